"""The per-chunk gradient kernel of the walk path (`pallas_kernels.gpu.chunk_grads`).

Off GPU the kernel runs in JAX's Mosaic GPU interpreter, so this file runs in `make test`; on a
Hopper GPU the same tests run it compiled. Oracles:
* the kernel against `chunk_grads_reference`: the VJP (jax.grad) of one chunk's map in float32
  at HIGHEST with the exact inverse, none of the kernel's algebra (the identity that gives dG
  without column sums included). dq, dk, dv leave the kernel in bf16 and every product takes
  bf16 operands: 1e-2 relative (measured 2-4e-3 in the interpreter);
* through the op, training through both walks against the scan (tests/test_chunk_walk.py);
* lowering for CUDA on the CPU within Hopper's shared memory, at K, V in {64, 128};
* the two-warpgroup kernel under the interpreter's race detector, which sees the warpgroups'
  register loads and stores of shared memory (the vectors handed over), not wgmma's or TMA's
  reads of it nor the loads' barriers: those hand-overs are checked by reading the kernel, and
  compiled on a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close, mosaic_gpu_or_skip, record_smem_estimates

ON_GPU, INTERPRET = mosaic_gpu_or_skip()

from pallas_kernels.gpu import chunk_grads as cg  # noqa: E402
from pallas_kernels.gpu import chunk_walk as cw  # noqa: E402

TOL = 1e-2


def _inputs(b, t, h, hv, dk, dv, seed, gate_scale=1.0, floor_gates=False):
  """The kernel's arguments (numpy-built): unit q, k; v, E, dO, dEᵀ, Sᵀ, dS'ᵀ normal; β = σ(N);
  log gates logsigmoid(N) · gate_scale (every 7th −1e4 with floor_gates), cumulated per
  chunk; the exact gate-free inverse."""
  r = np.random.default_rng(seed)
  n = lambda *s: r.standard_normal(s)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  c, nc = cg.CHUNK, t // cg.CHUNK
  q, k = unit(n(b, t, h, dk)), unit(n(b, t, h, dk))
  beta = 1 / (1 + np.exp(-n(b, hv, t)))
  g = -np.log1p(np.exp(-n(b, hv, t))) * gate_scale
  if floor_gates:
    g[..., ::7] = -1e4
  cum = np.cumsum(g.reshape(b, hv, nc, c), -1).reshape(b, hv, t)
  kc = np.repeat(k, hv // h, axis=2).reshape(b, nc, c, hv, dk).transpose(0, 3, 1, 2, 4)
  lower = np.tril(np.einsum("bhnik,bhnjk->bhnij", kc, kc) * beta.reshape(b, hv, nc, c, 1), -1)
  t0 = np.linalg.inv(np.eye(c) + lower)
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return dict(q=bf(q), k=bf(k), v=bf(n(b, t, hv, dv)), e=bf(n(b, t, hv, dv)),
              do=bf(n(b, t, hv, dv)), t0=bf(t0), g=f32(cum), beta=f32(beta),
              h_t=bf(0.5 * n(b, hv, nc, dv, dk)), dh_t=bf(0.5 * n(b, hv, nc, dv, dk)),
              de_t=bf(n(b, hv, nc, dv, c)))


# (b, t, h, hv, dk, dv, gate_scale, floor_gates, gated)
CASES = {
    "one chunk, K 64": (1, 64, 1, 1, 64, 64, 1.0, False, True),
    "K 128, V 64, strong decay": (1, 128, 1, 1, 128, 64, 30.0, False, True),
    "GVA, K 64, V 128": (1, 128, 1, 2, 64, 128, 1.0, False, True),
    "-1e4 gates": (1, 64, 1, 1, 64, 64, 1.0, True, True),
    "ungated (DeltaNet)": (1, 128, 1, 1, 64, 64, 1.0, False, False),
    "K 128, V 128, GVA, one chunk": (1, 64, 1, 2, 128, 128, 1.0, False, True),
}
if ON_GPU:
  CASES.update({
      "K 128, V 128, batch, GVA": (2, 512, 2, 4, 128, 128, 1.0, False, True),
      "K 128, V 128, -1e4 gates": (2, 256, 2, 2, 128, 128, 1.0, True, True),
  })


# join_exit (the exit term as a second accumulator of dk's group) changes only where that
# product is made: the gated cases again with it, against the same oracle.
_JOINED = sorted(c for c in CASES if CASES[c][-1])


# warpgroups=2 (the dq side and the dv / dR / dL side at once, K = V): the cases it takes.
_SPLIT = sorted(c for c in CASES if CASES[c][4] == CASES[c][5])


# `-m slow` (suite time): the single-warpgroup kernel (both exits) at two shapes whose default
# kernel is the two-warpgroup one (K = V), which their (True, 2) cases keep running. Its same
# branches stay at K = V = 64, one chunk ("-1e4 gates": the same shapes as "one chunk, K 64"),
# at K = 64 with V = 128 and GVA, ordinary gates ("GVA, K 64, V 128"), and at K = 128
# ("K 128, V 64, strong decay"); the interpreter runs the algebra, alike at every tile size.
_SLOW = {("one chunk, K 64", False, 1), ("one chunk, K 64", True, 1),
         ("K 128, V 128, GVA, one chunk", False, 1), ("K 128, V 128, GVA, one chunk", True, 1)}


def _vjp_param(*case):
  return pytest.param(*case, marks=pytest.mark.slow) if case in _SLOW else case


@pytest.mark.parametrize("case,join_exit,warpgroups",
                         [_vjp_param(c, False, 1) for c in sorted(CASES)]
                         + [_vjp_param(c, True, 1) for c in _JOINED]
                         + [_vjp_param(c, True, 2) for c in _SPLIT])
def test_kernel_matches_the_chunk_vjp(case, join_exit, warpgroups):
  b, t, h, hv, dk, dv, gate_scale, floor_gates, gated = CASES[case]
  x = _inputs(b, t, h, hv, dk, dv, seed=len(case), gate_scale=gate_scale,
              floor_gates=floor_gates)
  scale = dk ** -0.5
  got = jax.jit(lambda a: cg.chunk_grads(**a, scale=scale, gated=gated, join_exit=join_exit,
                                         warpgroups=warpgroups, interpret=INTERPRET))(x)
  ref_args = {name: val for name, val in x.items() if name != "t0"}
  want = jax.jit(lambda a: cg.chunk_grads_reference(**a, scale=scale, gated=gated))(ref_args)
  assert got[0].shape == (b, t, hv, dk) and got[2].shape == (b, t, hv, dv)
  assert got[0].dtype == got[1].dtype == got[2].dtype == jnp.bfloat16
  assert got[3].shape == (b, hv, t) and got[3].dtype == jnp.float32
  assert (got[4] is None) == (not gated)
  for name, g, w in zip(("dq", "dk", "dv", "dbeta", "dG"), got, want):
    if w is None:
      continue
    assert_close(jnp.asarray(g, jnp.float32), w, TOL, f"{case}: {name}")


@pytest.mark.skipif(ON_GPU, reason="the race detector is the interpreter's")
@pytest.mark.parametrize("gated", [True, False])
def test_two_warpgroups_hand_over_tiles_without_races(gated):
  # Dropping warpgroup 0's wait on warpgroup 1's mbarrier makes this report races on the
  # vectors warpgroup 0 loads (checked); wgmma's operand reads are not seen by the detector.
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # the detector's verdict
  from jax.experimental.pallas import mosaic_gpu as plgpu
  x = _inputs(1, 64, 1, 1, 64, 64, seed=3)
  out = cg.chunk_grads(**x, scale=0.125, gated=gated, join_exit=True, warpgroups=2,
                       interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(out)
  assert gpu_callbacks.get_races().races_found is False


LINEAR_CASES = [(1, 128, 1, 2, 64, 128), (1, 64, 1, 1, 128, 64)]
if ON_GPU:
  LINEAR_CASES += [(2, 512, 2, 4, 128, 128)]


@pytest.mark.parametrize("b,t,h,hv,dk,dv", LINEAR_CASES)
def test_linear_attention_kernel_matches_the_chunk_vjp(b, t, h, hv, dk, dv):
  # t0=None: linear attention (E = v, no erase); v, g and beta are not read.
  x = _inputs(b, t, h, hv, dk, dv, seed=t + hv)
  x["e"] = x["v"]           # what the forward walk writes for linear attention
  scale = dk ** -0.5
  got = jax.jit(lambda a: cg.chunk_grads(**dict(a, t0=None), scale=scale, gated=False,
                                         interpret=INTERPRET))(x)
  ref_args = {name: val for name, val in x.items() if name != "t0"}
  want = jax.jit(lambda a: cg.chunk_grads_reference(**a, scale=scale, gated=False,
                                                    delta=False))(ref_args)
  assert got[3] is None and got[4] is None and want[3] is None and want[4] is None
  for name, g, w in zip(("dq", "dk", "dv"), got[:3], want[:3]):
    assert_close(jnp.asarray(g, jnp.float32), w, TOL, f"linear attention: {name}")


def test_refuses_sizes_it_does_not_take():
  x = _inputs(1, 64, 1, 1, 128, 64, seed=0)
  with pytest.raises(ValueError, match="warpgroups=2 takes"):
    cg.chunk_grads(**x, scale=0.1, warpgroups=2, interpret=INTERPRET)
  with pytest.raises(ValueError, match="warpgroups=3"):
    cg.chunk_grads(**x, scale=0.1, warpgroups=3, interpret=INTERPRET)
  assert "V=256" in cg.supported(64, 128, 256)
  assert "chunk_size=32" in cg.supported(32, 64, 64)
  assert cg.supported(64, 128, 128) is None
  x = _inputs(1, 64, 1, 1, 64, 64, seed=0)
  x["q"], x["k"] = x["q"][:, :32], x["k"][:, :32]
  with pytest.raises(ValueError, match="multiple of 64"):
    cg.chunk_grads(**x, scale=0.1, interpret=INTERPRET)


@pytest.mark.parametrize("dk,dv", [(64, 64), (128, 128), (128, 64)])
def test_lowers_for_cuda_within_shared_memory(monkeypatch, dk, dv):
  estimates = record_smem_estimates(monkeypatch)
  b, t, h, hv = 2, 256, 2, 4
  nc = t // 64
  sds = jax.ShapeDtypeStruct
  bf, f32 = jnp.bfloat16, jnp.float32
  args = (sds((b, t, h, dk), bf), sds((b, t, h, dk), bf), sds((b, t, hv, dv), bf),
          sds((b, t, hv, dv), bf), sds((b, t, hv, dv), bf), sds((b, hv, nc, 64, 64), bf),
          sds((b, hv, t), f32), sds((b, hv, t), f32), sds((b, hv, nc, dv, dk), bf),
          sds((b, hv, nc, dv, dk), bf), sds((b, hv, nc, dv, 64), bf))
  # Every variant at the largest tiles (K = V = 128, where shared memory is tightest); the
  # gated kernel alone at the others.
  # (gated, approx_math, delta, join_exit, warpgroups)
  variants = [(True, False, True, False, 1)]
  if dk == dv:   # the two-warpgroup kernel, gated and not
    variants += [(True, True, True, True, 2), (False, False, True, True, 2)]
  if dk == dv == 128:
    variants += [(False, False, True, False, 1), (True, True, True, False, 1),
                 (False, False, False, False, 1), (True, True, True, True, 1)]
  for gated, approx, delta, join, wgs in variants:
    fn = lambda *a, gated=gated, approx=approx, delta=delta, join=join, wgs=wgs: cg._chunk_grads(
        *a[:5], a[5] if delta else None, *a[6:], scale=0.1, gated=gated, approx_math=approx,
        join_exit=join, warpgroups=wgs, interpret=None)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert 0 < estimates[-1] <= cw.SMEM_LIMIT, (dk, dv, gated, wgs, estimates[-1])
