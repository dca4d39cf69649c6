"""The state pass with every row cut into pieces (`GpuTuning(row_pieces=P)` on KDA, GDN-2 and
the split path; `gpu_vjps.state_pass(pieces=)`, `state_passing_fwd / _bwd(pieces=,
states_only=)`).

Off GPU the Mosaic GPU kernels run in JAX's interpreter, so this file runs in `make test`; on a
Hopper GPU the same tests run them compiled. Oracles:
* the kernels: the states-only passes against the whole passes' final state and entry
  cotangent (the same products: 1e-6), the maps' pass from [I | 0] against the float32 scan's
  state at the piece boundary (Φ S_in + Ψ; bf16 operands: 2e-2), and the pieces' pass from the
  scan's entry states against the scan with the kernel's bf16 rounding (1e-4);
* the op: output, final state and write residual against the `scan` implementation (2e-2,
  T = 1 among the cases) and every gradient (3e-2) under jit, with GVA, an initial state and
  chunks no piece count divides; packed rows (segment_ids) with resets inside a piece and on
  a piece's first token; a loss on the last piece alone (the carried cotangents); that the
  maps' pass ran.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import kernel_cases
from helpers import assert_close, make_inputs, mosaic_gpu_or_skip, run, run_jit

ON_GPU, INTERPRET = mosaic_gpu_or_skip()

from lineax_attn.ops import pallas_gpu  # noqa: E402
from pallas_kernels.gpu import state_passing as sp  # noqa: E402

FWD_TOL = 2e-2
GRAD_TOL = 3e-2


def _spy_state_passes(monkeypatch):
  """Records (states_only, pieces) of every forward state pass traced."""
  calls = []
  real = sp.state_passing_fwd

  def spy(*a, states_only=False, pieces=1, **kw):
    calls.append((states_only, pieces))
    return real(*a, states_only=states_only, pieces=pieces, **kw)
  monkeypatch.setattr(sp, "state_passing_fwd", spy)
  return calls


def test_states_only_passes_give_the_whole_passes_ends():
  x = kernel_cases.state_pass_inputs(0, nc=3)
  kw = dict(interpret=INTERPRET)
  # Jitted: one compile each (eager dispatch compiles every primitive on its own).
  _, _, s_final = jax.jit(lambda x: sp.state_passing_fwd(**x, **kw))(x)
  (alone,) = jax.jit(lambda x: sp.state_passing_fwd(**x, states_only=True, **kw))(x)
  assert_close(alone, s_final, 1e-6, "final state, states_only against the whole pass")
  r = jax.random.split(jax.random.key(1), 3)
  do = jax.random.normal(r[0], x["u"].shape).astype(jnp.bfloat16)
  dx = jax.random.normal(r[1], x["u"].shape)
  dsf = jax.random.normal(r[2], x["s0"].shape)
  args = (x["ny"], x["qg"], x["p"], x["kg"], x["gc"], do, dx, dsf)
  ds0 = jax.jit(lambda *a: sp.state_passing_bwd(*a, **kw))(*args)[2]
  (alone,) = jax.jit(lambda *a: sp.state_passing_bwd(*a, states_only=True, **kw))(*args)
  assert_close(alone, ds0, 1e-6, "entry cotangent, states_only against the whole pass")


def test_maps_and_pieces_passes_match_the_scan():
  # 4 chunks in 2 pieces, K = V = 64. The maps' pass from [I | 0] (its first K columns with
  # U = 0) gives piece 0's S_out = Φ S_in + Ψ; the pieces' pass from the scan's entry states
  # gives the scan's outputs and the state leaving each piece.
  b, hv, dk, dv, pieces = 1, 2, 64, 64, 2
  x = kernel_cases.state_pass_inputs(3, b=b, hv=hv, nc=4, dk=dk, dv=dv)
  h_ref = sp.state_passing_reference(**x)[3]
  s_maps = jnp.concatenate([jnp.broadcast_to(jnp.eye(dk), (b * pieces, hv, dk, dk)),
                            jnp.zeros((b * pieces, hv, dk, dv))], axis=-1)
  (maps,) = jax.jit(lambda x, s: sp.state_passing_fwd(**dict(x, s0=s), states_only=True,
                                                      pieces=pieces, interpret=INTERPRET))(
                                                          x, s_maps)
  assert maps.shape == (b * pieces, hv, dk, dk + dv)
  boundary = jnp.einsum("hij,hjv->hiv", maps[0, :, :, :dk], x["s0"][0],
                        precision="highest") + maps[0, :, :, dk:]
  assert_close(boundary, h_ref[0, :, 2], FWD_TOL, "Φ s0 + Ψ against the scan's state")
  # From the entry states of the scan that rounds as the kernel does, the same numbers.
  ro, re, rs, rh = sp.state_passing_reference(**x, round_operands=True)
  starts = jnp.stack([x["s0"][0], rh[0, :, 2]])
  o, e, ends = jax.jit(lambda x, s: sp.state_passing_fwd(**dict(x, s0=s), pieces=pieces,
                                                         interpret=INTERPRET))(x, starts)
  for name, got, want in (("o", o, ro), ("e", e, re), ("state leaving piece 0", ends[0],
                                                       rh[0, :, 2]),
                          ("state leaving the row", ends[1], rs[0])):
    assert_close(got, want, 1e-4, name)


def test_pieces_arguments_are_checked():
  x = kernel_cases.state_pass_inputs(0, nc=3)
  with pytest.raises(ValueError, match="pieces=2 must be a positive int dividing the 3"):
    sp.state_passing_fwd(**x, pieces=2, interpret=INTERPRET)
  with pytest.raises(ValueError, match="one state per piece"):
    sp.state_passing_fwd(**dict(x, s0=jnp.zeros((2, 2, 64, 64))), interpret=INTERPRET)
  with pytest.raises(ValueError, match="as wide as u"):
    sp.state_passing_fwd(**dict(x, s0=jnp.zeros((1, 2, 64, 128))), interpret=INTERPRET)
  with pytest.raises(ValueError, match="save_states"):
    sp.state_passing_fwd(**x, states_only=True, save_states=True, interpret=INTERPRET)


def _pieces(p, products="auto"):
  return pallas_gpu.GpuTuning(row_pieces=p, state_products=products)


# (mixer, B, T, pieces, by_rule): T = 200 pads to 4 chunks, 2 pieces; T = 130 is 3 chunks in 2
# pieces (one identity chunk of padding); T = 1 is one chunk, the second piece all identity;
# GDN on the split path (forward="split"). by_rule: row_pieces=0, the default, and an auto rule
# answering `pieces` (one run checks both the rule's plumbing and the values in pieces; it was a
# test of its own at T = 128).
FWD_CASES = [("kda", 1, 200, 2, True), ("gdn2", 2, 130, 2, False), ("kda", 1, 1, 2, False)]
if ON_GPU:
  FWD_CASES += [("kda", 1, 4096, 8, False), ("gdn2", 1, 1000, 4, False),
                ("gated_delta_rule", 1, 700, 3, False)]


@pytest.mark.parametrize("mixer,b,t,pieces,by_rule", FWD_CASES)
def test_pieces_forward_matches_scan(monkeypatch, mixer, b, t, pieces, by_rule):
  # by_rule: row_pieces=0 asks `gpu_pieces.auto_row_pieces` at trace time with the pass's sizes
  # (B·HV heads of one 64-column block each, the chunks), and its answer is the pass's pieces.
  from lineax_attn.ops import gpu_pieces  # pylint: disable=g-import-not-at-top
  asked = kernel_cases.answer_auto_rule(monkeypatch, pieces) if by_rule else None
  calls = _spy_state_passes(monkeypatch)
  args, kw = make_inputs(mixer, b=b, t=t, h=1, hv=2, dk=64, dv=64, seed=t + pieces)
  kwargs = dict(kw, output_final_state=True, return_residual=True)
  tuning = pallas_gpu.GpuTuning(row_pieces=0 if by_rule else pieces, forward="split")
  got = run_jit(mixer, args, **kwargs, implementation="pallas_gpu", tuning=tuning)
  want = run_jit(mixer, args, **kwargs, implementation="scan")
  if by_rule:   # (B·HV, K/64, V/64, chunks, SMs, one chain per CTA: the state pass's)
    assert asked == [(b * 2, 1, 1, -(-t // 64), gpu_pieces.device_sms(), 1)], asked
  assert sorted(calls) == [(False, pieces), (True, pieces)], calls   # pieces' and maps' pass
  for name, g, w in zip(("o", "final state", "residual"), got, want):
    assert_close(g, w, FWD_TOL, f"{mixer} B={b} T={t} P={pieces}: {name}")


# products: who makes the state pass's products (GpuTuning.state_products); "pass", the
# reverse pass itself (K = V = 64), walks the pieces' chunks with them. KDA is `-m slow` (suite
# time): at K = V = 64 "auto" is "pass", so GDN-2's case runs the same pass in the same pieces
# (GVA, T = 150, an initial state), and KDA's gradients in pieces against the scan are
# test_packed_rows_in_pieces_match_scan[kda]'s.
GRAD_CASES = [pytest.param("kda", 1, 150, 2, "auto", marks=pytest.mark.slow),
              ("gdn2", 1, 150, 2, "pass")]
if ON_GPU:
  GRAD_CASES += [("gdn2", 2, 333, 3, "auto"), ("kda", 1, 2048, 8, "auto"),
                 ("kda", 1, 2048, 8, "pass")]


@pytest.mark.parametrize("mixer,b,t,pieces,products", GRAD_CASES)
def test_pieces_gradients_match_scan(mixer, b, t, pieces, products):
  args, kw = make_inputs(mixer, b=b, t=t, h=1, hv=2, dk=64, dv=64, seed=3 * t + pieces)
  kernel_cases.assert_training_grads_match_scan(
      mixer, args, kw["initial_state"], _pieces(pieces, products), GRAD_TOL,
      f"{mixer} B={b} T={t} P={pieces}, {products} products")


def test_pieces_carry_the_cotangent_back():
  # GDN-2, a loss on the outputs of the last piece alone, slow gates (τ = 8): the earlier
  # pieces' inputs get their gradients only through the entry cotangents carried back. One
  # value head: the carry is per head (GVA's gradients are test_pieces_gradients_match_scan's).
  mixer, t, pieces = "gdn2", 192, 3
  args, kw = make_inputs(mixer, b=1, t=t, h=1, hv=1, dk=64, dv=64, tau=8.0, seed=t)
  last = 128
  grads = lambda impl, tuning: kernel_cases.late_output_grads(mixer, args, kw, last, impl,
                                                              tuning)
  names = kernel_cases.GRAD_NAMES[mixer][:len(args)]
  for name, g, want in zip(names, grads("pallas_gpu", _pieces(pieces)), grads("scan", None)):
    assert_close(g[:, :last], want[:, :last], GRAD_TOL, f"d{name}, earlier pieces")


def _packed_ids(t):
  """Segments 1 | 2 | 3 | 4, then padding (0): a reset inside the first piece (30), one on the
  second piece's first token (128, the pieces of 2 chunks at T = 300 in 3), one inside the
  third (228), the last 10 tokens padding."""
  parts = [(30, 1), (98, 2), (100, 3), (t - 238, 4), (10, 0)]
  return jnp.concatenate([jnp.full((1, n), i) for n, i in parts], 1).astype(jnp.int32)


@pytest.mark.parametrize("mixer", ["kda"] + (["gdn2"] if ON_GPU else []))
def test_packed_rows_in_pieces_match_scan(monkeypatch, mixer):
  # segment_ids cut the carried state at resets, whichever piece they fall in: the maps'
  # pass sees the reset as a zero decay, so a piece after it does not depend on the ones
  # before. Output, final state, residual, and the gradients of <o, W> against the scan. One
  # value head: the resets are per row (GVA in pieces is the other op tests').
  calls = _spy_state_passes(monkeypatch)
  t, pieces = 300, 3
  args, kw = make_inputs(mixer, b=1, t=t, h=1, hv=1, dk=64, dv=64, seed=21)
  kw = dict(kw, segment_ids=_packed_ids(t))
  got = run_jit(mixer, args, **kw, output_final_state=True, return_residual=True,
                implementation="pallas_gpu", tuning=_pieces(pieces))
  want = run_jit(mixer, args, **kw, output_final_state=True, return_residual=True,
                 implementation="scan")
  assert sorted(calls) == [(False, pieces), (True, pieces)], calls
  for name, g, w in zip(("o", "final state", "residual"), got, want):
    assert_close(g, w, FWD_TOL, f"{mixer} packed P={pieces}: {name}")
  w_o = jax.random.normal(jax.random.key(8), args[2].shape)

  def grads(impl, tuning):
    extra = {} if tuning is None else {"tuning": tuning}
    loss = lambda a, s0, ids: jnp.sum(
        run(mixer, a, initial_state=s0, segment_ids=ids, implementation=impl,
            **extra)[0].astype(jnp.float32) * w_o)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(args, kw["initial_state"],
                                                   kw["segment_ids"])
  (g_args, g_s0), (w_args, w_s0) = grads("pallas_gpu", _pieces(pieces)), grads("scan", None)
  names = kernel_cases.GRAD_NAMES[mixer]
  for name, g, w in zip(names, g_args + (g_s0,), w_args + (w_s0,)):
    assert_close(g, w, GRAD_TOL, f"{mixer} packed P={pieces}: d{name}")
