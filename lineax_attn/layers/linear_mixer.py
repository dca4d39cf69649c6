"""One NNX layer shell for the five linear mixers: linear attention, DeltaNet, GDN, KDA, GDN-2.

docs/MATH.md §4.1 with the per-mixer differences of §4.3:

    p = x W_in                                   one fused projection, no bias
    (q̂, k̂, v̂, extras) = split(p)
    (q̂, k̂, v̂) = SiLU(ShortConv(concat(q̂, k̂, v̂)))  one depthwise conv over all q, k, v channels
    q = L2N(q̂), k = L2N(k̂)                        per head, float32 inside
    gates (float32) from the extras (and, for KDA, a low-rank branch)
    o, S_T, r = lineax_attn.ops.<mixer>(q, k, v, gates, implementation=...)
    y = RMSNorm_{d_v}(o) [⊙ act(z)]               per-head norm, optional output gate
    out = y W_out

Fused in-projection layout (fixed, so checkpoints stay stable), in this order:

| kind | parts after q (H·d_k), k (H·d_k), v (HV·d_v) |
|---|---|
| linear_attention | z (HV·d_v) only if an output gate is configured |
| deltanet | z (if gated), β (HV) |
| gdn | z (if gated), β (HV), f (HV) |
| kda | β (HV); f and z come from a low-rank branch d → rank → HV·d_k / HV·d_v (z-up has a bias) |
| gdn2 | z (if gated), b (H·d_k), w (HV·d_v), f (H·d_k) |

Per-mixer parameters: GDN A_log[HV], dt_bias[HV]; KDA A_log[HV], dt_bias[HV, d_k]; GDN-2
A_log[H], dt_bias[H, d_k] (GDN-2's f, b, A_log and dt_bias live per key head and are repeated to
the value heads, docs/MATH.md §2.6).

Linear attention has no β projection here (the repo computes one and never uses it: 4·d fewer
parameters than its §4.5 row).

The layer also exports what cross-layer routing needs (docs/MATH.md §2.7): the write residual r and
the write value v, both `[B, T, HV, d_v]`, and accepts a `value_delta` added to v before the
recurrence (CLER v1). Decoding reuses the op: a one-token step is the op with T = 1, the cached
state as `initial_state` and `implementation=decode_implementation` (the scan by default).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from lineax_attn import ops
from lineax_attn.ops import segments as seg_lib
from lineax_attn.layers import conv as conv_lib
from lineax_attn.layers import gates as gates_lib
from lineax_attn.layers import norm as norm_lib
from lineax_attn.layers import partition
from lineax_attn.parallel import context as context_parallel

LINEAR_MIXERS = ("linear_attention", "deltanet", "gdn", "kda", "gdn2")

# Accepted spellings -> canonical layer names (the op names work too).
LINEAR_MIXER_ALIASES = {
    "linear_attention": "linear_attention", "la": "linear_attention",
    "deltanet": "deltanet", "delta_rule": "deltanet", "dn": "deltanet",
    "gdn": "gdn", "gated_deltanet": "gdn", "gated_delta_rule": "gdn",
    "kda": "kda",
    "gdn2": "gdn2", "gdn-2": "gdn2", "gated_deltanet2": "gdn2",
}

_OPS = {
    "linear_attention": ops.linear_attention,
    "deltanet": ops.delta_rule,
    "gdn": ops.gated_delta_rule,
    "kda": ops.kda,
    "gdn2": ops.gdn2,
}

# docs/MATH.md §4.3: SiLU for GDN and GDN-2, sigmoid for KDA, none for DeltaNet and linear
# attention.
DEFAULT_OUTPUT_GATE = {
    "linear_attention": "none", "deltanet": "none", "gdn": "silu", "kda": "sigmoid", "gdn2": "silu",
}

_GATED_KINDS = ("gdn", "kda", "gdn2")   # have a decay (A_log, dt_bias)
_BETA_KINDS = ("deltanet", "gdn", "kda")


class MixerOutput(NamedTuple):
  """What a mixer's `forward` returns.

  y: `[B, T, d]` layer output.
  r: `[B, T, HV, d_v]` write residual (linear mixers asked `with_residual`; else None).
  v: `[B, T, HV, d_v]` write value after conv/SiLU and any `value_delta` (None for softmax).
  cache: the updated decoding cache, or None when no cache was asked for.
  """
  y: jax.Array
  r: jax.Array | None
  v: jax.Array | None
  cache: Any


def canonical_linear_mixer(kind: str) -> str:
  name = LINEAR_MIXER_ALIASES.get(str(kind).lower())
  if name is None:
    raise ValueError(f"unknown linear mixer {kind!r}; expected one of {LINEAR_MIXERS} "
                     f"(aliases: {sorted(LINEAR_MIXER_ALIASES)}).")
  return name


def _layout(segment_ids):
  if segment_ids is None:
    return None, None
  layout = seg_lib.layout_from_segment_ids(jnp.asarray(segment_ids))
  return layout.valid, layout.segidx


class LinearMixer(nnx.Module):
  """A linear-attention-family token mixer `[B, T, d] -> [B, T, d]`.

  Args:
    kind: "linear_attention", "deltanet", "gdn", "kda" or "gdn2" (aliases: the op names).
    d_model: model width d.
    num_heads: key/query heads H.
    num_v_heads: value heads HV, a multiple of H (grouped value heads); default H.
    head_dim_k, head_dim_v: d_k (default d_model // num_heads, which must divide) and d_v
      (default d_k).
    conv_width: short-conv width W (4); 1 makes it a per-channel scale.
    output_gate: "none", "silu" or "sigmoid"; None = the mixer's docs/MATH.md §4.3 default.
    gate_rank: rank of KDA's low-rank f/z branch (default d_v).
    gate_init: "repo" (paper reproduction), "fla" (§4.4) or "long" (slow initial decay, for
      short synthetic runs) initialisation of A_log / dt_bias.
    gate_lower_bound: KDA-style bounded decay lb·σ(·) with lb in [−5, 0); gated kinds only.
    allow_neg_eigval: β (GDN-2: b) = 2σ(·) ∈ (0, 2) instead of σ(·).
    norm_eps: output RMSNorm epsilon.
    chunk_size: chunk size passed to the op.
    implementation: op implementation for sequences ("scan", "chunk", a kernel, None = best).
      The layer runs it with its default tuning (the ops' `tuning=` is not passed through).
    decode_implementation: op implementation for one-token steps ("scan").
    context_axis: mesh axis of context parallelism: when the current mesh (`jax.set_mesh`) has
      it with size P > 1 and P divides T, the op runs under `jax.shard_map` over it with the
      time axis split P ways (`lineax_attn.parallel.sharded_mixer`); None turns this off. The
      short conv stays plain jnp on the auto-sharded time axis (XLA exchanges the W−1 halo).
    init_std: std of the in-projections (N(0, 0.02)); out_init_std: of W_out (default init_std).
    dtype: compute dtype; param_dtype: parameter dtype (A_log, dt_bias stay float32).
  """

  def __init__(self, kind: str, d_model: int, *, num_heads: int, num_v_heads: int | None = None,
               head_dim_k: int | None = None, head_dim_v: int | None = None, conv_width: int = 4,
               output_gate: str | None = None, gate_rank: int | None = None,
               gate_init: str = "repo", gate_lower_bound: float | None = None,
               allow_neg_eigval: bool = False, norm_eps: float = 1e-5, chunk_size: int = 64,
               implementation: str | None = None, decode_implementation: str = "scan",
               context_axis: str | None = context_parallel.SEQUENCE_AXIS,
               init_std: float = 0.02, out_init_std: float | None = None, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    kind = canonical_linear_mixer(kind)
    if num_heads <= 0:
      raise ValueError(f"num_heads must be positive, got {num_heads}.")
    if head_dim_k is None:
      if d_model % num_heads != 0:
        raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}; pass "
                         f"head_dim_k explicitly or choose heads that divide d_model.")
      head_dim_k = d_model // num_heads
    head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
    num_v_heads = num_heads if num_v_heads is None else num_v_heads
    if num_v_heads % num_heads != 0:
      raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_heads={num_heads} "
                       f"(grouped value heads: value head j reads key head j // (HV / H)).")
    if min(head_dim_k, head_dim_v, num_v_heads) <= 0:
      raise ValueError(f"head dims and num_v_heads must be positive, got d_k={head_dim_k}, "
                       f"d_v={head_dim_v}, num_v_heads={num_v_heads}.")
    output_gate = DEFAULT_OUTPUT_GATE[kind] if output_gate is None else output_gate
    if output_gate not in norm_lib.OUTPUT_GATES:
      raise ValueError(f"unknown output_gate {output_gate!r}; expected one of "
                       f"{norm_lib.OUTPUT_GATES} or None (the mixer's default).")
    if gate_lower_bound is not None:
      if kind not in _GATED_KINDS:
        raise ValueError(f"gate_lower_bound applies to gated mixers {_GATED_KINDS}, not {kind!r}.")
      if not -5.0 <= gate_lower_bound < 0.0:
        raise ValueError(f"gate_lower_bound must lie in [-5, 0), got {gate_lower_bound}.")
    if not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % 16:
      raise ValueError(f"chunk_size must be a positive multiple of 16, got {chunk_size!r}.")

    self.kind = kind
    self.d_model = d_model
    self.num_heads, self.num_v_heads = num_heads, num_v_heads
    self.head_dim_k, self.head_dim_v = head_dim_k, head_dim_v
    self.output_gate = output_gate
    self.gate_lower_bound = gate_lower_bound
    self.allow_neg_eigval = allow_neg_eigval
    self.chunk_size = chunk_size
    self.implementation = implementation
    self.decode_implementation = decode_implementation
    self.context_axis = context_axis
    self.dtype = dtype
    gate_rank = head_dim_v if gate_rank is None else gate_rank

    qk, vw = num_heads * head_dim_k, num_v_heads * head_dim_v
    self.conv_channels = 2 * qk + vw
    parts = [("q", qk), ("k", qk), ("v", vw)]
    gated_out = output_gate != "none"
    if kind in ("linear_attention", "deltanet", "gdn", "gdn2") and gated_out:
      parts.append(("z", vw))
    if kind in _BETA_KINDS:
      parts.append(("beta", num_v_heads))
    if kind == "gdn":
      parts.append(("f", num_v_heads))
    if kind == "gdn2":
      parts += [("b", qk), ("w", vw), ("f", qk)]
    self.in_parts = tuple(parts)

    normal = nnx.initializers.normal
    out_init_std = init_std if out_init_std is None else out_init_std
    linear = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.in_proj = nnx.Linear(
        d_model, sum(w for _, w in parts), use_bias=False,
        kernel_init=partition.partitioned(normal(init_std), (partition.EMBED, partition.HEADS)),
        **linear)
    self.conv = conv_lib.ShortConv(self.conv_channels, conv_width, param_dtype=param_dtype,
                                   rngs=rngs)

    if kind in _GATED_KINDS:
      a_init, dt_init = gates_lib.gate_initializers(kind, gate_init)
      gate_heads = num_heads if kind == "gdn2" else num_v_heads
      dt_shape = (num_v_heads,) if kind == "gdn" else (gate_heads, head_dim_k)
      self.A_log = partition.param(rngs, a_init, (gate_heads,), jnp.float32, (None,))
      self.dt_bias = partition.param(rngs, dt_init, dt_shape, jnp.float32, (None,) * len(dt_shape))
    if kind == "kda":
      down_width = gate_rank * (2 if gated_out else 1)
      self.gate_down = nnx.Linear(
          d_model, down_width, use_bias=False,
          kernel_init=partition.partitioned(normal(init_std), (partition.EMBED, partition.RANK)),
          **linear)
      self.f_up = nnx.Linear(
          gate_rank, num_v_heads * head_dim_k, use_bias=False,
          kernel_init=partition.partitioned(normal(init_std), (partition.RANK, partition.HEADS)),
          **linear)
      if gated_out:
        self.z_up = nnx.Linear(
            gate_rank, vw, use_bias=True,
            kernel_init=partition.partitioned(normal(init_std), (partition.RANK, partition.HEADS)),
            bias_init=partition.partitioned(nnx.initializers.zeros, (partition.HEADS,)),
            **linear)
    self.gate_rank = gate_rank
    self.norm = norm_lib.GatedHeadNorm(head_dim_v, gate=output_gate, eps=norm_eps,
                                       param_dtype=param_dtype)
    self.out_proj = nnx.Linear(
        vw, d_model, use_bias=False,
        kernel_init=partition.partitioned(normal(out_init_std), (partition.HEADS, partition.EMBED)),
        **linear)

  # ----------------------------------------------------------------------------------------
  def init_cache(self, batch: int, max_len: int | None = None) -> dict[str, jax.Array]:
    """Empty decoding cache: conv `[B, W−1, 2·H·d_k + HV·d_v]` (compute dtype) and the
    recurrent state `[B, HV, d_k, d_v]` (float32). Its size does not depend on max_len."""
    del max_len
    return {
        "conv": self.conv.init_cache(batch, self.dtype),
        "state": jnp.zeros((batch, self.num_v_heads, self.head_dim_k, self.head_dim_v),
                           jnp.float32),
    }

  def _gates(self, x, parts):
    """The op's gate arrays (float32) in the op's argument order."""
    b, t, _ = x.shape
    h, hv, dk, dv = self.num_heads, self.num_v_heads, self.head_dim_k, self.head_dim_v
    n_rep = hv // h
    lb = self.gate_lower_bound
    if self.kind == "linear_attention":
      return (), None
    if self.kind == "deltanet":
      return (gates_lib.sigmoid_gate(parts["beta"], self.allow_neg_eigval),), parts.get("z")
    if self.kind == "gdn":
      g = gates_lib.log_decay(parts["f"], self.A_log[...], self.dt_bias[...], lb)
      beta = gates_lib.sigmoid_gate(parts["beta"], self.allow_neg_eigval)
      return (g, beta), parts.get("z")
    if self.kind == "kda":
      down = self.gate_down(x)
      f = self.f_up(down[..., :self.gate_rank]).reshape(b, t, hv, dk)
      z = self.z_up(down[..., self.gate_rank:]) if self.output_gate != "none" else None
      g = gates_lib.log_decay(f, self.A_log[...][:, None], self.dt_bias[...], lb)
      beta = gates_lib.sigmoid_gate(parts["beta"], self.allow_neg_eigval)
      return (g, beta), z
    # gdn2: decay and erase gate per key head, repeated to the value heads.
    f = parts["f"].reshape(b, t, h, dk)
    g = gates_lib.log_decay(f, self.A_log[...][:, None], self.dt_bias[...], lb)
    erase = gates_lib.sigmoid_gate(parts["b"].reshape(b, t, h, dk), self.allow_neg_eigval)
    write = gates_lib.sigmoid_gate(parts["w"].reshape(b, t, hv, dv))
    g, erase = jnp.repeat(g, n_rep, axis=2), jnp.repeat(erase, n_rep, axis=2)
    return (g, erase, write), parts.get("z")

  def forward(self, x: jax.Array, segment_ids: jax.Array | None = None, *,
              value_delta: jax.Array | None = None, cache: dict[str, jax.Array] | None = None,
              max_len: int | None = None, with_residual: bool = True) -> MixerOutput:
    """The full layer, with routing exports and an optional decoding cache.

    Args:
      x: `[B, T, d]`.
      segment_ids: `[B, T]` int (docs/MATH.md §1.7): conv and state reset where the id changes,
        0 is padding. With a cache, the row's first segment continues the cached one.
      value_delta: `[B, T, HV, d_v]` added to v after conv/SiLU (CLER v1 injection).
      cache: a cache from `init_cache` or an earlier call: continue from it.
      max_len: ask for a cache without passing one (a prefill from empty).
      with_residual: also return the write residual r (an extra output of the op; a kernel may
        skip it when it is not asked for).

    Returns:
      `MixerOutput(y, r, v, cache)`; r is None without `with_residual`; cache is None unless
      `cache` or `max_len` was given.
    """
    if x.ndim != 3 or x.shape[-1] != self.d_model:
      raise ValueError(f"x must have shape [B, T, d_model={self.d_model}], got {x.shape}.")
    b, t, _ = x.shape
    h, hv, dk, dv = self.num_heads, self.num_v_heads, self.head_dim_k, self.head_dim_v
    valid, segidx = _layout(segment_ids)
    x = x.astype(self.dtype)
    p = self.in_proj(x)
    parts, start = {}, 0
    for name, width in self.in_parts:
      parts[name] = p[..., start:start + width]
      start += width

    u = jnp.concatenate([parts["q"], parts["k"], parts["v"]], axis=-1)
    u, conv_cache = self.conv(u, valid=valid, segidx=segidx,
                              state=None if cache is None else cache["conv"])
    u = jax.nn.silu(u)
    q = norm_lib.l2_normalize(u[..., :h * dk].reshape(b, t, h, dk))
    k = norm_lib.l2_normalize(u[..., h * dk:2 * h * dk].reshape(b, t, h, dk))
    v = u[..., 2 * h * dk:].reshape(b, t, hv, dv)
    if value_delta is not None:
      if value_delta.shape != v.shape:
        raise ValueError(f"value_delta must have shape [B, T, HV, d_v] = {v.shape}, got "
                         f"{value_delta.shape}.")
      v = v + value_delta.astype(v.dtype)

    gate_args, z = self._gates(x, parts)
    want_cache = cache is not None or max_len is not None
    impl = self.decode_implementation if (want_cache and t == 1) else self.implementation
    if hasattr(self, "__captures__"):  # only under nnx.capture (lineax_attn.inspect): op inputs
      self.sow(nnx.Intermediate, "op_inputs", dict(q=q, k=k, v=v, gates=gate_args, z=z))
    op_kwargs = dict(initial_state=None if cache is None else cache["state"],
                     output_final_state=want_cache, segment_ids=segment_ids,
                     chunk_size=self.chunk_size, return_residual=with_residual,
                     implementation=impl)
    shards = context_parallel.active_axis_size(self.context_axis)
    if shards > 1 and t % shards == 0:
      results = context_parallel.sharded_mixer(self.kind, q, k, v, *gate_args,
                                               axis=self.context_axis, **op_kwargs)
    else:
      results = _OPS[self.kind](q, k, v, *gate_args, **op_kwargs)
    o, state = results[0], results[1]
    r = results[2] if with_residual else None
    if z is not None:
      z = z.reshape(b, t, hv, dv)
    y = self.norm(o, z).reshape(b, t, hv * dv)
    y = self.out_proj(y)
    new_cache = {"conv": conv_cache, "state": state} if want_cache else None
    return MixerOutput(y=y, r=r, v=v, cache=new_cache)

  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """`[B, T, d] -> [B, T, d]`: the plain layer, for dropping into any model."""
    return self.forward(x, segment_ids, with_residual=False).y

  def decode_step(self, x: jax.Array, cache: dict[str, jax.Array], *,
                  value_delta: jax.Array | None = None,
                  with_residual: bool = True) -> MixerOutput:
    """One token: x `[B, d]` (or `[B, 1, d]`) -> MixerOutput with y `[B, 1, d]`."""
    if x.ndim == 2:
      x = x[:, None]
    return self.forward(x, value_delta=value_delta, cache=cache, with_residual=with_residual)
