"""The `triton` implementation's CPU side: sizes, dispatch and fallback (no GPU, no extra needed).

The kernels themselves run only compiled on an NVIDIA GPU (jax-triton has no CPU lowering):
tests/test_triton_gpu.py.
"""

from __future__ import annotations

import importlib.util
import logging

import jax
import jax.numpy as jnp
import pytest

from helpers import assert_close, make_inputs, run
from lineax_attn import ops
from lineax_attn.ops import api
from lineax_attn.ops import gpu_chunks
from lineax_attn.ops import segments
from lineax_attn.ops import triton_gpu
from pallas_kernels.gpu.triton import blocks


def test_block_sizes_are_fixed_per_head_dims():
  # (BLOCK_V, warps, stages) of the state pass, as blocks' docstring derives them: Hopper's
  # timed on the H200 (3 stages forward, 2 reverse), other GPUs' and K = 256's chosen by
  # ptxas (spill-free); BLOCK_V the largest of the cap that divides V.
  launch = blocks.state_launch
  assert [launch(dk, 128, hopper=True) for dk in (16, 64, 128, 256)] == [
      (64, 4, 3), (64, 4, 3), (64, 4, 3), (16, 8, 1)]
  assert launch(128, 128, reverse=True, hopper=True) == (64, 4, 2)
  assert [launch(dk, 128, reverse=r) for dk in (64, 128, 256) for r in (False, True)] == [
      (32, 8, 2)] * 4 + [(16, 8, 1)] * 2
  assert launch(64, 48, hopper=True)[0] == 16 and launch(128, 96, hopper=True)[0] == 32
  assert launch(128, 96)[0] == 32 and launch(128, 80)[0] == 16
  with pytest.raises(ValueError, match="dv=40"):
    launch(64, 40)


def test_intra_kernel_loop_widths():
  # Columns a step of the intra kernels' loops with loop-invariant [C, C] operands take
  # (blocks' docstrings: triton 3.6 converts those operands once per step, so wider is fewer
  # conversions; the widths are what ptxas found spill-free): the widest dividing the dims,
  # 64 on Hopper for the delta-rule backward's dq / dk loop, 32 elsewhere.
  assert [blocks.solve_bk(d, d) for d in (64, 128, 256)] == [64, 64, 64]
  assert blocks.solve_bk(128, 96) == 32 and blocks.solve_bk(64, 48) == 16
  assert [blocks.grads_bk(d, hopper=True) for d in (64, 128)] == [64, 64]
  assert [blocks.grads_bk(d, hopper=False) for d in (64, 128)] == [32, 32]
  assert blocks.grads_bk(16, hopper=True) == 16
  assert [blocks.channel_bwd_solve_bk(d, d, hopper=True) for d in (64, 128)] == [32, 32]
  assert blocks.channel_bwd_solve_bk(128, 48, hopper=True) == blocks.CHANNEL_BK == 16
  assert blocks.channel_bwd_solve_bk(128, 128, hopper=False) == 16
  # The timing-only phases are distinct bits (their sums name the phases left out).
  phases = (blocks.PHASE_SOLVE, blocks.PHASE_ANCHORED, blocks.PHASE_BANDS)
  assert sorted(phases) == [1, 2, 4]
  assert blocks.INTRA_SLICE_STAGES == 2 and blocks.CHANNEL_BAND_STAGES == 1


@pytest.mark.parametrize("chunk,dk,dv,word", [(32, 64, 64, "chunk_size"), (64, 96, 64, "K=96"),
                                              (64, 64, 40, "V=40"), (64, 64, 1024, "V=1024")])
def test_unsupported_sizes_name_the_reason(chunk, dk, dv, word):
  assert word in blocks.supported(chunk, dk, dv)
  assert blocks.supported(64, 128, 128) is None


def test_off_gpu_the_op_falls_back_to_chunk_with_one_log_line(caplog):
  reason = triton_gpu.unsupported_reason(dk=32, dv=32, chunk_size=64, varlen=False)
  missing = [m for m in ("triton", "jax_triton") if importlib.util.find_spec(m) is None]
  if (jax.default_backend() == "gpu" and not missing) or triton_gpu.interpreted():
    pytest.skip("this machine runs the kernels (tests/test_triton_gpu.py)")
  assert reason and (("not installed" in reason) if missing else ("NVIDIA GPU" in reason))
  args, kw = make_inputs("gated_delta_rule", b=1, t=70, h=2, dk=32, dv=32, seed=0)
  triton_gpu._warned.clear()
  with caplog.at_level(logging.WARNING):
    got = jax.jit(lambda *a: run("gated_delta_rule", a, implementation="triton", **kw)[0])(*args)
    jax.jit(lambda *a: run("gated_delta_rule", a, implementation="triton", **kw)[0] * 2)(*args)
  lines = [r for r in caplog.records if "falls back to implementation='chunk'" in r.message]
  assert len(lines) == 1 and reason in lines[0].message
  want = run("gated_delta_rule", args, implementation="scan", **kw)[0]
  assert_close(got, want, 1e-4, "fallback output vs scan")


def test_registered_with_the_gpu_tuning_and_not_the_default_off_gpu():
  assert "triton" in ops.available_implementations()
  assert api.default_implementation("cpu") == "chunk"
  assert api.check_tuning(ops.GpuTuning(remat_intra=False), "triton") == ops.GpuTuning(
      remat_intra=False)
  with pytest.raises(ValueError, match="tuning"):
    api.check_tuning("remat_intra=false", "triton")


def test_direct_call_past_the_dispatch_refuses_rather_than_runs_wrong():
  if triton_gpu.available():
    pytest.skip("the kernels run here")
  args, _ = make_inputs("delta_rule", b=1, t=64, h=1, dk=32, dv=32, seed=1, with_state=False)
  q, k, v, beta = args
  layout = segments.SegmentLayout()
  with pytest.raises(ValueError, match="triton cannot run this call"):
    triton_gpu.triton_delta_family("delta_rule", q, k, v, {"beta": beta}, scale=32 ** -0.5,
                                   initial_state=None, layout=layout, chunk_size=64)


def test_kernel_module_needs_the_extra():
  if importlib.util.find_spec("triton") is not None:
    pytest.skip("triton is installed here")
  with pytest.raises(ImportError):
    importlib.import_module("pallas_kernels.gpu.triton.state_pass")
  # ... while the dispatch and size tables import without it (this file's own imports).
  assert jnp.asarray(blocks.CHUNK) == 64


def test_triton_intra_is_a_checked_tuning_field():
  # The triton path reads `triton_intra` (default "auto"), never `intra`.
  assert ops.GpuTuning().triton_intra == "auto" and ops.GpuTuning().intra == "kernel"
  assert ops.GpuTuning.parse("triton_intra=kernel").triton_intra == "kernel"
  with pytest.raises(ValueError, match="triton_intra"):
    ops.GpuTuning(triton_intra="fast")


@pytest.mark.parametrize("mixer,auto", [("linear_attention", "xla"), ("simple_gla", "xla"),
                                        ("delta_rule", "kernel"), ("gated_delta_rule", "kernel"),
                                        ("kda", "kernel"), ("gdn2", "kernel")])
def test_auto_intra_takes_the_kernels_measured_faster(mixer, auto):
  # "auto": the Triton intra kernels wherever they exist (the scalar-gate delta rule and the
  # per-channel mixers: all faster than XLA's part on the H200), XLA's part for the mixers
  # without a delta edit; an explicit choice is taken as given.
  assert triton_gpu.intra_choice(mixer, ops.GpuTuning()) == auto
  for choice in ("kernel", "xla"):
    assert triton_gpu.intra_choice(mixer, ops.GpuTuning(triton_intra=choice)) == choice


def test_intra_kernel_sizes():
  # The Triton intra-chunk kernels' size check lives beside them, in a module that imports
  # triton: here only when it is installed.
  if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed")
  from pallas_kernels.gpu.triton import intra_chunk as tic
  assert tic.supported(64, 128, 64) is None and "K=32" in tic.supported(64, 32, 64)


def test_channel_intra_kernel_applies_where_it_should():
  # The Triton channel-gate kernel (KDA, GDN-2) is taken only on the Triton path, on request,
  # for per-channel gates with an erase key, at sizes it takes.
  from lineax_attn.ops import gpu_prepare  # pylint: disable=g-import-not-at-top
  x = jnp.zeros((1, 64, 2, 64))
  channel, scalar = jnp.zeros((1, 64, 2, 64)), jnp.zeros((1, 64, 2))
  on = ops.GpuTuning(intra="kernel")
  applies = lambda g=channel, kt=x, c=64, tuning=on, kernels="triton", q=x: (
      gpu_prepare.channel_kernel_applies(q, kt, x, g, c=c, tuning=tuning, kernels=kernels))
  assert applies()
  # pallas_gpu keeps its XLA channel path when asked to ...
  assert not applies(tuning=ops.GpuTuning(intra="kernel", channel_intra="xla"), kernels="mosaic")
  # ... and by default ("auto") borrows the Triton kernels exactly where the extra runs.
  assert applies(kernels="mosaic") == triton_gpu.available()
  # The triton path does not read channel_intra (it gets its resolved triton_intra as `intra`).
  borrow = ops.GpuTuning(intra="xla", channel_intra="triton")
  assert not applies(tuning=borrow)
  if not triton_gpu.available():                # asked for outright, they need the extra
    with pytest.raises(ValueError, match="needs the triton extra"):
      applies(tuning=borrow, kernels="mosaic")
  with pytest.raises(ValueError, match="channel_intra"):
    ops.GpuTuning(channel_intra="kernel")
  with pytest.raises(ValueError, match="channel_grads"):
    ops.GpuTuning(channel_grads="triton")
  assert ops.GpuTuning.parse("channel_grads=kernel").channel_grads == "kernel"
  with pytest.raises(ValueError, match="intra_grads"):
    ops.GpuTuning(intra_grads="triton")
  # "auto" (the default) fuses for both mixers: timed faster on the H200 for GDN and, since the
  # ungated backward skips the gate's work, for DeltaNet.
  from lineax_attn.ops.gpu_tuning import fused_intra_grads  # pylint: disable=g-import-not-at-top
  assert ops.GpuTuning().intra_grads == "auto"
  assert fused_intra_grads(ops.GpuTuning(), gated=True)
  assert fused_intra_grads(ops.GpuTuning(), gated=False)
  for gated in (False, True):
    assert fused_intra_grads(ops.GpuTuning(intra_grads="kernel"), gated)
    assert not fused_intra_grads(ops.GpuTuning(intra_grads="xla"), gated)
  assert ops.GpuTuning.parse("intra_grads=kernel").intra_grads == "kernel"
  assert not applies(tuning=ops.GpuTuning(intra="xla"))
  assert not applies(g=scalar) and not applies(g=None) and not applies(kt=None)
  assert not applies(c=32) and not applies(q=jnp.zeros((1, 64, 2, 32)))


def _exact_channel_preparation(segidx, c):
  """prepare_chunks' six outputs for per-channel gates in float32 (HIGHEST, exact solve): the
  oracle of the channel-gate kernels and of their backward's glue."""
  from lineax_attn.ops import chunked, gpu_chunks  # pylint: disable=g-import-not-at-top

  def run(q, k, kt, vt, g):
    ch = lambda x: gpu_chunks.to_chunks(x, c)
    same = cont = keep = None
    if segidx is not None:
      same, cont, keep = gpu_chunks.segment_masks(segidx, c)
    G = jnp.cumsum(g.reshape(g.shape[0], -1, c, *g.shape[2:]), axis=2).reshape(g.shape)
    qg, p, y, u, kg, dc = chunked._intra_chunk(
        ch(q), ch(k), ch(kt), ch(vt), ch(G), "channel", same, cont, keep, matmul="highest",
        solve="trsm")
    return -y, qg, p, u, kg, jnp.broadcast_to(dc, qg.shape[:3] + (qg.shape[-1],))
  return run


@pytest.mark.parametrize("packed", [False, True])
def test_channel_backward_glue_from_exact_pair_grads_equals_autodiff(packed):
  # channel_grads (the XLA half of the channel-gate backward: QG / KG / gc terms, the entry and
  # exit factors, dG = Q ⊙ dQ + K̃ ⊙ dK̃ − K ⊙ dK of the pairs, the in-chunk reverse cumsum),
  # fed with the exact cotangents of the kernel's half (its oracle), must give autodiff of the
  # whole preparation; and the custom VJP wired around the two halves must too.
  from lineax_attn.ops import gpu_prepare  # pylint: disable=g-import-not-at-top
  args, _ = make_inputs("gdn2", b=1, t=64, h=2, hv=2, dk=16, dv=16, seed=3)
  q, k, v, g, b, w = args
  g = g / 10.0   # weak decays, so pairs across the segment boundary are not negligible
  kt, vt = k * b, v * w
  segidx = jnp.asarray([[0] * 20 + [1] * 44], jnp.int32) if packed else None
  c = 32
  exact = _exact_channel_preparation(segidx, c)
  # Each side one jitted program (eager dispatch compiled ~120 primitives one by one).
  outs = jax.eval_shape(exact, q, k, kt, vt, g)
  cts = tuple(jax.random.normal(jax.random.key(i), o.shape) for i, o in enumerate(outs))
  want = jax.jit(lambda p, cts: jax.vjp(exact, *p)[1](cts))((q, k, kt, vt, g), cts)

  def glue(q, k, kt, vt, g, cts):
    pair_grads = gpu_prepare.channel_pair_solve_vjp_reference(q, k, kt, vt, g, segidx, cts[0],
                                                              cts[2], cts[3], c=c)
    return gpu_prepare.channel_grads(q, k, kt, vt, g, segidx, pair_grads, cts, c=c)
  got = jax.jit(glue)(q, k, kt, vt, g, cts)
  for name, g_, w_ in zip(("q", "k", "kt", "vt", "g"), got, want):
    assert_close(g_, w_, 1e-5, f"d{name} (glue)")
  # The custom VJP around the GPU-only kernels, with their oracles standing in for them: the
  # kernel half then XLA's glue, or (fused_grads) one kernel for both, whose stand-in is the
  # half's oracle followed by the glue (its result order (dq, dk, dkt, dvt, dg) is the
  # kernel's; the Triton interpreter checked the kernel against this composition). The kernels
  # take the chunk-summed gates G of a Triton kernel (`_chunk_gates`, checked against cumsum in
  # tests/test_triton_gpu.py); its stand-in passes g through, so the oracles get the raw gate.
  stubs = ("_channel_kernel_call", "_channel_kernel_bwd_call", "_channel_kernel_grads_call",
           "_chunk_gates")
  saved = {name: getattr(gpu_prepare, name) for name in stubs}
  gpu_prepare._chunk_gates = lambda g, c: g
  gpu_prepare._channel_kernel_call = (
      lambda q, k, kt, vt, g, segidx, c, span=0.0, solve="fused": exact(q, k, kt, vt, g)
      + (jnp.zeros(()),))
  calls = []
  gpu_prepare._channel_kernel_bwd_call = (
      lambda q, k, kt, vt, g, segidx, m, d_ny, d_p, d_u, c, span=0.0: calls.append("half") or
      gpu_prepare.channel_pair_solve_vjp_reference(q, k, kt, vt, g, segidx, d_ny, d_p, d_u, c=c))

  def fused(q, k, kt, vt, g, segidx, m, cts, c, span=0.0):
    calls.append("fused")
    pairs = gpu_prepare.channel_pair_solve_vjp_reference(q, k, kt, vt, g, segidx, cts[0],
                                                         cts[2], cts[3], c=c)
    return gpu_prepare.channel_grads(q, k, kt, vt, g, segidx, pairs, cts, c=c)
  gpu_prepare._channel_kernel_grads_call = fused
  try:
    for fused_grads in (False, True):
      calls.clear()
      op = lambda *a, f=fused_grads: gpu_prepare.channel_intra_kernel(*a, segidx, c, f)
      loss = lambda *a, op=op: sum(jnp.sum(o * ct) for o, ct in zip(op(*a), cts))
      got = jax.jit(jax.grad(loss, argnums=range(5)))(q, k, kt, vt, g)
      assert calls == ["fused" if fused_grads else "half"]
      for name, g_, w_ in zip(("q", "k", "kt", "vt", "g"), got, want):
        assert g_.dtype == w_.dtype
        assert_close(g_, w_, 1e-5, f"d{name} (custom VJP, fused_grads={fused_grads})")
  finally:
    for name, fn in saved.items():
      setattr(gpu_prepare, name, fn)


# pieces 2: every row cut in two (T = 256, two chunks a piece), the maps' pass and the carried
# cotangents of `gpu_vjps.pass_forward` / `pass_backward`, as the split composition's pass.
@pytest.mark.parametrize("pieces", [1, 2])
def test_channel_state_core_vjp_wiring_matches_the_split_composition(monkeypatch, pieces):
  # gpu_prepare.channel_state_core (GpuTuning.channel_grads="states"): the channel kernels, with
  # KDA's β applied on chip, and the state pass under one custom VJP, whose backward runs the
  # state pass's reverse kernel and hands E, dE, dO and the chunk states to one
  # products-making kernel. Its Triton kernels are GPU / interpreter only
  # (tests/test_triton_gpu.py); here they are replaced by their oracles (the exact preparation
  # rounded to the kernel's dtypes; for the backward, XLA's products, the pairs' exact VJP, the
  # glue, the gates' chain rule and q's scale), the Mosaic state pass runs in its interpreter,
  # and values and every gradient must equal the split composition: s q, k̃ = k ⊙ β, ṽ = v ⊙ β
  # and the same preparation differentiated by autodiff, into `gpu_vjps.state_pass` (its dE
  # rounded to bf16 as the states path's reverse pass writes it).
  from lineax_attn.ops import gpu_prepare, gpu_vjps  # pylint: disable=g-import-not-at-top
  args, _ = make_inputs("kda", b=1, t=128 * pieces, h=1, hv=1, dk=64, dv=64, seed=13)
  q, k, v, g, beta = args
  g = g / 64.0   # weak decays: the state carried across chunks (and pieces) matters
  beta = beta[..., None]                      # [B, T, HV, 1]: one factor per row
  s0 = jax.random.normal(jax.random.key(14), (1, 1, 64, 64))
  c = 64
  exact = _exact_channel_preparation(None, c)
  kernel_dtypes = (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.bfloat16,
                   jnp.float32)
  prep = lambda *a: tuple(x.astype(dt) for x, dt in zip(exact(*a), kernel_dtypes))
  interpret = gpu_vjps.interpret_params()

  def states_call(q, k, v, erase, write, g, segidx, m, de, do, e, h, dh, c, span=0.0,
                  on_chip=True, q_scale=1.0, products="channel"):
    assert on_chip and products == "channel"   # (channel_state_core's default)
    q = q * q_scale
    kt, vt = k * erase, v * write
    # (do in o's [B, T, HV, V] layout, as the states path hands it over)
    d_ny, d_qg, d_p, d_kg, d_gc = gpu_vjps.state_pass_products(de, gpu_chunks.to_chunks(do, c),
                                                               e, h, dh)
    cts = (d_ny.astype(jnp.bfloat16), d_qg.astype(jnp.bfloat16), d_p.astype(jnp.bfloat16), de,
           d_kg.astype(jnp.bfloat16), d_gc)
    pairs = gpu_prepare.channel_pair_solve_vjp_reference(q, k, kt, vt, g, segidx, cts[0],
                                                         cts[2], cts[3], c=c)
    dq, dk, dkt, dvt, dg = gpu_prepare.channel_grads(q, k, kt, vt, g, segidx, pairs, cts, c=c)
    return (dq * q_scale, dk + dkt * erase, dvt * write, dg, jnp.sum(dkt * k, -1),
            jnp.sum(dvt * v, -1))                # row gates' gradients as the kernel's rows

  monkeypatch.setattr(gpu_prepare, "_chunk_gates", lambda g, c: g)   # the stand-ins take g
  monkeypatch.setattr(
      gpu_prepare, "_channel_kernel_call",
      lambda q, k, kt, vt, g, segidx, c, span=0.0, erase=None, write=None, q_scale=1.0,
      solve="fused": prep(q * q_scale, k, kt * erase, vt * write, g) + (jnp.zeros(()),))
  monkeypatch.setattr(gpu_prepare, "_channel_kernel_states_call", states_call)
  w = [jax.random.normal(jax.random.key(20 + i), s) for i, s in
       enumerate([(1, 128 * pieces, 1, 64), (1, 1, 2 * pieces, 64, 64), (1, 1, 64, 64)])]
  loss = lambda outs: sum(jnp.sum(o * w_) for o, w_ in zip(outs, w))

  def fused(q, k, v, beta, g, s0):
    return gpu_prepare.channel_state_core(q, k, v, beta, beta, g, s0, None, c=c, span=80.0,
                                          kernels="mosaic", interpret=interpret, scale=0.5,
                                          pieces=pieces)

  # The states path's reverse pass writes dE (U's cotangent) in bf16, which is how every
  # kernel reading it takes it; the split composition's float32 dE is rounded the same way
  # where it leaves the pass, so the two stay equal to float32 accuracy.
  @jax.custom_vjp
  def de_in_bf16(u):
    return u
  de_in_bf16.defvjp(lambda u: (u, None),
                    lambda _, ct: (ct.astype(jnp.bfloat16).astype(ct.dtype),))

  def split(q, k, v, beta, g, s0):   # q's scale applied outside, as the other paths do
    ny, qg, p, u, kg, gc = prep(q * 0.5, k, k * beta, v * beta, g)
    o, e, s_final = gpu_vjps.state_pass(ny, qg, p, de_in_bf16(u), kg, gc, s0, interpret,
                                        "mosaic", pieces=pieces)
    return gpu_chunks.from_chunks(o), e, s_final   # o in the op's layout, as fused gives it

  primals = (q, k, v, beta, g, s0)
  got, want = jax.jit(fused)(*primals), jax.jit(split)(*primals)   # (eager: ~130 compiles)
  for name, a, b in zip(("o", "e", "s_final"), got, want):
    assert_close(a, b, 1e-6, name)
  grad = lambda f: jax.jit(jax.grad(lambda *a: loss(f(*a)), argnums=range(6)))(*primals)
  for name, a, b in zip(("q", "k", "v", "beta", "g", "s0"), grad(fused), grad(split)):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert_close(a, b, 1e-5, f"d{name}")
