"""The Mosaic GPU kernels of the delta rule's walks as MLIR, lowered for CUDA on any machine (no
GPU): to check that a change leaves a kernel as it was, or to see what an option changes.

Each walk is lowered at B2 T256 H2 HV4 V128 and each head dim asked for: the forward walk
(`chunk_walk`: gated, ungated, saving states, linear attention), the reverse walk
(`chunk_walk_reverse`: gated, ungated, states only, linear attention) and the maps' walk of rows
in pieces (`maps_walk`: one and two chains). Its kernel module is printed without locations, so
two trees give the same text when the kernels are the same:

    python -m experiments.walk_mlir --out=/tmp/new.mlir
    (cd OTHER_TREE && python -m experiments.walk_mlir --out=/tmp/old.mlir)
    cmp /tmp/new.mlir /tmp/old.mlir

Prints a markdown table, a row per kernel: its wgmma ops, its lines and the first 12 hex
digits of the SHA-256 of its text (the same digits: the same kernel). `--overlap` lowers the
forward and reverse walks with `GpuTuning.walk_overlap`'s option. The text comes from
Mosaic GPU's lowering (`jax.experimental.mosaic.gpu.core._lower_as_gpu_kernel`, a private
function of jax 0.11.2, wrapped while this program runs).
"""

from __future__ import annotations

import hashlib

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from experiments import cli

_HEAD_DIMS = flags.DEFINE_list("head_dims", "64,128", "Key head dims K to lower at (64, 128).")
_OVERLAP = flags.DEFINE_bool("overlap", False, "Lower the forward and reverse walks with "
                             "`overlap=True` (`GpuTuning.walk_overlap`).")
_OUT = flags.DEFINE_string("out", "", "Write every kernel's MLIR here, one after another.")


def _kernels(dk: int, overlap: bool):
  """(name, function, argument shapes) of every walk at head dim dk."""
  from pallas_kernels.gpu import chunk_walk  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gpu import chunk_walk_reverse  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gpu import maps_walk  # pylint: disable=g-import-not-at-top
  b, t, h, hv, dv = 2, 256, 2, 4, 128
  sds = jax.ShapeDtypeStruct
  bf, f32 = jnp.bfloat16, jnp.float32
  q = k = sds((b, t, h, dk), bf)
  v = do = sds((b, t, hv, dv), bf)
  t0 = sds((b, hv, t // 64, 64, 64), bf)
  rows = sds((b, hv, t), f32)
  s = sds((b, hv, dv, dk), f32)
  # Off, no overlap argument is passed, so the same command also lowers trees older than it.
  forward_more = {"overlap": chunk_walk.overlap_parts(True)} if overlap else {}
  reverse_more = {"overlap": True} if overlap else {}
  out = []
  for name, gated, save, delta in (("gated", True, False, True), ("ungated", False, False, True),
                                   ("saving states", True, True, True),
                                   ("linear attention", False, True, False)):
    fn = lambda q, k, v, t0, g, beta, s, gated=gated, save=save: chunk_walk._chunk_walk(
        q, k, v, t0, g, beta, s, scale=0.1, gated=gated, save_states=save, interpret=None,
        **forward_more)
    out.append((f"forward, {name}", fn, (q, k, v, t0 if delta else None, rows, rows, s)))
  for name, gated, alone, delta in (("gated", True, False, True), ("ungated", False, False, True),
                                    ("states only", True, True, True),
                                    ("linear attention", False, False, False)):
    fn = lambda q, k, t0, g, beta, do, dx, s, gated=gated, alone=alone: (
        chunk_walk_reverse._chunk_walk_reverse(
            q, k, t0, g, beta, do, dx, s, scale=0.1, gated=gated, states_only=alone,
            interpret=None, **reverse_more))
    out.append((f"reverse, {name}", fn, (q, k, t0 if delta else None, rows, rows, do, do, s)))
  wide = sds((b, hv, dk + dv, dk), f32)
  for chains in (1, 2):
    fn = lambda k, v, t0, g, beta, s, chains=chains: maps_walk._maps_walk(
        k, v, t0, g, beta, s, gated=True, chains=chains, interpret=None)
    out.append((f"maps, {chains} chain{'s' if chains > 1 else ''}", fn,
                (k, v, t0, rows, rows, wide)))
  return out


def lower(fn, args) -> list[str]:
  """The MLIR of every Mosaic GPU kernel that lowering `fn` for CUDA makes, without locations."""
  from jax.experimental.mosaic.gpu import core  # pylint: disable=g-import-not-at-top
  texts, real = [], core._lower_as_gpu_kernel  # pylint: disable=protected-access

  def keep(*a, **kw):
    result = real(*a, **kw)
    texts.append(result[0].operation.get_asm(enable_debug_info=False))
    return result

  core._lower_as_gpu_kernel = keep  # pylint: disable=protected-access
  try:   # a fresh function: a cached trace would not lower again (None operands: no leaves)
    jax.jit(lambda *a: fn(*a)).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    core._lower_as_gpu_kernel = real  # pylint: disable=protected-access
  return texts


def main(argv):
  del argv
  try:
    dims = [int(d) for d in _HEAD_DIMS.value]
  except ValueError:
    dims = [0]
  if not dims or not set(dims) <= {64, 128}:
    raise app.UsageError(f"--head_dims takes 64 and / or 128, got {_HEAD_DIMS.value}")
  print(f"walk kernels lowered for CUDA, overlap={str(_OVERLAP.value).lower()}")
  print("| kernel | K | wgmma | lines | sha256 |")
  print("|---|---|---|---|---|")
  chunks = []
  for dk in dims:
    for name, fn, args in _kernels(dk, _OVERLAP.value):
      (text,) = lower(fn, args)
      digest = hashlib.sha256(text.encode()).hexdigest()[:12]
      print(f"| {name} | {dk} | {text.count('mosaic_gpu.wgmma')} | {text.count(chr(10))} | "
            f"{digest} |", flush=True)
      chunks.append(f"// {name}, K {dk}\n{text}")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write("\n//----\n".join(chunks))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
