"""Flax NNX layers over `lineax_attn.ops` (docs/MATH.md §4).

    from lineax_attn.layers import LinearMixer, SoftmaxAttention
    mixer = LinearMixer("gdn", d_model=256, num_heads=2, num_v_heads=4, head_dim_k=64,
                        head_dim_v=64, implementation="chunk", rngs=nnx.Rngs(0))
    y = mixer(x)                                   # [B, T, 256] -> [B, T, 256]

Every mixer (the five linear ones and softmax attention) has the same surface: `__call__(x,
segment_ids=None)`, `forward(x, segment_ids, *, value_delta, cache, max_len) -> MixerOutput`,
`init_cache(batch, max_len)` and `decode_step(x, cache)`.
"""

from __future__ import annotations

from lineax_attn.layers.attention import SoftmaxAttention
from lineax_attn.layers.conv import ShortConv, causal_depthwise_conv
from lineax_attn.layers.linear_mixer import (DEFAULT_OUTPUT_GATE, LINEAR_MIXERS, LinearMixer,
                                             MixerOutput, canonical_linear_mixer)
from lineax_attn.layers.mlp import SwiGLU
from lineax_attn.layers.norm import GatedHeadNorm, RMSNorm, l2_normalize

__all__ = [
    "LinearMixer", "SoftmaxAttention", "MixerOutput", "ShortConv", "SwiGLU", "RMSNorm",
    "GatedHeadNorm", "causal_depthwise_conv", "l2_normalize", "LINEAR_MIXERS",
    "DEFAULT_OUTPUT_GATE", "canonical_linear_mixer",
]
