"""The Mosaic reverse state pass makes the state pass's cotangent products itself where one CTA
holds all of V (`state_passing_bwd(products=(e, h))`, K = V = 64): dNY = dE hᵀ, dQG = dO hᵀ,
dP = dO Eᵀ, dKG = E dhᵀ and dgc = Σ_v h ⊙ dh, from the tiles the pass already holds, so dh is
never written and dE, dO, dh are never read back by a products kernel.

Oracle: the plain pass (which writes dh) followed by XLA's batched products of the same bf16
operands (`gpu_vjps.state_pass_products`). dE and ds0 must be the plain pass's to the bit (the
chain is untouched); the products are the same sums of the same bf16 operands in another order,
rounded once to bf16: equal to 1e-3 relative (dgc, float32, to 1e-5). Rows in two pieces, dO in
the op's layout and E's own cotangent, as the states path runs it. Sizes where a CTA does not
hold all of V, and states-only passes, are refused by name; the kernel lowers for CUDA within
Hopper's shared memory, as the states path and the split path run it. The op, where the
default takes this path, against the scan at T = 1, one chunk and one chunk plus a row, forward
alone and with every gradient, under fresh jitted compiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (assert_close, make_inputs, mosaic_gpu_or_skip, output_and_state_grads,
                     record_smem_estimates, run_jit)

ON_GPU, INTERPRET = mosaic_gpu_or_skip()

import kernel_cases  # noqa: E402
from lineax_attn.ops import gpu_chunks, gpu_vjps, pallas_gpu  # noqa: E402
from pallas_kernels.gpu import state_passing as sp  # noqa: E402

BF16 = jnp.bfloat16


def _case(seed, pieces=2):
  """Inputs of the reverse pass as the states path has them, and the forward's e and h."""
  x = kernel_cases.state_pass_inputs(seed, b=2, hv=2, nc=4)
  x["s0"] = jnp.concatenate([x["s0"], 0.5 * x["s0"]], 0) if pieces == 2 else x["s0"]
  _, e, _, h = jax.jit(lambda x: sp.state_passing_fwd(
      **x, save_states=True, pieces=pieces, out_dtype=BF16, interpret=INTERPRET))(x)
  ks = jax.random.split(jax.random.key(seed + 1), 3)
  do = jax.random.normal(ks[0], x["u"].shape).astype(BF16)          # chunk-major
  de_ext = jax.random.normal(ks[1], x["u"].shape)
  ds_final = jax.random.normal(ks[2], x["s0"].shape)
  head = (x["ny"], x["qg"], x["p"], x["kg"], x["gc"])
  return head, do, de_ext, ds_final, e, h


def test_products_in_the_pass_match_the_pass_then_xla_products():
  pieces = 2
  head, do, de_ext, ds_final, e, h = _case(3, pieces)
  rows = gpu_chunks.from_chunks(do)
  kw = dict(pieces=pieces, de_dtype=BF16, o_rows=True, interpret=INTERPRET)
  de, dh, ds0 = jax.jit(lambda: sp.state_passing_bwd(*head, rows, de_ext, ds_final, **kw))()
  got = jax.jit(lambda: sp.state_passing_bwd(*head, rows, de_ext, ds_final, products=(e, h),
                                             **kw))()
  assert len(got) == 7
  for name, a, b in (("de", got[0], de), ("ds0", got[6], ds0)):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                  np.asarray(b.astype(jnp.float32)), err_msg=name)
  want = gpu_vjps.state_pass_products(de, do, e, h, dh)
  for name, a, b in zip(("d_ny", "d_qg", "d_p", "d_kg"), got[1:5], want[:4]):
    assert a.dtype == BF16 and a.shape == b.shape, name
    assert_close(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(BF16), np.float32),
                 1e-3, name)
  assert got[5].dtype == jnp.float32 and got[5].shape == want[4].shape
  assert_close(np.asarray(got[5]), np.asarray(want[4]), 1e-5, "d_gc")


def test_products_are_refused_where_a_cta_does_not_hold_all_of_v():
  head, do, de_ext, ds_final, e, h = _case(4, pieces=1)
  with pytest.raises(ValueError, match="states_only"):
    sp.state_passing_bwd(*head, do, None, ds_final, states_only=True, products=(e, h),
                         interpret=INTERPRET)
  with pytest.raises(ValueError, match="products"):
    sp.state_passing_bwd(*head, do, None, ds_final, products=(e[..., :32], h),
                         interpret=INTERPRET)
  wide = kernel_cases.state_pass_inputs(5, nc=2, dv=128)
  do = wide["u"].astype(BF16)
  with pytest.raises(ValueError, match="V=128"):
    sp.state_passing_bwd(wide["ny"], wide["qg"], wide["p"], wide["kg"], wide["gc"], do, None,
                         wide["s0"], products=(do, jnp.zeros(wide["s0"].shape[:2] + (2,) +
                                                             wide["s0"].shape[2:], BF16)),
                         interpret=INTERPRET)
  assert sp.products_reason(64, 64) is None and sp.products_reason(128, 64)


# As the states path runs it (bf16 dE, dO in the op's layout) and as the split path does
# (float32 dE from a staging tile, E's own cotangent, chunk-major dO, rows in two pieces).
@pytest.mark.parametrize("states_path", [True, False])
def test_products_pass_lowers_for_cuda(states_path, monkeypatch):
  # Layout inference runs at lowering: the products' transposed operands, the dgc row sums and
  # their staging tiles must be constructs Mosaic GPU compiles (the interpreter takes more),
  # in Hopper's 227 KiB of shared memory a CTA.
  estimates = record_smem_estimates(monkeypatch)
  sds = jax.ShapeDtypeStruct
  f32 = jnp.float32
  b, hv, t, c, d = 1, 2, 128, 64, 64
  nc = t // c
  pieces = 1 if states_path else 2
  ck = sds((b, hv, nc, c, d), BF16)
  do = sds((b, t, hv, d), BF16) if states_path else ck
  dx = None if states_path else sds((b, hv, nc, c, d), f32)
  args = (ck, ck, sds((b, hv, nc, c, c), BF16), ck, sds((b, hv, nc, d), f32), do,
          sds((b * pieces, hv, d, d), f32), ck, sds((b, hv, nc, d, d), BF16))
  fn = lambda ny, qg, p, kg, gc, do, dsf, e, h, *dx: sp._state_passing_bwd(
      ny, qg, p, kg, gc, do, dx[0] if dx else None, dsf, (e, h), pieces=pieces,
      de_dtype=BF16 if states_path else f32, o_rows=states_path, interpret=None)
  lowered = jax.jit(fn).trace(*args, *([dx] if dx else [])).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()
  assert 0 < estimates[-1] <= 227 * 1024, estimates


@pytest.mark.parametrize("mixer,t", [("kda", 1), ("gdn2", 64), ("kda", 65)])
def test_op_at_the_edges_of_t_with_the_pass_products(monkeypatch, mixer, t):
  # The op as users call it at K = V = 64, where the default takes the pass's products: fresh
  # jitted compiles, forward alone (output and final state) and every gradient against the
  # scan, at T = 1, one chunk and one chunk plus a row; the pass made the products.
  made = []
  real = sp.state_passing_bwd
  monkeypatch.setattr(sp, "state_passing_bwd", lambda *a, **k: made.append(
      k.get("products") is not None) or real(*a, **k))
  args, kw = make_inputs(mixer, b=2, t=t, h=1, hv=2, dk=64, dv=64, seed=40 + t)
  tuning = pallas_gpu.GpuTuning()
  jax.clear_caches()
  got = run_jit(mixer, args, **kw, output_final_state=True, implementation="pallas_gpu",
                tuning=tuning)
  want = run_jit(mixer, args, **kw, output_final_state=True, implementation="scan")
  for name, g, w in zip(("o", "final state"), got, want):
    assert_close(g, w, 2e-2, f"{mixer} T={t} {name}")
  assert not made, "the forward ran a reverse pass"
  grads = output_and_state_grads(mixer, args, kw["initial_state"], "pallas_gpu", tuning=tuning)
  assert made and all(made), made
  for i, (g, w) in enumerate(zip(grads, output_and_state_grads(
      mixer, args, kw["initial_state"], "scan"))):
    assert_close(g, w, 3e-2, f"{mixer} T={t} grad {i}")

