"""`pallas_kernels.gpu.channel_pair` (Pallas on Triton; CPU: Pallas interpret mode, GPU:
compiled) against the dense definition of the per-channel pair matrix and its autodiff VJP."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close
from pallas_kernels.gpu import channel_pair as cp

INTERPRET = jax.default_backend() != "gpu"


def _inputs(n=2, c=64, d=64, lo=-0.5, seed=0):
  rng = np.random.default_rng(seed)
  q, kt, k = (jnp.asarray(rng.standard_normal((n, c, d)), jnp.float32) for _ in range(3))
  g = jnp.cumsum(jnp.asarray(rng.uniform(lo, 0.0, (n, c, d)), jnp.float32), axis=1)
  lower = jnp.tril(jnp.ones((c, c)))
  dp, dl = (jnp.asarray(rng.standard_normal((n, c, c)), jnp.float32) * lower for _ in range(2))
  return q, kt, k, g, dp, dl


def _dense(a, k, g):
  c = a.shape[1]
  lower = jnp.tril(jnp.ones((c, c), bool))[:, :, None]
  d = g[:, :, None] - g[:, None]
  e = jnp.where(lower, jnp.exp(jnp.where(lower, d, 0.0)), 0.0)
  return jnp.einsum("bic,bjc,bijc->bij", a, k, e, precision="highest")


def _fwd(*x, diag=cp.DIAG):
  return cp.channel_pairs_fwd(*x, interpret=INTERPRET, diag=diag)


def _bwd(*x, diag=cp.DIAG):
  return cp.channel_pairs_bwd(*x, interpret=INTERPRET, diag=diag)


# The default diagonal ("columns") at every shape; the opt-in "levels" at the underflow shape in
# the default run and at the other two under `-m slow` (issue #15: suite time).
_SHAPES = [(32, 128, -0.5), (16, 32, -0.5), (32, 32, -6.0)]
_DENSE_CASES = [pytest.param(*shape, diag, marks=pytest.mark.slow if
                             (diag != cp.DIAG and shape[2] != -6.0) else ())
                for diag in cp.DIAG_CHOICES for shape in _SHAPES]


@pytest.mark.parametrize("c,d,lo,diag", _DENSE_CASES)
def test_forward_and_backward_match_the_dense_definition(c, d, lo, diag):
  # c=16: one block (no off-diagonal part, the "rows after" anchor clamped); c=32, d=128: two
  # blocks and two channel slices (the op test below has four blocks over its two chunks).
  # lo = -6: per-step decays down to e^-6, so pairs 16 rows apart span up to e^-96 (underflow
  # of the factors) and every level's anchoring is exercised away from e^0.
  q, kt, k, g, dp, dl = _inputs(c=c, d=d, lo=lo)
  p, l = jax.jit(functools.partial(_fwd, diag=diag))(q, kt, k, g)
  assert_close(p, _dense(q, k, g), 3e-3, "P")   # bf16 operands of the off-diagonal dots
  assert_close(l, _dense(kt, k, g), 3e-3, "L")
  assert bool(jnp.all(p == jnp.tril(p)) and jnp.all(l == jnp.tril(l))), "lower triangular"
  got = jax.jit(functools.partial(_bwd, diag=diag))(q, kt, k, g, dp, dl)
  loss = lambda q, kt, k, g: jnp.sum(_dense(q, k, g) * dp) + jnp.sum(_dense(kt, k, g) * dl)
  # Jitted: one compile (eager dispatch compiles every primitive on its own).
  want = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, kt, k, g)
  for name, a, b in zip(("dQ", "dK~", "dK", "dG"), got, want):
    assert_close(a, b, 3e-3, name)


@pytest.mark.parametrize("diag", cp.DIAG_CHOICES)
def test_extreme_log_gates_stay_finite_and_exact_on_the_diagonal(diag):
  # Log gates of -1e4 per step: every off-diagonal entry underflows to 0 (e^{-1e4}), the
  # diagonal is exactly Σ_c a_ic k_ic, and nothing is inf or NaN forward or backward.
  q, kt, k, _, dp, dl = _inputs()
  g = jnp.cumsum(jnp.full(q.shape, -1e4, jnp.float32), axis=1)
  p, l = jax.jit(functools.partial(_fwd, diag=diag))(q, kt, k, g)
  on_diag = lambda a: jnp.zeros_like(p) + jnp.eye(64) * jnp.einsum("bic,bic->bi", a, k)[:, :, None]
  assert_close(p, on_diag(q), 1e-6, "P at -1e4")
  assert_close(l, on_diag(kt), 1e-6, "L at -1e4")
  dq, dkt, dk, dg = jax.jit(functools.partial(_bwd, diag=diag))(q, kt, k, g, dp, dl)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in (dq, dkt, dk, dg))
  wp, wl = (jnp.diagonal(x, axis1=1, axis2=2)[..., None] for x in (dp, dl))
  assert_close(dq, wp * k, 1e-6, "dQ at -1e4")
  assert_close(dkt, wl * k, 1e-6, "dK~ at -1e4")
  assert_close(dk, wp * q + wl * kt, 1e-6, "dK at -1e4")
  # M depends on G only through Q e^G, K~ e^G, K e^-G: on the diagonal those cancel, dG = 0.
  assert_close(dg + 1.0, jnp.ones_like(dg), 1e-6, "dG at -1e4")


def test_rejects_shapes_it_does_not_handle():
  q, kt, k, g, dp, dl = _inputs()
  with pytest.raises(ValueError, match="share one"):
    cp.channel_pairs_fwd(q, kt, k[:, :32], g)
  with pytest.raises(ValueError, match="K=48"):
    cp.channel_pairs_fwd(q[..., :48], kt[..., :48], k[..., :48], g[..., :48])
  with pytest.raises(ValueError, match="chunk_size=48"):
    cp.channel_pairs_fwd(q[:, :48], kt[:, :48], k[:, :48], g[:, :48])
  with pytest.raises(ValueError, match="dL"):
    cp.channel_pairs_bwd(q, kt, k, g, dp, dl[:, :32])


def test_kernel_forward_with_the_xla_backward_matches_the_dense_definition():
  # channel_pair="kernel_fwd": the op's custom VJP with the Pallas forward and the XLA backward
  # (`chunked._channel_pair_bwd`, once per matrix); c=32: two 16-row sub-chunks. The op test
  # below runs "kernel" (Pallas both ways) through the op; the two modes differ only in this
  # backward branch, which is why the op test no longer compiles the op a third time.
  from lineax_attn.ops import gpu_vjps
  q, kt, k, g, dp, dl = _inputs(c=32, d=32)
  pairs = lambda q, kt, k, g: gpu_vjps.channel_pairs_kernel(q, k, kt, g, INTERPRET, False)
  loss = lambda f: lambda *x: jnp.sum(f(*x)[0] * dp) + jnp.sum(f(*x)[1] * dl)
  p, l = jax.jit(pairs)(q, kt, k, g)
  assert_close(p, _dense(q, k, g), 3e-3, "P")
  assert_close(l, _dense(kt, k, g), 3e-3, "L")
  got = jax.jit(jax.grad(loss(pairs), argnums=(0, 1, 2, 3)))(q, kt, k, g)
  dense = lambda q, kt, k, g: (_dense(q, k, g), _dense(kt, k, g))
  want = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2, 3)))(q, kt, k, g)
  for name, a, b in zip(("dQ", "dK~", "dK", "dG"), got, want):
    assert_close(a, b, 3e-3, name)


# Each diagonal method through the op with both kernels (the dense tests above cover each kernel
# of each method alone). The default run keeps the default method, "columns"; "levels" is
# `-m slow` (suite time: ~9 s, a compile of the op's gradient): through the op it differs only
# in the `diag` that `gpu_prepare` hands the kernels (`GpuTuning.pair_diag`), and its kernels,
# forward and backward, run by default in
# test_forward_and_backward_match_the_dense_definition[32-32--6.0-levels] (two blocks, decays
# down to e^-96) and test_extreme_log_gates_stay_finite_and_exact_on_the_diagonal[levels]
# (c = 64 as here, log gates of -1e4).
@pytest.mark.parametrize("diag", [pytest.param(d, marks=() if d == cp.DIAG else pytest.mark.slow)
                                  for d in cp.DIAG_CHOICES])
def test_op_with_the_kernel_matches_the_xla_pair(diag):
  # The opt-in path through the op: same output and gradients as the default XLA pair (which
  # tests/test_pallas_gpu.py checks against the scan), within bf16 rounding. "kernel_fwd" (the
  # Pallas forward with the XLA backward) is the test above, at the custom VJP.
  from lineax_attn import bench, ops
  from lineax_attn.ops import pallas_gpu
  args = bench.mixer_inputs("gdn2", batch=1, seq_len=72, heads=1, v_heads=1, head_dim_k=64,
                            head_dim_v=64)

  def run(pair, diag="columns"):   # one compile per mode: the output rides along as the aux
    tuning = pallas_gpu.GpuTuning(channel_pair=pair, pair_diag=diag)
    f = lambda *a: ops.gdn2(*a, implementation="pallas_gpu", tuning=tuning)[0]
    loss = lambda *a: (jnp.sum(jnp.sin(f(*a))), f(*a))
    grad = jax.grad(loss, argnums=tuple(range(len(args))), has_aux=True)
    grads, out = jax.jit(grad)(*args)
    return out, grads

  o_x, g_x = run("xla")
  pair = "kernel"
  o_k, g_k = run(pair, diag)
  assert_close(o_k, o_x, 1e-3, f"o ({pair}, {diag})")
  for name, a, b in zip(("q", "k", "v", "g", "b", "w"), g_k, g_x):
    assert_close(a, b, 1e-2, f"d{name} ({pair}, {diag})")


def test_the_tuning_offers_the_kernels_diagonal_methods():
  from lineax_attn.ops import gpu_tuning
  assert gpu_tuning.PAIR_DIAG_CHOICES == cp.DIAG_CHOICES
  assert gpu_tuning.GpuTuning().pair_diag == cp.DIAG
  with pytest.raises(ValueError, match="pair_diag"):
    gpu_tuning.GpuTuning(pair_diag="rows")
  with pytest.raises(ValueError, match="diag"):
    cp.channel_pairs_fwd(*_inputs()[:4], interpret=INTERPRET, diag="rows")
