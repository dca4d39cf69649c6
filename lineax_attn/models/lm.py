"""Decoder-only language model over the mixer layers (docs/MATH.md §6.1), with cross-layer
routing (§5).

    h_0 = Embed(tokens)
    for each layer ℓ:  h ← h + Mixer_ℓ(RMSNorm(h));  h ← h + SwiGLU(RMSNorm(h));  [+ routing]
    logits = RMSNorm(h) W_head                      (W_head = Embedᵀ when tied)

    from lineax_attn.models import LanguageModel, ModelConfig
    model = LanguageModel(ModelConfig(mixer="gdn", pattern="LLS", n_layers=6), rngs=nnx.Rngs(0))
    logits = model(tokens)                          # [B, T] int -> [B, T, vocab] float32

Parameters without one compile of the whole model: `init_params(config, seed)` (or
`make_param_init`, which keeps its programs) returns `LanguageModel(config, rngs=nnx.Rngs(seed))`'s
parameters as a pure dict, compiled one block kind at a time, optionally created sharded.

Decoding: `init_cache(batch, max_len)`, `forward(tokens, cache=... | max_len=...)` (prefill or
continue) and `decode_step(tokens, cache)`; `lineax_attn.models.decode.generate` wraps them in
`jax.jit`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
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
      implementation=config.implementation, gpu_tuning=config.gpu_tuning, **common)


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


def _outer_parts(config: ModelConfig, rngs: nnx.Rngs):
  """(embedding, one Rngs per block, final norm, LM head or None) in the model's RNG order.

  The embedding takes the stream's first key, block i its (i + 2)-th, forked into the block's
  own Rngs (so a block's parameters are a function of the seed and its index alone, and
  `make_param_init` can build the blocks one compiled program per kind), the untied head the
  last.
  """
  dtype, param_dtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
  normal = nnx.initializers.normal(config.init_std)
  embed = nnx.Embed(
      config.vocab_size, config.d_model, dtype=dtype, param_dtype=param_dtype,
      embedding_init=partition.partitioned(normal, (partition.VOCAB, partition.EMBED)),
      rngs=rngs)
  block_rngs = [rngs.fork() for _ in config.layer_types]
  final_norm = RMSNorm(config.d_model, eps=config.norm_eps, param_dtype=param_dtype)
  lm_head = None
  if not config.tie_embeddings:
    lm_head = nnx.Linear(
        config.d_model, config.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype,
        kernel_init=partition.partitioned(normal, (partition.EMBED, partition.VOCAB)), rngs=rngs)
  return embed, block_rngs, final_norm, lm_head


class LanguageModel(nnx.Module):
  """Embeddings, `config.n_layers` blocks, final RMSNorm and LM head (tied or not)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    if not isinstance(config, ModelConfig):
      raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}.")
    self.config = config
    self.dtype = jnp.dtype(config.dtype)
    embed, block_rngs, final_norm, lm_head = _outer_parts(config, rngs)
    self.embed = embed
    self.blocks = nnx.List([Block(config, kind, rngs=block_rng)
                            for kind, block_rng in zip(config.layer_types, block_rngs)])
    self.final_norm = final_norm
    if lm_head is not None:
      self.lm_head = lm_head

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


def _param_dict(module: nnx.Module) -> dict:
  return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def _sharding_key(shardings) -> Any:
  if shardings is None:
    return None
  leaves, treedef = jax.tree.flatten(shardings)
  return treedef, tuple(leaves)


def make_param_init(config: ModelConfig, seed: int, *, out_shardings=None,
                    compiler_options: dict[str, Any] | None = None) -> Callable[[], dict]:
  """A function `() -> params` that returns the parameters of
  `LanguageModel(config, rngs=nnx.Rngs(seed))` as a pure dict, the values of the model built
  under `jax.jit` bit for bit, compiled one block kind at a time.

  One jitted program of the whole model inlines every parameter's RNG (threefry) and
  initialiser, so its compile grows with the depth (minutes on an H200 for the 24-layer
  Transformer++ of `configs/mixers.py:paper`, docs/BENCHMARKS.md "Start-up"). Here one small
  program makes the embedding, final norm, head and the blocks' keys, and each block comes
  from the compiled program of its kind called with its key: the identical blocks of a stack
  compile once (one program per mixer kind). The returned function keeps its compiled programs (call it again
  without compiling).

  Args:
    config: the model.
    seed: the int seed of `nnx.Rngs(seed)`.
    out_shardings: shardings with the structure of the returned dict (e.g. the trainer's
      parameter shardings): every piece is created directly in its shardings; None = the
      default device. Call the function outside `jax.set_mesh` (under a mesh flax shards each
      new variable by its logical names).
    compiler_options: XLA options of the jitted pieces.

  Raises:
    ValueError: config is not a ModelConfig, seed not an int, or out_shardings without one
      entry per block.
  """
  if not isinstance(config, ModelConfig):
    raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}.")
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise ValueError(f"seed must be an int, got {seed!r}.")
  seed = int(seed)
  options = dict(compiler_options or {})

  def jit(fn, shardings):
    kwargs = {} if shardings is None else {"out_shardings": shardings}
    return jax.jit(fn, compiler_options=options, **kwargs)

  def outer():
    embed, block_rngs, final_norm, lm_head = _outer_parts(config, nnx.Rngs(seed))
    params = {"embed": _param_dict(embed), "final_norm": _param_dict(final_norm)}
    if lm_head is not None:
      params["lm_head"] = _param_dict(lm_head)
    return params, [nnx.state(r) for r in block_rngs]

  block_shardings = [None] * config.n_layers
  outer_shardings = None
  if out_shardings is not None:
    rest = dict(out_shardings)
    blocks = rest.pop("blocks", None)
    if blocks is None or set(blocks) != set(range(config.n_layers)):
      got = None if blocks is None else sorted(blocks)
      raise ValueError(f"out_shardings must have 'blocks' with an entry for each of the "
                       f"{config.n_layers} blocks, got {got}.")
    block_shardings = [blocks[i] for i in range(config.n_layers)]
    first = jax.tree.leaves(rest)[0]
    # The blocks' keys: replicated over the parameters' devices (global on every process).
    replicated = (jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
                  if isinstance(first, jax.sharding.NamedSharding) else first)
    outer_shardings = (rest, replicated)
  outer_program = jit(outer, outer_shardings)

  rngs_graphdef = nnx.graphdef(nnx.eval_shape(lambda: nnx.Rngs(seed).fork()))

  def block(kind, rngs_state):
    return _param_dict(Block(config, kind, rngs=nnx.merge(rngs_graphdef, rngs_state)))

  programs: dict = {}  # (kind, shardings) -> the jitted block: equal blocks share a compile
  block_programs = []
  for kind, shardings in zip(config.layer_types, block_shardings):
    key = (kind, _sharding_key(shardings))
    if key not in programs:
      programs[key] = jit(functools.partial(block, kind), shardings)
    block_programs.append(programs[key])

  def init() -> dict:
    params, rngs_states = outer_program()
    params["blocks"] = {i: program(rngs_states[i]) for i, program in enumerate(block_programs)}
    return params

  return init


def init_params(config: ModelConfig, seed: int, *, out_shardings=None,
                compiler_options: dict[str, Any] | None = None) -> dict:
  """`make_param_init(...)()`: the parameters of `LanguageModel(config, rngs=nnx.Rngs(seed))`
  as a pure dict, compiled one block kind at a time (see `make_param_init`)."""
  return make_param_init(config, seed, out_shardings=out_shardings,
                         compiler_options=compiler_options)()
