"""Logical axis names of every parameter, and the initializer wrapper that attaches them.

Layers never name mesh axes. Each parameter carries *logical* names (read them with
`nnx.get_partition_spec`); a training stack maps them to mesh axes with a rule table (e.g.
`lineax_attn.train.sharding.DEFAULT_RULES`: `embed` -> fsdp; `vocab`, `mlp`, `heads` -> tensor)
without touching the layers.

Vocabulary (axes not listed in a rule table stay replicated):

| name | axis |
|---|---|
| `embed` | the model width d |
| `vocab` | the vocabulary |
| `mlp` | the SwiGLU hidden width |
| `heads` | flattened (head × head-dim) widths: the fused in-projections (q, k, v and gates), the
  attention's fused q/k/v projection, the input of every output projection, the conv channels |
| `conv` | the short-convolution taps |
| `rank` | the bottleneck of a low-rank projection (KDA gate branch, low-rank routing) |
| `layers` | the leading axis of a scanned model's stacked blocks (`ModelConfig.scan_layers`):
  replicated in the default rules, so each stacked parameter keeps its per-layer sharding |
| `None` | tiny per-head parameters (A_log, dt_bias, norm weights, γ): replicated |
"""

from __future__ import annotations

from typing import Any, Callable

from flax import nnx
from flax.core import meta as flax_meta

EMBED = "embed"
VOCAB = "vocab"
MLP = "mlp"
HEADS = "heads"
CONV = "conv"
RANK = "rank"
LAYERS = "layers"


def _eager_sharding() -> bool:
  # Flax 0.12 shards a partitioned variable at creation and fails when no mesh is set. Shard
  # eagerly only when the caller has set a mesh; otherwise keep the names as metadata only.
  return nnx.using_eager_sharding() and flax_meta.global_mesh_defined()


def partitioned(init: Callable[..., Any], axes: tuple[str | None, ...]) -> Callable[..., Any]:
  """`init` with logical axis names attached (`nnx.with_partitioning`), safe without a mesh."""
  return nnx.with_partitioning(init, axes, eager_sharding=_eager_sharding())


def param(rngs: nnx.Rngs | None, init: Callable[..., Any], shape: tuple[int, ...], dtype,
          axes: tuple[str | None, ...]) -> nnx.Param:
  """Creates an `nnx.Param` from `init(key, shape, dtype)` with logical axis names."""
  key = rngs.params() if rngs is not None else None
  return nnx.Param(partitioned(init, axes)(key, shape, dtype))
