"""Time the walk path's per-chunk backward kernel (`pallas_kernels.gpu.chunk_grads`) alone,
gated (GDN) and ungated (DeltaNet), and optionally break one call into its named phases with
Mosaic GPU's in-kernel profiler.

On the H200 (2026-12-04) the gated kernel took 573 µs and the ungated one 386 µs inside the
op (docs/BENCHMARKS.md "fourteenth stage"); this program isolates that difference:

    JAX_PLATFORMS=cuda,cpu python3 -u -m experiments.bench_chunk_grads --profile_dir=/tmp/cg_prof \\
        --approx_math=false,true --join_exit=false,true
    # the two-warpgroup kernel (chunk_grads(warpgroups=2)) beside the one-warpgroup kernel
    python3 -u -m experiments.bench_chunk_grads --approx_math=true --join_exit=true --warpgroups=1,2

prints, per variant, the median over rounds of the time per call of `--iters` calls queued and
waited for once (after a warm-up; waiting for each call alone timed the host's dispatch) and,
with --profile_dir, the mean time per CTA of each phase (`experiments.kernel_trace`). Inputs
are random with the op's shapes (q, k, v, E, dO `[B, T, H, D]` bf16; T0, the states and the
cotangents in the walks' layouts); the kernel's work does not depend on their values. Off GPU
the kernel runs in JAX's Mosaic GPU interpreter (to check this program, not to time it) and
--profile_dir is refused.
"""

from __future__ import annotations

import glob
import json
import os

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import cli
from experiments import kernel_trace
from lineax_attn import bench

_SHAPE = flags.DEFINE_string("shape", "4,4096,16,128", "B,T,H,D (K = V = D, HV = H).")
_ITERS = flags.DEFINE_integer("iters", 30, "Calls per round, queued and waited for once.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed rounds per variant; the median is reported.")
_APPROX = flags.DEFINE_list("approx_math", "false", "Variants of the kernel's approx_math "
                            "(e.g. false,true: an A/B of ex2.approx for e^x).")
_JOIN = flags.DEFINE_list("join_exit", "false", "Variants of the gated kernel's join_exit "
                          "(false,true: an A/B of the exit product in dk's wgmma group).")
_WGS = flags.DEFINE_list("warpgroups", "1", "Variants of the kernel's warpgroups (1,2: an A/B "
                         "of the two-warpgroup kernel, which implies join_exit).")
_PROFILE_DIR = flags.DEFINE_string("profile_dir", "", "If set, one profiled call per variant "
                                   "writes its trace here and its phases are printed.")


def _inputs(b, t, h, d):
  from pallas_kernels.gpu import chunk_grads as cg  # pylint: disable=g-import-not-at-top
  nc, c = t // cg.CHUNK, cg.CHUNK
  keys = iter(jax.random.split(jax.random.key(0), 12))
  bf = jnp.bfloat16
  normal = lambda shape, dtype=bf: (0.3 * jax.random.normal(next(keys), shape)).astype(dtype)
  act = lambda: normal((b, t, h, d))
  return dict(q=act(), k=act(), v=act(), e=act(), do=act(),
              t0=jnp.tril(normal((b, h, nc, c, c))),
              g=-jnp.abs(normal((b, h, t), jnp.float32)),
              beta=jax.nn.sigmoid(normal((b, h, t), jnp.float32)),
              h_t=normal((b, h, nc, d, d)), dh_t=normal((b, h, nc, d, d)),
              de_t=normal((b, h, nc, d, c)))


def main(argv):
  del argv
  from pallas_kernels.gpu import chunk_grads as cg  # pylint: disable=g-import-not-at-top
  b, t, h, d = (int(x) for x in _SHAPE.value.split(","))
  x = _inputs(b, t, h, d)
  interpret = None
  if jax.default_backend() != "gpu":
    if _PROFILE_DIR.value:
      raise app.UsageError("--profile_dir needs a GPU (the in-kernel profiler is compiled in)")
    from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
    interpret = plgpu.InterpretGPUParams()
  if _PROFILE_DIR.value:
    try:  # the profiler hands its trace to the host through a CPU callback
      jax.devices("cpu")
    except RuntimeError as err:
      raise app.UsageError("--profile_dir needs the CPU platform beside the GPU "
                           "(JAX_PLATFORMS=cuda,cpu)") from err
  print(f"chunk_grads at B{b} T{t} H{h} D{d}, {jax.devices()[0].device_kind}", flush=True)
  for flag in (_APPROX, _JOIN):
    if not set(flag.value) <= {"false", "true"}:
      raise app.UsageError(f"--{flag.name} takes false and/or true, got {flag.value}")
  if not set(_WGS.value) <= {"1", "2"}:
    raise app.UsageError(f"--warpgroups takes 1 and/or 2, got {_WGS.value}")
  # join_exit only changes the gated one-warpgroup kernel: the ungated one runs once per
  # approx_math, the two-warpgroup kernel once per approx_math and gating.
  variants = [(gated, approx == "true", join == "true", 1) for approx in _APPROX.value
              for gated in (True, False) for join in (_JOIN.value if gated else ["false"])
              if "1" in _WGS.value]
  variants += [(gated, approx == "true", True, 2) for approx in _APPROX.value
               for gated in (True, False) if "2" in _WGS.value]
  for gated, approx, join, wgs in variants:
    name = (("gated (GDN)" if gated else "ungated (DeltaNet)") + (", approx_math" if approx else "")
            + (", join_exit" if join else "") + (", 2 warpgroups" if wgs == 2 else ""))
    fn = jax.jit(lambda a, gated=gated, approx=approx, join=join, wgs=wgs: cg.chunk_grads(
        **a, scale=d ** -0.5, gated=gated, approx_math=approx, join_exit=join, warpgroups=wgs,
        interpret=interpret))
    jax.block_until_ready(fn(x))
    # Calls queued, then one wait: the GPU's time per call. (Waiting for each call measured
    # ~0.9 ms here, the host's dispatch, against the profile's ~0.5 ms of kernel.)
    step = bench.Step(lambda fn=fn: fn(x), jax.block_until_ready)
    rounds = [bench.time_round(step, _ITERS.value, 0, "queued") / 1e3
              for _ in range(_ROUNDS.value)]
    print(f"{name}: median {np.median(rounds) * 1e6:.0f} µs a call, min {np.min(rounds) * 1e6:.0f}"
          f" µs, over {_ROUNDS.value} rounds of {_ITERS.value} queued calls", flush=True)
    if _PROFILE_DIR.value:
      out = os.path.join(_PROFILE_DIR.value, ("gated" if gated else "ungated")
                         + ("_approx" if approx else "") + ("_join" if join else "")
                         + ("_wg2" if wgs == 2 else ""))
      os.makedirs(out, exist_ok=True)
      prof = jax.jit(lambda a, gated=gated, approx=approx, join=join, wgs=wgs, out=out:
                     cg.chunk_grads(**a, scale=d ** -0.5, gated=gated, approx_math=approx,
                                    join_exit=join, warpgroups=wgs, profile_dir=out))
      jax.block_until_ready(prof(x))
      traces = sorted(glob.glob(os.path.join(out, "*.json")), key=os.path.getmtime)
      if not traces:
        raise RuntimeError(f"the profiled call wrote no trace into {out}")
      with open(traces[-1]) as f:
        rows, span = kernel_trace.summarize(json.load(f))
      print(kernel_trace.to_markdown(rows, span, title=f"{name}: "), flush=True)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
