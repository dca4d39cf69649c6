"""FLA's public op names over `lineax_attn.ops`, so FLA code ports by changing an import.

The functions below take the arguments of flash-linear-attention's ops (`fla.ops`, read at
fla-org/flash-linear-attention commit bc3b101d of 2026-08-22, after v0.5.2; the newest stored tree
before the fla-core 0.6.0 release):
the same names, order and defaults, the `[B, T, H, K]` layout, `scale`, `initial_state`,
`output_final_state`, `use_qk_l2norm_in_kernel`, FLA-style varlen `cu_seqlens` with B = 1, and
they return `(o, final_state)` with final_state None unless asked for.

    # before
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    # after
    from lineax_attn.fla import chunk_gated_delta_rule

    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)

| FLA name (`fla.ops.<module>`)                         | lineax_attn op                    |
|-------------------------------------------------------|-----------------------------------|
| `chunk_linear_attn`, `fused_recurrent_linear_attn`    | `ops.linear_attention` + FLA's    |
|   (linear_attn)                                       |   normaliser (`normalize=True`)   |
| `chunk_delta_rule`, `fused_recurrent_delta_rule`      | `ops.delta_rule`                  |
|   (delta_rule)                                        |                                   |
| `chunk_gated_delta_rule` = `chunk_gdn` (gated_delta_rule) | `ops.gated_delta_rule`        |
| `fused_recurrent_gated_delta_rule`                    | `ops.gated_delta_rule`; `ops.kda` |
|   = `fused_recurrent_gdn` (gated_delta_rule)          |   with `gk`; `ops.delta_rule` if  |
|                                                       |   no decay is given               |
| `chunk_kda`, `fused_recurrent_kda` (kda)              | `ops.kda`                         |
| `chunk_gdn2`, `fused_recurrent_gdn2` (gdn2)           | `ops.gdn2`                        |
| `chunk_simple_gla`, `fused_recurrent_simple_gla`      | `ops.simple_gla`; `g_gamma` [H]   |
|   (simple_gla; read from fla-core 0.6.0)              |   broadcast over (B, T)           |

FLA's `chunk_*` and `fused_recurrent_*` kernels compute the same recurrence; here both go to the
same op with `implementation=None` (the best on the backend: Pallas on TPU / Hopper, the chunked
form elsewhere). Two keyword-only extras reach the op: `implementation` ("scan" is the
`lax.scan` reference) and `chunk_size` (a multiple of 16, default 64).

Options: FLA's gate and beta fusions are computed here in float32 before the op, with the maths
of `lineax_attn.layers.gates`: `use_gate_in_kernel` (g = −exp(A_log)·softplus(g + dt_bias), or
KDA / GDN-2's bounded lower_bound·σ(exp(A_log)·(g + dt_bias))), `use_beta_sigmoid_in_kernel`
(β = σ(β), 2σ(β) with `allow_neg_eigval`), `use_qk_l2norm_in_kernel` (x / sqrt(Σx² + 1e-6) along
K, as FLA's l2norm, differentiable), `state_v_first` (states `[N, HV, V, K]`). Performance hints
are accepted and have no effect: `cu_seqlens_cpu`, `chunk_indices`, `disable_recompute`,
`safe_gate` (it only picks a kernel in FLA; its `lower_bound` range check is kept). Not
supported, with an error naming the option: `head_first=True` (ValueError; FLA removed it too),
`cp_context` (use `lineax_attn.parallel`), `return_intermediate_states`, `fused_recurrent_gdn`'s
`gv` and per-value `beta` `[B, T, HV, V]` (NotImplementedError), and any keyword FLA does not
name (ValueError; FLA's `**kwargs` ignores unknown keywords silently). As in FLA, `A_log`,
`dt_bias` and `lower_bound` are ignored unless `use_gate_in_kernel=True`.

Differences from FLA:

* JAX arrays in and out, nothing is modified in place; the functions work under `jax.jit`,
  `jax.grad` and `jax.vmap` (the options are Python values, static under jit).
* dtypes: q, k, v, gates of any float dtype, computed in float32; o comes back in q's dtype (as
  FLA); states are float32, and `initial_state` of another float dtype is upcast (FLA's KDA and
  GDN-2 insist on float32). FLA's chunk kernels reject float32 inputs in places; these do not.
* Grouped value heads (HV a multiple of H) work for every op, also where FLA's kernel has none
  (delta rule, linear attention, chunk GDN-2).
* Values follow `docs/OP_CONTRACT.md`: eager calls check g <= 0, β and b in [0, 2], w in [0, 1]
  and `cu_seqlens`; under jit only in checked mode (`lineax_attn.ops.checked`).
* `chunk_linear_attn` normalises by default (`normalize=True`, as FLA): o_t / (scale·q_t·z_t +
  1e-10) with z_t the running sum of the keys, and returns `(o, (final_state, z_state))`, z
  `[N, 1, H, K]` in float32 (FLA keeps k's dtype).
"""

from __future__ import annotations

# pylint: disable=invalid-name  (FLA's argument names: A_log)

import math

import jax
import jax.numpy as jnp
import numpy as np

from lineax_attn import ops

L2NORM_EPS = 1e-6          # FLA's l2norm_fwd default: x / sqrt(sum(x²) + eps)
LINEAR_ATTN_EPS = 1e-10    # added to FLA's linear-attention denominator

# FLA's deprecated keywords with their new names.
_RENAMED = {"transpose_state_layout": "state_v_first"}

__all__ = [
    "chunk_linear_attn", "fused_recurrent_linear_attn",
    "chunk_delta_rule", "fused_recurrent_delta_rule",
    "chunk_gated_delta_rule", "chunk_gdn",
    "fused_recurrent_gated_delta_rule", "fused_recurrent_gdn",
    "chunk_kda", "fused_recurrent_kda",
    "chunk_gdn2", "fused_recurrent_gdn2",
    "chunk_simple_gla", "fused_recurrent_simple_gla",
]


# ----------------------------------------------------------------------------------------------
# Argument checks shared by the wrappers. Each error names the function and the argument.

def _flag(fn: str, name: str, value) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{fn}: `{name}` must be a bool, got {value!r}.")
  return bool(value)


def _check_extras(fn: str, kwargs: dict, head_first) -> None:
  """Unknown keywords, FLA's renamed ones and `head_first=True` are errors, never ignored."""
  if _flag(fn, "head_first", head_first):
    raise ValueError(f"{fn}: `head_first=True` ([B, H, T, ...] inputs) is not supported (FLA "
                     f"removed it too); pass [B, T, H, ...] arrays, e.g. jnp.swapaxes(x, 1, 2).")
  for name in sorted(kwargs):
    if name in _RENAMED:
      raise ValueError(f"{fn}: `{name}` is FLA's deprecated name of `{_RENAMED[name]}`; pass "
                       f"`{_RENAMED[name]}=` instead.")
  if kwargs:
    names = ", ".join(f"`{n}`" for n in sorted(kwargs))
    raise ValueError(f"{fn}: unknown option(s) {names}.")


def _not_supported(fn: str, name: str, value, default) -> None:
  if value is not default and value != default:
    raise NotImplementedError(f"{fn}: `{name}={value!r}` is not supported by lineax_attn.fla"
                              + _WHY.get(name, "."))


_WHY = {
    "cp_context": "; lineax_attn.parallel.context shards the linear mixers over the sequence.",
    "return_intermediate_states": "; the per-chunk states are internal to lineax_attn's chunked "
                                  "form.",
}


def _is_float_array(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _array(fn: str, name: str, x, ndim: int):
  if not _is_float_array(x):
    raise ValueError(f"{fn}: `{name}` must be a floating-point array, got "
                     f"{getattr(x, 'dtype', type(x).__name__)}.")
  if x.ndim != ndim:
    raise ValueError(f"{fn}: `{name}` must have rank {ndim}, got shape {tuple(x.shape)}.")
  return x


def _heads(fn: str, q, v) -> tuple[int, int]:
  """(HV, K) from q `[B, T, H, K]` and v `[B, T, HV, V]` (the op checks the rest)."""
  _array(fn, "q", q, 4)
  _array(fn, "v", v, 4)
  return v.shape[2], q.shape[3]


def _param(fn: str, name: str, x, shape: tuple[int, ...]):
  """A gate parameter (`A_log`, `dt_bias`) of `shape`, or of its flat size, as float32."""
  if not _is_float_array(x):
    raise ValueError(f"{fn}: `{name}` must be a floating-point array, got "
                     f"{getattr(x, 'dtype', type(x).__name__)}.")
  size = math.prod(shape)
  if tuple(x.shape) not in (tuple(shape), (size,)):
    want = f"{list(shape)}" + (f" or [{size}]" if len(shape) > 1 else "")
    raise ValueError(f"{fn}: `{name}` must have shape {want}, got {tuple(x.shape)}.")
  return x.astype(jnp.float32).reshape(shape)


def _lower_bound(fn: str, lower_bound, safe_gate: bool):
  try:
    lb = float(lower_bound)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{fn}: `lower_bound` must be a Python number, got {lower_bound!r}.") from e
  if not math.isfinite(lb) or lb >= 0:
    raise ValueError(f"{fn}: `lower_bound` is a log decay and must be a negative finite number, "
                     f"got {lower_bound!r}.")
  if safe_gate and lb < -5:
    raise ValueError(f"{fn}: `lower_bound` must be in the safe range [-5, 0) with "
                     f"`safe_gate=True`, got {lower_bound!r}.")
  return lb


# ----------------------------------------------------------------------------------------------
# The maths FLA fuses into its kernels, here in float32 before the op.

def _l2norm(x):
  """x / sqrt(Σx² + 1e-6) along the last axis in float32, back in x's dtype (FLA's l2norm)."""
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
    return x  # the op raises its ValueError
  xf = x.astype(jnp.float32)
  return (xf / jnp.sqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + L2NORM_EPS)).astype(x.dtype)


def _beta(fn: str, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval):
  use_sigmoid = _flag(fn, "use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)
  if _flag(fn, "allow_neg_eigval", allow_neg_eigval) and not use_sigmoid:
    raise ValueError(f"{fn}: `allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True` "
                     f"(as in FLA); scale a post-sigmoid beta yourself otherwise.")
  if not use_sigmoid:
    return beta
  _array(fn, "beta", beta, 3)
  s = jax.nn.sigmoid(beta.astype(jnp.float32))
  return 2.0 * s if allow_neg_eigval else s


def _gdn_gate(fn: str, g, A_log, dt_bias, hv: int):
  """GDN's g = −exp(A_log)·softplus(g + dt_bias), A_log and dt_bias `[HV]`."""
  if A_log is None:
    raise ValueError(f"{fn}: `A_log` [HV] must be given with `use_gate_in_kernel=True`.")
  _array(fn, "g", g, 3)
  f = g.astype(jnp.float32)
  if dt_bias is not None:
    f = f + _param(fn, "dt_bias", dt_bias, (hv,))
  return -jnp.exp(_param(fn, "A_log", A_log, (hv,))) * jax.nn.softplus(f)


def _channel_gate(fn: str, g, A_log, dt_bias, lower_bound, safe_gate: bool, hv: int, dk: int):
  """KDA / GDN-2's per-channel g: −exp(A_log)·softplus(g + dt_bias), or with `lower_bound`
  lb·σ(exp(A_log)·(g + dt_bias)) (lb·σ(g + dt_bias) without A_log). A_log `[HV]`, dt_bias
  `[HV * K]` (or `[HV, K]`)."""
  if A_log is None and lower_bound is None:
    raise ValueError(f"{fn}: `A_log` [HV] must be given with `use_gate_in_kernel=True` unless "
                     f"`lower_bound` is set.")
  if safe_gate and lower_bound is None:
    raise ValueError(f"{fn}: `lower_bound` must be given with `safe_gate=True` and "
                     f"`use_gate_in_kernel=True`.")
  _array(fn, "g", g, 4)
  f = g.astype(jnp.float32)
  if dt_bias is not None:
    f = f + _param(fn, "dt_bias", dt_bias, (hv, dk))
  a = 1.0 if A_log is None else jnp.exp(_param(fn, "A_log", A_log, (hv,)))[:, None]
  if lower_bound is None:
    return -a * jax.nn.softplus(f)
  return _lower_bound(fn, lower_bound, safe_gate) * jax.nn.sigmoid(a * f)


def _state_in(fn: str, initial_state, state_v_first: bool):
  if initial_state is None:
    return None
  _array(fn, "initial_state", initial_state, 4)
  s = initial_state.astype(jnp.float32)
  return jnp.swapaxes(s, -1, -2) if state_v_first else s


def _run(fn: str, op, q, k, v, gates, *, scale, initial_state, output_final_state,
         use_qk_l2norm_in_kernel, state_v_first, cu_seqlens, chunk_size, implementation):
  """The shared tail: l2norm, state layout, the op, o back in q's dtype."""
  state_v_first = _flag(fn, "state_v_first", state_v_first)
  if _flag(fn, "use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel):
    q, k = _l2norm(q), _l2norm(k)
  o, final_state = op(q, k, v, *gates, scale=scale,
                      initial_state=_state_in(fn, initial_state, state_v_first),
                      output_final_state=_flag(fn, "output_final_state", output_final_state),
                      cu_seqlens=cu_seqlens, chunk_size=chunk_size, implementation=implementation)
  if final_state is not None and state_v_first:
    final_state = jnp.swapaxes(final_state, -1, -2)
  return o.astype(q.dtype), final_state


# ----------------------------------------------------------------------------------------------
# Gated DeltaNet (fla.ops.gated_delta_rule).

def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                           chunk_indices=None, cp_context=None, *, use_gate_in_kernel=False,
                           A_log=None, dt_bias=None, chunk_size=64, head_first=False,
                           implementation=None, **kwargs):
  """FLA's `chunk_gated_delta_rule` (alias `chunk_gdn`) on `lineax_attn.ops.gated_delta_rule`.

  q, k `[B, T, H, K]`, v `[B, T, HV, V]`, g `[B, T, HV]` log decay (raw with
  `use_gate_in_kernel=True`, then A_log `[HV]` and dt_bias `[HV]`), beta `[B, T, HV]` (logits
  with `use_beta_sigmoid_in_kernel=True`). Returns `(o [B, T, HV, V], final_state [N, HV, K, V]
  or None)`. `cu_seqlens_cpu` and `chunk_indices` are accepted and unused; see the module
  docstring for the rest.
  """
  del cu_seqlens_cpu, chunk_indices  # derived from cu_seqlens here
  fn = "chunk_gated_delta_rule"
  _check_extras(fn, kwargs, head_first)
  _not_supported(fn, "cp_context", cp_context, None)
  hv, _ = _heads(fn, q, v)
  if _flag(fn, "use_gate_in_kernel", use_gate_in_kernel):
    g = _gdn_gate(fn, g, A_log, dt_bias, hv)
  beta = _beta(fn, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
  return _run(fn, ops.gated_delta_rule, q, k, v, (g, beta), scale=scale,
              initial_state=initial_state, output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=state_v_first,
              cu_seqlens=cu_seqlens, chunk_size=chunk_size, implementation=implementation)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                     initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                     A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                                     allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, *, chunk_size=64, head_first=False,
                                     implementation=None, **kwargs):
  """FLA's `fused_recurrent_gated_delta_rule` (alias `fused_recurrent_gdn`).

  FLA's recurrent kernel takes any of three decays. Here: g `[B, T, HV]` alone goes to
  `ops.gated_delta_rule`; a per-key decay gk `[B, T, HV, K]` (plus g, if given, broadcast over K)
  to `ops.kda`; neither to `ops.delta_rule`. `use_gate_in_kernel` acts on g only (as FLA). beta
  `[B, T, HV]` defaults to ones. Not supported: `gv` (a per-value decay) and a per-value beta
  `[B, T, HV, V]`.
  """
  fn = "fused_recurrent_gated_delta_rule"
  _check_extras(fn, kwargs, head_first)
  _not_supported(fn, "gv", gv, None)
  hv, _ = _heads(fn, q, v)
  if beta is None:
    beta = jnp.ones(v.shape[:3], jnp.float32)
  elif getattr(beta, "ndim", 3) == 4:
    raise NotImplementedError(f"{fn}: a per-value `beta` [B, T, HV, V] is not supported; pass "
                              f"beta [B, T, HV].")
  if _flag(fn, "use_gate_in_kernel", use_gate_in_kernel):
    if g is None:
      raise ValueError(f"{fn}: `g` (the raw gate input) must be given with "
                       f"`use_gate_in_kernel=True`.")
    g = _gdn_gate(fn, g, A_log, dt_bias, hv)
  beta = _beta(fn, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
  if gk is not None:
    if g is not None:
      _array(fn, "g", g, 3)
      _array(fn, "gk", gk, 4)
      gk = gk.astype(jnp.float32) + g.astype(jnp.float32)[..., None]
    op, gates = ops.kda, (gk, beta)
  elif g is not None:
    op, gates = ops.gated_delta_rule, (g, beta)
  else:
    op, gates = ops.delta_rule, (beta,)
  return _run(fn, op, q, k, v, gates, scale=scale, initial_state=initial_state,
              output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=state_v_first,
              cu_seqlens=cu_seqlens, chunk_size=chunk_size, implementation=implementation)


chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule


# ----------------------------------------------------------------------------------------------
# DeltaNet (fla.ops.delta_rule).

def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, *,
                     chunk_size=64, head_first=False, implementation=None, **kwargs):
  """FLA's `chunk_delta_rule` on `lineax_attn.ops.delta_rule`.

  q, k `[B, T, H, K]`, v `[B, T, HV, V]`, beta `[B, T, HV]`. Returns `(o, final_state or None)`.
  """
  del cu_seqlens_cpu
  fn = "chunk_delta_rule"
  _check_extras(fn, kwargs, head_first)
  return _run(fn, ops.delta_rule, q, k, v, (beta,), scale=scale, initial_state=initial_state,
              output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=False,
              cu_seqlens=cu_seqlens, chunk_size=chunk_size, implementation=implementation)


def fused_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False,
                               cu_seqlens=None, *, chunk_size=64, head_first=False,
                               implementation=None, **kwargs):
  """FLA's `fused_recurrent_delta_rule` on `lineax_attn.ops.delta_rule`; beta defaults to ones
  (per-value beta `[B, T, HV, V]` is not supported)."""
  fn = "fused_recurrent_delta_rule"
  _check_extras(fn, kwargs, head_first)
  if beta is None:
    _heads(fn, q, v)
    beta = jnp.ones(v.shape[:3], jnp.float32)
  elif getattr(beta, "ndim", 3) == 4:
    raise NotImplementedError(f"{fn}: a per-value `beta` [B, T, HV, V] is not supported; pass "
                              f"beta [B, T, HV].")
  return _run(fn, ops.delta_rule, q, k, v, (beta,), scale=scale, initial_state=initial_state,
              output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=False,
              cu_seqlens=cu_seqlens, chunk_size=chunk_size, implementation=implementation)


# ----------------------------------------------------------------------------------------------
# Kimi Delta Attention (fla.ops.kda).

def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
              lower_bound=None, disable_recompute=False, return_intermediate_states=False,
              state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None, *,
              A_log=None, dt_bias=None, chunk_size=64, head_first=False, implementation=None,
              **kwargs):
  """FLA's `chunk_kda` on `lineax_attn.ops.kda`.

  g `[B, T, HV, K]` is a log decay (raw with `use_gate_in_kernel=True`: then A_log `[HV]`,
  dt_bias `[HV * K]`, and `lower_bound` selects the bounded gate), beta `[B, T, HV]`.
  `safe_gate`, `disable_recompute` and `cu_seqlens_cpu` only tune FLA's kernels and are accepted
  without effect.
  """
  del cu_seqlens_cpu
  fn = "chunk_kda"
  _check_extras(fn, kwargs, head_first)
  _not_supported(fn, "cp_context", cp_context, None)
  _not_supported(fn, "return_intermediate_states",
                 _flag(fn, "return_intermediate_states", return_intermediate_states), False)
  _flag(fn, "disable_recompute", disable_recompute)
  safe_gate = _flag(fn, "safe_gate", safe_gate)
  hv, dk = _heads(fn, q, v)
  if _flag(fn, "use_gate_in_kernel", use_gate_in_kernel):
    g = _channel_gate(fn, g, A_log, dt_bias, lower_bound, safe_gate, hv, dk)
  beta = _beta(fn, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
  return _run(fn, ops.kda, q, k, v, (g, beta), scale=scale, initial_state=initial_state,
              output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=state_v_first,
              cu_seqlens=cu_seqlens, chunk_size=chunk_size, implementation=implementation)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None,
                        initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                        lower_bound=None, state_v_first=False, cu_seqlens=None, *,
                        chunk_size=64, head_first=False, implementation=None, **kwargs):
  """FLA's `fused_recurrent_kda` on `lineax_attn.ops.kda` (as `chunk_kda`; per-value beta
  `[B, T, HV, V]` is not supported)."""
  fn = "fused_recurrent_kda"
  _check_extras(fn, kwargs, head_first)
  if getattr(beta, "ndim", 3) == 4:
    raise NotImplementedError(f"{fn}: a per-value `beta` [B, T, HV, V] is not supported; pass "
                              f"beta [B, T, HV].")
  hv, dk = _heads(fn, q, v)
  if _flag(fn, "use_gate_in_kernel", use_gate_in_kernel):
    g = _channel_gate(fn, g, A_log, dt_bias, lower_bound, False, hv, dk)
  beta = _beta(fn, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
  return _run(fn, ops.kda, q, k, v, (g, beta), scale=scale, initial_state=initial_state,
              output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=state_v_first,
              cu_seqlens=cu_seqlens, chunk_size=chunk_size, implementation=implementation)


# ----------------------------------------------------------------------------------------------
# Gated DeltaNet-2 (fla.ops.gdn2).

def chunk_gdn2(q, k, v, g, b, w, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, cu_seqlens=None,
               cu_seqlens_cpu=None, safe_gate=False, lower_bound=None, disable_recompute=False,
               return_intermediate_states=False, state_v_first=False, *, A_log=None,
               dt_bias=None, chunk_size=64, head_first=False, implementation=None, **kwargs):
  """FLA's `chunk_gdn2` on `lineax_attn.ops.gdn2`:
  S_t = (I − k_t (b_t ⊙ k_t)ᵀ) Diag(exp(g_t)) S_{t−1} + k_t (w_t ⊙ v_t)ᵀ.

  g `[B, T, HV, K]` log decay (raw with `use_gate_in_kernel=True`, as `chunk_kda`), b
  `[B, T, HV, K]` erase gate, w `[B, T, HV, V]` write gate.
  """
  del cu_seqlens_cpu
  fn = "chunk_gdn2"
  _check_extras(fn, kwargs, head_first)
  _not_supported(fn, "return_intermediate_states",
                 _flag(fn, "return_intermediate_states", return_intermediate_states), False)
  _flag(fn, "disable_recompute", disable_recompute)
  safe_gate = _flag(fn, "safe_gate", safe_gate)
  hv, dk = _heads(fn, q, v)
  if _flag(fn, "use_gate_in_kernel", use_gate_in_kernel):
    g = _channel_gate(fn, g, A_log, dt_bias, lower_bound, safe_gate, hv, dk)
  return _run(fn, ops.gdn2, q, k, v, (g, b, w), scale=scale, initial_state=initial_state,
              output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=state_v_first,
              cu_seqlens=cu_seqlens, chunk_size=chunk_size, implementation=implementation)


def fused_recurrent_gdn2(q, k, v, g, b, w, A_log=None, dt_bias=None, scale=None,
                         initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                         lower_bound=None, state_v_first=False, cu_seqlens=None, *,
                         chunk_size=64, head_first=False, implementation=None, **kwargs):
  """FLA's `fused_recurrent_gdn2` on `lineax_attn.ops.gdn2` (as `chunk_gdn2`)."""
  fn = "fused_recurrent_gdn2"
  _check_extras(fn, kwargs, head_first)
  hv, dk = _heads(fn, q, v)
  if _flag(fn, "use_gate_in_kernel", use_gate_in_kernel):
    g = _channel_gate(fn, g, A_log, dt_bias, lower_bound, False, hv, dk)
  return _run(fn, ops.gdn2, q, k, v, (g, b, w), scale=scale, initial_state=initial_state,
              output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=state_v_first,
              cu_seqlens=cu_seqlens, chunk_size=chunk_size, implementation=implementation)


# ----------------------------------------------------------------------------------------------
# Simple GLA (fla.ops.simple_gla): decay only, one scalar per head and step (Mamba-2's SSD core).

def _simple_gla_gate(fn: str, q, v, g, g_gamma):
  """g `[B, T, HV]` log decay, or FLA's data-independent g_gamma `[HV]` broadcast over (B, T);
  neither: no decay (linear attention without normaliser, as FLA's kernel then computes)."""
  if g is not None and g_gamma is not None:
    raise ValueError(f"{fn}: pass `g` or `g_gamma`, not both (FLA: only one of them).")
  b, t, hv = q.shape[0], q.shape[1], v.shape[2]
  if g_gamma is not None:
    return jnp.broadcast_to(_param(fn, "g_gamma", g_gamma, (hv,)), (b, t, hv))
  if g is None:
    return jnp.zeros((b, t, hv), jnp.float32)
  _array(fn, "g", g, 3)
  return g


def _simple_gla(fn: str, q, k, v, g, g_gamma, **run_kwargs):
  """The shared body of both simple-GLA names: heads, the gate, then the op."""
  _heads(fn, q, v)
  g = _simple_gla_gate(fn, q, v, g, g_gamma)
  return _run(fn, ops.simple_gla, q, k, v, (g,), use_qk_l2norm_in_kernel=False, **run_kwargs)


def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                     output_final_state=False, state_v_first=False, cu_seqlens=None,
                     cu_seqlens_cpu=None, *, chunk_size=64, head_first=False,
                     implementation=None, **kwargs):
  """FLA's `chunk_simple_gla` on `lineax_attn.ops.simple_gla`: S_t = e^{g_t} S_{t−1} + k_t v_tᵀ.

  q, k `[B, T, H, K]`, v `[B, T, HV, V]`, g `[B, T, HV]` log decay or g_gamma `[HV]` (one
  constant log decay per head). Returns `(o [B, T, HV, V], final_state [N, HV, K, V] or None)`.
  """
  del cu_seqlens_cpu  # derived from cu_seqlens here
  fn = "chunk_simple_gla"
  _check_extras(fn, kwargs, head_first)
  return _simple_gla(fn, q, k, v, g, g_gamma, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, state_v_first=state_v_first,
                     cu_seqlens=cu_seqlens, chunk_size=chunk_size, implementation=implementation)


def fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                               output_final_state=False, reverse=False, state_v_first=False,
                               cu_seqlens=None, *, chunk_size=64, head_first=False,
                               implementation=None, **kwargs):
  """FLA's `fused_recurrent_simple_gla`: the same op as `chunk_simple_gla` (`reverse=True` is
  not supported)."""
  fn = "fused_recurrent_simple_gla"
  _check_extras(fn, kwargs, head_first)
  _not_supported(fn, "reverse", _flag(fn, "reverse", reverse), False)
  return _simple_gla(fn, q, k, v, g, g_gamma, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, state_v_first=state_v_first,
                     cu_seqlens=cu_seqlens, chunk_size=chunk_size, implementation=implementation)


# ----------------------------------------------------------------------------------------------
# Linear attention (fla.ops.linear_attn).

def _segmented_cumsum(x, starts):
  """Inclusive cumulative sum along axis 1 that restarts where `starts` [T] is True."""
  def combine(a, b):
    (xa, fa), (xb, fb) = a, b
    return xb + jnp.where(fb, 0.0, 1.0)[..., None, None] * xa, jnp.logical_or(fa, fb)
  flags = jnp.broadcast_to(starts, x.shape[:2])
  total, _ = jax.lax.associative_scan(combine, (x, flags), axis=1)
  return total


def _z_init(fn, z_init, rows, h, dk):
  _array(fn, "initial_state[1]", z_init, 4)
  if tuple(z_init.shape) != (rows, 1, h, dk):
    raise ValueError(f"{fn}: the z_state of `initial_state` must have shape [N, 1, H, K] = "
                     f"{(rows, 1, h, dk)}, got {tuple(z_init.shape)}.")
  return z_init.astype(jnp.float32)


def _normalize(o, q, k, scale, z_init, cu_seqlens):
  """FLA's normaliser: o_t / (scale·q_t·z_t + 1e-10), z_t = z_0 + Σ_{s<=t} k_s per sequence."""
  _, t, h, _ = q.shape
  kf = k.astype(jnp.float32)
  pos = jnp.arange(t)
  if cu_seqlens is None:
    z = jnp.cumsum(kf, axis=1)
    if z_init is not None:
      z = z + z_init
    z_state = z[:, -1:]
  else:
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    seq = jnp.searchsorted(cu, pos, side="right") - 1          # sequence of each token
    z = _segmented_cumsum(kf, pos == cu[seq])
    if z_init is not None:
      z = z + z_init[:, 0][seq][None]
    z_state = z[0, cu[1:] - 1][:, None]
  denom = jnp.sum(q.astype(jnp.float32) * scale * z, axis=-1, keepdims=True) + LINEAR_ATTN_EPS
  denom = jnp.repeat(denom, o.shape[2] // h, axis=2)          # value head j reads key head j // G
  return (o.astype(jnp.float32) / denom).astype(o.dtype), z_state


def _linear_attn(fn, q, k, v, scale, initial_state, output_final_state, normalize, reverse,
                 cu_seqlens, chunk_size, implementation):
  normalize = _flag(fn, "normalize", normalize)
  reverse = _flag(fn, "reverse", reverse)
  if normalize and isinstance(initial_state, tuple):
    if len(initial_state) != 2:
      raise ValueError(f"{fn}: `initial_state` must be (kv_state, z_state) with normalize=True, "
                       f"got a tuple of {len(initial_state)}.")
    kv_init, z_init = initial_state
  elif isinstance(initial_state, tuple):
    raise ValueError(f"{fn}: a (kv_state, z_state) `initial_state` needs `normalize=True`.")
  else:
    kv_init, z_init = initial_state, None
  _, dk = _heads(fn, q, v)
  scale = dk ** -0.5 if scale is None else scale
  if z_init is not None:    # checked before the op runs
    rows = q.shape[0] if cu_seqlens is None else np.shape(cu_seqlens)[0] - 1
    z_init = _z_init(fn, z_init, rows, q.shape[2], dk)
  if reverse:
    # A reverse scan is the forward one on time-flipped inputs (and sequences, in varlen).
    q, k, v = (jnp.flip(_array(fn, n, x, 4), axis=1) for n, x in (("q", q), ("k", k), ("v", v)))
    if cu_seqlens is not None:
      cu_seqlens = q.shape[1] - jnp.flip(jnp.asarray(cu_seqlens))
      kv_init = None if kv_init is None else jnp.flip(kv_init, axis=0)
      z_init = None if z_init is None else jnp.flip(z_init, axis=0)
  o, final_state = _run(fn, ops.linear_attention, q, k, v, (), scale=scale, initial_state=kv_init,
                        output_final_state=output_final_state, use_qk_l2norm_in_kernel=False,
                        state_v_first=False, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                        implementation=implementation)
  z_state = None
  if normalize:
    o, z_state = _normalize(o, q, k, scale, z_init, cu_seqlens)
  if reverse:
    o = jnp.flip(o, axis=1)
    if cu_seqlens is not None:
      final_state = None if final_state is None else jnp.flip(final_state, axis=0)
      z_state = None if z_state is None else jnp.flip(z_state, axis=0)
  if normalize:
    return o, (final_state, z_state)
  return o, final_state


def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False,
                      normalize=True, cu_seqlens=None, *, chunk_size=64, head_first=False,
                      implementation=None, **kwargs):
  """FLA's `chunk_linear_attn` on `lineax_attn.ops.linear_attention`.

  With `normalize=True` (FLA's default) o_t is divided by scale·q_t·z_t + 1e-10, z_t the running
  sum of the keys from z_0, `initial_state` may be a tuple `(kv_state [N, HV, K, V], z_state
  [N, 1, H, K])`, and the result is `(o, (final_state or None, z_state))` (as FLA, z always).
  With `normalize=False`: `(o, final_state or None)`.
  """
  fn = "chunk_linear_attn"
  _check_extras(fn, kwargs, head_first)
  return _linear_attn(fn, q, k, v, scale, initial_state, output_final_state, normalize, False,
                      cu_seqlens, chunk_size, implementation)


def fused_recurrent_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False,
                                reverse=False, normalize=False, cu_seqlens=None, *,
                                chunk_size=64, head_first=False, implementation=None, **kwargs):
  """FLA's `fused_recurrent_linear_attn`: as `chunk_linear_attn` but `normalize=False` by default,
  and `reverse=True` runs each sequence from its last token to its first (its final state is the
  one after the first token; z_t sums the keys from t to the end)."""
  fn = "fused_recurrent_linear_attn"
  _check_extras(fn, kwargs, head_first)
  return _linear_attn(fn, q, k, v, scale, initial_state, output_final_state, normalize, reverse,
                      cu_seqlens, chunk_size, implementation)
