"""Triton kernels of the chunk form's sequential part: the state pass, forward and reverse.

The same recurrence and the same array contract as the Mosaic GPU kernels of
`pallas_kernels.gpu.state_passing` (read its docstring for the maths), written in Triton's
language for any NVIDIA GPU from sm_80 (A100, L40, RTX) and called from JAX by
`jax_triton.triton_call`. Per chunk c (S = state entering c, K × BLOCK_V, float32 in registers):

    forward:   E = U + NY·S     O = QG·S + P·E     S' = gc ⊙ S + KGᵀ·E
    reverse:   dE = dE_ext + Pᵀ·dO + KG·dS      dS' = gc ⊙ dS + QGᵀ·dO + NYᵀ·dE

One program owns one (batch·value-head, V-tile) and walks the chunks in order; every product is
a `tl.dot` with bf16 operands (S and E rounded to bf16 as operands, as the Mosaic kernels do)
and a float32 accumulator. The loop's loads do not depend on the state, so the chunk loop is
software-pipelined (`tl.range(..., num_stages=STAGES)`: chunk c + 1's tiles are fetched by
async copies while chunk c computes). The loop asks for it itself: triton 3.6 did not pipeline
this loop from the launch's `num_stages` alone (its TTGIR had no async copy at 1, 2 or 3
stages; with `tl.range` it has four).

`state_pass_products`: the reverse pass's cotangents that are products, per chunk (one program
a chunk, no walk): dNY = dE Sᵀ, dQG = dO Sᵀ, dP = dO Eᵀ, dKG = E dS'ᵀ and dgc = Σ_v S ⊙ dS',
each operand read once for all of them.

Offsets are int64 (a B·T·H·D past 2^31 elements stays exact); the chunk count is a run-time
argument, so one compiled kernel serves every sequence length.

Arrays: chunk-major `[B, HV, Nc, C, D]`, contiguous. This module imports triton (the `triton`
extra; `lineax_attn` imports it lazily); jax_triton, which refuses to import without a GPU jaxlib,
is imported by the JAX wrappers when first called, so Triton's interpreter can run the kernels on
CPU (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import functools
import os
import types

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels.gpu.triton import blocks, ffi_call

MM_DTYPE = jnp.bfloat16


@triton.jit
def _fwd_kernel(ny_ptr, qg_ptr, p_ptr, u_ptr, kg_ptr, gc_ptr, s0_ptr, nc,
                o_ptr, e_ptr, sf_ptr, h_ptr,
                C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                SAVE_STATES: tl.constexpr, STAGES: tl.constexpr):
  iv = tl.program_id(0)
  bh = tl.program_id(1).to(tl.int64)
  rc = tl.arange(0, C)
  rk = tl.arange(0, K)
  rv = iv * BV + tl.arange(0, BV)
  ck = rc[:, None] * K + rk[None, :]          # a [C, K] tile
  cc = rc[:, None] * C + rc[None, :]          # a [C, C] tile
  cv = rc[:, None] * V + rv[None, :]          # a [C, BV] tile of a [C, V] chunk
  kv = rk[:, None] * V + rv[None, :]          # a [K, BV] tile of a [K, V] state
  s = tl.load(s0_ptr + bh * K * V + kv)
  for ci in tl.range(0, nc, num_stages=STAGES):
    chunk = bh * nc + ci                      # index of this (b, h, chunk) in the Nc axis
    ny = tl.load(ny_ptr + chunk * C * K + ck)
    qg = tl.load(qg_ptr + chunk * C * K + ck)
    kg = tl.load(kg_ptr + chunk * C * K + ck)
    p = tl.load(p_ptr + chunk * C * C + cc)
    u = tl.load(u_ptr + chunk * C * V + cv)
    gc = tl.load(gc_ptr + chunk * K + rk)
    s_mm = s.to(tl.bfloat16)
    if SAVE_STATES:                           # the state entering chunk ci, as used below
      tl.store(h_ptr + chunk * K * V + kv, s_mm)
    e = tl.dot(ny, s_mm) + u
    e_mm = e.to(tl.bfloat16)
    o = tl.dot(qg, s_mm)
    o = tl.dot(p, e_mm, o)
    s = s * gc[:, None]
    s = tl.dot(tl.trans(kg), e_mm, s)
    tl.store(o_ptr + chunk * C * V + cv, o.to(o_ptr.dtype.element_ty))
    tl.store(e_ptr + chunk * C * V + cv, e.to(e_ptr.dtype.element_ty))
  tl.store(sf_ptr + bh * K * V + kv, s)


@triton.jit
def _bwd_kernel(ny_ptr, qg_ptr, p_ptr, kg_ptr, gc_ptr, do_ptr, dx_ptr, dsf_ptr, nc,
                de_ptr, dh_ptr, ds0_ptr,
                C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                HAS_DX: tl.constexpr, STAGES: tl.constexpr):
  iv = tl.program_id(0)
  bh = tl.program_id(1).to(tl.int64)
  rc = tl.arange(0, C)
  rk = tl.arange(0, K)
  rv = iv * BV + tl.arange(0, BV)
  ck = rc[:, None] * K + rk[None, :]
  cc = rc[:, None] * C + rc[None, :]
  cv = rc[:, None] * V + rv[None, :]
  kv = rk[:, None] * V + rv[None, :]
  ds = tl.load(dsf_ptr + bh * K * V + kv)     # cotangent of the state leaving the last chunk
  for j in tl.range(0, nc, num_stages=STAGES):
    chunk = bh * nc + (nc - 1 - j)
    ny = tl.load(ny_ptr + chunk * C * K + ck)
    qg = tl.load(qg_ptr + chunk * C * K + ck)
    kg = tl.load(kg_ptr + chunk * C * K + ck)
    p = tl.load(p_ptr + chunk * C * C + cc)
    do = tl.load(do_ptr + chunk * C * V + cv)
    gc = tl.load(gc_ptr + chunk * K + rk)
    ds_mm = ds.to(tl.bfloat16)
    tl.store(dh_ptr + chunk * K * V + kv, ds_mm)
    if HAS_DX:
      de = tl.dot(tl.trans(p), do, tl.load(dx_ptr + chunk * C * V + cv))
    else:   # E is not an output anyone reads: its cotangent is not streamed in
      de = tl.dot(tl.trans(p), do)
    de = tl.dot(kg, ds_mm, de)
    de_mm = de.to(tl.bfloat16)
    ds = ds * gc[:, None]
    ds = tl.dot(tl.trans(qg), do, ds)
    ds = tl.dot(tl.trans(ny), de_mm, ds)
    tl.store(de_ptr + chunk * C * V + cv, de.to(de_ptr.dtype.element_ty))
  tl.store(ds0_ptr + bh * K * V + kv, ds)


def _jax_triton():
  """jax_triton, imported without its side effect on the process; or, where the kernels were
  made interpreted (TRITON_INTERPRET=1 at import), `interpret`, whose `triton_call` runs them
  in Triton's interpreter on the CPU.

  jax-triton 0.3.1 sets `os.environ["TRITON_CACHE_DIR"] = ""` when imported, which breaks every
  other Triton user of the process (FLA's autotuner raises "Could not create or locate cache
  dir"); its own compiles do not need that. So the variable is put back as it was."""
  if os.environ.get("TRITON_INTERPRET") == "1":
    from pallas_kernels.gpu.triton import interpret  # noqa: PLC0415
    if interpret.enabled():
      return interpret
  saved = os.environ.get("TRITON_CACHE_DIR")
  import jax_triton  # noqa: PLC0415 (see the module docstring)
  if saved is None:
    os.environ.pop("TRITON_CACHE_DIR", None)
  else:
    os.environ["TRITON_CACHE_DIR"] = saved
  # Which custom call the kernels lower to (`blocks.CALL_TARGET`, read at trace time).
  target = ffi_call.triton_call_kwargs(blocks.CALL_TARGET)
  if not target:
    return jax_triton
  return types.SimpleNamespace(triton_call=functools.partial(jax_triton.triton_call, **target))


def _structs(*shapes_dtypes):
  return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes_dtypes]


def _on_hopper() -> bool:
  cc = getattr(jax.devices()[0], "compute_capability", None)
  return str(cc).startswith("9.")


def _dims(qg, dv, launch_overrides, *, reverse):
  """(B, HV, Nc, C, K, BLOCK_V, launch options) of a call; ValueError for sizes not taken.

  launch_overrides: None, or (block_v, num_warps, num_stages) with None for "the table's":
  `blocks` fixes them per size; benchmarks pass others to time the alternatives."""
  b, hv, nc, c, dk = qg.shape
  reason = blocks.supported(c, dk, dv)
  if reason:
    raise ValueError(f"pallas_kernels.gpu.triton: {reason}.")
  table = blocks.state_launch(dk, dv, reverse=reverse, hopper=_on_hopper())
  bv, warps, stages = (x if x is not None else t
                       for x, t in zip(launch_overrides or (None,) * 3, table))
  if bv not in (16, 32, 64, 128) or dv % bv:
    raise ValueError(f"block_v={bv}: expected 16, 32, 64 or 128 dividing V={dv}")
  launch = dict(num_warps=warps, num_stages=stages)
  return b, hv, nc, c, dk, bv, launch


@functools.partial(jax.jit, static_argnames=("save_states", "out_dtype", "launch"))
def state_passing_fwd(ny, qg, p, u, kg, gc, s0, *, save_states=False, out_dtype=jnp.float32,
                      launch=None):
  """Forward state pass; arguments and results as `pallas_kernels.gpu.state_passing`'s.

  ny, qg, kg `[B, HV, Nc, C, K]` bf16; p `[B, HV, Nc, C, C]` bf16; u `[B, HV, Nc, C, V]` f32;
  gc `[B, HV, Nc, K]` f32; s0 `[B, HV, K, V]` f32. Returns (o, e, s_final[, h]): o, e like u
  in out_dtype (float32 or bfloat16: the float32 results rounded once on chip), s_final like
  s0, h `[B, HV, Nc, K, V]` bf16 (the state entering each chunk).
  launch: None (the sizes of `blocks`) or (block_v, num_warps, num_stages), None entries kept.
  """
  from pallas_kernels.gpu import state_passing  # pylint: disable=g-import-not-at-top
  out_dtype = state_passing.check_out_dtype(out_dtype)
  dv = u.shape[-1]
  b, hv, nc, c, dk, bv, launch = _dims(qg, dv, launch, reverse=False)
  f32 = jnp.float32
  # Without save_states the kernel never writes h: a one-element placeholder.
  out_shape = _structs(((b, hv, nc, c, dv), out_dtype), ((b, hv, nc, c, dv), out_dtype),
                       ((b, hv, dk, dv), f32),
                       ((b, hv, nc, dk, dv) if save_states else (1,), MM_DTYPE))
  o, e, s_final, h = _jax_triton().triton_call(
      ny.astype(MM_DTYPE), qg.astype(MM_DTYPE), p.astype(MM_DTYPE), u.astype(f32),
      kg.astype(MM_DTYPE), gc.astype(f32), s0.astype(f32), nc,
      kernel=_fwd_kernel, out_shape=out_shape, grid=(dv // bv, b * hv),
      C=c, K=dk, V=dv, BV=bv, SAVE_STATES=save_states, STAGES=launch["num_stages"], **launch)
  return (o, e, s_final, h) if save_states else (o, e, s_final)


@functools.partial(jax.jit, static_argnames=("de_dtype", "launch"))
def state_passing_bwd(ny, qg, p, kg, gc, do, de_ext, ds_final, *, de_dtype=jnp.float32,
                      launch=None):
  """Reverse state pass; arguments and results as `pallas_kernels.gpu.state_passing`'s.

  Returns (de, dh, ds0): de `[B, HV, Nc, C, V]` in de_dtype (total cotangent of E; float32 or
  bfloat16, the float32 result rounded once on chip), dh `[B, HV, Nc, K, V]` bf16 (cotangent
  of the state leaving each chunk), ds0 `[B, HV, K, V]` f32. de_ext may be None (E unused:
  nothing read in its place). launch: as `state_passing_fwd`'s.
  """
  from pallas_kernels.gpu import state_passing  # pylint: disable=g-import-not-at-top
  de_dtype = state_passing.check_out_dtype(de_dtype, "de_dtype")
  dv = do.shape[-1]
  b, hv, nc, c, dk, bv, launch = _dims(qg, dv, launch, reverse=True)
  f32 = jnp.float32
  out_shape = _structs(((b, hv, nc, c, dv), de_dtype), ((b, hv, nc, dk, dv), MM_DTYPE),
                       ((b, hv, dk, dv), f32))
  return tuple(_jax_triton().triton_call(
      ny.astype(MM_DTYPE), qg.astype(MM_DTYPE), p.astype(MM_DTYPE), kg.astype(MM_DTYPE),
      gc.astype(f32), do.astype(MM_DTYPE), ds_final if de_ext is None else de_ext.astype(f32),
      ds_final.astype(f32), nc, kernel=_bwd_kernel, out_shape=out_shape,
      grid=(dv // bv, b * hv), C=c, K=dk, V=dv, BV=bv, HAS_DX=de_ext is not None,
      STAGES=launch["num_stages"], **launch))


@triton.jit
def chunk_products(de_ptr, do_ptr, e_ptr, h_ptr, dh_ptr, cv_rows, do_rows, chunk,
                   dny_ptr, dqg_ptr, dp_ptr, dkg_ptr, dgc_ptr, C: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, BK: tl.constexpr):
  """One chunk's dNY, dQG, dKG [C, K], dP [C, C] (bf16) and dgc [K] (float32), each operand
  read once: dE, dO, E whole (any float dtype, rounded to bf16 as operands), the states h, dh'
  in BK-row slices, so no [K, V] tile is held whole. cv_rows, do_rows: the [C] offsets of the
  chunk's rows in dE / E and in dO (their layouts are the caller's); chunk: its index in the
  chunk-major order of h, dh and the outputs. Shared by the products kernel and the channel
  backward kernel's prologue (`channel_intra`), so both make the same values."""
  rc, rv, rb = tl.arange(0, C), tl.arange(0, V), tl.arange(0, BK)
  de = tl.load(de_ptr + cv_rows[:, None] + rv[None, :]).to(tl.bfloat16)
  do = tl.load(do_ptr + do_rows[:, None] + rv[None, :]).to(tl.bfloat16)
  e = tl.load(e_ptr + cv_rows[:, None] + rv[None, :]).to(tl.bfloat16)
  dp = tl.dot(do, tl.trans(e))
  tl.store(dp_ptr + chunk * C * C + rc[:, None] * C + rc[None, :], dp.to(tl.bfloat16))
  for s in tl.range(K // BK):
    rk = s * BK + rb
    kv = chunk * K * V + rk[:, None] * V + rv[None, :]
    h = tl.load(h_ptr + kv)
    dh = tl.load(dh_ptr + kv)
    ck = chunk * C * K + rc[:, None] * K + rk[None, :]
    tl.store(dny_ptr + ck, tl.dot(de, tl.trans(h)).to(tl.bfloat16))     # E = U + NY·S
    tl.store(dqg_ptr + ck, tl.dot(do, tl.trans(h)).to(tl.bfloat16))     # O = QG·S + P·E
    tl.store(dkg_ptr + ck, tl.dot(e, tl.trans(dh)).to(tl.bfloat16))     # S' = gc⊙S + KGᵀ·E
    tl.store(dgc_ptr + chunk * K + rk,
             tl.sum(h.to(tl.float32) * dh.to(tl.float32), axis=1))


@triton.jit
def _products_kernel(de_ptr, do_ptr, e_ptr, h_ptr, dh_ptr, dny_ptr, dqg_ptr, dp_ptr, dkg_ptr,
                     dgc_ptr, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, HV: tl.constexpr, O_ROWS: tl.constexpr):
  """`chunk_products` of one chunk a program. O_ROWS: dO in `[B, T, HV, V]`."""
  bh = tl.program_id(1).to(tl.int64)
  chunk = bh * tl.num_programs(0) + tl.program_id(0)
  rc = tl.arange(0, C)
  cv_rows = chunk * C * V + rc * V
  if O_ROWS:   # time row (b·T + chunk·C + r), head h
    t_rows = (bh // HV) * tl.num_programs(0) * C + tl.program_id(0) * C + rc
    do_rows = (t_rows * HV + bh % HV) * V
  else:
    do_rows = cv_rows
  chunk_products(de_ptr, do_ptr, e_ptr, h_ptr, dh_ptr, cv_rows, do_rows, chunk, dny_ptr,
                 dqg_ptr, dp_ptr, dkg_ptr, dgc_ptr, C, K, V, BK)


PRODUCTS_WARPS = 8   # ptxas (sm_90a, K = V = 128, BK 64): see `state_pass_products`
PRODUCTS_BK = 64


@functools.partial(jax.jit, static_argnames=("o_rows", "launch"))
def state_pass_products(de, do, e, h, dh, *, o_rows=False, launch=None):
  """`lineax_attn.ops.gpu_vjps.state_pass_products` in one kernel: (dNY, dQG, dP, dKG, dgc) from
  dE, dO, E `[B, HV, Nc, C, V]` (any float dtype; rounded to bf16 as operands; dO in
  `[B, T, HV, V]` with o_rows, as `state_passing_bwd(o_rows=True)` takes it) and the states
  h, dh `[B, HV, Nc, K, V]` bf16; dNY, dQG, dKG `[B, HV, Nc, C, K]` and dP `[..., C, C]` in
  bf16 (float32 accumulation, rounded once, as XLA's products rounded to the operands' bf16),
  dgc `[B, HV, Nc, K]` float32. XLA makes them as four batched products, a reduction and
  float32 -> bf16 copies of dE and E, each pass reading its operands again. launch: None (the
  module's PRODUCTS_WARPS, PRODUCTS_BK, one stage) or (warps, bk, stages), for benchmarks
  (`experiments.bench_triton_parts --mixers=products`)."""
  b, hv, nc, c, dv = de.shape
  dk = h.shape[-2]
  reason = blocks.supported(c, dk, dv)
  if reason:
    raise ValueError(f"state_pass_products: {reason}.")
  want = (b, nc * c, hv, dv) if o_rows else de.shape
  if tuple(do.shape) != tuple(want):
    raise ValueError(f"state_pass_products: do {tuple(do.shape)} must be {tuple(want)} "
                     f"(o_rows={bool(o_rows)}).")
  warps, bk, stages = launch or (PRODUCTS_WARPS, PRODUCTS_BK, 1)
  if bk not in (16, 32, 64, 128) or dk % min(bk, dk):
    raise ValueError(f"state_pass_products: launch bk={bk} must be 16, 32, 64 or 128.")
  bf = MM_DTYPE
  out_shape = _structs(((b, hv, nc, c, dk), bf), ((b, hv, nc, c, dk), bf), ((b, hv, nc, c, c), bf),
                       ((b, hv, nc, c, dk), bf), ((b, hv, nc, dk), jnp.float32))
  d_ny, d_qg, d_p, d_kg, d_gc = _jax_triton().triton_call(
      de, do, e, h.astype(bf), dh.astype(bf), kernel=_products_kernel,
      out_shape=out_shape, grid=(nc, b * hv),
      num_warps=warps, num_stages=stages, C=c, K=dk, V=dv, BK=min(bk, dk), HV=hv,
      O_ROWS=bool(o_rows))
  return d_ny, d_qg, d_p, d_kg, d_gc
