"""Softmax attention layer: RoPE, GQA, optional sliding window and output gate, KV cache
(docs/MATH.md §2.1, §8).

    q, k, v = x W_qkv  (H_q, H_kv, H_kv heads of d_h)       one fused projection, no bias
    q, k ← RoPE(q, k; base 500000)                           rotate-half convention, float32
    o = softmax_attention(q, k, v, causal, window, segments)  lineax_attn.ops
    o ← o ⊙ σ(x W_g)  (optional output gate, width H_q·d_h)
    out = o W_o

Positions: without segment ids position t is t; with segment ids a token's position is the
number of real tokens before it in its segment, so each packed document starts at 0 and a
right-padded row continues, when decoding, at its own real length.

KV cache `{"k", "v": [B, S, H_kv, d_h]; "kpos": [B, S] int32 (position of the key in each slot,
−1 = empty); "pos": [B] int32 (next position)}`. A key at position p lives in slot p mod S, with
S = max_len, or S = min(max_len, window) for a sliding window: a ring buffer that keeps exactly
the keys a future query can see.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lineax_attn import ops
from lineax_attn.layers import partition
from lineax_attn.layers.linear_mixer import MixerOutput
from lineax_attn.ops import segments as seg_lib
from lineax_attn.parallel import attention as parallel_attention
from lineax_attn.parallel import context as context_parallel

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, as in docs/MATH.md §2.1


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """Rotary embedding (rotate-half) of x `[B, T, H, D]` at integer positions `[B, T]`."""
  d = x.shape[-1]
  half = d // 2
  inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / d)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
  cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., :half], xf[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def segment_positions(valid: jax.Array, segidx: jax.Array,
                      offset: jax.Array | None = None) -> jax.Array:
  """`[B, T]` int32: real tokens before t in t's segment (+ `offset[b]` in the row's first segment)."""
  real = valid.astype(jnp.int32)
  before = jnp.cumsum(real, axis=1) - real  # real tokens strictly before t in the row
  starts = jnp.concatenate(
      [jnp.ones_like(segidx[:, :1], dtype=bool), segidx[:, 1:] != segidx[:, :-1]], axis=1)
  base = jax.lax.cummax(jnp.where(starts, before, 0), axis=1)
  pos = before - base
  if offset is not None:
    pos = pos + jnp.where(segidx == segidx[:, :1], offset[:, None], 0)
  return pos.astype(jnp.int32)


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                     scale: float) -> jax.Array:
  """Dense GQA attention: q `[B, T, H, D]`, k, v `[B, S, H_kv, D]`, mask `[B, T, S]` -> `[B, T, H, D]`.

  Float32 logits and softmax; kv heads are not repeated (q is grouped instead), so decoding
  over a long cache does not copy it.
  """
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  qg = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)
  logits = jnp.einsum("btgrd,bsgd->bgrts", qg, k.astype(jnp.float32)) * scale
  logits = jnp.where(mask[:, None, None], logits, _MASK_VALUE)
  probs = jax.nn.softmax(logits, axis=-1)
  o = jnp.einsum("bgrts,bsgd->btgrd", probs, v.astype(jnp.float32))
  return o.reshape(b, t, hq, d).astype(q.dtype)


def cache_from_entries(k_all, v_all, kpos_all, keep, slots: int) -> dict[str, jax.Array]:
  """Builds a cache of `slots` slots from candidate keys.

  k_all, v_all `[B, L, H_kv, D]`; kpos_all `[B, L]` positions; keep `[B, L]` marks the keys of
  the row's current segment. The kept positions of a row are contiguous (a segment's keys), so
  slot j takes the newest kept key with position ≡ j (mod slots).
  """
  length = kpos_all.shape[1]
  big = jnp.iinfo(jnp.int32).max
  order = jnp.argsort(jnp.where(keep, kpos_all, big), axis=1, stable=True)
  pos_next = jnp.max(jnp.where(keep, kpos_all, -1), axis=1) + 1  # [B]
  p_min = jnp.min(jnp.where(keep, kpos_all, big), axis=1)          # [B]
  j = jnp.arange(slots, dtype=jnp.int32)
  p_slot = j + slots * jnp.floor_divide(pos_next[:, None] - 1 - j, slots)  # [B, slots]
  ok = (p_slot >= 0) & (p_slot >= p_min[:, None])
  idx = jnp.take_along_axis(order, jnp.clip(p_slot - p_min[:, None], 0, length - 1), axis=1)
  gather = lambda a: jnp.where(ok[..., None, None],
                               jnp.take_along_axis(a, idx[..., None, None], axis=1),
                               jnp.zeros((), a.dtype))
  return {"k": gather(k_all), "v": gather(v_all), "kpos": jnp.where(ok, p_slot, -1).astype(jnp.int32),
          "pos": pos_next.astype(jnp.int32)}


class SoftmaxAttention(nnx.Module):
  """Causal multi-head softmax attention with RoPE and GQA, `[B, T, d] -> [B, T, d]`.

  Args:
    d_model: model width d.
    num_heads: query heads H_q.
    num_kv_heads: key/value heads H_kv (H_q a multiple of it); default H_q.
    head_dim: d_h (default d_model // num_heads, which must divide; must be even for RoPE).
    rope_base: RoPE base (500000 at 350M).
    window: sliding window W (query t sees keys t − W < s ≤ t), or None.
    output_gate: multiply by σ(x W_g) before the output projection (the repo's GDN/KDA/GDN-2 runs).
    implementation: `ops.softmax_attention` implementation ("reference", "xla", "cudnn", None).
    context_axis: mesh axis of context parallelism: when the current mesh has it with size
      P > 1 dividing T, attention runs under `jax.shard_map` over it, each device with its query
      shard and all-gathered K/V (`lineax_attn.parallel.sharded_attention`); None turns it off.
      Positions (RoPE) are computed on the global time axis before, so they need no offset.
    init_std, out_init_std, dtype, param_dtype: as for `LinearMixer`.
  """

  def __init__(self, d_model: int, *, num_heads: int, num_kv_heads: int | None = None,
               head_dim: int | None = None, rope_base: float = 500000.0,
               window: int | None = None, output_gate: bool = False,
               implementation: str | None = None,
               context_axis: str | None = context_parallel.SEQUENCE_AXIS,
               init_std: float = 0.02, out_init_std: float | None = None, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    if num_heads <= 0:
      raise ValueError(f"num_heads must be positive, got {num_heads}.")
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
      raise ValueError(f"num_heads={num_heads} must be a positive multiple of "
                       f"num_kv_heads={num_kv_heads} (GQA).")
    if head_dim is None:
      if d_model % num_heads != 0:
        raise ValueError(f"d_model={d_model} is not divisible by the attention heads "
                         f"num_heads={num_heads}; pass head_dim explicitly.")
      head_dim = d_model // num_heads
    if head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {head_dim}.")
    if window is not None and (not isinstance(window, int) or window <= 0):
      raise ValueError(f"window must be a positive int or None, got {window!r}.")
    self.d_model = d_model
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.rope_base = float(rope_base)
    self.window = window
    self.implementation = implementation
    self.context_axis = context_axis
    self.dtype = dtype
    normal = nnx.initializers.normal
    out_init_std = init_std if out_init_std is None else out_init_std
    linear = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.qkv_proj = nnx.Linear(
        d_model, (num_heads + 2 * num_kv_heads) * head_dim,
        kernel_init=partition.partitioned(normal(init_std), (partition.EMBED, partition.HEADS)),
        **linear)
    if output_gate:
      self.gate_proj = nnx.Linear(
          d_model, num_heads * head_dim,
          kernel_init=partition.partitioned(normal(init_std), (partition.EMBED, partition.HEADS)),
          **linear)
    self.output_gate = bool(output_gate)
    self.out_proj = nnx.Linear(
        num_heads * head_dim, d_model,
        kernel_init=partition.partitioned(normal(out_init_std), (partition.HEADS, partition.EMBED)),
        **linear)

  # ----------------------------------------------------------------------------------------
  def cache_slots(self, max_len: int) -> int:
    return max_len if self.window is None else min(max_len, self.window)

  def init_cache(self, batch: int, max_len: int) -> dict[str, jax.Array]:
    """Empty KV cache for sequences of up to `max_len` tokens (prompt + generated)."""
    slots = self.cache_slots(max_len)
    shape = (batch, slots, self.num_kv_heads, self.head_dim)
    return {"k": jnp.zeros(shape, self.dtype), "v": jnp.zeros(shape, self.dtype),
            "kpos": jnp.full((batch, slots), -1, jnp.int32), "pos": jnp.zeros((batch,), jnp.int32)}

  def _project(self, x):
    b, t, _ = x.shape
    hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
    p = self.qkv_proj(x)
    q = p[..., :hq * d].reshape(b, t, hq, d)
    k = p[..., hq * d:(hq + hkv) * d].reshape(b, t, hkv, d)
    v = p[..., (hq + hkv) * d:].reshape(b, t, hkv, d)
    return q, k, v

  def _window_ok(self, dist):
    return True if self.window is None else dist < self.window

  def forward(self, x: jax.Array, segment_ids: jax.Array | None = None, *,
              value_delta: jax.Array | None = None, cache: dict[str, jax.Array] | None = None,
              max_len: int | None = None, with_residual: bool = False) -> MixerOutput:
    """Same contract as `LinearMixer.forward`; r and v are None (softmax layers export nothing).

    Without a cache this is `ops.softmax_attention`; with `max_len` it also returns a fresh
    cache; with `cache` it attends over the cached keys plus the new ones (dense, float32).
    """
    del with_residual  # nothing to export
    if value_delta is not None:
      raise ValueError("softmax attention layers take no routed value (value_delta).")
    if x.ndim != 3 or x.shape[-1] != self.d_model:
      raise ValueError(f"x must have shape [B, T, d_model={self.d_model}], got {x.shape}.")
    b, t, _ = x.shape
    x = x.astype(self.dtype)
    q, k, v = self._project(x)
    scale = self.head_dim ** -0.5
    if segment_ids is None:
      valid = jnp.ones((b, t), bool)
      segidx = jnp.ones((b, t), jnp.int32)
    else:
      layout = seg_lib.layout_from_segment_ids(jnp.asarray(segment_ids))
      valid, segidx = layout.valid, layout.segidx

    new_cache = None
    if cache is None:
      pos = (jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)) if segment_ids is None
             else segment_positions(valid, segidx))
      q, k = rope(q, pos, self.rope_base), rope(k, pos, self.rope_base)
      shards = context_parallel.active_axis_size(self.context_axis)
      attend = ops.softmax_attention
      if shards > 1 and t % shards == 0:
        attend = functools.partial(parallel_attention.sharded_attention, axis=self.context_axis)
      o = attend(q, k, v, scale=scale, causal=True, window=self.window,
                 segment_ids=segment_ids, implementation=self.implementation)
      if max_len is not None:
        keep = valid & (segidx == segidx[:, -1:])
        new_cache = cache_from_entries(k, v, jnp.where(valid, pos, -1), keep,
                                       self.cache_slots(max_len))
    elif t == 1 and segment_ids is None:
      o, new_cache = self._decode_one(q, k, v, cache, scale)
    else:
      o, new_cache = self._extend(q, k, v, valid, segidx, cache, scale)

    if self.output_gate:
      o = o * jax.nn.sigmoid(self.gate_proj(x).astype(jnp.float32)).reshape(o.shape).astype(o.dtype)
    y = self.out_proj(o.reshape(b, t, self.num_heads * self.head_dim))
    return MixerOutput(y=y, r=None, v=None, cache=new_cache)

  def _decode_one(self, q, k, v, cache, scale):
    """One real token per row: write slot pos mod S, attend over the filled slots."""
    b = q.shape[0]
    pos = cache["pos"]
    q = rope(q, pos[:, None], self.rope_base)
    k = rope(k, pos[:, None], self.rope_base)
    slot = pos % cache["k"].shape[1]
    rows = jnp.arange(b)
    kc = cache["k"].at[rows, slot].set(k[:, 0].astype(cache["k"].dtype))
    vc = cache["v"].at[rows, slot].set(v[:, 0].astype(cache["v"].dtype))
    kpos = cache["kpos"].at[rows, slot].set(pos)
    mask = (kpos >= 0) & self._window_ok(pos[:, None] - kpos)
    o = masked_attention(q, kc, vc, mask[:, None, :], scale)
    return o, {"k": kc, "v": vc, "kpos": kpos, "pos": pos + 1}

  def _extend(self, q, k, v, valid, segidx, cache, scale):
    """Several new tokens after a cache (chunked prefill, or decoding with segment ids)."""
    b, t = valid.shape
    pos = segment_positions(valid, segidx, offset=cache["pos"])
    q, k = rope(q, pos, self.rope_base), rope(k, pos, self.rope_base)
    slots = cache["k"].shape[1]
    k_all = jnp.concatenate([cache["k"], k.astype(cache["k"].dtype)], axis=1)
    v_all = jnp.concatenate([cache["v"], v.astype(cache["v"].dtype)], axis=1)
    kpos_all = jnp.concatenate([cache["kpos"], jnp.where(valid, pos, -1)], axis=1)
    # Cached keys belong to the segment that the row's first new segment continues.
    seg_all = jnp.concatenate([jnp.broadcast_to(segidx[:, :1], (b, slots)), segidx], axis=1)
    key_ok = kpos_all >= 0
    mask = (key_ok[:, None, :] & (seg_all[:, None, :] == segidx[:, :, None])
            & (kpos_all[:, None, :] <= pos[:, :, None])
            & self._window_ok(pos[:, :, None] - kpos_all[:, None, :]))
    o = masked_attention(q, k_all, v_all, mask, scale)
    o = jnp.where(valid[:, :, None, None], o, jnp.zeros((), o.dtype))
    keep = key_ok & (seg_all == segidx[:, -1:])
    return o, cache_from_entries(k_all, v_all, kpos_all, keep, slots)

  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """`[B, T, d] -> [B, T, d]`: the plain layer."""
    return self.forward(x, segment_ids).y

  def decode_step(self, x: jax.Array, cache: dict[str, jax.Array]) -> MixerOutput:
    """One token: x `[B, d]` (or `[B, 1, d]`) -> MixerOutput with y `[B, 1, d]`."""
    if x.ndim == 2:
      x = x[:, None]
    return self.forward(x, cache=cache)
