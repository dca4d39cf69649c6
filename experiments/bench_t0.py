"""Time the walks' gate-free inverse kernel (`fused_forward._t0_kernel`) at several launches.

The Mosaic walks of DeltaNet and GDN read one factor per chunk from HBM, the gate-free inverse
T0 = (I + diag(β) strict(k kᵀ))⁻¹, made by a Triton kernel beforehand (jax-linear-attention's
own takes ~49 µs at B4 T4096 H16 D128). Its first launch was the intra kernel's, which holds far
more live tiles; this program times it at others, `warps:BK:inverse` (warps, key columns a step
of the k kᵀ loop, `blocks.T0_INVERSES`):

    python3 -u -m experiments.bench_t0 --launches=4:16:batched,4:128:batched,8:128:tiles \\
        --out_json=/tmp/t0.json

Per launch: over `--rounds` interleaved rounds (the order rotated each round, so drift does not
favour one), each round's time per call of `--iters` calls queued and waited for once (the
GPU's time per call: one call waited for alone measured 200-400 µs on the H200 for this
~100 µs kernel, the host's dispatch), the median of the rounds and their range, and the
relative rms error of T0 against the float32 inverse (`ops.triangular.unit_lower_inverse`,
products at HIGHEST) of the same bf16 inputs: unit-norm keys (as the layers feed them) and β
in (0, 1). The HBM floor printed beside it is k and β read once and T0 written once at the
nominal bandwidth (`--hbm_tb_s`). On the H200 (2026-12-04): `blocks.t0_launch`'s docstring.
Off GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1; to check the program and
the errors, not to time).
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

_SHAPE = flags.DEFINE_string("shape", "4,4096,16,128", "B,T,H,K (HV = H).")
_LAUNCHES = flags.DEFINE_list(
    "launches", "4:16:batched,4:64:batched,4:128:batched,8:128:batched,2:128:batched,"
    "4:128:tiles,8:128:tiles,8:64:tiles",
    "warps:BK:inverse launches to time (the library's, blocks.t0_launch, is added first).")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved rounds.")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed calls per launch and round.")
_HBM = flags.DEFINE_float("hbm_tb_s", 4.8, "HBM bandwidth for the floor, TB/s (H200: 4.8).")
_OUT_JSON = flags.DEFINE_string("out_json", "", "Write the rows here as JSON.")


def parse_launch(text: str, dk: int) -> tuple[int, int, str]:
  """"4:128:tiles" -> (4, 128, "tiles"), checked (`blocks.check_t0_launch`)."""
  from pallas_kernels.gpu.triton import blocks  # pylint: disable=g-import-not-at-top
  parts = text.split(":")
  if len(parts) != 3 or not (parts[0].isdigit() and parts[1].isdigit()):
    raise app.UsageError(f"--launches: {text!r} is not warps:BK:inverse")
  return blocks.check_t0_launch((int(parts[0]), int(parts[1]), parts[2]), dk)


def inputs(b: int, t: int, h: int, dk: int, seed: int = 0):
  """(k `[B, T, H, K]` bf16 with unit-norm rows, β `[B, H, T]` float32 in (0, 1))."""
  kk, kb = jax.random.split(jax.random.key(seed))
  k = jax.random.normal(kk, (b, t, h, dk), jnp.float32)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  beta = jax.nn.sigmoid(jax.random.normal(kb, (b, h, t), jnp.float32))
  return k.astype(jnp.bfloat16), beta


def exact_inverse(k, beta, c: int = 64):
  """The float32 T0 `[B, H, Nc, C, C]` of the bf16 keys (the oracle)."""
  from lineax_attn.ops import triangular  # pylint: disable=g-import-not-at-top
  b, t, h, dk = k.shape
  kc = jnp.moveaxis(k.astype(jnp.float32).reshape(b, t // c, c, h, dk), 3, 1)  # [B,H,Nc,C,K]
  kk = jnp.einsum("bhnik,bhnjk->bhnij", kc, kc, precision=jax.lax.Precision.HIGHEST)
  lower = jnp.tril(kk * beta.reshape(b, h, t // c, c)[..., :, None], -1)
  return triangular.unit_lower_inverse(lower)


def rel_rms(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.sqrt(np.mean((x - ref) ** 2) / np.mean(ref ** 2)))


def main(argv):
  del argv
  from pallas_kernels.gpu.triton import blocks  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gpu.triton import fused_forward as ff  # pylint: disable=g-import-not-at-top
  b, t, h, dk = (int(x) for x in _SHAPE.value.split(","))
  if t % blocks.CHUNK:
    raise app.UsageError(f"--shape: T={t} is not a multiple of {blocks.CHUNK}")
  launches = [blocks.check_t0_launch(blocks.T0_LAUNCH or blocks.t0_launch(dk), dk)]
  launches += [x for x in (parse_launch(s, dk) for s in _LAUNCHES.value) if x not in launches]
  k, beta = inputs(b, t, h, dk)
  ref = exact_inverse(k, beta)
  nc, c = t // blocks.CHUNK, blocks.CHUNK
  floor_us = (k.size * 2 + beta.size * 4 + b * h * nc * c * c * 2) / (_HBM.value * 1e12) * 1e6
  print(f"T0 kernel at B{b} T{t} H{h} K{dk}, {jax.devices()[0].device_kind}; HBM floor "
        f"{floor_us:.1f} µs at {_HBM.value} TB/s", flush=True)
  steps, errors = {}, {}
  for launch in launches:
    fn = jax.jit(lambda k_, b_, launch=launch: ff.gate_free_inverse(k_, b_, hv=h, launch=launch))
    out = jax.block_until_ready(fn(k, beta))            # compiles
    errors[launch] = rel_rms(out.astype(jnp.float32), ref)
    steps[launch] = bench.Step(lambda fn=fn: fn(k, beta), jax.block_until_ready)
  # Queued, then one wait: the GPU's time per call, not the host's dispatch (a call waited for
  # alone measured 200-400 µs on the H200 for this ~100 µs kernel).
  medians = {launch: [ms * 1e3 for ms in times] for launch, times in bench.interleave(
      steps, _ROUNDS.value, _ITERS.value, warmup=1, timing="queued").items()}
  base = float(np.median(medians[launches[0]]))
  rows = []
  print(f"{'launch (warps:BK:inverse)':<28} {'µs':>8} {'range':>17} {'/ default':>10} "
        f"{'/ floor':>8} {'T0 rel rms':>11}")
  for launch in launches:
    med = float(np.median(medians[launch]))
    name = ":".join(map(str, launch)) + (" (default)" if launch == launches[0] else "")
    rows.append(dict(launch=list(launch), default=launch == launches[0], us=med,
                     rounds_us=medians[launch], error=errors[launch]))
    print(f"{name:<28} {med:8.1f} {min(medians[launch]):8.1f}-{max(medians[launch]):<8.1f} "
          f"{med / base:10.3f} {med / floor_us:8.2f} {errors[launch]:11.2e}", flush=True)
  if _OUT_JSON.value:
    with open(_OUT_JSON.value, "w") as f:
      json.dump(dict(shape=[b, t, h, dk], device=jax.devices()[0].device_kind,
                     jax=jax.__version__, floor_us=floor_us, rounds=_ROUNDS.value,
                     iters=_ITERS.value, rows=rows), f, indent=1)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
