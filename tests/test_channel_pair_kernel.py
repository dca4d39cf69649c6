"""`pallas_kernels.gpu.channel_pair` (Pallas on Triton; CPU: Pallas interpret mode, GPU:
compiled) against the dense definition of the per-channel pair matrix and its autodiff VJP."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close
from pallas_kernels.gpu import channel_pair as cp

INTERPRET = jax.default_backend() != "gpu"


def _inputs(n=2, c=64, d=64, lo=-0.5, seed=0):
  rng = np.random.default_rng(seed)
  a, k = (jnp.asarray(rng.standard_normal((n, c, d)), jnp.float32) for _ in range(2))
  g = jnp.cumsum(jnp.asarray(rng.uniform(lo, 0.0, (n, c, d)), jnp.float32), axis=1)
  dm = jnp.asarray(rng.standard_normal((n, c, c)), jnp.float32)
  return a, k, g, dm


def _dense(a, k, g):
  c = a.shape[1]
  lower = jnp.tril(jnp.ones((c, c), bool))[:, :, None]
  d = g[:, :, None] - g[:, None]
  e = jnp.where(lower, jnp.exp(jnp.where(lower, d, 0.0)), 0.0)
  return jnp.einsum("bic,bjc,bijc->bij", a, k, e, precision="highest")


@pytest.mark.parametrize("c,d", [(64, 64), (32, 128)])
def test_forward_and_backward_match_the_dense_definition(c, d):
  a, k, g, dm = _inputs(c=c, d=d)
  m = jax.jit(lambda *x: cp.channel_pair_fwd(*x, interpret=INTERPRET))(a, k, g)
  assert_close(m, _dense(a, k, g), 3e-3, "M")   # bf16 operands of the off-diagonal dots
  assert bool(jnp.all(m == jnp.tril(m))), "M must be lower triangular"
  da, dk = jax.jit(lambda *x: cp.channel_pair_bwd(*x, interpret=INTERPRET))(a, k, g, dm)
  _, vjp = jax.vjp(lambda a, k: _dense(a, k, g), a, k)
  ra, rk = vjp(dm)
  assert_close(da, ra, 3e-3, "dA")
  assert_close(dk, rk, 3e-3, "dK")


def test_extreme_log_gates_stay_finite_and_exact_on_the_diagonal():
  # Log gates of -1e4 per step: every off-diagonal entry underflows to 0 (e^{-1e4}), the
  # diagonal is exactly Σ_c a_ic k_ic, and nothing is inf or NaN forward or backward.
  a, k, _, dm = _inputs()
  g = jnp.cumsum(jnp.full(a.shape, -1e4, jnp.float32), axis=1)
  m = cp.channel_pair_fwd(a, k, g, interpret=INTERPRET)
  want = jnp.zeros_like(m) + jnp.eye(64) * jnp.einsum("bic,bic->bi", a, k)[:, :, None]
  assert_close(m, want, 1e-6, "M at -1e4")
  da, dk = cp.channel_pair_bwd(a, k, g, dm, interpret=INTERPRET)
  assert bool(jnp.all(jnp.isfinite(da)) and jnp.all(jnp.isfinite(dk)))
  diag = jnp.diagonal(dm, axis1=1, axis2=2)[..., None]
  assert_close(da, diag * k, 1e-6, "dA at -1e4")
  assert_close(dk, diag * a, 1e-6, "dK at -1e4")


def test_rejects_shapes_it_does_not_handle():
  a, k, g, dm = _inputs()
  with pytest.raises(ValueError, match="share one"):
    cp.channel_pair_fwd(a, k[:, :32], g)
  with pytest.raises(ValueError, match="K=48"):
    cp.channel_pair_fwd(a[..., :48], k[..., :48], g[..., :48])
  with pytest.raises(ValueError, match="dM"):
    cp.channel_pair_bwd(a, k, g, dm[:, :32])


def test_op_with_the_kernel_matches_the_xla_pair():
  # The opt-in path through the op: same output and gradients as the default XLA pair (which
  # tests/test_pallas_gpu.py checks against the scan), within bf16 rounding.
  from lineax_attn import bench, ops
  from lineax_attn.ops import pallas_gpu
  args = bench.mixer_inputs("gdn2", batch=1, seq_len=72, heads=1, v_heads=1, head_dim_k=64,
                            head_dim_v=64)

  def run(pair):
    tuning = pallas_gpu.GpuTuning(channel_pair=pair)
    f = lambda *a: ops.gdn2(*a, implementation="pallas_gpu", tuning=tuning)[0]
    loss = lambda *a: jnp.sum(jnp.sin(f(*a)))
    return jax.jit(f)(*args), jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)

  (o_k, g_k), (o_x, g_x) = run("kernel"), run("xla")
  assert_close(o_k, o_x, 1e-3, "o")
  for name, a, b in zip(("q", "k", "v", "g", "b", "w"), g_k, g_x):
    assert_close(a, b, 1e-2, f"d{name}")
