"""Triton kernels of the delta-rule intra-chunk part (DeltaNet, GDN), forward and backward.

The same maths, inputs and outputs as the Mosaic GPU kernels of `pallas_kernels.gpu.intra_chunk`
(read its docstring for the formulas and layouts; `intra_chunk_reference` there is the oracle),
for any NVIDIA GPU from sm_80. One program per (chunk, batch · value head) reads the chunk's rows
of q, k, v straight from `[B, T, H, D]` and writes the state pass's inputs once:

    Γ_ij = exp(G_i − G_j) (i ≥ j, same segment)   P = s (q kᵀ) ⊙ Γ
    L = diag(β) (k kᵀ) ⊙ Γ strictly lower         M = (I + L)^{-1}
    Y = M (k ⊙ β e),  U = M (v ⊙ β)               NY = −Y, QG = s q ⊙ e, KG = k ⊙ e^{Gx}

The inverse is built up from 4 × 4 diagonal blocks. With L_b the b × b block diagonal of L,
(I + L_4)^{-1} = (I − L_4)(I + L_4²) (L_4⁴ = 0), and each merge 4 → 16 → 64 is

    (I + L_b)^{-1} = (I − F)(I + F²)(I + L_{b/4})^{-1},   F = (I + L_{b/4})^{-1}(L_b − L_{b/4}),

with F strictly lower in b/4-blocks inside b-blocks (F⁴ = 0): ten 64³ products per chunk,
float32 operands, tf32 tensor-core products (`blocks.INTRA_PRECISION` says why and what the
others cost). Every factor stays near 1 in size (|F| < 1, |F²| < 2 on correlated keys), so tf32's
10-bit operands cost about 1e-3 of M. (The Mosaic kernel's form, (I + D)^{-1} from the powers
D², D⁴, D⁸ of the 16 × 16 blocks, needs float32-grade products: on correlated keys D⁸ reaches
~300 and the sum cancels; with tf32 products its M was 20–60 % wrong, measured on the H200.)
M is rounded to bf16 to be applied, as the other paths do; every other product has bf16
operands and a float32 accumulator.

The backward takes the forward's bf16 M (`with_inverse`) and follows the formulas of
`intra_chunk.intra_chunk_bwd`. Offsets are int64. Imports triton (the `triton` extra);
jax_triton only inside the wrappers (`state_pass._jax_triton`).

Channel slices: no program holds a whole float32 [C, K] or [C, V] tile (as one tile, at K = V =
128 both kernels spilled ~1-4 KB a thread). K and V are walked in slices of BK columns
(`blocks.INTRA_BK`), loaded as bf16 [C, BK] slices. Forward: one K loop accumulates q kᵀ and
k kᵀ and stores QG, KG; then P, L and M; then NY = −M (k ⊙ β e) per K slice and U = M (v ⊙ β)
per V slice. Backward: a K loop makes Y and dR_k = Mᵀ dY per slice and accumulates
−dL += dR_k Yᵀ and Σ dR_k ⊙ k; a V loop the same with U, dR_v (and stores dV); a K loop k kᵀ;
then dB, dβ and W's k kᵀ half; a K loop stores dq, dk per slice (dR_k made again); a last
K loop q kᵀ for W's other half, with dA and Γ made again (each kept live over the loops
spilled at 4 warps). Only the order of the float32 sums differs from a whole-tile form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels.gpu.triton import blocks
from pallas_kernels.gpu.triton.state_pass import MM_DTYPE, _jax_triton, _on_hopper, _structs


@triton.jit
def _dot32(a, b, PREC: tl.constexpr):
  return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _merge_blocks(inv, lmat, ii, jj, BLK: tl.constexpr, PREC: tl.constexpr):
  """(I + L_BLK)^{-1} from inv = (I + L_{BLK/4})^{-1}, where L_b keeps L's b × b diagonal blocks.

  (I + L_BLK) = (I + L_{BLK/4})(I + F) with F = inv (L_BLK − L_{BLK/4}); F is strictly lower in
  BLK/4-blocks inside BLK-blocks, so F⁴ = 0 and (I + F)^{-1} = (I − F)(I + F²)."""
  eye = tl.where(ii == jj, 1.0, 0.0)
  e = tl.where(((ii // BLK) == (jj // BLK)) & ((ii // (BLK // 4)) != (jj // (BLK // 4))), lmat,
               0.0)
  f = _dot32(inv, e, PREC)
  return _dot32(_dot32(eye - f, eye + _dot32(f, f, PREC), PREC), inv, PREC)


@triton.jit
def _unit_lower_inverse_blocks(lmat, ii, jj, BLK: tl.constexpr, PREC: tl.constexpr):
  """(I + L_BLK)^{-1} for BLK in (16, 64): 4 × 4 blocks, merged to 16 (and to 64). ii, jj are
  broadcastable row / column index grids, so lmat may be one [64, 64] tile or a batch
  [n, 16, 16] of blocks (then `_dot32` makes batched products)."""
  eye = tl.where(ii == jj, 1.0, 0.0)
  d = tl.where((ii // 4) == (jj // 4), lmat, 0.0)            # D⁴ = 0 in 4 × 4 blocks
  inv = _dot32(eye - d, eye + _dot32(d, d, PREC), PREC)
  inv = _merge_blocks(inv, lmat, ii, jj, 16, PREC)
  if BLK == 64:
    inv = _merge_blocks(inv, lmat, ii, jj, 64, PREC)
  return inv


@triton.jit
def _unit_lower_inverse(lmat, ii, jj, PREC: tl.constexpr):
  """(I + L)^{-1} for a strictly lower [64, 64] float32 L: 4 × 4 blocks, merged to 16 and 64
  (the module docstring)."""
  return _unit_lower_inverse_blocks(lmat, ii, jj, 64, PREC)


@triton.jit
def _merge_blocks_short(inv, lmat, ii, jj, BF16: tl.constexpr, PREC: tl.constexpr):
  """`_merge_blocks` from 16 to 64 with a shorter chain of dependent products.

  With B = inv and F = B E (E: L's entries between different 16-blocks), F⁴ = 0, so
  (I + L)^{-1} = (I − F + F² − F³) B = Y + F² Y with Y = B − F B: F B and F² do not depend on
  each other (three products deep where `_merge_blocks` is four). BF16: the products take bf16
  operands (float32 accumulators), as jla's kkt merge does; else float32 at PREC."""
  e = tl.where((ii // 16) != (jj // 16), lmat, 0.0)
  f = _merge_dot(inv, e, BF16, PREC)
  y = inv - _merge_dot(f, inv, BF16, PREC)
  return y + _merge_dot(_merge_dot(f, f, BF16, PREC), y, BF16, PREC)


@triton.jit
def _merge_dot(a, b, BF16: tl.constexpr, PREC: tl.constexpr):
  if BF16:
    return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
  return _dot32(a, b, PREC)


@triton.jit
def _batched_unit_lower_inverse(lmat, ii, jj, PREC: tl.constexpr):
  """`_unit_lower_inverse` with its first two levels on the 16 × 16 diagonal blocks alone.

  The full-tile form spends six of its ten 64³ products on block-diagonal matrices (three
  quarters zeros). Here L's four diagonal blocks are gathered into a [4, 16, 16] batch, the
  4 → 16 inverse runs on it as batched 16³ products (the same formulas), the result is put
  back as a block-diagonal [64, 64] and only the 16 → 64 merge is full-tile. Same maths, fewer
  FLOPs; whether the reshapes cost less than the products they save is for the GPU to say
  (`blocks.INTRA_INVERSE`)."""
  return _merge_blocks(_batched_diagonal_inverse(lmat, PREC), lmat, ii, jj, 64, PREC)


@triton.jit
def _batched_diagonal_inverse(lmat, PREC: tl.constexpr):
  """The inverses of (I + L)'s four 16 × 16 diagonal blocks, as a block-diagonal [64, 64]
  (`_batched_unit_lower_inverse`'s first two levels)."""
  x = tl.permute(tl.reshape(lmat, (4, 16, 4, 16)), (0, 2, 1, 3))      # [row blk, col blk, r, c]
  a4 = tl.arange(0, 4)
  diag = (a4[:, None] == a4[None, :])[:, :, None, None]
  d = tl.sum(tl.where(diag, x, 0.0), axis=1)                           # [blk, r, c]
  inv = _unit_lower_inverse_blocks(d, tl.arange(0, 16)[None, :, None],
                                   tl.arange(0, 16)[None, None, :], 16, PREC)
  return tl.reshape(tl.permute(tl.where(diag, inv[:, None, :, :], 0.0), (0, 2, 1, 3)), (64, 64))


@triton.jit
def _chunk_index(t, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 C: tl.constexpr):
  """This program's chunk rows [C], its time rows, the int64 bases of its q/k rows, v rows and
  [B, HV, T] vectors, and its chunk of the chunk-major outputs."""
  ci = tl.program_id(0)
  bhv = tl.program_id(1)
  b = bhv // HV
  hv = bhv % HV
  rc = tl.arange(0, C)
  row0 = b.to(tl.int64) * t + ci * C                    # first time row of this chunk
  qk_base = (row0 * H + hv // (HV // H)) * K
  v_base = (row0 * HV + hv) * V
  vec0 = bhv.to(tl.int64) * t + ci * C
  chunk = bhv.to(tl.int64) * (t // C) + ci
  return rc, row0 + rc, qk_base, v_base, vec0, chunk


@triton.jit
def _same_segment(gam, seg_ptr, rows, PACKED: tl.constexpr):
  """gam [C, C] zeroed between rows of different segments when packed."""
  if PACKED:
    seg = tl.load(seg_ptr + rows)
    gam = tl.where(seg[:, None] == seg[None, :], gam, 0.0)
  return gam


@triton.jit
def _gamma(g, seg_ptr, rows, ii, jj, PACKED: tl.constexpr):
  """Γ [C, C] (i ≥ j, same segment when packed) from G [C]."""
  lower = ii >= jj
  gam = tl.where(lower, tl.exp(tl.where(lower, g[:, None] - g[None, :], 0.0)), 0.0)
  return _same_segment(gam, seg_ptr, rows, PACKED)


@triton.jit
def _ungated_gamma(seg_ptr, rows, ii, jj, PACKED: tl.constexpr):
  """Γ at G = 0: the lower triangle, same segment when packed."""
  return _same_segment(tl.where(ii >= jj, 1.0, 0.0), seg_ptr, rows, PACKED)


@triton.jit
def _entry(g, cont_ptr, rows, PACKED: tl.constexpr):
  """The entry factor e [C] (zero on rows whose segment started inside the chunk)."""
  entry = tl.exp(g)
  if PACKED:
    entry = entry * tl.load(cont_ptr + rows)
  return entry


@triton.jit
def _row_factors(beta_ptr, g_ptr, cont_ptr, vec0, rc, rows, BK: tl.constexpr,
                 PACKED: tl.constexpr):
  """Slice columns, the [C, C] index grids, and the chunk's β, G and entry factor [C]."""
  beta = tl.load(beta_ptr + vec0 + rc)
  g = tl.load(g_ptr + vec0 + rc)
  return (tl.arange(0, BK), rc[:, None], rc[None, :], beta, g,
          _entry(g, cont_ptr, rows, PACKED))


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, gx_ptr, seg_ptr, cont_ptr, keep_ptr, t,
                scale, ny_ptr, qg_ptr, p_ptr, u_ptr, kg_ptr, m_ptr,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                C: tl.constexpr, BK: tl.constexpr, PACKED: tl.constexpr,
                WITH_INVERSE: tl.constexpr, PREC: tl.constexpr, SLICE_STAGES: tl.constexpr,
                SBK: tl.constexpr, BATCHED_INVERSE: tl.constexpr):
  tl.static_assert((K % BK == 0) and (V % BK == 0))
  rc, rows, qk_base, v_base, vec0, chunk = _chunk_index(t, H, HV, K, V, C)
  rb, ii, jj, beta, g, entry = _row_factors(beta_ptr, g_ptr, cont_ptr, vec0, rc, rows, BK,
                                            PACKED)
  exit_ = tl.exp(tl.load(gx_ptr + vec0 + rc))
  if PACKED:
    exit_ = exit_ * tl.load(keep_ptr + rows)
  # q kᵀ and k kᵀ over the K slices; QG and KG need neither, so they are stored on the way.
  qk = tl.zeros((C, C), tl.float32)
  kk = tl.zeros((C, C), tl.float32)
  for s in tl.range(K // BK, num_stages=SLICE_STAGES):
    cols = s * BK + rb
    src = qk_base + ii * (H * K) + cols[None, :]
    q = tl.load(q_ptr + src)
    k = tl.load(k_ptr + src)
    qk = tl.dot(q, tl.trans(k), qk)
    kk = tl.dot(k, tl.trans(k), kk)
    dst = chunk * C * K + ii * K + cols[None, :]
    tl.store(qg_ptr + dst, (scale * q.to(tl.float32) * entry[:, None]).to(tl.bfloat16))
    tl.store(kg_ptr + dst, (k.to(tl.float32) * exit_[:, None]).to(tl.bfloat16))
  gam = _gamma(g, seg_ptr, rows, ii, jj, PACKED)
  cc = chunk * C * C + ii * C + jj
  tl.store(p_ptr + cc, (scale * qk * gam).to(tl.bfloat16))
  lmat = tl.where(ii > jj, beta[:, None] * kk * gam, 0.0)
  if BATCHED_INVERSE:
    m = _batched_unit_lower_inverse(lmat, ii, jj, PREC).to(tl.bfloat16)
  else:
    m = _unit_lower_inverse(lmat, ii, jj, PREC).to(tl.bfloat16)
  if WITH_INVERSE:
    tl.store(m_ptr + cc, m)
  # NY = −M (k ⊙ β e) in K slices, U = M (v ⊙ β) in V slices, SBK wide (`blocks.solve_bk`).
  rs = tl.arange(0, SBK)
  for s in tl.range(K // SBK, num_stages=SLICE_STAGES):
    cols = s * SBK + rs
    k = tl.load(k_ptr + qk_base + ii * (H * K) + cols[None, :])
    y = tl.dot(m, (k.to(tl.float32) * (beta * entry)[:, None]).to(tl.bfloat16))
    tl.store(ny_ptr + chunk * C * K + ii * K + cols[None, :], (-y).to(tl.bfloat16))
  for s in tl.range(V // SBK, num_stages=SLICE_STAGES):
    cols = s * SBK + rs
    v = tl.load(v_ptr + v_base + ii * (HV * V) + cols[None, :])
    u = tl.dot(m, (v.to(tl.float32) * beta[:, None]).to(tl.bfloat16))
    tl.store(u_ptr + chunk * C * V + ii * V + cols[None, :], u)


@triton.jit
def _abt(a_ptr, a_stride, b_ptr, b_rows, b_stride, C: tl.constexpr, N: tl.constexpr,
         V: tl.constexpr, VS: tl.constexpr):
  """A Bᵀ [C, N], A the [C, V] rows at a_ptr (row stride a_stride), B the [N, V] rows b_rows
  at b_ptr (row stride b_stride), V walked VS columns a step; bf16 operands, float32 sums."""
  rc = tl.arange(0, C)
  acc = tl.zeros((C, N), tl.float32)
  for s in tl.range(V // VS):
    vc = s * VS + tl.arange(0, VS)
    a = tl.load(a_ptr + rc[:, None] * a_stride + vc[None, :]).to(tl.bfloat16)
    b = tl.load(b_ptr + b_rows[:, None] * b_stride + vc[None, :]).to(tl.bfloat16)
    acc = tl.dot(a, tl.trans(b), acc)
  return acc


@triton.jit
def _bwd_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, seg_ptr, cont_ptr, keep_ptr, m_ptr,
                dny_ptr, dp_ptr, du_ptr, dqg_ptr, dkg_ptr, h_ptr, dh_ptr, e_ptr, do_ptr,
                t, scale, dq_ptr, dk_ptr, dv_ptr, dbeta_ptr, dgr_ptr, dgc_ptr,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                C: tl.constexpr, BK: tl.constexpr, PACKED: tl.constexpr,
                SLICE_STAGES: tl.constexpr, GBK: tl.constexpr, GRADS: tl.constexpr,
                GATED: tl.constexpr, STATES: tl.constexpr, VS: tl.constexpr):
  """The backward through the C×C products, the inverse and the pseudo-values: dq, dk, dv
  chunk-major, dβ, and G's two row sums (dgr, dgc), the elementwise QG / KG terms left to the
  caller; with GRADS (H = HV only) those terms too, whole dq, dk, dv stored in the inputs'
  `[B, T, H, D]` layout and the whole dG in dgr (`intra_chunk_bwd`'s docstring).
  Without GATED (DeltaNet: G = 0, so e = cont, x = keep and Γ the same-segment lower mask)
  G is not read and no part of dG is made: no q kᵀ loop, no W sums; dgr, dgc are not written."""
  tl.static_assert((K % BK == 0) and (V % BK == 0) and (K % GBK == 0))
  tl.static_assert((not GRADS) or (H == HV))
  tl.static_assert((not STATES) or GRADS)
  rc, rows, qk_base, v_base, vec0, chunk = _chunk_index(t, H, HV, K, V, C)
  q_ptr += qk_base           # int64 bases in the pointers, so that tile offsets are int32
  # (the forward kept int64 tile offsets: ptxas gave it more registers with these shifts)
  k_ptr += qk_base
  v_ptr += v_base
  m_ptr += chunk * C * C
  dp_ptr += chunk * C * C
  dny_ptr += chunk * C * K
  du_ptr += chunk * C * V
  if STATES:   # the state pass's products made here (`intra_chunk_bwd_from_states`)
    h_ptr += chunk * K * V
    dh_ptr += chunk * K * V
    e_ptr += v_base
    do_ptr += v_base
  if GRADS:                  # whole gradients in the inputs' layout
    dq_ptr += qk_base
    dk_ptr += qk_base
    dv_ptr += v_base
    dqg_ptr += chunk * C * K
    dkg_ptr += chunk * C * K
  else:
    dq_ptr += chunk * C * K
    dk_ptr += chunk * C * K
    dv_ptr += chunk * C * V
  if GATED:
    rb, ii, jj, beta, g, entry = _row_factors(beta_ptr, g_ptr, cont_ptr, vec0, rc, rows, BK,
                                              PACKED)
  else:   # e = e^0 · cont
    rb, ii, jj = tl.arange(0, BK), rc[:, None], rc[None, :]
    beta = tl.load(beta_ptr + vec0 + rc)
    if PACKED:
      entry = tl.load(cont_ptr + rows)
    else:
      entry = tl.full((C,), 1.0, tl.float32)
  cc = ii * C + jj
  m = tl.load(m_ptr + cc)                                 # bf16, as the forward applied it
  mt = tl.trans(m)
  # dR = Mᵀ [dY | dU] with Y = M (k ⊙ β e), U = M (v ⊙ β) made again, a slice at a time:
  # −dL = dR_k Yᵀ + dR_v Uᵀ accumulates over the slices, and so do the row sums Σ dR_k ⊙ k,
  # Σ dR_v ⊙ v of dβ; dV = β dR_v is stored per slice.
  d_l = tl.zeros((C, C), tl.float32)
  rk_dot = tl.zeros((C,), tl.float32)
  rv_dot = tl.zeros((C,), tl.float32)
  for s in tl.range(K // BK, num_stages=SLICE_STAGES):
    cols = s * BK + rb
    k = tl.load(k_ptr + ii * (H * K) + cols[None, :])
    y = tl.dot(m, (k.to(tl.float32) * (beta * entry)[:, None]).to(tl.bfloat16))
    if STATES:                                            # dNY = dE hᵀ
      d_y = (-_abt(du_ptr, V, h_ptr, cols, V, C, BK, V, VS)).to(tl.bfloat16)
    else:
      d_y = (-tl.load(dny_ptr + ii * K + cols[None, :]).to(tl.float32)
             ).to(tl.bfloat16)                            # dY = −dNY (exact)
    d_rk = tl.dot(mt, d_y)
    d_l = tl.dot(d_rk.to(tl.bfloat16), tl.trans(y.to(tl.bfloat16)), d_l)
    rk_dot += tl.sum(d_rk * k.to(tl.float32), axis=1)
  for s in tl.range(V // BK, num_stages=SLICE_STAGES):
    cols = s * BK + rb
    cv = ii * V + cols[None, :]
    v = tl.load(v_ptr + ii * (HV * V) + cols[None, :])
    u = tl.dot(m, (v.to(tl.float32) * beta[:, None]).to(tl.bfloat16))
    d_rv = tl.dot(mt, tl.load(du_ptr + cv))
    d_l = tl.dot(d_rv.to(tl.bfloat16), tl.trans(u.to(tl.bfloat16)), d_l)
    if GRADS:
      tl.store(dv_ptr + ii * (HV * V) + cols[None, :], beta[:, None] * d_rv)
    else:
      tl.store(dv_ptr + cv, beta[:, None] * d_rv)
    rv_dot += tl.sum(d_rv * v.to(tl.float32), axis=1)
  d_l = -d_l
  # k kᵀ in a loop of its own: accumulated beside dL above, the two tiles spilled at 4 warps.
  kk = tl.zeros((C, C), tl.float32)
  for s in tl.range(K // BK, num_stages=SLICE_STAGES):
    k = tl.load(k_ptr + ii * (H * K) + (s * BK + rb)[None, :])
    kk = tl.dot(k, tl.trans(k), kk)
  if GATED:
    gam = _gamma(g, seg_ptr, rows, ii, jj, PACKED)
  else:
    gam = _ungated_gamma(seg_ptr, rows, ii, jj, PACKED)
  strict = ii > jj
  d_b = tl.where(strict, d_l * beta[:, None] * gam, 0.0)
  d_beta = tl.sum(tl.where(strict, d_l * kk * gam, 0.0), axis=1) + entry * rk_dot + rv_dot
  tl.store(dbeta_ptr + vec0 + rc, d_beta)
  if GATED:
    w_b = d_b * kk                      # W = dA ⊙ q kᵀ + dB ⊙ k kᵀ: its k kᵀ half
    w_row = tl.sum(w_b, axis=1)
    w_col = tl.sum(w_b, axis=0)
  if STATES:                                              # dP = dO Eᵀ
    d_p = _abt(do_ptr, HV * V, e_ptr, rc, HV * V, C, C, V, VS)
  else:
    d_p = tl.load(dp_ptr + cc).to(tl.float32)
  d_a = scale * d_p * gam
  d_a16 = d_a.to(tl.bfloat16)
  d_bs = (d_b + tl.trans(d_b)).to(tl.bfloat16)
  # dq = dA k, dk = dAᵀ q + (dB + dBᵀ) k + β e ⊙ dR_k (dR_k made again), GBK columns a step
  # (`blocks.grads_bk`: triton 3.6 converts dA and dB + dBᵀ to the products' operand layout
  # inside every step); then, GATED, q kᵀ over the slices for W's other half.
  # With GRADS, also the QG = scale q e and KG = k x terms (x = e^{G_C − G}, the exit factor)
  # and, GATED, their row sums for dG.
  rg = tl.arange(0, GBK)
  if GATED:
    exit_ = tl.exp(tl.load(g_ptr + vec0 + C - 1) - g)
    if PACKED:
      exit_ = exit_ * tl.load(keep_ptr + rows)
  elif PACKED:   # x = e^0 · keep
    exit_ = tl.load(keep_ptr + rows)
  else:
    exit_ = tl.full((C,), 1.0, tl.float32)
  q_row = tl.zeros((C,), tl.float32)
  k_row = tl.zeros((C,), tl.float32)
  for s in tl.range(K // GBK, num_stages=SLICE_STAGES):
    cols = s * GBK + rg
    src = ii * (H * K) + cols[None, :]
    ck = ii * K + cols[None, :]
    q = tl.load(q_ptr + src)
    k = tl.load(k_ptr + src)
    dq = tl.dot(d_a16, k)
    dk = tl.dot(tl.trans(d_a16), q)
    dk = tl.dot(d_bs, k, dk)
    if STATES:
      d_rk = tl.dot(mt, (-_abt(du_ptr, V, h_ptr, cols, V, C, GBK, V, VS)).to(tl.bfloat16))
    else:
      d_rk = tl.dot(mt, (-tl.load(dny_ptr + ck).to(tl.float32)).to(tl.bfloat16))
    dk += (beta * entry)[:, None] * d_rk
    if STATES:                     # dQG = dO hᵀ, dKG = E dhᵀ
      d_qg = _abt(do_ptr, HV * V, h_ptr, cols, V, C, GBK, V, VS)
      d_kg = _abt(e_ptr, HV * V, dh_ptr, cols, V, C, GBK, V, VS)
    elif GRADS:
      d_qg = tl.load(dqg_ptr + ck).to(tl.float32)
      d_kg = tl.load(dkg_ptr + ck).to(tl.float32)
    if GRADS:
      dq += (scale * entry)[:, None] * d_qg
      dk += exit_[:, None] * d_kg
      if GATED:
        q_row += tl.sum(d_qg * q.to(tl.float32), axis=1)
        k_row += tl.sum(d_kg * k.to(tl.float32), axis=1)
      tl.store(dq_ptr + src, dq)
      tl.store(dk_ptr + src, dk)
    else:
      tl.store(dq_ptr + ck, dq)
      tl.store(dk_ptr + ck, dk)
  if GATED:   # the rest is dG's: q kᵀ for W's other half, the row and column sums
    qk = tl.zeros((C, C), tl.float32)
    for s in tl.range(K // BK, num_stages=SLICE_STAGES):
      src = ii * (H * K) + (s * BK + rb)[None, :]
      qk = tl.dot(tl.load(q_ptr + src), tl.trans(tl.load(k_ptr + src)), qk)
    # dA again from memory and Γ again from G (held over the loops, their float32 tiles
    # spilled).
    g = tl.load(g_ptr + vec0 + rc)
    gam = _gamma(g, seg_ptr, rows, ii, jj, PACKED)
    if STATES:
      w_a = scale * _abt(do_ptr, HV * V, e_ptr, rc, HV * V, C, C, V, VS) * gam * qk
    else:
      w_a = scale * tl.load(dp_ptr + cc).to(tl.float32) * gam * qk
    d_row = entry * beta * rk_dot + (tl.sum(w_a, axis=1) + w_row)
    d_col = tl.sum(w_a, axis=0) + w_col
    if GRADS:   # dG = row sums − column sums + the QG / KG terms; G_C also enters every x
      d_exit = exit_ * k_row
      d_g = d_row - d_col + scale * entry * q_row - d_exit
      d_g += tl.where(rc == C - 1, tl.sum(d_exit, axis=0), 0.0)
      tl.store(dgr_ptr + vec0 + rc, d_g)
    else:
      tl.store(dgr_ptr + vec0 + rc, d_row)
      tl.store(dgc_ptr + vec0 + rc, d_col)


def supported(chunk: int, dk: int, dv: int) -> str | None:
  """None if these kernels take the sizes (those checked: `blocks.INTRA_HEAD_DIMS`), else why."""
  return blocks.intra_supported("delta-rule", chunk, dk, dv)


def _dims(q, v, segments, beta):
  """((B, T, H, K, HV, V, Nc, C), the three segment rows, packed?) of a call."""
  b, t, h, dk = q.shape
  hv, dv = v.shape[2], v.shape[3]
  if segments is None:   # unused pointers: the kernels read them only when PACKED
    seg, packed = (beta,) * 3, False
  else:
    seg, packed = tuple(x.astype(jnp.float32) for x in segments), True
  return (b, t, h, dk, hv, dv, t // blocks.CHUNK, blocks.CHUNK), seg, packed


@functools.partial(jax.jit, static_argnames=("scale", "with_inverse", "precision", "num_warps",
                                             "slice_stages", "inverse"))
def intra_chunk_fwd(q, k, v, beta, g, gx, segments=None, *, scale: float, with_inverse=False,
                    precision: str = blocks.INTRA_PRECISION, num_warps: int = blocks.INTRA_WARPS,
                    slice_stages: int = blocks.INTRA_SLICE_STAGES,
                    inverse: str = blocks.INTRA_INVERSE):
  """As `pallas_kernels.gpu.intra_chunk.intra_chunk_fwd` (same arguments and results).

  precision: `tl.dot`'s input_precision for the inverse's float32 products ("ieee", "tf32x3" or
  "tf32"); num_warps: the program's warps; slice_stages: the software-pipelining depth of the
  slice loops; inverse: "tiles" (`_unit_lower_inverse`, ten full-tile products) or "batched"
  (`_batched_unit_lower_inverse`, its first levels on the diagonal blocks). Their defaults are
  `blocks`' (how they were chosen is written there); the others are for
  `experiments.bench_triton_parts`."""
  if precision not in blocks.INTRA_PRECISIONS:
    raise ValueError(f"precision={precision!r}: expected one of {blocks.INTRA_PRECISIONS}")
  if inverse not in blocks.INTRA_INVERSES:
    raise ValueError(f"inverse={inverse!r}: expected one of {blocks.INTRA_INVERSES}")
  (b, t, h, dk, hv, dv, nc, c), seg, packed = _dims(q, v, segments, beta)
  bk = blocks.INTRA_BK
  f32 = jnp.float32
  out_shape = _structs(((b, hv, nc, c, dk), MM_DTYPE), ((b, hv, nc, c, dk), MM_DTYPE),
                       ((b, hv, nc, c, c), MM_DTYPE), ((b, hv, nc, c, dv), f32),
                       ((b, hv, nc, c, dk), MM_DTYPE),
                       ((b, hv, nc, c, c) if with_inverse else (1,), MM_DTYPE))
  ny, qg, p, u, kg, m = _jax_triton().triton_call(
      q.astype(MM_DTYPE), k.astype(MM_DTYPE), v.astype(MM_DTYPE), beta.astype(f32),
      g.astype(f32), gx.astype(f32), *seg, t, float(scale),
      kernel=_fwd_kernel, out_shape=out_shape, grid=(nc, b * hv), num_warps=num_warps,
      num_stages=1, H=h, HV=hv, K=dk, V=dv, C=c, PACKED=packed,
      BK=bk, WITH_INVERSE=with_inverse, PREC=precision, SLICE_STAGES=slice_stages,
      SBK=blocks.solve_bk(dk, dv), BATCHED_INVERSE=inverse == "batched")
  return (ny, qg, p, u, kg, m) if with_inverse else (ny, qg, p, u, kg)


@functools.partial(jax.jit, static_argnames=("scale", "gated", "num_warps", "slice_stages",
                                             "grads_bk"))
def intra_chunk_bwd(q, k, v, beta, g, gx, segments, m, dny, dp, du, cotangents=None, *,
                    scale: float, gated: bool = True, num_warps: int = blocks.INTRA_WARPS,
                    slice_stages: int = blocks.INTRA_SLICE_STAGES, grads_bk: int | None = None):
  """As `pallas_kernels.gpu.intra_chunk.intra_chunk_bwd` (same arguments and results), or, with
  `cotangents` = (dqg, dkg) (the cotangents of the forward's QG and KG, chunk-major), the whole
  backward in one kernel (H = HV only): (dq, dk `[B, T, H, K]`, dv `[B, T, HV, V]`, dβ and dG
  `[B, HV, T]`), all float32: what `lineax_attn.ops.gpu_vjps` otherwise adds in XLA (the QG / KG
  terms, dG from the row sums, the chunk-major-to-row transposes).
  gated=False: for G = 0 (DeltaNet; `g` is then not read, and must be zeros for the other
  results to hold): the kernel makes no part of dG (no q kᵀ loop, no W or QG / KG row sums),
  and None stands in the results for dg_row and dg_col (or for the fused dG). Untimed: the
  next GPU session should time DeltaNet with intra_grads="kernel" against "xla"
  (`experiments.bench_triton_parts`' "delta_rule whole op" rows) on this path.
  grads_bk: columns a step of the dq / dk loop (None: `blocks.grads_bk`'s; for benchmarks)."""
  del gx   # the kernel makes the exit factor from G
  (b, t, h, dk, hv, dv, nc, c), seg, packed = _dims(q, v, segments, beta)
  grads = cotangents is not None
  if grads and h != hv:
    raise ValueError(f"intra_chunk_bwd: cotangents (the fused backward) need H = HV, got "
                     f"H={h}, HV={hv} (GVA sums dq, dk over value heads: the caller's)")
  bk = blocks.INTRA_BK
  f32 = jnp.float32
  dg_shape = (b, hv, t) if gated else (1,)   # ungated: dgr, dgc unwritten placeholders
  if grads:
    out_shape = _structs(((b, t, h, dk), f32), ((b, t, h, dk), f32), ((b, t, hv, dv), f32),
                         ((b, hv, t), f32), (dg_shape, f32), ((1,), f32))
    dqg, dkg = (x.astype(MM_DTYPE) for x in cotangents)
  else:
    out_shape = _structs(((b, hv, nc, c, dk), f32), ((b, hv, nc, c, dk), f32),
                         ((b, hv, nc, c, dv), f32), ((b, hv, t), f32), *[(dg_shape, f32)] * 2)
    dqg = dkg = dny.astype(MM_DTYPE)   # unread placeholders
  outs = tuple(_jax_triton().triton_call(
      q.astype(MM_DTYPE), k.astype(MM_DTYPE), v.astype(MM_DTYPE), beta.astype(f32),
      g.astype(f32), seg[0], seg[1], seg[2], m.astype(MM_DTYPE), dny.astype(MM_DTYPE),
      dp.astype(MM_DTYPE), du.astype(MM_DTYPE), dqg, dkg, *(dqg,) * 4, t, float(scale),
      kernel=_bwd_kernel, out_shape=out_shape, grid=(nc, b * hv), num_warps=num_warps, num_stages=1,
      H=h, HV=hv, K=dk, V=dv, C=c, BK=bk, PACKED=packed, SLICE_STAGES=slice_stages,
      GBK=grads_bk or blocks.grads_bk(dk, hopper=_on_hopper(), fused=grads), GRADS=grads,
      GATED=gated, STATES=False, VS=min(dv, 64)))
  if not gated:
    outs = outs[:4] + (None, None)
  return outs[:5] if grads else outs


@functools.partial(jax.jit, static_argnames=("scale", "gated", "num_warps", "slice_stages",
                                             "vs"))
def intra_chunk_bwd_from_states(q, k, v, beta, g, segments, m, de, h, dh, e, do, *,
                                scale: float, gated: bool = True,
                                num_warps: int = blocks.INTRA_WARPS,
                                slice_stages: int = blocks.INTRA_SLICE_STAGES,
                                vs: int | None = None):
  """`intra_chunk_bwd` with `cotangents` (the whole backward, H = HV), its inputs' cotangents
  made in the kernel from the state pass's arrays instead of read: dNY = dE hᵀ, dQG = dO hᵀ,
  dP = dO Eᵀ, dKG = E dhᵀ, dU = dE (what `gpu_vjps.state_pass_products` would write to HBM).

  de, h, dh chunk-major (`[B, HV, Nc, C, V]` float32, `[B, HV, Nc, K, V]` bf16 twice: the
  cotangent of E, the state entering each chunk, the cotangent of the state leaving it); e, do
  in the op's `[B, T, HV, V]` layout (E float32, dO). Returns (dq, dk, dv, dβ, dG) as
  `intra_chunk_bwd` with cotangents does (dG None when not gated); gc's term of dG is the
  caller's. vs: value columns a step of the in-kernel products (None:
  `blocks.from_states_vs`; at V = 128 a step of 64 compiles to a wrong dk on the H200, see
  there). `lineax_attn.ops.pallas_gpu` calls it only up to head dim 64, where its op-level
  tests ran compiled."""
  (b, t, h_, dk, hv, dv, nc, c), seg, packed = _dims(q, v, segments, beta)
  vs = blocks.from_states_vs(dv) if vs is None else vs
  if dv % vs:
    raise ValueError(f"intra_chunk_bwd_from_states: vs={vs} must divide V={dv}")
  if h_ != hv:
    raise ValueError(f"intra_chunk_bwd_from_states needs H = HV, got H={h_}, HV={hv}")
  f32 = jnp.float32
  dg_shape = (b, hv, t) if gated else (1,)
  out_shape = _structs(((b, t, h_, dk), f32), ((b, t, h_, dk), f32), ((b, t, hv, dv), f32),
                       ((b, hv, t), f32), (dg_shape, f32), ((1,), f32))
  m = m.astype(MM_DTYPE)
  outs = _jax_triton().triton_call(
      q.astype(MM_DTYPE), k.astype(MM_DTYPE), v.astype(MM_DTYPE), beta.astype(f32),
      g.astype(f32), seg[0], seg[1], seg[2], m, m, m, de.astype(MM_DTYPE), m, m,
      h.astype(MM_DTYPE), dh.astype(MM_DTYPE), e.astype(f32), do.astype(MM_DTYPE), t,
      float(scale), kernel=_bwd_kernel, out_shape=out_shape, grid=(nc, b * hv),
      num_warps=num_warps, num_stages=1, H=h_, HV=hv, K=dk, V=dv, C=c, BK=blocks.INTRA_BK,
      PACKED=packed, SLICE_STAGES=slice_stages,
      GBK=blocks.grads_bk(dk, hopper=_on_hopper(), fused=True), GRADS=True, GATED=gated,
      STATES=True, VS=vs)
  dq, dk_, dv_, dbeta, dg = outs[:5]
  return dq, dk_, dv_, dbeta, dg if gated else None
