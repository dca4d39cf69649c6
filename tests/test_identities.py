"""Exact identities of the linear mixers (docs/MATH.md §9, items 6-13), for "scan" and "chunk".

Each test builds inputs for which the recurrence of docs/MATH.md §2 has a closed form (or reduces
to another mixer) and checks the op against that oracle, computed in numpy float64 where it is
a formula. Tolerances follow §9: fp32 outputs/states/r at rel 1e-5 (`helpers.assert_close`).

All inputs are drawn with numpy (no eager jax ops to compile) and every op call goes through
one jitted runner, so each (mixer, implementation, shape) compiles once for the whole file.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close
from lineax_attn import ops
from lineax_attn.ops import specs

IMPLS = ("scan", "chunk")
DELTA_MIXERS = ("delta_rule", "gated_delta_rule", "kda", "gdn2")
TOL = 1e-5        # docs/MATH.md §9: fp32 o, states and r
GRAD_TOL = 5e-5   # docs/MATH.md §9: fp32 gradients
CHUNK = 16
# Default shapes: T = 40 crosses two chunk boundaries at C = 16; HV = 2·H exercises GVA.
B, T, H, HV, DK, DV = 2, 40, 2, 4, 8, 12


@functools.partial(jax.jit, static_argnames=("mixer", "impl", "chunk_size", "scale"))
def _run(mixer, impl, args, initial_state=None, segment_ids=None, chunk_size=CHUNK, scale=None):
  """(o, final_state, r) of `ops.<mixer>` with every output requested."""
  return getattr(ops, mixer)(*args, initial_state=initial_state, segment_ids=segment_ids,
                             output_final_state=True, return_residual=True, scale=scale,
                             chunk_size=chunk_size, implementation=impl)


def _unit(x, axis=-1):
  """Exactly unit rows (no eps), normalised in float64."""
  x = np.asarray(x, np.float64)
  return x / np.linalg.norm(x, axis=axis, keepdims=True)


def _f32(*xs):
  return tuple(jnp.asarray(np.asarray(x, np.float32)) for x in xs)


def _base(seed, b=B, t=T, h=H, hv=HV, dk=DK, dv=DV):
  """Random q, k (unit rows), v, initial state S0 as numpy float32, plus the generator."""
  rng = np.random.default_rng(seed)
  q = _unit(rng.standard_normal((b, t, h, dk))).astype(np.float32)
  k = _unit(rng.standard_normal((b, t, h, dk))).astype(np.float32)
  v = rng.standard_normal((b, t, hv, dv)).astype(np.float32)
  s0 = rng.standard_normal((b, hv, dk, dv)).astype(np.float32)
  return rng, q, k, v, s0


def _gates(rng, mixer, b=B, t=T, hv=HV, dk=DK, dv=DV, tau=1.0):
  """docs/MATH.md §9 gates (`specs.random_gates`): β, b, w = σ(N(0,1)); g = logsigmoid(N(0,1)) / τ."""
  return specs.random_gates(mixer, lambda _, shape: rng.standard_normal(shape), b=b, t=t, hv=hv,
                            dk=dk, dv=dv, tau=tau, xp=np)


def _key_heads_to_value_heads(x, hv):
  """[B, T, H, K] -> [B, T, HV, K] (value head j reads key head j // (HV / H))."""
  return np.repeat(np.asarray(x, np.float64), hv // x.shape[2], axis=2)


def _assert_same_outputs(out, ref, name):
  for part, x, y in zip(("o", "final_state", "r"), out, ref):
    assert_close(x, y, TOL, f"{name}: {part}")


# ----------------------------------------------------------------------------------------------
# §9.6 No write leaves the state unchanged (up to decay).


@pytest.mark.parametrize("impl", IMPLS)
def test_delta_rule_beta_zero_keeps_state(impl):
  """β = 0: S_t = S_{t−1} for all t, so S_T = S_0, r = 0 and o_t = S_0ᵀ (scale·q_t)."""
  _, q, k, v, s0 = _base(0)
  beta = np.zeros((B, T, HV), np.float32)
  o, s, r = _run("delta_rule", impl, _f32(q, k, v, beta), jnp.asarray(s0))
  assert_close(s, s0, TOL, "final_state")
  assert np.max(np.abs(np.asarray(r))) == 0.0, "r must be exactly 0 when beta = 0"
  o_ref = DK ** -0.5 * np.einsum("bthk,bhkv->bthv", _key_heads_to_value_heads(q, HV), s0)
  assert_close(o, o_ref, TOL, "o")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mixer", ("gated_delta_rule", "kda", "gdn2"))
def test_no_write_is_pure_decay(mixer, impl):
  """β = 0 (GDN-2: b = w = 0): S_t = Diag(exp(G_t)) S_0 with G_t = Σ_{s<=t} g_s, across chunks.

  Checks S_T, r = 0 and every o_t = (Diag(exp(G_t)) S_0)ᵀ (scale·q_t) in float64.
  τ = 10 keeps exp(G_T) well away from 0 over T = 40 so the check is not vacuous.
  """
  rng, q, k, v, s0 = _base(1)
  gates = list(_gates(rng, mixer, tau=10.0))
  if mixer == "gdn2":
    gates[1] = np.zeros_like(gates[1])
    gates[2] = np.zeros_like(gates[2])
  else:
    gates[1] = np.zeros_like(gates[1])
  g = np.asarray(gates[0], np.float64)
  if g.ndim == 3:  # scalar gate: the same decay on every key channel
    g = np.broadcast_to(g[..., None], (B, T, HV, DK))
  G = np.cumsum(g, axis=1)                                       # [B, T, HV, K]

  o, s, r = _run(mixer, impl, _f32(q, k, v, *gates), jnp.asarray(s0))
  s_ref = np.exp(G[:, -1])[..., None] * s0
  assert np.min(np.exp(G[:, -1])) > 1e-3  # the decayed state is not ~0
  assert_close(s, s_ref, TOL, "final_state")
  assert np.max(np.abs(np.asarray(r))) == 0.0, "r must be exactly 0 without writes"
  states = np.exp(G)[..., None] * s0[:, None]                    # [B, T, HV, K, V]
  o_ref = DK ** -0.5 * np.einsum("bthk,bthkv->bthv", _key_heads_to_value_heads(q, HV), states)
  assert_close(o, o_ref, TOL, "o")


# ----------------------------------------------------------------------------------------------
# §9.7-9.10 Reductions between mixers.


@pytest.mark.parametrize("impl", IMPLS)
def test_gdn_with_zero_gate_is_delta_rule(impl):
  rng, q, k, v, s0 = _base(2)
  _, beta = _gates(rng, "gated_delta_rule")
  g = np.zeros((B, T, HV))
  out = _run("gated_delta_rule", impl, _f32(q, k, v, g, beta), jnp.asarray(s0))
  ref = _run("delta_rule", impl, _f32(q, k, v, beta), jnp.asarray(s0))
  _assert_same_outputs(out, ref, "GDN(g=0) vs DeltaNet")


@pytest.mark.parametrize("impl", IMPLS)
def test_kda_with_channel_uniform_gate_is_gdn(impl):
  rng, q, k, v, s0 = _base(3)
  g, beta = _gates(rng, "gated_delta_rule")
  g_channel = np.broadcast_to(g[..., None], (B, T, HV, DK))
  out = _run("kda", impl, _f32(q, k, v, g_channel, beta), jnp.asarray(s0))
  ref = _run("gated_delta_rule", impl, _f32(q, k, v, g, beta), jnp.asarray(s0))
  _assert_same_outputs(out, ref, "KDA(uniform g) vs GDN")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("unit_beta", (False, True), ids=("b=w=beta", "b=w=1"))
def test_gdn2_with_beta_gates_is_kda(impl, unit_beta):
  """b_t = w_t = β_t·1 gives KDA; b = w = 1 gives KDA with β = 1."""
  rng, q, k, v, s0 = _base(4)
  g, beta = _gates(rng, "kda")
  if unit_beta:
    beta = np.ones_like(beta)
  gate_b = np.broadcast_to(beta[..., None], (B, T, HV, DK))
  gate_w = np.broadcast_to(beta[..., None], (B, T, HV, DV))
  out = _run("gdn2", impl, _f32(q, k, v, g, gate_b, gate_w), jnp.asarray(s0))
  ref = _run("kda", impl, _f32(q, k, v, g, beta), jnp.asarray(s0))
  _assert_same_outputs(out, ref, "GDN-2(b=w=beta) vs KDA")


@pytest.mark.parametrize("impl", IMPLS)
def test_gdn2_without_erase_or_decay_is_linear_attention(impl):
  """b = 0, w = 1, g = 0 gives linear attention (r = v)."""
  _, q, k, v, s0 = _base(5)
  g = np.zeros((B, T, HV, DK))
  gate_b = np.zeros((B, T, HV, DK))
  gate_w = np.ones((B, T, HV, DV))
  out = _run("gdn2", impl, _f32(q, k, v, g, gate_b, gate_w), jnp.asarray(s0))
  ref = _run("linear_attention", impl, _f32(q, k, v), jnp.asarray(s0))
  _assert_same_outputs(out, ref, "GDN-2(b=0,w=1,g=0) vs linear attention")
  assert_close(out[2], v, TOL, "r = v")


@pytest.mark.parametrize("impl", IMPLS)
def test_linear_attention_is_causal_quadratic_form(impl):
  """O = scale·((M≤ ⊙ Q Kᵀ) V + Q S_0), per value head, in float64; S_T = S_0 + Kᵀ V."""
  _, q, k, v, s0 = _base(6)
  o, s, r = _run("linear_attention", impl, _f32(q, k, v), jnp.asarray(s0))
  qh = _key_heads_to_value_heads(q, HV)
  kh = _key_heads_to_value_heads(k, HV)
  v64 = v.astype(np.float64)
  causal = np.tril(np.ones((T, T)))
  scores = np.einsum("bthk,bshk->bhts", qh, kh) * causal
  o_ref = DK ** -0.5 * (np.einsum("bhts,bshv->bthv", scores, v64)
                        + np.einsum("bthk,bhkv->bthv", qh, s0))
  s_ref = s0 + np.einsum("bthk,bthv->bhkv", kh, v64)
  assert_close(o, o_ref, TOL, "o")
  assert_close(s, s_ref, TOL, "final_state")
  assert_close(r, v, TOL, "r")


# ----------------------------------------------------------------------------------------------
# §9.11 Householder / WY: with V = 0 one chunk of DeltaNet is an ordered product of reflections.


@pytest.mark.parametrize("impl,chunk_size", (("scan", 16), ("chunk", 16), ("chunk", 32)))
def test_delta_rule_one_chunk_is_householder_product(impl, chunk_size):
  """S_C = (I − β_C k_C k_Cᵀ) ··· (I − β_1 k_1 k_1ᵀ) S_0 (float64), T = C."""
  rng, q, k, _, s0 = _base(7, t=chunk_size)
  v = np.zeros((B, chunk_size, HV, DV))
  (beta,) = _gates(rng, "delta_rule", t=chunk_size)
  _, s, _ = _run("delta_rule", impl, _f32(q, k, v, beta), jnp.asarray(s0), chunk_size=chunk_size)
  kh = _key_heads_to_value_heads(k, HV)
  s_ref = s0.astype(np.float64)
  for t in range(chunk_size):  # apply t = 1 first, so the product reads right to left
    house = np.eye(DK) - beta[:, t, :, None, None] * np.einsum("bhi,bhj->bhij", kh[:, t], kh[:, t])
    s_ref = house @ s_ref
  assert_close(s, s_ref, TOL, "final_state")


# ----------------------------------------------------------------------------------------------
# §9.12 Exact read-back, §9.13 contraction.


def _unit_write_gates(rng, mixer, t, b=B):
  """Gates with β = 1 (GDN-2: b = w = 1) and τ = 1 decays."""
  gates = list(_gates(rng, mixer, b=b, t=t))
  if mixer == "gdn2":
    gates[1], gates[2] = np.ones_like(gates[1]), np.ones_like(gates[2])
  else:
    gates[-1] = np.ones_like(gates[-1])
  return gates


def _read(s, k_last):
  """S_tᵀ k_t in float64; s [B, HV, K, V], k_last [B, HV, K] -> [B, HV, V]."""
  return np.einsum("bhkv,bhk->bhv", np.asarray(s, np.float64), k_last)


# t = 17 (C + 1) is `-m slow` (suite time): t = T = 40 runs the same code (several chunks, the
# last one padded, no segment ids) at shapes the file has compiled already, and
# test_exact_read_back_every_prefix checks the identity at t = 17 itself (every t <= 24).
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mixer", DELTA_MIXERS)
@pytest.mark.parametrize("t", (pytest.param(17, marks=pytest.mark.slow), T))
def test_exact_read_back_at_last_token(mixer, impl, t):
  """With ‖k_t‖ = 1 and β = 1, S_tᵀ k_t = v_t: check the final token of the first t tokens."""
  rng, q, k, v, s0 = _base(8)
  gates = _unit_write_gates(rng, mixer, T)
  trunc = lambda x: np.asarray(x)[:, :t]
  _, s, _ = _run(mixer, impl, _f32(*map(trunc, (q, k, v, *gates))), jnp.asarray(s0))
  k_last = _key_heads_to_value_heads(k, HV)[:, t - 1]
  assert_close(_read(s, k_last), v[:, t - 1], TOL, "S_t^T k_t vs v_t")


def _prefix_segment_ids(t):
  """[t, t] ids: row i has i + 1 real tokens then trailing padding (identity steps)."""
  return jnp.asarray(np.arange(t)[None, :] <= np.arange(t)[:, None], jnp.int32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mixer", DELTA_MIXERS)
def test_exact_read_back_every_prefix(mixer, impl):
  """Same identity at every t: row i of a [T, T] batch holds the sequence's first i + 1 tokens
  followed by padding, so its final_state is S_{i+1} (docs/MATH.md §1.7)."""
  t = 24
  rng, q, k, v, s0 = _base(9, b=1, t=t)
  gates = _unit_write_gates(rng, mixer, t, b=1)
  tile = lambda x: np.repeat(np.asarray(x), t, axis=0)
  _, s, _ = _run(mixer, impl, _f32(*map(tile, (q, k, v, *gates))), jnp.asarray(tile(s0)),
                 segment_ids=_prefix_segment_ids(t))
  k_last = _key_heads_to_value_heads(k, HV)[0]          # [t, HV, K]: row i reads k_{i+1}
  assert_close(_read(s, k_last), v[0], TOL, "S_t^T k_t vs v_t")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mixer", ("delta_rule", "gated_delta_rule", "kda"))
def test_no_write_contracts_state(mixer, impl):
  """β ∈ [0, 2], unit keys, v = 0: ‖S_t‖_F ≤ ‖S_{t−1}‖_F at every t (not asserted for GDN-2)."""
  t = 24
  rng, q, k, _, s0 = _base(10, b=1, t=t)
  v = np.zeros((1, t, HV, DV))
  gates = list(_gates(rng, mixer, b=1, t=t))
  gates[-1] = rng.uniform(0.0, 2.0, size=(1, t, HV))
  gates[-1][0, 0], gates[-1][0, 1] = 0.0, 2.0  # the ends of the range: identity, reflection
  tile = lambda x: np.repeat(np.asarray(x), t, axis=0)
  _, s, _ = _run(mixer, impl, _f32(*map(tile, (q, k, v, *gates))), jnp.asarray(tile(s0)),
                 segment_ids=_prefix_segment_ids(t))
  norms = np.linalg.norm(np.asarray(s, np.float64), axis=(-2, -1))       # [t, HV]: ‖S_1..S_t‖
  norms = np.concatenate([np.linalg.norm(s0.astype(np.float64), axis=(-2, -1)), norms])
  # fp32 slack: a β = 2 or β = 0 step keeps the norm exactly, up to rounding.
  assert np.all(norms[1:] <= norms[:-1] * (1 + 1e-5)), np.diff(norms, axis=0).max()
  assert np.all(norms[-1] < 0.9 * norms[0])  # and it really contracted


# ----------------------------------------------------------------------------------------------
# Extreme inputs: the chunk form stays finite and equal to the scan, forward and backward.


def _loss(mixer, impl, args, s0, cot):
  o, s, r = _run(mixer, impl, args, s0)
  return jnp.sum(o * cot[0]) + jnp.sum(s * cot[1]) + jnp.sum(r * cot[2])


_grad = jax.jit(jax.grad(_loss, argnums=(2, 3)), static_argnums=(0, 1))


def _extreme_cases():
  cases = []
  for gate in (0.0, 1.0):
    cases.append(("delta_rule", None, (gate,)))
    for g in (-1e4, 0.0):
      cases.append(("gated_delta_rule", g, (gate,)))
      cases.append(("kda", g, (gate,)))
      for w in (0.0, 1.0):
        cases.append(("gdn2", g, (gate, w)))
  return cases


def _extreme_inputs(mixer, g_value, gate_values, seed, b=B, t=T, h=H, hv=HV, dk=DK, dv=DV):
  rng, q, k, v, s0 = _base(seed, b=b, t=t, h=h, hv=hv, dk=dk, dv=dv)
  shapes = {"delta_rule": [(b, t, hv)], "gated_delta_rule": [(b, t, hv), (b, t, hv)],
            "kda": [(b, t, hv, dk), (b, t, hv)],
            "gdn2": [(b, t, hv, dk), (b, t, hv, dk), (b, t, hv, dv)]}[mixer]
  values = ((g_value,) if g_value is not None else ()) + tuple(gate_values)
  gates = [np.full(shape, val) for shape, val in zip(shapes, values)]
  return rng, _f32(q, k, v, *gates), jnp.asarray(s0)


@pytest.mark.parametrize("mixer,g_value,gate_values", _extreme_cases())
def test_extreme_gates_finite_and_match_scan(mixer, g_value, gate_values):
  """log gates −1e4 / 0 everywhere, β (or b, w) 0 / 1: chunk o, S, r and all gradients finite
  and equal to the scan's (rel 1e-5 forward, 5e-5 gradients)."""
  rng, args, s0 = _extreme_inputs(mixer, g_value, gate_values, seed=11)
  out = _run(mixer, "chunk", args, s0)
  ref = _run(mixer, "scan", args, s0)
  for part, x in zip(("o", "final_state", "r"), out):
    assert np.all(np.isfinite(np.asarray(x))), f"chunk {part} not finite"
  _assert_same_outputs(out, ref, f"{mixer} chunk vs scan")

  cot = _f32(*(rng.standard_normal(np.shape(x)) for x in ref))
  grads = _grad(mixer, "chunk", args, s0, cot)
  grads_ref = _grad(mixer, "scan", args, s0, cot)
  flat, flat_ref = jax.tree.leaves(grads), jax.tree.leaves(grads_ref)
  for i, (x, y) in enumerate(zip(flat, flat_ref)):
    assert np.all(np.isfinite(np.asarray(x))), f"chunk gradient {i} not finite"
    assert_close(x, y, GRAD_TOL, f"gradient {i}")


@pytest.mark.parametrize("mixer", ("kda", "gdn2"))
def test_strong_decay_gradients_finite(mixer):
  """g = −1e4 on every channel but not every token (mixed with τ = 0.1 decays): gradients of the
  chunk form, incl. dg, stay finite (no exp overflow in the backward pass)."""
  rng, q, k, v, s0 = _base(12)
  gates = list(_gates(rng, mixer, tau=0.1))
  gates[0] = np.where(rng.uniform(size=gates[0].shape) < 0.5, -1e4, gates[0])
  args = _f32(q, k, v, *gates)
  cot = _f32(*(rng.standard_normal(shape) for shape in
               ((B, T, HV, DV), (B, HV, DK, DV), (B, T, HV, DV))))
  grads = jax.tree.leaves(_grad(mixer, "chunk", args, jnp.asarray(s0), cot))
  for i, x in enumerate(grads):
    assert np.all(np.isfinite(np.asarray(x))), f"gradient {i} not finite"
  assert np.any(np.asarray(grads[3]) != 0)  # dg is not trivially zero


LONG_T = 4097  # one token past a multiple of every chunk size


@pytest.mark.parametrize("mixer", ("kda", "gdn2"))
def test_long_sequence_chunk_finite(mixer):
  """T = 4097, strong decays (τ = 0.1): chunk forward and gradients are finite (the per-channel
  path, the one with overflow hazards; the scan comparison below covers all forwards)."""
  rng, q, k, v, s0 = _base(13, b=1, t=LONG_T, h=1, hv=1, dk=16, dv=16)
  gates = _gates(rng, mixer, b=1, t=LONG_T, hv=1, dk=16, dv=16, tau=0.1)
  args = _f32(q, k, v, *gates)
  out = _run(mixer, "chunk", args, jnp.asarray(s0))
  for part, x in zip(("o", "final_state", "r"), out):
    assert np.all(np.isfinite(np.asarray(x))), f"{part} not finite"
  cot = _f32(*(rng.standard_normal(np.shape(x)) for x in out))
  for i, x in enumerate(jax.tree.leaves(_grad(mixer, "chunk", args, jnp.asarray(s0), cot))):
    assert np.all(np.isfinite(np.asarray(x))), f"gradient {i} not finite"


@pytest.mark.parametrize("mixer", DELTA_MIXERS)
def test_long_sequence_chunk_matches_scan(mixer):
  """T = 4097, B = H = 1, K = V = 16, τ = 1: chunk equals scan at rel 1e-5 (o, S, r)."""
  rng, q, k, v, s0 = _base(14, b=1, t=LONG_T, h=1, hv=1, dk=16, dv=16)
  args = _f32(q, k, v, *_gates(rng, mixer, b=1, t=LONG_T, hv=1, dk=16, dv=16))
  out = _run(mixer, "chunk", args, jnp.asarray(s0), chunk_size=64)
  ref = _run(mixer, "scan", args, jnp.asarray(s0), chunk_size=64)
  _assert_same_outputs(out, ref, f"{mixer} T={LONG_T}")


# ----------------------------------------------------------------------------------------------
# Hand-computed two-token case (docs/MATH.md §2 step formulas), K = V = 2.


def _hand_steps(q, k, v, beta, g, s0, scale):
  """o_t for S̄ = e^{g_t} S; S_t = S̄ + β_t k_t (v_t − S̄ᵀ k_t)ᵀ; o_t = S_tᵀ (scale·q_t)."""
  s, outs = s0.copy(), []
  for t in range(len(q)):
    s = np.exp(g[t]) * s
    s = s + beta[t] * np.outer(k[t], v[t] - s.T @ k[t])
    outs.append(s.T @ (scale * q[t]))
  return np.array(outs), s


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mixer", ("delta_rule", "gated_delta_rule"))
def test_two_token_hand_computed(mixer, impl):
  q = np.array([[1.0, 0.0], [0.6, 0.8]])
  k = np.array([[0.0, 1.0], [0.8, -0.6]])
  v = np.array([[2.0, -1.0], [0.5, 3.0]])
  beta = np.array([0.5, 0.25])
  g = np.array([-0.5, -1.0]) if mixer == "gated_delta_rule" else np.zeros(2)
  s0 = np.array([[1.0, 2.0], [-1.0, 0.5]])
  scale = 0.7
  o_ref, s_ref = _hand_steps(q, k, v, beta, g, s0, scale)
  # Spot check of the first step by hand: S̄ = e^{g_1} S0, S̄ᵀk_1 = e^{g_1}(−1, 0.5),
  # r_1 = β_1 (v_1 − S̄ᵀk_1), only row 2 of S changes.
  a = np.exp(g[0])
  r1 = 0.5 * (np.array([2.0, -1.0]) - a * np.array([-1.0, 0.5]))
  s1 = a * s0 + np.array([[0.0, 0.0], r1])
  np.testing.assert_allclose(o_ref[0], scale * s1[0], rtol=1e-12)

  gates = (beta[None, :, None],) if mixer == "delta_rule" else (g[None, :, None], beta[None, :, None])
  expand = lambda x: x[None, :, None, :]
  args = _f32(expand(q), expand(k), expand(v), *gates)
  o, s, _ = _run(mixer, impl, args, jnp.asarray(s0[None, None], jnp.float32), scale=scale)
  assert_close(o[0, :, 0], o_ref, TOL, "o")
  assert_close(s[0, 0], s_ref, TOL, "final_state")
