"""Context parallelism for the linear mixers: the sequence axis sharded over devices.

Every linear mixer is S_t = A_t S_{t−1} + (write), with A_t acting on the key side only, and its
outputs are linear in the state read-out (docs/MATH.md §2.0). So the pass of one device over its
shard of the sequence is *affine* in the state S_in that enters the shard (per batch row and
value head, S_in is `[K, V]`):

    S_out = M S_in + B          M `[K, K]`, B `[K, V]`
    o_t   = o0_t + S_inᵀ a_t    a_t `[K]`   (likewise r_t = r0_t + S_inᵀ e_t)

One local pass of the ordinary op gives all of them: append K zero value columns, start from
`[0 | I_K]`, and the results split as final state `[B | M]`, output `[o0 | a]`, residual
`[r0 | e]` (the extra columns carry the derivative of everything with respect to S_in; GDN-2's
write gate w is padded with ones, its value is irrelevant since those values are zero). Then:

1. `all_gather` the per-device pairs (M_d, B_d) over the sequence axis (one collective of
   P·K·(K+V) float32 per batch row and value head; see docs/CONTEXT_PARALLEL.md for why not a
   ring), and the first/last real segment id of each shard;
2. every device composes the prefix S_in(d) = M_{d−1}(…(M_0 S_init + B_0)…) + B_{d−1} (P small
   `[K, K] x [K, V]` matmuls, float32), dropping the carried state at a shard boundary where a new
   segment starts (docs/MATH.md §1.7);
3. corrects its outputs with one `[T, K] x [K, V]` matmul per head.

Linear attention needs no augmentation: its transition is I (0 after a reset inside the shard),
so M collapses to one flag per row and S_in is a sum of the earlier shards' B.

The final state of the whole sequence (the last shard's S_out) is computed by every device from
the gathered pairs, so no further collective is needed to return it.

Gradients are plain autodiff through the local op and the collectives (`all_gather` transposes
to a reduce-scatter); tests/test_context_parallel.py checks them against the unsharded op.

Use `context_parallel(...)` inside your own `jax.shard_map` (manual over `axis_name`), or
`sharded_mixer(...)`, which wraps the shard_map itself (manual over the sequence axis and the
mesh axes that already split the batch and the heads; any other axis stays automatic).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from lineax_attn import ops
from lineax_attn.ops import api
from lineax_attn.ops import segments as seg_lib
from lineax_attn.ops import specs

_HI = jax.lax.Precision.HIGHEST
SEQUENCE_AXIS = "sequence"
# Mesh axes that may split the batch / the heads; `sharded_mixer` makes those present (and
# dividing the dimension) manual too, so that every per-row, per-head computation of the body
# stays local (left automatic, XLA's propagation replicated the batch inside the body).
DEFAULT_BATCH_AXES = ("data", "fsdp")
DEFAULT_HEAD_AXES = ("tensor",)



def mixer_name(mixer: str | Callable[..., Any]) -> str:
  """The op name of `mixer`: a public op function (`ops.kda`) or a name/alias ("gdn")."""
  if callable(mixer):
    for name in specs.names():
      if getattr(ops, name) is mixer:
        return name
    raise ValueError(f"`mixer` must be one of the public linear-mixer ops "
                     f"{specs.names()} or their names, got the callable {mixer!r}.")
  try:
    return specs.resolve(mixer).name
  except ValueError:
    raise ValueError(f"unknown `mixer` {mixer!r}; expected one of {specs.names()} "
                     f"(aliases: {specs.all_names()}).") from None


def active_axis_size(axis: str | None, mesh=None) -> int:
  """Size of `axis` in `mesh` (default: the current abstract mesh) if it is there and not
  already manual (we are not inside a shard_map over it); else 1 (no context parallelism)."""
  if axis is None:
    return 1
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh is None or getattr(mesh, "empty", False) or axis not in mesh.axis_names:
    return 1
  types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))
  if types.get(axis) == jax.sharding.AxisType.Manual:
    return 1
  return int(mesh.shape[axis])


def pick_axes(mesh, names: Sequence[str], *dims: int) -> tuple[str, ...]:
  """The axes of `names` in `mesh` (in order, not manual, size > 1) whose running product
  divides every one of `dims`."""
  types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))
  chosen: list[str] = []
  for name in names:
    if name not in mesh.axis_names or types.get(name) == jax.sharding.AxisType.Manual:
      continue
    size = math.prod(mesh.shape[a] for a in chosen) * mesh.shape[name]
    if mesh.shape[name] > 1 and all(d % size == 0 for d in dims):
      chosen.append(name)
  return tuple(chosen)


def manual_axes(mesh, axis: str, rows: Sequence[str], heads: Sequence[str]) -> frozenset:
  """The shard_map's manual axes: `axis`, the row and head axes, and every size-1 axis not
  already manual (free to make manual; a body with no automatic axis left also admits host
  callbacks, e.g. the Pallas interpreter)."""
  types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))
  trivial = {a for a in mesh.axis_names
             if mesh.shape[a] == 1 and types.get(a) != jax.sharding.AxisType.Manual}
  return frozenset({axis, *rows, *heads} | trivial)


def checks_types(implementation: str | None) -> bool:
  """Whether the shard_map can run with `check_vma=True` around this op implementation.

  The pure-JAX forms ("chunk", "scan") are typed through, and `pallas_gpu` types its kernels'
  outputs and cotangents with the inputs' varying axes (tests/test_pallas_gpu.py checks its
  gradients under shard_map with check_vma=True). The TPU kernels' custom VJP does not yet, so
  around it the check is off (the collectives and their transposes are the same; only the
  static replication check is skipped).
  """
  name = api.default_implementation() if implementation is None else implementation
  return name in ("chunk", "scan", "pallas_gpu")


def spec(*dims) -> PartitionSpec:
  """PartitionSpec from per-dimension axis tuples (empty: replicated)."""
  return PartitionSpec(*(None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims))


def _matmul(spec, *xs):
  return jnp.einsum(spec, *xs, precision=_HI)


def _varying_axes(x) -> frozenset:
  """The manual mesh axes `x` varies over (shard_map's type of x)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))   # older jax spelling


def _varying(x, axis_name, *like):
  """Marks a device-invariant value (a constant) as varying over `axis_name` and over every
  manual axis the arrays `like` vary over: the local op's `lax.scan` carries the state, and
  under shard_map's type checks (check_vma) its initial value must have the carry's type.
  Without the checks (no axis is typed varying) it is a no-op; axis_name None: only `like`'s
  axes (the in-device row split, `row_split`)."""
  axes = set()
  for a in like:
    axes |= _varying_axes(a)
  if not axes:
    return x
  axes = (axes | ({axis_name} if axis_name else set())) - _varying_axes(x)
  return jax.lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def boundary_ids(segment_ids):
  """(first, last) real segment id of each row of this shard, `[B]` int32 (0: none)."""
  ids = segment_ids.astype(jnp.int32)
  t = ids.shape[1]
  pos = jnp.arange(t, dtype=jnp.int32)
  real = ids != 0
  first_pos = jnp.min(jnp.where(real, pos, t), axis=1)
  last_pos = jnp.max(jnp.where(real, pos, -1), axis=1)
  take = lambda p: jnp.take_along_axis(ids, jnp.clip(p, 0, t - 1)[:, None], axis=1)[:, 0]
  has = jnp.any(real, axis=1)
  return jnp.where(has, take(first_pos), 0), jnp.where(has, take(last_pos), 0)


def entry_states(apply, pairs, s_init, firsts, lasts, n_shards):
  """Prefix composition over the P shards (static loop, identical on every device).

  apply(pair_j, S) -> S_out of shard j; firsts/lasts `[P, B]` real segment ids at the shard
  edges (None without segments). Returns (entry states `[P, B, HV, K, V]`, final state).
  """
  s = s_init
  carry = None if firsts is None else jnp.zeros_like(firsts[0])
  entries = []
  for j in range(n_shards):
    if j > 0 and firsts is not None:
      # The shard's first real token starts a new segment iff its id differs from the last
      # real id before the shard (docs/MATH.md §1.7: a start is where the filled id changes); with
      # no real token before it (leading padding) or none in it, the state flows on unchanged.
      first = firsts[j]
      cont = (carry == 0) | (first == 0) | (carry == first)
      s = jnp.where(cont[:, None, None, None], s, 0.0)
    entries.append(s)
    s = apply(jax.tree.map(lambda x: x[j], pairs), s)
    if lasts is not None:
      carry = jnp.where(lasts[j] != 0, lasts[j], carry)
  return jnp.stack(entries), s


def checked_call(mixer, q, k, v, gates, *, scale, chunk_size, segment_ids, initial_state,
                 cu_seqlens, where):
  """The op's argument checks for a split pass: (name, dims, gates, scale, chunk_size,
  initial_state). `where` names the caller in the `cu_seqlens` error."""
  name = mixer_name(mixer)
  if cu_seqlens is not None:
    raise ValueError(f"`cu_seqlens` (varlen mode) is not supported {where}: pack the sequences "
                     "into rows with `segment_ids` instead (the state resets where the id "
                     "changes).")
  gate_specs = specs.resolve(name).gate_axes
  if len(gates) != len(gate_specs):
    raise ValueError(f"{name} takes {len(gate_specs)} gate array(s) "
                     f"{tuple(g for g, _ in gate_specs)}, got {len(gates)}.")
  dims = api.check_qkv(q, k, v)
  for (gate_name, axis), gate in zip(gate_specs, gates):
    api.check_gate(name, gate_name, gate, axis, dims)
  scale = api.check_scale(scale, dims.dk)
  chunk_size = api.check_chunk_size(chunk_size)
  if segment_ids is not None:
    api.check_segments(segment_ids, None, dims)
  initial_state = api.check_initial_state(initial_state, dims, seg_lib.SegmentLayout())
  return name, dims, tuple(gates), scale, chunk_size, initial_state


def affine_pass(name, dims, q, k, v, gates, *, axis_name, scale, segment_ids, chunk_size,
                implementation, tuning=None):
  """One pass of the op over rows whose entry state is unknown (a shard, or a piece of a row):
  (pairs, apply, correct_o, correct_r). pairs: what `apply(pair, S_in)` needs to give the state
  leaving the rows (linear attention: (m, B), a carry flag and the state from zero; else
  (M, B)); correct_o(S_in) / correct_r(S_in): the outputs and residuals with S_in entering.
  axis_name: the manual axis the pass varies over (None: only its inputs' axes); tuning: the
  op's `GpuTuning` (None: its default)."""
  spec_ = specs.resolve(name)
  b, hv, dk, dv = dims.b, dims.hv, dims.dk, dims.dv
  op = getattr(ops, name)
  common = dict(scale=scale, segment_ids=segment_ids, chunk_size=chunk_size,
                output_final_state=True, return_residual=True, implementation=implementation,
                tuning=tuning)
  v32 = v.astype(jnp.float32)  # outputs stay float32 until the correction is added
  if not spec_.gates:
    # Linear attention (no gates): transition I, or 0 once a segment starts inside the rows:
    # one flag per row.
    zeros = _varying(jnp.zeros((b, hv, dk, dv), jnp.float32), axis_name, q, k, v)
    o0, b_local, r = op(q, k, v32, initial_state=zeros, **common)
    layout = (seg_lib.layout_from_segment_ids(segment_ids.astype(jnp.int32))
              if segment_ids is not None else None)
    if layout is None:
      reads = jnp.ones((b, dims.t), jnp.float32)
      m_local = jnp.ones((b,), jnp.float32)
    else:  # rows of the first segment read S_in (padding rows output 0)
      first_seg = layout.segidx == layout.segidx[:, :1]
      reads = (first_seg & layout.valid).astype(jnp.float32)
      m_local = first_seg[:, -1].astype(jnp.float32)
    apply = lambda pair, s: pair[0][:, None, None, None] * s + pair[1]
    qr = jnp.repeat(q.astype(jnp.float32), hv // dims.h, axis=2) * scale
    correct_o = lambda s_in: o0 + reads[:, :, None, None] * _matmul("bthk,bhkv->bthv", qr, s_in)
    return (m_local, b_local), apply, correct_o, lambda s_in: r
  # The augmented pass: K extra zero value columns starting from [0 | I] track d(.)/d S_in.
  v_aug = jnp.concatenate([v32, jnp.zeros((b, dims.t, hv, dk), jnp.float32)], axis=-1)
  gates = list(gates)
  for i, (_, axis) in enumerate(spec_.gate_axes):
    if axis == "v":  # per value channel (GDN-2's w): it multiplies the zero columns, any value will do
      pad = jnp.ones((b, dims.t, hv, dk), jnp.float32)
      gates[i] = jnp.concatenate([gates[i].astype(jnp.float32), pad], axis=-1)
  s_aug = jnp.concatenate([jnp.zeros((b, hv, dk, dv), jnp.float32),
                           jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (b, hv, dk, dk))],
                          axis=-1)
  s_aug = _varying(s_aug, axis_name, q, k, v, *gates)
  o_aug, final_aug, r_aug = op(q, k, v_aug, *gates, initial_state=s_aug, **common)
  apply = lambda pair, s: _matmul("bhkj,bhjv->bhkv", pair[0], s) + pair[1]
  correct_o = lambda s_in: o_aug[..., :dv] + _matmul("bthk,bhkv->bthv", o_aug[..., dv:], s_in)
  correct_r = lambda s_in: r_aug[..., :dv] + _matmul("bthk,bhkv->bthv", r_aug[..., dv:], s_in)
  return (final_aug[..., dv:], final_aug[..., :dv]), apply, correct_o, correct_r   # (M, B)


def context_parallel(mixer, q, k, v, *gates, axis_name: str = SEQUENCE_AXIS, scale=None,
                     initial_state=None, output_final_state=False, segment_ids=None,
                     cu_seqlens=None, chunk_size=64, return_residual=False,
                     implementation="chunk"):
  """A linear mixer over a sequence sharded along `axis_name`; call inside a `jax.shard_map`.

  Each device passes its contiguous shard of the time axis (shard d holds tokens
  [d·T_local, (d+1)·T_local)); the result equals the op on the whole sequence.

  Args:
    mixer: op name ("linear_attention", "delta_rule", "gated_delta_rule", "kda", "gdn2"; the
      layer aliases work too) or the public op function itself.
    q, k: `[B, T_local, H, K]`; v: `[B, T_local, HV, V]`; gates: the op's gates, local shards
      (`[B, T_local, HV]` or `[B, T_local, HV, K|V]`).
    axis_name: the manual mesh axis the time axis is split over.
    scale, chunk_size, return_residual: as for the op.
    initial_state: `[B, HV, K, V]` float32, the same on every device (it enters at shard 0).
    output_final_state: also return the state after the whole sequence. Every device computes
      the same value, but shard_map types it as varying over `axis_name` (it comes from an
      all_gather): return it with a leading axis over `axis_name` and keep the last entry, as
      `sharded_mixer` does.
    segment_ids: `[B, T_local]` int, the local shard of the ids (docs/MATH.md §1.7); segments may
      cross shard boundaries and may start exactly at one.
    cu_seqlens: not supported (ValueError): pack the sequences with segment_ids instead.
    implementation: the op implementation of the local pass ("chunk" by default; a kernel name
      passes through; the "scan" reference works too).

  Returns:
    `(o, final_state)` or `(o, final_state, r)` like the op; o and r are local shards.
  """
  name, dims, gates, scale, chunk_size, initial_state = checked_call(
      mixer, q, k, v, gates, scale=scale, chunk_size=chunk_size, segment_ids=segment_ids,
      initial_state=initial_state, cu_seqlens=cu_seqlens, where="under context parallelism")
  if not isinstance(axis_name, str):
    raise ValueError(f"`axis_name` must be a mesh axis name (str), got {axis_name!r}.")
  try:
    n_shards = jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(f"`axis_name={axis_name!r}` is not a manual axis here: call "
                     f"context_parallel inside jax.shard_map over it, or use sharded_mixer.") from e
  shard = jax.lax.axis_index(axis_name)
  b, hv, dk, dv = dims.b, dims.hv, dims.dk, dims.dv
  pairs, apply, correct_o, correct_r = affine_pass(
      name, dims, q, k, v, gates, axis_name=axis_name, scale=scale, segment_ids=segment_ids,
      chunk_size=chunk_size, implementation=implementation)
  gather = functools.partial(jax.lax.all_gather, axis_name=axis_name)
  all_pairs = jax.tree.map(gather, pairs)
  firsts = lasts = None
  if segment_ids is not None:
    first, last = boundary_ids(segment_ids)
    firsts, lasts = gather(first), gather(last)
  s_init = (jnp.zeros((b, hv, dk, dv), jnp.float32) if initial_state is None
            else initial_state)
  entries, final = entry_states(apply, all_pairs, s_init, firsts, lasts, n_shards)
  s_in = jax.lax.dynamic_index_in_dim(entries, shard, axis=0, keepdims=False)
  o = correct_o(s_in).astype(v.dtype)
  final = final if output_final_state else None
  if return_residual:
    return o, final, correct_r(s_in).astype(v.dtype)
  return o, final


def sharded_mixer(mixer, q, k, v, *gates, mesh=None, axis: str = SEQUENCE_AXIS, scale=None,
                  initial_state=None, output_final_state=False, segment_ids=None,
                  cu_seqlens=None, chunk_size=64, return_residual=False,
                  implementation="chunk", batch_axes: Sequence[str] = DEFAULT_BATCH_AXES,
                  head_axes: Sequence[str] = DEFAULT_HEAD_AXES):
  """`context_parallel` wrapped in `jax.shard_map` over the mesh axis `axis`.

  Takes and returns global arrays (time axis T = P·T_local, T divisible by the axis size P).
  The shard_map is manual over `axis` and over those of `batch_axes` / `head_axes` that are in
  the mesh and divide B / the heads (H and HV), so the rows and heads already split over them
  stay where they are; every other mesh axis stays automatic. With `mesh=None` the current
  mesh (`jax.set_mesh`) is used; if `axis` is absent there or has size 1, this is the plain op.

  Args: as `context_parallel`, plus `mesh`, `axis`, `batch_axes`, `head_axes`.
  Returns: as the op.
  """
  name = mixer_name(mixer)
  mesh_ = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  n_shards = active_axis_size(axis, mesh_)
  kwargs = dict(scale=scale, output_final_state=output_final_state, chunk_size=chunk_size,
                return_residual=return_residual)
  if n_shards == 1:
    return getattr(ops, name)(q, k, v, *gates, initial_state=initial_state,
                              segment_ids=segment_ids, cu_seqlens=cu_seqlens,
                              implementation=implementation, **kwargs)
  if cu_seqlens is not None:
    raise ValueError("`cu_seqlens` (varlen mode) is not supported under context parallelism: "
                     "pack the sequences into rows with `segment_ids` instead.")
  dims = api.check_qkv(q, k, v)
  if dims.t % n_shards:
    raise ValueError(f"the time axis T={dims.t} of `q` [B, T, H, K] must be divisible by the "
                     f"size {n_shards} of mesh axis {axis!r}.")
  rows = pick_axes(mesh_, [a for a in batch_axes if a != axis], dims.b)
  heads = pick_axes(mesh_, [a for a in head_axes if a != axis and a not in rows], dims.h, dims.hv)
  time_spec = spec(rows, (axis,), heads)                    # [B, T, heads, ...]
  arrays = {"q": q, "k": k, "v": v, "gates": tuple(gates)}
  specs = {"q": time_spec, "k": time_spec, "v": time_spec, "gates": (time_spec,) * len(gates)}
  if initial_state is not None:
    arrays["initial_state"], specs["initial_state"] = initial_state, spec(rows, heads)
  if segment_ids is not None:
    arrays["segment_ids"], specs["segment_ids"] = segment_ids, spec(rows, (axis,))

  def body(a):
    out = context_parallel(name, a["q"], a["k"], a["v"], *a["gates"], axis_name=axis,
                           initial_state=a.get("initial_state"),
                           segment_ids=a.get("segment_ids"), implementation=implementation,
                           **kwargs)
    # The final state is equal on every device of `axis` but typed as varying (it comes from
    # an all_gather): return one copy per shard and keep the last outside.
    final = None if out[1] is None else out[1][None]
    return (out[0], final) + tuple(out[2:])

  out_specs = (time_spec, spec((axis,), rows, heads) if output_final_state else None)
  if return_residual:
    out_specs += (time_spec,)
  fn = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=out_specs,
                     axis_names=manual_axes(mesh_, axis, rows, heads),
                     check_vma=checks_types(implementation))
  out = fn(arrays)
  final = None if out[1] is None else out[1][-1]
  return (out[0], final) + tuple(out[2:])
