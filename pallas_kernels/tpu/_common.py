"""Shared argument handling of the per-mixer entry points."""

from __future__ import annotations

import jax.numpy as jnp

COMMON_DOC = """scale: query scale, default K ** -0.5.
    initial_state: `[B, HV, K, V]` float32 (varlen: `[N, HV, K, V]`) or None for zeros.
    output_final_state: also return the state after the last real token.
    segidx: `[B, T]` int running segment index (the state resets where it changes), or None.
    valid: `[B, T]` bool, False at padding positions, or None.
    cu_seqlens: `[N + 1]` int for varlen mode (B = 1), or None.
    block_sizes: `BlockSizes` (chunk size and tiling).
    interpret: False (compiled), True or `pltpu.InterpretParams`; None = compiled on TPU only.

  Returns:
    (o `[B, T, HV, V]`, final_state float32 or None, r `[B, T, HV, V]` the write residual)."""


def with_doc(fn):
  fn.__doc__ = fn.__doc__.replace("{common}", COMMON_DOC)
  return fn


def default_scale(scale, q):
  return q.shape[-1] ** -0.5 if scale is None else float(scale)


def value_heads(k, hv):
  """k `[B, T, H, K]` repeated to the HV value heads (repeat_interleave: head h -> h // n_rep)."""
  n_rep = hv // k.shape[2]
  return k if n_rep == 1 else jnp.repeat(k, n_rep, axis=2)


def times(x, factor):
  """x ⊙ factor in float32 (factor broadcasts: `[B, T, HV]` scalars get a trailing axis)."""
  factor = factor.astype(jnp.float32)
  if factor.ndim == x.ndim - 1:
    factor = factor[..., None]
  return x.astype(jnp.float32) * factor
