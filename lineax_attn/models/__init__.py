"""Models over the mixer layers: config, decoder-only LM with hybrid stacks and routing, decoding.

    from lineax_attn.models import LanguageModel, ModelConfig, generate
    config = ModelConfig(mixer="gdn", pattern="LLS", n_layers=6, routing="clvr")
    model = LanguageModel(config, rngs=nnx.Rngs(0))
"""

from __future__ import annotations

from lineax_attn.models.config import (MIXERS, PRESETS, ROUTING_MODES, ModelConfig,
                                       canonical_mixer, get_config)
from lineax_attn.models.decode import cache_bytes, decode_step, generate, init_cache, prefill
from lineax_attn.models.lm import (Block, LanguageModel, init_params, make_mixer, make_param_init,
                                   scanned, stack_params, unrolled, unstack_params)

_PARAMS_NAMES = ("abstract_model", "count_params", "format_breakdown", "param_breakdown")


def __getattr__(name):
  # Imported lazily so `python -m lineax_attn.models.params` runs without a runpy warning.
  if name in _PARAMS_NAMES:
    from lineax_attn.models import params
    return getattr(params, name)
  raise AttributeError(f"module 'lineax_attn.models' has no attribute {name!r}")


__all__ = [
    "ModelConfig", "LanguageModel", "Block", "make_mixer", "make_param_init", "init_params", "get_config", "canonical_mixer",
    "PRESETS", "MIXERS", "ROUTING_MODES", "generate", "init_cache", "prefill", "decode_step",
    "cache_bytes", "stack_params", "unstack_params", "scanned", "unrolled",
    "count_params", "param_breakdown", "format_breakdown", "abstract_model",
]
