"""Softmax attention, the mixer of the hybrids' SDPA layers (docs/MATH.md §2.1).

Three implementations behind one signature: "reference" (dense masked fp32, the oracle), "xla"
and "cudnn" (both through `jax.nn.dot_product_attention`). Masks follow §2.1: causal, optional
sliding window (t − s < window), same segment (running segment index, not raw ids) and never a
padding key; outputs at padding queries are 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lineax_attn.ops import api
from lineax_attn.ops import segments as seg_lib

_HI = jax.lax.Precision.HIGHEST
_IMPLEMENTATIONS = ("reference", "xla", "cudnn")
IMPLEMENTATIONS = _IMPLEMENTATIONS  # public: configs check attn_implementation against it


def _check(q, k, v, window, causal):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"`{name}` must be a floating-point array, got {getattr(x, 'dtype', type(x).__name__)}.")
    if x.ndim != 4:
      raise ValueError(f"`{name}` must be rank 4 [B, T, heads, head_dim], got shape {tuple(x.shape)}.")
  b, t, hq, d = q.shape
  if k.shape != v.shape:
    raise ValueError(f"`v` must have the shape of `k` [B, T, H_kv, D], got k {tuple(k.shape)}, v {tuple(v.shape)}.")
  if k.shape[0] != b or k.shape[1] != t or k.shape[3] != d:
    raise ValueError(f"`k` must have shape [B, T, H_kv, D] = ({b}, {t}, H_kv, {d}), got {tuple(k.shape)}.")
  if hq % k.shape[2] != 0:
    raise ValueError(f"query heads {hq} must be a multiple of key/value heads {k.shape[2]} (GQA).")
  if window is not None:
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
      raise ValueError(f"`window` must be a positive int or None, got {window!r}.")
    if not causal:
      raise ValueError("`window` needs `causal=True` (a sliding window looks back only).")
  return b, t, hq, d


def _mask(b, t, causal, window, layout):
  """[B, 1, T, T] bool: query t may attend key s."""
  pos = jnp.arange(t)
  m = jnp.ones((t, t), bool)
  if causal:
    m = pos[:, None] >= pos[None, :]
  if window is not None:
    m = m & (pos[:, None] - pos[None, :] < window)
  m = jnp.broadcast_to(m, (b, 1, t, t))
  if layout.segidx is not None:
    m = m & (layout.segidx[:, None, :, None] == layout.segidx[:, None, None, :])
    m = m & layout.valid[:, None, None, :]
  return m


def _reference(q, k, v, scale, mask):
  n_rep = q.shape[2] // k.shape[2]
  k = jnp.repeat(k.astype(jnp.float32), n_rep, axis=2)
  v = jnp.repeat(v.astype(jnp.float32), n_rep, axis=2)
  logits = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k, precision=_HI) * scale
  logits = jnp.where(mask, logits, -0.7 * jnp.finfo(jnp.float32).max)
  return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, axis=-1), v, precision=_HI)


def softmax_attention(q, k, v, *, scale=None, causal=True, window=None, segment_ids=None,
                      implementation=None):
  """Multi-head softmax attention with GQA, causal/sliding-window and segment masks.

  Args:
    q: `[B, T, H, D]` queries; k, v: `[B, T, H_kv, D]` with H % H_kv == 0 (query head j reads
      key/value head j // (H / H_kv)).
    scale: logit scale, default D ** -0.5.
    causal: mask future keys.
    window: sliding window W (query t sees keys t − W < s <= t), or None for full attention.
    segment_ids: `[B, T]` int; attention never crosses a segment boundary (a reused id starts a
      new segment) nor reaches a padding key (id 0); outputs at padding queries are 0.
    implementation: "reference", "xla" or "cudnn"; None picks "cudnn" on GPU for bf16/fp16
      inputs and "xla" elsewhere.

  Returns:
    `[B, T, H, D]` in q's dtype.

  Raises:
    ValueError: naming the argument, for a wrong shape, dtype or option, and for negative
      `segment_ids` where they are concrete. In checked mode (`lineax_attn.ops.debug_checks()`)
      traced `segment_ids` and NaN/Inf in q, k, v are checked too (docs/OP_CONTRACT.md).
  """
  b, t, _, d = _check(q, k, v, window, causal)
  scale = api.check_scale(scale, d)
  layout = seg_lib.SegmentLayout()
  if segment_ids is not None:
    layout = api.check_segments(segment_ids, None, api.Dims(b, t, 1, 1, d, d))
  api.check_finite((("q", q), ("k", k), ("v", v)))
  if implementation is None:
    gpu = jax.default_backend() == "gpu"
    implementation = "cudnn" if gpu and q.dtype in (jnp.bfloat16, jnp.float16) else "xla"
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(f"unknown `implementation={implementation!r}`; expected one of {_IMPLEMENTATIONS} or None.")

  if implementation == "reference":
    o = _reference(q, k, v, scale, _mask(b, t, causal, window, layout))
  else:
    kwargs = {}
    if layout.segidx is not None:
      kwargs["mask"] = _mask(b, t, causal, window, layout)
    else:
      kwargs["is_causal"] = causal
      if window is not None:
        kwargs["local_window_size"] = (window - 1, 0)
    o = jax.nn.dot_product_attention(q, k, v, scale=scale, implementation=implementation, **kwargs)
  if layout.valid is not None:
    o = jnp.where(layout.valid[:, :, None, None], o, 0)
  return o.astype(q.dtype)
