"""Interleaved A/B timing of a few implementations of one op, for a GPU that is noisy.

    python3 -m experiments.bench_ab --mixers=delta_rule --variants=triton,triton:tiles,fla \\
        --rounds=9 --out_json=/tmp/ab.json --out_md=/tmp/ab.md

`bench_kernels` times each implementation once, one after another; on a shared machine whose
speed drifts by 20-40 % over minutes (docs/BENCHMARKS.md, "eighth stage") that cannot settle a
5 % question. Here every variant is compiled first, then timed in `--rounds` rounds; in each
round every variant runs `--iters` calls (after `--warmup`), in an order rotated from round to
round so none always runs first (`--timing=waited`: each call timed alone and waited for;
`queued`: a round's calls launched back to back and waited for once, the device's time a call
without the host's dispatch in it). Reported per variant: the median of its round medians and
their range; per pair (each variant against `--baseline`): the ratio of the two medians *of
the same round*, whose median and range say whether a difference outlives the drift.

Variants: `pallas_gpu`, `triton`, `chunk` (ours), `triton:batched` / `triton:tiles` (ours with
the delta-rule intra forward's inverse forced: `blocks.INTRA_INVERSES`), ours with a
`GpuTuning` after `@` (`GpuTuning.parse`'s fields, `;`-separated, e.g.
`pallas_gpu@state_pass=triton`), ours with the fused walks' kernel knobs after `#`
(`;`-separated: `scores=walk|stored`, `blocks.FUSED_SCORES`; `launch=BLOCK_V:warps:stages`,
`blocks.FUSED_WALK_LAUNCH`; e.g. `triton@forward=fused#scores=stored;launch=16:4:2`; and, on the walks too, `t0=warps:BK:inverse`,
`blocks.T0_LAUNCH`, the gate-free inverse's launch: `pallas_gpu#t0=8:64:tiles`), ours
with every row cut into P pieces after `/` (`lineax_attn.parallel.pieces.row_split`, for small B·H:
`pallas_gpu/8` at `--shape=1,65536,16,128`), ours with the Triton kernels' custom call forced
after `+`
(`triton+ffi`: XLA's typed-FFI Triton target, which command buffers take; `+legacy`:
jax-triton's own; `pallas_kernels.gpu.triton.ffi_call`), `jla`, `fla`. The
inverse is a keyword of the kernel wrapper, not of `GpuTuning`; the variant swaps the module's
`intra_chunk_fwd` for one with that keyword while it is traced, and clears JAX's caches before
each trace so no variant reuses another's program.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from typing import NamedTuple

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave memory for torch

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments import cli  # noqa: E402
from experiments import peer_ops  # noqa: E402
from lineax_attn import ops  # noqa: E402
# The interleaved timing itself (rounds, rotation, waited / queued) is `lineax_attn.bench`'s.
from lineax_attn.bench import TIMINGS, Step, interleave, time_round  # noqa: E402,F401

# The program's own flag set (not absl's global one): its functions are tested in the same
# process as other programs that define the same names (--modes, --iters, ...).
FLAGS = flags.FlagValues()
_F = {"flag_values": FLAGS}
_MIXERS = flags.DEFINE_list("mixers", "delta_rule,gated_delta_rule", "Ops to time.", **_F)
_VARIANTS = flags.DEFINE_list("variants", "triton,triton:tiles,fla",
                              "impl or impl:inverse (see the module docstring).", **_F)
_BASELINE = flags.DEFINE_string("baseline", "fla", "The variant every ratio is against.", **_F)
_SHAPE = flags.DEFINE_string("shape", "4,4096,16,128", "B,T,H,D.", **_F)
_MODES = flags.DEFINE_list("modes", "fwd,fwdbwd", "Of fwd, fwdbwd (loss and gradients), "
                           "fwdbwd_dep (the cotangent depending on the output, as in training), "
                           "fwdbwd_grads (the gradients alone): `peer_ops.MODES`.", **_F)
_ROUNDS = flags.DEFINE_integer("rounds", 9, "Rounds; every variant is timed once per round.",
                               **_F)
_ITERS = flags.DEFINE_integer("iters", 20, "Timed calls per variant and round.", **_F)
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed calls per variant and round.", **_F)
_SETTLE_S = flags.DEFINE_float("settle_s", 1.0, "Seconds of untimed rounds (as --timing "
                               "times them) of every variant before each mixer and mode's first "
                               "round (`bench.settle`: an idle GPU's clocks rise, a first burst "
                               "of queued calls is slow; 0 = one round each).", **_F)
_OUT_JSON = flags.DEFINE_string("out_json", "", "Raw per-round medians as JSON.", **_F)
_TIMING = flags.DEFINE_enum(
    "timing", "waited", TIMINGS, "waited: each call timed alone and waited for (host dispatch "
    "included; every stage until 2026-12-04); queued: a round's calls launched back to back, "
    "waited for once (the device's time a call, as a training step sees it).", **_F)
_OUT_MD = flags.DEFINE_string("out_md", "", "The Markdown tables.", **_F)


@contextlib.contextmanager
def forced_inverse(inverse: str | None):
  """While active, the Triton delta-rule intra forward builds its inverse as `inverse`."""
  if inverse is None:
    yield
    return
  from pallas_kernels.gpu.triton import blocks, intra_chunk  # pylint: disable=g-import-not-at-top
  if inverse not in blocks.INTRA_INVERSES:
    raise ValueError(f"--variants: inverse {inverse!r} is not one of {blocks.INTRA_INVERSES}")
  original = intra_chunk.intra_chunk_fwd
  intra_chunk.intra_chunk_fwd = functools.partial(original, inverse=inverse)
  try:
    yield
  finally:
    intra_chunk.intra_chunk_fwd = original


# The `#` knobs of a variant and the `blocks` constants they set.
_KNOB_ATTRS = {"scores": "FUSED_SCORES", "launch": "FUSED_WALK_LAUNCH", "t0": "T0_LAUNCH"}


@contextlib.contextmanager
def forced_blocks(values: dict):
  """While active, `blocks.<NAME> = value` for each item: the custom call the Triton kernels
  lower to (CALL_TARGET) and the fused walks' knobs, all read at trace time, so a step
  compiled inside keeps them."""
  if not values:
    yield
    return
  from pallas_kernels.gpu.triton import blocks  # pylint: disable=g-import-not-at-top
  original = {name: getattr(blocks, name) for name in values}
  for name, value in values.items():
    setattr(blocks, name, value)
  try:
    yield
  finally:
    for name, value in original.items():
      setattr(blocks, name, value)


def parse_fused_knobs(text: str) -> dict:
  """"scores=stored;launch=16:4:2;t0=8:64:tiles" -> {"scores": "stored", "launch": (16, 4, 2),
  "t0": (8, 64, "tiles")}."""
  from pallas_kernels.gpu.triton import blocks  # pylint: disable=g-import-not-at-top
  knobs = {}
  for item in filter(None, text.split(";")):
    key, _, value = item.partition("=")
    if key == "scores" and value in blocks.FUSED_SCORES_CHOICES:
      knobs["scores"] = value
    elif key == "launch" and len(value.split(":")) == 3 and value.replace(":", "").isdigit():
      knobs["launch"] = tuple(int(x) for x in value.split(":"))
    elif key == "t0" and len(value.split(":")) == 3:
      warps, bk, inverse = value.split(":")
      if not (warps.isdigit() and bk.isdigit()):
        raise ValueError(f"--variants: T0 knob {item!r} is not t0=warps:BK:inverse")
      # (BK against K is checked when the kernel is traced; here only the form)
      knobs["t0"] = blocks.check_t0_launch((int(warps), int(bk), inverse), int(bk))
    else:
      raise ValueError(f"--variants: fused knob {item!r} is not scores="
                       f"{'|'.join(blocks.FUSED_SCORES_CHOICES)}, launch=BLOCK_V:warps:stages "
                       "or t0=warps:BK:inverse")
  return knobs


def jax_step(fn, args):
  """A compiled fn as a `Step` of zero arguments."""
  jax.clear_caches()
  compiled = jax.jit(fn).lower(*args).compile()
  return Step(lambda: compiled(*args), jax.block_until_ready)


def ours_step(mixer, impl, inverse, mode, np_in, tuning=None, pieces=None):
  with forced_inverse(inverse):
    return jax_step(*peer_ops.jax_call(peer_ops.ours_op(mixer, impl, tuning, pieces), np_in,
                                       mode))


def jla_step(mixer, mode, np_in):
  return jax_step(*peer_ops.jax_call(peer_ops.jla_op(mixer, np_in[3]), np_in, mode))


def fla_step(mixer, mode, np_in):
  import torch  # pylint: disable=g-import-not-at-top
  q, k, v, gates = np_in
  need_grad = mode != "fwd"
  tq, tk, tv = (torch.tensor(x, device="cuda", dtype=torch.bfloat16, requires_grad=need_grad)
                for x in (q, k, v))
  tg = {n: torch.tensor(x, device="cuda", dtype=torch.float32, requires_grad=need_grad)
        for n, x in gates.items()}
  op = peer_ops.fla_op(mixer)
  if mode == "fwd":
    def call():
      with torch.no_grad():
        return op(tq, tk, tv, tg)
  else:
    do = torch.randn_like(tv)

    def call():
      for x in (tq, tk, tv, *tg.values()):
        x.grad = None
      o = op(tq, tk, tv, tg)
      o.backward(do + peer_ops.DEP_WEIGHT * o.detach() if mode == "fwdbwd_dep" else do)
  step = Step(call, lambda _: torch.cuda.synchronize())
  step.wait(step.call())  # FLA autotunes on its first call
  return step


class Variant(NamedTuple):
  impl: str
  inverse: str | None
  tuning: ops.GpuTuning | None
  call_target: str | None
  knobs: dict
  pieces: int | None


def parse_variant(variant: str) -> Variant:
  """"impl[:inverse][@field=value;...][#knob=value;...][/pieces][+call_target]" -> its parts,
  each None (knobs: empty) where not given. call_target: `blocks.CALL_TARGETS`, the custom call
  the Triton kernels lower to (e.g. `triton+ffi`); pieces: the row split's pieces per row."""
  text = variant
  variant, _, call_target = variant.partition("+")
  variant, _, pieces_text = variant.partition("/")
  if pieces_text and not (pieces_text.isdigit() and int(pieces_text) >= 1):
    raise ValueError(f"--variants: {text!r}: pieces {pieces_text!r} is not an int >= 1")
  variant, _, knob_text = variant.partition("#")
  head, _, tuning_text = variant.partition("@")
  impl, _, inverse = head.partition(":")
  ours = impl in ("pallas_gpu", "triton", "chunk")
  if (inverse or tuning_text or call_target or knob_text or pieces_text) and not ours:
    raise ValueError(f"--variants: {variant!r}: only our implementations take an inverse, "
                     "a tuning, fused knobs, pieces or a call target")
  tuning = ops.GpuTuning.parse(tuning_text.replace(";", ",")) if tuning_text else None
  if tuning is not None and impl == "chunk":
    raise ValueError(f"--variants: {variant!r}: chunk takes no GpuTuning")
  if call_target and call_target not in ("legacy", "ffi"):
    raise ValueError(f"--variants: call target {call_target!r} is not 'legacy' or 'ffi'")
  knobs = parse_fused_knobs(knob_text) if knob_text else {}
  if set(knobs) - {"t0"} and (tuning is None or tuning.forward != "fused"):
    raise ValueError(f"--variants: {variant!r}: fused knobs but t0 need @forward=fused")
  return Variant(impl, inverse or None, tuning, call_target or None, knobs,
                 int(pieces_text) if pieces_text else None)


def make_step(variant, mixer, mode, np_in):
  impl, inverse, tuning, call_target, knobs, pieces = parse_variant(variant)
  if impl in ("pallas_gpu", "triton", "chunk"):
    settings = {_KNOB_ATTRS[key]: value for key, value in knobs.items()}
    if call_target:
      settings["CALL_TARGET"] = call_target
    with forced_blocks(settings):
      return ours_step(mixer, impl, inverse, mode, np_in, tuning, pieces)
  if impl == "jla":
    return jla_step(mixer, mode, np_in)
  if impl == "fla":
    return fla_step(mixer, mode, np_in)
  raise ValueError(f"--variants: unknown implementation {impl!r}")


def summarise(medians: dict[str, list[float]], baseline: str) -> list[dict]:
  rows = []
  base = np.asarray(medians[baseline]) if baseline in medians else None
  for name, ms in medians.items():
    ms = np.asarray(ms)
    row = {"variant": name, "median_ms": float(np.median(ms)), "min_ms": float(ms.min()),
           "max_ms": float(ms.max())}
    if base is not None and name != baseline:
      ratio = ms / base
      row.update(ratio_median=float(np.median(ratio)), ratio_min=float(ratio.min()),
                 ratio_max=float(ratio.max()), rounds_faster=int(np.sum(ratio < 1.0)))
    rows.append(row)
  return rows


def to_markdown(tables, meta) -> str:
  lines = [f"Interleaved A/B (`experiments/bench_ab.py`), {meta['date']}, {meta['device']}, "
           f"shape B,T,H,D = {meta['shape']}, {meta['rounds']} rounds x {meta['iters']} calls "
           f"({meta.get('timing', 'waited')}); ratios against {meta['baseline']} within each "
           f"round.", ""]
  for (mixer, mode), rows in tables.items():
    lines += [f"**{mixer} {mode}**", "",
              f"| variant | median of round medians (ms) | range | / {meta['baseline']}, "
              f"median (range) | rounds faster |", "|---|---|---|---|---|"]
    for r in rows:
      ratio = (f"{r['ratio_median']:.3f}x ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})"
               if "ratio_median" in r else "")
      faster = f"{r['rounds_faster']}/{meta['rounds']}" if "rounds_faster" in r else ""
      lines.append(f"| {r['variant']} | {r['median_ms']:.3f} | {r['min_ms']:.3f}-"
                   f"{r['max_ms']:.3f} | {ratio} | {faster} |")
    lines.append("")
  return "\n".join(lines)


def main(argv):
  del argv
  if _ROUNDS.value < 1 or _ITERS.value < 1 or _WARMUP.value < 0 or _SETTLE_S.value < 0:
    raise ValueError("--rounds and --iters must be >= 1, --warmup and --settle_s >= 0")
  if set(_MODES.value) - set(peer_ops.MODES):
    raise ValueError(f"--modes: {_MODES.value} are not all of {peer_ops.MODES}")
  b, t, h, d = (int(x) for x in _SHAPE.value.split(","))
  meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
          "device": jax.devices()[0].device_kind, "jax": jax.__version__,
          "shape": [b, t, h, d], "rounds": _ROUNDS.value, "iters": _ITERS.value,
          "warmup": _WARMUP.value, "settle_s": _SETTLE_S.value, "baseline": _BASELINE.value,
          "variants": _VARIANTS.value, "timing": _TIMING.value}
  tables, raw = {}, []
  for mixer in _MIXERS.value:
    np_in = peer_ops.make_inputs(mixer, b, t, h, d)
    for mode in _MODES.value:
      t0 = time.time()
      steps = {v: make_step(v, mixer, mode, np_in) for v in _VARIANTS.value}
      print(f"[compiled] {mixer} {mode}: {time.time() - t0:.0f} s", flush=True)
      medians = interleave(steps, _ROUNDS.value, _ITERS.value, _WARMUP.value, _TIMING.value,
                           _SETTLE_S.value)
      rows = summarise(medians, _BASELINE.value)
      tables[(mixer, mode)] = rows
      raw.append({"mixer": mixer, "mode": mode, "round_medians_ms": medians, "rows": rows})
      for r in rows:
        print(f"[ab] {mixer} {mode} {r}", flush=True)
      del steps
      text = to_markdown(tables, meta)
      if _OUT_MD.value:
        with open(_OUT_MD.value, "w") as f:
          f.write(text)
      if _OUT_JSON.value:
        with open(_OUT_JSON.value, "w") as f:
          json.dump({"meta": meta, "results": raw}, f, indent=1)
  print(to_markdown(tables, meta), flush=True)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
