"""Time the delta rule's walks alone, per chunk step: the forward walk (`chunk_walk`), the
reverse walk (`chunk_walk_reverse`, whole and states-only) and the maps' walk of rows cut into
pieces (`maps_walk`, one or two chains per CTA).

Every walk is a latency-bound chain of products from chunk to chunk, one chain per 64 state
columns. How long one chunk step takes decides what rows cut into pieces can buy (issue #17's
flat T sweep; docs/KERNELS_GPU.md, "Long rows in pieces"), and the auto rule
(`gpu_pieces.auto_row_pieces`) guesses two things this program measures:

* a maps' step is as long as a main walk's step (`gpu_pieces.MAPS_STEP_COST` = 1);
* a CTA carrying two chains (`maps_walk(chains=2)`) steps as fast as a CTA carrying one, so two
  chains per SM take half the waves.

    python3 -u -m experiments.bench_walks --shape=1,65536,16,128 --pieces=1,4,8

prints one row per walk, `--overlap` value and piece count: its CTAs, the waves they make on
this GPU's SMs (one CTA per SM), the chunks each walks, the median time per call (`--iters`
calls queued and waited for once, over `--rounds`), and that time per step, call / (waves ·
chunks). Rows of P pieces are P rows of T/P tokens (the kernels' inputs as `gpu_walks` lays
them out). Inputs are random: the walks' work does not depend on their values. Off GPU the
kernels run in JAX's Mosaic GPU interpreter, to check this program, not to time it.
"""

from __future__ import annotations

import json

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import cli
from lineax_attn import bench
from lineax_attn.ops import gpu_pieces

KERNELS = ("walk", "reverse", "reverse_states", "maps1", "maps2")

_SHAPE = flags.DEFINE_string("shape", "1,65536,16,128", "B,T,H,D (K = V = D, HV = H).")
_PIECES = flags.DEFINE_list("pieces", "1,4", "Pieces per row (each a row of the table).")
_KERNELS = flags.DEFINE_list("kernels", ",".join(KERNELS),
                             f"Walks to time, of {', '.join(KERNELS)} (the maps' walks only in "
                             "pieces: with one piece there is no map to make).")
_GATED = flags.DEFINE_bool("gated", True, "GDN's gated walks (false: DeltaNet's).")
_ITERS = flags.DEFINE_integer("iters", 10, "Calls per round, queued and waited for once.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Timed rounds per walk; the median is reported.")
_OVERLAP = flags.DEFINE_list("overlap", "false", "`overlap` values of the forward and reverse "
                             "walks (`GpuTuning.walk_overlap`), e.g. false,true: one row each, "
                             "their rounds alternating (the maps' walk has no such option). The "
                             "forward walk also takes its parts, '+'-joined (`chunk_walk."
                             "OVERLAP_PARTS`, e.g. publish+ahead); the reverse walks read those "
                             "as true.")
_MADE_M = flags.DEFINE_bool("made_m", False, "Also time the forward walk reading M̃ made ahead "
                             "(`chunk_walk(made_m=True)`: no M̃ made by its output warpgroup, no "
                             "wait for it in the chain), as one more row, overlap 'made_m'.")
_APPROX = flags.DEFINE_bool("approx_math", False, "Every walk (forward, reverse, maps') with "
                             "e^x as ex2.approx (their `approx_math`), every row.")
_OUT_JSON = flags.DEFINE_string("out_json", "", "The rows, with every round's time, as JSON.")


def _inputs(b, t, h, d, seed=0):
  """The walks' inputs for rows of T tokens (q, k, v, dO, dE `[B, T, H, D]` bf16; T0; gates and
  β `[B, H, T]`; states transposed `[B, H, D, D]`), small enough that no state overflows."""
  c = 64
  keys = iter(jax.random.split(jax.random.key(seed), 10))
  bf = jnp.bfloat16
  normal = lambda shape, scale=0.1, dtype=bf: (scale * jax.random.normal(next(keys), shape)
                                               ).astype(dtype)
  g = jnp.cumsum(-0.01 * jnp.abs(normal((b, h, t // c, c), 1.0, jnp.float32)), -1)
  return dict(q=normal((b, t, h, d)), k=normal((b, t, h, d)), v=normal((b, t, h, d)),
              do=normal((b, t, h, d)), de=normal((b, t, h, d)),
              t0=(jnp.eye(c) + jnp.tril(normal((b, h, t // c, c, c), 0.01, jnp.float32), -1)
                  ).astype(bf),
              g=g.reshape(b, h, t), beta=jax.nn.sigmoid(normal((b, h, t), 1.0, jnp.float32)),
              s=normal((b, h, d, d), 0.1, jnp.float32))


def _walk_call(kernel, x, d, gated, interpret, overlap=False, approx_math=False):
  """(the jitted walk, its CTAs per row and head): one call of `kernel` on inputs x."""
  from pallas_kernels.gpu import chunk_walk  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gpu import chunk_walk_reverse  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gpu import maps_walk  # pylint: disable=g-import-not-at-top
  scale, blocks = d ** -0.5, d // 64
  if kernel == "walk":   # (overlap "made_m": the walk of M̃ made ahead, random as T0 is)
    made_m = overlap == "made_m"
    return jax.jit(lambda a: chunk_walk.chunk_walk(
        a["q"], a["k"], a["v"], a["t0"], a["g"], a["beta"], a["s"], scale=scale, gated=gated,
        overlap=False if made_m else overlap, made_m=made_m, approx_math=approx_math,
        interpret=interpret)), blocks
  if kernel in ("reverse", "reverse_states"):
    return jax.jit(lambda a: chunk_walk_reverse.chunk_walk_reverse(
        a["q"], a["k"], a["t0"], a["g"], a["beta"], a["do"], a["de"], a["s"], scale=scale,
        gated=gated, states_only=kernel == "reverse_states", overlap=overlap,
        approx_math=approx_math, interpret=interpret)), blocks
  chains = int(kernel[-1])
  wide = lambda s: jnp.concatenate([jnp.broadcast_to(jnp.eye(d, dtype=s.dtype), s.shape), s], 2)
  return jax.jit(lambda a: maps_walk.maps_walk(
      a["k"], a["v"], a["t0"], a["g"], a["beta"], wide(a["s"]), gated=gated, chains=chains,
      approx_math=approx_math, interpret=interpret)), -(-2 * blocks // chains)


def main(argv):
  del argv
  b, t, h, d = (int(x) for x in _SHAPE.value.split(","))
  kernels = _KERNELS.value
  if not kernels or not set(kernels) <= set(KERNELS):
    raise app.UsageError(f"--kernels takes some of {', '.join(KERNELS)}, got {kernels}")
  try:
    pieces = [int(p) for p in _PIECES.value]
  except ValueError:
    pieces = [0]
  if not pieces or min(pieces) < 1 or any(t % (64 * p) for p in pieces):
    raise app.UsageError(f"--pieces takes counts that cut T={t} into multiples of 64, "
                         f"got {_PIECES.value}")
  from pallas_kernels.gpu import chunk_walk  # pylint: disable=g-import-not-at-top
  words = [w.lower() for w in _OVERLAP.value]
  try:
    overlaps = list(dict.fromkeys({"false": False, "true": True}.get(w, w) for w in words))
    for w in overlaps:
      chunk_walk.overlap_parts(w)
  except ValueError:
    overlaps = []
  if not overlaps:
    raise app.UsageError(f"--overlap takes false, true or the forward's parts "
                         f"({'+'.join(chunk_walk.OVERLAP_PARTS)}), got {_OVERLAP.value}")
  if d not in (64, 128):
    raise app.UsageError(f"--shape: the walks take D = 64 or 128, got {d}")
  interpret = None
  if jax.default_backend() != "gpu":
    from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
    interpret = plgpu.InterpretGPUParams()
  sms = gpu_pieces.device_sms()
  print(f"walks at B{b} T{t} H{h} D{d} ({'gated' if _GATED.value else 'ungated'}), "
        f"{jax.devices()[0].device_kind}, {sms} SMs", flush=True)
  rows = []
  print("| walk | overlap | pieces | CTAs | waves | chunks a CTA | µs a call | µs a step |")
  print("|---|---|---|---|---|---|---|---|")
  for p in pieces:
    # P pieces = P rows of T/P tokens (the pieces' layout; T0 and the rows likewise).
    x = _inputs(b * p, t // p, h, d)
    for kernel in kernels:
      if kernel.startswith("maps") and p == 1:
        continue
      if kernel.startswith("maps"):
        variants = [False]
      elif kernel == "walk":
        variants = overlaps + (["made_m"] if _MADE_M.value else [])
      else:   # the reverse walks' overlap is one switch
        variants = list(dict.fromkeys(w is not False for w in overlaps))
      steps = {}
      for overlap in variants:
        fn, ctas_per_head = _walk_call(kernel, x, d, _GATED.value, interpret, overlap,
                                       _APPROX.value)
        jax.block_until_ready(fn(x))
        steps[overlap] = bench.Step(lambda fn=fn: fn(x), jax.block_until_ready)
      times = {overlap: [] for overlap in variants}
      for _ in range(_ROUNDS.value):   # alternating, so drift falls on both alike
        for overlap in variants:
          times[overlap].append(bench.time_round(steps[overlap], _ITERS.value, 0, "queued"))
      ctas = b * p * h * ctas_per_head
      waves = -(-ctas // sms)
      chunks = t // p // 64
      for overlap in variants:
        call_us = float(np.median(times[overlap])) * 1e3
        shown = "–" if kernel.startswith("maps") else str(overlap).lower()
        print(f"| {kernel} | {shown} | {p} | {ctas} | {waves} | {chunks} | {call_us:.0f} | "
              f"{call_us / (waves * chunks):.2f} |", flush=True)
        rows.append(dict(walk=kernel, overlap=shown, pieces=p, ctas=ctas, waves=waves,
                         chunks=chunks, us_call=call_us, us_step=call_us / (waves * chunks),
                         rounds_ms=[float(x) for x in times[overlap]]))
  if _OUT_JSON.value:
    with open(_OUT_JSON.value, "w") as f:
      json.dump(dict(shape=[b, t, h, d], gated=_GATED.value, approx_math=_APPROX.value,
                     device=jax.devices()[0].device_kind,
                     rounds=_ROUNDS.value, iters=_ITERS.value, rows=rows), f, indent=1)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
