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

Scanned stack (`ModelConfig.scan_layers`): the blocks of each position j of the repeating period
P (`config.scan_period`) live in `model.layer_stack[j]` with parameters stacked on a leading
"layers" axis (row r is layer r·P + j; `config.scan_rows[j]` rows), run by one `jax.lax.scan`
over ceil(n_layers / P) iterations; the layers after the last whole period run in its last
iteration, which skips the positions they lack (`lax.cond`), so no layer is traced outside the
loop. The parameters and the function are those of the unrolled model of the same seed
(`stack_params` / `unstack_params` convert pure dicts; `unrolled(model)` gives the unrolled
twin). `layer_blocks()` lists one Block per layer for either layout. Decoding (a cache) runs the
layers unrolled on slices of the stack.

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

# The pure-dict key (and attribute) of a scanned model's stacked blocks; the optimiser reads it.
LAYER_STACK = "layer_stack"


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
      implementation=config.implementation, gpu_tuning=config.gpu_tuning,
      remat_conv_norm=config.remat_conv_norm, **common)


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


def embed_tokens(table: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
  """The rows of `table` [V, d] at `tokens`, in `dtype`: gathered in the table's own dtype
  (float32) and cast after, so the table's gradient is a float32 scatter-add.

  `nnx.Embed.__call__` casts the whole table to `dtype` first, so its gradient is a bf16
  scatter-add (16-bit atomics, contended on frequent tokens): by
  `experiments/step_profile` on the H200 that one kernel took 19 / 61 / 122 ms of the 350M
  softmax / GDN / KDA training steps (docs/BENCHMARKS.md "nineteenth stage"). Same values.
  """
  return jnp.take(table, tokens, axis=0).astype(dtype)


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
    blocks = [Block(config, kind, rngs=block_rng)
              for kind, block_rng in zip(config.layer_types, block_rngs)]
    if config.scan_layers:
      period = config.scan_period
      self.layer_stack = nnx.List([_stack_blocks(blocks[j::period]) for j in range(period)])
    else:
      self.blocks = nnx.List(blocks)
    self.final_norm = final_norm
    if lm_head is not None:
      self.lm_head = lm_head

  def layer_blocks(self) -> list[Block]:
    """One Block per layer, in order. For a scanned model these are views built from slices of
    the stacked parameters (reading them is fine; a change to a view does not reach the model)."""
    if not self.config.scan_layers:
      return list(self.blocks)
    period = self.config.scan_period
    views = [None] * self.config.n_layers
    for j, stacked in enumerate(self.layer_stack):
      graphdef, state = nnx.split(stacked)
      for r in range(self.config.scan_rows[j]):
        views[r * period + j] = nnx.merge(graphdef, _unstack_state(state, r))
    return views

  def init_cache(self, batch: int, max_len: int) -> list[dict[str, jax.Array]]:
    """Per-layer decoding caches for `batch` rows of up to `max_len` tokens."""
    return [block.mixer.init_cache(batch, max_len) for block in self.layer_blocks()]

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
    n_layers = self.config.n_layers
    if cache is not None and len(cache) != n_layers:
      raise ValueError(f"cache has {len(cache)} layers, the model {n_layers}.")
    h = embed_tokens(self.embed.embedding[...], tokens, self.dtype)
    residual = None
    want_cache = cache is not None or max_len is not None
    if self.config.scan_layers and not want_cache:
      return self._scanned_hidden_states(h, segment_ids), None
    new_cache = [] if want_cache else None
    for i, block in enumerate(self.layer_blocks()):
      h, residual, layer_cache = block(h, segment_ids=segment_ids, residual=residual,
                                       cache=None if cache is None else cache[i], max_len=max_len)
      if want_cache:
        new_cache.append(layer_cache)
    return h, new_cache

  def _scanned_hidden_states(self, h: jax.Array, segment_ids) -> jax.Array:
    """The blocks of a scanned model: one `lax.scan`, an iteration per (started) period."""
    residual = None
    if self.config.routing == "cler":
      # The CLER residual rides in the carry, so it needs a value before the first linear
      # layer: zeros, whose injection γ·0 is the unrolled model's (§5.1). float32 holds any
      # residual dtype exactly (the injection normalises in float32 anyway).
      b, t = h.shape[:2]
      residual = jnp.zeros((b, t, self.config.v_heads, self.config.dv), jnp.float32)

    def run(block, h, residual):
      h, residual, _ = block(h, segment_ids=segment_ids, residual=residual)
      return h, None if residual is None else residual.astype(jnp.float32)

    rows = self.config.scan_rows
    iterations = rows[0]
    parts = [nnx.split(stacked) for stacked in self.layer_stack]
    # Full positions are sliced by the scan; the others (one row short: the last iteration has
    # no layer there) are indexed inside the loop and skipped in its last iteration.
    full = {j: state for j, (_, state) in enumerate(parts) if rows[j] == iterations}
    short = {j: state for j, (_, state) in enumerate(parts) if rows[j] < iterations}

    def body(carry, xs):
      i, sliced = xs
      h, residual = carry
      for j, (graphdef, _) in enumerate(parts):
        if j in full:
          h, residual = run(nnx.merge(graphdef, sliced[j]), h, residual)
          continue
        row = jax.tree.map(
            lambda x: jax.lax.dynamic_index_in_dim(x, jnp.minimum(i, rows[j] - 1), keepdims=False),
            short[j])
        h, residual = jax.lax.cond(
            i < rows[j],
            lambda h, residual, row, g=graphdef: run(nnx.merge(g, row), h, residual),
            lambda h, residual, row: (h, residual),
            h, residual, row)
      return (h, residual), None

    (h, residual), _ = jax.lax.scan(body, (h, residual), (jnp.arange(iterations), full))
    return h

  def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """tokens `[B, T]` int -> logits `[B, T, vocab]` float32."""
    return self.forward(tokens, segment_ids)[0]

  def decode_step(self, tokens: jax.Array, cache: list) -> tuple[jax.Array, list]:
    """One token per row: tokens `[B]` -> (logits `[B, vocab]`, new cache)."""
    logits, cache = self.forward(tokens[:, None], cache=cache)
    return logits[:, 0], cache


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def _set_layer_axis(state, add: bool):
  """Prepends (add) or drops the "layers" logical name of every variable's sharding names."""
  for var in jax.tree.leaves(state, is_leaf=_is_variable):
    names = var.get_metadata().get("out_sharding") if _is_variable(var) else None
    if names:
      var.set_metadata(out_sharding=(partition.LAYERS, *names) if add else tuple(names[1:]))
  return state


def _stack_blocks(blocks: list[Block]) -> Block:
  """Equal-structure blocks -> one Block whose parameters are stacked on a leading axis."""
  graphdef, _ = nnx.split(blocks[0])
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in blocks])
  return nnx.merge(graphdef, _set_layer_axis(stacked, add=True))


def _index(x, r: int):
  if isinstance(x, jax.ShapeDtypeStruct):  # an abstract model (nnx.eval_shape)
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
  return x[r]


def _unstack_state(state, r: int):
  """Row r of a stacked block's state, with the per-layer sharding names."""
  return _set_layer_axis(jax.tree.map(lambda x: _index(x, r), state), add=False)


def stack_params(config: ModelConfig, params: dict) -> dict:
  """The pure-dict parameters of the unrolled model -> those of `config`'s scanned model
  (`scan_layers=True`): `blocks[r·P + j]` becomes row r of `layer_stack[j]`. The values are
  unchanged (`unstack_params` inverts it).

  Raises:
    ValueError: config is not a ModelConfig, or params has not one entry per layer in "blocks".
  """
  if not isinstance(config, ModelConfig):
    raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}.")
  blocks = params.get("blocks") if isinstance(params, dict) else None
  if blocks is None or set(blocks) != set(range(config.n_layers)):
    got = None if blocks is None else sorted(blocks)
    raise ValueError(f"params must be an unrolled model's, with 'blocks' 0..{config.n_layers - 1}; "
                     f"got blocks {got}.")
  period = config.scan_period
  out = {k: v for k, v in params.items() if k != "blocks"}
  out[LAYER_STACK] = {
      j: jax.tree.map(lambda *xs: jnp.stack(xs), *[blocks[i] for i in range(j, config.n_layers,
                                                                              period)])
      for j in range(period)}
  return out


def unstack_params(config: ModelConfig, params: dict) -> dict:
  """The pure-dict parameters of `config`'s scanned model -> the unrolled model's
  (the inverse of `stack_params`).

  Raises:
    ValueError: config is not a ModelConfig, or params has no `layer_stack` of P entries.
  """
  if not isinstance(config, ModelConfig):
    raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}.")
  period = config.scan_period
  stack = params.get(LAYER_STACK) if isinstance(params, dict) else None
  if stack is None or set(stack) != set(range(period)):
    got = None if stack is None else sorted(stack)
    raise ValueError(f"params must be a scanned model's, with 'layer_stack' 0..{period - 1} "
                     f"(the period of {config.layer_types}); got layer_stack {got}.")
  out = {k: v for k, v in params.items() if k != LAYER_STACK}
  out["blocks"] = {r * period + j: jax.tree.map(lambda x: x[r], stack[j])
                   for j in range(period) for r in range(config.scan_rows[j])}
  return out


def _with_params(config: ModelConfig, params: dict) -> LanguageModel:
  abstract = nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


def unrolled(model: LanguageModel) -> LanguageModel:
  """The unrolled twin of a scanned model (the same parameters, unstacked); an unrolled model
  is returned as is. For tools that walk `model.blocks` (lineax_attn.inspect)."""
  if not isinstance(model, LanguageModel):
    raise ValueError(f"model must be a LanguageModel, got {type(model).__name__}.")
  if not model.config.scan_layers:
    return model
  config = model.config.replace(scan_layers=False)
  return _with_params(config, unstack_params(model.config, nnx.to_pure_dict(nnx.state(model))))


def scanned(model: LanguageModel) -> LanguageModel:
  """The scanned twin of an unrolled model (the same parameters, stacked); a scanned model is
  returned as is."""
  if not isinstance(model, LanguageModel):
    raise ValueError(f"model must be a LanguageModel, got {type(model).__name__}.")
  if model.config.scan_layers:
    return model
  config = model.config.replace(scan_layers=True)
  return _with_params(config, stack_params(config, nnx.to_pure_dict(nnx.state(model))))


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

  A scanned model (`config.scan_layers`) gets its stacked layout ("layer_stack"): each
  position of the period is one program, the block's init vmapped over its rows' keys, so the
  values equal the unrolled model's stacked (`stack_params`).

  Raises:
    ValueError: config is not a ModelConfig, seed not an int, or out_shardings without one
      entry per block (per position of the period when scanned).
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

  scan = config.scan_layers
  # The blocks' groups: unrolled, one per layer ("blocks"); scanned, one per position j of the
  # period ("layer_stack": its layers j, j + P, ... stacked).
  if scan:
    period = config.scan_period
    groups = [(LAYER_STACK, j, kind, list(range(j, config.n_layers, period)))
              for j, kind in enumerate(config.layer_types[:period])]
  else:
    groups = [("blocks", i, kind, [i]) for i, kind in enumerate(config.layer_types)]

  def outer():
    embed, block_rngs, final_norm, lm_head = _outer_parts(config, nnx.Rngs(seed))
    params = {"embed": _param_dict(embed), "final_norm": _param_dict(final_norm)}
    if lm_head is not None:
      params["lm_head"] = _param_dict(lm_head)
    states = [nnx.state(r) for r in block_rngs]
    rngs = []
    for part, _, _, layers in groups:
      if part == LAYER_STACK:  # one stacked key state per position: vmapped below
        rngs.append(jax.tree.map(lambda *xs: jnp.stack(xs), *[states[i] for i in layers]))
      else:
        rngs.append(states[layers[0]])
    return params, rngs

  group_shardings = [None] * len(groups)
  outer_shardings = None
  if out_shardings is not None:
    rest = dict(out_shardings)
    parts = {part: rest.pop(part, None) for part in ("blocks", LAYER_STACK)}
    for part in sorted({g[0] for g in groups}):
      want = {g[1] for g in groups if g[0] == part}
      if parts[part] is None or set(parts[part]) != want:
        got = None if parts[part] is None else sorted(parts[part])
        what = "positions of the period (stacked blocks)" if scan else "blocks"
        raise ValueError(f"out_shardings must have {part!r} with an entry for each of the "
                         f"{len(want)} {what}, got {got}.")
    group_shardings = [parts[part][index] for part, index, _, _ in groups]
    first = jax.tree.leaves(rest)[0]
    # The blocks' keys: replicated over the parameters' devices (global on every process).
    replicated = (jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
                  if isinstance(first, jax.sharding.NamedSharding) else first)
    outer_shardings = (rest, replicated)
  outer_program = jit(outer, outer_shardings)

  rngs_graphdef = nnx.graphdef(nnx.eval_shape(lambda: nnx.Rngs(seed).fork()))

  def block(kind, rngs_state):
    return _param_dict(Block(config, kind, rngs=nnx.merge(rngs_graphdef, rngs_state)))

  def stacked_block(kind, rngs_states):
    # One program for all rows of a position: the block's init vmapped over the rows' keys
    # (jax's random functions give each key under vmap what they give it alone).
    return jax.vmap(functools.partial(block, kind))(rngs_states)

  programs: dict = {}  # (part, kind, shardings) -> the jitted group: equal ones share a compile
  group_programs = []
  for (part, _, kind, _), shardings in zip(groups, group_shardings):
    key = (part == LAYER_STACK, kind, _sharding_key(shardings))
    if key not in programs:
      fn = stacked_block if part == LAYER_STACK else block
      programs[key] = jit(functools.partial(fn, kind), shardings)
    group_programs.append(programs[key])

  def init() -> dict:
    params, rngs_states = outer_program()
    for (part, index, _, _), program, rngs_state in zip(groups, group_programs, rngs_states):
      params.setdefault(part, {})[index] = program(rngs_state)
    return params

  return init


def init_params(config: ModelConfig, seed: int, *, out_shardings=None,
                compiler_options: dict[str, Any] | None = None) -> dict:
  """`make_param_init(...)()`: the parameters of `LanguageModel(config, rngs=nnx.Rngs(seed))`
  as a pure dict, compiled one block kind at a time (see `make_param_init`)."""
  return make_param_init(config, seed, out_shardings=out_shardings,
                         compiler_options=compiler_options)()
