"""Softmax attention with the sequence axis sharded (context parallelism, all-gather K/V).

Each device keeps its shard of the queries (tokens [d·T_local, (d+1)·T_local)) and all-gathers
the keys, values and segment ids of the whole sequence over the sequence axis; the causal mask
compares the query's *global* position (offset d·T_local) with the key's. The segment layout
(docs/MATH.md §1.7: forward-filled ids, running segment index) is computed from the gathered ids,
so segments crossing shard boundaries, padding and reused ids behave exactly as unsharded.

Why all-gather and not a ring (ppermute of K/V blocks with an online softmax): the hybrids have
few softmax layers with grouped K/V heads, so gathering K/V costs (P−1)/P · T · 2·H_kv·d_h
elements per row, and one dense masked attention per device is simple and fast to compile; a
ring saves the memory of the gathered K/V but needs P dependent steps. See
docs/CONTEXT_PARALLEL.md (cost, load imbalance of the causal mask, limitations).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lineax_attn import ops
from lineax_attn.ops import api
from lineax_attn.ops import attention as attention_ops
from lineax_attn.ops import segments as seg_lib
from lineax_attn.parallel import context


def _global_mask(b, t_local, t_global, offset, causal, window, layout):
  """`[B, T_local, T_global]` bool: local query i (global position offset + i) may see key s."""
  q_pos = offset + jnp.arange(t_local)
  k_pos = jnp.arange(t_global)
  m = jnp.ones((t_local, t_global), bool)
  if causal:
    m = q_pos[:, None] >= k_pos[None, :]
  if window is not None:
    m = m & (q_pos[:, None] - k_pos[None, :] < window)
  m = jnp.broadcast_to(m, (b, t_local, t_global))
  if layout is not None:
    q_seg = jax.lax.dynamic_slice_in_dim(layout.segidx, offset, t_local, axis=1)
    m = m & (q_seg[:, :, None] == layout.segidx[:, None, :]) & layout.valid[:, None, :]
  return m


STRATEGIES = ("offset_mask", "padded_queries")


def _padded_queries(q, k_all, v_all, offset, t_global, segment_ids_all, **kwargs):
  """This shard's queries placed at their global rows of an otherwise zero `[B, T, H, D]` query
  array, then the unsharded op (so cuDNN's fused kernel runs: it takes no offset mask), and this
  shard's rows sliced back out. Rows of other shards get zero cotangents, so the gradients
  (through the all_gather's transpose) are exact; the price is attention compute of the whole
  sequence on every device."""
  b, t_local, h, d = q.shape
  q_full = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((b, t_global, h, d), q.dtype), q,
                                               offset, axis=1)
  o_full = ops.softmax_attention(q_full, k_all, v_all, segment_ids=segment_ids_all, **kwargs)
  return jax.lax.dynamic_slice_in_dim(o_full, offset, t_local, axis=1)


def context_parallel_attention(q, k, v, *, axis_name: str = context.SEQUENCE_AXIS, scale=None,
                               causal=True, window=None, segment_ids=None, implementation=None,
                               strategy: str | None = None):
  """Softmax attention over a sequence sharded along `axis_name`; call inside `jax.shard_map`.

  Args:
    q: `[B, T_local, H, D]` this shard's queries; k, v: `[B, T_local, H_kv, D]` this shard's
      keys and values (gathered here); shard d holds tokens [d·T_local, (d+1)·T_local).
    axis_name: the manual mesh axis the time axis is split over.
    scale, causal, window: as `ops.softmax_attention`.
    segment_ids: `[B, T_local]` int, this shard's ids (segments may cross shard boundaries).
    implementation: "reference" (dense float32 here), "xla", "cudnn" or None (as
      `ops.softmax_attention`: cuDNN on GPU for bf16/fp16).
    strategy: "offset_mask": `[T_local, T]` scores with the offset causal mask (XLA; compute
      and memory split over the shards, but materialised scores, fine for short T);
      "padded_queries": the unsharded op on zero-padded queries (`_padded_queries`; cuDNN's
      fused kernel, whole-sequence attention compute per device). None: padded_queries when
      the implementation resolves to cuDNN, else offset_mask. On 2 H200s at T = 16K the offset
      mask made the hybrid's step far slower than one GPU (docs/BENCHMARKS.md, "Two GPUs").

  Returns:
    `[B, T_local, H, D]` in q's dtype; outputs at padding queries are 0.
  """
  b, t_local, _, d = attention_ops._check(q, k, v, window, causal)  # pylint: disable=protected-access
  scale = api.check_scale(scale, d)
  if implementation not in (None, "reference", "xla", "cudnn"):
    raise ValueError(f"unknown `implementation={implementation!r}`; expected 'reference', "
                     f"'xla', 'cudnn' or None.")
  if segment_ids is not None:
    api.check_segments(segment_ids, None, api.Dims(b, t_local, 1, 1, d, d))
  if strategy is None:
    on_gpu = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
    cudnn = implementation == "cudnn" or (implementation is None and on_gpu)
    strategy = "padded_queries" if cudnn else "offset_mask"
  if strategy not in STRATEGIES:
    raise ValueError(f"unknown `strategy={strategy!r}`; expected one of {STRATEGIES} or None.")
  n_shards = jax.lax.axis_size(axis_name)
  offset = jax.lax.axis_index(axis_name) * t_local
  gather = lambda x: jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
  k_all, v_all = gather(k), gather(v)
  t_global = t_local * n_shards
  if strategy == "padded_queries":
    ids = None if segment_ids is None else gather(segment_ids.astype(jnp.int32))
    return _padded_queries(q, k_all, v_all, offset, t_global, ids, scale=scale, causal=causal,
                           window=window, implementation=implementation).astype(q.dtype)
  layout = None
  if segment_ids is not None:
    layout = seg_lib.layout_from_segment_ids(gather(segment_ids.astype(jnp.int32)))
  mask = _global_mask(b, t_local, t_global, offset, causal, window, layout)
  if implementation == "reference":
    # The dense float32 oracle of ops.attention, here with the offset mask.
    o = attention_ops._reference(q, k_all, v_all, scale, mask[:, None])  # pylint: disable=protected-access
  else:
    o = jax.nn.dot_product_attention(q, k_all, v_all, scale=scale, mask=mask[:, None],
                                     implementation="xla")
  if layout is not None:
    valid = jax.lax.dynamic_slice_in_dim(layout.valid, offset, t_local, axis=1)
    o = jnp.where(valid[:, :, None, None], o, 0)
  return o.astype(q.dtype)


def sharded_attention(q, k, v, *, mesh=None, axis: str = context.SEQUENCE_AXIS, scale=None,
                      causal=True, window=None, segment_ids=None, implementation=None,
                      strategy: str | None = None,
                      batch_axes=context.DEFAULT_BATCH_AXES, head_axes=context.DEFAULT_HEAD_AXES):
  """`context_parallel_attention` in a `jax.shard_map` manual over `axis` (and over those of
  `batch_axes` / `head_axes` in the mesh that divide B / both head counts, as
  `context.sharded_mixer` does).

  Global arrays in and out (T divisible by the axis size). With `mesh=None` the current mesh is
  used; if `axis` is absent there or has size 1, this is `ops.softmax_attention`.
  """
  mesh_ = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  n_shards = context.active_axis_size(axis, mesh_)
  kwargs = dict(scale=scale, causal=causal, window=window, implementation=implementation)
  if n_shards == 1:
    return ops.softmax_attention(q, k, v, segment_ids=segment_ids, **kwargs)
  attention_ops._check(q, k, v, window, causal)  # pylint: disable=protected-access
  if q.shape[1] % n_shards:
    raise ValueError(f"the time axis of `q` [B, T, H, D] (shape {tuple(q.shape)}) must be "
                     f"divisible by the size {n_shards} of mesh axis {axis!r}.")
  rows = context.pick_axes(mesh_, [a for a in batch_axes if a != axis], q.shape[0])
  heads = context.pick_axes(mesh_, [a for a in head_axes if a != axis and a not in rows],
                            q.shape[2], k.shape[2])
  time_spec = context.spec(rows, (axis,), heads)
  arrays = {"q": q, "k": k, "v": v}
  specs = {"q": time_spec, "k": time_spec, "v": time_spec}
  if segment_ids is not None:
    arrays["segment_ids"], specs["segment_ids"] = segment_ids, context.spec(rows, (axis,))
  fn = jax.shard_map(
      lambda a: context_parallel_attention(a["q"], a["k"], a["v"], axis_name=axis,
                                           segment_ids=a.get("segment_ids"), strategy=strategy,
                                           **kwargs),
      mesh=mesh, in_specs=(specs,), out_specs=time_spec,
      axis_names=context.manual_axes(mesh_, axis, rows, heads))
  return fn(arrays)
