"""The `triton` implementation, compiled on an NVIDIA GPU, or in Triton's interpreter on the CPU
(skipped elsewhere, with the reason).

jax-triton has no CPU lowering and triton is no CI dependency, so nothing here runs in `make
test`; the CPU side (sizes, dispatch, fallback) is tests/test_triton_path.py. On the GPU
machine: `GPU_TESTS=tests/test_triton_gpu.py bash experiments/run_gpu_kernels.sh 300 0`. On a
CPU with triton installed (`pip install triton`, no GPU), the same tests run the kernels in
Triton's interpreter (`pallas_kernels.gpu.triton.interpret`), slowly, and check what they
compute (not their speed, registers or races): `TRITON_INTERPRET=1 pytest tests/test_triton_gpu.py`.

Oracles (as tests/test_pallas_gpu.py's for the Mosaic kernels, same tolerances):
* kernel forward vs the float32 `lax.scan` recurrence with the kernels' bf16 operand rounding
  emulated (`state_passing_reference(round_operands=True)`: only accumulation order differs);
* kernel backward vs autodiff of the unrounded float32 recurrence (bf16 operands);
* the intra-chunk kernels (DeltaNet / GDN) vs `intra_chunk.intra_chunk_reference` (float32,
  exact solve) forward, and through `gpu_vjps.intra_kernel` vs autodiff of it (5e-3, as the
  Mosaic GPU kernels' tests);
* public ops vs the `scan` reference, forward and every gradient, with GVA, segment ids, tail
  padding, T not a multiple of the chunk, initial/final state and the write residual; edges of
  T under fresh jit compiles; log gates down to −1e4; bf16 / fp16 / fp32 inputs.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import MIXERS, assert_close, make_inputs, output_and_state_grads, run
from lineax_attn.ops import api
from lineax_attn.ops import triton_gpu

_REASON = triton_gpu.unsupported_reason(dk=64, dv=64, chunk_size=64, varlen=False)
if _REASON:
  pytest.skip(f"implementation='triton' cannot run here: {_REASON}", allow_module_level=True)

import kernel_cases  # noqa: E402
from lineax_attn import ops  # noqa: E402
from lineax_attn.ops import gpu_chunks, gpu_prepare, gpu_vjps, pallas_gpu  # noqa: E402
from pallas_kernels.gpu import intra_chunk as ic  # noqa: E402  (the shared reference)
from pallas_kernels.gpu import state_passing as sp  # noqa: E402  (the shared reference)
from pallas_kernels.gpu.triton import intra_chunk as tic  # noqa: E402
from pallas_kernels.gpu.triton import state_pass as tsp  # noqa: E402

FWD_TOL = 2e-2    # bf16 matmul operands, float32 accumulation and state
GRAD_TOL = 3e-2
BF = jnp.bfloat16


_chunk_inputs = kernel_cases.state_pass_inputs


# Every block width: V-tiles of 64 (K ≤ 128), 32 (K = 256) and 16 (V = 48).
@pytest.mark.parametrize("dk,dv", [(64, 64), (128, 128), (256, 64), (32, 48)])
def test_state_pass_forward_matches_scan(dk, dv):
  # 5e-4: the reference rounds the same operands to bf16, but a float32 state that differs in
  # its last bits (accumulation order) can round to the neighbouring bf16 value; those flips
  # (2^-8 each) reach ~1.5e-4 over three chunks (measured on the H200).
  x = _chunk_inputs(0, dk=dk, dv=dv)
  o, e, s, h = tsp.state_passing_fwd(**x, save_states=True)
  ro, re, rs, rh = sp.state_passing_reference(**x, round_operands=True)
  for name, got, want in (("o", o, ro), ("e", e, re), ("s_final", s, rs)):
    assert_close(got, want, 5e-4, name)
  assert h.dtype == BF
  assert_close(h.astype(jnp.float32), rh, 1e-2, "h (bf16 chunk-entry states)")
  # Without the saved states (another compiled kernel, maybe another accumulation order).
  o2, e2, s2 = tsp.state_passing_fwd(**x)
  for name, got, want in (("o", o2, ro), ("e", e2, re), ("s_final", s2, rs)):
    assert_close(got, want, 5e-4, f"{name} (save_states=False)")


@pytest.mark.parametrize("dk,dv", [(64, 64), (128, 128)])
def test_state_pass_backward_matches_autodiff(dk, dv):
  x = _chunk_inputs(1, nc=4, dk=dk, dv=dv)
  for name, got, want, tol in kernel_cases.state_pass_backward_pairs(tsp.state_passing_bwd, x):
    assert_close(got, want, tol, name)
  # E's cotangent not given (the op's case when E is unused): the kernel reads nothing for it.
  for name, got, want, tol in kernel_cases.state_pass_backward_pairs(tsp.state_passing_bwd, x,
                                                                     residual=False):
    assert_close(got, want, tol, f"{name} (no residual)")
  # The same cotangents as the Mosaic GPU kernel where it runs (Hopper).
  if pallas_gpu.is_hopper():
    ks = jax.random.split(jax.random.key(2), 3)
    cts = (jax.random.normal(ks[0], x["u"].shape).astype(BF),
           jax.random.normal(ks[1], x["u"].shape), jax.random.normal(ks[2], x["s0"].shape))
    args = (x["ny"], x["qg"], x["p"], x["kg"], x["gc"], *cts)
    for name, got, w in zip(("de", "dh", "ds0"), tsp.state_passing_bwd(*args),
                            sp.state_passing_bwd(*args)):
      assert_close(got.astype(jnp.float32), w.astype(jnp.float32), 1e-2, f"{name} vs Mosaic")


@pytest.mark.parametrize("mixer", MIXERS)
def test_op_forward_matches_scan(mixer):
  for name, g, w in kernel_cases.op_forward_pairs(mixer, "triton", b=2):
    assert_close(g, w, FWD_TOL, f"{mixer} {name} vs scan")


@pytest.mark.parametrize("mixer", MIXERS)
def test_op_gradients_match_scan(mixer):
  args, kw = make_inputs(mixer, b=1, t=160, h=2, hv=4, dk=64, dv=128, seed=4)
  got = output_and_state_grads(mixer, args, kw["initial_state"], "triton")
  want = output_and_state_grads(mixer, args, kw["initial_state"], "scan")
  names = ["q", "k", "v"] + [f"gate{i}" for i in range(len(args) - 3)] + ["initial_state"]
  for name, g, w in zip(names, got, want):
    assert_close(g, w, GRAD_TOL, f"{mixer} d{name}")


# The per-channel gates' one-chunk case is where XLA CPU once miscompiled (tests/test_jit_edges.py);
# GDN shares every other path of theirs (tests/test_triton_gpu.py's op tests). With the intra
# kernels (triton_intra="kernel") every mixer that has one: padding to one chunk, tail rows.
_EDGE_CASES = ([(m, "xla") for m in ("kda", "gdn2")]
               + [(m, "kernel") for m in ("kda", "gdn2", "gated_delta_rule", "delta_rule")])


@pytest.mark.parametrize("t", [1, 63, 64, 65, 128])
@pytest.mark.parametrize("mixer,intra", _EDGE_CASES)
def test_jitted_forward_at_the_edges_of_t(mixer, intra, t):
  args, _ = make_inputs(mixer, b=2, t=t, h=2, dk=64, dv=64, seed=5, with_state=False)
  want = run(mixer, args, implementation="scan")[0]
  tuning = ops.GpuTuning(triton_intra=intra)
  for outputs in ("o", "o+state", "o+residual"):
    # A new function object each time: a fresh trace and compile (the class of bug
    # tests/test_jit_edges.py hunts), without clearing every other test's caches.
    kw = dict(output_final_state=outputs == "o+state", return_residual=outputs == "o+residual")
    got = jax.jit(lambda *a, kw=kw: run(mixer, a, implementation="triton", tuning=tuning,
                                        **kw)[0])(*args)
    assert_close(got, want, FWD_TOL, f"{mixer} intra={intra} T={t} {outputs}")


@pytest.mark.parametrize("mixer", ["kda", "gdn2", "gated_delta_rule"])
def test_log_gates_down_to_minus_1e4_stay_finite(mixer):
  args, kw = make_inputs(mixer, b=1, t=130, h=2, dk=64, dv=64, seed=6)
  args = list(args)
  gi = 3   # the decay gate follows q, k, v in every gated mixer's signature
  g = np.array(args[gi])
  g[:, 40:50] = -1e4   # a full reset in the middle of the first chunk
  args[gi] = jnp.asarray(g)
  got = run(mixer, args, **kw, implementation="triton", output_final_state=True)
  want = run(mixer, args, **kw, implementation="scan", output_final_state=True)
  for name, x, w in zip(("o", "final_state"), got, want):
    assert np.isfinite(np.asarray(x)).all(), f"{mixer} {name} not finite"
    assert_close(x, w, FWD_TOL, f"{mixer} {name} with −1e4 gates")
  grads = output_and_state_grads(mixer, tuple(args), kw["initial_state"], "triton")
  assert all(np.isfinite(np.asarray(x)).all() for x in grads), f"{mixer}: non-finite gradient"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_input_dtypes(dtype):
  args, kw = make_inputs("gated_delta_rule", b=1, t=96, h=2, dk=128, dv=128, seed=7)
  cast = [a.astype(dtype) for a in args[:3]] + list(args[3:])
  got = run("gated_delta_rule", cast, **kw, implementation="triton")[0]
  want = run("gated_delta_rule", cast, **kw, implementation="scan")[0]
  assert got.dtype == dtype
  assert_close(got.astype(jnp.float32), want.astype(jnp.float32), FWD_TOL, str(dtype))


_GPU_ONLY = pytest.mark.skipif(triton_gpu.interpreted(), reason="about the GPU itself, not the "
                               "kernels: runs compiled only")


@_GPU_ONLY
def test_default_implementation_on_this_gpu():
  want = "pallas_gpu" if pallas_gpu.is_hopper() else "triton"
  assert api.default_implementation() == want


def test_tuning_steers_the_xla_intra_chunk_part():
  # remat_intra=False keeps the intra-chunk residuals: same numbers, one less recompute.
  args, kw = make_inputs("kda", b=1, t=128, h=2, dk=64, dv=64, seed=8)
  a = output_and_state_grads("kda", args, kw["initial_state"], "triton",
                             tuning=ops.GpuTuning(remat_intra=False))
  b = output_and_state_grads("kda", args, kw["initial_state"], "triton")
  for x, y in zip(a, b):
    assert_close(x, y, 1e-5, "remat_intra")


@_GPU_ONLY
def test_jax_triton_leaves_other_triton_users_their_cache_dir():
  # jax-triton 0.3.1 empties TRITON_CACHE_DIR on import, which broke FLA's autotuner in the same
  # process ("Could not create or locate cache dir"); state_pass puts it back.
  x = _chunk_inputs(9, nc=1)
  tsp.state_passing_fwd(**x)
  assert os.environ.get("TRITON_CACHE_DIR", None) != ""


def _intra_inputs(seed, *, correlated=False, **dims):
  return kernel_cases.intra_inputs(seed, correlated=correlated, **dims)


def _packed_ids(t=128):
  return jnp.asarray(kernel_cases.packed_segments(t)[0], jnp.int32)


@pytest.mark.parametrize("inverse", ["tiles", "batched"])
@pytest.mark.parametrize("case,dk,dv", [("random", 64, 64), ("random", 128, 128),
                                        ("correlated", 64, 64), ("packed", 64, 128)])
def test_intra_kernel_forward_matches_exact_reference(case, dk, dv, inverse):
  args = _intra_inputs(0, correlated=case == "correlated", dk=dk, dv=dv)
  segments = gpu_chunks.kernel_segments(_packed_ids(), 64) if case == "packed" else None
  scale = dk ** -0.5
  *got, m = tic.intra_chunk_fwd(*args, segments, scale=scale, with_inverse=True,
                                inverse=inverse)
  want = ic.intra_chunk_reference(*args, segments, scale=scale)
  for name, g, w in zip(("ny", "qg", "p", "u", "kg"), got, want):
    tol = 2e-2 if (name == "ny" and case == "correlated") else 5e-3
    assert_close(np.asarray(g, np.float32), w, tol, f"{name} ({case})")
  plain = tic.intra_chunk_fwd(*args, segments, scale=scale,   # with_inverse changes nothing else
                              inverse=inverse)
  for name, a, b in zip(("ny", "qg", "p", "u", "kg"), plain, got):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), name)
  # M (I + L) = I with L built here in float64 (M is bf16: 2^-9 per entry).
  q, k, v, beta, g, _ = (np.asarray(x, np.float64) for x in args)
  for hv, ci in ((0, 0), (1, 1)):
    rows = slice(ci * 64, (ci + 1) * 64)
    kc, gc, bc = k[0, rows, 0], g[0, hv, rows], beta[0, hv, rows]
    gam = np.exp(gc[:, None] - gc[None, :])
    if case == "packed":
      ids = np.asarray(_packed_ids())[0, rows]
      gam = gam * (ids[:, None] == ids[None, :])
    lmat = np.tril(bc[:, None] * (kc @ kc.T) * gam, -1)
    resid = np.asarray(m[0, hv, ci], np.float64) @ (np.eye(64) + lmat) - np.eye(64)
    assert np.abs(resid).max() < 1e-2, (case, hv, ci, np.abs(resid).max())


@pytest.mark.parametrize("case", ["random", "packed"])
def test_intra_kernel_backward_matches_autodiff_of_exact_reference(case):
  kernel = lambda q, k, v, beta_t, G, segidx, scale: gpu_vjps.intra_kernel(
      q, k, v, beta_t, G, segidx, scale, 64, None, "triton")
  for name, g_, w in kernel_cases.intra_backward_pairs(kernel, case):
    assert_close(g_, w, 5e-3, f"d{name} ({case})")


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", ["random", "packed"])
def test_ungated_intra_backward_matches_the_gated_kernel_and_the_exact_reference(case, fused):
  # gated=False (DeltaNet) skips dG's work in the backward kernel. At G = 0 its dq, dk, dv, dβ
  # are the gated kernel's (the same float32 sums: equal to rounding), and no dG comes back.
  q, k, v, beta, g, gx = kernel_cases.intra_inputs(3, correlated=False, hv=1)
  g, gx = jnp.zeros_like(g), jnp.zeros_like(gx)
  segs = (tuple(jnp.asarray(x) for x in kernel_cases.packed_segments()) if case == "packed"
          else None)
  m = tic.intra_chunk_fwd(q, k, v, beta, g, gx, segs, scale=0.125, with_inverse=True)[-1]
  keys = jax.random.split(jax.random.key(4), 5)
  ct = lambda i, shape: jax.random.normal(keys[i], shape).astype(jnp.bfloat16)
  dny, du, dqg, dkg = (ct(i, (1, 1, 2, 64, 64)) for i in range(4))
  dp = ct(4, (1, 1, 2, 64, 64))
  cts = (dqg, dkg) if fused else None
  run = lambda gated: tic.intra_chunk_bwd(q, k, v, beta, g, gx, segs, m, dny, dp, du, cts,
                                          scale=0.125, gated=gated)
  gated, ungated = run(True), run(False)
  assert len(gated) == len(ungated) == (5 if fused else 6)
  assert all(x is None for x in ungated[4:]), [type(x) for x in ungated[4:]]
  for name, a, b in zip(("dq", "dk", "dv", "dbeta"), ungated, gated):
    assert a.shape == b.shape, name
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6,
                               err_msg=f"{name} ungated vs gated ({case}, fused={fused})")
  # Through the custom VJP, against autodiff of the exact reference at G = 0 (G's own
  # cotangent is not the kernel's: it takes no G).
  kernel = lambda q, k, v, beta_t, G, segidx, scale: gpu_vjps.intra_kernel(
      q, k, v, beta_t, None, segidx, scale, 64, None, "triton", fused_grads=fused, gated=False)
  pairs = kernel_cases.intra_backward_pairs(kernel, case, hv=1, zero_gates=True)
  for name, g_, w in pairs[:4]:
    assert_close(g_, w, 5e-3, f"d{name} ungated ({case}, fused={fused})")


@pytest.mark.parametrize("case", ["random", "packed"])
def test_fused_intra_grads_match_the_glue_and_the_exact_reference(case):
  # GpuTuning(intra_grads="kernel"): the backward kernel also finishes the QG / KG terms and dG
  # and stores dq, dk, dv in the inputs' layout (no GVA: one q/k head, one value head). Against
  # the kernel + XLA glue on the same inputs (the same float32 sums in another order) and
  # against autodiff of the exact reference.
  fused = lambda *a: gpu_vjps.intra_kernel(*a, 64, None, "triton", fused_grads=True)
  glue = lambda *a: gpu_vjps.intra_kernel(*a, 64, None, "triton")
  got = kernel_cases.intra_backward_pairs(fused, case, hv=1)
  base = kernel_cases.intra_backward_pairs(glue, case, hv=1)
  for (name, g_, w), (_, b_, _) in zip(got, base):
    assert g_.shape == b_.shape == w.shape, name
    assert_close(np.asarray(g_), np.asarray(b_), 1e-5, f"d{name} fused vs glue ({case})")
    assert_close(g_, w, 5e-3, f"d{name} fused vs exact ({case})")
  # With GVA the fused kernel does not apply (dq, dk sum over value heads): the glue runs.
  with_gva = kernel_cases.intra_backward_pairs(fused, case, hv=2)
  for (name, g_, w) in with_gva:
    assert_close(g_, w, 5e-3, f"d{name} GVA ({case})")
  with pytest.raises(ValueError, match="H = HV"):
    q, k, v, beta, g, gx = kernel_cases.intra_inputs(0, correlated=False, hv=2)
    m = tic.intra_chunk_fwd(q, k, v, beta, g, gx, scale=0.125, with_inverse=True)[-1]
    zeros = jnp.zeros((1, 2, 2, 64, 64), jnp.bfloat16)
    tic.intra_chunk_bwd(q, k, v, beta, g, gx, None, m, zeros, zeros, zeros, (zeros, zeros),
                        scale=0.125)


@pytest.mark.parametrize("fused", [False, True])
def test_intra_backward_is_the_same_at_every_loop_width(fused):
  # blocks.grads_bk only changes how many columns a step of the dq / dk loop takes: every
  # output column is the same product, so the results agree to float32 rounding at K = V = 128
  # (8, 4 and 2 steps), plain and fused.
  q, k, v, beta, g, gx = kernel_cases.intra_inputs(2, correlated=False, hv=1, dk=128, dv=128)
  m = tic.intra_chunk_fwd(q, k, v, beta, g, gx, scale=128 ** -0.5, with_inverse=True)[-1]
  keys = jax.random.split(jax.random.key(4), 5)
  ct = lambda i, shape: jax.random.normal(keys[i], shape).astype(jnp.bfloat16)
  dny, du, dqg, dkg = (ct(i, (1, 1, 2, 64, 128)) for i in range(4))
  dp = ct(4, (1, 1, 2, 64, 64))
  cts = (dqg, dkg) if fused else None
  run = lambda bk: tic.intra_chunk_bwd(q, k, v, beta, g, gx, None, m, dny, dp, du, cts,
                                       scale=128 ** -0.5, grads_bk=bk)
  base = run(16)
  for bk in (32, 64):
    for i, (a, b) in enumerate(zip(run(bk), base)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                                 err_msg=f"output {i}, {bk} columns a step")


@pytest.mark.parametrize("t", [1, 64, 90])
@pytest.mark.parametrize("mixer", ["gated_delta_rule", "delta_rule"])
def test_op_gradients_with_fused_intra_grads_match_scan(monkeypatch, mixer, t):
  # The op's every gradient with intra_grads="kernel" (h = hv, so the fused kernel runs), under
  # jit, against the scan: T = 1 (one padded chunk), one whole chunk, and T 90 (padded to 96).
  fused_calls = []
  kernel = tic.intra_chunk_bwd
  monkeypatch.setattr(tic, "intra_chunk_bwd", lambda *a, **k: fused_calls.append(
      len(a) > 11 and a[11] is not None) or kernel(*a, **k))
  tuning = ops.GpuTuning(intra_grads="kernel", triton_intra="kernel")
  args, kw = make_inputs(mixer, b=1, t=t, h=2, hv=2, dk=64, dv=64, seed=4)
  got = output_and_state_grads(mixer, args, kw["initial_state"], "triton", tuning=tuning)
  want = output_and_state_grads(mixer, args, kw["initial_state"], "scan")
  assert fused_calls == [True], fused_calls
  for i, (g_, w) in enumerate(zip(got, want)):
    assert_close(g_, w, GRAD_TOL, f"{mixer} fused intra grads, grad {i}")


@pytest.mark.parametrize("t", [1, 64, 90])
@pytest.mark.parametrize("intra_grads", ["kernel", "xla"])
def test_delta_rule_op_gradients_through_the_ungated_backward_match_scan(monkeypatch,
                                                                         intra_grads, t):
  # DeltaNet has no gate: the backward kernel runs ungated (gated=False, no dG work), fused or
  # with XLA's glue; every op gradient under jit against the scan, T = 1, 64 and 90 (padded).
  calls = []
  kernel = tic.intra_chunk_bwd
  monkeypatch.setattr(tic, "intra_chunk_bwd", lambda *a, **k: calls.append(
      (len(a) > 11 and a[11] is not None, k.get("gated", True))) or kernel(*a, **k))
  tuning = ops.GpuTuning(intra_grads=intra_grads, triton_intra="kernel")
  args, kw = make_inputs("delta_rule", b=1, t=t, h=2, hv=2, dk=64, dv=64, seed=4)
  got = output_and_state_grads("delta_rule", args, kw["initial_state"], "triton", tuning=tuning)
  want = output_and_state_grads("delta_rule", args, kw["initial_state"], "scan")
  assert calls == [(intra_grads == "kernel", False)], calls
  for i, (g_, w) in enumerate(zip(got, want)):
    assert_close(g_, w, GRAD_TOL, f"delta_rule ungated intra grads={intra_grads}, grad {i}")


def test_intra_kernel_refuses_a_gate_that_disagrees_with_gated():
  q, k, v, beta, g, _ = kernel_cases.intra_inputs(0, correlated=False, hv=1)
  beta_t = jnp.moveaxis(beta, 1, 2)
  with pytest.raises(ValueError, match="gated"):
    gpu_vjps.intra_kernel(q, k, v, beta_t, None, None, 0.125, 64, None, "triton")
  with pytest.raises(ValueError, match="gated"):
    gpu_vjps.intra_kernel(q, k, v, beta_t, g.reshape(1, 1, 2, 64), None, 0.125, 64, None,
                          "triton", gated=False)


# Where each mixer's intra kernel is entered: (module, function). The delta-rule kernel's own
# entry; for per-channel gates the call inside the custom VJP (its backward is XLA's).
_INTRA_ENTRY = {"gated_delta_rule": (tic, "intra_chunk_fwd"),
                "delta_rule": (tic, "intra_chunk_fwd"),
                "kda": (gpu_prepare, "_channel_kernel_call"),
                "gdn2": (gpu_prepare, "_channel_kernel_call")}


@pytest.mark.parametrize("mixer", ["gated_delta_rule", "delta_rule", "kda", "gdn2"])
def test_op_takes_the_triton_intra_kernel_on_request(monkeypatch, mixer):
  module, name = _INTRA_ENTRY[mixer]
  calls = []
  kernel = getattr(module, name)
  monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or kernel(*a, **k))
  args, kw = make_inputs(mixer, b=1, t=96, h=1, hv=2, dk=64, dv=64, seed=1)
  want = output_and_state_grads(mixer, args, kw["initial_state"], "scan")
  for intra in ("kernel", "xla"):
    calls.clear()
    got = output_and_state_grads(mixer, args, kw["initial_state"], "triton",
                                 tuning=ops.GpuTuning(triton_intra=intra))
    assert bool(calls) == (intra == "kernel"), intra
    for i, (g_, w) in enumerate(zip(got, want)):
      assert_close(g_, w, GRAD_TOL, f"{mixer} intra={intra} grad {i}")


@pytest.mark.parametrize("mixer", ["kda", "gdn2"])
def test_pallas_gpu_borrows_the_triton_channel_kernels(monkeypatch, mixer):
  # On Hopper with the extra, pallas_gpu takes the Triton KDA / GDN-2 intra kernels by default
  # (channel_intra="auto") and on request ("triton"); "xla" keeps XLA's part. Each against the
  # scan: output, final state and every gradient.
  if not (pallas_gpu.is_hopper() or triton_gpu.interpreted()):   # (on CPU: Mosaic's interpreter)
    pytest.skip("pallas_gpu needs a Hopper GPU")
  module, name = _INTRA_ENTRY[mixer]
  calls = []
  kernel = getattr(module, name)
  monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or kernel(*a, **k))
  args, kw = make_inputs(mixer, b=1, t=96, h=1, hv=2, dk=64, dv=64, seed=2)
  s0 = kw["initial_state"]
  want_o, want_s = run(mixer, args, initial_state=s0, output_final_state=True,
                       implementation="scan")
  want = output_and_state_grads(mixer, args, s0, "scan")
  for choice in ("auto", "triton", "xla"):
    tuning = ops.GpuTuning(channel_intra=choice)
    calls.clear()
    o, s = jax.jit(lambda *a, tuning=tuning: run(
        mixer, a[:-1], initial_state=a[-1], output_final_state=True,
        implementation="pallas_gpu", tuning=tuning))(*args, s0)
    assert bool(calls) == (choice != "xla"), choice
    assert_close(o, want_o, FWD_TOL, f"{mixer} channel_intra={choice} o")
    assert_close(s, want_s, FWD_TOL, f"{mixer} channel_intra={choice} final state")
    got = output_and_state_grads(mixer, args, s0, "pallas_gpu", tuning=tuning)
    for i, (g_, w) in enumerate(zip(got, want)):
      assert_close(g_, w, GRAD_TOL, f"{mixer} channel_intra={choice} grad {i}")


@pytest.mark.parametrize("dk,dv", [(64, 64), (128, 128), (128, 64)])
def test_state_pass_products_kernel_matches_float32_products(dk, dv):
  # The one-program-a-chunk products against float32 products (HIGHEST) of the same bf16
  # operands: only the outputs' bf16 rounding (and the accumulation order) differ.
  r = np.random.default_rng(dk + dv)
  n = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  b, hv, nc, c = 1, 2, 3, 64
  de, e = n(b, hv, nc, c, dv), n(b, hv, nc, c, dv)
  do = n(b, hv, nc, c, dv).astype(BF)
  h, dh = n(b, hv, nc, dk, dv).astype(BF), n(b, hv, nc, dk, dv).astype(BF)
  got = jax.jit(tsp.state_pass_products)(de, do, e, h, dh)
  f = lambda x: x.astype(BF).astype(jnp.float32)
  mm = lambda spec, x, y: jnp.einsum(spec, f(x), f(y), precision=jax.lax.Precision.HIGHEST)
  want = (mm("...cv,...kv->...ck", de, h), mm("...cv,...kv->...ck", do, h),
          mm("...iv,...jv->...ij", do, e), mm("...cv,...kv->...ck", e, dh),
          jnp.sum(f(h) * f(dh), axis=-1))
  for name, g_, w, dtype in zip(("dNY", "dQG", "dP", "dKG", "dgc"), got, want,
                                (BF, BF, BF, BF, jnp.float32)):
    assert g_.shape == w.shape and g_.dtype == dtype, name
    assert_close(g_.astype(jnp.float32), w, 1e-2 if dtype == BF else 1e-5, f"{name} K{dk} V{dv}")
  # dO in the op's [B, T, HV, V] layout (o_rows, the states path's), two rows of the batch:
  # the same products to the bit as from the chunk-major dO.
  de2, e2, do2, h2, dh2 = (jnp.concatenate([x, -x], 0) for x in (de, e, do, h, dh))
  chunked = jax.jit(tsp.state_pass_products)(de2, do2, e2, h2, dh2)
  rows = jax.jit(functools.partial(tsp.state_pass_products, o_rows=True))(
      de2, gpu_chunks.from_chunks(do2), e2, h2, dh2)
  for name, a, b_ in zip(("dNY", "dQG", "dP", "dKG", "dgc"), rows, chunked):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                  np.asarray(b_.astype(jnp.float32)), err_msg=f"{name} rows")
  with pytest.raises(ValueError, match="do"):
    tsp.state_pass_products(de2, do2, e2, h2, dh2, o_rows=True)
  # Another launch (benchmarks' `launch=`: warps, K rows a slice, stages): the same products
  # (up to the float32 sums' order, then the outputs' bf16 rounding: 1e-2, dgc 1e-5 as above);
  # a slice width it cannot take is refused.
  other = jax.jit(functools.partial(tsp.state_pass_products, launch=(4, 32, 2)))(
      de, do, e, h, dh)
  for name, a, w, dtype in zip(("dNY", "dQG", "dP", "dKG", "dgc"), other, want,
                               (BF, BF, BF, BF, jnp.float32)):
    assert a.dtype == dtype, name
    assert_close(a.astype(jnp.float32), w, 1e-2 if dtype == BF else 1e-5, f"{name} launch")
  with pytest.raises(ValueError, match="bk"):
    tsp.state_pass_products(de, do, e, h, dh, launch=(8, 48, 1))


@pytest.mark.parametrize("mixer", ["kda", "gdn2"])
def test_pallas_gpu_with_the_products_kernel_matches_scan(mixer):
  # GpuTuning(state_products="kernel"): the state pass's backward products by the Triton
  # kernel instead of XLA's; every gradient against the scan's, with a tail and two heads.
  if not (pallas_gpu.is_hopper() or triton_gpu.interpreted()):   # (on CPU: Mosaic's interpreter)
    pytest.skip("pallas_gpu needs a Hopper GPU")
  args, kw = make_inputs(mixer, b=1, t=100, h=1, hv=2, dk=64, dv=64, seed=9)
  s0 = kw["initial_state"]
  got = output_and_state_grads(mixer, args, s0, "pallas_gpu",
                               tuning=ops.GpuTuning(state_products="kernel"))
  want = output_and_state_grads(mixer, args, s0, "scan")
  for i, (g_, w) in enumerate(zip(got, want)):
    assert_close(g_, w, GRAD_TOL, f"{mixer} grad {i}")


@pytest.mark.parametrize("mixer", ["gated_delta_rule", "delta_rule", "kda"])
def test_pallas_gpu_with_the_triton_state_pass_matches_scan(monkeypatch, mixer):
  # GpuTuning(state_pass="triton"): pallas_gpu's intra part (Mosaic intra kernels for DeltaNet /
  # GDN, the channel kernels for KDA), then the Triton state pass instead of Mosaic's, which is
  # not called. Against the scan: output, final state, every gradient; segments and a tail.
  if not (pallas_gpu.is_hopper() or triton_gpu.interpreted()):   # (on CPU: Mosaic's interpreter)
    pytest.skip("pallas_gpu needs a Hopper GPU")
  called = {"triton": 0, "mosaic": 0}
  for kind, module in (("triton", tsp), ("mosaic", sp)):
    for name in ("state_passing_fwd", "state_passing_bwd"):
      fn = getattr(module, name)
      monkeypatch.setattr(module, name, lambda *a, _fn=fn, _kind=kind, **k: (
          called.__setitem__(_kind, called[_kind] + 1), _fn(*a, **k))[1])
  args, kw = make_inputs(mixer, b=1, t=150, h=1, hv=2, dk=64, dv=64, seed=5)
  s0 = kw["initial_state"]
  seg = jnp.asarray(np.repeat([[1, 2, 3]], [70, 50, 30]))[None]
  tuning = ops.GpuTuning(state_pass="triton", forward="split")   # (the walks have no state pass)
  want_o, want_s = run(mixer, args, initial_state=s0, output_final_state=True,
                       segment_ids=seg, implementation="scan")
  o, s = jax.jit(lambda *a: run(mixer, a[:-1], initial_state=a[-1], output_final_state=True,
                                segment_ids=seg, implementation="pallas_gpu",
                                tuning=tuning))(*args, s0)
  assert called == {"triton": 1, "mosaic": 0}, called
  assert_close(o, want_o, FWD_TOL, f"{mixer} o")
  assert_close(s, want_s, FWD_TOL, f"{mixer} final state")
  got = output_and_state_grads(mixer, args, s0, "pallas_gpu", tuning=tuning)
  want = output_and_state_grads(mixer, args, s0, "scan")
  assert called["mosaic"] == 0 and called["triton"] >= 3, called   # fwd, fwd for the vjp, bwd
  for i, (g_, w) in enumerate(zip(got, want)):
    assert_close(g_, w, GRAD_TOL, f"{mixer} grad {i}")


# ----------------------------------------------------------------------------- channel gates


def _channel_inputs(seed, *, dk, dv, t=128, hv=2, tau=1.0):
  """The channel-gate kernel's inputs as the XLA preparation has them (float32 [B, T, HV, D]),
  and G summed within chunks of 64. tau < 1 sharpens the decays (strong decay)."""
  ks = jax.random.split(jax.random.key(seed), 6)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (1, t, hv, dk))) * dk ** -0.5
  k = unit(jax.random.normal(ks[1], (1, t, hv, dk)))
  kt = k * jax.nn.sigmoid(jax.random.normal(ks[2], (1, t, hv, dk)))
  vt = jax.random.normal(ks[3], (1, t, hv, dv)) * jax.nn.sigmoid(
      jax.random.normal(ks[4], (1, t, hv, dv)))
  g = jax.nn.log_sigmoid(jax.random.normal(ks[5], (1, t, hv, dk))) / tau
  G = jnp.cumsum(g.reshape(1, t // 64, 64, hv, dk), axis=2).reshape(1, t, hv, dk)
  return q, k, kt, vt, g, G


# Decay sharpness per case: strong (τ = 0.1) and weak (τ = 10, for packing: pairs across a
# segment boundary stay large enough to matter).
_TAU = {"random": 1.0, "strong": 0.1, "packed": 10.0}


# span 80: the bounded-span path (blocks.CHANNEL_SPAN, the default): "random" and "packed"
# chunks take it (bf16 diagonal blocks), "strong" ones (16-row spans past 80 nats) keep the
# exact path, so both paths and their switch run.
@pytest.mark.parametrize("span", [0.0, 80.0])
@pytest.mark.parametrize("case,dk,dv", [("random", 64, 64), ("random", 128, 128),
                                        ("strong", 128, 64), ("packed", 64, 128)])
def test_channel_intra_kernel_matches_exact_reference(case, dk, dv, span):
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  from lineax_attn.ops import chunked  # pylint: disable=g-import-not-at-top
  q, k, kt, vt, _, G = _channel_inputs(3, dk=dk, dv=dv, tau=_TAU[case])
  same = cont = keep = segments = None
  if case == "packed":
    ids = _packed_ids()
    segments = gpu_chunks.kernel_segments(ids, 64)
    same, cont, keep = gpu_chunks.segment_masks(ids, 64)
  got = channel_intra.channel_intra_fwd(q, k, kt, vt, G, segments, chunk=64, span=span)
  ch = lambda x: gpu_chunks.to_chunks(x, 64)
  QG, P, Y, U, KG, dc = chunked._intra_chunk(ch(q), ch(k), ch(kt), ch(vt), ch(G), "channel",
                                             same, cont, keep, matmul="highest", solve="trsm")
  want = (-Y, QG, P, U, KG, jnp.broadcast_to(dc, got[5].shape))
  for name, g_, w in zip(("ny", "qg", "p", "u", "kg", "gc"), got, want):
    g_, w = np.asarray(g_, np.float32), np.asarray(w, np.float32)
    assert np.all(np.isfinite(g_)), name
    if name == "gc":   # exact exponentials; zero where a segment starts inside the chunk
      np.testing.assert_allclose(g_, w, rtol=1e-5, atol=1e-30)
    else:   # NY goes through M in bf16 and the erase keys: 1e-2 (5.6e-3 in the interpreter)
      assert_close(g_, w, 1e-2 if name == "ny" else 5e-3, f"{name} ({case})")


def test_bounded_span_path_is_taken_only_where_the_decay_is_bounded():
  # span 80: chunks whose 16-row sub-chunks decay by at most 80 nats take the tensor-core
  # diagonal blocks (P changes by bf16 rounding), steeper ones keep the exact path (P is the
  # exact path's to the bit); a span of 0 is the exact path itself.
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  for case, taken in (("random", True), ("strong", False)):
    q, k, kt, vt, _, G = _channel_inputs(3, dk=64, dv=64, tau=_TAU[case])
    p_of = lambda span: np.asarray(channel_intra.channel_intra_fwd(
        q, k, kt, vt, G, chunk=64, span=span)[2], np.float32)
    exact, bounded = p_of(0.0), p_of(80.0)
    assert np.array_equal(exact, bounded) != taken, case
  with pytest.raises(ValueError, match="span"):
    channel_intra.channel_intra_fwd(q, k, kt, vt, G, chunk=64, span=100.0)


@pytest.mark.parametrize("case", ["random", "strong", "packed"])
def test_channel_forward_pipelined_slice_loop_changes_no_result(case):
  # slice_stages (blocks.CHANNEL_SLICE_STAGES) only moves the next slice's loads ahead of this
  # slice's products: every output the same to the bit, on the bounded-span and exact paths,
  # packed rows, and with the gates made on chip as the op calls the kernel; a depth the kernel
  # does not take is refused.
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  q, k, kt, vt, _, G = _channel_inputs(7, dk=64, dv=64, tau=_TAU[case])
  segments = gpu_chunks.kernel_segments(_packed_ids(), 64) if case == "packed" else None
  erase = jax.nn.sigmoid(jax.random.normal(jax.random.key(8), k.shape[:3]))
  calls = (lambda st: channel_intra.channel_intra_fwd(q, k, kt, vt, G, segments, chunk=64,
                                                      with_inverse=True, slice_stages=st),
           lambda st: channel_intra.channel_intra_fwd(q, k, k, vt, G, segments, chunk=64,
                                                      erase=erase, slice_stages=st))
  for call in calls:
    one = call(1)
    for st in (2, 3):
      for name, a, b in zip(("ny", "qg", "p", "u", "kg", "gc", "m"), call(st), one):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=f"{name} ({case}, {st} stages)")
  with pytest.raises(ValueError, match="slice_stages"):
    channel_intra.channel_intra_fwd(q, k, kt, vt, G, chunk=64, slice_stages=4)


@pytest.mark.parametrize("case,gates", [("random", "none"), ("strong", "row"),
                                        ("packed", "channel")])
def test_channel_forward_solve_kernel_matches_the_fused_solve(case, gates):
  # solve="kernel" (GpuTuning.channel_solve): the forward kernel stops after M and a second
  # kernel makes NY and U from the stored M with the same operands and products, so every
  # output matches the fused solve's (NY in bf16 to within a rounding, U float32 to 1e-6),
  # with the exact and bounded-span paths, packed rows, and gates made on chip (K 64, V 128:
  # a column block count that differs between NY and U); M is returned only if asked for.
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  q, k, v, G, erase, write, _ = _gated_channel_inputs(21, "row" if gates == "none" else gates)
  if case == "strong":
    G = _channel_inputs(21, dk=64, dv=128, tau=_TAU["strong"])[-1]
  segments = gpu_chunks.kernel_segments(_packed_ids(), 64) if case == "packed" else None
  gated = {} if gates == "none" else dict(erase=erase, write=write)
  call = lambda solve, inverse: channel_intra.channel_intra_fwd(
      q, k, k, v, G, segments, chunk=64, with_inverse=inverse, solve=solve, q_scale=0.125,
      **gated)
  fused, split = call("fused", True), call("kernel", True)
  for name, a, b in zip(("ny", "qg", "p", "u", "kg", "gc", "m"), split, fused):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.all(np.isfinite(a)), name
    assert_close(a, b, 1e-3 if name == "ny" else 1e-6, f"{name} ({case}, {gates})")
  assert len(call("kernel", False)) == 6
  with pytest.raises(ValueError, match="solve"):
    call("split", False)


@pytest.mark.parametrize("dk,dv,case,gates", [(128, 128, "random", "row"),
                                               (64, 128, "packed", "channel"),
                                               pytest.param(128, 64, "strong", "none",
                                                            marks=pytest.mark.slow)])
def test_channel_forward_paired_solve_is_the_fused_solve(dk, dv, case, gates):
  # solve="paired" (GpuTuning.channel_solve): the fused solve's loops as one, each step making
  # NY's and U's blocks of the same columns, the columns K or V has beyond the other after it;
  # "prefetched", the same with the next step's tiles loaded during this one (none past the
  # last). The same operands and products in another order, so every output equals the fused
  # solve's to the bit: K = V (two paired steps at 128), K < V and K > V (one paired step,
  # then U's or NY's block alone), the exact and bounded-span paths, packed rows, gates on chip.
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  q, k, _, v, _, G = _channel_inputs(23, dk=dk, dv=dv, tau=_TAU[case])
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  ks = jax.random.split(jax.random.key(24), 2)
  gated = {}
  if gates != "none":
    shape = lambda x: x.shape[:3] + ((1,) if gates == "row" else x.shape[3:])
    gated = dict(erase=jax.nn.sigmoid(jax.random.normal(ks[0], shape(k))),
                 write=jax.nn.sigmoid(jax.random.normal(ks[1], shape(v))))
  segments = gpu_chunks.kernel_segments(_packed_ids(), 64) if case == "packed" else None
  call = lambda solve: channel_intra.channel_intra_fwd(
      q, k, k, v, G, segments, chunk=64, with_inverse=True, solve=solve, q_scale=0.125,
      **gated)
  fused = call("fused")
  for solve in ("paired", "prefetched"):
    for name, a, b in zip(("ny", "qg", "p", "u", "kg", "gc", "m"), call(solve), fused):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      # (gc, the chunks' whole decay, is 0 under strong decay and where a segment begins)
      assert np.all(np.isfinite(a)) and (name == "gc" or np.abs(b).max() > 0), name
      np.testing.assert_array_equal(a, b, err_msg=f"{solve}: {name} ({dk}, {dv}, {case}, "
                                    f"{gates})")


def test_channel_kernel_phases_split_the_pair_matrix_exactly():
  # The timing knob `skip_phases` (bench_triton_parts --phase_costs) leaves out one phase: the
  # anchored products and the diagonal bands fill disjoint entries of P (the anchored operands
  # are exactly zero inside the 16 x 16 diagonal blocks), so leaving one out must leave the
  # other's entries as the whole kernel has them and zeros in its own. Also what makes the
  # phase timings mean anything.
  from pallas_kernels.gpu.triton import blocks, channel_intra  # pylint: disable=g-import-not-at-top
  q, k, kt, vt, _, G = _channel_inputs(5, dk=64, dv=64)
  p_of = lambda skip: np.asarray(channel_intra.channel_intra_fwd(
      q, k, kt, vt, G, chunk=64, skip_phases=skip, span=0.0)[2], np.float32)
  whole, no_bands, no_anchored = (p_of(0), p_of(blocks.PHASE_BANDS),
                                  p_of(blocks.PHASE_ANCHORED))
  rc = np.arange(64)
  diagonal = (rc[:, None] // 16) == (rc[None, :] // 16)
  assert np.abs(whole[..., diagonal]).max() > 0 and np.abs(whole[..., ~diagonal]).max() > 0
  np.testing.assert_array_equal(no_bands[..., diagonal], 0.0)
  np.testing.assert_array_equal(no_anchored[..., ~diagonal], 0.0)
  np.testing.assert_array_equal(no_bands[..., ~diagonal], whole[..., ~diagonal])
  np.testing.assert_array_equal(no_anchored[..., diagonal], whole[..., diagonal])
  with pytest.raises(ValueError, match="skip_phases"):
    channel_intra.channel_intra_fwd(q, k, kt, vt, G, chunk=64, skip_phases=8)


def _channel_forward(seed, case, dk, dv):
  """A case's inputs, segment ids and kernel segments, and the forward kernel's six outputs
  and bf16 M: what the backward kernels take."""
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  inputs = _channel_inputs(seed, dk=dk, dv=dv, tau=_TAU[case])
  segidx = _packed_ids() if case == "packed" else None
  segments = None if segidx is None else gpu_chunks.kernel_segments(segidx, 64)
  q, k, kt, vt, _, G = inputs
  *outs, m = channel_intra.channel_intra_fwd(q, k, kt, vt, G, segments, chunk=64,
                                             with_inverse=True)
  return inputs, segidx, segments, outs, m


@pytest.mark.parametrize("span", [0.0, 80.0])
@pytest.mark.parametrize("case,dk,dv", [("random", 64, 64), ("strong", 128, 128),
                                        ("packed", 64, 128)])
def test_channel_intra_backward_kernel_matches_exact_reference(case, dk, dv, span):
  # The kernel's half of the backward (pairs and solve) against its float32 oracle; the XLA half
  # (channel_grads) is checked on CPU (tests/test_triton_path.py).
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  (q, k, kt, vt, g, G), segidx, segments, outs, m = _channel_forward(4, case, dk, dv)
  ks = jax.random.split(jax.random.key(5), 3)
  d_ny, d_p, d_u = (jax.random.normal(key, outs[i].shape).astype(outs[i].dtype)
                    for key, i in zip(ks, (0, 2, 3)))
  got = channel_intra.channel_intra_bwd(q, k, kt, vt, G, segments, m, d_ny, d_p, d_u, chunk=64,
                                        span=span)
  want = gpu_prepare.channel_pair_solve_vjp_reference(q, k, kt, vt, g, segidx, d_ny, d_p, d_u,
                                                      c=64)
  for name, g_, w in zip(("dq", "dkt", "dk", "d_rk", "dvt"), got, want):
    assert_close(np.asarray(g_), np.asarray(w), GRAD_TOL, f"{name} ({case})")


@pytest.mark.parametrize("case,dk,dv", [("random", 64, 64), ("strong", 128, 128),
                                        ("packed", 64, 128)])
def test_fused_channel_grads_match_the_kernel_half_and_the_glue(case, dk, dv):
  # GpuTuning.channel_grads="kernel": the backward kernel with the elementwise rest and dG fused
  # in (channel_intra_grads) against the kernel half followed by XLA's glue
  # (gpu_prepare.channel_grads) on the same inputs: only float32 rounding differs (the Triton
  # interpreter measured 1e-8 to 4e-7 relative); and against the exact float32 oracle
  # composed with the glue, as the half is checked above.
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  (q, k, kt, vt, g, G), segidx, segments, outs, m = _channel_forward(6, case, dk, dv)
  cts = tuple(jax.random.normal(key, o.shape).astype(o.dtype)
              for key, o in zip(jax.random.split(jax.random.key(7), 6), outs))
  d_ny, d_qg, d_p, d_u, d_kg, d_gc = cts
  got = channel_intra.channel_intra_grads(q, k, kt, vt, G, segments, m, *cts, chunk=64)
  half = channel_intra.channel_intra_bwd(q, k, kt, vt, G, segments, m, d_ny, d_p, d_u, chunk=64)
  glue = gpu_prepare.channel_grads(q, k, kt, vt, g, segidx, half, cts, c=64)
  exact = gpu_prepare.channel_grads(q, k, kt, vt, g, segidx, gpu_prepare.
                                    channel_pair_solve_vjp_reference(
                                        q, k, kt, vt, g, segidx, d_ny, d_p, d_u, c=64), cts, c=64)
  for name, g_, w, e in zip(("dq", "dk", "dkt", "dvt", "dg"), got, glue, exact):
    assert g_.shape == w.shape
    assert_close(np.asarray(g_), np.asarray(w), 1e-5, f"{name} vs the glue ({case})")
    assert_close(np.asarray(g_), np.asarray(e), GRAD_TOL, f"{name} vs exact ({case})")
  # The solve loops' width (blocks.channel_bwd_solve_bk: 32 on Hopper, 16 elsewhere) changes
  # only how many columns a step takes: the same gradients to float32 rounding.
  for bk in (16, 32):
    other = channel_intra.channel_intra_grads(q, k, kt, vt, G, segments, m, *cts, chunk=64,
                                              solve_bk=bk)
    for name, a, b in zip(("dq", "dk", "dkt", "dvt", "dg"), other, got):
      assert_close(np.asarray(a), np.asarray(b), 1e-5, f"{name}, solve {bk} wide ({case})")


@pytest.mark.parametrize("dk,dtype", [(128, jnp.float32), (48, jnp.bfloat16)])
def test_chunk_gates_kernel_sums_each_chunk(dk, dtype):
  # The channel kernels' G (`channel_intra.chunk_gates`): log gates summed within each chunk of
  # 64 rows, restarting at every chunk, every batch row and head apart; against cumsum.
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  g = (jax.nn.log_sigmoid(jax.random.normal(jax.random.key(4), (2, 192, 3, dk))) * 5.0
       ).astype(dtype)
  got = channel_intra.chunk_gates(g, chunk=64)
  wide = g.astype(jnp.float32)
  want = jnp.cumsum(wide.reshape(2, 3, 64, 3, dk), axis=2).reshape(wide.shape)
  assert got.dtype == jnp.float32 and got.shape == g.shape
  assert_close(np.asarray(got), np.asarray(want), 1e-6, f"G at K={dk}")
  np.testing.assert_array_equal(np.asarray(got)[:, ::64], np.asarray(wide)[:, ::64])
  with pytest.raises(ValueError, match="multiple of chunk"):
    channel_intra.chunk_gates(g[:, :100], chunk=64)


def test_channel_kernels_read_bf16_inputs_as_their_float32_values():
  # q, k, k̃, ṽ reach the channel kernels in bf16 as the op has them (widened to float32 on
  # chip, not by a float32 copy in HBM): the same values given as float32 give the same
  # outputs and gradients, up to the order of float32 sums.
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  q, k, kt, vt, _, G = _channel_inputs(8, dk=64, dv=64)
  low = [x.astype(jnp.bfloat16) for x in (q, k, kt, vt)]
  wide = [x.astype(jnp.float32) for x in low]
  fwd = lambda xs: channel_intra.channel_intra_fwd(*xs, G, chunk=64, with_inverse=True)
  got, want = fwd(low), fwd(wide)
  for name, g_, w in zip(("ny", "qg", "p", "u", "kg", "gc", "m"), got, want):
    assert g_.dtype == w.dtype, name
    assert_close(np.asarray(g_, np.float32), np.asarray(w, np.float32), 1e-6, f"fwd {name}")
  cts = [jax.random.normal(key, o.shape).astype(o.dtype)
         for key, o in zip(jax.random.split(jax.random.key(9), 6), want[:6])]
  grads = lambda xs: channel_intra.channel_intra_grads(*xs, G, None, want[6], *cts, chunk=64)
  for name, g_, w in zip(("dq", "dk", "dkt", "dvt", "dg"), grads(low), grads(wide)):
    assert_close(np.asarray(g_), np.asarray(w), 1e-6, f"grads {name}")


@pytest.mark.parametrize("case,dk,dv", [("random", 64, 64), ("strong", 128, 128),
                                        ("packed", 64, 128)])
def test_channel_grads_from_states_match_the_kernel_fed_xla_products(case, dk, dv):
  # GpuTuning.channel_grads="states": the fused backward kernel makes the state pass's
  # cotangent products (dNY, dQG, dP, dKG, dgc) from E, dE, dO and the chunk states itself;
  # against the same kernel fed XLA's products (`gpu_vjps.state_pass_products`, rounded to the
  # forward's dtypes as the state pass's VJP delivers them): float32 rounding only.
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  (q, k, kt, vt, _, G), _, segments, outs, m = _channel_forward(9, case, dk, dv)
  ny, qg, p, u, kg, gc = outs
  s0 = jax.random.normal(jax.random.key(10), (q.shape[0], q.shape[2], dk, dv))
  o, e, s_final, h = tsp.state_passing_fwd(ny, qg, p, u, kg, gc, s0, save_states=True)
  ks = jax.random.split(jax.random.key(11), 3)
  do = jax.random.normal(ks[0], o.shape).astype(jnp.bfloat16)
  de, dh, _ = tsp.state_passing_bwd(ny, qg, p, kg, gc, do, jax.random.normal(ks[1], e.shape),
                                    jax.random.normal(ks[2], s_final.shape))
  d_ny, d_qg, d_p, d_kg, d_gc = gpu_vjps.state_pass_products(de, do, e, h, dh)
  cts = (d_ny.astype(ny.dtype), d_qg.astype(qg.dtype), d_p.astype(p.dtype), de,
         d_kg.astype(kg.dtype), d_gc)
  want = channel_intra.channel_intra_grads(q, k, kt, vt, G, segments, m, *cts, chunk=64)
  *got, d_erase, d_write = channel_intra.channel_intra_grads_from_states(
      q, k, kt, vt, G, segments, m, de, do, e, h, dh, chunk=64)
  assert d_erase is None and d_write is None
  for name, g_, w in zip(("dq", "dk", "dkt", "dvt", "dg"), got, want):
    assert g_.shape == w.shape and g_.dtype == w.dtype
    assert np.all(np.isfinite(np.asarray(g_))), name
    assert_close(np.asarray(g_), np.asarray(w), 1e-5, f"{name} ({case})")


def _gated_channel_inputs(seed, gates):
  """bf16 q, k, v (K 64, V 128), G, erase and write gates (one per row for "row", per channel
  for "channel"), and four more keys for the caller's own draws."""
  q, k, _, v, _, G = _channel_inputs(seed, dk=64, dv=128)
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  ks = jax.random.split(jax.random.key(seed + 1), 6)
  shape = lambda x: x.shape[:3] + ((1,) if gates == "row" else x.shape[3:])
  erase = jax.nn.sigmoid(jax.random.normal(ks[0], shape(k)))
  write = jax.nn.sigmoid(jax.random.normal(ks[1], shape(v)))
  return q, k, v, G, erase, write, ks


@pytest.mark.parametrize("gates", ["row", "channel"])
def test_channel_kernels_apply_erase_and_write_gates_on_chip(gates):
  # erase / write given to the kernels (k and v passed as kt, vt): the forward equals the
  # kernels on k̃ = k ⊙ erase, ṽ = v ⊙ write made outside, and the backward (made from the
  # states) equals the same kernel's k̃, ṽ gradients taken through the chain rule outside:
  # dk + dk̃ ⊙ erase, dk̃ ⊙ k (summed over channels for a row gate), dṽ ⊙ write, dṽ ⊙ v;
  # and q's scale on chip likewise (s q made outside; dq = s d(s q)). bf16 q, k, v, as the op
  # passes them.
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  q, k, v, G, erase, write, ks = _gated_channel_inputs(15, gates)
  kt, vt = k * erase, v * write                                   # float32
  s = 0.125
  qs = q.astype(jnp.float32) * s
  outside = channel_intra.channel_intra_fwd(qs, k, kt, vt, G, chunk=64, with_inverse=True)
  inside = channel_intra.channel_intra_fwd(q, k, k, v, G, chunk=64, with_inverse=True,
                                           erase=erase, write=write, q_scale=s)
  for name, a, b in zip(("ny", "qg", "p", "u", "kg", "gc", "m"), inside, outside):
    assert_close(np.asarray(a, np.float32), np.asarray(b, np.float32), 1e-6, f"fwd {name}")
  ny, qg, p, u, kg, gc, m = outside
  s0 = jax.random.normal(ks[2], (1, 2, 64, 128))
  o, e, s_final, h = tsp.state_passing_fwd(ny, qg, p, u, kg, gc, s0, save_states=True)
  do = jax.random.normal(ks[3], o.shape).astype(jnp.bfloat16)
  de, dh, _ = tsp.state_passing_bwd(ny, qg, p, kg, gc, do, jax.random.normal(ks[4], e.shape),
                                    jax.random.normal(ks[5], s_final.shape))
  states = (de, do, e, h, dh)
  dq, dk, dkt, dvt, dg, *_ = channel_intra.channel_intra_grads_from_states(
      qs, k, kt, vt, G, None, m, *states, chunk=64)
  sums = lambda x, like: jnp.sum(x, -1, keepdims=True) if like.shape[-1] == 1 else x
  want = (dq * s, dk + dkt * erase, dvt * write, dg, sums(dkt * k, erase), sums(dvt * v, write))
  got = channel_intra.channel_intra_grads_from_states(q, k, k, v, G, None, m, *states,
                                                      chunk=64, erase=erase, write=write,
                                                      q_scale=s)
  assert got[2] is None
  got = got[:2] + got[3:]
  for name, a, b in zip(("dq", "dk", "dv", "dg", "d_erase", "d_write"), got, want):
    assert np.all(np.isfinite(np.asarray(a))), name
    assert_close(np.asarray(a).reshape(b.shape), np.asarray(b), 1e-5, f"{name} ({gates})")


@pytest.mark.parametrize("implementation,gates,products", [
    ("triton", "kernel", "channel"), ("pallas_gpu", "kernel", "channel"),
    ("pallas_gpu", "xla", "channel"), ("pallas_gpu", "kernel", "kernel"),
    ("pallas_gpu", "kernel", "xla"), ("pallas_gpu", "xla", "kernel"),
    ("pallas_gpu", "kernel", "pass")])
@pytest.mark.parametrize("mixer", ["kda", "gdn2"])
def test_op_with_channel_grads_states_matches_scan(monkeypatch, mixer, implementation, gates,
                                                   products):
  # Every gradient of a loss on the output and the final state through the state pass and
  # channel kernels' one custom VJP (channel_grads="states"; bounded span, the default), the
  # erase / write gates applied on chip or by XLA (channel_gates), the state pass's products
  # made by the channel kernel, the products kernel, XLA or the Mosaic reverse pass
  # (state_products; K = V = 64 here, where the pass can), against the scan; the states path
  # is what ran, with the products asked for.
  if implementation == "pallas_gpu" and not (pallas_gpu.is_hopper() or triton_gpu.interpreted()):
    pytest.skip("pallas_gpu needs a Hopper GPU")
  calls, real = [], gpu_prepare._channel_kernel_states_call
  monkeypatch.setattr(gpu_prepare, "_channel_kernel_states_call",
                      lambda *a, **k: calls.append(k["products"]) or real(*a, **k))
  tuning = ops.GpuTuning(channel_grads="states", channel_gates=gates, triton_intra="kernel",
                         channel_intra="triton", state_products=products)
  args, kw = make_inputs(mixer, b=1, t=96, h=1, hv=2, dk=64, dv=64, seed=12)
  got = output_and_state_grads(mixer, args, kw["initial_state"], implementation, tuning=tuning)
  assert calls and set(calls) == {products}, calls
  want = output_and_state_grads(mixer, args, kw["initial_state"], "scan")
  for i, (g_, w) in enumerate(zip(got, want)):
    assert_close(g_, w, GRAD_TOL, f"{mixer} {implementation} states, {gates} gates, "
                                  f"{products} products, grad {i}")


@pytest.mark.parametrize("mixer,t", [("kda", 1), ("gdn2", 64), ("kda", 65)])
def test_op_with_channel_grads_states_at_the_edges_of_t(monkeypatch, mixer, t):
  # The states path under jit at T = 1, one chunk, one chunk plus a row (padding rows are
  # identity steps: zero k, v, gates): output, residual and every gradient against the scan.
  calls, real = [], gpu_prepare._channel_kernel_states_call
  monkeypatch.setattr(gpu_prepare, "_channel_kernel_states_call",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  tuning = ops.GpuTuning(channel_grads="states", triton_intra="kernel", channel_intra="triton",
                         state_products="kernel")
  args, kw = make_inputs(mixer, b=2, t=t, h=2, hv=2, dk=64, dv=64, seed=17 + t)
  fwd = lambda impl, tun: jax.jit(lambda *a: run(mixer, a, implementation=impl, tuning=tun,
                                                 return_residual=True))(*args)
  got, want = fwd("triton", tuning), fwd("scan", None)
  assert_close(got[0], want[0], FWD_TOL, f"{mixer} T={t} output")
  assert_close(got[-1], want[-1], FWD_TOL, f"{mixer} T={t} residual")
  grads = output_and_state_grads(mixer, args, kw["initial_state"], "triton", tuning=tuning)
  for i, (g_, w) in enumerate(zip(grads, output_and_state_grads(
      mixer, args, kw["initial_state"], "scan"))):
    assert_close(g_, w, GRAD_TOL, f"{mixer} T={t} states, grad {i}")
  assert calls, "the states path did not run"


@pytest.mark.parametrize("mixer,implementation,t,solve", [("kda", "pallas_gpu", 65, "kernel"),
                                                          ("gdn2", "pallas_gpu", 128, "kernel"),
                                                          ("kda", "triton", 1, "kernel"),
                                                          ("gdn2", "pallas_gpu", 65, "paired"),
                                                          ("kda", "triton", 128, "prefetched"),
                                                          ("gdn2", "triton", 64, "fused")])
def test_op_with_the_solve_kernel_matches_scan(monkeypatch, mixer, implementation, t, solve):
  # GpuTuning(channel_solve=...) (every choice) reaches the forward kernel's call on both GPU
  # paths, and the op's output, residual and every gradient still match the scan under jit.
  if implementation == "pallas_gpu" and not (pallas_gpu.is_hopper() or triton_gpu.interpreted()):
    pytest.skip("pallas_gpu needs a Hopper GPU")
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  solves, real = [], channel_intra.channel_intra_fwd
  monkeypatch.setattr(channel_intra, "channel_intra_fwd",
                      lambda *a, **k: solves.append(k.get("solve")) or real(*a, **k))
  tuning = ops.GpuTuning(triton_intra="kernel", channel_intra="triton", channel_solve=solve)
  args, kw = make_inputs(mixer, b=1, t=t, h=2, hv=2, dk=64, dv=64, seed=31 + t)
  fwd = lambda impl, tun: jax.jit(lambda *a: run(mixer, a, implementation=impl, tuning=tun,
                                                 return_residual=True))(*args)
  got, want = fwd(implementation, tuning), fwd("scan", None)
  assert solves and set(solves) == {solve}, solves
  assert_close(got[0], want[0], FWD_TOL, f"{mixer} T={t} output")
  assert_close(got[-1], want[-1], FWD_TOL, f"{mixer} T={t} residual")
  grads = output_and_state_grads(mixer, args, kw["initial_state"], implementation,
                                 tuning=tuning)
  for i, (g_, w) in enumerate(zip(grads, output_and_state_grads(
      mixer, args, kw["initial_state"], "scan"))):
    assert_close(g_, w, GRAD_TOL, f"{mixer} {implementation} T={t} solve {solve}, grad {i}")


@pytest.mark.parametrize("mixer", ["kda", "gdn2"])
def test_op_with_channel_grads_states_on_packed_rows(monkeypatch, mixer):
  # Two segments in a row of 150 (a boundary inside the second chunk), through the states
  # path with the gates on chip: output, final state and every gradient against the scan.
  calls, real = [], gpu_prepare._channel_kernel_states_call
  monkeypatch.setattr(gpu_prepare, "_channel_kernel_states_call",
                      lambda *a, **k: calls.append(a[6] is not None) or real(*a, **k))
  tuning = ops.GpuTuning(channel_grads="states", triton_intra="kernel", channel_intra="triton",
                         state_products="channel")
  args, kw = make_inputs(mixer, b=1, t=150, h=1, hv=2, dk=64, dv=64, seed=19)
  s0 = kw["initial_state"]
  seg = jnp.asarray(np.repeat([[1, 2]], [90, 60]))[None]
  w_o = jax.random.normal(jax.random.key(5), args[2].shape)
  w_s = jax.random.normal(jax.random.key(6), s0.shape)

  def loss(impl, tun):
    def f(*a):
      o, s = run(mixer, a[:-1], initial_state=a[-1], output_final_state=True, segment_ids=seg,
                 implementation=impl, tuning=tun)
      return jnp.sum(o * w_o) + jnp.sum(s * w_s), (o, s)
    return jax.jit(jax.value_and_grad(f, argnums=tuple(range(len(args) + 1)), has_aux=True))(
        *args, s0)

  (_, (o, s)), got = loss("triton", tuning)
  (_, (want_o, want_s)), want = loss("scan", None)
  assert_close(o, want_o, FWD_TOL, f"{mixer} o")
  assert_close(s, want_s, FWD_TOL, f"{mixer} final state")
  for i, (g_, w) in enumerate(zip(got, want)):
    assert_close(g_, w, GRAD_TOL, f"{mixer} packed states, grad {i}")
  assert calls == [True], calls   # the states path ran, with the segments


@pytest.mark.parametrize("implementation", ["triton", "pallas_gpu"])
@pytest.mark.parametrize("mixer", ["kda", "gdn2"])
def test_op_gradients_with_fused_channel_grads_match_scan(mixer, implementation):
  # The op's every gradient with the fused backward on both GPU paths, against the scan, on the
  # exact diagonal blocks (channel_span=0; the default bounded-span path is tested below).
  if implementation == "pallas_gpu" and not (pallas_gpu.is_hopper() or triton_gpu.interpreted()):
    pytest.skip("pallas_gpu needs a Hopper GPU")
  tuning = ops.GpuTuning(channel_grads="kernel", triton_intra="kernel", channel_intra="triton",
                         channel_span=0.0)
  args, kw = make_inputs(mixer, b=1, t=96, h=1, hv=2, dk=64, dv=64, seed=3)
  got = output_and_state_grads(mixer, args, kw["initial_state"], implementation, tuning=tuning)
  want = output_and_state_grads(mixer, args, kw["initial_state"], "scan")
  for i, (g_, w) in enumerate(zip(got, want)):
    assert_close(g_, w, GRAD_TOL, f"{mixer} {implementation} fused grads, grad {i}")


@pytest.mark.parametrize("mixer", ["kda", "gdn2"])
def test_op_gradients_with_the_bounded_span_path_match_scan(mixer):
  # GpuTuning(channel_span=80, the default): the channel kernels take their diagonal blocks on
  # the tensor cores where the sub-chunks decay by at most 80 nats (here: all of them).
  tuning = ops.GpuTuning(channel_grads="kernel", triton_intra="kernel", channel_intra="triton",
                         channel_span=80.0)
  args, kw = make_inputs(mixer, b=1, t=96, h=1, hv=2, dk=64, dv=64, seed=8)
  got = output_and_state_grads(mixer, args, kw["initial_state"], "triton", tuning=tuning)
  want = output_and_state_grads(mixer, args, kw["initial_state"], "scan")
  for i, (g_, w) in enumerate(zip(got, want)):
    assert_close(g_, w, GRAD_TOL, f"{mixer} bounded-span grads, grad {i}")


@pytest.mark.parametrize("mixer", ["gated_delta_rule", "kda"])
def test_ffi_call_target_lowers_to_the_typed_ffi_handler_and_matches_scan(monkeypatch, request,
                                                                          mixer):
  # blocks.CALL_TARGET="ffi": every Triton kernel of the op lowers to jaxlib's typed-FFI
  # "triton_kernel_call_ffi" (which XLA's command buffers take) instead of jax-triton's legacy
  # call, and the op still matches the scan, forward and every gradient, with segments.
  from pallas_kernels.gpu.triton import blocks, ffi_call
  if triton_gpu.interpreted():
    pytest.skip("the interpreter runs kernels by host callback: there is no custom call")
  if not ffi_call.ffi_target_available():
    pytest.skip("this jaxlib has no typed-FFI Triton handler")
  monkeypatch.setattr(blocks, "CALL_TARGET", "ffi")
  # The jitted kernel wrappers (`channel_intra_fwd`, ...) read CALL_TARGET when traced and keep
  # their traces: one made by an earlier test of the same worker still held the legacy call
  # (KDA failed here so on the H200, 2026-12-05). So no trace of before or after this test is
  # reused across the switch.
  jax.clear_caches()
  request.addfinalizer(jax.clear_caches)
  args, kw = make_inputs(mixer, b=1, t=150, h=1, hv=2, dk=64, dv=64, seed=6)
  s0 = kw["initial_state"]
  seg = jnp.asarray(np.repeat([[1, 2]], [90, 60]))[None]
  fwd = lambda *a: run(mixer, a[:-1], initial_state=a[-1], output_final_state=True,
                       segment_ids=seg, implementation="triton")
  hlo = jax.jit(fwd).lower(*args, s0).as_text()
  assert "triton_kernel_call_ffi" in hlo and '@triton_kernel_call"' not in hlo
  assert "@triton_kernel_call(" not in hlo
  want_o, want_s = run(mixer, args, initial_state=s0, output_final_state=True,
                       segment_ids=seg, implementation="scan")
  o, s = jax.jit(fwd)(*args, s0)
  assert_close(o, want_o, FWD_TOL, f"{mixer} o")
  assert_close(s, want_s, FWD_TOL, f"{mixer} final state")
  got = output_and_state_grads(mixer, args, s0, "triton")
  want = output_and_state_grads(mixer, args, s0, "scan")
  for i, (g_, w) in enumerate(zip(got, want)):
    assert_close(g_, w, GRAD_TOL, f"{mixer} grad {i} (ffi call target)")


_FUSED_CASES = [("triton", "gated_delta_rule"), ("triton", "delta_rule"),
                ("pallas_gpu", "gated_delta_rule"), ("pallas_gpu", "delta_rule")]


@pytest.mark.parametrize("hv", [1, 2])   # H = HV: the per-chunk backward kernel; GVA: XLA's
@pytest.mark.parametrize("implementation,mixer", _FUSED_CASES)
def test_fused_path_matches_scan_forward_and_in_every_gradient(monkeypatch, implementation,
                                                               mixer, hv):
  # GpuTuning(forward="fused"): the call runs the fused kernels (T0, the walk; under jax.grad
  # also the reverse walk and the split's intra-chunk backward), never the split's state pass;
  # with GVA, packed segments, a tail, an initial and a final state and the write residual it
  # matches the scan, forward and in every gradient.
  from pallas_kernels.gpu.triton import fused_forward as ff
  if implementation == "pallas_gpu" and not (pallas_gpu.is_hopper() or triton_gpu.interpreted()):
    pytest.skip("pallas_gpu needs a Hopper GPU")
  calls = {"fused": 0, "split": 0}
  fused_fn = ff.fused_forward
  monkeypatch.setattr(ff, "fused_forward", lambda *a, **k: (
      calls.__setitem__("fused", calls["fused"] + 1), fused_fn(*a, **k))[1])
  for module in (tsp, sp):
    fn = module.state_passing_fwd
    monkeypatch.setattr(module, "state_passing_fwd", lambda *a, _fn=fn, **k: (
        calls.__setitem__("split", calls["split"] + 1), _fn(*a, **k))[1])
  tuning = ops.GpuTuning(forward="fused")
  args, kw = make_inputs(mixer, b=2, t=150, h=1, hv=hv, dk=64, dv=64, seed=7)
  s0 = kw["initial_state"]
  seg = jnp.asarray(np.stack([np.repeat([1, 2, 3], [40, 70, 40]), np.repeat([4, 5], [110, 40])]))
  want = run(mixer, args, initial_state=s0, output_final_state=True, segment_ids=seg,
             return_residual=True, implementation="scan")
  got = jax.jit(lambda *a: run(mixer, a[:-1], initial_state=a[-1], output_final_state=True,
                               segment_ids=seg, return_residual=True,
                               implementation=implementation, tuning=tuning))(*args, s0)
  assert calls == {"fused": 1, "split": 0}, calls
  for name, g_, w in zip(("o", "final state", "residual"), got, want):
    assert_close(g_, w, FWD_TOL, f"{implementation} {mixer} {name}")
  grads = output_and_state_grads(mixer, args, s0, implementation, tuning=tuning)
  assert calls["split"] == 0 and calls["fused"] >= 2, calls
  for i, (g_, w) in enumerate(zip(grads, output_and_state_grads(mixer, args, s0, "scan"))):
    assert_close(g_, w, GRAD_TOL, f"{implementation} {mixer} grad {i} (forward='fused')")


@pytest.mark.parametrize("t", [1, 63, 64, 65, 128])
def test_fused_forward_at_the_edges_of_t(t):
  args, _ = make_inputs("gated_delta_rule", b=2, t=t, h=2, dk=64, dv=64, seed=8,
                        with_state=False)
  want = run("gated_delta_rule", args, implementation="scan")[0]
  tuning = ops.GpuTuning(forward="fused")
  got = jax.jit(lambda *a: run("gated_delta_rule", a, implementation="triton",
                               tuning=tuning)[0])(*args)
  assert_close(got, want, FWD_TOL, f"fused forward T={t}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fused_forward_at_k_128_with_minus_1e4_gates(dtype):
  # The head dims of the benchmark (K = V = 128: BLOCK_V 64, two V-tiles), a full reset by
  # −1e4 log gates inside the first chunk, bf16 and float32 inputs: finite, and the scan's.
  args, kw = make_inputs("gated_delta_rule", b=1, t=200, h=2, dk=128, dv=128, seed=9)
  args = [a.astype(dtype) for a in args[:3]] + list(args[3:])
  g = np.array(args[3])
  g[:, 40:50] = -1e4
  args[3] = jnp.asarray(g)
  tuning = ops.GpuTuning(forward="fused")
  got = run("gated_delta_rule", args, **kw, implementation="triton", output_final_state=True,
            tuning=tuning)
  want = run("gated_delta_rule", args, **kw, implementation="scan", output_final_state=True)
  assert got[0].dtype == dtype
  for name, x, w in zip(("o", "final_state"), got, want):
    assert np.isfinite(np.asarray(x, np.float32)).all(), f"{name} not finite"
    assert_close(x.astype(jnp.float32), w.astype(jnp.float32), FWD_TOL, f"{name}, {dtype}")
  if dtype == jnp.float32:   # and the gradients through the fused reverse walk
    grads = output_and_state_grads("gated_delta_rule", tuple(args), kw["initial_state"],
                                   "triton", tuning=tuning)
    want = output_and_state_grads("gated_delta_rule", tuple(args), kw["initial_state"], "scan")
    for i, (g_, w) in enumerate(zip(grads, want)):
      assert np.isfinite(np.asarray(g_)).all(), f"grad {i} not finite"
      assert_close(g_, w, GRAD_TOL, f"grad {i} with −1e4 gates")


def test_fused_path_gradients_through_the_write_residual():
  # CLER routes the write residual r (= E): its cotangent enters the fused reverse walk as dE_ext.
  args, kw = make_inputs("gated_delta_rule", b=1, t=130, h=1, hv=2, dk=64, dv=64, seed=10)
  w_o = jax.random.normal(jax.random.key(1), args[2].shape)
  w_r = jax.random.normal(jax.random.key(2), args[2].shape)

  def loss(implementation, tuning=None):
    def f(*a):
      o, _, r = run("gated_delta_rule", a, initial_state=kw["initial_state"],
                    return_residual=True, implementation=implementation, tuning=tuning)
      return jnp.sum(o * w_o) + jnp.sum(r * w_r)
    return jax.jit(jax.grad(f, argnums=tuple(range(len(args)))))(*args)

  got = loss("triton", ops.GpuTuning(forward="fused"))
  want = loss("scan")
  for i, (g_, w) in enumerate(zip(got, want)):
    assert_close(g_, w, GRAD_TOL, f"grad {i} through o and the residual")


@pytest.mark.parametrize("scores,launch", [("stored", None), ("stored", (16, 4, 1)),
                                           ("walk", (16, 4, 1))])
def test_fused_walk_knobs_match_scan(monkeypatch, scores, launch):
  # The fused walks' timing knobs change where the scores are made and how the value columns
  # are tiled, never the result: with GVA (the T0 kernel's scores per value head), packed
  # segments and a tail, forward and every gradient against the scan.
  from pallas_kernels.gpu.triton import blocks
  monkeypatch.setattr(blocks, "FUSED_SCORES", scores)
  monkeypatch.setattr(blocks, "FUSED_WALK_LAUNCH", launch)
  args, kw = make_inputs("gated_delta_rule", b=1, t=150, h=1, hv=2, dk=64, dv=64, seed=11)
  seg = jnp.asarray(np.repeat([1, 2], [90, 60]))[None]
  tuning = ops.GpuTuning(forward="fused")
  got = jax.jit(lambda *a: run("gated_delta_rule", a, **kw, segment_ids=seg,
                               implementation="triton", tuning=tuning)[0])(*args)
  want = run("gated_delta_rule", args, **kw, segment_ids=seg, implementation="scan")[0]
  assert_close(got, want, FWD_TOL, f"o ({scores}, {launch})")
  grads = output_and_state_grads("gated_delta_rule", args, kw["initial_state"], "triton",
                                 tuning=tuning)
  want = output_and_state_grads("gated_delta_rule", args, kw["initial_state"], "scan")
  for i, (g_, w) in enumerate(zip(grads, want)):
    assert_close(g_, w, GRAD_TOL, f"grad {i} ({scores}, {launch})")


def test_fused_walk_knobs_are_checked():
  from pallas_kernels.gpu.triton import fused_forward as ff
  args, _ = make_inputs("gated_delta_rule", b=1, t=64, h=1, dk=64, dv=64, seed=12,
                        with_state=False)
  q, k, v = args[:3]
  beta = jnp.ones((1, 1, 64), jnp.float32)
  s0 = jnp.zeros((1, 1, 64, 64), jnp.float32)
  with pytest.raises(ValueError, match="scores='cached'"):
    ff.fused_forward(q, k, v, beta, None, s0, scale=1.0, gated=False, scores="cached")
  with pytest.raises(ValueError, match="launch=.*BLOCK_V"):
    ff.fused_forward(q, k, v, beta, None, s0, scale=1.0, gated=False, launch=(48, 4, 1))


# The T0 kernel's launches (`blocks.t0_launch`, timed by experiments/bench_t0.py) change how
# k kᵀ is sliced and how the inverse is built, never what it is: T0 against the float32
# inverse of the same bf16 keys. 5e-3: T0 is stored in bf16 (its rounding alone is ~2e-3 rms
# of an entry) and tf32 products build it (~1e-3, intra_chunk's docstring); measured 5e-4.
@pytest.mark.parametrize("dk,launch", [
    (dk, launch) for dk in (64, 128)
    for launch in (None, (4, 16, "batched"), (8, 64, "tiles"), (2, 64, "batched"),
                   (4, 128, "batched"), (4, 64, "batched_short"), (4, 64, "batched_bf16"))
    if launch is None or dk % launch[1] == 0])
def test_gate_free_inverse_at_every_launch_matches_the_exact_inverse(dk, launch):
  from experiments import bench_t0
  from pallas_kernels.gpu.triton import fused_forward as ff
  k, beta = bench_t0.inputs(2, 128, 2, dk, seed=3)
  got = jax.jit(lambda k_, b_: ff.gate_free_inverse(k_, b_, hv=2, launch=launch))(k, beta)
  want = bench_t0.exact_inverse(k, beta)
  assert got.shape == want.shape and got.dtype == BF
  assert bench_t0.rel_rms(got.astype(jnp.float32), want) < 5e-3, launch
  with pytest.raises(ValueError, match="T0 launch"):
    ff.gate_free_inverse(k, beta, hv=2, launch=(4, 48, "batched"))


# The kernel-level check of `intra_chunk_bwd_from_states` the op-level tests lacked. Compiled on
# the H200 (2026-12-03) its dk was wrong at K = V = 128 with the products' V loop in two steps
# of 64, at either slice-stage count, and right in one step of 128 (`blocks.from_states_vs`, now
# the default); the interpreter gets all right. The two-step cases stay as strict xfails on the
# GPU: they start passing (and so failing here) when triton compiles them right.
_MISCOMPILED = pytest.mark.xfail(
    condition=not triton_gpu.interpreted(), strict=True,
    reason="triton 3.6 on the H200: the two-step V loop gives a wrong dk at K = V = 128")


@pytest.mark.parametrize("d,slice_stages,vs", [
    (64, 2, 64), pytest.param(128, 2, 64, marks=_MISCOMPILED),
    pytest.param(128, 1, 64, marks=_MISCOMPILED), (128, 2, 128), (128, 1, 128),
    (128, 2, None)])
def test_from_states_backward_matches_the_glue(d, slice_stages, vs):
  # The in-kernel state-pass products (dNY = dE hᵀ, dQG = dO hᵀ, dP = dO Eᵀ, dKG = E dhᵀ)
  # against XLA's products fed to the fused backward kernel (itself checked against autodiff of
  # the exact reference above): every result.
  b, t, h, c = 1, 128, 2, 64
  nc = t // c
  rng = np.random.default_rng(13)
  rnd = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, k = (x / jnp.linalg.norm(x, axis=-1, keepdims=True) for x in (rnd(b, t, h, d),
                                                                   rnd(b, t, h, d)))
  v = rnd(b, t, h, d)
  beta = jax.nn.sigmoid(rnd(b, h, t))
  g = jnp.cumsum(jax.nn.log_sigmoid(rnd(b, h, nc, c)), axis=-1).reshape(b, h, t)
  m = jnp.tril(0.1 * rnd(b, h, nc, c, c), -1) + jnp.eye(c)
  m = m.astype(BF)
  de = rnd(b, h, nc, c, d)
  hs, dh = rnd(b, h, nc, d, d).astype(BF), rnd(b, h, nc, d, d).astype(BF)
  e, do = rnd(b, t, h, d), rnd(b, t, h, d).astype(BF)
  scale = d ** -0.5
  got = tic.intra_chunk_bwd_from_states(q, k, v, beta, g, None, m, de, hs, dh, e, do,
                                        scale=scale, slice_stages=slice_stages, vs=vs)
  d_ny, d_qg, d_p, d_kg, _ = gpu_vjps.state_pass_products(
      de, gpu_chunks.to_chunks(do, c), gpu_chunks.to_chunks(e, c), hs, dh)
  want = tic.intra_chunk_bwd(q, k, v, beta, g, None, None, m, d_ny, d_p, de,
                             cotangents=(d_qg, d_kg), scale=scale)
  for name, x, w in zip(("dq", "dk", "dv", "dbeta", "dG"), got, want):
    assert_close(x, w, 1e-2, f"{name} (d={d}, slice_stages={slice_stages}, vs={vs})")


@pytest.mark.parametrize("mixer,t,pieces,packed", [("kda", 300, 2, False), ("gdn2", 256, 4, False),
                                                   ("kda", 300, 2, True)])
def test_pallas_gpu_default_runs_the_states_path_in_pieces(monkeypatch, mixer, t, pieces, packed):
  # The default tuning on pallas_gpu (channel_grads "auto" = "states", 2026-12-06) with rows
  # cut into pieces (T padded to a multiple of 64·pieces with identity steps; the maps' pass
  # and the carried cotangents of gpu_vjps.pass_forward / pass_backward): output, final state
  # and every gradient against the scan, with weak decays so the carried states matter; packed:
  # two documents, the second starting inside the first piece's last chunk.
  if not (pallas_gpu.is_hopper() or triton_gpu.interpreted()):
    pytest.skip("pallas_gpu needs a Hopper GPU")
  seen, real = [], gpu_prepare.channel_state_core
  monkeypatch.setattr(gpu_prepare, "channel_state_core",
                      lambda *a, **k: seen.append(k["pieces"]) or real(*a, **k))
  monkeypatch.setattr(pallas_gpu, "channel_state_core", gpu_prepare.channel_state_core)
  args, kw = make_inputs(mixer, b=1, t=t, h=1, hv=2, dk=64, dv=64, seed=23)
  args = args[:3] + (args[3] / 64.0,) + args[4:]   # g: weak decays
  tuning = ops.GpuTuning(row_pieces=pieces)   # every other field the default
  if packed:
    kw["segment_ids"] = jnp.asarray(np.repeat([[1, 2]], [100, t - 100]))[None]
  grads = lambda impl, tun: output_and_state_grads(mixer, args, kw["initial_state"], impl,
                                                   tuning=tun,
                                                   segment_ids=kw.get("segment_ids"))
  got = grads("pallas_gpu", tuning)
  assert seen and set(seen) == {pieces}, seen
  want = grads("scan", None)
  for i, (g_, w) in enumerate(zip(got, want)):
    assert_close(g_, w, GRAD_TOL, f"{mixer} default tuning, {pieces} pieces, grad {i}")
  fwd = lambda impl, tun: jax.jit(lambda *a: run(mixer, a, implementation=impl, tuning=tun,
                                                 output_final_state=True, **kw))(*args)
  (o, s), (want_o, want_s) = fwd("pallas_gpu", tuning), fwd("scan", None)
  assert_close(o, want_o, FWD_TOL, f"{mixer} o")
  assert_close(s, want_s, FWD_TOL, f"{mixer} final state")


def _states_path_case(seed, gates, out_dtype=jnp.float32):
  """The states path's tensors up to its reverse pass, made by the kernels: the channel
  forward (gates on chip, q's scale 0.125), the Triton state pass (o, e in out_dtype, chunk
  states saved), a bf16 dO and a final-state cotangent."""
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  q, k, v, G, erase, write, ks = _gated_channel_inputs(seed, gates)
  ny, qg, p, u, kg, gc, m = channel_intra.channel_intra_fwd(
      q, k, k, v, G, chunk=64, with_inverse=True, erase=erase, write=write, q_scale=0.125)
  s0 = jax.random.normal(ks[2], (1, 2, 64, 128))
  o, e, s_final, h = tsp.state_passing_fwd(ny, qg, p, u, kg, gc, s0, save_states=True,
                                           out_dtype=out_dtype)
  return dict(q=q, k=k, v=v, G=G, erase=erase, write=write, m=m, ny=ny, qg=qg, p=p, kg=kg,
              gc=gc, e=e, h=h, do=jax.random.normal(ks[3], o.shape).astype(jnp.bfloat16),
              ds_final=jax.random.normal(ks[5], s_final.shape))


def _channel_backward_entries(x, de, dh, products):
  """Both channel backward entries on a `_states_path_case`, keyword arguments left open:
  "gated" fed the state pass's products (dNY, dQG, dP, dKG, dgc), "from_states" making them."""
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  d_ny, d_qg, d_p, d_kg, d_gc = products
  head = (x["q"], x["k"], x["k"], x["v"], x["G"], None, x["m"])
  gates = dict(chunk=64, erase=x["erase"], write=x["write"], q_scale=0.125)
  return {
      "gated": lambda **kw: channel_intra.channel_intra_grads_gated(
          *head, d_ny, d_qg, d_p, de, d_kg, d_gc, **gates, **kw),
      "from_states": lambda **kw: channel_intra.channel_intra_grads_from_states(
          *head, de, x["do"], x["e"], x["h"], dh, **gates, **kw)}


@pytest.mark.parametrize("gates", ["row", "channel"])
def test_backward_writes_whole_gradients_in_bf16_rounded_once(gates):
  # grad_dtypes (the states path asks for the bf16 inputs' dtype): dq, and with the gates on
  # chip dk and dv, stored in bf16 by the backward kernel must equal the same kernel's float32
  # gradients rounded to bf16, to the bit (one rounding of the same accumulators); dg and the
  # gates' gradients stay float32 and unchanged. Both backward entries (products given, and
  # made from the states).
  x = _states_path_case(25, gates)
  head = (x["ny"], x["qg"], x["p"], x["kg"], x["gc"], x["do"], None, x["ds_final"])
  de, dh, _ = tsp.state_passing_bwd(*head)
  products = gpu_vjps.state_pass_products(de, x["do"], x["e"], x["h"], dh)
  calls = _channel_backward_entries(x, de, dh, products)
  for entry, call in calls.items():
    wide = call()
    narrow = call(grad_dtypes=("bfloat16",) * 3)
    for name, i in (("dq", 0), ("dk", 1), ("dv", 3)):
      assert wide[i].dtype == jnp.float32 and narrow[i].dtype == jnp.bfloat16, (entry, name)
      np.testing.assert_array_equal(np.asarray(narrow[i].astype(jnp.float32)),
                                    np.asarray(wide[i].astype(jnp.bfloat16).astype(jnp.float32)),
                                    err_msg=f"{entry} {name}")
    for name, i in (("dg", 4), ("d_erase", 5), ("d_write", 6)):
      assert narrow[i].dtype == jnp.float32
      np.testing.assert_array_equal(np.asarray(narrow[i]), np.asarray(wide[i]),
                                    err_msg=f"{entry} {name}")
  with pytest.raises(ValueError, match="grad_dtypes"):
    calls["gated"](grad_dtypes=("float16",) * 3)


@pytest.mark.parametrize("gates", ["row", "channel"])
def test_bf16_de_changes_no_gradient_of_the_states_path(gates):
  # The states path's reverse pass writes dE in bf16 (`state_passing_bwd(de_dtype=)`): the
  # Triton pass's bf16 de must be its float32 de rounded once, to the bit, dh and ds0
  # unchanged; and every reader of dE (the products kernel, XLA's products, both channel
  # backward entries) must give the same results to the bit from either, since each reads dE
  # as a bf16 operand.
  x = _states_path_case(31, gates, out_dtype=jnp.bfloat16)
  do, e, h = x["do"], x["e"], x["h"]
  head = (x["ny"], x["qg"], x["p"], x["kg"], x["gc"], do, None, x["ds_final"])
  wide = tsp.state_passing_bwd(*head)
  narrow = tsp.state_passing_bwd(*head, de_dtype=jnp.bfloat16)
  assert wide[0].dtype == jnp.float32 and narrow[0].dtype == jnp.bfloat16
  same = lambda a, b, name: np.testing.assert_array_equal(
      np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)), err_msg=name)
  same(narrow[0], wide[0].astype(jnp.bfloat16), "de")
  same(narrow[1], wide[1], "dh")
  same(narrow[2], wide[2], "ds0")
  de32, de16, dh = wide[0], narrow[0], wide[1]
  for make in (gpu_vjps.products_kernel, gpu_vjps.state_pass_products):
    for i, (a, b) in enumerate(zip(make(de16, do, e, h, dh), make(de32, do, e, h, dh))):
      same(a, b, f"{make.__name__} output {i}")
  products = gpu_vjps.products_kernel(de32, do, e, h, dh)
  calls = {de.dtype: _channel_backward_entries(x, de, dh, products) for de in (de16, de32)}
  for entry in ("gated", "from_states"):
    narrow_grads, wide_grads = (calls[dt][entry](grad_dtypes=("bfloat16",) * 3)
                                for dt in (de16.dtype, de32.dtype))
    for i, (a, b) in enumerate(zip(narrow_grads, wide_grads)):
      if a is not None:
        same(a, b, f"{entry} output {i}")
  with pytest.raises(ValueError, match="de_dtype"):
    tsp.state_passing_bwd(*head, de_dtype=jnp.float16)


def test_channel_products_read_do_in_the_ops_layout():
  # The states path hands the channel kernel dO as the op has it, [B, T, HV, V] (do_rows): its
  # prologue must read the same rows as from the chunk-major copy, so every gradient is the
  # same to the bit; and the products it makes (the one code the products kernel runs too,
  # `state_pass.chunk_products`, at other slice widths and warps) give the gradients the
  # kernel fed the products kernel's outputs gives (to the bit in the interpreter; compiled,
  # the two launches may sum a product's terms in another order: 1e-3). A dO of the other
  # layout is refused by name.
  x = _states_path_case(37, "channel", out_dtype=jnp.bfloat16)
  head = (x["ny"], x["qg"], x["p"], x["kg"], x["gc"], x["do"], None, x["ds_final"])
  de, dh, _ = tsp.state_passing_bwd(*head, de_dtype=jnp.bfloat16)
  calls = _channel_backward_entries(x, de, dh, gpu_vjps.products_kernel(de, x["do"], x["e"],
                                                                        x["h"], dh))
  chunk_major = calls["from_states"](grad_dtypes=("bfloat16",) * 3)
  x_rows = dict(x, do=gpu_chunks.from_chunks(x["do"]))
  rows = _channel_backward_entries(x_rows, de, dh, (None,) * 5)["from_states"](
      grad_dtypes=("bfloat16",) * 3, do_rows=True)
  fed = calls["gated"](grad_dtypes=("bfloat16",) * 3)
  for i, (a, b, c) in enumerate(zip(rows, chunk_major, fed)):
    if a is None:
      assert b is None and c is None
      continue
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                  np.asarray(b.astype(jnp.float32)), err_msg=f"rows, output {i}")
    assert_close(np.asarray(b.astype(jnp.float32)), np.asarray(c.astype(jnp.float32)), 1e-3,
                 f"fed, output {i}")
  with pytest.raises(ValueError, match="do_rows"):
    calls["from_states"](do_rows=True)


@pytest.mark.parametrize("mixer", ["kda", "gdn2"])
def test_states_path_takes_bf16_de_and_its_gradients_match_float32_de(monkeypatch, mixer):
  # Through the op (channel_grads="states", the Mosaic pass on Hopper or in the interpreter):
  # the reverse pass is asked for a bf16 dE, and the gradients equal those of the same program
  # with the float32 dE it wrote before, to the bit.
  if not (pallas_gpu.is_hopper() or triton_gpu.interpreted()):
    pytest.skip("pallas_gpu needs a Hopper GPU")
  asked, real = [], gpu_vjps.pass_backward
  tuning = ops.GpuTuning(channel_grads="states", channel_intra="triton", row_pieces=1)
  args, kw = make_inputs(mixer, b=1, t=96, h=1, hv=2, dk=64, dv=64, seed=14)
  args = tuple(x.astype(jnp.bfloat16) for x in args[:3]) + args[3:]

  def grads(de_dtype):
    def patched(*a, **k):
      asked.append(jnp.dtype(k["de_dtype"]))
      return real(*a, **{**k, "de_dtype": de_dtype or k["de_dtype"]})
    monkeypatch.setattr(gpu_vjps, "pass_backward", patched)
    return output_and_state_grads(mixer, args, kw["initial_state"], "pallas_gpu", tuning=tuning)

  narrow = grads(None)
  assert asked == [jnp.dtype(jnp.bfloat16)], asked
  wide = grads(jnp.float32)
  for i, (a, b) in enumerate(zip(narrow, wide)):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                  np.asarray(b.astype(jnp.float32)), err_msg=f"grad {i}")
