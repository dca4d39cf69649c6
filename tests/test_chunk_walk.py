"""The warp-specialised Mosaic GPU walk (`pallas_kernels.gpu.chunk_walk`; the op's
`GpuTuning(forward="walk")`).

Off GPU the kernel runs in JAX's Mosaic GPU interpreter, three warpgroups and their barriers
included (a barrier phase left unobserved fails there), so this file runs in `make test`; on a
Hopper GPU the same tests run the compiled kernel. Oracles:
* the kernel against `chunk_walk_reference`, a float32 scan over chunks with the kernel's bf16
  operand roundings (the final state to accumulation order, 5e-4; o and e, which leave the
  kernel in bf16, to 1e-2; the saved chunk states 5e-3), and that reference against the op's
  `scan` (the delta rule itself, 2e-2: bf16 roundings);
* the op with forward="walk" against `scan`: output, final state and write residual (2e-2),
  under jit, at the edges of T, with GVA, an initial state and −1e4 gates;
* training through both walks (forward="walk") against `scan`: every gradient, the residual's
  included (3e-2); packed rows keep the split; "auto" walks where the triton extra runs;
* lowering for CUDA on the CPU (Mosaic GPU's layout inference) within Hopper's shared memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_cases
from helpers import (assert_close, make_inputs, mosaic_gpu_or_skip, record_smem_estimates,
                     run_jit)

ON_GPU, INTERPRET = mosaic_gpu_or_skip()

from lineax_attn.ops import pallas_gpu  # noqa: E402
from pallas_kernels.gpu import chunk_walk as cw  # noqa: E402
from pallas_kernels.gpu import chunk_walk_reverse as cwr  # noqa: E402
from pallas_kernels.gpu import maps_walk as mw  # noqa: E402

WALK = pallas_gpu.GpuTuning(forward="walk")
FWD_TOL = 2e-2
GRAD_TOL = 3e-2


_kernel_inputs = kernel_cases.walk_inputs


# (b, t, h, hv, dk, dv, gate_scale, floor_gates, gated). The ring holds 4 chunks at K = 64 and
# 2 at K = 128: "wraps" cases walk past it.
KERNEL_CASES = {
    "one chunk, K 64": (1, 64, 1, 1, 64, 64, 1.0, False, True),
    "ring wraps, K 128, strong decay": (1, 192, 1, 1, 128, 64, 30.0, False, True),
    "GVA, two V tiles, ring wraps": (1, 320, 1, 2, 64, 128, 1.0, False, True),
    "-1e4 gates": (1, 128, 1, 1, 64, 64, 1.0, True, True),
    "ungated (DeltaNet)": (1, 128, 1, 1, 64, 64, 1.0, False, False),
}
if ON_GPU:
  KERNEL_CASES.update({
      "K 128, V 256, GVA, long": (2, 2048, 2, 4, 128, 256, 1.0, False, True),
      "K 128, -1e4 gates": (2, 1024, 4, 4, 128, 128, 1.0, True, True),
  })


@pytest.mark.parametrize("case", sorted(KERNEL_CASES))
def test_kernel_matches_its_rounded_reference(case):
  b, t, h, hv, dk, dv, gate_scale, floor_gates, gated = KERNEL_CASES[case]
  args = _kernel_inputs(b, t, h, hv, dk, dv, seed=len(case), gate_scale=gate_scale,
                        floor_gates=floor_gates)
  o, e, sf, h = jax.jit(lambda *a: cw.chunk_walk(*a, scale=dk ** -0.5, gated=gated,
                                                 save_states=True, interpret=INTERPRET))(*args)
  ro, re, rsf, rh = jax.jit(lambda *a: cw.chunk_walk_reference(*a, scale=dk ** -0.5,
                                                               gated=gated))(*args)
  assert o.dtype == e.dtype == h.dtype == jnp.bfloat16
  assert o.shape == (b, t, hv, dv) and sf.shape == (b, hv, dv, dk)
  assert h.shape == (b, hv, t // 64, dv, dk)
  # Compiled, a different float32 summation order can move a bf16 rounding of E or P by one
  # step, which the later chunks carry (seen: 1.07e-4 on the strong-decay case at K = 128).
  assert_close(sf, rsf, 5e-4, f"{case}: final state")
  assert_close(h.astype(jnp.float32), rh, 5e-3, f"{case}: chunk states (bf16)")
  for name, got, want in (("o", o, ro), ("e", e, re)):
    assert_close(got.astype(jnp.float32), want, 1e-2, f"{case}: {name} (bf16)")
  if ON_GPU or case == "one chunk, K 64":   # saving the states changes nothing else
    o_only = jax.jit(lambda *a: cw.chunk_walk(*a, scale=dk ** -0.5, gated=gated,
                                              interpret=INTERPRET))(*args)
    np.testing.assert_array_equal(np.asarray(o_only[0], np.float32), np.asarray(o, np.float32))


def made_m(t0, g, beta, gated):
  """M̃ = T0 ⊙ Γ · diag(β) per chunk from its definition (float32, then bf16 once), what a
  caller hands `chunk_walk(made_m=True)`: Γ_ij = e^{G_i − G_j} on i ≥ j (T0 is zero above)."""
  b, hv, nc, c, _ = t0.shape
  gc = g.reshape(b, hv, nc, c)
  lower = jnp.tril(jnp.ones((c, c), bool))
  gam = jnp.where(lower, jnp.exp(jnp.where(lower, gc[..., :, None] - gc[..., None, :], 0.0)),
                  0.0) if gated else lower.astype(jnp.float32)
  bc = beta.reshape(b, hv, nc, 1, c)
  return (t0.astype(jnp.float32) * gam * bc).astype(jnp.bfloat16)


# (The ungated case is slow: made_m and gated are independent branches of the walk (made_m
# only skips making M̃ and waiting for it), so the gated case covers made_m, at K 128 with its
# ring wrapping, and test_kernel_matches_its_rounded_reference["ungated (DeltaNet)"] the
# ungated walk.)
@pytest.mark.parametrize("case", [
    "ring wraps, K 128, strong decay",
    pytest.param("ungated (DeltaNet)", marks=pytest.mark.slow)])
def test_kernel_reading_a_made_m_matches_its_reference(case):
  # made_m: the caller makes M̃ (here from its definition); the walk reads it from the ring
  # and neither makes it nor waits for it. Only M̃'s bf16 rounding differs from the walk's
  # own (once here, twice there), which the final state's bound leaves room for.
  b, t, h, hv, dk, dv, gate_scale, floor_gates, gated = KERNEL_CASES[case]
  q, k, v, t0, g, beta, s0t = _kernel_inputs(b, t, h, hv, dk, dv, seed=len(case),
                                             gate_scale=gate_scale, floor_gates=floor_gates)
  m = made_m(t0, g, beta, gated)
  o, e, sf = jax.jit(lambda *a: cw.chunk_walk(*a, scale=dk ** -0.5, gated=gated, made_m=True,
                                              interpret=INTERPRET))(q, k, v, m, g, beta, s0t)
  ro, re, rsf, _ = jax.jit(lambda *a: cw.chunk_walk_reference(*a, scale=dk ** -0.5,
                                                              gated=gated))(
      q, k, v, t0, g, beta, s0t)
  assert_close(sf, rsf, 5e-3, f"{case}: final state")
  for name, got, want in (("o", o, ro), ("e", e, re)):
    assert_close(got.astype(jnp.float32), want, 1e-2, f"{case}: {name} (bf16)")
  with pytest.raises(ValueError, match="made_m"):
    cw.chunk_walk(q, k, v, None, g, beta, s0t, scale=1.0, made_m=True, interpret=INTERPRET)


# Slow (the GPU run keeps it): off GPU the interpreter computes e^x exactly and approx_math is
# only a compiler parameter, so this runs the one-chunk walks of
# test_kernel_matches_its_rounded_reference["one chunk, K 64"] and of the reverse test's same
# case (its check without dE_ext), and the gated one-chain maps' walk of test_walk_pieces.py's
# test_maps_walk_gives_the_whole_walks_final_states[True-1-64-128]; approx_math (on by default)
# reaching every walk is the op tests' (test_walk_overlap_reaches_the_reverse_walks_and_keeps_
# the_gradients and the options tests assert it).
@pytest.mark.slow
def test_approximate_exponentials_keep_the_walks_within_their_bounds():
  # approx_math: e^x as ex2.approx in the walks' gates (decay masks, entry / exit factors). The
  # interpreter computes e^x exactly either way, so off GPU this checks the option's path; on
  # the GPU it checks the approximation against the float32 references at the kernel tests'
  # bounds, at strong decay. (Off GPU at one chunk: the exact e^x there makes the strong-decay
  # case the kernel tests' own, which they run.)
  b, t, h, hv, dk, dv, gate_scale, floor_gates, gated = KERNEL_CASES[
      "ring wraps, K 128, strong decay" if ON_GPU else "one chunk, K 64"]
  q, k, v, t0, g, beta, s0t = _kernel_inputs(b, t, h, hv, dk, dv, seed=7, gate_scale=gate_scale)
  kw = dict(scale=dk ** -0.5, gated=gated)
  o, e, sf = jax.jit(lambda *a: cw.chunk_walk(*a, **kw, approx_math=True, interpret=INTERPRET))(
      q, k, v, t0, g, beta, s0t)
  ro, re, rsf, _ = jax.jit(lambda *a: cw.chunk_walk_reference(*a, **kw))(
      q, k, v, t0, g, beta, s0t)
  assert_close(sf, rsf, 5e-4, "final state")
  for name, got, want in (("o", o, ro), ("e", e, re)):
    assert_close(got.astype(jnp.float32), want, 1e-2, f"{name} (bf16)")
  # The maps' walk (no leading columns: the walk's own state chain, no outputs).
  from pallas_kernels.gpu import maps_walk as mw  # pylint: disable=g-import-not-at-top
  msf, = jax.jit(lambda *a: mw.maps_walk(*a, gated=gated, approx_math=True,
                                          interpret=INTERPRET))(k, v, t0, g, beta, s0t)
  assert_close(msf, rsf, 5e-4, "maps' walk final state")
  r = np.random.default_rng(7)
  do = jnp.asarray(r.standard_normal((b, t, hv, dv)), jnp.bfloat16)
  dsf = jnp.asarray(0.1 * r.standard_normal((b, hv, dv, dk)), jnp.float32)
  de, dh, ds0 = jax.jit(lambda *a: cwr.chunk_walk_reverse(*a, **kw, approx_math=True,
                                                          interpret=INTERPRET))(
      q, k, t0, g, beta, do, None, dsf)
  rde, rdh, rds0 = jax.jit(lambda *a: cwr.chunk_walk_reverse_reference(*a, None, dsf, **kw))(
      q, k, t0, g, beta, do)
  assert_close(de.astype(jnp.float32), rde, 1e-2, "dE (bf16)")
  assert_close(ds0, rds0, 5e-4, "dS0")
  assert_close(dh.astype(jnp.float32), rdh, 5e-3, "dh (bf16)")


@pytest.mark.parametrize("case", sorted(KERNEL_CASES))
def test_reverse_kernel_matches_its_rounded_reference(case):
  b, t, h, hv, dk, dv, gate_scale, floor_gates, gated = KERNEL_CASES[case]
  q, k, _, t0, g, beta, _ = _kernel_inputs(b, t, h, hv, dk, dv, seed=len(case) + 1,
                                           gate_scale=gate_scale, floor_gates=floor_gates)
  r = np.random.default_rng(len(case))
  do = jnp.asarray(r.standard_normal((b, t, hv, dv)), jnp.bfloat16)
  dx = jnp.asarray(0.3 * r.standard_normal((b, t, hv, dv)), jnp.bfloat16)
  dsf = jnp.asarray(0.1 * r.standard_normal((b, hv, dv, dk)), jnp.float32)
  args = (q, k, t0, g, beta, do, dx, dsf)
  de, dh, ds0 = jax.jit(lambda *a: cwr.chunk_walk_reverse(*a, scale=dk ** -0.5, gated=gated,
                                                          interpret=INTERPRET))(*args)
  rde, rdh, rds0 = jax.jit(lambda *a: cwr.chunk_walk_reverse_reference(
      *a, scale=dk ** -0.5, gated=gated))(*args)
  assert de.shape == (b, hv, t // 64, dv, 64) and dh.shape == (b, hv, t // 64, dv, dk)
  assert dh.dtype == de.dtype == jnp.bfloat16 and ds0.shape == (b, hv, dv, dk)
  assert_close(de.astype(jnp.float32), rde, 1e-2, f"{case}: dE (bf16)")
  assert_close(ds0, rds0, 5e-4, f"{case}: dS0")
  assert_close(dh.astype(jnp.float32), rdh, 5e-3, f"{case}: dh (bf16)")
  if case == "one chunk, K 64":   # no dE_ext (an unused residual): as if it were zero
    args = (q, k, t0, g, beta, do, None, dsf)
    de0, _, ds00 = jax.jit(lambda *a: cwr.chunk_walk_reverse(
        *a, scale=dk ** -0.5, gated=gated, interpret=INTERPRET))(*args)
    rde0, _, rds00 = cwr.chunk_walk_reverse_reference(*args, scale=dk ** -0.5, gated=gated)
    assert_close(de0.astype(jnp.float32), rde0, 1e-2, "dE without dE_ext")
    assert_close(ds00, rds00, 5e-4, "dS0 without dE_ext")


# (mixer: "gdn" | "deltanet" | "linear", T, K, V): the overlapped walks against the serial ones.
# GDN's rings wrap: K 64 holds four chunks, K 128 two (where the forward's next M̃ waits for
# its chunk to land). DeltaNet's and linear attention's branches at two chunks (at K 64 their
# rings wrapped at neither 192 nor 128 rows; the wrap is GDN's cases').
OVERLAP_CASES = [("gdn", 320, 64, 64), ("gdn", 192, 128, 64), ("deltanet", 128, 64, 64),
                 ("linear", 128, 64, 64)]
if ON_GPU:
  OVERLAP_CASES += [("gdn", 1024, 128, 128), ("deltanet", 1024, 128, 256)]


@pytest.mark.parametrize("mixer,t,dk,dv", OVERLAP_CASES)
def test_overlapped_products_change_no_result(mixer, t, dk, dv):
  # `overlap` issues independent products together (one wait for two) and makes the forward's
  # next M̃ before O's epilogue; the products, their operands and the sums are the serial
  # walk's, so every output is the same to the bit: forward (o, e, states) and reverse, and at
  # K 128 (and compiled) also the reverse without dE_ext and states only (their branches are
  # the mixers' alike; on the CPU each pair costs seconds).
  b, h, hv = 1, 1, 1
  q, k, v, t0, g, beta, s0t = _kernel_inputs(b, t, h, hv, dk, dv, seed=dk + dv)
  t0 = None if mixer == "linear" else t0
  gated = mixer == "gdn"
  kw = dict(scale=dk ** -0.5, gated=gated, interpret=INTERPRET)
  walk = lambda overlap: jax.jit(lambda *a: cw.chunk_walk(
      *a, **kw, save_states=True, overlap=overlap))(q, k, v, t0, g, beta, s0t)
  r = np.random.default_rng(dk)
  do = jnp.asarray(r.standard_normal((b, t, hv, dv)), jnp.bfloat16)
  dx = jnp.asarray(0.3 * r.standard_normal((b, t, hv, dv)), jnp.bfloat16)
  dsf = jnp.asarray(0.1 * r.standard_normal((b, hv, dv, dk)), jnp.float32)
  rev = lambda overlap, dx, alone=False: jax.jit(lambda *a: cwr.chunk_walk_reverse(
      *a, **kw, states_only=alone, overlap=overlap))(q, k, t0, g, beta, do, dx, dsf)
  pairs = [("forward", walk(False), walk(True)), ("reverse", rev(False, dx), rev(True, dx))]
  if dk == 128:
    pairs += [("reverse, no dE_ext", rev(False, None), rev(True, None)),
              ("states only", rev(False, dx, True), rev(True, dx, True))]
  for name, serial, overlapped in pairs:
    for i, (x, y) in enumerate(zip(serial, overlapped)):
      assert bool(jnp.any(x != 0)), (mixer, name, i)
      np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x, np.float32),
                                    err_msg=f"{mixer} K{dk} V{dv} {name}, output {i}")


# (K 64 is slow: the same overlapped walks, gated, forward and reverse, and the same barriers
# as K 128, where both rings (two chunks each) wrap at 192 rows and their slots are reused; at
# K 64 neither ring (four chunks, three) wraps here.)
@pytest.mark.skipif(ON_GPU, reason="the race detector is the interpreter's")
@pytest.mark.parametrize("dk", [pytest.param(64, marks=pytest.mark.slow), 128])
def test_overlapped_walks_hand_over_tiles_without_races(dk):
  # Overlapped, the forward's output warpgroup writes the next chunk's M̃ into the ring while
  # the state warpgroup works on this one, and the reverse walk stages two register operands at
  # once; the detector sees register loads and stores of shared memory (not wgmma's reads).
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # the detector's verdict
  from jax.experimental.pallas import mosaic_gpu as plgpu
  q, k, v, t0, g, beta, s0t = _kernel_inputs(1, 192, 1, 1, dk, 64, seed=dk)
  kw = dict(scale=dk ** -0.5, overlap=True,
            interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(cw.chunk_walk(q, k, v, t0, g, beta, s0t, **kw))
  assert gpu_callbacks.get_races().races_found is False
  do = jnp.ones((1, 192, 1, 64), jnp.bfloat16)
  jax.block_until_ready(cwr.chunk_walk_reverse(q, k, t0, g, beta, do, do, s0t, **kw))
  assert gpu_callbacks.get_races().races_found is False


# Two chunks (the state carried across; neither ring wraps at K 64 below five), GVA, two V tiles.
LINEAR_KERNEL_CASES = [(1, 128, 1, 2, 64, 128)]
if ON_GPU:
  LINEAR_KERNEL_CASES += [(2, 1024, 2, 4, 128, 128)]


@pytest.mark.parametrize("b,t,h,hv,dk,dv", LINEAR_KERNEL_CASES)
def test_linear_attention_walks_match_their_references(b, t, h, hv, dk, dv):
  # t0=None: linear attention, the same walks without the erase (E = v), both ways.
  q, k, v, _, g, beta, s0t = _kernel_inputs(b, t, h, hv, dk, dv, seed=t)
  scale = dk ** -0.5
  o, e, sf, hs = jax.jit(lambda *a: cw.chunk_walk(*a, scale=scale, gated=False, save_states=True,
                                                  interpret=INTERPRET))(q, k, v, None, g, beta,
                                                                       s0t)
  ro, re, rsf, rh = jax.jit(lambda *a: cw.chunk_walk_reference(*a[:3], None, *a[3:],
                                                               scale=scale, gated=False))(
      q, k, v, g, beta, s0t)
  np.testing.assert_array_equal(np.asarray(e, np.float32), np.asarray(v, np.float32))
  assert_close(sf, rsf, 5e-4, "final state")
  assert_close(hs.astype(jnp.float32), rh, 5e-3, "chunk states")
  assert_close(o.astype(jnp.float32), ro, 1e-2, "o")
  r = np.random.default_rng(t)
  do = jnp.asarray(r.standard_normal((b, t, hv, dv)), jnp.bfloat16)
  dsf = jnp.asarray(0.1 * r.standard_normal((b, hv, dv, dk)), jnp.float32)
  args = (q, k, None, g, beta, do, None, dsf)
  de, dh, ds0 = jax.jit(lambda *a: cwr.chunk_walk_reverse(*a, scale=scale, gated=False,
                                                          interpret=INTERPRET))(*args)
  rde, rdh, rds0 = jax.jit(lambda *a: cwr.chunk_walk_reverse_reference(
      *a[:2], None, *a[2:5], None, a[5], scale=scale, gated=False))(q, k, g, beta, do, dsf)
  assert_close(de.astype(jnp.float32), rde, 1e-2, "dE")
  assert_close(ds0, rds0, 5e-4, "dS0")
  assert_close(dh.astype(jnp.float32), rdh, 5e-3, "dh")


def test_linear_attention_reference_is_linear_attention():
  from lineax_attn import ops  # pylint: disable=g-import-not-at-top
  b, t, h, hv, dk, dv = 1, 192, 1, 2, 64, 64
  q, k, v, _, g, beta, s0t = _kernel_inputs(b, t, h, hv, dk, dv, seed=4)
  o, e, sf, _ = cw.chunk_walk_reference(q, k, v, None, g, beta, s0t, scale=0.125, gated=False)
  f32 = lambda x: x.astype(jnp.float32)
  want_o, want_s = ops.linear_attention(f32(q), f32(k), f32(v), scale=0.125,
                                        initial_state=jnp.swapaxes(s0t, -1, -2),
                                        output_final_state=True, implementation="scan")
  assert_close(o, want_o, FWD_TOL, "o")
  assert_close(jnp.swapaxes(sf, -1, -2), want_s, FWD_TOL, "final state")
  assert_close(e, f32(v), 1e-6, "e = v")


def test_reference_is_the_delta_rule():
  # The kernel's oracle against the recurrence itself: `scan` of GDN on the same inputs.
  from lineax_attn import ops  # pylint: disable=g-import-not-at-top
  b, t, h, hv, dk, dv = 1, 192, 1, 2, 64, 64
  q, k, v, t0, cum, beta, s0t = _kernel_inputs(b, t, h, hv, dk, dv, seed=3)
  g = jnp.diff(cum.reshape(b, hv, t // 64, 64), axis=-1, prepend=0.0).reshape(b, hv, t)
  o, e, sf, _ = cw.chunk_walk_reference(q, k, v, t0, cum, beta, s0t, scale=0.125)
  f32 = lambda x: x.astype(jnp.float32)
  want_o, want_s, want_r = ops.gated_delta_rule(
      f32(q), f32(k), f32(v), jnp.moveaxis(g, 1, 2), jnp.moveaxis(beta, 1, 2), scale=0.125,
      initial_state=jnp.swapaxes(s0t, -1, -2), output_final_state=True, return_residual=True,
      implementation="scan")
  assert_close(o, want_o, FWD_TOL, "o")
  assert_close(jnp.swapaxes(sf, -1, -2), want_s, FWD_TOL, "final state")
  assert_close(e, want_r, FWD_TOL, "e = write residual")


# (GDN's ragged two chunks on the CPU at T = 65, chunk + 1; T = 100 is DeltaNet's and linear
# attention's.)
OP_CASES = [("delta_rule", 100, 1.0), ("gated_delta_rule", 1, 1.0),
            ("gated_delta_rule", 65, 1.0), ("linear_attention", 100, 1.0),
            ("linear_attention", 1, 1.0)]
if ON_GPU:
  OP_CASES += [("gated_delta_rule", 100, 1.0), ("gated_delta_rule", 63, 1.0),
               ("gated_delta_rule", 64, 1.0),
               ("delta_rule", 128, 1.0), ("gated_delta_rule", 1000, 1e4)]


def _forward_matches_scan(mixer, t, tau_inv, tuning):
  args, kw = make_inputs(mixer, b=1, t=t, h=1, hv=2, dk=64, dv=64, tau=1 / tau_inv,
                         seed=t + len(mixer))
  kwargs = dict(kw, output_final_state=True, return_residual=True)
  got = run_jit(mixer, args, **kwargs, implementation="pallas_gpu", tuning=tuning)
  want = run_jit(mixer, args, **kwargs, implementation="scan")
  for name, g, w in zip(("o", "final state", "residual"), got, want):
    assert_close(g, w, FWD_TOL, f"{mixer} T={t}, {tuning}: {name}")


@pytest.mark.parametrize("mixer,t,tau_inv", OP_CASES)
def test_op_with_the_walk_matches_scan(mixer, t, tau_inv):
  # tau_inv 1e4: log gates down to ~ −1e4 (the decay floor every path must keep finite).
  _forward_matches_scan(mixer, t, tau_inv, WALK)


# (Not T = 1: its one β per head gets a gradient whose terms cancel, so the relative error of
# that one scalar measures bf16 cancellation, not the path: 0.21 here, 0.08 for the split,
# ~1e-3 for both from T = 3.)
GRAD_CASES = [("gated_delta_rule", 80, 2), ("delta_rule", 130, 2), ("linear_attention", 100, 2)]
if ON_GPU:
  GRAD_CASES += [("gated_delta_rule", 3, 1), ("gated_delta_rule", 80, 1),
                 ("gated_delta_rule", 333, 1)]


def _record_grads_options(monkeypatch):
  """Lists that fill, as the op is traced, with the (approx_math, join_exit, warpgroups) of each
  per-chunk backward (`chunk_grads`) and the (walk, approx_math) of each forward and reverse
  walk."""
  from pallas_kernels.gpu import chunk_grads as cg  # pylint: disable=g-import-not-at-top
  seen, real = [], cg.chunk_grads
  monkeypatch.setattr(cg, "chunk_grads", lambda *a, **k: seen.append(
      (k["approx_math"], k["join_exit"], k["warpgroups"])) or real(*a, **k))
  walks = []
  for mod, name in ((cw, "chunk_walk"), (cwr, "chunk_walk_reverse")):
    monkeypatch.setattr(mod, name, lambda *a, real=getattr(mod, name), name=name, **k: (
        walks.append((name, k.get("approx_math", False))) or real(*a, **k)))
  return seen, walks


@pytest.mark.parametrize("mixer,t,hv", GRAD_CASES)
def test_training_through_both_walks_matches_scan(monkeypatch, mixer, t, hv):
  # forward="walk" differentiated: the forward walk saves the chunk states, the reverse walk
  # makes dE and the state cotangents, then the intra-chunk backward. Every gradient (and the
  # residual's, through return_residual) against the scan's. The tuning's defaults (approx_math,
  # join_exit, two warpgroups) reach the per-chunk backward and both walks: this is the options
  # test's default case (GDN and DeltaNet with GVA; the other option values are its cases).
  seen, walks = _record_grads_options(monkeypatch)
  args, kw = make_inputs(mixer, b=1, t=t, h=1, hv=hv, dk=64, dv=64, seed=t + hv)
  kernel_cases.assert_training_grads_match_scan(mixer, args, kw["initial_state"], WALK, GRAD_TOL,
                                                f"{mixer} T={t} HV={hv}")
  assert (WALK.approx_math, WALK.join_exit, WALK.grads_warpgroups) == (True, True, 2)
  if mixer != "linear_attention":
    assert seen == [(True, True, 2)]
  assert set(walks) == {("chunk_walk", True), ("chunk_walk_reverse", True)}


# ("o" is slow: a loss on o alone, no residual and no final state, so the reverse walk without
# dE_ext and a zero final-state cotangent, is what the GDN options cases of
# test_grads_options_reach_chunk_grads_and_keep_the_gradients run (Σ o², every gradient
# against the scan's), and test_walk_overlap_reaches_the_reverse_walks_and_keeps_the_gradients
# [gated_delta_rule-1] with the default tuning; "residual", o unused (dO made zeros), is this
# test's own.)
@pytest.mark.parametrize("used", [pytest.param("o", marks=pytest.mark.slow), "residual"])
def test_training_with_unused_outputs_matches_scan(used):
  # Outputs a loss does not read reach the walk's backward as symbolic zeros (no residual:
  # the reverse walk runs without its dE_ext copies; no final state, or no o): every gradient
  # still matches the scan's. (One value head: GVA's gradients are the training test's.)
  args, kw = make_inputs("gated_delta_rule", b=1, t=96, h=1, hv=1, dk=64, dv=64, seed=31)
  w = jax.random.normal(jax.random.key(3), args[2].shape)

  def loss(impl, tuning):
    def f(*a):
      out = run_jit("gated_delta_rule", a, **kw, return_residual=True, implementation=impl,
                    tuning=tuning)
      return jnp.sum(out[0 if used == "o" else -1] * w)
    return jax.jit(jax.grad(f, argnums=tuple(range(len(args)))))(*args)

  for name, g, want in zip(["q", "k", "v", "g", "beta"], loss("pallas_gpu", WALK),
                           loss("scan", None)):
    assert_close(g, want, GRAD_TOL, f"{used} only: d{name}")


def _square_loss_grads_uncached(mixer, t, hv, impl, tuning):
  """Gradients of Σ o² with respect to the positional inputs (B1 H1 K=V=64, seed 41)."""
  args, kw = make_inputs(mixer, b=1, t=t, h=1, hv=hv, dk=64, dv=64, seed=41)
  f = lambda *a: jnp.sum(run_jit(mixer, a, **kw, implementation=impl, tuning=tuning)[0] ** 2)
  return jax.jit(jax.grad(f, argnums=tuple(range(len(args)))))(*args)


# The scan's gradients once per (mixer, T, HV): two option cases below share their inputs.
_square_loss_scan_grads = functools.cache(
    lambda mixer, t, hv: _square_loss_grads_uncached(mixer, t, hv, "scan", None))


def _square_loss_grads(mixer, t, hv, impl, tuning):
  if impl == "scan":
    return _square_loss_scan_grads(mixer, t, hv)
  return _square_loss_grads_uncached(mixer, t, hv, impl, tuning)


# The defaults (True, True, 2), for GDN and DeltaNet with GVA, are
# test_training_through_both_walks_matches_scan's cases (the same checks, every output read).
@pytest.mark.parametrize("mixer,approx_math,join_exit,warpgroups", [
    ("gated_delta_rule", True, False, 1), ("gated_delta_rule", False, True, 1)])
def test_grads_options_reach_chunk_grads_and_keep_the_gradients(monkeypatch, mixer, approx_math,
                                                                 join_exit, warpgroups):
  # GpuTuning's approx_math (e^x as ex2.approx on a GPU; the interpreter computes it exactly),
  # join_exit (the exit product in dk's wgmma group) and grads_warpgroups (the two-warpgroup
  # kernel) reach the per-chunk backward, approx_math the forward and reverse walks too, and
  # the gradients stay the scan's.
  seen, walks = _record_grads_options(monkeypatch)
  t = 64 if warpgroups == 1 else 96
  got = _square_loss_grads(mixer, t, warpgroups, "pallas_gpu", pallas_gpu.GpuTuning(
      forward="walk", approx_math=approx_math, join_exit=join_exit, grads_warpgroups=warpgroups))
  assert seen == [(approx_math, join_exit, warpgroups)]
  assert set(walks) == {("chunk_walk", approx_math), ("chunk_walk_reverse", approx_math)}
  names = ["q", "k", "v"] + (["g", "beta"] if mixer == "gated_delta_rule" else ["beta"])
  for name, g, want in zip(names, got, _square_loss_grads(mixer, t, warpgroups, "scan", None)):
    assert_close(g, want, GRAD_TOL, f"{mixer} approx_math={approx_math}, join_exit={join_exit}, "
                                    f"warpgroups={warpgroups}: d{name}")


@pytest.mark.parametrize("mixer,pieces", [("gated_delta_rule", 1), ("delta_rule", 2)])
def test_walk_overlap_reaches_the_reverse_walks_and_keeps_the_gradients(monkeypatch, mixer,
                                                                         pieces):
  # GpuTuning(walk_overlap=True) reaches the reverse walk and, with rows in pieces, the
  # states-only reverse walk of the entry cotangents, not the forward walk (whose overlap
  # gained nothing on the H200); outputs and gradients stay the scan's. The default
  # approx_math reaches every one of those walks, and the maps' walk of the pieces.
  from pallas_kernels.gpu import maps_walk as mw  # pylint: disable=g-import-not-at-top
  seen = []
  for mod, name in ((cw, "chunk_walk"), (cwr, "chunk_walk_reverse"), (mw, "maps_walk")):
    real = getattr(mod, name)
    monkeypatch.setattr(mod, name, lambda *a, real=real, name=name, **k: seen.append(
        (name, k.get("states_only", False), k.get("overlap", False),
         k.get("approx_math", False))) or real(*a, **k))
  # Two chunks (one a piece): the options' routing and the gradients; the overlapped walks'
  # rings wrapping is test_overlapped_products_change_no_result's.
  args, kw = make_inputs(mixer, b=1, t=128, h=1, hv=1, dk=64, dv=64, seed=43)
  tuning = pallas_gpu.GpuTuning(forward="walk", walk_overlap=True, row_pieces=pieces)

  def grads(impl, tuning):
    f = lambda *a: jnp.sum(run_jit(mixer, a, **kw, implementation=impl, tuning=tuning)[0] ** 2)
    return jax.jit(jax.grad(f, argnums=tuple(range(len(args)))))(*args)

  got = grads("pallas_gpu", tuning)
  want = {("chunk_walk", False, False, True), ("chunk_walk_reverse", False, True, True)}
  if pieces > 1:
    want |= {("chunk_walk_reverse", True, True, True), ("maps_walk", False, False, True)}
  assert set(seen) == want
  names = ["q", "k", "v"] + (["g", "beta"] if mixer == "gated_delta_rule" else ["beta"])
  for name, g, w in zip(names, got, grads("scan", None)):
    assert_close(g, w, GRAD_TOL, f"{mixer} in {pieces} pieces, walk_overlap: d{name}")


def test_linear_attention_takes_the_walks_without_t0(monkeypatch):
  # Linear attention runs the walks with t0=None (no gate-free inverse is made) where DeltaNet /
  # GDN would walk (forward="walk", or "auto" where the triton extra runs); the split keeps it
  # off them.
  calls = []
  real = cw.chunk_walk
  monkeypatch.setattr(cw, "chunk_walk", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
  args, kw = make_inputs("linear_attention", b=1, t=70, h=1, hv=1, dk=64, dv=64, seed=5)
  got = run_jit("linear_attention", args, **kw, implementation="pallas_gpu", tuning=WALK)
  assert calls == [None]
  split = run_jit("linear_attention", args, **kw, implementation="pallas_gpu",
                  tuning=pallas_gpu.GpuTuning(forward="split"))
  assert len(calls) == 1
  assert_close(got[0], split[0], FWD_TOL, "walk vs split")
  assert not pallas_gpu._linear_walk_applies(WALK, 128, 256, 64, "mosaic", False)   # V 256
  from lineax_attn.ops import triton_gpu  # pylint: disable=g-import-not-at-top
  assert (pallas_gpu._linear_walk_applies(pallas_gpu.GpuTuning(), 64, 64, 64, "mosaic", False)
          == triton_gpu.available())   # "auto" walks where DeltaNet / GDN do


def test_auto_takes_the_walk_where_the_triton_extra_runs():
  from lineax_attn.ops import triton_gpu  # pylint: disable=g-import-not-at-top
  auto = pallas_gpu.GpuTuning()
  assert auto.forward == "auto"
  assert pallas_gpu.walk_applies(auto, 128, 128, 64, "mosaic", False) == triton_gpu.available()
  assert not pallas_gpu.walk_applies(pallas_gpu.GpuTuning(forward="split"), 128, 128, 64,
                                     "mosaic", False)


def test_packed_rows_keep_the_split():
  args, kw = make_inputs("gated_delta_rule", b=1, t=96, h=1, hv=1, dk=64, dv=64, seed=22)
  seg = jnp.asarray([[1] * 40 + [2] * 50 + [0] * 6])
  walk = run_jit("gated_delta_rule", args, **kw, segment_ids=seg, implementation="pallas_gpu",
                 tuning=WALK)
  split = run_jit("gated_delta_rule", args, **kw, segment_ids=seg, implementation="pallas_gpu",
                  tuning=pallas_gpu.GpuTuning(forward="split"))
  np.testing.assert_array_equal(np.asarray(walk[0]), np.asarray(split[0]))
  assert not pallas_gpu.walk_applies(WALK, 64, 64, 64, "mosaic", packed=True)
  assert not pallas_gpu.walk_applies(WALK, 64, 64, 64, "triton", packed=False)
  assert pallas_gpu.walk_applies(WALK, 128, 128, 64, "mosaic", packed=False)


def test_kernel_refuses_sizes_it_does_not_take():
  args = list(_kernel_inputs(1, 64, 1, 1, 64, 64, seed=0))
  with pytest.raises(ValueError, match="multiple of 64"):
    cw.chunk_walk(*[x[:, :32] if i < 3 else x for i, x in enumerate(args)], scale=0.1,
                  interpret=INTERPRET)
  assert "K=32" in cw.supported(64, 32, 64)
  assert "V=96" in cw.supported(64, 64, 96)
  assert cw.supported(64, 128, 128) is None


@pytest.mark.parametrize("dk", [64, 128])
def test_lowers_for_cuda_within_shared_memory(monkeypatch, dk):
  # Mosaic GPU's layout inference runs at lowering: register-operand wgmma, transposed tiles
  # and 1-D gate vectors the interpreter accepts but the compiler would reject fail here. The
  # gated, serial walks are lowered as the op runs them, with approx_math (e^x as ex2.approx).
  estimates = record_smem_estimates(monkeypatch)
  b, t, h, hv, dv = 2, 256, 2, 4, 128
  sds = jax.ShapeDtypeStruct
  bf, f32 = jnp.bfloat16, jnp.float32
  args = (sds((b, t, h, dk), bf), sds((b, t, h, dk), bf), sds((b, t, hv, dv), bf),
          sds((b, hv, t // 64, 64, 64), bf), sds((b, hv, t), f32), sds((b, hv, t), f32),
          sds((b, hv, dv, dk), f32))
  for gated, save, overlap in ((True, False, False), (False, False, False), (True, True, False),
                               (True, True, True), (False, False, True)):
    fn = lambda *a, gated=gated, save=save, overlap=overlap: cw._chunk_walk(
        *a, scale=0.1, gated=gated, save_states=save, overlap=cw.overlap_parts(overlap),
        approx_math=gated and not overlap, interpret=None)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert 0 < estimates[-1] <= cw.SMEM_LIMIT, (dk, gated, save, overlap, estimates[-1])
  assert cw.ring_stages(dk) == (4 if dk == 64 else 2)
  # The maps' walk of row pieces: k, v, T0, g, β and a state K columns wider than v (the
  # leading columns read v scaled by 0), one chain per CTA or two (4 and 3 warpgroups' worth
  # of registers; 3 blocks at K 64 leave a spare chain).
  maps_args = args[1:6] + (sds((b, hv, dk + dv, dk), f32),)
  for gated, chains in ((True, 1), (True, 2), (False, 2)):
    fn = lambda *a, gated=gated, chains=chains: mw._maps_walk(*a, gated=gated, chains=chains,
                                                              approx_math=gated, interpret=None)
    text = jax.jit(fn).trace(*maps_args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert 0 < estimates[-1] <= cw.SMEM_LIMIT, ("maps", dk, gated, chains, estimates[-1])
  assert mw.ring_stages(dk, 1) == 4
  assert mw.ring_stages(dk, 2) == (4 if dk == 64 else 3)
  # The reverse walk: q, k, T0, g, β, dO, dE_ext, dS_T.
  rev_args = args[:2] + args[3:6] + (sds((b, t, hv, dv), bf),) * 2 + (args[6],)
  for gated, alone, overlap in ((True, False, False), (False, False, False), (True, True, False),
                                (True, False, True), (False, False, True), (True, True, True)):
    fn = lambda *a, gated=gated, alone=alone, overlap=overlap: cwr._chunk_walk_reverse(
        *a, scale=0.1, gated=gated, states_only=alone, overlap=overlap,
        approx_math=gated and not overlap, interpret=None)
    text = jax.jit(fn).trace(*rev_args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert 0 < estimates[-1] <= cw.SMEM_LIMIT, ("reverse", dk, gated, alone, overlap,
                                                estimates[-1])
  # ... and linear attention's (no T0), its products overlapped.
  fn = lambda *a: cwr._chunk_walk_reverse(*a[:2], None, *a[2:], scale=0.1, gated=False,
                                          states_only=False, overlap=True, interpret=None)
  text = jax.jit(fn).trace(*rev_args[:2], *rev_args[3:]).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  assert cwr.ring_stages(dk) == (3 if dk == 64 else 2)
