"""Device mesh and logical-axis sharding rules (the pjit way).

The mesh has three axes, `("data", "fsdp", "tensor")` (`MESH_AXES`), all of type Auto (so
`with_sharding_constraint` constrains instead of asserting; see INSTALL.md). With context
parallelism (`sequence > 1`) it has four, `("data", "fsdp", "sequence", "tensor")`
(`MESH_AXES_WITH_SEQUENCE`): the batch's time axis is split over "sequence", and the linear
mixers and softmax layers run under `jax.shard_map` over it (`lineax_attn.parallel`,
docs/CONTEXT_PARALLEL.md). A size-1 sequence axis is left out, so meshes without context
parallelism are unchanged. Parameters and activations are annotated with *logical* axis names,
one per array dimension, and a rule table maps each logical name to mesh axes:

| logical name | mesh axes | what |
|---|---|---|
| batch | ("data", "fsdp") | examples of a batch: data parallel over data and fsdp |
| embed | "fsdp" | the model width d: parameters sharded ZeRO-3 style |
| vocab, mlp, heads, kv_heads | "tensor" | Megatron-style tensor parallel dimensions |
| length | "sequence" | the time axis (context parallel; dropped on meshes without it) |
| kv, head_dim, conv, layers, norm | None | per-head widths, conv taps, ... |

Resolution of one array's logical axes (`logical_to_pspec`):

* A logical name not in the rules, or None, is replicated (None in the PartitionSpec). This is
  deliberate: a layer may name a dimension that the rule table does not care about.
* A mesh axis shards at most one dimension of an array: if two dimensions map to the same mesh
  axis, the first (leftmost) keeps it and the later one drops it.
* Mesh axes that the mesh does not have are dropped (so a rule table can name axes of a larger
  mesh).

`shard_params` checks, before any device transfer, that every sharded dimension is divisible by
the product of its mesh axes' sizes, and raises a ValueError naming the parameter otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
SEQUENCE_AXIS = "sequence"
MESH_AXES_WITH_SEQUENCE = ("data", "fsdp", SEQUENCE_AXIS, "tensor")
BATCH_AXES = ("data", "fsdp")

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]

DEFAULT_RULES: LogicalRules = (
    ("batch", BATCH_AXES),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("length", SEQUENCE_AXIS),
    ("kv", None),
    ("head_dim", None),
    ("conv", None),
    ("layers", None),
    ("norm", None),
)


def resolve_mesh_shape(data: int, fsdp: int, tensor: int, device_count: int, *,
                       sequence: int = 1) -> tuple[int, int, int]:
  """Replaces one -1 by what fills device_count; checks the product (ValueError names axes).

  Returns (data, fsdp, tensor); `sequence` (the context-parallel axis, >= 1, never -1) counts
  in the product and must be given again to `make_mesh`.
  """
  if not isinstance(sequence, int) or isinstance(sequence, bool) or sequence < 1:
    raise ValueError(f"Impossible mesh: the sequence (context parallel) axis size must be an "
                     f"int >= 1, got sequence={sequence!r}")
  shape = {"data": data, "fsdp": fsdp, "tensor": tensor}
  if sequence > 1:
    shape = {"data": data, "fsdp": fsdp, "sequence": sequence, "tensor": tensor}
  desc = ", ".join(f"{k}={v}" for k, v in shape.items())
  fill = [k for k, v in shape.items() if v == -1]
  bad = [k for k, v in shape.items() if v != -1 and v < 1]
  if bad or len(fill) > 1:
    raise ValueError(f"Impossible mesh ({desc}): each axis size must be >= 1, and at most one "
                     f"may be -1 (fill); offending axes: {bad or fill}")
  fixed = math.prod(v for v in shape.values() if v != -1)
  if fill:
    if device_count % fixed:
      raise ValueError(f"Impossible mesh ({desc}): the fixed axes need a multiple of {fixed} "
                       f"devices but {device_count} devices are available")
    shape[fill[0]] = device_count // fixed
  elif fixed != device_count:
    raise ValueError(f"Impossible mesh ({desc}): {'*'.join(shape)} = {fixed} but "
                     f"{device_count} devices are available")
  return shape["data"], shape["fsdp"], shape["tensor"]


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, *, sequence: int = 1,
              devices=None) -> Mesh:
  """A ("data", "fsdp", "tensor") mesh over all devices; one size may be -1 (fill the rest).

  With `sequence > 1` the mesh is ("data", "fsdp", "sequence", "tensor"): the time axis of the
  batch and of the activations is split over "sequence" (context parallelism).
  """
  devices = jax.devices() if devices is None else list(devices)
  data, fsdp, tensor = resolve_mesh_shape(data, fsdp, tensor, len(devices), sequence=sequence)
  if sequence == 1:
    shape, names = (data, fsdp, tensor), MESH_AXES
  else:
    shape, names = (data, fsdp, sequence, tensor), MESH_AXES_WITH_SEQUENCE
  return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names),
                       devices=devices)


def _as_axes(value) -> tuple[str, ...]:
  if value is None:
    return ()
  return (value,) if isinstance(value, str) else tuple(value)


def logical_to_pspec(logical_axes, rules: LogicalRules = DEFAULT_RULES, mesh: Mesh | None = None
                     ) -> PartitionSpec:
  """One array's logical axis names (tuple or PartitionSpec; None = replicated) -> PartitionSpec."""
  if logical_axes is None:
    return PartitionSpec()
  table: dict[str, tuple[str, ...]] = {}
  for name, axes in rules:
    table.setdefault(name, _as_axes(axes))  # the first rule for a name wins
  used: set[str] = set()
  out = []
  for name in tuple(logical_axes):
    axes = () if name is None else table.get(name, ())
    axes = tuple(a for a in axes
                 if a not in used and (mesh is None or a in mesh.axis_names))
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*out)


def _is_axes_leaf(x) -> bool:
  if x is None or isinstance(x, PartitionSpec):
    return True
  return isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x)


def logical_to_sharding(tree, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES):
  """A tree of logical-axis tuples (or PartitionSpecs / None) -> a tree of NamedShardings."""
  return jax.tree.map(lambda axes: NamedSharding(mesh, logical_to_pspec(axes, rules, mesh)),
                      tree, is_leaf=_is_axes_leaf)


def _check_divisible(path, shape, sharding: NamedSharding):
  spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
  if len(spec) > len(shape):
    raise ValueError(f"Parameter {jax.tree_util.keystr(path)} of shape {shape} has "
                     f"{len(sharding.spec)} axis names")
  for dim, (size, axes) in enumerate(zip(shape, spec)):
    n = math.prod(sharding.mesh.shape[a] for a in _as_axes(axes))
    if size % n:
      raise ValueError(f"Parameter {jax.tree_util.keystr(path)} of shape {shape}: dimension {dim} "
                       f"(size {size}) is not divisible by mesh axes {axes} (size {n})")


def shard_params(params, logical_axes, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES):
  """Places params on the mesh by their logical axes (a tree like params of axis tuples).

  Checks divisibility first (ValueError naming the parameter), then `jax.device_put`.
  Leaves may be arrays or jax.ShapeDtypeStruct; for the latter the function returns the
  shardings only (useful for abstract restore targets).
  """
  shardings = logical_to_sharding(logical_axes, mesh, rules)
  jax.tree_util.tree_map_with_path(lambda p, x, s: _check_divisible(p, np.shape(x), s),
                                   params, shardings)
  if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        params, shardings)
  return jax.device_put(params, shardings)


def nnx_logical_axes(state) -> dict:
  """Logical axis tuples from flax.nnx Variables' sharding metadata (None where absent).

  Reads the `out_sharding` metadata that `nnx.with_partitioning(init, names)` sets (older
  names: `sharding_names`, `sharding`). Returns a nested dict shaped like
  `nnx.to_pure_dict(state)`, ready for `shard_params(pure_params, axes, mesh)`.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  out: dict = {}
  for path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_var)[0]:
    meta = var.get_metadata() if is_var(var) else {}
    names = next((meta[k] for k in ("out_sharding", "sharding_names", "sharding") if meta.get(k)),
                 None)
    keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
    node = out
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    node[keys[-1]] = None if names is None else tuple(names)
  return out


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches `[B, T, ...]`: B over ("data", "fsdp"), T over "sequence" if the mesh has it."""
  if SEQUENCE_AXIS in mesh.axis_names:
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, SEQUENCE_AXIS))
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def shard_batch(local_batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """This process's rows -> global arrays sharded over the batch axes.

  Each process passes its own `global_batch / process_count` rows (the data pipeline's
  shard); the global batch dimension must divide by data * fsdp (and T by the sequence axis).
  With a sequence axis, every process must hold whole rows: the sequence axis may not span
  processes (not supported).
  """
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in local_batch.items()}
