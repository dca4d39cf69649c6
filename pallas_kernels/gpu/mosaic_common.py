"""Mosaic GPU building blocks shared by the kernels of `pallas_kernels/gpu/`.

Shared-memory tiles that TMA and wgmma can both read, wgmma into scoped float32 accumulators,
row / column broadcasts and index grids of WGMMA tiles, and the wait for an interpreted
kernel's results. Kernel-specific helpers stay in their kernel
module. Imports nothing of lineax_attn.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def tile_transforms(cols: int, dtype) -> tuple:
  """Tiling + swizzle transforms that let TMA and wgmma read a [rows, cols] smem tile."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(cols * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def smem(shape, dtype):
  return plgpu.SMEM(shape, dtype, transforms=tile_transforms(shape[-1], dtype))


def rows(vec, shape):
  """A per-row vector (`Layout.WGMMA.reduce(1)`) broadcast over the columns of `shape`."""
  return lax.broadcast_in_dim(vec, shape, [0])


def cols(vec, shape):
  """A per-column vector (`Layout.WGMMA.reduce(0)`) broadcast over the rows of `shape`."""
  return lax.broadcast_in_dim(vec, shape, [1])


def iota(n: int, dim: int):
  """Row (dim 0) or column (dim 1) indices of an [n, n] tile in the WGMMA layout."""
  return plgpu.broadcasted_iota(jnp.int32, (n, n), dim, layout=plgpu.Layout.WGMMA)


def matmuls(*groups):
  """Runs wgmmas into fresh float32 accumulators and returns their values.

  groups: one `(rows, cols, [(a, b), ...])` per accumulator, summing a·b over its pairs. Scoped
  accumulators (zero-initialised) rather than `run_state` with `ACC.init`, because JAX's Mosaic
  GPU interpreter does not run `run_state`; the caller adds any initial term in registers.
  """
  def body(*accs):
    for acc, (_, _, pairs) in zip(accs, groups):
      for a, b in pairs:
        plgpu.wgmma(acc, a, b)
    return tuple(acc[...] for acc in accs)
  return pl.run_scoped(body, *(plgpu.ACC((r, c), jnp.float32) for r, c, _ in groups))


PROFILE_EVENTS = 32   # profiler ranges per CTA (the kernels have fewer than 16 named phases)


def compiler_params(profile_dir: str = "", approx_math: bool = False):
  """Mosaic GPU's compiler parameters, or None for the defaults. profile_dir: the in-kernel
  profiler, one trace per call with the kernel's `jax.named_scope` phases as ranges per CTA
  (off, the scopes cost nothing). approx_math: approximate transcendentals (e^x as ex2.approx)."""
  params = {}
  if approx_math:
    params["approx_math"] = True
  if profile_dir:
    params.update(profile_space=PROFILE_EVENTS, profile_dir=profile_dir)
  return plgpu.CompilerParams(**params) if params else None


def sync_if_interpreted(outs, interpret):
  """Waits for an interpreted kernel's results before returning them.

  The Mosaic GPU interpreter runs the kernel in io_callbacks that dispatch JAX ops from XLA's
  thread; if the caller meanwhile dispatches eager ops from the main thread, the two can
  deadlock (seen with jax 0.11.2 on CPU). Compiled kernels and traced values are left alone.
  """
  if interpret is None:
    return outs
  leaves = jax.tree.leaves(outs)
  if any(isinstance(x, jax.core.Tracer) for x in leaves):
    return outs
  return jax.block_until_ready(outs)
