"""Triton kernels of the intra-chunk part for per-channel gates (KDA, GDN-2), forward and backward.

The delta-rule intra-chunk part with a per-channel cumulative log gate G [C, K] (G_ic = Σ of the
log decays of rows ≤ i of the chunk, channel c; non-increasing in i, so every exponent below is
≤ 0). For one chunk, with A ∈ {Q, K̃} (queries, erase keys):

    pair(A)_ij = Σ_c A_ic K_jc e^{G_ic − G_jc}   (j ≤ i)
    P = pair(Q) (j ≤ i),   L = pair(K̃) (j < i),   M = (I + L)^{-1}
    Y = M (K̃ ⊙ e^{G}),  U = M Ṽ,  NY = −Y,  QG = Q ⊙ e^{G},  KG = K ⊙ e^{G_C − G},  gc = e^{G_C}

pair() is computed as the XLA path computes it (`lineax_attn.ops.chunked._channel_pair`,
docs/MATH.md §3.4), so that no exponent is positive: rows are split in sub-chunks of 16; a pair
of rows in different sub-chunks (j before the sub-chunk p of i) is anchored at n = p's first
row, e^{G_i − G_j} = e^{G_i − G_n} e^{G_n − G_j}, one bf16 product per sub-chunk for the whole
chunk (operands masked to p's rows and to the columns before n); the 16 × 16 diagonal blocks
are exact elementwise float32 sums over the channels, in slices of 16 channels. The inverse and the rest
are those of the DeltaNet / GDN kernel (`intra_chunk._unit_lower_inverse`, tf32 products, M
applied in bf16).

Segments (packed sequences): seg (the segment id relative to the chunk's first row), cont and
keep, each [B, T] float32 (`gpu_chunks.kernel_segments`); pairs of different segments are zero,
rows whose segment started inside the chunk do not see the entry state (QG, K̃ ⊙ e^G scaled by
cont), rows whose segment ends inside the chunk do not reach the exit state (KG by keep), and gc
is scaled by the chunk's last cont.

One program per (chunk, batch · value head) reads its rows of q, k, k̃, ṽ and G from
`[B, T, HV, D]` (float32, as the XLA preparation has them) and writes the state pass's inputs in
chunk-major `[B, HV, Nc, C, D]`. L's diagonal blocks and its off-diagonal part are assembled
through a float32 scratch output (written, a block barrier, read back), since a Triton program
cannot place a 16 × 16 block inside a 64 × 64 register tile.

The backward kernel (`channel_intra_bwd`) takes the forward's bf16 M and computes what needs the
C × C matrices: Y, U again, dR = Mᵀ [dY | dU], dL = −dR [Y | U]ᵀ (strictly lower, same
segment), and the pairs' cotangents for W ∈ {dP, dL}, anchored as in the forward plus the exact
diagonal blocks: dA_ic = Σ_j W_ij K_jc e^{G_ic − G_jc}, dK_jc = Σ_i W_ij A_ic e^{G_ic − G_jc}.
The elementwise rest (QG, KG, gc, the entry and exit factors, and dG, which the pairs give as
Q ⊙ dQ + K̃ ⊙ dK̃ − K ⊙ dK since they depend on G only through A ⊙ e^G and K ⊙ e^{−G}) is XLA's:
`lineax_attn.ops.gpu_prepare.channel_grads`, with the kernel half's float32 oracle beside it
(`channel_pair_solve_vjp_reference`). Imports triton (the `triton` extra); jax_triton only
inside the wrappers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels.gpu.triton import blocks
from pallas_kernels.gpu.triton.intra_chunk import _unit_lower_inverse
from pallas_kernels.gpu.triton.state_pass import MM_DTYPE, _jax_triton, _structs

SUB = 16          # rows of a sub-chunk (the anchoring of the off-diagonal pairs)
CHANNEL_SLICE = 16  # channels per step of the exact diagonal blocks ([16, 16, 16] tiles)


@triton.jit
def _chunk_tiles(q_ptr, k_ptr, kt_ptr, g_ptr, t, HV: tl.constexpr, K: tl.constexpr,
                 C: tl.constexpr):
  """This program's chunk: q, k, k̃, G [C, K] float32 and its indices (time rows, chunk)."""
  ci = tl.program_id(0)
  bhv = tl.program_id(1)
  hv = bhv % HV
  rc = tl.arange(0, C)
  rk = tl.arange(0, K)
  row0 = (bhv // HV).to(tl.int64) * t + ci * C                # first time row of the chunk
  rows = row0 + rc
  ck_in = (rows * HV + hv)[:, None] * K + rk[None, :]
  chunk = bhv.to(tl.int64) * (t // C) + ci
  return (tl.load(q_ptr + ck_in), tl.load(k_ptr + ck_in), tl.load(kt_ptr + ck_in),
          tl.load(g_ptr + ck_in), hv, row0, rows, rc, rk, chunk)


@triton.jit
def _pair_masks(seg_ptr, rows, ii, jj, PACKED: tl.constexpr):
  """Where P (j ≤ i) and L (j < i) may be non-zero: same segment too when packed."""
  keep_p = ii >= jj
  keep_l = ii > jj
  if PACKED:
    seg = tl.load(seg_ptr + rows)
    same = seg[:, None] == seg[None, :]
    keep_p = keep_p & same
    keep_l = keep_l & same
  return keep_p, keep_l


@triton.jit
def _anchored_factors(g, g_ptr, row0, hv, rc, rk, blk, HV: tl.constexpr, K: tl.constexpr,
                      SUBC: tl.constexpr):
  """Sub-chunk blk's anchoring at its first row n: (rows of blk [C, 1], columns before n
  [1, C], e^{G_i − G_n} on blk's rows, e^{G_n − G_j} on the rows before n), zero elsewhere."""
  n = blk * SUBC
  g_n = tl.load(g_ptr + ((row0 + n) * HV + hv) * K + rk)
  in_p = ((rc >= n) & (rc < n + SUBC))[:, None]
  before = (rc < n)[:, None]
  row_f = tl.where(in_p, tl.exp(tl.where(in_p, g - g_n[None, :], 0.0)), 0.0)
  col_f = tl.where(before, tl.exp(tl.where(before, g_n[None, :] - g, 0.0)), 0.0)
  return in_p, (rc < n)[None, :], row_f, col_f


@triton.jit
def _diagonal_decay(g_ptr, off, lower):
  """E_ijc = e^{G_ic − G_jc} (j ≤ i) of one diagonal block's channel slice, [16, 16, KS]."""
  ga = tl.load(g_ptr + off)
  return tl.where(lower, tl.exp(tl.where(lower, ga[:, None, :] - ga[None, :, :], 0.0)), 0.0)


@triton.jit
def _diagonal_blocks(q_ptr, k_ptr, kt_ptr, g_ptr, seg_ptr, row0, hv, p_ptr, l_ptr,
                     cc0, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                     SUBC: tl.constexpr, KS: tl.constexpr, PACKED: tl.constexpr):
  """The exact diagonal blocks of P (j ≤ i) and L (j < i), stored to p_ptr and l_ptr."""
  rs = tl.arange(0, SUBC)
  ks = tl.arange(0, KS)
  for blk in tl.static_range(C // SUBC):
    rows = row0 + blk * SUBC + rs                               # time rows, int64
    dq = tl.zeros((SUBC, SUBC), tl.float32)
    dl = tl.zeros((SUBC, SUBC), tl.float32)
    lower = rs[:, None, None] >= rs[None, :, None]
    for s in tl.static_range(K // KS):
      off = (rows * HV + hv)[:, None] * K + (s * KS + ks)[None, :]
      kj = tl.load(k_ptr + off)[None, :, :] * _diagonal_decay(g_ptr, off, lower)
      dq += tl.sum(tl.load(q_ptr + off)[:, None, :] * kj, axis=2)
      dl += tl.sum(tl.load(kt_ptr + off)[:, None, :] * kj, axis=2)
    ii = rs[:, None]
    jj = rs[None, :]
    keep_p, keep_l = _pair_masks(seg_ptr, rows, ii, jj, PACKED)
    cc = cc0 + (blk * SUBC + ii) * C + blk * SUBC + jj
    tl.store(p_ptr + cc, tl.where(keep_p, dq, 0.0).to(tl.bfloat16))
    tl.store(l_ptr + cc, tl.where(keep_l, dl, 0.0))


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, kt_ptr, vt_ptr, g_ptr, seg_ptr, cont_ptr, keep_ptr, t,
                ny_ptr, qg_ptr, p_ptr, u_ptr, kg_ptr, gc_ptr, l_ptr, m_ptr,
                HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                SUBC: tl.constexpr, KS: tl.constexpr, PACKED: tl.constexpr,
                WITH_INVERSE: tl.constexpr, PREC: tl.constexpr):
  q, k, kt, g, hv, row0, rows, rc, rk, chunk = _chunk_tiles(q_ptr, k_ptr, kt_ptr, g_ptr, t,
                                                            HV, K, C)
  rv = tl.arange(0, V)
  ii = rc[:, None]
  jj = rc[None, :]
  cc0 = chunk * C * C
  cc = cc0 + ii * C + jj
  # Off-diagonal pairs, anchored at each sub-chunk's first row n: rows of sub-chunk p against
  # the columns before n, e^{G_i − G_n} · e^{G_n − G_j}, both exponents ≤ 0.
  p_off = tl.zeros((C, C), tl.float32)
  l_off = tl.zeros((C, C), tl.float32)
  for blk in tl.static_range(1, C // SUBC):
    _, _, row_f, col_f = _anchored_factors(g, g_ptr, row0, hv, rc, rk, blk, HV, K, SUBC)
    kc = tl.trans((k * col_f).to(tl.bfloat16))
    p_off = tl.dot((q * row_f).to(tl.bfloat16), kc, p_off)
    l_off = tl.dot((kt * row_f).to(tl.bfloat16), kc, l_off)
  off_block = (ii // SUBC) != (jj // SUBC)
  if PACKED:
    keep_p, keep_l = _pair_masks(seg_ptr, rows, ii, jj, PACKED)
    p_off = tl.where(keep_p, p_off, 0.0)
    l_off = tl.where(keep_l, l_off, 0.0)
  # p_off and l_off are zero on and above the diagonal blocks; the blocks are stored apart.
  tl.store(p_ptr + cc, p_off.to(tl.bfloat16), mask=off_block)
  tl.store(l_ptr + cc, l_off, mask=off_block)
  _diagonal_blocks(q_ptr, k_ptr, kt_ptr, g_ptr, seg_ptr, row0, hv, p_ptr, l_ptr, cc0,
                   HV, K, C, SUBC, KS, PACKED)
  tl.debug_barrier()                                          # L's two parts, then read back
  lmat = tl.load(l_ptr + cc)
  m = _unit_lower_inverse(lmat, ii, jj, PREC).to(tl.bfloat16)
  entry = tl.exp(g)
  g_last = tl.load(g_ptr + ((row0 + C - 1) * HV + hv) * K + rk)
  exit_ = tl.exp(g_last[None, :] - g)
  gc = tl.exp(g_last)
  if PACKED:
    cont = tl.load(cont_ptr + rows)
    entry = entry * cont[:, None]
    exit_ = exit_ * tl.load(keep_ptr + rows)[:, None]
    gc = gc * tl.load(cont_ptr + row0 + C - 1)
  y = tl.dot(m, (kt * entry).to(tl.bfloat16))
  vt = tl.load(vt_ptr + (rows * HV + hv)[:, None] * V + rv[None, :])
  u = tl.dot(m, vt.to(tl.bfloat16))
  ck = chunk * C * K + ii * K + rk[None, :]
  tl.store(ny_ptr + ck, (-y).to(tl.bfloat16))
  tl.store(qg_ptr + ck, (q * entry).to(tl.bfloat16))
  tl.store(kg_ptr + ck, (k * exit_).to(tl.bfloat16))
  tl.store(u_ptr + chunk * C * V + ii * V + rv[None, :], u)
  tl.store(gc_ptr + chunk * K + rk, gc)
  if WITH_INVERSE:
    tl.store(m_ptr + cc, m)


@triton.jit
def _diagonal_blocks_bwd(q_ptr, k_ptr, kt_ptr, g_ptr, seg_ptr, row0, hv, dp_ptr, wl_ptr, cc0,
                         dq_ptr, dkt_ptr, dk_ptr, ck0, HV: tl.constexpr, K: tl.constexpr,
                         C: tl.constexpr, SUBC: tl.constexpr, KS: tl.constexpr,
                         PACKED: tl.constexpr):
  """Adds the exact diagonal blocks' terms to the pair gradients dQ, dK̃, dK (read, add, store):
  dA_ic += Σ_j W_ij K_jc E_ijc, dK_jc += Σ_i W_ij A_ic E_ijc, E_ijc = e^{G_ic − G_jc}, j ≤ i."""
  rs = tl.arange(0, SUBC)
  ks = tl.arange(0, KS)
  ii = rs[:, None]
  jj = rs[None, :]
  lower = rs[:, None, None] >= rs[None, :, None]
  for blk in tl.static_range(C // SUBC):
    rows = row0 + blk * SUBC + rs
    cc = cc0 + (blk * SUBC + ii) * C + blk * SUBC + jj
    keep_p, keep_l = _pair_masks(seg_ptr, rows, ii, jj, PACKED)
    wp = tl.where(keep_p, tl.load(dp_ptr + cc).to(tl.float32), 0.0)[:, :, None]
    wl = tl.where(keep_l, tl.load(wl_ptr + cc), 0.0)[:, :, None]
    for s in tl.static_range(K // KS):
      cols = s * KS + ks
      off = (rows * HV + hv)[:, None] * K + cols[None, :]
      out = ck0 + (blk * SUBC + ii) * K + cols[None, :]
      e3 = _diagonal_decay(g_ptr, off, lower)
      kj = tl.load(k_ptr + off)[None, :, :] * e3
      tl.store(dq_ptr + out, tl.load(dq_ptr + out) + tl.sum(wp * kj, axis=1))
      tl.store(dkt_ptr + out, tl.load(dkt_ptr + out) + tl.sum(wl * kj, axis=1))
      qe = tl.load(q_ptr + off)[:, None, :] * e3
      kte = tl.load(kt_ptr + off)[:, None, :] * e3
      tl.store(dk_ptr + out, tl.load(dk_ptr + out) + tl.sum(wp * qe + wl * kte, axis=0))


@triton.jit
def _bwd_kernel(q_ptr, k_ptr, kt_ptr, vt_ptr, g_ptr, seg_ptr, cont_ptr, m_ptr, dny_ptr, dp_ptr,
                du_ptr, t, dq_ptr, dkt_ptr, dk_ptr, drk_ptr, dvt_ptr, wl_ptr,
                HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                SUBC: tl.constexpr, KS: tl.constexpr, PACKED: tl.constexpr):
  """The pair and solve part of the backward; the elementwise rest is the caller's (XLA)."""
  q, k, kt, g, hv, row0, rows, rc, rk, chunk = _chunk_tiles(q_ptr, k_ptr, kt_ptr, g_ptr, t,
                                                            HV, K, C)
  rv = tl.arange(0, V)
  ii = rc[:, None]
  jj = rc[None, :]
  cc0 = chunk * C * C
  cc = cc0 + ii * C + jj
  ck0 = chunk * C * K
  ck = ck0 + ii * K + rk[None, :]
  cv = chunk * C * V + ii * V + rv[None, :]
  entry = tl.exp(g)
  if PACKED:
    entry = entry * tl.load(cont_ptr + rows)[:, None]
  # The solve: Y = M R_k, U = M Ṽ (the forward's bf16 M); dR = Mᵀ [dY | dU], dL = −dR [Y | U]ᵀ.
  m = tl.load(m_ptr + cc)
  y = tl.dot(m, (kt * entry).to(tl.bfloat16))
  vt = tl.load(vt_ptr + (rows * HV + hv)[:, None] * V + rv[None, :])
  u = tl.dot(m, vt.to(tl.bfloat16))
  mt = tl.trans(m)
  d_y = (-tl.load(dny_ptr + ck).to(tl.float32)).to(tl.bfloat16)
  d_rk = tl.dot(mt, d_y)
  d_rv = tl.dot(mt, tl.load(du_ptr + cv).to(tl.bfloat16))
  tl.store(drk_ptr + ck, d_rk)
  tl.store(dvt_ptr + cv, d_rv)
  d_l = -(tl.dot(d_rk.to(tl.bfloat16), tl.trans(y.to(tl.bfloat16)))
          + tl.dot(d_rv.to(tl.bfloat16), tl.trans(u.to(tl.bfloat16))))
  keep_p, keep_l = _pair_masks(seg_ptr, rows, ii, jj, PACKED)
  w_l = tl.where(keep_l, d_l, 0.0)
  w_p = tl.where(keep_p, tl.load(dp_ptr + cc).to(tl.float32), 0.0)
  tl.store(wl_ptr + cc, w_l)            # the diagonal blocks read it back
  # Off-diagonal pairs, anchored as in the forward.
  d_q = tl.zeros((C, K), tl.float32)
  d_kt = tl.zeros((C, K), tl.float32)
  d_k = tl.zeros((C, K), tl.float32)
  for blk in tl.static_range(1, C // SUBC):
    in_p, cols_before, row_f, col_f = _anchored_factors(g, g_ptr, row0, hv, rc, rk, blk, HV, K,
                                                        SUBC)
    block = in_p & cols_before                                 # rows of p, columns before n
    wp = tl.where(block, w_p, 0.0).to(tl.bfloat16)
    wl = tl.where(block, w_l, 0.0).to(tl.bfloat16)
    kc = (k * col_f).to(tl.bfloat16)
    d_q += row_f * tl.dot(wp, kc)
    d_kt += row_f * tl.dot(wl, kc)
    back = tl.dot(tl.trans(wp), (q * row_f).to(tl.bfloat16))
    back = tl.dot(tl.trans(wl), (kt * row_f).to(tl.bfloat16), back)
    d_k += col_f * back
  tl.store(dq_ptr + ck, d_q)
  tl.store(dkt_ptr + ck, d_kt)
  tl.store(dk_ptr + ck, d_k)
  tl.debug_barrier()                    # the stores above, then the diagonal blocks' additions
  _diagonal_blocks_bwd(q_ptr, k_ptr, kt_ptr, g_ptr, seg_ptr, row0, hv, dp_ptr, wl_ptr, cc0,
                       dq_ptr, dkt_ptr, dk_ptr, ck0, HV, K, C, SUBC, KS, PACKED)


def supported(chunk: int, dk: int, dv: int) -> str | None:
  """None if this kernel takes the sizes (its [C, D] tiles stay in registers), else why."""
  return blocks.intra_supported("channel-gate", chunk, dk, dv)


@functools.partial(jax.jit, static_argnames=("chunk", "with_inverse", "precision", "num_warps"))
def channel_intra_fwd(q, k, kt, vt, G, segments=None, *, chunk: int, with_inverse=False,
                      precision: str = blocks.INTRA_PRECISION,
                      num_warps: int = blocks.CHANNEL_WARPS):
  """The intra-chunk part for per-channel gates (module docstring).

  q, k, kt, vt: `[B, T, HV, K]` (vt `[B, T, HV, V]`), the scaled queries, keys, erase keys and
  write values as the XLA preparation has them (any float dtype; read as float32); G `[B, T,
  HV, K]` float32, the log gates summed within each chunk; segments: None or (seg, cont, keep)
  `[B, T]` float32 (`gpu_chunks.kernel_segments`). T a multiple of `chunk`.
  Returns (ny, qg, p, u, kg, gc) as `gpu_prepare.prepare_chunks` (ny, qg, kg `[B, HV, Nc, C, K]`
  bf16, p `[B, HV, Nc, C, C]` bf16, u `[B, HV, Nc, C, V]` float32, gc `[B, HV, Nc, K]` float32),
  and M `[B, HV, Nc, C, C]` bf16 after them if `with_inverse`.
  """
  reason = supported(chunk, q.shape[-1], vt.shape[-1])
  if reason:
    raise ValueError(f"channel_intra_fwd: {reason}")
  if precision not in blocks.INTRA_PRECISIONS:
    raise ValueError(f"precision={precision!r}: expected one of {blocks.INTRA_PRECISIONS}")
  b, t, hv, dk = q.shape
  dv = vt.shape[-1]
  if t % chunk:
    raise ValueError(f"channel_intra_fwd: T={t} is not a multiple of chunk={chunk}")
  nc, c = t // chunk, chunk
  f32 = jnp.float32
  packed = segments is not None
  seg = tuple(x.astype(f32) for x in segments) if packed else (G,) * 3   # unread unless packed
  out_shape = _structs(((b, hv, nc, c, dk), MM_DTYPE), ((b, hv, nc, c, dk), MM_DTYPE),
                       ((b, hv, nc, c, c), MM_DTYPE), ((b, hv, nc, c, dv), f32),
                       ((b, hv, nc, c, dk), MM_DTYPE), ((b, hv, nc, dk), f32),
                       ((b, hv, nc, c, c), f32),
                       ((b, hv, nc, c, c) if with_inverse else (1,), MM_DTYPE))
  ny, qg, p, u, kg, gc, _, m = _jax_triton().triton_call(
      q.astype(f32), k.astype(f32), kt.astype(f32), vt.astype(f32), G.astype(f32), *seg, t,
      kernel=_fwd_kernel, out_shape=out_shape, grid=(nc, b * hv), num_warps=num_warps,
      num_stages=1, HV=hv, K=dk, V=dv, C=c, SUBC=SUB, KS=CHANNEL_SLICE, PACKED=packed,
      WITH_INVERSE=with_inverse, PREC=precision)
  outs = (ny, qg, p, u, kg, gc)
  return outs + (m,) if with_inverse else outs


@functools.partial(jax.jit, static_argnames=("chunk", "num_warps"))
def channel_intra_bwd(q, k, kt, vt, G, segments, m, dny, dp, du, *, chunk: int,
                      num_warps: int = blocks.CHANNEL_WARPS):
  """The backward of `channel_intra_fwd`'s NY, P and U through the pairs and the solve.

  Arguments as the forward's, plus its bf16 M and the cotangents dny, dp, du (chunk-major).
  Returns (dq, dkt, dk, d_rk, dvt), float32 `[B, HV, Nc, C, D]`: dq, dkt, dk the gradients
  through P and L (pair(Q), pair(K̃); dk from both), d_rk the cotangent of the solve's key
  right-hand side K̃ ⊙ e^G, dvt that of Ṽ. The elementwise terms (QG, KG, gc, the entry and exit
  factors) and dG are the caller's: `lineax_attn.ops.gpu_prepare`.
  """
  reason = supported(chunk, q.shape[-1], vt.shape[-1])
  if reason:
    raise ValueError(f"channel_intra_bwd: {reason}")
  b, t, hv, dk = q.shape
  dv = vt.shape[-1]
  nc, c = t // chunk, chunk
  f32 = jnp.float32
  packed = segments is not None
  seg = tuple(x.astype(f32) for x in segments[:2]) if packed else (G,) * 2
  out_shape = _structs(*[((b, hv, nc, c, dk), f32)] * 4, ((b, hv, nc, c, dv), f32),
                       ((b, hv, nc, c, c), f32))
  *grads, _ = _jax_triton().triton_call(
      q.astype(f32), k.astype(f32), kt.astype(f32), vt.astype(f32), G.astype(f32), *seg,
      m.astype(MM_DTYPE), dny.astype(MM_DTYPE), dp.astype(MM_DTYPE), du.astype(f32), t,
      kernel=_bwd_kernel, out_shape=out_shape, grid=(nc, b * hv), num_warps=num_warps,
      num_stages=1, HV=hv, K=dk, V=dv, C=c, SUBC=SUB, KS=CHANNEL_SLICE, PACKED=packed)
  return tuple(grads)
