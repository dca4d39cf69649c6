"""Decoder-only language model over the mixer layers (docs/MATH.md §6.1), with cross-layer
routing (§5).

    h_0 = Embed(tokens)
    for each layer ℓ:  h ← h + Mixer_ℓ(RMSNorm(h));  h ← h + SwiGLU(RMSNorm(h));  [+ routing]
    logits = RMSNorm(h) W_head                      (W_head = Embedᵀ when tied)

    from lineax_attn.models import LanguageModel, ModelConfig
    model = LanguageModel(ModelConfig(mixer="gdn", pattern="LLS", n_layers=6), rngs=nnx.Rngs(0))
    logits = model(tokens)                          # [B, T] int -> [B, T, vocab] float32

Decoding: `init_cache(batch, max_len)`, `forward(tokens, cache=... | max_len=...)` (prefill or
continue) and `decode_step(tokens, cache)`; `lineax_attn.models.decode.generate` wraps them in
`jax.jit`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lineax_attn.layers import partition
from lineax_attn.layers.attention import SoftmaxAttention
from lineax_attn.layers.linear_mixer import LinearMixer
from lineax_attn.layers.mlp import SwiGLU
from lineax_attn.layers.norm import RMSNorm
from lineax_attn.models.config import SOFTMAX, ModelConfig
from lineax_attn.models.routing import ClerGamma, HiddenRoute


def make_mixer(config: ModelConfig, kind: str, *, rngs: nnx.Rngs):
  """The mixer layer of `kind` with the config's sizes and options."""
  dtype, param_dtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
  common = dict(init_std=config.init_std, out_init_std=config.out_init_std, dtype=dtype,
                param_dtype=param_dtype, rngs=rngs)
  if kind == SOFTMAX:
    return SoftmaxAttention(
        config.d_model, num_heads=config.attn_heads, num_kv_heads=config.attn_kv_heads,
        head_dim=config.attn_head_dim, rope_base=config.rope_base, window=config.window,
        output_gate=config.attention_output_gate, implementation=config.attn_implementation,
        **common)
  return LinearMixer(
      kind, config.d_model, num_heads=config.num_heads, num_v_heads=config.num_v_heads,
      head_dim_k=config.head_dim_k, head_dim_v=config.head_dim_v, conv_width=config.conv_width,
      output_gate=config.output_gate, gate_rank=config.gate_rank, gate_init=config.gate_init,
      gate_lower_bound=config.gate_lower_bound, allow_neg_eigval=config.allow_neg_eigval,
      norm_eps=config.norm_eps, chunk_size=config.chunk_size,
      implementation=config.implementation, **common)


class Block(nnx.Module):
  """Pre-norm residual block: mixer + SwiGLU, plus this layer's routing parameters."""

  def __init__(self, config: ModelConfig, kind: str, *, rngs: nnx.Rngs):
    dtype, param_dtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
    self.kind = kind
    self.norm1 = RMSNorm(config.d_model, eps=config.norm_eps, param_dtype=param_dtype)
    self.mixer = make_mixer(config, kind, rngs=rngs)
    self.norm2 = RMSNorm(config.d_model, eps=config.norm_eps, param_dtype=param_dtype)
    self.mlp = SwiGLU(config.d_model, config.mlp_dim, init_std=config.init_std,
                      out_init_std=config.out_init_std, dtype=dtype, param_dtype=param_dtype,
                      rngs=rngs)
    self.routing = None if kind == SOFTMAX else config.routing
    if self.routing == "cler":
      self.cler = ClerGamma(config.v_heads, config.dv, shape=config.cler_gamma,
                            init=config.cler_gamma_init, normalize=config.routing_norm,
                            param_dtype=param_dtype)
    elif self.routing in ("cler_h", "clvr"):
      self.route = HiddenRoute(config.v_heads, config.dv, config.d_model,
                               rank=config.routing_rank,
                               normalize=config.routing_norm and self.routing == "cler_h",
                               init_std=config.init_std, dtype=dtype, param_dtype=param_dtype,
                               rngs=rngs)

  def __call__(self, h: jax.Array, *, segment_ids=None, residual=None, cache=None,
               max_len=None) -> tuple[jax.Array, jax.Array | None, Any]:
    """h `[B, T, d]` -> (h, residual for the next linear layer (CLER v1), new cache)."""
    value_delta = None
    if self.routing == "cler":
      b, t = h.shape[:2]
      if residual is None:  # the first linear layer: γ·0 keeps γ in the graph (§5.1)
        residual = jnp.zeros((b, t, self.mixer.num_v_heads, self.mixer.head_dim_v), h.dtype)
      value_delta = self.cler(residual)
    out = self.mixer.forward(self.norm1(h), segment_ids, value_delta=value_delta, cache=cache,
                             max_len=max_len, with_residual=self.routing in ("cler", "cler_h"))
    h = h + out.y.astype(h.dtype)
    h = h + self.mlp(self.norm2(h)).astype(h.dtype)
    if self.routing == "cler":
      residual = out.r
    elif self.routing == "cler_h":
      h = h + self.route(out.r).astype(h.dtype)
    elif self.routing == "clvr":
      h = h + self.route(out.v).astype(h.dtype)
    return h, residual, out.cache


class LanguageModel(nnx.Module):
  """Embeddings, `config.n_layers` blocks, final RMSNorm and LM head (tied or not)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    if not isinstance(config, ModelConfig):
      raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}.")
    self.config = config
    dtype, param_dtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
    self.dtype = dtype
    normal = nnx.initializers.normal(config.init_std)
    self.embed = nnx.Embed(
        config.vocab_size, config.d_model, dtype=dtype, param_dtype=param_dtype,
        embedding_init=partition.partitioned(normal, (partition.VOCAB, partition.EMBED)),
        rngs=rngs)
    self.blocks = nnx.List([Block(config, kind, rngs=rngs) for kind in config.layer_types])
    self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps, param_dtype=param_dtype)
    if not config.tie_embeddings:
      self.lm_head = nnx.Linear(
          config.d_model, config.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype,
          kernel_init=partition.partitioned(normal, (partition.EMBED, partition.VOCAB)), rngs=rngs)

  def init_cache(self, batch: int, max_len: int) -> list[dict[str, jax.Array]]:
    """Per-layer decoding caches for `batch` rows of up to `max_len` tokens."""
    return [block.mixer.init_cache(batch, max_len) for block in self.blocks]

  def logits(self, h: jax.Array) -> jax.Array:
    """Final norm and LM head: h `[..., d]` -> logits `[..., vocab]` float32."""
    h = self.final_norm(h)
    if self.config.tie_embeddings:
      return self.embed.attend(h).astype(jnp.float32)
    return self.lm_head(h).astype(jnp.float32)

  def forward(self, tokens: jax.Array, segment_ids: jax.Array | None = None, *,
              cache: list | None = None, max_len: int | None = None
              ) -> tuple[jax.Array, list | None]:
    """tokens `[B, T]` -> (logits `[B, T, vocab]` float32, new cache or None).

    With `max_len` (and no cache) this is a prefill that returns a cache for up to max_len
    tokens; with `cache` it continues from it. segment_ids `[B, T]` packs sequences (0 = pad).
    """
    h, new_cache = self.hidden_states(tokens, segment_ids, cache=cache, max_len=max_len)
    return self.logits(h), new_cache

  def hidden_states(self, tokens: jax.Array, segment_ids: jax.Array | None = None, *,
                    cache: list | None = None, max_len: int | None = None
                    ) -> tuple[jax.Array, list | None]:
    """Like `forward` but returns the last block's output `[B, T, d]` (before the final norm),
    e.g. to compute logits at a few positions only (a long prefill needs just the last)."""
    if tokens.ndim != 2:
      raise ValueError(f"tokens must have shape [B, T], got {tokens.shape}.")
    if cache is not None and len(cache) != len(self.blocks):
      raise ValueError(f"cache has {len(cache)} layers, the model {len(self.blocks)}.")
    h = self.embed(tokens).astype(self.dtype)
    residual = None
    want_cache = cache is not None or max_len is not None
    new_cache = [] if want_cache else None
    for i, block in enumerate(self.blocks):
      h, residual, layer_cache = block(h, segment_ids=segment_ids, residual=residual,
                                       cache=None if cache is None else cache[i], max_len=max_len)
      if want_cache:
        new_cache.append(layer_cache)
    return h, new_cache

  def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """tokens `[B, T]` int -> logits `[B, T, vocab]` float32."""
    return self.forward(tokens, segment_ids)[0]

  def decode_step(self, tokens: jax.Array, cache: list) -> tuple[jax.Array, list]:
    """One token per row: tokens `[B]` -> (logits `[B, vocab]`, new cache)."""
    logits, cache = self.forward(tokens[:, None], cache=cache)
    return logits[:, 0], cache
