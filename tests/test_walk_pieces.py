"""The walks with every row cut into pieces (`GpuTuning(row_pieces=P)`, `gpu_walks.
walk_pieces_core`).

Off GPU the Mosaic GPU kernels run in JAX's interpreter, so this file runs in `make test`; on a
Hopper GPU the same tests run them compiled. Oracles: the op's `scan` (the recurrence token by
token, float32 at HIGHEST) for the output, the final state and the write residual (2e-2: the
walks' bf16 operands) and for every gradient (3e-2), under jit, with GVA, an initial state,
T that no piece length divides, and pieces of one chunk; and that the maps' walk ran (the
pieces path taken, not the whole-row walk), with the maps' walk on one chain per CTA or two;
log gates down to −1e4 (finite, exact). The maps' walk (`maps_walk`, one chain per CTA or
two) and the reverse walk with `states_only=True` against the whole walks' final state and
entry cotangent: the same products (1e-5); the two chains under the interpreter's race
detector. The auto rule and its model by hand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import kernel_cases
from helpers import assert_close, make_inputs, mosaic_gpu_or_skip, run_jit

ON_GPU, INTERPRET = mosaic_gpu_or_skip()

from lineax_attn.ops import gpu_pieces  # noqa: E402
from lineax_attn.ops import pallas_gpu  # noqa: E402
from pallas_kernels.gpu import chunk_walk as cw  # noqa: E402
from pallas_kernels.gpu import chunk_walk_reverse as cwr  # noqa: E402
from pallas_kernels.gpu import maps_walk as mw  # noqa: E402

FWD_TOL = 2e-2
GRAD_TOL = 3e-2


def _pieces(p, chains=0):
  return pallas_gpu.GpuTuning(forward="walk", row_pieces=p, maps_chains=chains)


def _count_walk_widths(monkeypatch, chains=None):
  """Records the state width (value columns) of every forward walk traced: the pieces' walk
  (`chunk_walk`) and the maps' walk (`maps_walk`, K columns wider); its chains per CTA go to
  `chains` (a list) if given."""
  widths = []
  real_walk, real_maps = cw.chunk_walk, mw.maps_walk

  def walk(*a, **kw):
    widths.append(a[6].shape[-2])
    return real_walk(*a, **kw)

  def maps(*a, **kw):
    widths.append(a[5].shape[-2])
    if chains is not None:
      chains.append(kw["chains"])
    return real_maps(*a, **kw)
  monkeypatch.setattr(cw, "chunk_walk", walk)
  monkeypatch.setattr(mw, "maps_walk", maps)
  return widths


# (mixer, B, T, pieces, maps' chains per CTA; 0: the rule's, one at these sizes, by_rule):
# T = 200 in 2 pieces pads to 256 (two chunks each); 130 in 3 pads to 192 (one chunk each, the
# last mostly padding); T = 1 leaves the second piece all padding. by_rule: row_pieces=0, the
# default, and an auto rule answering `pieces` (one run checks both the rule's plumbing and the
# values in pieces; it was a test of its own at T = 128).
FWD_CASES = [("gated_delta_rule", 1, 200, 2, 0, True), ("delta_rule", 2, 130, 3, 2, False),
             ("linear_attention", 1, 100, 2, 0, False), ("gated_delta_rule", 1, 1, 2, 2, False)]
if ON_GPU:
  FWD_CASES += [("gated_delta_rule", 1, 4096, 8, 2, False), ("delta_rule", 1, 1000, 4, 0, False)]


@pytest.mark.parametrize("mixer,b,t,pieces,chains,by_rule", FWD_CASES)
def test_pieces_forward_matches_scan(monkeypatch, mixer, b, t, pieces, chains, by_rule):
  # by_rule: row_pieces=0 asks the rule at trace time with the call's sizes (B·HV heads of one
  # 64-column block each, the chunks, up to two chains per maps' CTA), and its answer is the
  # pieces the walks run.
  asked = kernel_cases.answer_auto_rule(monkeypatch, pieces) if by_rule else None
  ran = []
  widths = _count_walk_widths(monkeypatch, ran)
  args, kw = make_inputs(mixer, b=b, t=t, h=1, hv=2, dk=64, dv=64, seed=t + pieces)
  kwargs = dict(kw, output_final_state=True, return_residual=True)
  got = run_jit(mixer, args, **kwargs, implementation="pallas_gpu",
                tuning=_pieces(0 if by_rule else pieces, chains))
  want = run_jit(mixer, args, **kwargs, implementation="scan")
  if by_rule:   # (B·HV, K/64, V/64, chunks, SMs, the walks' chains)
    assert asked == [(b * 2, 1, 1, -(-t // 64), gpu_pieces.device_sms(), 2)], asked
  # the pieces' walk and the maps' walk (linear attention: its maps are products, no walk)
  assert sorted(widths) == ([64] if mixer == "linear_attention" else [64, 128]), widths
  assert ran == ([] if mixer == "linear_attention" else [chains or 1]), ran
  for name, g, w in zip(("o", "final state", "residual"), got, want):
    assert_close(g, w, FWD_TOL, f"{mixer} B={b} T={t} P={pieces}: {name}")


def test_pieces_forward_at_k_v_128_on_two_chains(monkeypatch):
  # K = V = 128: the maps' state [I | S] is 4 blocks, the first two Φ's (v = 0), so with two
  # chains one CTA walks Φ alone and the other Ψ alone. T = 128: two pieces of one chunk.
  ran = []
  widths = _count_walk_widths(monkeypatch, ran)
  args, kw = make_inputs("gated_delta_rule", b=1, t=128, h=1, hv=1, dk=128, dv=128, seed=5)
  kwargs = dict(kw, output_final_state=True)
  got = run_jit("gated_delta_rule", args, **kwargs, implementation="pallas_gpu",
                tuning=_pieces(2, 2))
  want = run_jit("gated_delta_rule", args, **kwargs, implementation="scan")
  assert sorted(widths) == [128, 256] and ran == [2], (widths, ran)
  for name, g, w in zip(("o", "final state"), got, want):
    assert_close(g, w, FWD_TOL, f"K = V = 128 in 2 pieces, two chains: {name}")


def test_pieces_take_log_gates_down_to_minus_1e4():
  # Every 37th token's log gate at −1e4 (a state wiped almost to zero, e^{−1e4} = 0 in
  # float32), some in the middle of a piece: Φ of those pieces is ~0 and their Ψ the state
  # after the wipe, so the composed entry states stay finite and the output exact. T = 200 in
  # 2 pieces; one value head (GVA in pieces is the forward cases').
  args, kw = make_inputs("gated_delta_rule", b=1, t=200, h=1, hv=1, dk=64, dv=64, seed=7)
  q, k, v, g, beta = args
  g = jnp.where((jnp.arange(200) % 37 == 5)[None, :, None], -1e4, g)
  kwargs = dict(kw, output_final_state=True)
  got = run_jit("gated_delta_rule", (q, k, v, g, beta), **kwargs, implementation="pallas_gpu",
                tuning=_pieces(2))
  want = run_jit("gated_delta_rule", (q, k, v, g, beta), **kwargs, implementation="scan")
  for name, x, w in zip(("o", "final state"), got, want):
    assert bool(jnp.all(jnp.isfinite(x))), name
    assert_close(x, w, FWD_TOL, f"log gates at -1e4 in 2 pieces: {name}")


# (mixer, B, HV, T, pieces). GDN's gradients on CPU: the carry test below. Two rows (B = 2) of
# two pieces for DeltaNet, GVA for linear attention: each feature once (B2 HV2 took 22 s).
GRAD_CASES = [("delta_rule", 2, 1, 128, 2), ("linear_attention", 1, 2, 100, 2)]
if ON_GPU:
  GRAD_CASES += [("delta_rule", 2, 2, 128, 2), ("gated_delta_rule", 1, 2, 150, 2),
                 ("gated_delta_rule", 1, 2, 2048, 8), ("gated_delta_rule", 2, 2, 333, 3)]


@pytest.mark.parametrize("mixer,b,hv,t,pieces", GRAD_CASES)
def test_pieces_gradients_match_scan(mixer, b, hv, t, pieces):
  # Every gradient, the initial state's and the residual's included, against the scan's: the
  # entry cotangents carried back across the pieces (D and the maps) are what this checks.
  args, kw = make_inputs(mixer, b=b, t=t, h=1, hv=hv, dk=64, dv=64, seed=3 * t + pieces)
  kernel_cases.assert_training_grads_match_scan(mixer, args, kw["initial_state"], _pieces(pieces),
                                                GRAD_TOL, f"{mixer} B={b} T={t} P={pieces}")


# (DeltaNet's only compiled: the carry's code is GDN's, and it costs the CPU suite 10 s. Linear
# attention's entry cotangents are products, not walks: its own case.)
@pytest.mark.parametrize("mixer,t,pieces,chains", [("gated_delta_rule", 150, 2, 2),
                                                   ("linear_attention", 150, 2, 0)]
                         + ([("delta_rule", 192, 3, 1)] if ON_GPU else []))
def test_pieces_carry_the_cotangent_back(mixer, t, pieces, chains):
  # A loss on the outputs of the last piece only, with slow gates (τ = 8): the earlier pieces'
  # inputs get their gradients only through the entry cotangents carried back across the
  # pieces (without the carried local terms D, their dk was off by 1.0). The loss reads o
  # alone, so the final state's and the residual's cotangents come as symbolic zeros. One
  # value head: the carry is per head (GVA's gradients are test_pieces_gradients_match_scan's).
  args, kw = make_inputs(mixer, b=1, t=t, h=1, hv=1, dk=64, dv=64, tau=8.0, seed=t)
  last = -(-t // (64 * pieces)) * 64 * (pieces - 1)     # where the last piece starts
  loss = lambda impl, tuning: kernel_cases.late_output_grads(mixer, args, kw, last, impl, tuning)
  names = kernel_cases.GRAD_NAMES[mixer][:len(args)]
  for name, g, want in zip(names, loss("pallas_gpu", _pieces(pieces, chains)),
                           loss("scan", None)):
    early = slice(0, last)   # the earlier pieces' gradients: the carry's alone
    assert_close(g[:, early], want[:, early], GRAD_TOL,
                 f"{mixer} P={pieces}: d{name}, earlier pieces")
    assert_close(g, want, GRAD_TOL, f"{mixer} P={pieces}: d{name}")


# (Gated on two chains at K 64, V 128 is slow: the ungated case has its spare chain, the one-chain
# case its gates. Gated on two chains at K = V = 128 is slow too: K 128, V 64 has the gated
# two-chain walk at K 128 with its rings wrapping, the ungated case a second CTA of two chains,
# and test_pieces_forward_at_k_v_128_on_two_chains the four blocks at K = V = 128, Φ alone in
# one CTA and Ψ in the other.)
@pytest.mark.parametrize("gated,chains,dk,dv", [
    (True, 1, 64, 128), pytest.param(True, 2, 64, 128, marks=pytest.mark.slow),
    (False, 2, 64, 128), pytest.param(True, 2, 128, 128, marks=pytest.mark.slow),
    (True, 2, 128, 64)])
def test_maps_walk_gives_the_whole_walks_final_states(gated, chains, dk, dv):
  # GDN and DeltaNet, a ring that wraps. The maps' walk gets a state 64 columns wider than v,
  # [A | S0]: its last V columns must end as the whole walk's from S0, and its first 64 as a
  # whole walk's from A with v = 0 (the maps' Φ columns). 64 + V 128 is 3 blocks: with two
  # chains the second CTA's spare chain must store nothing over them; 64 + V 64 at K 128 is 2,
  # the second chain of the one CTA a value block. The rings wrap: five chunks at K 64 (the
  # walks' rings hold four), four at K 128 (the maps' ring holds three, the walk's two). One
  # value head: the chains and blocks are per head (GVA through the maps' walk is
  # test_pieces_forward_matches_scan's).
  t = 320 if dk == 64 else 256
  q, k, v, t0, g, beta, s0t = kernel_cases.walk_inputs(1, t, 1, 1, dk, dv, seed=9)
  walk = jax.jit(lambda *a: cw.chunk_walk(*a, scale=0.125, gated=gated, interpret=INTERPRET))
  lead = s0t[:, :, :64] * 0.5                                      # A: [B, HV, 64, K]
  (maps,) = jax.jit(lambda *a: mw.maps_walk(*a, gated=gated, chains=chains,
                                            interpret=INTERPRET))(
      k, v, t0, g, beta, jnp.concatenate([lead, s0t], axis=2))
  assert maps.shape == (1, 1, 64 + dv, dk) and bool(jnp.any(maps != 0))
  assert_close(maps[:, :, 64:], walk(q, k, v, t0, g, beta, s0t)[2], 1e-5,
               "the value columns, maps' walk against the whole walk")
  assert_close(maps[:, :, :64], walk(q, k, jnp.zeros_like(v[..., :64]), t0, g, beta, lead)[2],
               1e-5, "the leading columns (v = 0), maps' walk against the whole walk")


@pytest.mark.skipif(ON_GPU, reason="the race detector is the interpreter's")
def test_maps_walk_chains_share_the_ring_without_races():
  # Two chains and the factors' warpgroup read one ring; each chain stages its own register
  # operands (interpreter only). The detector sees register loads and stores of shared memory.
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  _, k, v, t0, g, beta, s0t = kernel_cases.walk_inputs(1, 192, 1, 1, 64, 64, seed=4)
  mw.maps_walk(k, v, t0, g, beta, jnp.concatenate([s0t, s0t], axis=2), chains=2,
               interpret=plgpu.InterpretGPUParams(detect_races=True))
  assert gpu_callbacks.get_races().races_found is False


# (Linear attention's case is slow: states_only only leaves out the stores of dE and dh, alike
# for every mixer (the GDN case checks it); the walk without T0 is test_chunk_walk.py's
# test_linear_attention_walks_match_their_references's; and the op never asks it of linear
# attention, whose entry cotangents are products.)
@pytest.mark.parametrize("delta,gated", [
    (True, True), pytest.param(False, False, marks=pytest.mark.slow)])
def test_states_only_reverse_walk_gives_the_whole_walks_entry_cotangent(delta, gated):
  # Four chunks: the reverse walk's ring (three at K 64) wraps.
  q, k, _, t0, g, beta, dsf_t = kernel_cases.walk_inputs(1, 256, 1, 2, 64, 128, seed=8)
  r = jax.random.split(jax.random.key(2), 2)
  do, dx = (jax.random.normal(x, (1, 256, 2, 128)).astype(jnp.bfloat16) for x in r)
  t0 = t0 if delta else None
  kw = dict(scale=0.125, gated=gated, interpret=INTERPRET)
  args = (q, k, t0, g, beta, do, dx, dsf_t)
  whole = jax.jit(lambda *a: cwr.chunk_walk_reverse(*a, **kw))(*args)
  (alone,) = jax.jit(lambda *a: cwr.chunk_walk_reverse(*a, **kw, states_only=True))(*args)
  assert alone.shape == whole[2].shape and bool(jnp.any(alone != 0))
  assert_close(alone, whole[2], 1e-5, "entry cotangent, states_only against the whole walk")


def test_walks_refuse_states_they_do_not_take():
  q, k, v, t0, g, beta, s0t = kernel_cases.walk_inputs(1, 64, 1, 1, 64, 64, seed=0)
  wide = jnp.zeros((1, 1, 128, 64))
  with pytest.raises(ValueError, match="state columns"):   # wider states: the maps' walk's
    cw.chunk_walk(q, k, v, t0, g, beta, wide, scale=0.125, interpret=INTERPRET)
  with pytest.raises(ValueError, match="state columns"):
    mw.maps_walk(k, v, t0, g, beta, wide[:, :, :96], interpret=INTERPRET)
  with pytest.raises(ValueError, match="chains"):
    mw.maps_walk(k, v, t0, g, beta, wide, chains=3, interpret=INTERPRET)
  with pytest.raises(ValueError, match="linear attention"):
    mw.maps_walk(k, v, None, g, beta, wide, interpret=INTERPRET)


# Chunk steps by `predicted_steps`, with the H200's constants: whole rows 2·waves·N; P pieces
# (maps + 3 main waves)·N/P + 64, the maps' waves at 0.6 a one-chain wave and 0.6 · 1.65 =
# 0.99 a two-chain one. Arguments: B·HV, K/64, V/64, chunks, SMs, the maps' pass's chains per
# CTA at most (2: the walks' `maps_walk`; 1: the state pass).
@pytest.mark.parametrize("heads,kb,vb,chunks,sms,chains,want", [
    # B1 T65536 H16 K=V=128: whole 2048; P4 (0.99 + 3)·256 + 64 = 1085.4 (256 chains, two a
    # CTA: one wave); P8 (2·0.99 + 2·3)·128 + 64, the same (a tie: fewer). Measured: P4 on two
    # chains 3.84 ms, whole rows 5.84, P8 3.93 (docs/BENCHMARKS.md "twenty-first stage").
    (16, 2, 2, 1024, 132, 2, 4),
    (16, 2, 2, 1024, 132, 1, 4),     # one chain a CTA: P4 (1.2 + 3)·256 + 64 = 1139.2 = P8's
    (8, 2, 2, 1024, 132, 2, 8),      # H8: P4 (0.6 + 3)·256 + 64 = 985.6, P8 3.99·128 + 64 = 574.7
    (16, 1, 2, 1024, 132, 2, 8),     # K 64, V 128 (3 blocks): P4 3.99·256 + 64, P8 (1.8 + 6)·128 + 64
    (16, 1, 2, 1024, 132, 1, 8),     # ... one a CTA: P4 (1.2 + 3)·256 + 64 = 1139.2, P8 1062.4
    (64, 2, 2, 1024, 132, 2, 1),     # B4 H16: the passes fill the GPU already
    (32, 2, 2, 512, 132, 2, 1),      # B2 T32768: P2 3.99·256 + 64 = 1085.4 against 1024
    (32, 2, 2, 512, 132, 1, 1),      # ... one chain a CTA: P2 (1.2 + 3)·256 + 64 = 1139.2
    (16, 2, 2, 256, 132, 2, 4),      # B1 T16384: P4 3.99·64 + 64 = 319.4 against 512
    (16, 2, 2, 16, 132, 2, 1),       # 16 chunks: P2 (0.6 + 3)·8 + 64 = 92.8 against 32
    (16, 2, 2, 8, 132, 2, 1),        # 8 chunks: no piece would reach 8
    (1, 1, 1, 1024, 4, 1, 4),        # 4 SMs, 1 CTA: P4 (1.2 + 3)·256 + 64 = 1139.2 against 2048
    (16, 0, 2, 1024, 132, 2, 4),     # linear attention (no maps' pass): P4 2·256 + 64, P8 alike
    (32, 0, 2, 512, 132, 2, 2),      # linear attention at B2 T32768: P2 2·256 + 64 against 1024
])
def test_auto_row_pieces_by_hand(heads, kb, vb, chunks, sms, chains, want):
  assert gpu_pieces.auto_row_pieces(heads, kb, vb, chunks, sms, chains) == want


def test_predicted_steps_and_chains_by_hand():
  steps = lambda *a: pytest.approx(gpu_pieces.predicted_steps(*a))
  assert steps(1, 16, 2, 2, 1024, 132) == 2048
  assert steps(4, 16, 2, 2, 1024, 132) == (0.6 * 2 + 3) * 256 + 64     # 256 maps CTAs: 2 waves
  assert steps(4, 16, 2, 2, 1024, 132, 2) == (0.99 + 3) * 256 + 64    # 128 CTAs of two chains
  assert steps(3, 16, 2, 2, 1000, 132) == (0.6 * 2 + 3) * 334 + 64    # 192 maps CTAs
  assert steps(4, 16, 0, 2, 1024, 132) == 2 * 256 + 64                # no maps' pass
  chains = gpu_pieces.maps_chains
  assert chains(64, 2, 2, 132) == 2        # 256 chains: 1.65 one-chain waves against 2
  assert chains(32, 2, 2, 132) == 1        # 128 chains fit one wave alone
  assert chains(64, 2, 2, 132, max_chains=1) == 1
  assert chains(64, 1, 2, 132) == 2        # 3 blocks a head: 192 chains, 128 CTAs of two
  assert chains(128, 2, 2, 132) == 2       # 512 chains: 2 · 1.65 = 3.3 waves against 4
  assert chains(128, 1, 2, 132) == 1       # 384 chains: 2 · 1.65 = 3.3 against 3


def test_explicit_row_pieces_skip_the_rule(monkeypatch):
  # (The rule's answer reaching the walks: test_pieces_forward_matches_scan's by_rule case.)
  asked = kernel_cases.answer_auto_rule(monkeypatch, 2)
  assert gpu_pieces.row_pieces(pallas_gpu.GpuTuning(row_pieces=3), 1, 2, 64, 64, 128, 64) == 3
  assert gpu_pieces.row_pieces(pallas_gpu.GpuTuning(row_pieces=1), 1, 2, 64, 64, 128, 64) == 1
  assert not asked
  assert pallas_gpu.GpuTuning().row_pieces == 0      # the rule is the default


@pytest.mark.parametrize("bad", [-1, 65, True, 2.0, "4"])
def test_row_pieces_must_be_a_small_int(bad):
  with pytest.raises(ValueError, match="row_pieces"):
    pallas_gpu.GpuTuning(row_pieces=bad)


def test_row_pieces_parses_from_the_command_line():
  assert pallas_gpu.GpuTuning.parse("row_pieces=8").row_pieces == 8


def test_two_chains_only_where_their_steps_pay(monkeypatch):
  # Were a two-chain CTA's step twice a one-chain step, two chains would buy nothing: the rule
  # keeps one (256 chains: two waves either way, counted in one-chain steps).
  monkeypatch.setattr(gpu_pieces, "TWO_CHAIN_STEP_COST", 2.0)
  assert gpu_pieces.maps_chains(64, 2, 2, 132) == 1
  assert gpu_pieces.predicted_steps(4, 16, 2, 2, 1024, 132, 2) == pytest.approx(
      (0.6 * 2 + 3) * 256 + 64)
  monkeypatch.setattr(gpu_pieces, "TWO_CHAIN_STEP_COST", 1.5)   # 1.5 waves against 2
  assert gpu_pieces.maps_chains(64, 2, 2, 132) == 2
  assert gpu_pieces.predicted_steps(4, 16, 2, 2, 1024, 132, 2) == pytest.approx(
      (0.6 * 1.5 + 3) * 256 + 64)
