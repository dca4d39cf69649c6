"""The `pallas_gpu` implementation: Mosaic GPU state-passing kernels and the ops built on them.

On a machine without GPU the kernels run in JAX's Mosaic GPU interpreter (`plgpu.kernel` style
is what it supports), so this file runs in `make test`; on a Hopper GPU the same tests run the
compiled kernels. Shapes are small (K = V = 64, C = 64, a few chunks) to keep the interpreter
within the CPU budget.

Oracles:
* kernel forward vs the same recurrence as a float32 `lax.scan` with the kernel's bf16 operand
  rounding emulated (so only accumulation order differs: rel 1e-4);
* kernel backward vs autodiff of the unrounded float32 recurrence (bf16 operands: rel 2e-2);
* public ops vs the `scan` reference and the `chunk` form, forward and gradients, with
  initial/final state, GVA, segment ids and T not a multiple of the chunk (bf16 matmul
  operands, float32 accumulation and state: rel 2e-2 forward, 3e-2 gradients).
"""

from __future__ import annotations

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (MIXERS, assert_close, make_inputs, mosaic_gpu_or_skip, output_and_state_grads,
                     run, run_jit)

ON_GPU, INTERPRET = mosaic_gpu_or_skip()

import kernel_cases  # noqa: E402
from lineax_attn import ops  # noqa: E402
from lineax_attn.ops import api  # noqa: E402
from lineax_attn.ops import pallas_gpu  # noqa: E402
from pallas_kernels.gpu import intra_chunk as ic  # noqa: E402
from pallas_kernels.gpu import state_passing as sp  # noqa: E402

FWD_TOL = 2e-2    # bf16 matmul operands (Y, S, E, P, QG, KG), float32 accumulation and state
GRAD_TOL = 3e-2


_chunk_inputs = kernel_cases.state_pass_inputs


# K = 128 (two swizzle groups per row, M = 128 state matmuls) only compiled: the interpreter
# gains nothing from it but time.
@pytest.mark.parametrize("dk,dv", [(64, 64)] + ([(128, 64)] if ON_GPU else []))
def test_state_pass_forward_matches_scan(dk, dv):
  x = _chunk_inputs(0, dk=dk, dv=dv)
  o, e, s, h = jax.jit(lambda x: sp.state_passing_fwd(**x, save_states=True,
                                                      interpret=INTERPRET))(x)
  ro, re, rs, rh = jax.jit(lambda x: sp.state_passing_reference(**x, round_operands=True))(x)
  for name, got, want in (("o", o, ro), ("e", e, re), ("s_final", s, rs)):
    assert_close(got, want, 1e-4, name)
  assert h.dtype == sp.MM_DTYPE
  assert_close(h.astype(jnp.float32), rh, 1e-2, "h (bf16 chunk-entry states)")


@pytest.mark.parametrize("residual", [True, False])
def test_state_pass_backward_matches_autodiff(residual):
  # residual False: E's cotangent not given (None), as the op passes it when E is unused.
  bwd = functools.partial(sp.state_passing_bwd, interpret=INTERPRET)
  for name, got, want, tol in kernel_cases.state_pass_backward_pairs(bwd, _chunk_inputs(1),
                                                                     residual=residual):
    assert_close(got, want, tol, f"{name} (residual={residual})")


# GDN is `-m slow` (suite time): off GPU it takes the path DeltaNet's case takes here (the
# intra-chunk kernel with segments, then the state pass; its residual r too), and GDN's own
# forward on it is tests/test_pallas_gpu_intra.py's: test_op_forward_matches_scan[
# gated_delta_rule] (no segments) and test_op_with_segments_and_padding_matches_scan (these
# segments' features: a reset inside a chunk, one crossing it, padding; GVA, initial state).
@pytest.mark.parametrize("mixer", [pytest.param(m, marks=pytest.mark.slow)
                                   if m == "gated_delta_rule" else m for m in MIXERS])
def test_op_forward_matches_scan(mixer):
  for name, g, w in kernel_cases.op_forward_pairs(mixer, "pallas_gpu", b=1):
    assert_close(g, w, FWD_TOL, f"{mixer} {name} vs scan")


# (GDN with the intra kernel only where "auto" may walk: off GPU, where the triton extra does not
# run, "auto" is "split" and this case is tests/test_pallas_gpu_intra.py's
# test_op_gradients_match_scan, the same inputs, tuning and oracle.)
# Both CPU cases are `-m slow` (suite time). KDA (intra is unread for it) is the default path
# that tests/test_state_pass_products.py's test_op_at_the_edges_of_t_with_the_pass_products[
# kda-65] takes with the same gradients and oracle (output_and_state_grads, 3e-2): GVA, an
# initial state, two chunks, the second padded. GDN's XLA intra-chunk path with the same state
# pass and products is test_gradients_under_shard_map_with_varying_axes_check's (every
# gradient against the scan); GVA, the initial state and padding through that composition
# (off GPU KDA takes it too: pallas_gpu._core) are the KDA case's.
@pytest.mark.parametrize("mixer,intra", [pytest.param("gated_delta_rule", "xla",
                                                      marks=pytest.mark.slow),
                                         pytest.param("kda", "kernel", marks=pytest.mark.slow)]
                         + ([("gated_delta_rule", "kernel")] if ON_GPU else []))
def test_op_gradients_match_scan(mixer, intra):
  # intra: who computes GDN's intra-chunk part (the Mosaic GPU kernel by default; the XLA path
  # is what runs under shard_map, and KDA/GDN-2 always take it).
  args, kw = make_inputs(mixer, b=1, t=96, h=1, hv=2, dk=64, dv=64, seed=4)
  got = output_and_state_grads(mixer, args, kw["initial_state"], "pallas_gpu",
                               tuning=pallas_gpu.GpuTuning(intra=intra))
  want = output_and_state_grads(mixer, args, kw["initial_state"], "scan")
  names = ["q", "k", "v"] + (["g", "beta"]) + ["initial_state"]
  for name, g, w in zip(names, got, want):
    assert_close(g, w, GRAD_TOL, f"{mixer} d{name}")


# "o" is `-m slow` (suite time): E's cotangent a symbolic zero on KDA's default path is what
# tests/test_state_pass_products.py's test_op_at_the_edges_of_t_with_the_pass_products[kda-*]
# take (their loss reads o and the final state, not E), every gradient against the scan; the
# final state's unused cotangent is "residual"'s here.
@pytest.mark.parametrize("used", [pytest.param("o", marks=pytest.mark.slow), "residual"])
def test_kda_gradients_with_and_without_the_residual_match_scan(used):
  # KDA's state pass gets E's cotangent only where a loss reads E (the routing residual);
  # otherwise a symbolic zero, which its reverse kernel replaces by reading nothing. Both ways
  # every gradient is the scan's.
  args, kw = make_inputs("kda", b=1, t=96, h=1, hv=2, dk=64, dv=64, seed=8)
  w = jax.random.normal(jax.random.key(3), args[2].shape)

  def grads(impl):
    def f(*a):
      out = run_jit("kda", a, **kw, return_residual=True, implementation=impl)
      return jnp.sum(out[0] * w) + (jnp.sum(out[-1] * w[..., ::-1]) if used == "residual" else 0)
    return jax.jit(jax.grad(f, argnums=tuple(range(len(args)))))(*args)

  for name, g, want in zip(["q", "k", "v", "g", "beta"], grads("pallas_gpu"), grads("scan")):
    assert_close(g, want, GRAD_TOL, f"{used}: d{name}")


def test_products_kernel_wiring_matches_scan(monkeypatch):
  # GpuTuning(state_products="kernel") hands the reverse pass's dE, dO, E and the states to the
  # products kernel (GPU-only: XLA's products stand in for it here, counted) and its outputs
  # to the cotangents: KDA's gradients still the scan's.
  from lineax_attn.ops import gpu_vjps, triton_gpu
  calls = []
  monkeypatch.setattr(triton_gpu, "available", lambda: True)
  monkeypatch.setattr(gpu_vjps, "products_kernel", lambda *a, o_rows=False: calls.append(
      o_rows) or tuple(x.astype(jnp.bfloat16) if i < 4 else x    # (the split path: chunk-major)
                       for i, x in enumerate(gpu_vjps.state_pass_products(*a))))
  args, kw = make_inputs("kda", b=1, t=96, h=1, hv=2, dk=64, dv=64, seed=6)
  tuning = pallas_gpu.GpuTuning(state_products="kernel", channel_intra="xla")  # (no Triton here)
  got = output_and_state_grads("kda", args, kw["initial_state"], "pallas_gpu", tuning=tuning)
  assert calls, "the products kernel was not called"
  want = output_and_state_grads("kda", args, kw["initial_state"], "scan")
  for name, g, w in zip(["q", "k", "v", "g", "beta", "initial_state"], got, want):
    assert_close(g, w, GRAD_TOL, f"products kernel wiring: d{name}")


def test_each_tuning_traces_separately_under_one_jit(monkeypatch):
  # The tuning used to be module flags read at trace time, so changing one after a function
  # had been jitted was silently ignored. A GpuTuning is a static argument: one jitted function
  # called with A, B, C traces three times, and each result is that tuning's own (equal to a
  # fresh jit closing over it; the kernel path: the kernel ran), not the first trace's.
  calls = []
  kernel = ic.intra_chunk_fwd
  monkeypatch.setattr(ic, "intra_chunk_fwd", lambda *a, **k: calls.append(1) or kernel(*a, **k))
  args, _ = make_inputs("gated_delta_rule", b=1, t=64, h=1, hv=1, dk=64, dv=64, seed=12)
  traces = []

  @functools.partial(jax.jit, static_argnames="tuning")
  def f(*a, tuning):
    traces.append(tuning)
    return ops.gated_delta_rule(*a, implementation="pallas_gpu", tuning=tuning)[0]

  inverse = pallas_gpu.GpuTuning(intra="xla", solve="inverse")
  trsm = pallas_gpu.GpuTuning(intra="xla", solve="trsm")
  kernel_path = pallas_gpu.GpuTuning(intra="kernel", forward="split")
  outs = {}
  for tuning in (inverse, trsm, kernel_path):
    before = len(calls)
    outs[tuning] = np.asarray(f(*args, tuning=tuning))
    # Only the intra="kernel" trace calls the intra-chunk kernel.
    assert len(calls) - before == (tuning.intra == "kernel"), tuning
    if tuning.intra == "xla":   # (the kernel path's fresh compile would only cost time)
      fresh = jax.jit(lambda *a, t=tuning: ops.gated_delta_rule(*a, implementation="pallas_gpu",
                                                                 tuning=t)[0])
      np.testing.assert_array_equal(outs[tuning], np.asarray(fresh(*args)), err_msg=str(tuning))
  assert traces == [inverse, trsm, kernel_path]
  # The bf16-applied inverse and the float32 triangular solve round differently.
  assert np.max(np.abs(outs[inverse] - outs[trsm])) > 1e-5
  np.testing.assert_array_equal(np.asarray(f(*args, tuning=pallas_gpu.GpuTuning(intra="xla"))),
                                outs[inverse])    # an equal tuning reuses its trace
  assert len(traces) == 3
  want = run_jit("gated_delta_rule", args, implementation="scan")[0]
  for tuning, out in outs.items():
    assert_close(out, want, FWD_TOL, f"o with {tuning} vs scan")


def test_remat_intra_decides_whether_the_intra_chunk_part_is_checkpointed():
  # remat_intra only changes what the backward keeps; the traced program shows it as a
  # checkpoint (remat) around the XLA intra-chunk part, and the forward values are the same.
  # (channel_intra="xla": where the triton extra runs, "auto" takes the Triton channel kernels
  # and there is no XLA intra-chunk part to checkpoint.)
  args, _ = make_inputs("kda", b=1, t=64, h=1, hv=1, dk=64, dv=64, seed=13)
  results = {}
  for remat in (True, False):
    tuning = pallas_gpu.GpuTuning(remat_intra=remat, channel_intra="xla")
    fn = lambda *a, tuning=tuning: ops.kda(*a, implementation="pallas_gpu", tuning=tuning)[0]
    # The printed jaxpr holds nested jaxprs inline; remat's primitive is "remat2" in jax 0.11
    # ("checkpoint" in some other versions).
    text = str(jax.make_jaxpr(fn)(*args))
    assert len(re.findall(r"\b(?:remat\w*|checkpoint)\[", text)) == int(remat), remat
    results[remat] = np.asarray(jax.jit(fn)(*args))
  np.testing.assert_allclose(results[True], results[False], rtol=0, atol=1e-6)


def test_unsupported_shape_falls_back_to_chunk_with_log(caplog):
  args, kw = make_inputs("gated_delta_rule", b=1, t=20, h=1, dk=16, dv=24, seed=7)
  with caplog.at_level(logging.WARNING, logger=pallas_gpu.__name__):
    pallas_gpu._warned.clear()
    got = run_jit("gated_delta_rule", args, **kw, implementation="pallas_gpu")
  want = run_jit("gated_delta_rule", args, **kw, implementation="chunk")
  assert "falls back to implementation='chunk'" in caplog.text
  assert "K=16" in caplog.text
  assert_close(got[0], want[0], 1e-6, "fallback o")


def test_registered_and_default_implementation():
  assert "pallas_gpu" in ops.available_implementations()
  expected = "pallas_gpu" if ON_GPU else "chunk"
  assert api.default_implementation() == expected


def test_kernel_implementations_get_the_callers_dtypes_and_upcast_themselves(monkeypatch):
  # api hands q, k, v to an implementation registered with keeps_input_dtypes in the caller's
  # dtypes (pallas_gpu, triton: their channel kernels read bf16 as it is), to the others
  # upcast to float32; pallas_gpu upcasts them itself, so bf16 inputs give what their float32
  # values give, output and every gradient.
  from lineax_attn.ops import chunked  # pylint: disable=g-import-not-at-top
  seen = {}
  for name, keeps in (("spy_keeps", True), ("spy_upcast", False)):
    for registry in (api._IMPLEMENTATIONS, api._TUNING_TYPES, api._SUPPORTS, api._KEEPS_DTYPES,
                     api._FALLBACK_LOGGED):
      monkeypatch.setitem(registry, name, None)   # so the test's registrations are undone

    def spy(mixer, q, k, v, *a, name=name, **kw):
      seen[name] = (q.dtype, k.dtype, v.dtype)
      return chunked.chunk_delta_family(mixer, q.astype(jnp.float32), k.astype(jnp.float32),
                                        v.astype(jnp.float32), *a, **kw)
    api.register_implementation(name, spy, keeps_input_dtypes=keeps)
  args, kw = make_inputs("gated_delta_rule", b=1, t=64, h=1, hv=1, dk=64, dv=64, seed=23)
  low = tuple(x.astype(jnp.bfloat16) for x in args[:3]) + args[3:]
  for name in ("spy_keeps", "spy_upcast"):
    run_jit("gated_delta_rule", low, **kw, implementation=name)
  assert seen == {"spy_keeps": (jnp.bfloat16,) * 3, "spy_upcast": (jnp.float32,) * 3}
  assert api._KEEPS_DTYPES["pallas_gpu"] and api._KEEPS_DTYPES["triton"]
  wide = tuple(x.astype(jnp.float32) for x in low[:3]) + low[3:]

  def grads(a):
    f = lambda *x: jnp.sum(run("gated_delta_rule", x, implementation="pallas_gpu")[0]
                           .astype(jnp.float32) ** 2)
    return jax.jit(jax.value_and_grad(f, argnums=tuple(range(len(a)))))(*a)
  (lo, g_lo), (wi, g_wi) = grads(low), grads(wide)
  assert_close(lo, wi, 1e-2, "loss")   # o rounded to bf16 on the low side only
  for i, (a, b) in enumerate(zip(g_lo, g_wi)):
    assert a.dtype == low[i].dtype
    assert_close(a.astype(jnp.float32), b.astype(a.dtype).astype(jnp.float32), 2e-2, f"grad {i}")


def test_gradients_under_shard_map_with_varying_axes_check():
  # Context parallelism (lineax_attn.parallel) calls the op inside jax.shard_map with
  # check_vma=True: the custom VJP must type its kernel outputs and cotangents with the inputs'
  # varying mesh axes (a one-device mesh checks the typing; values vs the scan reference).
  from jax.sharding import NamedSharding, PartitionSpec as P
  args, _ = make_inputs("gated_delta_rule", b=1, t=64, h=1, hv=1, dk=64, dv=64, seed=8)
  mesh = jax.make_mesh((1,), ("sequence",), devices=jax.devices()[:1])
  spec = P(None, "sequence")
  sharded = [jax.device_put(a, NamedSharding(mesh, spec)) for a in args]
  op = lambda impl: lambda *a: ops.gated_delta_rule(*a, implementation=impl)[0]
  inner = jax.shard_map(op("pallas_gpu"), mesh=mesh, in_specs=(spec,) * len(args),
                        out_specs=spec, check_vma=True)
  w = jax.random.normal(jax.random.key(9), args[2].shape)
  argnums = tuple(range(len(args)))
  # Jitted: check_vma types the program at trace time either way, and one compile of the
  # whole gradient costs ~1/4 of eager dispatch's per-primitive compiles.
  got = jax.jit(jax.grad(lambda *a: jnp.sum(inner(*a) * w), argnums=argnums))(*sharded)
  want = jax.jit(jax.grad(lambda *a: jnp.sum(op("scan")(*a) * w), argnums=argnums))(*args)
  for name, g, r in zip(("q", "k", "v", "g", "beta"), got, want):
    assert_close(g, r, GRAD_TOL, f"d{name} under shard_map")
