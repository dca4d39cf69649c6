"""Normalisations: RMSNorm over the model width, the per-head gated output norm, and L2N.

All three compute in float32 and cast back to the input dtype (docs/MATH.md §1.1, §1.4, §4.1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lineax_attn.layers import partition

OUTPUT_GATES = ("none", "silu", "sigmoid")


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x²) + eps) over the last axis, in float32."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """L2N(x) = x / sqrt(Σ x² + eps) over the last axis (the head dim); float32 inside."""
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def gate_activation(z: jax.Array, kind: str) -> jax.Array:
  if kind == "silu":
    return jax.nn.silu(z)
  if kind == "sigmoid":
    return jax.nn.sigmoid(z)
  raise ValueError(f"unknown output gate {kind!r}; expected one of {OUTPUT_GATES}.")


class RMSNorm(nnx.Module):
  """RMSNorm_γ(x) = γ ⊙ x / sqrt(mean(x²) + eps) over the last axis `[..., dim]`."""

  def __init__(self, dim: int, *, eps: float = 1e-5, axis_name: str | None = partition.EMBED,
               param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    del rngs  # deterministic init; accepted so every layer has the same constructor shape
    self.eps = eps
    self.weight = partition.param(None, nnx.initializers.ones, (dim,), param_dtype, (axis_name,))

  def __call__(self, x: jax.Array) -> jax.Array:
    return (rms_normalize(x, self.eps) * self.weight[...].astype(jnp.float32)).astype(x.dtype)


class GatedHeadNorm(nnx.Module):
  """The mixers' output norm: per-head RMSNorm over the head dim (one weight γ ∈ R^{d_v} shared
  by all heads), times an optional output gate act(z) (docs/MATH.md §4.1, §4.3).

  Input o `[B, T, HV, V]`, gate logits z `[B, T, HV, V]` (or None with `gate="none"`).
  """

  def __init__(self, head_dim: int, *, gate: str = "none", eps: float = 1e-5,
               param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    del rngs
    if gate not in OUTPUT_GATES:
      raise ValueError(f"unknown output gate {gate!r}; expected one of {OUTPUT_GATES}.")
    self.gate = gate
    self.eps = eps
    self.weight = partition.param(None, nnx.initializers.ones, (head_dim,), param_dtype, (None,))

  def __call__(self, o: jax.Array, z: jax.Array | None = None, *, remat: bool = False
               ) -> jax.Array:
    """remat: recompute the norm in the backward (`jax.checkpoint`) instead of keeping its
    float32 intermediates until then; the same values either way."""
    if self.gate != "none" and z is None:
      raise ValueError(f"output gate {self.gate!r} needs gate logits z.")
    norm = functools.partial(gated_head_norm, eps=self.eps, gate=self.gate)
    return (jax.checkpoint(norm) if remat else norm)(o, z, self.weight[...])


def gated_head_norm(o: jax.Array, z: jax.Array | None, weight: jax.Array, *, eps: float,
                    gate: str) -> jax.Array:
  """`GatedHeadNorm` as a pure function: RMSNorm of o over its last axis times weight, times
  act(z) unless gate is "none"; float32 inside, o's dtype out."""
  y = rms_normalize(o, eps) * weight.astype(jnp.float32)
  if gate != "none":
    y = y * gate_activation(z.astype(jnp.float32), gate)
  return y.astype(o.dtype)
