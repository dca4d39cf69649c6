"""The Mosaic GPU intra-chunk kernel (`pallas_kernels.gpu.intra_chunk`) and `pallas_gpu` with it.

Runs in JAX's Mosaic GPU interpreter on CPU (`make test`) and compiled on a Hopper GPU.

Oracles:
* the kernel's five outputs vs `intra_chunk_reference` (float32 HIGHEST products and an exact
  `triangular_solve`), on random unit keys with decay and on strongly correlated keys with
  β near 1 and no decay (the worst conditioned solve), with GVA (two value heads per key head).
  The outputs are bf16 (P, QG, KG, NY) or come from a bf16 application of the inverse (U), as in
  the XLA path: rel 5e-3, NY 2e-2 on the correlated keys (measured 2e-3 and 1e-2; the XLA path's
  own error on the same inputs is 9e-3). Also with packed rows (three segments, one boundary
  inside a chunk and one on a chunk boundary).
* the forward's optional M output (the backward's input) is unit lower triangular and inverts
  I + L (L built in float64 from the inputs) to 1e-2 (bf16-rounded M), random and correlated
  keys, and asking for it changes no other output;
* the backward kernel (with the XLA glue of `gpu_vjps.intra_kernel`: QG/KG terms, Gx's chain
  rule, GVA's sum) vs autodiff of that exact reference, for random cotangents: every input's
  gradient to rel 5e-3 (bf16 matmul operands; measured dq 9e-4), random and packed inputs.
* `implementation="pallas_gpu"` with `GpuTuning(intra="kernel")` vs the `scan` reference: GDN and
  DeltaNet forward with an initial state and T not a multiple of the chunk (rel 2e-2), GDN
  gradients of every input (rel 3e-2).
* With segment ids and padding (id 0) the op with the kernel vs the `scan` reference, forward
  and gradients (the same tolerances).
* Both kernels (and the state pass, the reference point: it compiles and runs on the H200) lower
  to Mosaic GPU for CUDA on this CPU, at K, V in {64, 128}, with and without segments: Mosaic
  GPU's layout inference runs at lowering, so the interpreter-only constructs it rejects fail
  here, in CI, rather than on the GPU. Their shared memory (Pallas's estimate, what the launch
  requests) fits a Hopper CTA (227 KiB), and the forward fits twice per SM (113 KiB).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (assert_close, make_inputs, mosaic_gpu_or_skip, output_and_state_grads,
                     record_smem_estimates, run, run_jit)

ON_GPU, INTERPRET = mosaic_gpu_or_skip()

import kernel_cases  # noqa: E402
from lineax_attn.ops import gpu_vjps, pallas_gpu  # noqa: E402
from pallas_kernels.gpu import intra_chunk as ic  # noqa: E402
NAMES = ("ny", "qg", "p", "u", "kg")


_kernel_inputs = kernel_cases.intra_inputs
_packed = kernel_cases.packed_segments


@pytest.mark.parametrize("case", ["random", "correlated", "packed"])
def test_kernel_matches_exact_reference(case):
  args = _kernel_inputs(0, correlated=case == "correlated")
  segments = _packed() if case == "packed" else None
  scale = 64 ** -0.5
  # Jitted: one compile each (eager dispatch compiles every primitive on its own).
  got = jax.jit(lambda a, s: ic.intra_chunk_fwd(*a, s, scale=scale, interpret=INTERPRET))(
      args, segments)
  want = jax.jit(lambda a, s: ic.intra_chunk_reference(*a, s, scale=scale))(args, segments)
  for name, g, w in zip(NAMES, got, want):
    assert g.shape == w.shape, name
    tol = 2e-2 if (name == "ny" and case == "correlated") else 5e-3
    assert_close(np.asarray(g, np.float32), w, tol, f"{name} ({case})")
  if case == "packed":  # the masks did something: P has no entry across segments
    p = np.asarray(got[2], np.float32)[0, 0, 0]
    assert np.all(p[40:, :40] == 0) and np.any(p[41:, 40:41] != 0)


# "correlated" is `-m slow` (suite time): "random" runs the same kernel with with_inverse=True,
# and test_kernel_matches_exact_reference[correlated] the same inverse on the correlated keys
# (U = M V and NY against the exact solve).
@pytest.mark.parametrize("case", ["random", pytest.param("correlated", marks=pytest.mark.slow)])
def test_kernel_inverse_output(case):
  # with_inverse=True adds M = (I + L)^{-1} (the backward's input) and changes nothing else.
  # Oracle: M (I + L) = I, with L = diag(β)(K Kᵀ ⊙ Γ) strictly lower built here in float64.
  args = _kernel_inputs(1, correlated=case == "correlated")
  scale = 64 ** -0.5
  # Jitted: one compile each (eager dispatch compiles every primitive on its own).
  plain = jax.jit(lambda a: ic.intra_chunk_fwd(*a, scale=scale, interpret=INTERPRET))(args)
  *outs, m = jax.jit(lambda a: ic.intra_chunk_fwd(*a, scale=scale, with_inverse=True,
                                                  interpret=INTERPRET))(args)
  for name, a, b in zip(NAMES, plain, outs):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), name)
  q, k, v, beta, g, _ = (np.asarray(x, np.float64) for x in args)
  n_rep = v.shape[2] // k.shape[2]
  for hv, ci in ((0, 0), (1, 1)):
    rows = slice(ci * 64, (ci + 1) * 64)
    kc, gc, bc = k[0, rows, hv // n_rep], g[0, hv, rows], beta[0, hv, rows]
    lmat = np.tril(bc[:, None] * (kc @ kc.T) * np.exp(gc[:, None] - gc[None, :]), -1)
    resid = np.asarray(m[0, hv, ci], np.float64) @ (np.eye(64) + lmat) - np.eye(64)
    # M is rounded to bf16 (2^-9 relative per entry) as the forward applies it: measured 5e-4
    # (random) and 5e-3 (correlated).
    assert np.abs(resid).max() < 1e-2, (case, hv, ci, np.abs(resid).max())
    assert np.all(np.triu(np.asarray(m[0, hv, ci], np.float32), 1) == 0)


@pytest.mark.parametrize("case", ["random", "packed"])
def test_kernel_backward_matches_autodiff_of_exact_reference(case):
  kernel = lambda q, k, v, beta_t, G, segidx, scale: gpu_vjps.intra_kernel(
      q, k, v, beta_t, G, segidx, scale, 64, INTERPRET)
  for name, g_, w in kernel_cases.intra_backward_pairs(kernel, case):
    assert_close(g_, w, 5e-3, f"d{name} ({case})")


def test_supported_sizes():
  assert ic.supported(64, 64, 128) is None and ic.supported(64, 128, 64) is None
  assert "chunk_size=32" in ic.supported(32, 64, 64)
  assert "K=96" in ic.supported(64, 96, 64)


# Explicit, so these tests keep covering the kernel if the default tuning changes.
KERNEL = pallas_gpu.GpuTuning(intra="kernel", forward="split")


# DeltaNet is `-m slow` (suite time): GDN's case runs the same kernels with the same tuning and
# shapes (no segments), and DeltaNet's ungated glue on this path (forward alone, against the
# scan) is tests/test_pallas_gpu.py's test_op_forward_matches_scan[delta_rule].
@pytest.mark.parametrize("mixer", ["gated_delta_rule",
                                   pytest.param("delta_rule", marks=pytest.mark.slow)])
def test_op_forward_matches_scan(monkeypatch, mixer):
  calls = []
  kernel = ic.intra_chunk_fwd
  monkeypatch.setattr(ic, "intra_chunk_fwd", lambda *a, **k: calls.append(1) or kernel(*a, **k))
  args, kw = make_inputs(mixer, b=1, t=96, h=1, hv=2, dk=64, dv=64, seed=1)
  got = run_jit(mixer, args, **kw, output_final_state=True, implementation="pallas_gpu",
                tuning=KERNEL)
  assert calls, "the op did not take the intra-chunk kernel"
  want = run_jit(mixer, args, **kw, output_final_state=True, implementation="scan")
  for name, g, w in zip(("o", "final_state"), got, want):
    assert_close(g, w, 2e-2, f"{mixer} {name}")


def test_op_gradients_match_scan():
  mixer = "gated_delta_rule"
  args, kw = make_inputs(mixer, b=1, t=96, h=1, hv=2, dk=64, dv=64, seed=4)
  s0 = kw["initial_state"]
  for name, g, w in zip(("q", "k", "v", "g", "beta", "initial_state"),
                        output_and_state_grads(mixer, args, s0, "pallas_gpu", tuning=KERNEL),
                        output_and_state_grads(mixer, args, s0, "scan")):
    assert_close(g, w, 3e-2, f"d{name}")


def test_op_with_segments_and_padding_matches_scan():
  mixer = "gated_delta_rule"
  args, kw = make_inputs(mixer, b=1, t=96, h=1, hv=2, dk=64, dv=64, seed=2)
  seg = jnp.asarray(np.concatenate([np.full(40, 1), np.full(30, 2), np.zeros(26)])[None],
                    jnp.int32)
  w_o = jax.random.normal(jax.random.key(7), args[2].shape)

  def value_and_grads(impl):
    def f(*xs):
      o, s = run(mixer, xs, initial_state=kw["initial_state"], segment_ids=seg,
                 output_final_state=True, implementation=impl,
                 tuning=KERNEL if impl == "pallas_gpu" else None)
      return jnp.sum(o * w_o) + jnp.sum(s), (o, s)
    # Jitted: one compile, not one per primitive (helpers.run_jit).
    return jax.jit(jax.grad(f, argnums=tuple(range(len(args))), has_aux=True))(*args)

  got, (o, s) = value_and_grads("pallas_gpu")
  want, (o_ref, s_ref) = value_and_grads("scan")
  assert_close(o, o_ref, 2e-2, "o")
  assert_close(s, s_ref, 2e-2, "final_state")
  assert np.all(np.asarray(o)[:, 70:] == 0)   # padding rows give zero output
  for name, g, w in zip(("q", "k", "v", "g", "beta"), got, want):
    assert_close(g, w, 3e-2, f"d{name}")


# (64, 64) is `-m slow`: (64, 128) lowers the same K = 64 code (issue #15: suite time).
@pytest.mark.parametrize("dk,dv", [pytest.param(64, 64, marks=pytest.mark.slow), (128, 128),
                                   (64, 128)])
def test_kernels_lower_to_mosaic_gpu_for_cuda(dk, dv, monkeypatch):
  from pallas_kernels.gpu import state_passing as sp  # pylint: disable=g-import-not-at-top
  sds = jax.ShapeDtypeStruct
  bf, f32 = jnp.bfloat16, jnp.float32
  b, h, hv, t, c = 1, 1, 2, 128, 64
  nc = t // c
  rows = [sds((b, hv, t), f32)] * 3
  inputs = [sds((b, t, h, dk), bf), sds((b, t, h, dk), bf), sds((b, t, hv, dv), bf)] + rows
  segments = [sds((b, t), f32)] * 3
  cts = [sds((b, hv, nc, c, c), bf), sds((b, hv, nc, c, dk), bf), sds((b, hv, nc, c, c), bf),
         sds((b, hv, nc, c, dv), bf)]                     # m, dny, dp, du
  state = [sds((b, hv, nc, c, dk), bf), sds((b, hv, nc, c, dk), bf), sds((b, hv, nc, c, c), bf),
           sds((b, hv, nc, c, dv), f32), sds((b, hv, nc, c, dk), bf), sds((b, hv, nc, dk), f32),
           sds((b, hv, dk, dv), f32)]
  # ny, qg, p, kg, gc, do, ds_final (two pieces)
  state_bwd = state[:3] + state[4:6] + [sds((b, hv, nc, c, dv), bf), sds((2 * b, hv, dk, dv), f32)]
  cases = {
      "state pass": (lambda *a: sp._state_passing_fwd(*a, save_states=True, interpret=None),
                     state),
      # rows in 2 pieces: the maps' pass ([I | 0], K columns more) and the pieces' reverse
      "state pass maps": (lambda *a: sp._state_passing_fwd(*a, save_states=False,
                                                           states_only=True, pieces=2,
                                                           interpret=None),
                          state[:6] + [sds((2 * b, hv, dk, dk + dv), f32)]),
      "state pass reverse, pieces": (lambda *a: sp._state_passing_bwd(
          *a[:6], None, a[6], pieces=2, interpret=None), state_bwd),
      # As the channel states path runs them: o written and dO read in [B, T, HV, V], de in
      # bf16 (leaving from its operand copy)
      "state pass, o rows": (lambda *a: sp._state_passing_fwd(
          *a, save_states=True, out_dtype=bf, o_rows=True, interpret=None), state),
      "state pass reverse, o rows, bf16 de": (lambda *a: sp._state_passing_bwd(
          *a[:5], a[5].reshape(b, t, hv, dv), None, a[6], pieces=2, de_dtype=bf, o_rows=True,
          interpret=None), state_bwd),
      "state pass reverse, states only": (lambda *a: sp._state_passing_bwd(
          *a[:6], None, a[6], states_only=True, pieces=2, interpret=None), state_bwd),
      "intra fwd": (lambda *a: ic._intra_chunk_fwd(*a, None, scale=0.1, with_inverse=False,
                                                   interpret=None), inputs),
      "intra fwd packed, with M": (lambda *a: ic._intra_chunk_fwd(
          *a[:6], a[6:], scale=0.1, with_inverse=True, interpret=None), inputs + segments),
      "intra bwd": (lambda *a: ic._intra_chunk_bwd(*a[:6], None, *a[6:], scale=0.1,
                                                   interpret=None), inputs + cts),
      "intra bwd packed": (lambda *a: ic._intra_chunk_bwd(*a[:6], a[10:], *a[6:10], scale=0.1,
                                                          interpret=None),
                           inputs + cts + segments),
  }
  estimates = record_smem_estimates(monkeypatch)
  smem = {}
  for name, (fn, args) in cases.items():
    estimates.clear()
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text(), name
    smem[name] = estimates[-1]
  # Hopper: at most 227 KiB per CTA; two CTAs share an SM only below 113 KiB each (228 KiB per
  # SM, 1 KiB reserved per CTA), which the intra-chunk forward's two phases are there for.
  for name, nbytes in smem.items():
    assert 0 < nbytes <= 227 * 1024, (name, nbytes)
  assert smem["intra fwd"] <= 113 * 1024, smem
