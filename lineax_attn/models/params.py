"""Parameter counting and a per-layer breakdown (docs/MATH.md §4.5, §9 item 19).

Counts come from the model's own parameters, built abstractly (`nnx.eval_shape`), so a 350M
preset is counted without allocating it:

    python -m lineax_attn.models.params gdn_350m deltanet_350m softmax_350m
"""

from __future__ import annotations

import argparse
import collections
import math

import jax
from flax import nnx

from lineax_attn.models.config import PRESETS, ModelConfig, get_config
from lineax_attn.models.lm import LanguageModel


def abstract_model(config: ModelConfig) -> LanguageModel:
  """The model with `jax.ShapeDtypeStruct` parameters (no memory, no compute)."""
  return nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))


def count_params(tree) -> int:
  """Number of parameter scalars of a module or state (only `nnx.Param`s)."""
  state = nnx.state(tree, nnx.Param) if isinstance(tree, nnx.Module) else tree
  return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


def param_breakdown(model: LanguageModel) -> dict:
  """Counts by part.

  Returns a dict with `embedding`, `lm_head`, `final_norm`, `layers` (a list with, per layer,
  `kind`, `mixer`, `mlp`, `norms`, `routing`), `by_kind` (mixer params summed per kind),
  `total` and `non_embedding` (total − embedding − untied head).
  """
  layers = []
  for block in model.layer_blocks():  # a scanned model's stack: one view per layer
    routing = 0
    if hasattr(block, "cler"):
      routing = count_params(block.cler)
    elif hasattr(block, "route"):
      routing = count_params(block.route)
    layers.append({
        "kind": block.kind,
        "mixer": count_params(block.mixer),
        "mlp": count_params(block.mlp),
        "norms": count_params(block.norm1) + count_params(block.norm2),
        "routing": routing,
    })
  embedding = count_params(model.embed)
  head = 0 if model.config.tie_embeddings else count_params(model.lm_head)
  total = count_params(model)
  by_kind = collections.Counter()
  for layer in layers:
    by_kind[layer["kind"]] += layer["mixer"]
  return {
      "embedding": embedding, "lm_head": head, "final_norm": count_params(model.final_norm),
      "layers": layers, "by_kind": dict(by_kind), "total": total,
      "non_embedding": total - embedding - head,
  }


def format_breakdown(model_or_config) -> str:
  """A printable table of `param_breakdown`."""
  model = (abstract_model(model_or_config) if isinstance(model_or_config, ModelConfig)
           else model_or_config)
  bd = param_breakdown(model)
  lines = [f"{'layer':>5} {'kind':<17} {'mixer':>12} {'mlp':>12} {'norms':>7} {'routing':>10}"]
  for i, layer in enumerate(bd["layers"]):
    lines.append(f"{i:>5} {layer['kind']:<17} {layer['mixer']:>12,} {layer['mlp']:>12,} "
                 f"{layer['norms']:>7,} {layer['routing']:>10,}")
  counts = collections.Counter(layer["kind"] for layer in bd["layers"])
  for kind, n in counts.items():
    lines.append(f"  {n} × {kind}: {bd['by_kind'][kind] // n:,} per layer")
  lines.append(f"embedding {bd['embedding']:,}   lm_head {bd['lm_head']:,}   "
               f"final_norm {bd['final_norm']:,}")
  lines.append(f"non-embedding {bd['non_embedding']:,} ({bd['non_embedding'] / 1e6:.1f}M)   "
               f"total {bd['total']:,} ({bd['total'] / 1e6:.1f}M)")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("presets", nargs="*", default=["gdn_350m", "deltanet_350m", "softmax_350m"],
                      help=f"preset names: {sorted(PRESETS)}")
  parser.add_argument("--routing", default=None, help="routing mode to add (cler, cler_h, clvr)")
  args = parser.parse_args(argv)
  for name in args.presets:
    overrides = {} if args.routing is None else {"routing": args.routing}
    print(f"== {name}{'' if args.routing is None else ' + ' + args.routing}")
    print(format_breakdown(get_config(name, **overrides)))


if __name__ == "__main__":
  main()
