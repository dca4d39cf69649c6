"""Pieces of the intra-chunk part against independent oracles: the matmul-only solve
(`ops.triangular`), the per-channel pair matrices' hand-written VJP (`chunked._channel_pair`),
and the `matmul`/`solve` options of `chunked._intra_chunk` that the pallas_gpu XLA path uses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close
from lineax_attn.ops import chunked
from lineax_attn.ops import triangular


def test_unit_lower_inverse_and_its_closed_form_vjp():
  # Value vs a float64 numpy inverse, VJP vs autodiff of a triangular solve (an independent
  # route to the same function).
  c = 64
  rng = np.random.default_rng(11)
  lower = np.tril(np.ones((c, c), bool), k=-1)
  L = jnp.asarray(np.where(lower, 0.3 * rng.standard_normal((2, 3, c, c)), 0.0), jnp.float32)
  x = jax.jit(triangular.unit_lower_inverse)(L)
  want = np.linalg.inv(np.eye(c) + np.asarray(L, np.float64))
  assert_close(x, want, 1e-5, "(I + L)^-1")
  w = jnp.asarray(rng.standard_normal((2, 3, c, c)), jnp.float32)

  def by_solve(l):
    eye = jnp.broadcast_to(jnp.eye(c, dtype=l.dtype), l.shape)
    return jax.lax.linalg.triangular_solve(eye + l, eye, left_side=True, lower=True,
                                           unit_diagonal=True)

  got = jax.jit(jax.grad(lambda l: jnp.sum(triangular.unit_lower_inverse(l) * w)))(L)
  ref = jax.grad(lambda l: jnp.sum(by_solve(l) * w))(L)
  ref = jnp.where(lower, ref, 0.0)   # L's upper triangle and diagonal are structurally zero
  assert_close(got, ref, 1e-4, "d(I + L)^-1 / dL")


def test_unit_lower_inverse_rejects_sizes_its_merge_cannot_handle():
  with pytest.raises(ValueError, match="C=48"):
    triangular.unit_lower_inverse(jnp.zeros((48, 48)))


def _chunk_inputs(gate_kind, extreme, c=64, dk=32, dv=16, n=3, seed=0):
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  f = lambda x: jnp.asarray(x, jnp.float32)
  q, k = f(unit(rng.standard_normal((n, c, dk)))), f(unit(rng.standard_normal((n, c, dk))))
  beta = f(1 / (1 + np.exp(-rng.standard_normal((n, c, 1)))))
  vt = f(rng.standard_normal((n, c, dv))) * beta
  lo, hi = (-1e4, -1e3) if extreme else (-1.0, -0.01)
  shape = {"channel": (n, c, dk), "scalar": (n, c), None: None}[gate_kind]
  G = None if shape is None else jnp.cumsum(f(rng.uniform(lo, hi, shape)), axis=1)
  return q, k, k * beta, vt, G


@pytest.mark.parametrize("gate_kind", ["channel", "scalar", None])
@pytest.mark.parametrize("extreme", [False, True])
def test_bf16_matmuls_and_inverse_match_the_float32_solve(gate_kind, extreme):
  # The pallas_gpu XLA path (bf16 operands, float32 accumulation, blocked inverse) against the
  # chunk form's float32 HIGHEST products and triangular solve: same QG, P, Y, U, KG, decay_chunk within
  # bf16 rounding, finite for log gates down to -1e4 per step (forward and gradient).
  args = _chunk_inputs(gate_kind, extreme)
  run = lambda matmul, solve: jax.jit(lambda *a: chunked._intra_chunk(
      *a, gate_kind=gate_kind, same=None, cont=None, keep=None, matmul=matmul, solve=solve))(
          *args)
  want = run("highest", "trsm")
  got = run("bf16", "inverse")
  for name, g, w in zip(("QG", "P", "Y", "U", "KG", "decay_chunk"), got, want):
    if w is None:
      assert g is None, name
      continue
    assert bool(jnp.all(jnp.isfinite(g))), name
    assert_close(g, w, 1e-2, f"{gate_kind} {name}")

  def loss(*a):
    outs = chunked._intra_chunk(*a, gate_kind=gate_kind, same=None, cont=None, keep=None,
                                matmul="bf16", solve="inverse")
    return sum(jnp.sum(jnp.sin(x)) for x in outs if x is not None)

  grads = jax.jit(jax.grad(loss, argnums=tuple(i for i, x in enumerate(args) if x is not None)))(
      *args)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


def test_intra_chunk_rejects_unknown_options():
  args = _chunk_inputs("scalar", False)
  with pytest.raises(ValueError, match="matmul"):
    chunked._intra_chunk(*args, gate_kind="scalar", same=None, cont=None, keep=None,
                         matmul="fp8")


@pytest.mark.parametrize("matmul", ["highest", "bf16"])
def test_channel_pair_and_its_vjp_match_the_dense_definition(matmul):
  # Oracle: M_ij = Σ_c A_ic K_jc e^{G_ic − G_jc} (j <= i) from the dense [C, C, K] exponent,
  # differentiated by autodiff (fine for moderate gates, where nothing overflows).
  c, dk = 64, 32
  rng = np.random.default_rng(5)
  A, K = (jnp.asarray(rng.standard_normal((2, c, dk)), jnp.float32) for _ in range(2))
  G = jnp.cumsum(jnp.asarray(rng.uniform(-0.5, 0.0, (2, c, dk)), jnp.float32), axis=1)
  W = jnp.asarray(rng.standard_normal((2, c, c)), jnp.float32)

  def dense(A, K, G):
    lower = jnp.tril(jnp.ones((c, c), bool))[:, :, None]
    e = jnp.where(lower, jnp.exp(G[:, :, None, :] - G[:, None, :, :]), 0.0)
    return jnp.einsum("bic,bjc,bijc->bij", A, K, e, precision="highest")

  tol = 1e-5 if matmul == "highest" else 1e-2
  got = jax.jit(lambda *x: chunked._channel_pair(*x, matmul))(A, K, G)
  assert_close(got, dense(A, K, G), tol, "M")
  grad = lambda f: jax.jit(jax.grad(lambda *x: jnp.sum(f(*x) * W), argnums=(0, 1, 2)))(A, K, G)
  for name, g, w in zip("AKG", grad(lambda *x: chunked._channel_pair(*x, matmul)), grad(dense)):
    assert_close(g, w, 1e-4 if matmul == "highest" else 2e-2, f"d{name}")

