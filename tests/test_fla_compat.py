"""lineax_attn.fla: FLA's op names and arguments over lineax_attn.ops.

Every FLA name runs the same random inputs as the lineax_attn op it stands for and must give the
same outputs and final states (bit for bit where the wrapper adds no maths; to float32 rounding
where it computes FLA's fused options, against our own layer maths or an explicit oracle):
`use_qk_l2norm_in_kernel`, varlen `cu_seqlens` with `initial_state`, grouped value heads where
FLA has them, gate and beta fusions, the V-first state layout, FLA's linear-attention
normaliser (a numpy loop), gradients, argument errors and the signatures read from FLA's source.
"""

from __future__ import annotations

import ast
import inspect
import pathlib

from helpers import l2norm
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lineax_attn import fla
from lineax_attn import ops
from lineax_attn.layers import gates

ROOT = pathlib.Path(__file__).resolve().parent.parent
REQUIRED = inspect.Parameter.empty

# FLA's parameter lists (name, default), in order, as read from fla-org/flash-linear-attention at
# commit bc3b101d (2026-08-22, after v0.5.2, before fla-core 0.6.0): fla/ops/gated_delta_rule/
# chunk.py and fused_recurrent.py, fla/ops/delta_rule/chunk.py and fused_recurrent.py,
# fla/ops/kda/chunk.py and fused_recurrent.py, fla/ops/gdn2/chunk.py and fused_recurrent.py,
# fla/ops/linear_attn/chunk.py and fused_recurrent.py.
_QKV = [("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED)]
FLA_SIGNATURES = {
    "chunk_gated_delta_rule": _QKV + [
        ("g", REQUIRED), ("beta", REQUIRED), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
        ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False),
        ("state_v_first", False), ("cu_seqlens", None), ("cu_seqlens_cpu", None),
        ("chunk_indices", None), ("cp_context", None)],
    "fused_recurrent_gated_delta_rule": _QKV + [
        ("g", None), ("gk", None), ("gv", None), ("beta", None), ("scale", None),
        ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
        ("use_gate_in_kernel", False), ("A_log", None), ("dt_bias", None),
        ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False),
        ("state_v_first", False), ("cu_seqlens", None)],
    "chunk_delta_rule": _QKV + [
        ("beta", REQUIRED), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("use_qk_l2norm_in_kernel", False), ("cu_seqlens", None),
        ("cu_seqlens_cpu", None)],
    "fused_recurrent_delta_rule": _QKV + [
        ("beta", None), ("scale", None), ("initial_state", None), ("output_final_state", False),
        ("use_qk_l2norm_in_kernel", False), ("cu_seqlens", None)],
    "chunk_kda": _QKV + [
        ("g", REQUIRED), ("beta", REQUIRED), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
        ("use_gate_in_kernel", False), ("use_beta_sigmoid_in_kernel", False),
        ("allow_neg_eigval", False), ("safe_gate", False), ("lower_bound", None),
        ("disable_recompute", False), ("return_intermediate_states", False),
        ("state_v_first", False), ("cu_seqlens", None), ("cu_seqlens_cpu", None),
        ("cp_context", None)],
    "fused_recurrent_kda": _QKV + [
        ("g", REQUIRED), ("beta", REQUIRED), ("A_log", None), ("dt_bias", None), ("scale", None),
        ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
        ("use_gate_in_kernel", False), ("use_beta_sigmoid_in_kernel", False),
        ("allow_neg_eigval", False), ("lower_bound", None), ("state_v_first", False),
        ("cu_seqlens", None)],
    "chunk_gdn2": _QKV + [
        ("g", REQUIRED), ("b", REQUIRED), ("w", REQUIRED), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
        ("use_gate_in_kernel", False), ("cu_seqlens", None), ("cu_seqlens_cpu", None),
        ("safe_gate", False), ("lower_bound", None), ("disable_recompute", False),
        ("return_intermediate_states", False), ("state_v_first", False)],
    "fused_recurrent_gdn2": _QKV + [
        ("g", REQUIRED), ("b", REQUIRED), ("w", REQUIRED), ("A_log", None), ("dt_bias", None),
        ("scale", None), ("initial_state", None), ("output_final_state", False),
        ("use_qk_l2norm_in_kernel", False), ("use_gate_in_kernel", False), ("lower_bound", None),
        ("state_v_first", False), ("cu_seqlens", None)],
    "chunk_linear_attn": _QKV + [
        ("scale", None), ("initial_state", None), ("output_final_state", False),
        ("normalize", True), ("cu_seqlens", None)],
    "fused_recurrent_linear_attn": _QKV + [
        ("scale", None), ("initial_state", None), ("output_final_state", False),
        ("reverse", False), ("normalize", False), ("cu_seqlens", None)],
    # Read from the fla-core 0.6.0 wheel: fla/ops/simple_gla/chunk.py and fused_recurrent.py.
    "chunk_simple_gla": _QKV + [
        ("g", None), ("g_gamma", None), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("state_v_first", False), ("cu_seqlens", None),
        ("cu_seqlens_cpu", None)],
    "fused_recurrent_simple_gla": _QKV + [
        ("g", None), ("g_gamma", None), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("reverse", False), ("state_v_first", False),
        ("cu_seqlens", None)],
}
# Options FLA reads from **kwargs (keyword-only here), with FLA's defaults.
FLA_KWARGS = {
    "chunk_gated_delta_rule": {"use_gate_in_kernel": False, "A_log": None, "dt_bias": None,
                               "chunk_size": 64},
    "chunk_delta_rule": {"chunk_size": 64},
    "chunk_kda": {"A_log": None, "dt_bias": None, "chunk_size": 64},
    "chunk_gdn2": {"A_log": None, "dt_bias": None, "chunk_size": 64},
}

# FLA name -> (our op, its gate names in order, whether FLA's kernel has grouped value heads).
CASES = {
    "chunk_linear_attn": (ops.linear_attention, (), False),
    "fused_recurrent_linear_attn": (ops.linear_attention, (), False),
    "chunk_delta_rule": (ops.delta_rule, ("beta",), False),
    "fused_recurrent_delta_rule": (ops.delta_rule, ("beta",), False),
    "chunk_gated_delta_rule": (ops.gated_delta_rule, ("g", "beta"), True),
    "fused_recurrent_gated_delta_rule": (ops.gated_delta_rule, ("g", "beta"), True),
    "chunk_kda": (ops.kda, ("g", "beta"), True),
    "fused_recurrent_kda": (ops.kda, ("g", "beta"), True),
    "chunk_gdn2": (ops.gdn2, ("g", "b", "w"), False),
    "fused_recurrent_gdn2": (ops.gdn2, ("g", "b", "w"), True),
    "chunk_simple_gla": (ops.simple_gla, ("g",), False),
    "fused_recurrent_simple_gla": (ops.simple_gla, ("g",), False),
}
L2NORM_NAMES = [n for n in CASES if "linear_attn" not in n and "simple_gla" not in n]


def inputs(name, *, b=2, t=13, h=2, hv=None, dk=8, dv=8, seed=0, unit_qk=True):
  """q, k, v and the gates of FLA name `name`, in range; unit q, k unless `unit_qk=False`."""
  _, gate_names, gva = CASES[name]
  hv = hv or (2 * h if gva else h)
  ks = iter(jax.random.split(jax.random.key(seed), 8))
  q = jax.random.normal(next(ks), (b, t, h, dk))
  k = jax.random.normal(next(ks), (b, t, h, dk))
  if unit_qk:
    q, k = l2norm(q), l2norm(k)
  else:   # far from unit norm, and one token of norm ~3e-3, where FLA's eps 1e-6 shows
    q, k = 3.0 * q.at[:, 1].multiply(1e-3), 3.0 * k.at[:, 2].multiply(1e-3)
  x = {"q": q, "k": k, "v": jax.random.normal(next(ks), (b, t, hv, dv))}
  per_channel = name.endswith(("kda", "gdn2"))
  shapes = {"g": (b, t, hv, dk) if per_channel else (b, t, hv), "beta": (b, t, hv),
            "b": (b, t, hv, dk), "w": (b, t, hv, dv)}
  for gate in gate_names:
    z = jax.random.normal(next(ks), shapes[gate])
    x[gate] = jax.nn.log_sigmoid(z + 1.0) if gate == "g" else jax.nn.sigmoid(z)
  return x


def states(b, hv, dk, dv, seed=1):
  return 0.3 * jax.random.normal(jax.random.key(seed), (b, hv, dk, dv))


def assert_same(got, want, what=""):
  (o, s), (o_ref, s_ref) = got, want
  np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref), what)
  np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref), what)


def assert_near(got, want, tol=2e-6, what=""):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol, err_msg=what)


def gate_kwargs(name, x):
  return {gate: x[gate] for gate in CASES[name][1]}


def qkv(x):
  return x["q"], x["k"], x["v"]


SCAN = {"implementation": "scan"}   # the mapping is under test, not the implementation


# ----------------------------------------------------------------------------------------------
# Each test runs its calls in one jitted program, as a user's jitted step would (and one compile
# per test keeps the file fast).

@pytest.mark.parametrize("name", sorted(CASES))
def test_same_as_the_op(name):
  """(1) B = 2 with the default scale K^-1/2, GVA where FLA has it, the final state only when
  asked; (2) B = 1 varlen cu_seqlens with one initial state per sequence; (3) as (2) with
  use_qk_l2norm_in_kernel=True, against the op on q, k normalised beforehand
  (x / sqrt(Σx² + 1e-6), FLA's l2norm)."""
  fn = getattr(fla, name)
  op = CASES[name][0]
  extra = {"normalize": False} if "linear_attn" in name else {}
  batch = inputs(name)
  batch["h0"] = states(2, batch["v"].shape[2], 8, 8)
  packed = inputs(name, b=1, t=21, seed=2)
  packed["h0"] = states(3, packed["v"].shape[2], 8, 8, seed=3)
  packed["cu"] = jnp.array([0, 5, 6, 21], jnp.int32)
  raw = dict(inputs(name, b=1, t=21, seed=2, unit_qk=False), h0=packed["h0"], cu=packed["cu"])
  has_l2norm = name in L2NORM_NAMES     # FLA's linear attention has no such option

  def run(batch, packed, raw):
    out = {
        "batch": (fn(*qkv(batch), **gate_kwargs(name, batch), initial_state=batch["h0"],
                     output_final_state=True, **SCAN, **extra),
                  op(*qkv(batch), **gate_kwargs(name, batch), scale=8 ** -0.5,
                     initial_state=batch["h0"], output_final_state=True, **SCAN)),
        "no_state": fn(*qkv(batch), **gate_kwargs(name, batch), **SCAN, **extra)[1],
        "varlen": (fn(*qkv(packed), **gate_kwargs(name, packed), scale=0.4,
                      initial_state=packed["h0"], output_final_state=True,
                      cu_seqlens=packed["cu"], **SCAN, **extra),
                   op(*qkv(packed), **gate_kwargs(name, packed), scale=0.4,
                      initial_state=packed["h0"], output_final_state=True,
                      cu_seqlens=packed["cu"], **SCAN)),
    }
    if has_l2norm:
      out["l2norm"] = (
          fn(*qkv(raw), **gate_kwargs(name, raw), scale=0.4, initial_state=raw["h0"],
             output_final_state=True, cu_seqlens=raw["cu"], use_qk_l2norm_in_kernel=True, **SCAN),
          op(l2norm(raw["q"]), l2norm(raw["k"]), raw["v"], **gate_kwargs(name, raw), scale=0.4,
             initial_state=raw["h0"], output_final_state=True, cu_seqlens=raw["cu"], **SCAN))
    return out

  out = jax.jit(run)(batch, packed, raw)
  assert out["no_state"] is None
  assert_same(*out["batch"], what="batch")
  assert out["varlen"][0][1].shape == (3, packed["v"].shape[2], 8, 8)
  assert_same(*out["varlen"], what="varlen")
  if has_l2norm:
    assert_near(*out["l2norm"], what="use_qk_l2norm_in_kernel")
  else:
    with pytest.raises(ValueError, match="unknown option"):
      fn(*qkv(raw), use_qk_l2norm_in_kernel=True)


def test_default_implementation_and_positional_call():
  """No `implementation`: the chunk and fused-recurrent names both run the op's default (the
  chunked form here, T not a multiple of the chunk), with FLA's positional order scale,
  initial_state, output_final_state."""
  x = inputs("chunk_kda", b=1, t=20, seed=4)
  x["h0"] = states(1, 4, 8, 8)
  chunk, recurrent, op = jax.jit(lambda x: (
      fla.chunk_kda(*qkv(x), x["g"], x["beta"], 0.5, x["h0"], True),
      fla.fused_recurrent_kda(*qkv(x), x["g"], x["beta"], None, None, 0.5, x["h0"], True),
      ops.kda(*qkv(x), x["g"], x["beta"], scale=0.5, initial_state=x["h0"],
              output_final_state=True)))(x)
  assert_same(chunk, op)
  assert_same(recurrent, op)


def test_gradients():
  """jax.grad through the FLA name equals jax.grad through the op, also through the in-kernel
  l2norm (against the op on q, k normalised by hand)."""
  x = inputs("chunk_gated_delta_rule", b=1, t=11, seed=5, unit_qk=False)
  x["h0"] = states(1, 4, 8, 8)
  x_unit = dict(x, q=l2norm(x["q"]), k=l2norm(x["k"]))
  w_o = jax.random.normal(jax.random.key(7), (1, 11, 4, 8))
  w_s = jax.random.normal(jax.random.key(8), (1, 4, 8, 8))

  def grad(call):
    def loss(x):
      o, ht = call(x)
      return jnp.sum(o * w_o) + jnp.sum(ht * w_s)
    return jax.grad(loss)

  def fla_call(l2):
    return lambda x: fla.chunk_gated_delta_rule(
        *qkv(x), x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
        use_qk_l2norm_in_kernel=l2, **SCAN)

  def op_call(l2):
    def call(x):
      q, k = (l2norm(x["q"]), l2norm(x["k"])) if l2 else (x["q"], x["k"])
      return ops.gated_delta_rule(q, k, x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                  output_final_state=True, **SCAN)
    return call

  got, want, got_l2, want_l2 = jax.jit(lambda x_unit, x: (
      grad(fla_call(False))(x_unit), grad(op_call(False))(x_unit),
      grad(fla_call(True))(x), grad(op_call(True))(x)))(x_unit, x)
  for name in x:
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), name)
    assert float(jnp.max(jnp.abs(want_l2[name]))) > 1e-3, name   # a real gradient
    np.testing.assert_allclose(np.asarray(got_l2[name]), np.asarray(want_l2[name]), rtol=1e-5,
                               atol=1e-6, err_msg=name)


# FLA name, FLA's options, the gate the op gets from our layers' maths (raw gate input f).
HV, DK = 4, 8
A_LOG = np.log(np.linspace(1.0, 8.0, HV))     # numpy, so collecting this file runs no jax
DT_GDN = np.linspace(-1.0, 1.0, HV)
DT_KDA = np.linspace(-1.0, 1.0, HV * DK)
GATE_CASES = [
    ("chunk_gated_delta_rule", {"A_log": A_LOG, "dt_bias": DT_GDN},
     lambda f: gates.log_decay(f, A_LOG, DT_GDN)),
    ("fused_recurrent_gated_delta_rule", {"A_log": A_LOG},
     lambda f: gates.log_decay(f, A_LOG, jnp.zeros(()))),
    ("chunk_kda", {"A_log": A_LOG, "dt_bias": DT_KDA},
     lambda f: gates.log_decay(f, A_LOG[:, None], DT_KDA.reshape(HV, DK))),
    ("chunk_kda", {"A_log": A_LOG, "dt_bias": DT_KDA.reshape(HV, DK), "lower_bound": -3.0,
                   "safe_gate": True},
     lambda f: gates.log_decay(f, A_LOG[:, None], DT_KDA.reshape(HV, DK), lower_bound=-3.0)),
    ("fused_recurrent_kda", {"dt_bias": DT_KDA, "lower_bound": -5.0},   # no A_log: lb·σ(f + dt)
     lambda f: gates.log_decay(f, jnp.zeros(()), DT_KDA.reshape(HV, DK), lower_bound=-5.0)),
    ("chunk_gdn2", {"A_log": A_LOG, "dt_bias": DT_KDA},
     lambda f: gates.log_decay(f, A_LOG[:, None], DT_KDA.reshape(HV, DK))),
    ("fused_recurrent_gdn2", {"A_log": A_LOG, "lower_bound": -2.0},
     lambda f: gates.log_decay(f, A_LOG[:, None], jnp.zeros(()), lower_bound=-2.0)),
]


def test_use_gate_in_kernel():
  """FLA's fused gate activation equals the op on our layers' `gates.log_decay`."""
  xs = [inputs(name, b=1, t=9, hv=HV, seed=6 + i) for i, (name, _, _) in enumerate(GATE_CASES)]
  fs = [2.0 * jax.random.normal(jax.random.key(20 + i), x["g"].shape)   # raw inputs, any sign
        for i, x in enumerate(xs)]

  def run(xs, fs):
    out = []
    for (name, options, gate), x, f in zip(GATE_CASES, xs, fs):
      out.append((getattr(fla, name)(**dict(x, g=f), use_gate_in_kernel=True,
                                     output_final_state=True, **SCAN, **options),
                  CASES[name][0](**dict(x, g=gate(f)), output_final_state=True, **SCAN)))
    return out

  for (name, options, gate), f, (got, want) in zip(GATE_CASES, fs, jax.jit(run)(xs, fs)):
    assert float(jnp.min(gate(f))) < -0.1
    assert_near(got, want, what=f"{name} {sorted(options)}")


BETA_NAMES = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda",
              "fused_recurrent_kda"]


def test_use_beta_sigmoid_in_kernel():
  """β = σ(logits), 2σ with allow_neg_eigval: the op on our layers' `gates.sigmoid_gate`."""
  cases = [(name, neg) for name in BETA_NAMES for neg in (False, True)]
  xs = [inputs(name, b=1, t=9, seed=10 + i) for i, (name, _) in enumerate(cases)]
  logits = [2.0 * jax.random.normal(jax.random.key(30 + i), x["beta"].shape)
            for i, x in enumerate(xs)]

  def run(xs, logits):
    return [(getattr(fla, name)(**dict(x, beta=z), use_beta_sigmoid_in_kernel=True,
                                allow_neg_eigval=neg, output_final_state=True, **SCAN),
             CASES[name][0](**dict(x, beta=gates.sigmoid_gate(z, neg)), output_final_state=True,
                            **SCAN))
            for (name, neg), x, z in zip(cases, xs, logits)]

  for (name, neg), (got, want) in zip(cases, jax.jit(run)(xs, logits)):
    assert_near(got, want, what=f"{name} allow_neg_eigval={neg}")


def test_state_v_first_and_dtypes():
  """state_v_first: initial and final states are [N, HV, V, K]; a bfloat16 h0 is upcast; o comes
  back in q's dtype (FLA), where the op returns v's."""
  names = ["chunk_kda", "fused_recurrent_gdn2", "chunk_gated_delta_rule"]
  xs = [inputs(name, b=1, t=9, dv=4, seed=12) for name in names]
  h0s = [states(1, x["v"].shape[2], 8, 4).astype(jnp.bfloat16) for x in xs]
  mixed = inputs("chunk_gated_delta_rule", b=1, t=5)
  mixed["v"] = mixed["v"].astype(jnp.bfloat16)

  def run(xs, h0s, mixed):
    out = [(getattr(fla, name)(**x, initial_state=jnp.swapaxes(h0, -1, -2),
                               output_final_state=True, state_v_first=True, **SCAN),
            CASES[name][0](**x, initial_state=h0.astype(jnp.float32), output_final_state=True,
                           **SCAN))
           for name, x, h0 in zip(names, xs, h0s)]
    return out, fla.chunk_gated_delta_rule(**mixed, **SCAN), ops.gated_delta_rule(**mixed, **SCAN)

  out, (o, _), (o_ref, _) = jax.jit(run)(xs, h0s, mixed)
  for name, x, ((o_v, ht), want) in zip(names, xs, out):
    assert ht.shape == (1, x["v"].shape[2], 4, 8) and ht.dtype == jnp.float32, name
    assert_same((o_v, jnp.swapaxes(ht, -1, -2)), want, what=name)
  assert o.dtype == jnp.float32 and o_ref.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref.astype(jnp.float32)))


def test_fused_recurrent_gdn_decays():
  """FLA's recurrent GDN kernel: gk alone is KDA, g and gk multiply, no decay is DeltaNet, and
  beta defaults to ones."""
  x = inputs("fused_recurrent_kda", b=1, t=9, seed=13)
  x["g3"] = jax.nn.log_sigmoid(jax.random.normal(jax.random.key(14), x["beta"].shape) + 2.0)
  run = dict(output_final_state=True, **SCAN)
  rec = fla.fused_recurrent_gated_delta_rule

  def calls(x):
    ones = jnp.ones(x["beta"].shape)
    return {
        "gk": (rec(*qkv(x), gk=x["g"], beta=x["beta"], **run),
               ops.kda(*qkv(x), x["g"], x["beta"], **run)),
        "g+gk": (rec(*qkv(x), g=x["g3"], gk=x["g"], beta=x["beta"], **run),
                 ops.kda(*qkv(x), x["g"] + x["g3"][..., None], x["beta"], **run)),
        "none": (rec(*qkv(x), beta=x["beta"], **run), ops.delta_rule(*qkv(x), x["beta"], **run)),
        "beta=None": (rec(*qkv(x), g=x["g3"], **run),
                      ops.gated_delta_rule(*qkv(x), x["g3"], ones, **run)),
        "delta beta=None": (fla.fused_recurrent_delta_rule(*qkv(x), **run),
                            ops.delta_rule(*qkv(x), ones, **run)),
    }

  for what, (got, want) in jax.jit(calls)(x).items():
    if what == "g+gk":    # the op gets g + gk summed beforehand: equal to rounding
      assert_near(got, want, what=what)
    else:
      assert_same(got, want, what=what)


def linear_attn_loop(q, k, v, scale, h0, z0, cu, reverse, normalize):
  """numpy float64 recurrence of FLA's (normalised) linear attention, one sequence at a time."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, h, _ = q.shape
  hv = v.shape[2]
  group = hv // h
  spans = ([(0, n, cu[n], cu[n + 1]) for n in range(len(cu) - 1)] if cu is not None
           else [(n, n, 0, t) for n in range(b)])
  o = np.zeros(v.shape)
  hs, zs = [], []
  for row, n, start, end in spans:
    s = np.zeros((hv, q.shape[3], v.shape[3])) if h0 is None else np.array(h0[n], np.float64)
    z = np.zeros((h, q.shape[3])) if z0 is None else np.array(z0[n, 0], np.float64)
    for i in (range(end - 1, start - 1, -1) if reverse else range(start, end)):
      for j in range(hv):
        s[j] += np.outer(k[row, i, j // group], v[row, i, j])
      z += k[row, i]
      for j in range(hv):
        o[row, i, j] = scale * q[row, i, j // group] @ s[j]
        if normalize:
          o[row, i, j] /= scale * q[row, i, j // group] @ z[j // group] + 1e-10
    hs.append(s)
    zs.append(z[None])
  return o, np.stack(hs), np.stack(zs)


def test_simple_gla_g_gamma_and_no_decay():
  """FLA's g_gamma [H] is one constant log decay per head: the op with it broadcast over (B, T);
  with neither g nor g_gamma the recurrence is unnormalised linear attention."""
  x = inputs("chunk_simple_gla")
  gamma = -jnp.array([0.1, 0.7])

  def run(x):
    return (fla.chunk_simple_gla(*qkv(x), g_gamma=gamma, output_final_state=True, **SCAN),
            ops.simple_gla(*qkv(x), jnp.broadcast_to(gamma, x["v"].shape[:3]),
                           output_final_state=True, **SCAN),
            fla.fused_recurrent_simple_gla(*qkv(x), output_final_state=True, **SCAN),
            ops.linear_attention(*qkv(x), output_final_state=True, **SCAN))

  got, want, free, linear = jax.jit(run)(x)
  assert_same(got, want, what="g_gamma")
  assert_near(free, linear, what="no decay = linear attention")


@pytest.mark.parametrize("varlen", [False, True])
def test_linear_attn_normalize(varlen):
  """FLA's normaliser (chunk_linear_attn's default) against a numpy loop: a (kv_state, z_state)
  initial state, GVA (FLA has none), varlen, and fused_recurrent_linear_attn's reverse."""
  b, cu = (1, [0, 4, 11, 12]) if varlen else (2, None)
  n = len(cu) - 1 if varlen else b
  x = inputs("chunk_linear_attn", b=b, t=12, hv=4, seed=15)
  x = dict(x, k=jax.nn.softplus(x["k"]), q=jax.nn.softplus(x["q"]))   # positive feature maps
  x["h0"] = states(n, 4, 8, 8)
  x["z0"] = jnp.abs(jax.random.normal(jax.random.key(16), (n, 1, 2, 8)))
  x["cu"] = None if cu is None else jnp.array(cu, jnp.int32)

  def run(x):
    kw = dict(output_final_state=True, cu_seqlens=x["cu"], **SCAN)
    out = {}
    for reverse in (False, True):
      out[f"normalized {reverse}"] = fla.fused_recurrent_linear_attn(
          *qkv(x), initial_state=(x["h0"], x["z0"]), reverse=reverse, normalize=True, **kw)
      out[f"plain {reverse}"] = fla.fused_recurrent_linear_attn(
          *qkv(x), initial_state=x["h0"], reverse=reverse, **kw)
    out["chunk"] = fla.chunk_linear_attn(*qkv(x), initial_state=(x["h0"], x["z0"]), **kw)
    out["no_state"] = fla.chunk_linear_attn(*qkv(x), cu_seqlens=x["cu"], **SCAN)[1]
    return out

  out = jax.jit(run)(x)
  (o_c, (h_c, z_c)), (o_r, (h_r, z_r)) = out["chunk"], out["normalized False"]
  assert_same((o_c, h_c), (o_r, h_r), what="chunk vs recurrent")
  np.testing.assert_array_equal(np.asarray(z_c), np.asarray(z_r))
  for reverse in (False, True):
    o, (ht, zt) = out[f"normalized {reverse}"]
    want = linear_attn_loop(*qkv(x), 8 ** -0.5, x["h0"], x["z0"], cu, reverse, True)
    assert_near((o, ht, zt), want, tol=1e-5, what=f"normalize reverse={reverse}")
    o, ht = out[f"plain {reverse}"]
    want = linear_attn_loop(*qkv(x), 8 ** -0.5, x["h0"], None, cu, reverse, False)
    assert_near((o, ht), want[:2], tol=1e-5, what=f"plain reverse={reverse}")
  none, z = out["no_state"]       # FLA gives (None, z) when no state is asked for
  assert none is None and z.shape == (n, 1, 2, 8)


def _error_inputs():
  x = inputs("chunk_kda", b=1, t=4)
  return {"kda": x, "gdn": inputs("chunk_gated_delta_rule", b=1, t=4),
          "gdn2": inputs("chunk_gdn2", b=1, t=4), "la": {n: x[n] for n in "qkv"}}


# (FLA call on the inputs above, error, message); the op's own checks still speak too.
ERRORS = [
    (lambda i: fla.chunk_kda(**i["kda"], head_first=True), ValueError, r"`head_first=True`"),
    (lambda i: fla.chunk_simple_gla(**i["la"], g=i["gdn"]["g"], g_gamma=-jnp.ones(4)),
     ValueError, r"`g` or `g_gamma`, not both"),
    (lambda i: fla.chunk_simple_gla(**i["la"], g_gamma=-jnp.ones(3)), ValueError,
     r"`g_gamma` must have shape \[4\]"),
    (lambda i: fla.fused_recurrent_simple_gla(**i["la"], reverse=True), NotImplementedError,
     r"`reverse=True`"),
    (lambda i: fla.chunk_linear_attn(**i["la"], head_first=True), ValueError,
     r"`head_first=True`"),
    (lambda i: fla.chunk_gated_delta_rule(**i["gdn"], use_cache=True), ValueError,
     r"unknown option\(s\) `use_cache`"),
    (lambda i: fla.fused_recurrent_linear_attn(**i["la"], foo=1), ValueError, r"`foo`"),
    (lambda i: fla.chunk_kda(**i["kda"], transpose_state_layout=True), ValueError,
     r"`state_v_first`"),
    (lambda i: fla.chunk_kda(**i["kda"], cp_context=object()), NotImplementedError,
     r"`cp_context"),
    (lambda i: fla.chunk_gdn2(**i["gdn2"], return_intermediate_states=True), NotImplementedError,
     r"`return_intermediate_states"),
    (lambda i: fla.fused_recurrent_gated_delta_rule(**i["gdn"], gv=i["kda"]["v"]),
     NotImplementedError, r"`gv"),
    (lambda i: fla.fused_recurrent_kda(**dict(i["kda"], beta=i["kda"]["v"])), NotImplementedError,
     r"per-value `beta`"),
    (lambda i: fla.chunk_gated_delta_rule(**i["gdn"], use_gate_in_kernel=True), ValueError,
     r"`A_log` \[HV\]"),
    (lambda i: fla.chunk_kda(**i["kda"], use_gate_in_kernel=True), ValueError,
     r"`A_log` \[HV\]"),
    (lambda i: fla.chunk_kda(**i["kda"], use_gate_in_kernel=True, A_log=A_LOG, safe_gate=True),
     ValueError, r"`lower_bound` must be given"),
    (lambda i: fla.chunk_gdn2(**i["gdn2"], use_gate_in_kernel=True, lower_bound=-6.0,
                              safe_gate=True),
     ValueError, r"`lower_bound` must be in the safe range"),
    (lambda i: fla.fused_recurrent_kda(**i["kda"], use_gate_in_kernel=True, lower_bound=0.5),
     ValueError, r"`lower_bound` is a log decay"),
    (lambda i: fla.chunk_kda(**i["kda"], use_gate_in_kernel=True, A_log=np.zeros(3)), ValueError,
     r"`A_log` must have shape \[4\]"),
    (lambda i: fla.chunk_kda(**i["kda"], use_gate_in_kernel=True, A_log=A_LOG,
                             dt_bias=np.zeros(8)),
     ValueError, r"`dt_bias` must have shape \[4, 8\] or \[32\]"),
    (lambda i: fla.chunk_kda(**i["kda"], allow_neg_eigval=True), ValueError,
     r"`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`"),
    (lambda i: fla.chunk_delta_rule(**i["la"], beta=i["gdn"]["beta"], use_qk_l2norm_in_kernel=1),
     ValueError, r"`use_qk_l2norm_in_kernel` must be a bool"),
    (lambda i: fla.fused_recurrent_gated_delta_rule(**dict(i["gdn"], g=None), A_log=A_LOG,
                                                    use_gate_in_kernel=True), ValueError, r"`g`"),
    (lambda i: fla.chunk_linear_attn(**i["la"], initial_state=(i["la"]["v"],)), ValueError,
     r"`initial_state` must be \(kv_state, z_state\)"),
    (lambda i: fla.chunk_linear_attn(**i["la"], initial_state=(states(1, 4, 8, 8),
                                                               jnp.zeros((1, 2, 8)))),
     ValueError, r"`initial_state\[1\]` must have rank 4"),
    (lambda i: fla.chunk_kda(**dict(i["kda"], g=-i["kda"]["g"])), ValueError,
     r"`g` is a log decay"),
    (lambda i: fla.chunk_gdn2(**dict(i["gdn2"], w=i["gdn2"]["b"][..., :4])), ValueError,
     r"`w` must have shape"),
    # The extras reach the op.
    (lambda i: fla.chunk_kda(**i["kda"], chunk_size=24), ValueError,
     r"`chunk_size` must be a positive multiple of 16"),
    (lambda i: fla.fused_recurrent_gdn2(**i["gdn2"], implementation="cuda"), ValueError,
     r"unknown `implementation='cuda'`"),
]


@pytest.mark.parametrize("index", range(len(ERRORS)))
def test_argument_errors(index):
  call, error, match = ERRORS[index]
  with pytest.raises(error, match=match):
    call(_error_inputs())


@pytest.mark.parametrize("name", sorted(FLA_SIGNATURES))
def test_signature_is_flas(name):
  """FLA's parameters, in FLA's order, positional-or-keyword with FLA's defaults; what FLA reads
  from **kwargs and our extras are keyword-only; unknown keywords land in **kwargs (an error)."""
  params = list(inspect.signature(getattr(fla, name)).parameters.values())
  fla_params = FLA_SIGNATURES[name]
  head = params[:len(fla_params)]
  assert [(p.name, p.default) for p in head] == fla_params
  assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in head)
  tail = params[len(fla_params):]
  assert tail[-1].kind is inspect.Parameter.VAR_KEYWORD
  keyword_only = {p.name: p.default for p in tail[:-1]}
  assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in tail[:-1])
  assert keyword_only.items() >= FLA_KWARGS.get(name, {}).items()
  assert keyword_only.items() >= {"chunk_size": 64, "head_first": False,
                                  "implementation": None}.items()


def test_aliases_and_exports():
  assert fla.chunk_gdn is fla.chunk_gated_delta_rule
  assert fla.fused_recurrent_gdn is fla.fused_recurrent_gated_delta_rule
  assert set(fla.__all__) == set(FLA_SIGNATURES) | {"chunk_gdn", "fused_recurrent_gdn"}


def test_module_imports_only_ops():
  """lineax_attn.fla sits beside ops: jax, numpy and lineax_attn.ops, never torch or fla."""
  tree = ast.parse((ROOT / "lineax_attn" / "fla.py").read_text(encoding="utf-8"))
  imported = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      imported |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      imported |= {f"{node.module}.{a.name}" for a in node.names}
  assert imported == {"__future__.annotations", "math", "jax", "jax.numpy", "numpy",
                      "lineax_attn.ops"}
