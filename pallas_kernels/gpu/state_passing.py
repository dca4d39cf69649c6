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
dKG = E·dSᵀ, dgc = Σ_v dS ⊙ S) are batched products over all chunks at once, made by XLA or a
products kernel. Each sums over V, so where one CTA holds all of V (K = V = 64) the reverse
pass makes them itself instead (`products=`), from E and the states streamed in beside its own
tiles, and the state cotangent never leaves the chip.

Rows in pieces (`pieces=P`): grid axis "b" runs over B·P, piece j of row b walking its own
Nc/P chunks from its own entry state (the states in and out are `[B·P, HV, K, V]`; the
per-chunk arrays keep their layout). `states_only` passes carry the state alone: forward from
[I | 0] they give each piece's affine map, backward from a zero cotangent its own entry
cotangent (the composition: `lineax_attn.ops.gpu_pieces`).

Array layout: chunk-major `[B, HV, Nc, C, D]`; C = 64, K = 64 or 128, V a multiple of 64
(V-tile 64). Shared memory at K = 128: ~200 KiB forward (two input slots), ~200 KiB backward.
Operands NY, QG, KG, P and dO are bf16; U, dE_ext, gc and the states are float32; O and E
float32 or, `out_dtype=bfloat16`, rounded once to bf16 on chip.
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


OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def check_out_dtype(out_dtype, name="out_dtype"):
  """out_dtype as a numpy dtype, if the kernels write their per-chunk outputs (o and e
  forward, de in reverse) in it (`OUT_DTYPES`); else ValueError naming the argument."""
  dtype = jnp.dtype(out_dtype)
  if dtype not in OUT_DTYPES:
    raise ValueError(f"state pass: {name}={dtype} must be one of "
                     f"{', '.join(map(str, OUT_DTYPES))}.")
  return dtype


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


def _mesh_kwargs(b, hv, nc, dv, pieces=1):
  check_index_range(b, nc * CHUNK, hv, dv)
  return dict(grid=(dv // BLOCK_V, hv, b * pieces), grid_names=("v", "h", "b"))


def _piece(pieces: int, ncp: int):
  """(row of the per-piece states, batch row, first chunk) of this CTA: grid axis "b" runs over
  B·pieces, piece j of batch row b at b·pieces + j walking chunks [j·ncp, (j + 1)·ncp)."""
  row = lax.axis_index("b")
  if pieces == 1:
    return row, row, 0
  return row, lax.div(row, pieces), lax.rem(row, pieces) * ncp


def _check_pieces(nc: int, pieces: int, states_shape, b: int, name: str):
  if not isinstance(pieces, int) or pieces < 1 or nc % pieces:
    raise ValueError(f"state pass: pieces={pieces!r} must be a positive int dividing the "
                     f"{nc} chunks.")
  if states_shape[0] != b * pieces:
    raise ValueError(f"state pass: {name} needs one state per piece, [B·pieces = "
                     f"{b * pieces}, HV, K, ·], got {tuple(states_shape)}.")


def _issue(srcs, dsts, bars, slot):
  for src, dst, bar in zip(srcs, dsts, bars):
    plgpu.copy_gmem_to_smem(src, dst.at[slot], bar.at[slot])


def _chunk_loop(n, step_srcs, dsts, bars, body, init):
  """`lax.fori_loop` of body(j, slot, carry) over n steps, step j's inputs (the HBM refs
  `step_srcs(j)`) waited for in `slot` of the two-slot buffers `dsts` while step j + 1's are
  copied by TMA into the other."""
  _issue(step_srcs(0), dsts, bars, 0)

  def step(j, carry):
    slot = lax.rem(j, 2)

    @pl.when(j + 1 < n)
    def _prefetch():
      _issue(step_srcs(j + 1), dsts, bars, 1 - slot)

    for bar in bars:
      plgpu.barrier_wait(bar.at[slot])
    return body(j, slot, carry)

  return lax.fori_loop(0, n, step, init)


def state_passing_fwd(ny, qg, p, u, kg, gc, s0, *, save_states=False, states_only=False,
                      pieces=1, out_dtype=jnp.float32, o_rows=False, interpret=None):
  """Forward state pass.

  Args:
    ny, qg, kg: `[B, HV, Nc, C, K]` bf16 (−Y, Q⊙Γ, K⊙e^{G_C−G} of each chunk).
    p: `[B, HV, Nc, C, C]` bf16 masked intra-chunk attention.
    u: `[B, HV, Nc, C, V]` float32 pseudo-values.
    gc: `[B, HV, Nc, K]` float32 decay of the entry state across each chunk.
    s0: `[B·pieces, HV, K, V]` float32 state entering each piece (pieces 1: the initial state).
    save_states: also return the bf16 state entering every chunk (for the backward).
    out_dtype: o's and e's dtype, float32 or bfloat16 (`OUT_DTYPES`). bf16 is the float32
      results rounded once on chip (e is the bf16 operand the products already use), the
      values a caller casting them to bf16 would get, at half their bytes.
    states_only: carry the state alone and return only the final state (the affine maps of
      rows cut into pieces, `lineax_attn.ops.gpu_vjps.state_pass`): qg and p are not read, O is
      not made, nothing is stored per chunk. s0 may then be wider than u, `[B·pieces, HV, K,
      L + V]`: its first L columns (a multiple of 64) walk with U = 0, so that from s0 = [I | 0]
      the final state is the map [Φ | Ψ] of S_out = Φ S_in + Ψ. Excludes save_states.
    pieces: each row's Nc chunks are walked as `pieces` consecutive pieces at once (Nc a
      multiple of it), piece j of row b from s0[b·pieces + j] (its own CTAs: small B·HV fill
      the GPU); the per-chunk outputs keep the `[B, HV, Nc, ...]` layout.
    o_rows: write o in the op's own layout `[B, T, HV, V]` (T = Nc·C) instead of chunk-major,
      so that neither o nor its cotangent (`state_passing_bwd(o_rows=True)`) is relaid out
      by XLA between the caller and the kernels.
  Returns:
    (o, e, s_final[, h]): o, e `[B, HV, Nc, C, V]` (o `[B, T, HV, V]` with o_rows) in
    out_dtype, s_final `[B·pieces, HV, K, V]` float32 (the state leaving each piece), h
    `[B, HV, Nc, K, V]` bf16; with states_only `(s_final,)`, as wide as s0.
  """
  if states_only and save_states:
    raise ValueError("state_passing_fwd: states_only stores no chunk states; save_states must "
                     "be False with it.")
  b, _, nc = u.shape[:3]
  _check_pieces(nc, pieces, s0.shape, b, "s0")
  lead = s0.shape[-1] - u.shape[-1]
  if lead and not (states_only and lead > 0 and lead % BLOCK_V == 0):
    raise ValueError(f"state_passing_fwd: s0 {tuple(s0.shape)} must be as wide as u "
                     f"{tuple(u.shape)}, or (states_only) wider by a multiple of {BLOCK_V}.")
  out_dtype = check_out_dtype(out_dtype)
  outs = _state_passing_fwd(ny, qg, p, u, kg, gc, s0, save_states=save_states,
                            states_only=states_only, pieces=pieces, out_dtype=out_dtype,
                            o_rows=bool(o_rows), interpret=interpret)
  return mc.sync_if_interpreted(outs, interpret)


@functools.partial(jax.jit, static_argnames=("save_states", "states_only", "pieces",
                                             "out_dtype", "o_rows", "interpret"))
def _state_passing_fwd(ny, qg, p, u, kg, gc, s0, *, save_states, interpret, states_only=False,
                       pieces=1, out_dtype=jnp.float32, o_rows=False):
  b, hv, nc, c, dk = qg.shape
  dv = u.shape[-1]
  ncp = nc // pieces
  bv = BLOCK_V
  f32 = jnp.float32
  # bf16 outputs: e leaves from its bf16 operand copy (no float32 staging tile for it).
  e_from_operand = jnp.dtype(out_dtype) == jnp.dtype(MM_DTYPE)
  out_type = [jax.ShapeDtypeStruct((b, nc * c, hv, dv) if o_rows else (b, hv, nc, c, dv),
                                   out_dtype),
              jax.ShapeDtypeStruct((b, hv, nc, c, dv), out_dtype),
              jax.ShapeDtypeStruct((b * pieces, hv, dk, dv), f32)]
  if save_states:
    out_type.append(jax.ShapeDtypeStruct((b, hv, nc, dk, dv), MM_DTYPE))
  if states_only:
    out_type = [jax.ShapeDtypeStruct(s0.shape, f32)]

  def kernel(ny_ref, qg_ref, p_ref, u_ref, kg_ref, gc_ref, s0_ref, *out_refs):
    if states_only:
      return _states_only_kernel(ny_ref, u_ref, kg_ref, gc_ref, s0_ref, *out_refs,
                                 pieces=pieces, ncp=ncp)
    o_ref, e_ref, sf_ref, *maybe_h = out_refs
    h_ref = maybe_h[0] if save_states else None
    row, bi, c0 = _piece(pieces, ncp)
    hi, vi = lax.axis_index("h"), lax.axis_index("v")
    vs = pl.ds(vi * bv, bv)
    state = _load_tile(s0_ref.at[row, hi, :, vs], (dk, bv), f32)

    def chunk_srcs(ci):
      ci = c0 + ci
      return (ny_ref.at[bi, hi, ci], qg_ref.at[bi, hi, ci], p_ref.at[bi, hi, ci],
              u_ref.at[bi, hi, ci, :, vs], kg_ref.at[bi, hi, ci], gc_ref.at[bi, hi, ci])

    def loop(ny_s, qg_s, p_s, u_s, kg_s, gc_s, s_mm, e_mm, o_out, *rest):
      *e_outs, bars = rest   # e's own staging tile unless it leaves from e_mm
      e_out = None if e_from_operand else e_outs[0]
      s_mm[...] = state.astype(MM_DTYPE)
      plgpu.commit_smem()

      def step(ci, slot, s):
        if save_states:  # the state entering chunk ci, exactly the operand used below
          plgpu.copy_smem_to_gmem(s_mm, h_ref.at[bi, hi, c0 + ci, :, vs])
        u = u_s.at[slot][...]

        e, o = mc.matmuls((c, bv, [(ny_s.at[slot], s_mm)]), (c, bv, [(qg_s.at[slot], s_mm)]))
        e = e + u

        gcv = plgpu.load(gc_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(1))
        # The previous chunk's output copies must have read o_out / e_out (h may stay pending).
        plgpu.wait_smem_to_gmem(1 if save_states else 0, wait_read_only=True)
        if not e_from_operand:
          e_out[...] = e.astype(e_out.dtype)
        e_mm[...] = e.astype(MM_DTYPE)
        plgpu.commit_smem()

        pe, ke = mc.matmuls((c, bv, [(p_s.at[slot], e_mm)]),
                            (dk, bv, [(kg_s.at[slot].transpose((1, 0)), e_mm)]))
        o = o + pe
        s = s * mc.rows(gcv, s.shape) + ke

        o_out[...] = o.astype(o_out.dtype)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # h copy done reading s_mm
        s_mm[...] = s.astype(MM_DTYPE)
        plgpu.commit_smem()
        o_dst = (o_ref.at[bi, pl.ds((c0 + ci) * c, c), hi, vs] if o_rows
                 else o_ref.at[bi, hi, c0 + ci, :, vs])
        plgpu.copy_smem_to_gmem(o_out, o_dst, commit_group=False)
        plgpu.copy_smem_to_gmem(e_mm if e_from_operand else e_out,
                                e_ref.at[bi, hi, c0 + ci, :, vs], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        return s

      s = _chunk_loop(ncp, chunk_srcs, (ny_s, qg_s, p_s, u_s, kg_s, gc_s), bars, step, state)
      plgpu.wait_smem_to_gmem(0)
      return s

    barriers = tuple(plgpu.Barrier(num_barriers=2) for _ in range(6))
    state = pl.run_scoped(
        loop,
        mc.smem((2, c, dk), MM_DTYPE), mc.smem((2, c, dk), MM_DTYPE), mc.smem((2, c, c), MM_DTYPE),
        mc.smem((2, c, bv), f32), mc.smem((2, c, dk), MM_DTYPE), plgpu.SMEM((2, dk), f32),
        mc.smem((dk, bv), MM_DTYPE), mc.smem((c, bv), MM_DTYPE),
        mc.smem((c, bv), out_dtype),
        *([] if e_from_operand else [mc.smem((c, bv), out_dtype)]), barriers)
    _store_tile(state, sf_ref.at[row, hi, :, vs])

  grid_v = s0.shape[-1] if states_only else dv
  return plgpu.kernel(kernel, out_type=tuple(out_type), interpret=interpret,
                      **_mesh_kwargs(b, hv, nc, grid_v, pieces))(ny, qg, p, u, kg, gc, s0)


def _states_only_kernel(ny_ref, u_ref, kg_ref, gc_ref, s0_ref, sf_ref, *, pieces, ncp):
  """The forward's state chain alone, E = U + NY·S, S' = gc⊙S + KGᵀ·E, from s0 to the final
  state: half the forward's products (no QG·S, no P·E) and nothing stored per chunk. State
  columns before u's (s0 wider than u by L) walk with U = 0: their CTAs read u's first tile
  and scale it by 0 (one copy pattern for every CTA; the walk is latency-bound)."""
  c, dk = ny_ref.shape[-2:]
  lead = (s0_ref.shape[-1] - u_ref.shape[-1]) // BLOCK_V
  bv = BLOCK_V
  f32 = jnp.float32
  row, bi, c0 = _piece(pieces, ncp)
  hi, vi = lax.axis_index("h"), lax.axis_index("v")
  vs = pl.ds(vi * bv, bv)
  state = _load_tile(s0_ref.at[row, hi, :, vs], (dk, bv), f32)
  us = pl.ds(jnp.maximum(vi - lead, 0) * bv, bv) if lead else vs
  u_scale = jnp.where(vi >= lead, 1.0, 0.0).astype(f32) if lead else None

  def chunk_srcs(ci):
    ci = c0 + ci
    return (ny_ref.at[bi, hi, ci], u_ref.at[bi, hi, ci, :, us], kg_ref.at[bi, hi, ci],
            gc_ref.at[bi, hi, ci])

  def loop(ny_s, u_s, kg_s, gc_s, s_mm, e_mm, bars):
    s_mm[...] = state.astype(MM_DTYPE)
    plgpu.commit_smem()

    def step(_, slot, s):
      (e,) = mc.matmuls((c, bv, [(ny_s.at[slot], s_mm)]))
      u = u_s.at[slot][...]
      e_mm[...] = (e + (u if u_scale is None else u * u_scale)).astype(MM_DTYPE)
      plgpu.commit_smem()
      (ke,) = mc.matmuls((dk, bv, [(kg_s.at[slot].transpose((1, 0)), e_mm)]))
      gcv = plgpu.load(gc_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(1))
      s = s * mc.rows(gcv, s.shape) + ke
      s_mm[...] = s.astype(MM_DTYPE)
      plgpu.commit_smem()
      return s

    return _chunk_loop(ncp, chunk_srcs, (ny_s, u_s, kg_s, gc_s), bars, step, state)

  barriers = tuple(plgpu.Barrier(num_barriers=2) for _ in range(4))
  state = pl.run_scoped(
      loop, mc.smem((2, c, dk), MM_DTYPE), mc.smem((2, c, bv), f32), mc.smem((2, c, dk), MM_DTYPE),
      plgpu.SMEM((2, dk), f32), mc.smem((dk, bv), MM_DTYPE), mc.smem((c, bv), MM_DTYPE),
      barriers)
  _store_tile(state, sf_ref.at[row, hi, :, vs])


def products_reason(dk: int, dv: int) -> str | None:
  """None where the reverse pass can make the state pass's products itself
  (`state_passing_bwd(products=...)`), else why not. Each product sums over V, so one CTA must
  hold all of V; at K = V = 64 its tiles fit beside the pass's own."""
  if (dk, dv) != (BLOCK_V, BLOCK_V):
    return (f"K={dk}, V={dv}: the reverse pass makes the products only where one CTA holds all "
            f"of V and K, K = V = {BLOCK_V}")
  return None


def state_passing_bwd(ny, qg, p, kg, gc, do, de_ext, ds_final, *, states_only=False,
                      pieces=1, de_dtype=jnp.float32, o_rows=False, products=None,
                      interpret=None):
  """Reverse state pass (docs/MATH.md §3.6 steps 1-2).

  Args:
    ny, qg, p, kg, gc: as in `state_passing_fwd`.
    do: `[B, HV, Nc, C, V]` bf16 output cotangent (o_rows: `[B, T, HV, V]`, o's layout of
      `state_passing_fwd(o_rows=True)`).
    de_ext: `[B, HV, Nc, C, V]` float32 cotangent of E as an output (routing), or None where
      E is not used (the kernel then reads nothing in its place: no zeros made and streamed).
    ds_final: `[B·pieces, HV, K, V]` float32 cotangent of the state leaving each piece (pieces
      1: of the final state), or zeros.
    states_only: return only ds0 (nothing stored per chunk): from a zero ds_final, each
      piece's own entry cotangent, for rows cut into pieces (`gpu_vjps.state_pass`).
    pieces: as in `state_passing_fwd`: piece j of row b walks back from ds_final[b·pieces + j].
    de_dtype: de's dtype, float32 or bfloat16 (`OUT_DTYPES`). bf16 is the float32 result
      rounded once on chip (it leaves from the bf16 operand copy the pass makes anyway), for
      callers whose every use of dE is a bf16 operand (the channel kernels' states path).
    products: None, or (e, h), the forward pass's E `[B, HV, Nc, C, V]` and chunk states h
      `[B, HV, Nc, K, V]` (bf16): the pass then also makes the state pass's cotangent products
      of each chunk from the tiles it holds, dNY = dE hᵀ, dQG = dO hᵀ, dP = dO Eᵀ, dKG = E dhᵀ,
      dgc = Σ_v h ⊙ dh (bf16 operands, float32 sums, rounded once to bf16; dgc float32), and
      dh never leaves the chip. Only where `products_reason` is None (one CTA holds all of V).
  Returns:
    (de, dh, ds0): de `[B, HV, Nc, C, V]` total cotangent of E in de_dtype; dh `[B, HV, Nc, K, V]`
    bf16 cotangent of the state leaving each chunk; ds0 `[B·pieces, HV, K, V]` float32, the
    cotangent of the state entering each piece; with states_only `(ds0,)`; with products
    (de, d_ny, d_qg, d_p, d_kg, d_gc, ds0): d_ny, d_qg, d_kg `[B, HV, Nc, C, K]`, d_p
    `[B, HV, Nc, C, C]` bf16, d_gc `[B, HV, Nc, K]` float32.
  """
  b, hv, nc, c = qg.shape[:4]
  want = (b, nc * c, hv) if o_rows else (b, hv, nc, c)
  if tuple(do.shape[:-1]) != want:
    raise ValueError(f"state_passing_bwd: do {tuple(do.shape)} must be {want + ('V',)} "
                     f"(o_rows={bool(o_rows)}).")
  _check_pieces(nc, pieces, ds_final.shape, b, "ds_final")
  de_dtype = check_out_dtype(de_dtype, "de_dtype")
  if products is not None:
    e, h = products
    dk, dv = qg.shape[-1], do.shape[-1]
    reason = products_reason(dk, dv) or (
        "states_only makes no per-chunk outputs" if states_only else None)
    if reason:
      raise ValueError(f"state_passing_bwd: products: {reason}.")
    if tuple(e.shape) != (b, hv, nc, c, dv) or tuple(h.shape) != (b, hv, nc, dk, dv):
      raise ValueError(f"state_passing_bwd: products (e, h) must be {(b, hv, nc, c, dv)} and "
                       f"{(b, hv, nc, dk, dv)}, got {tuple(e.shape)} and {tuple(h.shape)}.")
    products = (e.astype(MM_DTYPE), h.astype(MM_DTYPE))
  outs = _state_passing_bwd(ny, qg, p, kg, gc, do, de_ext, ds_final, products,
                            states_only=states_only, pieces=pieces, de_dtype=de_dtype,
                            o_rows=bool(o_rows), interpret=interpret)
  return mc.sync_if_interpreted(outs, interpret)


@functools.partial(jax.jit, static_argnames=("states_only", "pieces", "de_dtype", "o_rows",
                                             "interpret"))
def _state_passing_bwd(ny, qg, p, kg, gc, do, de_ext, ds_final, products=None, *, interpret,
                       states_only=False, pieces=1, de_dtype=jnp.float32, o_rows=False):
  b, hv, nc, c, dk = qg.shape
  dv = do.shape[-1]
  ncp = nc // pieces
  bv = BLOCK_V
  f32 = jnp.float32
  # bf16 de leaves from its bf16 operand copy (no float32 staging tile for it).
  de_from_operand = jnp.dtype(de_dtype) == jnp.dtype(MM_DTYPE)
  staged = not (states_only or de_from_operand)
  with_products = products is not None
  sds = jax.ShapeDtypeStruct
  out_type = (sds((b, hv, nc, c, dv), de_dtype), sds((b, hv, nc, dk, dv), MM_DTYPE),
              sds((b * pieces, hv, dk, dv), f32))
  if states_only:
    out_type = out_type[2:]
  if with_products:   # de, then dNY, dQG, dP, dKG, dgc in place of dh, then ds0
    ck = sds((b, hv, nc, c, dk), MM_DTYPE)
    out_type = (out_type[0], ck, ck, sds((b, hv, nc, c, c), MM_DTYPE), ck,
                sds((b, hv, nc, dk), f32), out_type[2])

  has_dx = de_ext is not None

  def kernel(*refs):
    ny_ref, qg_ref, p_ref, kg_ref, gc_ref, do_ref, *refs = refs
    dx_ref = refs.pop(0) if has_dx else None
    e_ref, h_ref = (refs.pop(0), refs.pop(0)) if with_products else (None, None)
    dh_ref = None
    if states_only:
      (dsf_ref, ds0_ref), de_ref = refs, None
    elif with_products:
      dsf_ref, de_ref, dny_ref, dqg_ref, dp_ref, dkg_ref, dgc_ref, ds0_ref = refs
    else:
      dsf_ref, de_ref, dh_ref, ds0_ref = refs
    row, bi, c0 = _piece(pieces, ncp)
    hi, vi = lax.axis_index("h"), lax.axis_index("v")
    vs = pl.ds(vi * bv, bv)
    dstate = _load_tile(dsf_ref.at[row, hi, :, vs], (dk, bv), f32)

    last = c0 + ncp - 1   # step j walks chunk last − j

    def step_srcs(j):
      ci = last - j
      return (ny_ref.at[bi, hi, ci], qg_ref.at[bi, hi, ci], p_ref.at[bi, hi, ci],
              kg_ref.at[bi, hi, ci], gc_ref.at[bi, hi, ci],
              do_ref.at[bi, pl.ds(ci * c, c), hi, vs] if o_rows
              else do_ref.at[bi, hi, ci, :, vs]) + (
                  (dx_ref.at[bi, hi, ci, :, vs],) if has_dx else ()) + (
                  (e_ref.at[bi, hi, ci], h_ref.at[bi, hi, ci]) if with_products else ())

    def loop(ny_s, qg_s, p_s, kg_s, gc_s, do_s, *scratch):
      scratch = list(scratch)
      dx_s = scratch.pop(0) if has_dx else None
      e_s, h_s = (scratch.pop(0), scratch.pop(0)) if with_products else (None, None)
      # the products' staging tiles (dNY, dQG, dP, dKG, dgc)
      outs_s = [scratch.pop(0) for _ in range(5)] if with_products else None
      de_out = scratch.pop(2) if staged else None
      ds_mm, de_mm, bars = scratch
      ds_mm[...] = dstate.astype(MM_DTYPE)
      plgpu.commit_smem()

      def step(j, slot, ds):
        ci = last - j
        if not (states_only or with_products):
          plgpu.copy_smem_to_gmem(ds_mm, dh_ref.at[bi, hi, ci, :, vs])  # dS leaving chunk ci
        gcv = plgpu.load(gc_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(1))

        de, qdo = mc.matmuls(
            (c, bv, [(p_s.at[slot].transpose((1, 0)), do_s.at[slot]), (kg_s.at[slot], ds_mm)]),
            (dk, bv, [(qg_s.at[slot].transpose((1, 0)), do_s.at[slot])]))
        if has_dx:
          de = de + dx_s.at[slot][...]
        ds = ds * mc.rows(gcv, ds.shape) + qdo

        if with_products:
          # ds_mm is dh of chunk ci (the dS leaving it) until it is overwritten below, so the
          # products reading it come first; every earlier copy must be done reading.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          _chunk_products_from_dh(ds_mm, e_s.at[slot], h_s.at[slot], do_s.at[slot], outs_s)
          ny_o, qg_o, p_o, kg_o, gc_o = outs_s
          for src, dst in ((qg_o, dqg_ref), (p_o, dp_ref), (kg_o, dkg_ref), (gc_o, dgc_ref)):
            plgpu.copy_smem_to_gmem(src, dst.at[bi, hi, ci], commit_group=False)
          plgpu.commit_smem_to_gmem_group()
        elif not states_only:
          plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # previous de copy done reading
        if staged:
          de_out[...] = de
        de_mm[...] = de.astype(MM_DTYPE)
        plgpu.commit_smem()

        if with_products:   # dNY = dE hᵀ beside the chain's NYᵀ dE
          yde, d_ny = mc.matmuls((dk, bv, [(ny_s.at[slot].transpose((1, 0)), de_mm)]),
                                 (c, dk, [(de_mm, h_s.at[slot].T)]))
          outs_s[0][...] = d_ny.astype(MM_DTYPE)
        else:
          (yde,) = mc.matmuls((dk, bv, [(ny_s.at[slot].transpose((1, 0)), de_mm)]))
        ds = ds + yde

        if not (states_only or with_products):
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # dh copy done reading ds_mm
        ds_mm[...] = ds.astype(MM_DTYPE)
        plgpu.commit_smem()
        if with_products:
          plgpu.copy_smem_to_gmem(outs_s[0], dny_ref.at[bi, hi, ci], commit_group=False)
        if not states_only:
          plgpu.copy_smem_to_gmem(de_mm if de_from_operand else de_out,
                                  de_ref.at[bi, hi, ci, :, vs])
        return ds

      dsts = (ny_s, qg_s, p_s, kg_s, gc_s, do_s) + ((dx_s,) if has_dx else ()) + (
          (e_s, h_s) if with_products else ())
      ds = _chunk_loop(ncp, step_srcs, dsts, bars, step, dstate)
      plgpu.wait_smem_to_gmem(0)
      return ds

    barriers = tuple(plgpu.Barrier(num_barriers=2)
                     for _ in range(6 + has_dx + 2 * with_products))
    product_tiles = [
        mc.smem((2, c, bv), MM_DTYPE), mc.smem((2, dk, bv), MM_DTYPE),       # E, h
        mc.smem((c, dk), MM_DTYPE), mc.smem((c, dk), MM_DTYPE),              # dNY, dQG
        mc.smem((c, c), MM_DTYPE), mc.smem((c, dk), MM_DTYPE),               # dP, dKG
        plgpu.SMEM((dk,), f32)] if with_products else []                     # dgc
    dstate = pl.run_scoped(
        loop,
        mc.smem((2, c, dk), MM_DTYPE), mc.smem((2, c, dk), MM_DTYPE), mc.smem((2, c, c), MM_DTYPE),
        mc.smem((2, c, dk), MM_DTYPE), plgpu.SMEM((2, dk), f32), mc.smem((2, c, bv), MM_DTYPE),
        *([mc.smem((2, c, bv), f32)] if has_dx else []), *product_tiles,
        mc.smem((dk, bv), MM_DTYPE), mc.smem((c, bv), MM_DTYPE),
        *([mc.smem((c, bv), f32)] if staged else []), barriers)
    _store_tile(dstate, ds0_ref.at[row, hi, :, vs])

  args = (ny, qg, p, kg, gc, do) + ((de_ext,) if has_dx else ()) + (
      tuple(products) if with_products else ()) + (ds_final,)
  return plgpu.kernel(kernel, out_type=out_type, interpret=interpret,
                      **_mesh_kwargs(b, hv, nc, dv, pieces))(*args)


def _chunk_products_from_dh(dh_mm, e_s, h_s, do_s, outs_s):
  """The products of one chunk that need no dE, into their staging tiles: dKG = E dhᵀ,
  dQG = dO hᵀ, dP = dO Eᵀ (bf16) and dgc = Σ_v h ⊙ dh (float32); dh_mm is the bf16 dS leaving
  the chunk, the operand the chain used (so each product sums what the separate products
  kernel sums)."""
  c, dk = e_s.shape[0], h_s.shape[0]
  _, qg_o, p_o, kg_o, gc_o = outs_s
  d_kg, d_qg, d_p = mc.matmuls((c, dk, [(e_s, dh_mm.T)]), (c, dk, [(do_s, h_s.T)]),
                               (c, c, [(do_s, e_s.T)]))
  wg = plgpu.Layout.WGMMA
  both = (plgpu.load(h_s, layout=wg).astype(jnp.float32)
          * plgpu.load(dh_mm, layout=wg).astype(jnp.float32))
  gc_o[...] = jnp.sum(both, axis=1)
  kg_o[...] = d_kg.astype(MM_DTYPE)
  qg_o[...] = d_qg.astype(MM_DTYPE)
  p_o[...] = d_p.astype(MM_DTYPE)
  plgpu.commit_smem()


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
