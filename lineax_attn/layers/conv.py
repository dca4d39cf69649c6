"""The short causal depthwise convolution in front of q, k, v, and its decoding cache
(docs/MATH.md §4.2, §8).

    y[t, c] = Σ_{j=0}^{W−1} w[j, c] · u[t − W + 1 + j, c]        (w[W−1] multiplies the current token)

u at positions before 0 comes from the conv cache (zeros when there is none); u at padding
positions and at positions of another segment (a different running segment index,
docs/MATH.md §1.7) is 0, so the convolution never mixes documents packed in one row.

The cache holds the last W − 1 *real* pre-conv inputs of the row's current segment, oldest
first, left-filled with zeros. After a right-padded prefill those are not the last W − 1 rows
(padding), which is why the cache is gathered rather than sliced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lineax_attn.layers import partition


def _extend(u, state, valid, segidx):
  """Prepends the cache rows: (u_ext [B, W−1+T, C], valid_ext, seg_ext)."""
  b, t, _ = u.shape
  n_state = state.shape[1]
  if valid is None:
    valid = jnp.ones((b, t), bool)
  if segidx is None:
    segidx = jnp.ones((b, t), jnp.int32)
  u = jnp.where(valid[..., None], u, jnp.zeros((), u.dtype))
  u_ext = jnp.concatenate([state.astype(u.dtype), u], axis=1)
  # Cache rows are real inputs of the segment that position 0 continues.
  valid_ext = jnp.concatenate([jnp.ones((b, n_state), bool), valid], axis=1)
  seg_ext = jnp.concatenate([jnp.broadcast_to(segidx[:, :1], (b, n_state)), segidx], axis=1)
  return u_ext, valid_ext, seg_ext


def causal_depthwise_conv(u: jax.Array, weight: jax.Array, *, valid: jax.Array | None = None,
                          segidx: jax.Array | None = None, state: jax.Array | None = None
                          ) -> tuple[jax.Array, jax.Array]:
  """Segment-aware causal depthwise conv.

  Args:
    u: `[B, T, C]` pre-conv inputs.
    weight: `[W, C]` taps; `weight[W−1]` multiplies the current token.
    valid: `[B, T]` bool, False at padding (its inputs are zeroed); None = all real.
    segidx: `[B, T]` running segment index (docs/MATH.md §1.7); None = one segment per row.
    state: `[B, W−1, C]` cache of earlier real inputs (oldest first), or None for zeros.

  Returns:
    y `[B, T, C]` in u's dtype (accumulated in float32), and the new cache `[B, W−1, C]`.
  """
  b, t, c = u.shape
  width = weight.shape[0]
  if state is None:
    state = jnp.zeros((b, width - 1, c), u.dtype)
  u_ext, valid_ext, seg_ext = _extend(u, state, valid, segidx)
  seg_t = seg_ext[:, width - 1:]
  w = weight.astype(jnp.float32)
  y = jnp.zeros((b, t, c), jnp.float32)
  for back in range(width):  # tap w[W−1−back] reads the input `back` steps earlier
    lo = width - 1 - back
    same = (seg_ext[:, lo:lo + t] == seg_t)[..., None]
    y = y + jnp.where(same, u_ext[:, lo:lo + t].astype(jnp.float32), 0.0) * w[width - 1 - back]
  return y.astype(u.dtype), _last_real_inputs(u_ext, valid_ext, seg_ext, width - 1)


def _last_real_inputs(u_ext, valid_ext, seg_ext, n: int) -> jax.Array:
  """`[B, n, C]`: the last n real inputs of each row's last segment, oldest first, zero-filled."""
  b, length, c = u_ext.shape
  if n == 0:
    return jnp.zeros((b, 0, c), u_ext.dtype)
  keep = valid_ext & (seg_ext == seg_ext[:, -1:])
  # rank 1 = the last kept position, 2 = the one before, ...
  rank = jnp.flip(jnp.cumsum(jnp.flip(keep, axis=1), axis=1), axis=1)
  pos = jnp.arange(length)
  rows = []
  for slot in range(n):  # slot 0 is the oldest, rank n
    want = n - slot
    idx = jnp.max(jnp.where(keep & (rank == want), pos, -1), axis=1)  # [B]
    row = jnp.take_along_axis(u_ext, jnp.maximum(idx, 0)[:, None, None], axis=1)[:, 0]
    rows.append(jnp.where((idx >= 0)[:, None], row, jnp.zeros((), u_ext.dtype)))
  return jnp.stack(rows, axis=1)


def conv_weight_init(width: int):
  """PyTorch's Conv1d default for a depthwise conv: U(−1/√W, 1/√W) (fan_in = W).

  docs/MATH.md §4.2.
  """
  bound = width ** -0.5

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


class ShortConv(nnx.Module):
  """Causal depthwise convolution of width W over `[B, T, C]`, no bias (docs/MATH.md §4.2).

  The activation (SiLU) is applied by the caller, so the gates can bypass it.
  """

  def __init__(self, channels: int, width: int = 4, *, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    if width < 1:
      raise ValueError(f"conv width must be >= 1, got {width}.")
    self.channels = channels
    self.width = width
    self.weight = partition.param(rngs, conv_weight_init(width), (width, channels), param_dtype,
                                  (partition.CONV, partition.HEADS))

  def __call__(self, u: jax.Array, *, valid: jax.Array | None = None,
               segidx: jax.Array | None = None, state: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """Returns (y `[B, T, C]`, new cache `[B, W−1, C]`); see `causal_depthwise_conv`."""
    return causal_depthwise_conv(u, self.weight[...], valid=valid, segidx=segidx, state=state)

  def init_cache(self, batch: int, dtype=jnp.float32) -> jax.Array:
    return jnp.zeros((batch, self.width - 1, self.channels), dtype)
