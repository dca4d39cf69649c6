"""Chunk layout and segment masks of the `pallas_gpu` implementation (plain jnp, no kernels).

The kernels take chunk-major `[B, HV, Nc, C, ...]` arrays; `to_chunks` / `from_chunks` convert
from / to the op's `[B, T, HV, ...]`. Packed rows (docs/MATH.md §3.5) become per-chunk masks:
`segment_masks` for the XLA path and the chunk decay, `kernel_segments` for the intra-chunk
kernel's row inputs.
"""

from __future__ import annotations

import jax.numpy as jnp

_F32 = jnp.float32


def to_chunks(x, c):
  """[B, T, HV, ...] -> [B, HV, Nc, C, ...]."""
  if x is None:
    return None
  b, t, hv = x.shape[:3]
  x = x.reshape(b, t // c, c, hv, *x.shape[3:])
  return jnp.moveaxis(x, 3, 1)


def from_chunks(x):
  """[B, HV, Nc, C, D] -> [B, T, HV, D]."""
  b, hv, nc, c, d = x.shape
  return jnp.moveaxis(x, 1, 3).reshape(b, nc * c, hv, d)


def segment_masks(segidx, c):
  """segidx [B, T] -> same [B, 1, Nc, C, C], cont and keep [B, 1, Nc, C] (docs/MATH.md §3.5)."""
  b, t = segidx.shape
  sc = segidx.reshape(b, 1, t // c, c)
  prev = jnp.concatenate([segidx[:, :1], segidx[:, c - 1:-1:c]], axis=1)   # [B, Nc]
  entry = prev[:, None, :, None]
  same = sc[..., :, None] == sc[..., None, :]
  cont = (sc == entry).astype(_F32)
  keep = (sc == sc[..., -1:]).astype(_F32)
  return same, cont, keep


def kernel_segments(segidx, c):
  """segidx [B, T] -> the kernel's (seg, cont, keep), each [B, T] float32.

  The kernel compares segment ids only within a chunk, so seg is segidx minus the id of the
  chunk's first row: in [0, C), exact in float32 (segidx, a running count up to T, is not once
  it passes 2^24)."""
  b, t = segidx.shape
  _, cont, keep = segment_masks(segidx, c)
  chunks = segidx.reshape(b, t // c, c)
  seg = (chunks - chunks[:, :, :1]).astype(_F32).reshape(b, t)
  return seg, cont.reshape(b, t), keep.reshape(b, t)
