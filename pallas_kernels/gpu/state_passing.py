"""Mosaic GPU (Hopper) kernels of the chunk form's sequential part (docs/MATH.md §3.2, §3.6).

Everything intra-chunk (P, the WY/UT solve Y, U, the gated keys) is computed for all chunks in
parallel outside (`intra_chunk.py` for DeltaNet/GDN, XLA otherwise). What remains is the
chunk-to-chunk state pass, which XLA runs as a `lax.scan` of tiny matmuls. Here one CTA (one
warpgroup) owns one (batch, value head, V-tile) and walks the chunks with the float32 state held
in registers; every product is a wgmma with bf16 operands and a float32 accumulator, and the
next chunk's inputs arrive by TMA into a second shared-memory slot while the current chunk
computes.

Forward, per chunk c (S = state entering c, K×Vt; gc = decay of S across the chunk, [K]):

    E  = U + NY·S            NY = −Y  [C, K]          (write residual r, FLA's v_new)
    O  = QG·S + P·E                                    (chunk output)
    S' = gc ⊙ S + KGᵀ·E                                (state entering c + 1)

Backward (reverse over chunks; dS = cotangent of the state leaving c, starts at d final_state):

    dE  = dE_ext + Pᵀ·dO + KG·dS
    dS' = gc ⊙ dS + QGᵀ·dO + NYᵀ·dE                    (cotangent of the state entering c)

The kernels also write, per chunk, the state entering it (forward, `save_states`) and the state
cotangent leaving it (backward): the remaining gradients (dNY = dE·Sᵀ, dQG = dO·Sᵀ, dP = dO·Eᵀ,
dKG = E·dSᵀ, dgc = Σ_v dS ⊙ S) are batched matmuls over all chunks at once, done in XLA.

Array layout: chunk-major `[B, HV, Nc, C, D]`; C = 64, K = 64 or 128, V a multiple of 64
(V-tile 64). Shared memory at K = 128: ~200 KiB forward (two input slots), ~200 KiB backward.
Operands NY, QG, KG, P and dO are bf16; U, dE_ext, gc and the states are float32.
Written in `plgpu.kernel` style so JAX's Mosaic GPU interpreter runs them on CPU (`interpret=`).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu import mosaic_common as mc

MM_DTYPE = jnp.bfloat16  # wgmma operand dtype; accumulation is always float32
CHUNK = 64               # wgmma M tile: rows of a chunk
BLOCK_V = 64             # value columns per CTA


# Index widths (docs/KERNELS_GPU.md, "Indexing past 2^31 elements"): every global access of these
# kernels is a TMA copy whose coordinates are signed 32-bit, one per dimension of the TMA view
# (the array, tiled; its squeezed leading dims collapsed into one when it has more than five), and
# CUDA caps grid x at 2^31 − 1 and grid y, z at 65535. Element offsets are never linearised.
MAX_TMA_DIM = 2**31 - 1
MAX_GRID_YZ = 65535


def index_range_reason(b: int, t: int, hv: int, dv: int) -> str | None:
  """None if the kernels' TMA coordinates and grid fit these sizes (T a multiple of the chunk),
  else why not. The largest view dimension of either kernel family is B·T·HV rows of
  `[B, T, HV, D]` (collapsed leading dims); the state pass puts HV and V/64 on grid y and z."""
  rows = b * t * hv
  if rows > MAX_TMA_DIM:
    return (f"B·T·HV = {rows} rows exceed {MAX_TMA_DIM}, the largest signed 32-bit TMA "
            "coordinate")
  if hv > MAX_GRID_YZ or dv // BLOCK_V > MAX_GRID_YZ:
    return f"HV = {hv} or V/{BLOCK_V} = {dv // BLOCK_V} exceeds CUDA's grid y/z limit {MAX_GRID_YZ}"
  return None


def check_index_range(b: int, t: int, hv: int, dv: int) -> None:
  """Raises ValueError where `index_range_reason` gives a reason (kernels called directly)."""
  reason = index_range_reason(b, t, hv, dv)
  if reason:
    raise ValueError(f"pallas_kernels.gpu: {reason}.")


def supported(chunk: int, dk: int, dv: int) -> str | None:
  """None if the kernels handle these sizes, else why not (for the caller's log line)."""
  if chunk != CHUNK:
    return f"chunk_size={chunk} (the Mosaic GPU kernels need {CHUNK})"
  if dk not in (64, 128):  # K = 192/256 would need more than Hopper's 227 KiB of smem
    return f"head dim K={dk} (the Mosaic GPU kernels need K = 64 or 128)"
  if dv % BLOCK_V:
    return f"head dim V={dv} (needs a multiple of {BLOCK_V})"
  return None


def _load_tile(src_gmem, shape, dtype):
  """Copies one gmem tile into registers (WGMMA layout) through a scoped smem buffer."""
  def body(buf, bar):
    plgpu.copy_gmem_to_smem(src_gmem, buf, bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    return buf[...]
  return pl.run_scoped(body, mc.smem(shape, dtype), plgpu.Barrier(num_barriers=1))


def _store_tile(x, dst_gmem):
  """Writes registers to a gmem tile through a scoped smem buffer and waits for the copy."""
  def body(buf):
    buf[...] = x.astype(buf.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(buf, dst_gmem)
    plgpu.wait_smem_to_gmem(0)
  pl.run_scoped(body, mc.smem(x.shape, dst_gmem.dtype))


def _mesh_kwargs(b, hv, nc, dv):
  check_index_range(b, nc * CHUNK, hv, dv)
  return dict(grid=(dv // BLOCK_V, hv, b), grid_names=("v", "h", "b"))


def _issue(srcs, dsts, bars, slot):
  for src, dst, bar in zip(srcs, dsts, bars):
    plgpu.copy_gmem_to_smem(src, dst.at[slot], bar.at[slot])


def state_passing_fwd(ny, qg, p, u, kg, gc, s0, *, save_states=False, interpret=None):
  """Forward state pass.

  Args:
    ny, qg, kg: `[B, HV, Nc, C, K]` bf16 (−Y, Q⊙Γ, K⊙e^{G_C−G} of each chunk).
    p: `[B, HV, Nc, C, C]` bf16 masked intra-chunk attention.
    u: `[B, HV, Nc, C, V]` float32 pseudo-values.
    gc: `[B, HV, Nc, K]` float32 decay of the entry state across each chunk.
    s0: `[B, HV, K, V]` float32 initial state.
    save_states: also return the bf16 state entering every chunk (for the backward).
  Returns:
    (o, e, s_final[, h]): o, e `[B, HV, Nc, C, V]` float32, s_final `[B, HV, K, V]` float32,
    h `[B, HV, Nc, K, V]` bf16.
  """
  outs = _state_passing_fwd(ny, qg, p, u, kg, gc, s0, save_states=save_states,
                            interpret=interpret)
  return mc.sync_if_interpreted(outs, interpret)


@functools.partial(jax.jit, static_argnames=("save_states", "interpret"))
def _state_passing_fwd(ny, qg, p, u, kg, gc, s0, *, save_states, interpret):
  b, hv, nc, c, dk = qg.shape
  dv = u.shape[-1]
  bv = BLOCK_V
  f32 = jnp.float32
  out_type = [jax.ShapeDtypeStruct((b, hv, nc, c, dv), f32),
              jax.ShapeDtypeStruct((b, hv, nc, c, dv), f32),
              jax.ShapeDtypeStruct((b, hv, dk, dv), f32)]
  if save_states:
    out_type.append(jax.ShapeDtypeStruct((b, hv, nc, dk, dv), MM_DTYPE))

  def kernel(ny_ref, qg_ref, p_ref, u_ref, kg_ref, gc_ref, s0_ref, o_ref, e_ref, sf_ref,
             *maybe_h):
    h_ref = maybe_h[0] if save_states else None
    bi, hi, vi = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
    vs = pl.ds(vi * bv, bv)
    state = _load_tile(s0_ref.at[bi, hi, :, vs], (dk, bv), f32)

    def chunk_srcs(ci):
      return (ny_ref.at[bi, hi, ci], qg_ref.at[bi, hi, ci], p_ref.at[bi, hi, ci],
              u_ref.at[bi, hi, ci, :, vs], kg_ref.at[bi, hi, ci], gc_ref.at[bi, hi, ci])

    def loop(ny_s, qg_s, p_s, u_s, kg_s, gc_s, s_mm, e_mm, o_out, e_out, bars):
      dsts = (ny_s, qg_s, p_s, u_s, kg_s, gc_s)
      _issue(chunk_srcs(0), dsts, bars, 0)
      s_mm[...] = state.astype(MM_DTYPE)
      plgpu.commit_smem()

      def step(ci, s):
        slot = lax.rem(ci, 2)

        @pl.when(ci + 1 < nc)
        def _prefetch():
          _issue(chunk_srcs(ci + 1), dsts, bars, 1 - slot)

        for bar in bars:
          plgpu.barrier_wait(bar.at[slot])
        if save_states:  # the state entering chunk ci, exactly the operand used below
          plgpu.copy_smem_to_gmem(s_mm, h_ref.at[bi, hi, ci, :, vs])
        u = u_s.at[slot][...]

        e, o = mc.matmuls((c, bv, [(ny_s.at[slot], s_mm)]), (c, bv, [(qg_s.at[slot], s_mm)]))
        e = e + u

        gcv = plgpu.load(gc_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(1))
        # The previous chunk's output copies must have read o_out / e_out (h may stay pending).
        plgpu.wait_smem_to_gmem(1 if save_states else 0, wait_read_only=True)
        e_out[...] = e
        e_mm[...] = e.astype(MM_DTYPE)
        plgpu.commit_smem()

        pe, ke = mc.matmuls((c, bv, [(p_s.at[slot], e_mm)]),
                            (dk, bv, [(kg_s.at[slot].transpose((1, 0)), e_mm)]))
        o = o + pe
        s = s * mc.rows(gcv, s.shape) + ke

        o_out[...] = o
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # h copy done reading s_mm
        s_mm[...] = s.astype(MM_DTYPE)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_out, o_ref.at[bi, hi, ci, :, vs], commit_group=False)
        plgpu.copy_smem_to_gmem(e_out, e_ref.at[bi, hi, ci, :, vs], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        return s

      s = lax.fori_loop(0, nc, step, state)
      plgpu.wait_smem_to_gmem(0)
      return s

    barriers = tuple(plgpu.Barrier(num_barriers=2) for _ in range(6))
    state = pl.run_scoped(
        loop,
        mc.smem((2, c, dk), MM_DTYPE), mc.smem((2, c, dk), MM_DTYPE), mc.smem((2, c, c), MM_DTYPE),
        mc.smem((2, c, bv), f32), mc.smem((2, c, dk), MM_DTYPE), plgpu.SMEM((2, dk), f32),
        mc.smem((dk, bv), MM_DTYPE), mc.smem((c, bv), MM_DTYPE),
        mc.smem((c, bv), f32), mc.smem((c, bv), f32), barriers)
    _store_tile(state, sf_ref.at[bi, hi, :, vs])

  return plgpu.kernel(kernel, out_type=tuple(out_type), interpret=interpret,
                      **_mesh_kwargs(b, hv, nc, dv))(ny, qg, p, u, kg, gc, s0)


def state_passing_bwd(ny, qg, p, kg, gc, do, de_ext, ds_final, *, interpret=None):
  """Reverse state pass (docs/MATH.md §3.6 steps 1-2).

  Args:
    ny, qg, p, kg, gc: as in `state_passing_fwd`.
    do: `[B, HV, Nc, C, V]` bf16 output cotangent.
    de_ext: `[B, HV, Nc, C, V]` float32 cotangent of E as an output (routing), or None where
      E is not used (the kernel then reads nothing in its place: no zeros made and streamed).
    ds_final: `[B, HV, K, V]` float32 cotangent of the final state, or zeros.
  Returns:
    (de, dh, ds0): de `[B, HV, Nc, C, V]` float32 total cotangent of E; dh `[B, HV, Nc, K, V]`
    bf16 cotangent of the state leaving each chunk; ds0 `[B, HV, K, V]` float32.
  """
  outs = _state_passing_bwd(ny, qg, p, kg, gc, do, de_ext, ds_final, interpret=interpret)
  return mc.sync_if_interpreted(outs, interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _state_passing_bwd(ny, qg, p, kg, gc, do, de_ext, ds_final, *, interpret):
  b, hv, nc, c, dk = qg.shape
  dv = do.shape[-1]
  bv = BLOCK_V
  f32 = jnp.float32
  out_type = (jax.ShapeDtypeStruct((b, hv, nc, c, dv), f32),
              jax.ShapeDtypeStruct((b, hv, nc, dk, dv), MM_DTYPE),
              jax.ShapeDtypeStruct((b, hv, dk, dv), f32))

  has_dx = de_ext is not None

  def kernel(*refs):
    ny_ref, qg_ref, p_ref, kg_ref, gc_ref, do_ref, *refs = refs
    dx_ref = refs.pop(0) if has_dx else None
    dsf_ref, de_ref, dh_ref, ds0_ref = refs
    bi, hi, vi = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
    vs = pl.ds(vi * bv, bv)
    dstate = _load_tile(dsf_ref.at[bi, hi, :, vs], (dk, bv), f32)

    def chunk_srcs(ci):
      return (ny_ref.at[bi, hi, ci], qg_ref.at[bi, hi, ci], p_ref.at[bi, hi, ci],
              kg_ref.at[bi, hi, ci], gc_ref.at[bi, hi, ci], do_ref.at[bi, hi, ci, :, vs]) + (
                  (dx_ref.at[bi, hi, ci, :, vs],) if has_dx else ())

    def loop(ny_s, qg_s, p_s, kg_s, gc_s, do_s, *scratch):
      dx_s, ds_mm, de_mm, de_out, bars = scratch if has_dx else (None, *scratch)
      dsts = (ny_s, qg_s, p_s, kg_s, gc_s, do_s) + ((dx_s,) if has_dx else ())
      _issue(chunk_srcs(nc - 1), dsts, bars, 0)
      ds_mm[...] = dstate.astype(MM_DTYPE)
      plgpu.commit_smem()

      def step(j, ds):
        ci = nc - 1 - j
        slot = lax.rem(j, 2)

        @pl.when(j + 1 < nc)
        def _prefetch():
          _issue(chunk_srcs(ci - 1), dsts, bars, 1 - slot)

        for bar in bars:
          plgpu.barrier_wait(bar.at[slot])
        plgpu.copy_smem_to_gmem(ds_mm, dh_ref.at[bi, hi, ci, :, vs])  # dS leaving chunk ci
        gcv = plgpu.load(gc_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(1))

        de, qdo = mc.matmuls(
            (c, bv, [(p_s.at[slot].transpose((1, 0)), do_s.at[slot]), (kg_s.at[slot], ds_mm)]),
            (dk, bv, [(qg_s.at[slot].transpose((1, 0)), do_s.at[slot])]))
        if has_dx:
          de = de + dx_s.at[slot][...]
        ds = ds * mc.rows(gcv, ds.shape) + qdo

        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # previous de copy done reading
        de_out[...] = de
        de_mm[...] = de.astype(MM_DTYPE)
        plgpu.commit_smem()

        (yde,) = mc.matmuls((dk, bv, [(ny_s.at[slot].transpose((1, 0)), de_mm)]))
        ds = ds + yde

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # dh copy done reading ds_mm
        ds_mm[...] = ds.astype(MM_DTYPE)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(de_out, de_ref.at[bi, hi, ci, :, vs])
        return ds

      ds = lax.fori_loop(0, nc, step, dstate)
      plgpu.wait_smem_to_gmem(0)
      return ds

    barriers = tuple(plgpu.Barrier(num_barriers=2) for _ in range(6 + has_dx))
    dstate = pl.run_scoped(
        loop,
        mc.smem((2, c, dk), MM_DTYPE), mc.smem((2, c, dk), MM_DTYPE), mc.smem((2, c, c), MM_DTYPE),
        mc.smem((2, c, dk), MM_DTYPE), plgpu.SMEM((2, dk), f32), mc.smem((2, c, bv), MM_DTYPE),
        *([mc.smem((2, c, bv), f32)] if has_dx else []), mc.smem((dk, bv), MM_DTYPE),
        mc.smem((c, bv), MM_DTYPE), mc.smem((c, bv), f32), barriers)
    _store_tile(dstate, ds0_ref.at[bi, hi, :, vs])

  args = (ny, qg, p, kg, gc, do) + ((de_ext,) if has_dx else ()) + (ds_final,)
  return plgpu.kernel(kernel, out_type=out_type, interpret=interpret,
                      **_mesh_kwargs(b, hv, nc, dv))(*args)


def state_passing_reference(ny, qg, p, u, kg, gc, s0, *, round_operands=False):
  """The same forward recurrence as a float32 `lax.scan`: the test oracle.

  With `round_operands` the state and E are rounded to bf16 where the kernel feeds them to a
  matmul, so kernel and oracle should agree to float32 accumulation-order noise.
  Returns (o, e, s_final, h) with h the float32 state entering each chunk `[B, HV, Nc, K, V]`.
  """
  hi = lax.Precision.HIGHEST
  f = lambda x: x.astype(jnp.float32)
  mv = lambda x: jnp.moveaxis(f(x), 2, 0)
  rnd = (lambda x: x.astype(MM_DTYPE).astype(jnp.float32)) if round_operands else (lambda x: x)

  def step(s, xs):
    ny_c, qg_c, p_c, u_c, kg_c, gc_c = xs
    sm = rnd(s)
    e = u_c + jnp.einsum("bhck,bhkv->bhcv", ny_c, sm, precision=hi)
    em = rnd(e)
    o = jnp.einsum("bhck,bhkv->bhcv", qg_c, sm, precision=hi) + \
        jnp.einsum("bhij,bhjv->bhiv", p_c, em, precision=hi)
    s_next = gc_c[..., None] * s + jnp.einsum("bhck,bhcv->bhkv", kg_c, em, precision=hi)
    return s_next, (o, e, s)

  s, (o, e, h) = lax.scan(step, f(s0), tuple(mv(x) for x in (ny, qg, p, u, kg, gc)))
  return jnp.moveaxis(o, 0, 2), jnp.moveaxis(e, 0, 2), s, jnp.moveaxis(h, 0, 2)
