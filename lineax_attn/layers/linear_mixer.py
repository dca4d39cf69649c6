"""One NNX layer shell for every linear mixer of `lineax_attn.ops.specs` (linear attention,
DeltaNet, GDN, KDA, GDN-2, ...), driven by each mixer's `specs.LayerSpec`.

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

(Any other mixer: z if gated, then its `LayerSpec.projections`, each as wide as its op gate.)

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

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from lineax_attn import ops
from lineax_attn.ops import api as ops_api
from lineax_attn.ops import segments as seg_lib
from lineax_attn.ops.gpu_tuning import GpuTuning
from lineax_attn.ops import specs
from lineax_attn.layers import conv as conv_lib
from lineax_attn.layers import gates as gates_lib
from lineax_attn.layers import norm as norm_lib
from lineax_attn.layers import partition
from lineax_attn.parallel import context as context_parallel

# The layer names of every linear mixer, and every accepted spelling -> its layer name (the op
# names work too); both read from `lineax_attn.ops.specs`.
LINEAR_MIXERS = specs.layer_names()
LINEAR_MIXER_ALIASES = {name: spec.layer_name for spec in specs.SPECS.values()
                        for name in spec.names}

# docs/MATH.md §4.3: SiLU for GDN and GDN-2, sigmoid for KDA, none for DeltaNet and linear
# attention (`specs.LayerSpec.output_gate`).
DEFAULT_OUTPUT_GATE = {spec.layer_name: spec.layer.output_gate for spec in specs.SPECS.values()}


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
  """The layer name of `kind` (any name or alias of a `specs.MixerSpec`)."""
  try:
    return specs.resolve(kind).layer_name
  except ValueError:
    raise ValueError(f"unknown linear mixer {kind!r}; expected one of {specs.layer_names()} "
                     f"(aliases: {specs.all_names()}).") from None


def _layout(segment_ids):
  if segment_ids is None:
    return None, None
  layout = seg_lib.layout_from_segment_ids(jnp.asarray(segment_ids))
  return layout.valid, layout.segidx


def conv_silu_l2n(u: jax.Array, conv_weight: jax.Array, valid: jax.Array | None,
                  segidx: jax.Array | None, conv_state: jax.Array | None, *,
                  heads: tuple[int, int], head_dims: tuple[int, int]):
  """The layer's front as a pure function: (q, k, v, new conv cache) from the projected
  q̂ k̂ v̂ channels u `[B, T, 2·H·d_k + HV·d_v]`: SiLU(ShortConv(u)), split into heads, q and k
  L2-normalised. heads = (H, HV), head_dims = (d_k, d_v).

  `LinearMixer(remat_conv_norm=True)` wraps it in `jax.checkpoint`: the conv's float32 taps and
  the norms' intermediates are then recomputed in the backward from u (kept anyway) rather than
  kept from the forward. It took the 350M GDN 2:1 hybrid's train step (16 x 4096 tokens) from
  78.1 to 60.0 GiB and 1.7 % faster on an H200 (69.8 → 60.0 GiB, 5 % on an H100); KDA's kept
  its time and memory there, GDN-2's became 2.8 % slower and 2.6 GiB larger, so GDN-2 keeps
  the front by default (docs/BENCHMARKS.md, "thirtieth" and "thirty-first stage")."""
  (h, hv), (dk, dv) = heads, head_dims
  b, t = u.shape[:2]
  y, conv_cache = conv_lib.causal_depthwise_conv(u, conv_weight, valid=valid, segidx=segidx,
                                                 state=conv_state)
  y = jax.nn.silu(y)
  q = norm_lib.l2_normalize(y[..., :h * dk].reshape(b, t, h, dk))
  k = norm_lib.l2_normalize(y[..., h * dk:2 * h * dk].reshape(b, t, h, dk))
  v = y[..., 2 * h * dk:].reshape(b, t, hv, dv)
  return q, k, v, conv_cache


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
    gate_init: "repo" (paper reproduction), "fla" (§4.4), "long" or "very_long" (slow
      initial decay, for short synthetic runs) initialisation of A_log / dt_bias.
    gate_lower_bound: KDA-style bounded decay lb·σ(·) with lb in [−5, 0); gated kinds only.
    allow_neg_eigval: β (GDN-2: b) = 2σ(·) ∈ (0, 2) instead of σ(·).
    norm_eps: output RMSNorm epsilon.
    chunk_size: chunk size passed to the op.
    implementation: op implementation for sequences ("scan", "chunk", a kernel, None = best).
    gpu_tuning: `ops.GpuTuning` passed as the op's `tuning=` when the implementation resolves to
      "pallas_gpu" or "triton" (None: its default); other implementations take no tuning. Not applied under
      context parallelism (the sharded op runs with its defaults).
    decode_implementation: op implementation for one-token steps ("scan").
    remat_conv_norm: recompute the front (short conv, SiLU, L2N: `conv_silu_l2n`) and the
      gated output norm in the backward instead of keeping their float32 intermediates (the
      same values either way; `jax.checkpoint`). None (the default) takes the mixer's
      `LayerSpec.remat_conv_norm`: on for every mixer but GDN-2. In the 350M hybrids' train
      step on an H200 it saved GDN 18 GiB and made it faster, cost KDA nothing, and made
      GDN-2's step 2.8 % slower and its peak 2.6 GiB larger (docs/LAYERS.md,
      "Implementation choices").
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
               implementation: str | None = None, gpu_tuning: GpuTuning | None = None,
               decode_implementation: str = "scan", remat_conv_norm: bool | None = None,
               context_axis: str | None = context_parallel.SEQUENCE_AXIS,
               init_std: float = 0.02, out_init_std: float | None = None, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    kind = canonical_linear_mixer(kind)
    spec = specs.resolve(kind)
    decay = next((lg for lg in spec.layer.gates if lg.kind == "decay"), None)
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
    output_gate = spec.layer.output_gate if output_gate is None else output_gate
    if output_gate not in norm_lib.OUTPUT_GATES:
      raise ValueError(f"unknown output_gate {output_gate!r}; expected one of "
                       f"{norm_lib.OUTPUT_GATES} or None (the mixer's default).")
    if gate_lower_bound is not None:
      if decay is None:
        gated = tuple(s.layer_name for s in specs.SPECS.values()
                      if any(lg.kind == "decay" for lg in s.layer.gates))
        raise ValueError(f"gate_lower_bound applies to gated mixers {gated}, not {kind!r}.")
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
    if gpu_tuning is not None and not isinstance(gpu_tuning, GpuTuning):
      raise ValueError(f"gpu_tuning must be an ops.GpuTuning or None, got {gpu_tuning!r}.")
    self.implementation = implementation
    self.gpu_tuning = gpu_tuning
    self.decode_implementation = decode_implementation
    if remat_conv_norm is None:
      remat_conv_norm = spec.layer.remat_conv_norm
    if not isinstance(remat_conv_norm, bool):
      raise ValueError(f"remat_conv_norm must be a bool or None (the mixer's default), got "
                       f"{remat_conv_norm!r}.")
    self.remat_conv_norm = remat_conv_norm
    self.context_axis = context_axis
    self.dtype = dtype
    gate_rank = head_dim_v if gate_rank is None else gate_rank

    qk, vw = num_heads * head_dim_k, num_v_heads * head_dim_v
    self.conv_channels = 2 * qk + vw
    parts = [("q", qk), ("k", qk), ("v", vw)]
    gated_out = output_gate != "none"
    if gated_out and not spec.layer.low_rank:
      parts.append(("z", vw))
    # The spec's projections in its order, each as wide as the op gate it feeds (per key or
    # value head, times d_k / d_v for a per-channel gate).
    widths = {}
    for lg in spec.layer.gates:
      heads = num_heads if lg.heads == "k" else num_v_heads
      axis = spec.gate(lg.gate).axis
      widths[lg.source] = heads * {None: 1, "k": head_dim_k, "v": head_dim_v}[axis]
    parts += [(name, widths[name]) for name in spec.layer.projections]
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

    if decay is not None:
      a_init, dt_init = gates_lib.gate_initializers(kind, gate_init)
      gate_heads = num_heads if decay.heads == "k" else num_v_heads
      per_channel = spec.gate(decay.gate).axis == "k"
      dt_shape = (gate_heads, head_dim_k) if per_channel else (gate_heads,)
      self.A_log = partition.param(rngs, a_init, (gate_heads,), jnp.float32, (None,))
      self.dt_bias = partition.param(rngs, dt_init, dt_shape, jnp.float32, (None,) * len(dt_shape))
    if spec.layer.low_rank:
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

  @property
  def spec(self) -> specs.MixerSpec:
    """The mixer's `specs.MixerSpec`."""
    return specs.resolve(self.kind)

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
    spec = self.spec
    z = parts.get("z")
    if spec.layer.low_rank:  # KDA: f and z from the low-rank branch
      down = self.gate_down(x)
      parts = dict(parts, low_rank=self.f_up(down[..., :self.gate_rank]))
      z = self.z_up(down[..., self.gate_rank:]) if self.output_gate != "none" else None
    out = []
    for lg in spec.layer.gates:
      axis = spec.gate(lg.gate).axis
      heads = h if lg.heads == "k" else hv
      x_gate = parts[lg.source].reshape((b, t, heads) + {None: (), "k": (dk,), "v": (dv,)}[axis])
      if lg.kind == "decay":
        a_log = self.A_log[...] if axis is None else self.A_log[...][:, None]
        gate = gates_lib.log_decay(x_gate, a_log, self.dt_bias[...], self.gate_lower_bound)
      else:
        gate = gates_lib.sigmoid_gate(x_gate, self.allow_neg_eigval and lg.neg_eigval)
      # Per key head (GDN-2): repeated to the value heads that read it.
      out.append(jnp.repeat(gate, n_rep, axis=2) if lg.heads == "k" else gate)
    return tuple(out), z

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
    front = functools.partial(conv_silu_l2n, heads=(h, hv), head_dims=(dk, dv))
    if self.remat_conv_norm:
      front = jax.checkpoint(front)
    q, k, v, conv_cache = front(u, self.conv.weight[...], valid, segidx,
                                None if cache is None else cache["conv"])
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
      tuning = (self.gpu_tuning if self.gpu_tuning is not None
                and ops_api.resolve_implementation(impl) in ("pallas_gpu", "triton") else None)
      results = getattr(ops, self.spec.name)(q, k, v, *gate_args, tuning=tuning, **op_kwargs)
    o, state = results[0], results[1]
    r = results[2] if with_residual else None
    if z is not None:
      z = z.reshape(b, t, hv, dv)
    y = self.norm(o, z, remat=self.remat_conv_norm).reshape(b, t, hv * dv)
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
