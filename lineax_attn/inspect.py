"""Inspection helpers: open the recurrent state, gates and routing of a model, for notebooks.

    from lineax_attn import inspect as li
    model, losses = li.train_tiny(config, steps=100)     # or li.load_model(workdir)
    layers = li.capture(model, tokens).layers            # {layer index: LayerCapture}
    cap = layers[0]
    li.state_norms(cap.states)                           # [B, T, HV]
    li.effective_rank(cap.states)                        # [B, T, HV]
    li.memory_readout(cap.states, cap.k, cap.v)          # [B, HV, T, T] cosines
    li.forgetting_curve(cap.gates["g"])                  # [B, T, HV]
    li.routing_summary(model)                            # one dict per routed layer
    li.plot_state_heatmaps(cap.states); li.plot_gates(cap); li.plot_readout(...)

How `capture` sees inside a layer without a second copy of its code: `LinearMixer.forward`
`sow`s the exact q, k, v, gates and output-gate logits it hands to its op, but only while
`nnx.capture` is running (otherwise it does nothing). `capture` runs the model under
`nnx.capture` with `method_outputs`, which also records every module method's output (each
mixer's `forward` result y and each block's normalised mixer input). The state after every token,
S_t `[B, T, HV, K, V]` float32, is then recomputed from the captured tensors by the step
functions of the `lax.scan` reference (`lineax_attn.ops.reference`), so it is exact
(docs/MATH.md §2) and costs T·HV·K·V floats per row: `capture` refuses prompts longer than
`MAX_TRAJECTORY_LEN`.

Memory readout: for a state S_t and an earlier key k_j, Sᵀ_t k_j is what the memory returns for
that key; its cosine with the written value v_j says how well token j is still recalled at t.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lineax_attn.ops import api as ops_api
from lineax_attn.ops import reference
from lineax_attn.ops import segments as seg_lib
from lineax_attn.ops import specs

MAX_TRAJECTORY_LEN = 512  # S_t for every t costs T·HV·K·V floats per row: short prompts only

# Layer kind (models) -> op name (from `ops.specs`).
OP_NAMES = {spec.layer_name: spec.name for spec in specs.SPECS.values()}


def _op_name(mixer: str) -> str:
  if mixer in OP_NAMES:
    return OP_NAMES[mixer]
  if mixer in OP_NAMES.values():
    return mixer
  raise ValueError(f"mixer must be one of {sorted(OP_NAMES)} (or an op name "
                   f"{sorted(OP_NAMES.values())}), got {mixer!r}.")


# ------------------------------------------------------------------------------------------
# State trajectory


def state_trajectory(mixer: str, q, k, v, gates: Mapping[str, Any] | None = None, *,
                     scale: float | None = None, segment_ids=None, initial_state=None,
                     max_len: int = MAX_TRAJECTORY_LEN):
  """The scan reference run over a short sequence, keeping the state after every token.

  Args:
    mixer: a layer kind ("linear_attention", "deltanet", "gdn", "kda", "gdn2") or op name.
    q, k: `[B, T, H, K]`; v: `[B, T, HV, V]`.
    gates: the op's gates by argument name: beta / g `[B, T, HV]` (KDA, GDN-2 g and b
      `[B, T, HV, K]`, GDN-2 w `[B, T, HV, V]`); None or {} for linear attention.
    scale: query scale (default K ** -0.5, as the ops).
    segment_ids: `[B, T]` int, docs/MATH.md §1.7 (resets; 0 = padding, an identity step).
    initial_state: `[B, HV, K, V]` float32 or None.
    max_len: the longest T accepted.

  Returns:
    (o `[B, T, HV, V]`, states `[B, T, HV, K, V]`, r `[B, T, HV, V]`), float32; states[:, t] is
    S_t, the state after token t (at padding: the state before it).
  """
  op = _op_name(mixer)
  dims = ops_api.check_qkv(q, k, v)
  if dims.t > max_len:
    raise ValueError(f"the state trajectory keeps T·HV·K·V floats per row: T={dims.t} exceeds "
                     f"max_len={max_len}; inspect a shorter prompt (or raise max_len).")
  gates = dict(gates or {})
  expected = [name for name, _ in ops_api.MIXER_GATES[op]]
  if sorted(gates) != sorted(expected):
    raise ValueError(f"gates for {op} must be exactly {expected}, got {sorted(gates)}.")
  checked = {name: ops_api.check_gate(op, name, gates[name], axis, dims)
             for name, axis in ops_api.MIXER_GATES[op]}
  scale = ops_api.check_scale(scale, dims.dk)
  layout = ops_api.check_segments(segment_ids, None, dims)
  initial_state = ops_api.check_initial_state(initial_state, dims, layout)
  b, t = dims.b, dims.t
  valid = jnp.ones((b, t), bool) if layout.valid is None else layout.valid
  start = (jnp.zeros((b, t), bool) if layout.segidx is None
           else seg_lib.segment_start_flags(layout.segidx))
  if initial_state is None:
    initial_state = jnp.zeros((b, dims.hv, dims.dk, dims.dv), jnp.float32)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return _trajectory(op, f32(q), f32(k), f32(v), checked, float(scale), valid, start,
                     initial_state)


@functools.partial(jax.jit, static_argnames=("op", "scale"))
def _trajectory(op, q, k, v, gates, scale, valid, start, initial_state):
  step = reference.STEPS[op]
  n_rep = v.shape[2] // q.shape[2]
  # GVA: value head j reads key head j // n_rep (as the reference does).
  q = jnp.repeat(q, n_rep, axis=2) * scale
  k = jnp.repeat(k, n_rep, axis=2)
  to_rows = lambda x: jnp.moveaxis(x, 2, 1)  # [B, T, HV, ...] -> [B, HV, T, ...]
  xs = {"q": to_rows(q), "k": to_rows(k), "v": to_rows(v)}
  xs.update({name: to_rows(x) for name, x in gates.items()})
  names = tuple(name for name, _ in ops_api.MIXER_GATES[op])  # the step's argument order
  zeros = jnp.zeros(initial_state.shape[-2:], jnp.float32)

  def run_row(xs_b, s0_b, valid_b, start_b):
    def run_head(xs_h, s0_h):
      o, r, _, states = reference._scan_row(  # pylint: disable=protected-access
          step, s0_h, xs_h, valid_b, start_b, lambda i: zeros, names, keep_states=True)
      return o, r, states
    return jax.vmap(run_head)(xs_b, s0_b)

  o, r, states = jax.vmap(run_row)(xs, initial_state, valid, start)
  return jnp.moveaxis(o, 1, 2), jnp.moveaxis(states, 1, 2), jnp.moveaxis(r, 1, 2)


# ------------------------------------------------------------------------------------------
# Capture


@dataclasses.dataclass(frozen=True)
class LayerCapture:
  """What one linear layer saw and did on a prompt (all float32 numpy-convertible arrays).

  Attributes:
    layer: the block index in the model; kind: the layer's mixer ("gdn", ...).
    x: `[B, T, d]` the mixer's input (after the block's pre-norm).
    q, k: `[B, T, H, K]` (L2-normalised); v: `[B, T, HV, V]` the write value (docs/MATH.md §2.7).
    gates: the op's gates by argument name: "g" (log decay, `[B, T, HV]` for GDN, `[B, T, HV, K]`
      for KDA and GDN-2), "beta" `[B, T, HV]`, GDN-2's erase "b" `[B, T, HV, K]` and write "w"
      `[B, T, HV, V]`.
    z: `[B, T, HV, V]` output-gate logits, or None without an output gate.
    o: `[B, T, HV, V]` the op's output; r: `[B, T, HV, V]` the write residual.
    states: `[B, T, HV, K, V]` S_t after every token.
    y: `[B, T, d]` the layer's output as the model computed it.
    scale: the query scale; segment_ids: `[B, T]` or None.
  """
  layer: int
  kind: str
  x: jax.Array
  q: jax.Array
  k: jax.Array
  v: jax.Array
  gates: dict[str, jax.Array]
  z: jax.Array | None
  o: jax.Array
  r: jax.Array
  states: jax.Array
  y: jax.Array
  scale: float
  segment_ids: jax.Array | None = None

  @property
  def final_state(self) -> jax.Array:
    """`[B, HV, K, V]` the state after the last real token."""
    return self.states[:, -1]

  @property
  def decay(self) -> jax.Array | None:
    """α = exp(g), or None for mixers without a decay (linear attention, DeltaNet)."""
    return None if "g" not in self.gates else jnp.exp(self.gates["g"])


@dataclasses.dataclass(frozen=True)
class ModelCapture:
  """`capture`'s result: the logits `[B, T, vocab]` and one `LayerCapture` per linear layer."""
  logits: jax.Array
  layers: dict[int, LayerCapture]


def _value(variable):
  """The first (only) value a module sowed under a name."""
  values = variable.get_value() if hasattr(variable, "get_value") else variable
  return values[0]


def _unrolled(model):
  """A scanned LanguageModel's unrolled twin (these tools walk `model.blocks`)."""
  if getattr(getattr(model, "config", None), "scan_layers", False):
    from lineax_attn.models import lm  # pylint: disable=g-import-not-at-top
    return lm.unrolled(model)
  return model


@functools.partial(jax.jit, static_argnums=0)
def _capture_jit(graphdef, state, tokens, segment_ids):
  model = nnx.merge(graphdef, state)
  run = nnx.capture(lambda m: m(tokens, segment_ids), nnx.Intermediate,
                    method_outputs=nnx.Intermediate)
  logits, found = run(model)
  layers = {}
  for i, block in enumerate(model.blocks):
    node = found["blocks"][i]
    if "op_inputs" not in node.get("mixer", {}):
      continue  # a softmax layer
    inputs = _value(node["mixer"]["op_inputs"])
    layers[i] = dict(x=_value(node["norm1"]["__call__"]), y=_value(node["mixer"]["forward"]).y,
                     q=inputs["q"], k=inputs["k"], v=inputs["v"], gates=tuple(inputs["gates"]),
                     z=inputs["z"])
  return logits, layers


def capture(model, tokens, segment_ids=None, *, max_len: int = MAX_TRAJECTORY_LEN
            ) -> ModelCapture:
  """Runs `model` on a short prompt and records every linear layer (see `LayerCapture`).

  Args:
    model: a `lineax_attn.models.LanguageModel`.
    tokens: `[B, T]` int, T <= max_len.
    segment_ids: `[B, T]` int or None (docs/MATH.md §1.7).
    max_len: the longest prompt accepted (the trajectory holds T·HV·K·V floats per row).

  Returns:
    `ModelCapture(logits, layers)`; layers maps block index -> `LayerCapture` for the linear
    layers (softmax layers have no state and are left out).
  """
  model = _unrolled(model)
  if not hasattr(model, "blocks") or not hasattr(model, "config"):
    raise ValueError(f"model must be a lineax_attn LanguageModel, got {type(model).__name__}.")
  tokens = jnp.asarray(tokens)
  if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens must be an int array [B, T], got {tokens.dtype} {tokens.shape}.")
  if tokens.shape[1] > max_len:
    raise ValueError(f"tokens has T={tokens.shape[1]} > max_len={max_len}: capture keeps the "
                     f"state after every token (T·HV·K·V floats per row); use a shorter prompt.")
  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids)
    if segment_ids.shape != tokens.shape or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids must be an int array of the tokens' shape {tokens.shape}, "
                       f"got {segment_ids.dtype} {segment_ids.shape}.")
  graphdef, state = nnx.split(model)
  logits, raw = _capture_jit(graphdef, state, tokens, segment_ids)
  layers = {}
  for i, got in raw.items():
    block = model.blocks[i]
    mixer = block.mixer
    op = OP_NAMES[mixer.kind]
    gates = {name: g for (name, _), g in zip(ops_api.MIXER_GATES[op], got["gates"])}
    scale = mixer.head_dim_k ** -0.5  # the layer passes no scale: the ops' default
    o, states, r = state_trajectory(mixer.kind, got["q"], got["k"], got["v"], gates,
                                    scale=scale, segment_ids=segment_ids, max_len=max_len)
    b, t = tokens.shape
    z = got["z"]
    if z is not None:
      z = z.reshape(b, t, mixer.num_v_heads, mixer.head_dim_v)
    layers[i] = LayerCapture(layer=i, kind=mixer.kind, x=got["x"], q=got["q"], k=got["k"],
                             v=got["v"], gates=gates, z=z, o=o, r=r, states=states, y=got["y"],
                             scale=scale, segment_ids=segment_ids)
  return ModelCapture(logits=logits, layers=layers)


def layer_output(mixer, cap: LayerCapture) -> jax.Array:
  """The mixer's output rebuilt from a capture: out_proj(norm(o, z)) `[B, T, d]` (a check that
  the captured tensors are the ones the layer used)."""
  b, t = cap.o.shape[:2]
  o = cap.o.astype(mixer.dtype)
  y = mixer.norm(o, cap.z).reshape(b, t, -1)
  return mixer.out_proj(y)


# ------------------------------------------------------------------------------------------
# Measures


def _check_matrices(name: str, x, min_ndim: int = 2):
  x = jnp.asarray(x)
  if x.ndim < min_ndim or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must be a float array [..., K, V] (e.g. states [B, T, HV, K, V]), "
                     f"got {x.dtype} {x.shape}.")
  return x.astype(jnp.float32)


def state_norms(states) -> jax.Array:
  """Frobenius norm ‖S‖_F of each state: `[..., K, V] -> [...]` (e.g. `[B, T, HV]`)."""
  states = _check_matrices("states", states)
  return jnp.sqrt(jnp.sum(jnp.square(states), axis=(-2, -1)))


def effective_rank(states, eps: float = 1e-12) -> jax.Array:
  """exp(entropy of the normalised singular values) of each state: `[..., K, V] -> [...]`.

  Between 1 (one direction) and min(K, V) (all singular values equal); 0 for a zero matrix.
  """
  states = _check_matrices("states", states)
  s = jnp.linalg.svd(states, compute_uv=False)
  total = jnp.sum(s, axis=-1, keepdims=True)
  p = s / jnp.maximum(total, eps)
  entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
  return jnp.where(total[..., 0] > eps, jnp.exp(entropy), 0.0)


def _keys_to_value_heads(keys, hv: int, name: str):
  keys = jnp.asarray(keys, jnp.float32)
  if keys.ndim != 4 or hv % keys.shape[2]:
    raise ValueError(f"{name} must be [B, T, H, K] with H dividing the state's HV={hv}, got "
                     f"{keys.shape}.")
  return jnp.repeat(keys, hv // keys.shape[2], axis=2)


def retrieve(states, keys) -> jax.Array:
  """What each state returns for each key: R[b, h, t, j] = S_tᵀ k_j, `[B, HV, T, T, V]`.

  states `[B, T, HV, K, V]`; keys `[B, T, H, K]` (H divides HV; key head h // (HV/H)).
  """
  states = _check_matrices("states", states, 5)
  b, t, hv, dk, _ = states.shape
  keys = _keys_to_value_heads(keys, hv, "keys")
  if keys.shape[:2] != (b, t) or keys.shape[-1] != dk:
    raise ValueError(f"keys must be [B={b}, T={t}, H, K={dk}] to match states, got {keys.shape}.")
  return jnp.einsum("bthkv,bjhk->bhtjv", states, keys, precision=jax.lax.Precision.HIGHEST)


def memory_readout(states, keys, values, eps: float = 1e-8) -> jax.Array:
  """How strongly each state still returns each earlier key's value.

  C[b, h, t, j] = cos(S_tᵀ k_j, v_j) for j <= t, NaN above the diagonal (j > t, not yet written).

  Args:
    states: `[B, T, HV, K, V]` (`LayerCapture.states`).
    keys: `[B, T, H, K]` the keys that wrote them (H divides HV).
    values: `[B, T, HV, V]` the values to compare with (the write values v).

  Returns:
    `[B, HV, T, T]` float32 cosines (t = state, j = key).
  """
  read = retrieve(states, keys)
  b, t, hv, _, dv = states.shape
  values = jnp.asarray(values, jnp.float32)
  if values.shape != (b, t, hv, dv):
    raise ValueError(f"values must be [B, T, HV, V] = {(b, t, hv, dv)}, got {values.shape}.")
  target = jnp.moveaxis(values, 2, 1)[:, :, None]  # [B, HV, 1, T, V]
  dot = jnp.sum(read * target, axis=-1)
  norms = jnp.linalg.norm(read, axis=-1) * jnp.linalg.norm(target, axis=-1)
  cos = dot / jnp.maximum(norms, eps)
  causal = jnp.tril(jnp.ones((t, t), bool))
  return jnp.where(causal, cos, jnp.nan)


def forgetting_curve(g, *, reduce_channels: bool = True) -> jax.Array:
  """Cumulative decay exp(Σ_{s<=t} g_s): the fraction of what was in the state before token 0
  that survives after token t (the delta edits aside).

  Args:
    g: log decay `[B, T, HV]` (GDN) or `[B, T, HV, K]` (KDA, GDN-2), <= 0.
    reduce_channels: average a per-channel curve over the K channels -> `[B, T, HV]`.

  Returns:
    `[B, T, HV]` (or `[B, T, HV, K]` with reduce_channels=False), in (0, 1], non-increasing in t.
  """
  g = jnp.asarray(g)
  if g.ndim not in (3, 4) or not jnp.issubdtype(g.dtype, jnp.floating):
    raise ValueError(f"g must be a float log decay [B, T, HV] or [B, T, HV, K], got "
                     f"{g.dtype} {g.shape}.")
  curve = jnp.exp(jnp.cumsum(g.astype(jnp.float32), axis=1))
  return curve.mean(axis=-1) if (reduce_channels and g.ndim == 4) else curve


def half_life(g) -> jax.Array:
  """Tokens for the decay to halve at the mean rate: ln 2 / mean(−g) per (row, head), `[B, HV]`
  (channel gates are averaged over K; inf where nothing decays)."""
  g = jnp.asarray(g, jnp.float32)
  if g.ndim not in (3, 4):
    raise ValueError(f"g must be [B, T, HV] or [B, T, HV, K], got {g.shape}.")
  rate = -g.mean(axis=1)
  rate = rate.mean(axis=-1) if g.ndim == 4 else rate
  return jnp.where(rate > 0, math.log(2.0) / jnp.maximum(rate, 1e-30), jnp.inf)


def routing_summary(model) -> list[dict[str, Any]]:
  """The routing parameters of every routed layer (docs/MATH.md §5), one dict per layer.

  Keys: "layer" (block index), "kind" (mixer), "mode" ("cler", "cler_h", "clvr"), and
  * CLER v1: "gamma" (numpy, scalar / `[HV, 1]` / `[HV, d_v]`), "gamma_abs_mean";
  * CLER-H / CLVR: "proj_norm" (‖P‖_F of the effective H_v·d_v -> d map; for a low-rank P the
    product of its two factors), "head_norms" `[HV]` (the rows of P that read each value head),
    "rank" (None = full rank).
  An unrouted model gives [].
  """
  model = _unrolled(model)
  if not hasattr(model, "blocks"):
    raise ValueError(f"model must be a lineax_attn LanguageModel, got {type(model).__name__}.")
  out = []
  for i, block in enumerate(model.blocks):
    mode = getattr(block, "routing", None)
    if mode is None:
      continue
    entry = {"layer": i, "kind": block.kind, "mode": mode}
    if mode == "cler":
      gamma = np.asarray(block.cler.gamma[...], np.float32)
      entry.update(gamma=gamma, gamma_abs_mean=float(np.mean(np.abs(gamma))))
    else:
      route = block.route
      if route.rank is None:
        w = np.asarray(route.proj.kernel[...], np.float32)
      else:
        w = np.asarray(route.down.kernel[...], np.float32) @ np.asarray(route.up.kernel[...],
                                                                        np.float32)
      hv = block.mixer.num_v_heads
      per_head = w.reshape(hv, -1, w.shape[-1])
      entry.update(proj_norm=float(np.linalg.norm(w)),
                   head_norms=np.sqrt(np.sum(per_head ** 2, axis=(1, 2))), rank=route.rank)
    out.append(entry)
  return out


# ------------------------------------------------------------------------------------------
# A quick model to inspect


def corpus_tokens(num_chars: int = 400_000, split: str = "train") -> np.ndarray:
  """Byte-tokenizer ids (`lineax_attn.data.tokenizers.ByteTokenizer`) of the first `num_chars`
  characters of the embedded corpus's `split`, int32 `[N]`."""
  from lineax_attn.data import corpus, tokenizers  # pylint: disable=g-import-not-at-top
  if num_chars <= 0:
    raise ValueError(f"num_chars must be positive, got {num_chars}.")
  text, docs = [], corpus.load_documents(split)
  size = 0
  for doc in docs:
    text.append(doc)
    size += len(doc) + 1
    if size >= num_chars:
      break
  return tokenizers.ByteTokenizer().encode("\n".join(text)[:num_chars])


def train_tiny(config, *, steps: int = 100, batch_size: int = 8, seq_len: int = 64,
               learning_rate: float = 3e-3, seed: int = 0, tokens: np.ndarray | None = None):
  """Trains a small `LanguageModel` on byte windows of the embedded corpus (AdamW, constant
  learning rate): enough for states and gates to look like a trained model's, for notebooks.

  Args:
    config: a `ModelConfig` with vocab_size >= 259 (byte tokenizer), e.g.
      `models.config.tiny(vocab_size=384)`.
    steps, batch_size, seq_len, learning_rate, seed: the run.
    tokens: `[N]` int token stream to sample windows from (default: `corpus_tokens()`).

  Returns:
    (model, losses): the trained model and the training loss of every step (a list of floats).
  """
  import optax  # pylint: disable=g-import-not-at-top
  from lineax_attn.models import LanguageModel  # pylint: disable=g-import-not-at-top
  from lineax_attn.models import losses as losses_lib  # pylint: disable=g-import-not-at-top
  for name, value in (("steps", steps), ("batch_size", batch_size), ("seq_len", seq_len)):
    if not isinstance(value, int) or value <= 0:
      raise ValueError(f"{name} must be a positive int, got {value!r}.")
  stream = corpus_tokens() if tokens is None else np.asarray(tokens, np.int32)
  if stream.ndim != 1 or stream.shape[0] <= seq_len + 1:
    raise ValueError(f"tokens must be a 1-D stream longer than seq_len + 1 = {seq_len + 1}, got "
                     f"shape {stream.shape}.")
  if int(stream.max()) >= config.vocab_size:
    raise ValueError(f"config.vocab_size={config.vocab_size} is too small for token id "
                     f"{int(stream.max())}.")
  model = LanguageModel(config, rngs=nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, optax.adamw(learning_rate, weight_decay=0.01), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, batch):
    def loss_fn(model):
      return losses_lib.masked_cross_entropy(model(batch[:, :-1]), batch[:, 1:])
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  rng = np.random.default_rng(seed)
  losses = []
  for _ in range(steps):
    starts = rng.integers(0, stream.shape[0] - seq_len - 1, size=batch_size)
    batch = np.stack([stream[s:s + seq_len + 1] for s in starts])
    losses.append(train_step(model, optimizer, jnp.asarray(batch)))
  return model, [float(x) for x in jax.device_get(losses)]


def load_model(workdir: str | os.PathLike, step: int | None = None):
  """The model of a `experiments/train.py` run: its config (`<workdir>/config.json`) and the
  parameters of checkpoint `step` (None = the latest) under `<workdir>/checkpoints`.

  Returns:
    (model, experiment) with the model on one device.
  """
  import ml_collections  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import experiment as experiment_lib  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import loop  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  workdir = os.fspath(workdir)
  config_path = os.path.join(workdir, "config.json")
  if not os.path.isfile(config_path):
    raise ValueError(f"workdir must hold an experiments/train.py run (config.json and "
                     f"checkpoints/), but {config_path} does not exist.")
  with open(config_path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  # Inspect on one device whatever mesh it was trained on.
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 1
  exp = experiment_lib.resolve(config, device_count=1, process_count=1)
  trainer = loop.Trainer(exp, mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
  with checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
    state = ckpt.restore(step, trainer.abstract_state())
  return trainer.model(state["params"]), exp


# ------------------------------------------------------------------------------------------
# Plots (matplotlib; each returns the figure)


def _pyplot():
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _pick_times(t: int, times: Sequence[int] | None, count: int = 6) -> list[int]:
  if times is None:
    return sorted(set(np.linspace(0, t - 1, min(count, t)).round().astype(int).tolist()))
  bad = [x for x in times if not 0 <= x < t]
  if bad:
    raise ValueError(f"times must lie in [0, T={t}), got {bad}.")
  return list(times)


def plot_state_heatmaps(states, *, batch: int = 0, heads: Sequence[int] | None = None,
                        times: Sequence[int] | None = None, title: str = ""):
  """A grid of state heatmaps S_t `[K, V]`: one row per head, one column per chosen time.

  states `[B, T, HV, K, V]`; times default to 6 evenly spaced tokens. The colour scale is shared
  per head (symmetric around 0), so growth and decay over time read directly.
  """
  states = np.asarray(_check_matrices("states", states, 5))
  _, t, hv = states.shape[:3]
  heads = list(range(hv)) if heads is None else list(heads)
  times = _pick_times(t, times)
  plt = _pyplot()
  fig, axes = plt.subplots(len(heads), len(times), squeeze=False,
                           figsize=(1.6 * len(times) + 1, 1.6 * len(heads) + 0.6))
  for row, h in enumerate(heads):
    lim = float(np.abs(states[batch, :, h]).max()) or 1.0
    for col, tt in enumerate(times):
      ax = axes[row, col]
      image = ax.imshow(states[batch, tt, h], cmap="RdBu_r", vmin=-lim, vmax=lim)
      ax.set_xticks([])
      ax.set_yticks([])
      if row == 0:
        ax.set_title(f"t={tt}", fontsize=8)
      if col == 0:
        ax.set_ylabel(f"head {h}\nK", fontsize=8)
    fig.colorbar(image, ax=axes[row, :].tolist(), fraction=0.02)
  if title:
    fig.suptitle(title)
  return fig


def plot_gates(cap: LayerCapture, *, batch: int = 0, title: str = ""):
  """Per-head traces over time of the decay α = exp(g) and of β / erase b / write w (channel
  gates averaged over their channels); one panel per gate."""
  if not isinstance(cap, LayerCapture):
    raise ValueError(f"cap must be a LayerCapture (capture(...).layers[i]), got "
                     f"{type(cap).__name__}.")
  panels = []
  if "g" in cap.gates:
    panels.append(("decay α = exp(g)", jnp.exp(cap.gates["g"])))
  for name, label in (("beta", "β"), ("b", "erase b"), ("w", "write w")):
    if name in cap.gates:
      panels.append((label, cap.gates[name]))
  plt = _pyplot()
  fig, axes = plt.subplots(1, max(len(panels), 1), squeeze=False,
                           figsize=(4 * max(len(panels), 1), 2.8))
  if not panels:
    axes[0, 0].text(0.5, 0.5, f"{cap.kind}: no gates (α = 1, no β)", ha="center", va="center")
    axes[0, 0].set_axis_off()
  for ax, (label, values) in zip(axes[0], panels):
    values = np.asarray(values, np.float32)[batch]
    values = values.mean(axis=-1) if values.ndim == 3 else values  # [T, HV]
    for h in range(values.shape[1]):
      ax.plot(values[:, h], label=f"head {h}", lw=1)
    ax.set_title(label, fontsize=9)
    ax.set_xlabel("token t")
    ax.set_ylim(0, 1.02 if label != "β" or values.max() <= 1 else None)
  axes[0, 0].legend(fontsize=7)
  fig.suptitle(title or f"layer {cap.layer} ({cap.kind})", fontsize=10)
  fig.tight_layout()
  return fig


def plot_readout(readout, *, batch: int = 0, heads: Sequence[int] | None = None,
                 title: str = ""):
  """Memory readout heatmaps (`memory_readout`'s `[B, HV, T, T]`): rows = state time t,
  columns = key j; cos(S_tᵀ k_j, v_j) from −1 to 1, blank above the diagonal."""
  readout = np.asarray(readout, np.float32)
  if readout.ndim != 4 or readout.shape[2] != readout.shape[3]:
    raise ValueError(f"readout must be memory_readout's [B, HV, T, T], got {readout.shape}.")
  heads = list(range(readout.shape[1])) if heads is None else list(heads)
  plt = _pyplot()
  fig, axes = plt.subplots(1, len(heads), squeeze=False, figsize=(2.6 * len(heads) + 1, 2.8))
  for ax, h in zip(axes[0], heads):
    image = ax.imshow(readout[batch, h], cmap="viridis", vmin=-1, vmax=1)
    ax.set_title(f"head {h}", fontsize=9)
    ax.set_xlabel("key j")
    ax.set_ylabel("state t")
  fig.colorbar(image, ax=axes[0, :].tolist(), fraction=0.02)
  if title:
    fig.suptitle(title, fontsize=10)
  return fig
