"""`jax.shard_map` around the kernels: batch rows and value heads split over mesh axes.

A `pallas_call` has no SPMD partitioning rule, so under a mesh XLA would gather its inputs onto
every device. The mixers are independent per batch row and per value head, so each device runs
the kernels on its own block of rows and heads and no communication is needed. Heads are split
contiguously for q/k (H) and v (HV) alike, so a device's value heads h read exactly its own key
heads h // n_rep (GVA stays local).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _axes(names: Sequence[str] | str | None):
  if names is None or names == ():
    return None
  return (names,) if isinstance(names, str) else tuple(names)


def _match_explicit(mesh, arrays, specs):
  """With Explicit mesh axes shard_map requires inputs already laid out as its in_specs: reshard
  them (Auto axes need nothing, shard_map moves the data itself)."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
              if kind == jax.sharding.AxisType.Explicit}
  if not explicit:
    return arrays

  return jax.tree.map(lambda x, spec: jax.sharding.reshard(x, NamedSharding(mesh, spec)),
                      arrays, specs)


def shard_mixer(fn: Callable, *, mesh=None, batch_axes: Sequence[str] | str | None = None,
                head_axes: Sequence[str] | str | None = None) -> Callable:
  """Wraps a mixer of `pallas_kernels.tpu` (same signature) in `jax.shard_map`.

  Args:
    fn: e.g. `pallas_kernels.tpu.gated_delta_rule`.
    mesh: a `Mesh`/`AbstractMesh`, or None for the mesh set with `jax.set_mesh`.
    batch_axes: mesh axes that split the batch dimension (must divide B; not with cu_seqlens).
    head_axes: mesh axes that split the heads (must divide H, hence HV).

  Returns:
    fn(q, k, v, *gates, **kwargs) -> (o, final_state, r), sharded like its inputs' specs:
    [B, T, heads, ...] tensors P(batch, None, heads), states P(batch, heads), segidx/valid
    P(batch, None).
  """
  b_ax, h_ax = _axes(batch_axes), _axes(head_axes)

  def wrapped(q, k, v, *gates, initial_state=None, output_final_state=False, segidx=None,
              valid=None, cu_seqlens=None, **static):
    varlen = cu_seqlens is not None
    if varlen and b_ax is not None:
      raise ValueError("cu_seqlens packs all sequences in one row: the batch cannot be sharded.")

    def tok(x):  # [B, T, heads, ...]
      return P(b_ax, None, h_ax, *(None,) * (x.ndim - 3))

    arrays = {"q": q, "k": k, "v": v, "gates": tuple(gates), "initial_state": initial_state,
              "segidx": segidx, "valid": valid, "cu_seqlens": cu_seqlens}
    specs = {"q": tok(q), "k": tok(k), "v": tok(v), "gates": tuple(tok(g) for g in gates),
             "initial_state": P(None if varlen else b_ax, h_ax), "segidx": P(b_ax, None),
             "valid": P(b_ax, None), "cu_seqlens": P()}
    present = [name for name, x in arrays.items() if x is not None]
    state_spec = P(None if varlen else b_ax, h_ax)
    out_specs = (P(b_ax, None, h_ax, None), state_spec, P(b_ax, None, h_ax, None))

    def local(a):
      a = {**{name: None for name in arrays}, **a}
      return fn(a["q"], a["k"], a["v"], *a["gates"], initial_state=a["initial_state"],
                output_final_state=True, segidx=a["segidx"], valid=a["valid"],
                cu_seqlens=a["cu_seqlens"], **static)

    in_specs = {n: specs[n] for n in present}
    args = _match_explicit(mesh, {n: arrays[n] for n in present}, in_specs)
    o, final, r = jax.shard_map(local, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs,
                                check_vma=False)(args)
    return o, (final if output_final_state else None), r

  return wrapped
