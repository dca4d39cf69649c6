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
row, e^{G_i − G_j} = e^{G_i − G_n} e^{G_n − G_j}, one bf16 product per sub-chunk (operands
masked to p's rows and to the columns before n, float32 accumulation); the 16 × 16 diagonal
blocks are exact elementwise float32 sums over the channels. The inverse and the rest are those
of the DeltaNet / GDN kernel (`intra_chunk._unit_lower_inverse`, tf32 products, M applied in
bf16).

Channel slices: no program holds a whole [C, K] float32 tile. K is walked in slices of BK
channels (`blocks.CHANNEL_BK`), and each slice loads only its [C, BK] columns of q, k, k̃, G (and
the anchor rows' G): every sum over channels (the anchored products, the diagonal blocks)
accumulates its [C, C] tile slice by slice, and every [C, K] output is made and stored slice by
slice. The diagonal blocks are walked as 16 bands, r = 0..15: band r pairs each row i with row
j = 16⌊i/16⌋ + r of its own sub-chunk (loaded as a [C, BK] slice whose rows repeat per
sub-chunk), which gives the blocks' entries (i, j) as a [C] vector, summed into column r of a
[C, 16] tile kept in the operands' layout; after the last slice one exact float32 product with
a 0/1 matrix places the tile into P and L (`_expand_bands`), all in registers. (Adding each
band straight to the [C, C] accumulators, which the tensor cores' products fix in their own
layout, cost a [C, C] layout conversion through shared memory per band.)

Forward: one slice loop accumulates P and L and stores QG, KG and gc (which need no M); then
the masks, P's store and M; then NY = −M (K̃ ⊙ e^G) and U = M Ṽ, `blocks.solve_bk` columns at
a time. Or (`solve="kernel"`) the program stops after storing M, and `_solve_kernel` makes NY
and U from it, one program per chunk and column block (few registers, many programs an SM).

The backward kernel (`channel_intra_bwd`) takes the forward's bf16 M and computes what needs the
C × C matrices: Y, U again, dR = Mᵀ [dY | dU], dL = −dR [Y | U]ᵀ (strictly lower, same
segment), and the pairs' cotangents for W ∈ {dP, dL}, anchored as in the forward plus the exact
diagonal blocks: dA_ic = Σ_j W_ij K_jc e^{G_ic − G_jc}, dK_jc = Σ_i W_ij A_ic e^{G_ic − G_jc}.
Sliced: a K-slice loop makes Y, dR_k (stored) and adds dR_k Yᵀ into dL, a V-slice loop U and dR_v
(stored) and dR_v Uᵀ; then a second K-slice loop makes each [C, BK] slice of dQ, dK̃, dK whole
(the anchored sub-chunks, then the diagonal bands, whose W entries W_{i, j} and W_{j, i} are read
as [C] vectors from dP and from dL's float32 scratch output, written before a block barrier)
and stores it once. The elementwise rest (QG, KG, gc, the entry and exit factors, and dG, which
the pairs give as Q ⊙ dQ + K̃ ⊙ dK̃ − K ⊙ dK since they depend on G only through A ⊙ e^G and
K ⊙ e^{−G}) is XLA's, `lineax_attn.ops.gpu_prepare.channel_grads`, with the kernel half's
float32 oracle beside it (`channel_pair_solve_vjp_reference`); or, with GRADS
(`channel_intra_grads`), the same kernel does it in its last slice loop (`_elementwise_grads`,
dG's in-chunk reverse cumsum as `tl.cumsum(reverse=True)` over the slice's rows) and stores
whole gradients in the inputs' `[B, T, HV, D]` layout, so the float32 pair parts never make a
round trip through HBM and XLA's passes over them and the layout transposes go away.

The bounded-span path (`span` > 0, `blocks.CHANNEL_SPAN` / `GpuTuning.channel_span`; 80, the
default, since it was timed on the H200): a channel slice whose every 16-row sub-chunk decays by at most `span`
nats (its first row's G less its last's, every channel of the slice) skips the bands and runs
the anchored products through the diagonal blocks too, the anchor factor e^{G_n − G_j} of a row
inside its own block then being ≥ 1 and at most e^{span} (≤ e^80, a normal number), so the
whole slice is four bf16 tensor-core products; other slices keep the exact bands.

Segments (packed sequences): seg (the segment id relative to the chunk's first row), cont and
keep, each [B, T] float32 (`gpu_chunks.kernel_segments`); pairs of different segments are zero,
rows whose segment started inside the chunk do not see the entry state (QG, K̃ ⊙ e^G scaled by
cont), rows whose segment ends inside the chunk do not reach the exit state (KG by keep), and gc
is scaled by the chunk's last cont.

The state pass's products in the backward (PRODUCTS, `channel_intra_grads_from_states`): the
fused backward takes the chunk states h, dh and E, dE, dO instead of the cotangents dNY, dQG,
dP, dKG, dgc that XLA would make from them, and makes each where it is used (all five in a
prologue, `state_pass.chunk_products`, into scratches the body reads as it reads given ones).

Gates on chip (`erase=`, `write=`; `GATE_ROW`, `GATE_CHANNEL`): kt and vt are then k and v, and
every load of k̃ or ṽ multiplies in the gate (`_gated_rows`); the backward writes k's whole
gradient, v's, and the gates' own (row gates summed over the channels in registers).

One program per (chunk, batch · value head) reads its rows of q, k, k̃, ṽ (bf16 or float32,
widened on chip) and G (float32, `chunk_gates`) from `[B, T, HV, D]` and writes chunk-major
`[B, HV, Nc, C, D]`. Offsets are int64. Imports triton (the `triton` extra); jax_triton only
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
from pallas_kernels.gpu.triton.state_pass import (MM_DTYPE, _jax_triton, _on_hopper, _structs,
                                                  chunk_products)

SUB = 16          # rows of a sub-chunk (the anchoring of the off-diagonal pairs)
# How k̃ and ṽ reach the kernels: given as arrays (GATE_NONE), or made on chip from k / v and a
# gate with one factor per row (`[B, T, HV]`, KDA's β) or per channel (GDN-2's gates).
GATE_NONE = tl.constexpr(0)
GATE_ROW = tl.constexpr(1)
GATE_CHANNEL = tl.constexpr(2)
# Which pair path `_slice_grads` compiles (the channel backward's slice loops).
PATHS_BOUNDED = tl.constexpr(1)
PATHS_EXACT = tl.constexpr(2)
PATHS_BOTH = tl.constexpr(3)


@triton.jit
def _chunk_index(t, HV: tl.constexpr, C: tl.constexpr):
  """This program's value head, first time row, time rows [C], chunk rows [C] and chunk."""
  ci = tl.program_id(0)
  bhv = tl.program_id(1)
  rc = tl.arange(0, C)
  row0 = (bhv // HV).to(tl.int64) * t + ci * C
  chunk = bhv.to(tl.int64) * (t // C) + ci
  return bhv % HV, row0, row0 + rc, rc, chunk


@triton.jit
def _rows(ptr, rows, hv, cols, HV: tl.constexpr, D: tl.constexpr):
  """The [len(rows), len(cols)] tile of `[B, T, HV, D]` at time rows `rows`, head hv, as float32
  (the inputs may come in bf16: `_operand`)."""
  return tl.load(ptr + (rows * HV + hv)[:, None] * D + cols[None, :]).to(tl.float32)


@triton.jit
def _scaled_q(q_ptr, rows, hv, cols, HV: tl.constexpr, K: tl.constexpr, QS: tl.constexpr):
  """`_rows` of q times its scale QS (1: q comes scaled; else the caller's q, scaled here)."""
  q = _rows(q_ptr, rows, hv, cols, HV, K)
  if QS != 1.0:
    q = q * QS
  return q


@triton.jit
def _gate(gate_ptr, rows, hv, cols, HV: tl.constexpr, D: tl.constexpr, GATE: tl.constexpr):
  """The factor a gated input is multiplied by on chip (`GATE_*`): one per row of `[B, T, HV]`
  ([len(rows), 1]) or one per channel of `[B, T, HV, D]`, float32."""
  if GATE == GATE_ROW:   # (a static branch: one return, as compiled Triton asks)
    factor = tl.load(gate_ptr + rows * HV + hv).to(tl.float32)[:, None]
  else:
    factor = _rows(gate_ptr, rows, hv, cols, HV, D)
  return factor


@triton.jit
def _gated_rows(x_ptr, gate_ptr, rows, hv, cols, HV: tl.constexpr, D: tl.constexpr,
                GATE: tl.constexpr):
  """`_rows` of k̃ or ṽ: x itself (GATE_NONE), or x ⊙ its gate made here (x then k or v)."""
  x = _rows(x_ptr, rows, hv, cols, HV, D)
  if GATE != GATE_NONE:
    x = x * _gate(gate_ptr, rows, hv, cols, HV, D, GATE)
  return x


@triton.jit
def _solve_slice(m, kt_ptr, g_ptr, cont, rows, hv, cols, HV: tl.constexpr, K: tl.constexpr,
                 PACKED: tl.constexpr, erase_ptr, ERASE: tl.constexpr):
  """Y = M (K̃ ⊙ e^G) on one channel slice (e^G zeroed where the segment began in the chunk)."""
  entry = tl.exp(_rows(g_ptr, rows, hv, cols, HV, K))
  if PACKED:
    entry = entry * cont
  kt = _gated_rows(kt_ptr, erase_ptr, rows, hv, cols, HV, K, ERASE)
  return tl.dot(m, (kt * entry).to(tl.bfloat16))


@triton.jit
def _store_ny(ny_ptr, y, chunk, cols, K: tl.constexpr, C: tl.constexpr):
  """NY = −Y on the columns `cols` of this chunk (bf16, chunk-major)."""
  tl.store(ny_ptr + chunk * C * K + tl.arange(0, C)[:, None] * K + cols[None, :],
           (-y).to(tl.bfloat16))


@triton.jit
def _store_u(u_ptr, u, chunk, cols, V: tl.constexpr, C: tl.constexpr):
  """U on the columns `cols` of this chunk (float32, chunk-major)."""
  tl.store(u_ptr + chunk * C * V + tl.arange(0, C)[:, None] * V + cols[None, :], u)


@triton.jit
def _ny_block(m, kt_ptr, g_ptr, cont, rows, hv, cols, chunk, ny_ptr, HV: tl.constexpr,
              K: tl.constexpr, C: tl.constexpr, PACKED: tl.constexpr, erase_ptr,
              ERASE: tl.constexpr):
  """Stores NY = −M (K̃ ⊙ e^G) on the columns `cols` of this chunk (bf16, chunk-major)."""
  y = _solve_slice(m, kt_ptr, g_ptr, cont, rows, hv, cols, HV, K, PACKED, erase_ptr, ERASE)
  _store_ny(ny_ptr, y, chunk, cols, K, C)


@triton.jit
def _raw_tile(ptr, rows, hv, cols, HV: tl.constexpr, D: tl.constexpr, live=True):
  """`_rows` as stored (bf16 or float32), widened where it is used; `live` False: no load
  (zeros), for a prefetch past the last step."""
  return tl.load(ptr + (rows * HV + hv)[:, None] * D + cols[None, :], mask=live, other=0.0)


@triton.jit
def _solve_pair(m, g, kt, vt, erase_ptr, write_ptr, cont, rows, hv, cols, chunk, ny_ptr, u_ptr,
                HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                PACKED: tl.constexpr, ERASE: tl.constexpr, WRITE: tl.constexpr):
  """`_ny_block` and `_u_block` on the same columns, the same values, from the tiles of G, K̃
  and Ṽ loaded by the caller (`_raw_tile`) before either product: the kernel's barriers keep
  every load of a block behind the block before it (SASS, sm_90a), so only loads written
  first overlap."""
  entry = tl.exp(g.to(tl.float32))
  if PACKED:
    entry = entry * cont
  kt = kt.to(tl.float32)
  if ERASE != GATE_NONE:
    kt = kt * _gate(erase_ptr, rows, hv, cols, HV, K, ERASE)
  vt = vt.to(tl.float32)
  if WRITE != GATE_NONE:
    vt = vt * _gate(write_ptr, rows, hv, cols, HV, V, WRITE)
  _store_ny(ny_ptr, tl.dot(m, (kt * entry).to(tl.bfloat16)), chunk, cols, K, C)
  _store_u(u_ptr, tl.dot(m, vt.to(tl.bfloat16)), chunk, cols, V, C)


@triton.jit
def _u_block(m, vt_ptr, rows, hv, cols, chunk, u_ptr, HV: tl.constexpr, V: tl.constexpr,
             C: tl.constexpr, write_ptr, WRITE: tl.constexpr):
  """Stores U = M Ṽ on the columns `cols` of this chunk (float32, chunk-major)."""
  u = tl.dot(m, _gated_rows(vt_ptr, write_ptr, rows, hv, cols, HV, V, WRITE).to(tl.bfloat16))
  _store_u(u_ptr, u, chunk, cols, V, C)


@triton.jit
def _slice_operands(q_ptr, k_ptr, kt_ptr, g_ptr, rows, hv, cols, HV: tl.constexpr,
                    K: tl.constexpr, erase_ptr, ERASE: tl.constexpr, QS: tl.constexpr):
  """One channel slice of q (times QS), k, k̃ and G, [C, BK] float32 each."""
  return (_scaled_q(q_ptr, rows, hv, cols, HV, K, QS), _rows(k_ptr, rows, hv, cols, HV, K),
          _gated_rows(kt_ptr, erase_ptr, rows, hv, cols, HV, K, ERASE),
          _rows(g_ptr, rows, hv, cols, HV, K))


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
def _anchored_factors(g, g_ptr, row0, hv, rc, cols, blk, HV: tl.constexpr, K: tl.constexpr,
                      SUBC: tl.constexpr, THROUGH: tl.constexpr = False):
  """Sub-chunk blk's anchoring at its first row n, on the channel slice `cols` (g is G's
  [C, BK] slice): (rows of blk [C, 1], columns before n [1, C], e^{G_i − G_n} on blk's rows,
  e^{G_n − G_j} on the rows before n), zero elsewhere. THROUGH (the bounded-span path): the
  columns run through blk's own rows too, where e^{G_n − G_j} ≥ 1 (at most e^{span})."""
  n = blk * SUBC
  g_n = tl.load(g_ptr + ((row0 + n) * HV + hv) * K + cols)
  in_p = ((rc >= n) & (rc < n + SUBC))[:, None]
  limit = n + SUBC if THROUGH else n
  before = (rc < limit)[:, None]
  row_f = tl.where(in_p, tl.exp(tl.where(in_p, g - g_n[None, :], 0.0)), 0.0)
  col_f = tl.where(before, tl.exp(tl.where(before, g_n[None, :] - g, 0.0)), 0.0)
  return in_p, (rc < limit)[None, :], row_f, col_f


@triton.jit
def _slice_bounded(g_ptr, row0, hv, cols, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                   SUBC: tl.constexpr, SPAN: tl.constexpr):
  """Whether every 16-row sub-chunk of the chunk decays by at most SPAN nats in every channel
  of the slice (G is non-increasing within a chunk: a sub-chunk's decay is its first row's G
  less its last row's)."""
  span = tl.zeros((), tl.float32)
  for blk in tl.static_range(C // SUBC):
    first = tl.load(g_ptr + ((row0 + blk * SUBC) * HV + hv) * K + cols)
    last = tl.load(g_ptr + ((row0 + blk * SUBC + SUBC - 1) * HV + hv) * K + cols)
    span = tl.maximum(span, tl.max(first - last, axis=0))
  return span <= SPAN


@triton.jit
def _pairs_slice(q, k, kt, g, k_ptr, g_ptr, row0, hv, rc, cols, p_acc, l_acc, p_band, l_band,
                 HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr,
                 BAND_STAGES: tl.constexpr, SKIP: tl.constexpr, SPAN: tl.constexpr = 0.0):
  """Adds the channel slice `cols` (q, k, k̃, G its [C, BK] slices) to P and L (unmasked): the
  anchored products to p_acc / l_acc [C, C], the diagonal blocks to p_band / l_band [C, SUBC]
  (entry (i, r) of row i's band r, `_expand_bands` places them once all slices are in). With
  SPAN > 0 a slice whose sub-chunks decay by at most SPAN takes the diagonal blocks into the
  anchored products instead (`blocks.CHANNEL_SPAN`)."""
  bounded = False
  if SPAN > 0:
    bounded = _slice_bounded(g_ptr, row0, hv, cols, HV, K, C, SUBC, SPAN)
  if bounded:
    for blk in tl.static_range(C // SUBC):
      _, _, row_f, col_f = _anchored_factors(g, g_ptr, row0, hv, rc, cols, blk, HV, K, SUBC,
                                             True)
      kc = tl.trans((k * col_f).to(tl.bfloat16))
      p_acc = tl.dot((q * row_f).to(tl.bfloat16), kc, p_acc)
      l_acc = tl.dot((kt * row_f).to(tl.bfloat16), kc, l_acc)
  else:
    p_acc, l_acc, p_band, l_band = _pairs_slice_exact(q, k, kt, g, k_ptr, g_ptr, row0, hv, rc,
                                                      cols, p_acc, l_acc, p_band, l_band, HV,
                                                      K, C, SUBC, BAND_STAGES, SKIP)
  return p_acc, l_acc, p_band, l_band


@triton.jit
def _pairs_slice_exact(q, k, kt, g, k_ptr, g_ptr, row0, hv, rc, cols, p_acc, l_acc, p_band,
                       l_band, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                       SUBC: tl.constexpr, BAND_STAGES: tl.constexpr, SKIP: tl.constexpr):
  """`_pairs_slice` with exact float32 diagonal blocks (any decay)."""
  # Off-diagonal pairs, anchored at each sub-chunk's first row n: rows of sub-chunk p against
  # the columns before n, e^{G_i − G_n} · e^{G_n − G_j}, both exponents ≤ 0. They are exactly
  # zero inside the diagonal blocks, which the bands below fill.
  if (SKIP & 2) == 0:   # blocks.PHASE_ANCHORED
    for blk in tl.static_range(1, C // SUBC):
      _, _, row_f, col_f = _anchored_factors(g, g_ptr, row0, hv, rc, cols, blk, HV, K, SUBC)
      kc = tl.trans((k * col_f).to(tl.bfloat16))
      p_acc = tl.dot((q * row_f).to(tl.bfloat16), kc, p_acc)
      l_acc = tl.dot((kt * row_f).to(tl.bfloat16), kc, l_acc)
  # Diagonal blocks, exact float32: band r pairs row i with j = 16⌊i/16⌋ + r (j ≤ i). A
  # run-time loop: unrolled, the sixteen bands' loads were scheduled together and spilled.
  # The band sums go to [C, SUBC] tiles in the operands' own layout, not into the [C, C]
  # accumulators: those live in the tensor cores' layout, and adding a column to them cost a
  # whole [C, C] layout conversion through shared memory per band (seen in the TTGIR).
  base = (rc // SUBC) * SUBC
  band_col = tl.arange(0, SUBC)[None, :]
  for r in tl.range(SUBC if (SKIP & 4) == 0 else 0, num_stages=BAND_STAGES):
    lower = (r <= rc - base)[:, None]
    j_rows = row0 + base + r
    e = tl.where(lower, tl.exp(tl.where(lower, g - _rows(g_ptr, j_rows, hv, cols, HV, K), 0.0)),
                 0.0)
    kj = _rows(k_ptr, j_rows, hv, cols, HV, K) * e
    p_band += tl.where(band_col == r, tl.sum(q * kj, axis=1)[:, None], 0.0)
    l_band += tl.where(band_col == r, tl.sum(kt * kj, axis=1)[:, None], 0.0)
  return p_acc, l_acc, p_band, l_band


@triton.jit
def _expand_bands(band, rc, SUBC: tl.constexpr):
  """[C, SUBC] band entries (i, r) as the [C, C] matrix with (i, 16⌊i/16⌋ + r), zero outside
  the diagonal blocks: a product with the 0/1 matrix S[r, j] = (j mod 16 = r) in float32 on
  the CUDA cores ("ieee": x·1 + 0 + … is exact), then the block mask."""
  sel = ((rc[None, :] % SUBC) == tl.arange(0, SUBC)[:, None]).to(tl.float32)
  spread = tl.dot(band, sel, input_precision="ieee")
  return tl.where((rc[:, None] // SUBC) == (rc[None, :] // SUBC), spread, 0.0)


@triton.jit
def _boundary_factors(gsum, g_last, cont, keep, cont_last, PACKED: tl.constexpr):
  """A channel slice's entry factor e^G (rows that see the entry state), exit factor
  e^{G_C − G} (rows that reach the exit state) and the chunk decay e^{G_C}; gsum the slice of
  G, g_last its last row. Packed: zero where the row's segment began after the chunk's first
  row (entry, and the chunk decay if the last row's did) or ends before its last (exit)."""
  entry = tl.exp(gsum)
  exit_ = tl.exp(g_last[None, :] - gsum)
  gc = tl.exp(g_last)
  if PACKED:
    entry = entry * cont
    exit_ = exit_ * keep
    gc = gc * cont_last
  return entry, exit_, gc


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, kt_ptr, vt_ptr, g_ptr, seg_ptr, cont_ptr, keep_ptr, erase_ptr,
                write_ptr, t,
                ny_ptr, qg_ptr, p_ptr, u_ptr, kg_ptr, gc_ptr, m_ptr,
                HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                SUBC: tl.constexpr, BK: tl.constexpr, PACKED: tl.constexpr,
                WITH_INVERSE: tl.constexpr, PREC: tl.constexpr, BAND_STAGES: tl.constexpr,
                SBK: tl.constexpr, SKIP: tl.constexpr, SPAN: tl.constexpr,
                ERASE: tl.constexpr, WRITE: tl.constexpr, QS: tl.constexpr,
                SLICE_STAGES: tl.constexpr, SOLVE_LOOP: tl.constexpr):
  tl.static_assert((K % BK == 0) and (V % BK == 0) and (K % SBK == 0) and (V % SBK == 0))
  hv, row0, rows, rc, chunk = _chunk_index(t, HV, C)
  rb = tl.arange(0, BK)
  ii = rc[:, None]
  jj = rc[None, :]
  cc = chunk * C * C + ii * C + jj
  last = (row0 + C - 1) * HV + hv                              # the chunk's last row, head hv
  cont = 1.0                                                  # read only when PACKED
  keep = 1.0
  cont_last = 1.0
  if PACKED:
    cont = tl.load(cont_ptr + rows)[:, None]
    keep = tl.load(keep_ptr + rows)[:, None]
    cont_last = tl.load(cont_ptr + row0 + C - 1)
  # P and L over the channel slices; QG, KG and gc need no M, so they are stored on the way.
  p_acc = tl.zeros((C, C), tl.float32)
  l_acc = tl.zeros((C, C), tl.float32)
  p_band = tl.zeros((C, SUBC), tl.float32)
  l_band = tl.zeros((C, SUBC), tl.float32)
  for s in tl.range(K // BK, num_stages=SLICE_STAGES):
    cols = s * BK + rb
    q, k, kt, g = _slice_operands(q_ptr, k_ptr, kt_ptr, g_ptr, rows, hv, cols, HV, K,
                                  erase_ptr, ERASE, QS)
    p_acc, l_acc, p_band, l_band = _pairs_slice(q, k, kt, g, k_ptr, g_ptr, row0, hv, rc, cols,
                                                p_acc, l_acc, p_band, l_band, HV, K, C, SUBC,
                                                BAND_STAGES, SKIP, SPAN)
    entry, exit_, gc = _boundary_factors(g, tl.load(g_ptr + last * K + cols), cont, keep,
                                         cont_last, PACKED)
    ck = chunk * C * K + ii * K + cols[None, :]
    tl.store(qg_ptr + ck, (q * entry).to(tl.bfloat16))
    tl.store(kg_ptr + ck, (k * exit_).to(tl.bfloat16))
    tl.store(gc_ptr + chunk * K + cols, gc)
  p_acc += _expand_bands(p_band, rc, SUBC)
  l_acc += _expand_bands(l_band, rc, SUBC)
  keep_p, keep_l = _pair_masks(seg_ptr, rows, ii, jj, PACKED)
  tl.store(p_ptr + cc, tl.where(keep_p, p_acc, 0.0).to(tl.bfloat16))
  m = _unit_lower_inverse(tl.where(keep_l, l_acc, 0.0), ii, jj, PREC).to(tl.bfloat16)
  # NY = −M (K̃ ⊙ e^G) and U = M Ṽ, SBK columns at a time (only M is live here, so wide
  # steps). The TTGIR converts M to the product's operand layout inside each step, but in the
  # SASS (sm_90a, K = V = 128) M's bf16 operand registers are packed once, before the loops.
  rs = tl.arange(0, SBK)
  n_solve: tl.constexpr = 1 if (SKIP & 1) == 0 else 0   # blocks.PHASE_SOLVE
  # SOLVE_LOOP (`blocks.CHANNEL_SOLVES`): 0 ("fused"), NY's loop, then U's; 1 ("paired"), one
  # loop whose step loads the tiles of K̃, G and Ṽ of the same columns, then makes NY's and U's
  # blocks (`_solve_pair`): a program waits for loads half as often; 2 ("prefetched"), the
  # same with the next step's tiles loaded before this step's products, so only the first
  # step's loads are waited for. The columns one of K, V has beyond the other follow alone.
  n_paired: tl.constexpr = (min(K, V) // SBK) if SOLVE_LOOP > 0 else 0
  if SOLVE_LOOP == 2 and n_solve > 0:   # (no loads where the timing knob skips the solve)
    g_n = _raw_tile(g_ptr, rows, hv, rs, HV, K)
    kt_n = _raw_tile(kt_ptr, rows, hv, rs, HV, K)
    vt_n = _raw_tile(vt_ptr, rows, hv, rs, HV, V)
    for s in range(n_solve * n_paired):
      g, kt, vt = g_n, kt_n, vt_n
      live = s + 1 < n_paired
      nxt = (s + 1) * SBK + rs
      g_n = _raw_tile(g_ptr, rows, hv, nxt, HV, K, live)
      kt_n = _raw_tile(kt_ptr, rows, hv, nxt, HV, K, live)
      vt_n = _raw_tile(vt_ptr, rows, hv, nxt, HV, V, live)
      _solve_pair(m, g, kt, vt, erase_ptr, write_ptr, cont, rows, hv, s * SBK + rs, chunk,
                  ny_ptr, u_ptr, HV, K, V, C, PACKED, ERASE, WRITE)
  else:
    for s in range(n_solve * n_paired):
      cols = s * SBK + rs
      _solve_pair(m, _raw_tile(g_ptr, rows, hv, cols, HV, K),
                  _raw_tile(kt_ptr, rows, hv, cols, HV, K),
                  _raw_tile(vt_ptr, rows, hv, cols, HV, V), erase_ptr, write_ptr, cont, rows,
                  hv, cols, chunk, ny_ptr, u_ptr, HV, K, V, C, PACKED, ERASE, WRITE)
  for s in range(n_solve * n_paired, n_solve * K // SBK):
    _ny_block(m, kt_ptr, g_ptr, cont, rows, hv, s * SBK + rs, chunk, ny_ptr, HV, K, C, PACKED,
              erase_ptr, ERASE)
  for s in range(n_solve * n_paired, n_solve * V // SBK):
    _u_block(m, vt_ptr, rows, hv, s * SBK + rs, chunk, u_ptr, HV, V, C, write_ptr, WRITE)
  if WITH_INVERSE:
    tl.store(m_ptr + cc, m)


@triton.jit
def _solve_kernel(m_ptr, kt_ptr, vt_ptr, g_ptr, cont_ptr, erase_ptr, write_ptr, t, ny_ptr, u_ptr,
                  HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                  SB: tl.constexpr, PACKED: tl.constexpr, ERASE: tl.constexpr,
                  WRITE: tl.constexpr):
  """The forward's solve on its own (`solve="kernel"`): NY = −M (K̃ ⊙ e^G) and U = M Ṽ from
  the forward kernel's stored bf16 M, SB columns a program. Program (chunk, batch · value
  head, j): NY's column block j for j < K / SB, else U's block j − K / SB."""
  hv, _, rows, rc, chunk = _chunk_index(t, HV, C)
  j = tl.program_id(2)
  m = tl.load(m_ptr + chunk * C * C + rc[:, None] * C + rc[None, :])
  rs = tl.arange(0, SB)
  if j < K // SB:
    cont = 1.0                                                # read only when PACKED
    if PACKED:
      cont = tl.load(cont_ptr + rows)[:, None]
    _ny_block(m, kt_ptr, g_ptr, cont, rows, hv, j * SB + rs, chunk, ny_ptr, HV, K, C, PACKED,
              erase_ptr, ERASE)
  else:
    _u_block(m, vt_ptr, rows, hv, (j - K // SB) * SB + rs, chunk, u_ptr, HV, V, C, write_ptr,
             WRITE)


@triton.jit
def _elementwise_grads(q, k, kt, gsum, d_q, d_kt, d_k, d_r, d_qg, d_kg, d_gc, g_last, cont,
                       keep, cont_last, ii, C: tl.constexpr, PACKED: tl.constexpr):
  """One channel slice's whole gradients (dq, dk, dk̃, dg) from its pair and solve parts (d_q,
  d_kt, d_k: through P and L; d_r: through the solve's R = K̃ ⊙ e^G) and the cotangents of
  QG = Q ⊙ e^G, KG = K ⊙ e^{G_C − G} and gc = e^{G_C}; gsum is G's slice, g_last its last row
  G_C, dg the gradient of the log gate g itself. The pairs depend on G only through A ⊙ e^G
  and K ⊙ e^{−G}, so they give dG as Q ⊙ dQ + K̃ ⊙ dK̃ − K ⊙ dK; G = cumsum(g) within the
  chunk, so dg is dG's reverse cumsum (`gpu_prepare.channel_grads` is the same in XLA)."""
  entry, exit_, gc = _boundary_factors(gsum, g_last, cont, keep, cont_last, PACKED)
  d_exit = exit_ * k * d_kg
  d_big_g = q * d_q + kt * d_kt - k * d_k + entry * (q * d_qg + kt * d_r) - d_exit
  last_row = tl.sum(d_exit, axis=0) + gc * d_gc                 # G_C's own terms
  d_big_g += tl.where(ii == C - 1, last_row[None, :], 0.0)
  d_g = tl.cumsum(d_big_g, axis=0, reverse=True)
  return d_q + entry * d_qg, d_k + exit_ * d_kg, d_kt + entry * d_r, d_g


@triton.jit
def _anchored_grads(q, k, kt, g, g_ptr, row0, hv, rc, cols, blk, w_p, w_l, d_q, d_kt, d_k,
                    HV: tl.constexpr, K: tl.constexpr, SUBC: tl.constexpr,
                    THROUGH: tl.constexpr):
  """Sub-chunk blk's anchored share of the pairs' cotangents on one channel slice (columns
  before its first row, or through its own rows with THROUGH: `_anchored_factors`)."""
  in_p, cols_before, row_f, col_f = _anchored_factors(g, g_ptr, row0, hv, rc, cols, blk, HV, K,
                                                      SUBC, THROUGH)
  block = in_p & cols_before                               # rows of p, its columns
  wp = tl.where(block, w_p, tl.zeros_like(w_p))
  wl = tl.where(block, w_l, tl.zeros_like(w_l))
  kc = (k * col_f).to(tl.bfloat16)
  d_q += row_f * tl.dot(wp, kc)
  d_kt += row_f * tl.dot(wl, kc)
  back = tl.dot(tl.trans(wp), (q * row_f).to(tl.bfloat16))
  back = tl.dot(tl.trans(wl), (kt * row_f).to(tl.bfloat16), back)
  d_k += col_f * back
  return d_q, d_kt, d_k


@triton.jit
def _exact_grads(q, k, kt, g, q_ptr, k_ptr, kt_ptr, g_ptr, seg_ptr, dp_ptr, wl_ptr, erase_ptr,
                 ERASE: tl.constexpr, QS: tl.constexpr, seg, row0,
                 hv, rc, base, cc0, cols, w_p, w_l, d_q, d_kt, d_k, HV: tl.constexpr,
                 K: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr, PACKED: tl.constexpr,
                 BAND_STAGES: tl.constexpr, SKIP: tl.constexpr):
  """The pairs' cotangents on one channel slice with exact float32 diagonal blocks: the bands,
  then the anchored off-diagonal sub-chunks."""
  # Diagonal blocks, exact float32, band r: this row x and b = 16⌊x/16⌋ + r of its sub-chunk.
  # As i (dQ, dK̃): W_xb K_b E_xb, b ≤ x; as j (dK): W_bx A_b E_bx, b ≥ x. A run-time loop,
  # pipelined as in the forward. First, in tiles of the operands' layout: added to the
  # products' accumulators, each band cost three layout conversions through shared memory.
  for r in tl.range(SUBC if (SKIP & 4) == 0 else 0, num_stages=BAND_STAGES):
    b = base + r
    b_rows = row0 + b
    up = r <= rc - base                                       # b ≤ x
    down = r >= rc - base                                     # b ≥ x
    g_b = _rows(g_ptr, b_rows, hv, cols, HV, K)
    e = tl.exp(tl.where(up[:, None], g - g_b, g_b - g))       # ≤ 0 either way
    keep_r = up
    keep_c = down
    if PACKED:
      same = seg == tl.load(seg_ptr + b_rows)
      keep_r = keep_r & same
      keep_c = keep_c & same
    w_pr = tl.where(keep_r, tl.load(dp_ptr + cc0 + rc * C + b).to(tl.float32), 0.0)
    w_lr = tl.load(wl_ptr + cc0 + rc * C + b)                # W_l as stored: masked
    w_pc = tl.where(keep_c, tl.load(dp_ptr + cc0 + b * C + rc).to(tl.float32), 0.0)
    w_lc = tl.load(wl_ptr + cc0 + b * C + rc)
    kb = _rows(k_ptr, b_rows, hv, cols, HV, K) * tl.where(up[:, None], e, 0.0)
    d_q += w_pr[:, None] * kb
    d_kt += w_lr[:, None] * kb
    d_k += tl.where(down[:, None], e, 0.0) * (
        w_pc[:, None] * _scaled_q(q_ptr, b_rows, hv, cols, HV, K, QS)
        + w_lc[:, None] * _gated_rows(kt_ptr, erase_ptr, b_rows, hv, cols, HV, K, ERASE))
  # Off-diagonal pairs, anchored as in the forward.
  for blk in tl.static_range(1, C // SUBC if (SKIP & 2) == 0 else 1):
    d_q, d_kt, d_k = _anchored_grads(q, k, kt, g, g_ptr, row0, hv, rc, cols, blk, w_p, w_l,
                                     d_q, d_kt, d_k, HV, K, SUBC, False)
  return d_q, d_kt, d_k


@triton.jit
def _slice_grads(q_ptr, k_ptr, kt_ptr, g_ptr, seg_ptr, dp_src, wl_ptr, erase_ptr, drk_ptr,
                 dqg_src, dkg_src, dgc_src, dg_ptr, dera_ptr, dq_ptr, dkt_ptr, dk_ptr, rows,
                 row0, hv, rc, ii, base, cc0, chunk, row_major, cols, cont, keep,
                 cont_last, w_p, w_l, d_erase_rows, bounded, HV: tl.constexpr,
                 K: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr, BK: tl.constexpr,
                 PACKED: tl.constexpr, GRADS: tl.constexpr, BAND_STAGES: tl.constexpr,
                 SKIP: tl.constexpr, ERASE: tl.constexpr, QS: tl.constexpr,
                 PATHS: tl.constexpr):
  """One channel slice of the backward's pair part, then, with GRADS, its elementwise rest
  (`_elementwise_grads`); stores dq, dk (dk̃, dg) of the slice and returns d_erase_rows with
  the slice's share added (ERASE == GATE_ROW). The pair part's path: PATHS_BOUNDED, the four
  anchored blocks through their own rows; PATHS_EXACT, the exact bands and three anchored
  blocks; PATHS_BOTH, whichever the run-time `bounded` says."""
  q, k, kt, g = _slice_operands(q_ptr, k_ptr, kt_ptr, g_ptr, rows, hv, cols, HV, K,
                                erase_ptr, ERASE, QS)
  d_q = tl.zeros((C, BK), tl.float32)
  d_kt = tl.zeros((C, BK), tl.float32)
  d_k = tl.zeros((C, BK), tl.float32)
  if PATHS == PATHS_BOTH:
    take_bounded = bounded
  else:
    take_bounded = PATHS == PATHS_BOUNDED
  if take_bounded:
    for blk in tl.static_range(C // SUBC):
      d_q, d_kt, d_k = _anchored_grads(q, k, kt, g, g_ptr, row0, hv, rc, cols, blk, w_p, w_l,
                                       d_q, d_kt, d_k, HV, K, SUBC, True)
  else:
    seg = 0.0                             # read only when PACKED
    if PACKED:
      seg = tl.load(seg_ptr + rows)
    d_q, d_kt, d_k = _exact_grads(q, k, kt, g, q_ptr, k_ptr, kt_ptr, g_ptr, seg_ptr, dp_src,
                                  wl_ptr, erase_ptr, ERASE, QS, seg, row0, hv, rc, base, cc0,
                                  cols, w_p, w_l, d_q, d_kt, d_k, HV, K, C, SUBC, PACKED,
                                  BAND_STAGES, SKIP)
  ck = chunk * C * K + ii * K + cols[None, :]
  if GRADS:
    g_last = tl.load(g_ptr + ((row0 + C - 1) * HV + hv) * K + cols)
    d_qg = tl.load(dqg_src + ck).to(tl.float32)
    d_kg = tl.load(dkg_src + ck).to(tl.float32)
    d_gc = tl.load(dgc_src + chunk * K + cols)
    d_q, d_k, d_kt, d_g = _elementwise_grads(
        q, k, kt, g, d_q, d_kt, d_k, tl.load(drk_ptr + ck), d_qg, d_kg, d_gc, g_last,
        cont, keep, cont_last, ii, C, PACKED)
    ck = row_major * K + cols[None, :]
    tl.store(dg_ptr + ck, d_g)
    if ERASE != GATE_NONE:   # k̃ = k ⊙ erase: k's whole gradient, and the gate's
      d_k += d_kt * _gate(erase_ptr, rows, hv, cols, HV, K, ERASE)
      if ERASE == GATE_ROW:
        d_erase_rows += tl.sum(d_kt * k, axis=1)
      else:
        tl.store(dera_ptr + ck, d_kt * k)
  d_q = d_q * QS if QS != 1.0 else d_q                    # q's own gradient
  tl.store(dq_ptr + ck, d_q.to(dq_ptr.dtype.element_ty))
  if ERASE == GATE_NONE:
    tl.store(dkt_ptr + ck, d_kt)
  tl.store(dk_ptr + ck, d_k.to(dk_ptr.dtype.element_ty))
  return d_erase_rows


@triton.jit
def _solve_grads_k(cols, m, mt, neg_dl, kt_ptr, g_ptr, cont, rows, hv, ii, chunk, dny_src,
                   drk_ptr, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                   PACKED: tl.constexpr, erase_ptr, ERASE: tl.constexpr):
  """One K slice of the solve's backward: Y = M R_k, dR_k = Mᵀ dY (stored); returns −dL plus
  dR_k Yᵀ."""
  y = _solve_slice(m, kt_ptr, g_ptr, cont, rows, hv, cols, HV, K, PACKED, erase_ptr, ERASE)
  ck = chunk * C * K + ii * K + cols[None, :]
  d_y = (-tl.load(dny_src + ck).to(tl.float32)).to(tl.bfloat16)
  d_rk = tl.dot(mt, d_y)
  tl.store(drk_ptr + ck, d_rk)
  return tl.dot(d_rk.to(tl.bfloat16), tl.trans(y.to(tl.bfloat16)), neg_dl)


@triton.jit
def _solve_grads_v(cols, m, mt, neg_dl, d_write_rows, vt_ptr, write_ptr, rows, hv, ii,
                   row_major, chunk, du_ptr, dvt_ptr, dwri_ptr, HV: tl.constexpr,
                   V: tl.constexpr, C: tl.constexpr, GRADS: tl.constexpr, WRITE: tl.constexpr):
  """One V slice of the solve's backward: U = M Ṽ, dR_v = Mᵀ dU (stored: dṽ, or with GRADS dv
  and the write gate's share); returns −dL plus dR_v Uᵀ, and the row gate's Σ_v dṽ ⊙ v."""
  v_in = _rows(vt_ptr, rows, hv, cols, HV, V)
  w_gate = 1.0
  if WRITE != GATE_NONE:
    w_gate = _gate(write_ptr, rows, hv, cols, HV, V, WRITE)
  u = tl.dot(m, (v_in * w_gate).to(tl.bfloat16))
  cv = chunk * C * V + ii * V + cols[None, :]
  d_rv = tl.dot(mt, tl.load(du_ptr + cv).to(tl.bfloat16))
  if GRADS:
    tl.store(dvt_ptr + row_major * V + cols[None, :],                  # ṽ = v ⊙ write
             (d_rv * w_gate).to(dvt_ptr.dtype.element_ty))
    if WRITE == GATE_ROW:
      d_write_rows += tl.sum(d_rv * v_in, axis=1)
    elif WRITE == GATE_CHANNEL:
      tl.store(dwri_ptr + row_major * V + cols[None, :], d_rv * v_in)
  else:
    tl.store(dvt_ptr + cv, d_rv)
  return tl.dot(d_rv.to(tl.bfloat16), tl.trans(u.to(tl.bfloat16)), neg_dl), d_write_rows


@triton.jit
def _bwd_kernel(q_ptr, k_ptr, kt_ptr, vt_ptr, g_ptr, seg_ptr, cont_ptr, keep_ptr, m_ptr,
                dny_ptr, dqg_ptr, dp_ptr, du_ptr, dkg_ptr, dgc_ptr, h_ptr, dh_ptr, do_ptr,
                e_ptr, erase_ptr, write_ptr, t,
                dq_ptr, dkt_ptr, dk_ptr, drk_ptr, dvt_ptr, wl_ptr, dg_ptr, dps_ptr, dera_ptr,
                dwri_ptr, sny_ptr, sqg_ptr, skg_ptr, sgc_ptr,
                HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                SUBC: tl.constexpr, BK: tl.constexpr, PACKED: tl.constexpr,
                GRADS: tl.constexpr, BAND_STAGES: tl.constexpr, SBK: tl.constexpr,
                SKIP: tl.constexpr, SPAN: tl.constexpr, PRODUCTS: tl.constexpr,
                DO_ROWS: tl.constexpr, ERASE: tl.constexpr, WRITE: tl.constexpr,
                QS: tl.constexpr):
  """The pair and solve part of the backward; with GRADS also the elementwise rest and dG
  (`_elementwise_grads`), storing whole gradients in the inputs' `[B, T, HV, D]` layout;
  without, the pair and solve parts chunk-major and the rest is the caller's (XLA).

  PRODUCTS (with GRADS): the state pass's cotangents of NY, QG, P, KG and gc are not read
  (dny, dqg, dp, dkg, dgc unread) but made here from the chunk states: dNY = dE Sᵀ, dQG = dO Sᵀ,
  dP = dO Eᵀ, dKG = E dS'ᵀ, dgc = Σ_v S ⊙ dS' (h, dh `[B, HV, Nc, K, V]` bf16; dO bf16, E and
  dE = du float32 or bf16 `[B, HV, Nc, C, V]`; dO in `[B, T, HV, V]` with DO_ROWS), each
  rounded to bf16 as the products kernel delivers them (`state_pass.chunk_products`, the same
  code). They are made first, in a prologue whose live tiles end before the body's begin, into
  the scratches dps, sny, sqg, skg, sgc, which the body then reads as it reads the given
  cotangents (from L2: this program wrote them). Making each inside the loop that uses it held
  it beside that loop's accumulators, at 255 registers (1.6 ms slower, BENCHMARKS eighteenth
  stage). (du is read as a bf16 operand everywhere, so a bf16 dE gives the same results.)

  ERASE / WRITE (`GATE_*`, with GRADS): kt, vt are k and v, multiplied on chip by the gates
  erase, write; then dk (dk_ptr) is k's whole gradient, dv (dvt_ptr) v's, and the gates'
  gradients go to dera / dwri (`[B, T, HV]` row sums, or per channel); dkt is not written."""
  tl.static_assert((K % BK == 0) and (V % BK == 0) and (K % SBK == 0) and (V % SBK == 0))
  tl.static_assert(GRADS or (ERASE == GATE_NONE and WRITE == GATE_NONE))
  hv, row0, rows, rc, chunk = _chunk_index(t, HV, C)
  rb = tl.arange(0, BK)
  ii = rc[:, None]
  jj = rc[None, :]
  cc0 = chunk * C * C
  cc = cc0 + ii * C + jj
  row_major = (rows * HV + hv)[:, None]                        # [B, T, HV, D] rows of this chunk
  cont = 1.0                                                  # read only when PACKED
  keep = 1.0
  cont_last = 1.0
  if PACKED:
    cont = tl.load(cont_ptr + rows)[:, None]
    if GRADS:
      keep = tl.load(keep_ptr + rows)[:, None]
      cont_last = tl.load(cont_ptr + row0 + C - 1)
  rs = tl.arange(0, SBK)
  if PRODUCTS:   # the five products first, into the scratches the body reads back
    cv_rows = chunk * C * V + rc * V                           # [C, V] chunk tiles' rows
    do_rows = cv_rows
    if DO_ROWS:   # dO in the op's layout
      do_rows = (rows * HV + hv) * V
    chunk_products(du_ptr, do_ptr, e_ptr, h_ptr, dh_ptr, cv_rows, do_rows, chunk, sny_ptr,
                   sqg_ptr, dps_ptr, skg_ptr, sgc_ptr, C, K, V, SBK)
    tl.debug_barrier()   # (this program's stores, then its loads)
    dny_src, dqg_src, dp_src, dkg_src, dgc_src = sny_ptr, sqg_ptr, dps_ptr, skg_ptr, sgc_ptr
  else:
    dny_src, dqg_src, dp_src, dkg_src, dgc_src = dny_ptr, dqg_ptr, dp_ptr, dkg_ptr, dgc_ptr
  # The solve: Y = M R_k, U = M Ṽ (the forward's bf16 M); dR = Mᵀ [dY | dU], dL = −dR [Y | U]ᵀ,
  # accumulated over the K slices, then the V slices.
  m = tl.load(m_ptr + cc)
  mt = tl.trans(m)
  neg_dl = tl.zeros((C, C), tl.float32)
  n_solve: tl.constexpr = 1 if (SKIP & 1) == 0 else 0   # blocks.PHASE_SOLVE
  d_write_rows = tl.zeros((C,), tl.float32)                  # WRITE == GATE_ROW: Σ_v dṽ ⊙ v
  # Unrolled (static_range) unless the write gate is per channel: on an H100 (2026-12-07,
  # B4 T4096 H16, fwd+bwd) unrolled loops took KDA's op 3.546 -> 3.505 ms at K = 128 (3.34 ->
  # 3.32 at 64) but GDN-2's 3.90 -> 3.92 (3.68 -> 3.71). ptxas: KDA's spills 364 / 408 -> 276 / 292.
  UNROLL: tl.constexpr = WRITE != GATE_CHANNEL
  if UNROLL:
    for s in tl.static_range(n_solve * K // SBK):
      neg_dl = _solve_grads_k(s * SBK + rs, m, mt, neg_dl, kt_ptr, g_ptr, cont, rows, hv, ii,
                              chunk, dny_src, drk_ptr, HV, K, C, PACKED, erase_ptr, ERASE)
    for s in tl.static_range(n_solve * V // SBK):
      neg_dl, d_write_rows = _solve_grads_v(
          s * SBK + rs, m, mt, neg_dl, d_write_rows, vt_ptr, write_ptr, rows, hv, ii, row_major,
          chunk, du_ptr, dvt_ptr, dwri_ptr, HV, V, C, GRADS, WRITE)
  else:
    for s in range(n_solve * K // SBK):
      neg_dl = _solve_grads_k(s * SBK + rs, m, mt, neg_dl, kt_ptr, g_ptr, cont, rows, hv, ii,
                              chunk, dny_src, drk_ptr, HV, K, C, PACKED, erase_ptr, ERASE)
    for s in range(n_solve * V // SBK):
      neg_dl, d_write_rows = _solve_grads_v(
          s * SBK + rs, m, mt, neg_dl, d_write_rows, vt_ptr, write_ptr, rows, hv, ii, row_major,
          chunk, du_ptr, dvt_ptr, dwri_ptr, HV, V, C, GRADS, WRITE)
  if WRITE == GATE_ROW:
    tl.store(dwri_ptr + rows * HV + hv, d_write_rows)
  keep_p, keep_l = _pair_masks(seg_ptr, rows, ii, jj, PACKED)
  w_l = tl.where(keep_l, -neg_dl, 0.0)
  tl.store(wl_ptr + cc, w_l)            # the diagonal bands read their entries back
  w_l = w_l.to(tl.bfloat16)
  w_p = tl.where(keep_p, tl.load(dp_src + cc).to(tl.float32), 0.0).to(tl.bfloat16)
  tl.debug_barrier()                    # the scratches above (dL, dR_k, dP), then their loads
  base = (rc // SUBC) * SUBC
  d_erase_rows = tl.zeros((C,), tl.float32)                  # ERASE == GATE_ROW: Σ_k dk̃ ⊙ k
  # Unpacked, the slices go in two loops, the bounded-span ones first, then the exact ones: the
  # same work, but each loop holds one path's registers. ptxas sm_90a, K = V = 128, KDA's gates:
  # the paths alone spill 48 and 124 bytes, both behind a branch in one loop 472 / 672 bytes
  # (stores / loads), two loops 364 / 408. Packed rows keep the one loop (732 / 852 in two
  # loops against 524 / 740).
  SPLIT: tl.constexpr = SPAN > 0 and not PACKED
  for part in tl.static_range(2 if SPLIT else 1):   # split: 0 the bounded-span slices, 1 the rest
    for s in range(K // BK):
      cols = s * BK + rb
      bounded = False
      if SPAN > 0:   # the bounded-span path (`blocks.CHANNEL_SPAN`): no bands, four anchored blocks
        bounded = _slice_bounded(g_ptr, row0, hv, cols, HV, K, C, SUBC, SPAN)
      paths: tl.constexpr = ((PATHS_BOUNDED if part == 0 else PATHS_EXACT) if SPLIT else
                             PATHS_BOTH if SPAN > 0 else PATHS_EXACT)
      take = True
      if SPLIT:
        take = bounded if part == 0 else not bounded
      if take:
        d_erase_rows = _slice_grads(
            q_ptr, k_ptr, kt_ptr, g_ptr, seg_ptr, dp_src, wl_ptr, erase_ptr, drk_ptr, dqg_src,
            dkg_src, dgc_src, dg_ptr, dera_ptr, dq_ptr, dkt_ptr, dk_ptr, rows, row0, hv, rc, ii,
            base, cc0, chunk, row_major, cols, cont, keep, cont_last, w_p, w_l, d_erase_rows,
            bounded, HV, K, C, SUBC, BK, PACKED, GRADS, BAND_STAGES, SKIP, ERASE, QS, paths)
  if ERASE == GATE_ROW:
    tl.store(dera_ptr + rows * HV + hv, d_erase_rows)


@triton.jit
def _chunk_gates_kernel(g_ptr, t, out_ptr, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                        BK: tl.constexpr):
  """G: one chunk's log gates summed over its rows, column slice by column slice."""
  hv, _, rows, _, _ = _chunk_index(t, HV, C)
  rb = tl.arange(0, BK)
  for s in tl.static_range(K // BK):
    at = (rows * HV + hv)[:, None] * K + (s * BK + rb)[None, :]
    tl.store(out_ptr + at, tl.cumsum(tl.load(g_ptr + at).to(tl.float32), axis=0))


@functools.partial(jax.jit, static_argnames=("chunk",))
def chunk_gates(g, *, chunk: int):
  """The kernels' G: per-channel log gates `[B, T, HV, K]` (any float dtype) summed within each
  chunk of `chunk` rows, float32. One read and one write of g; XLA's cumsum (a reduce-window in
  two levels) took ~200 µs for the ~60 µs this costs at B4 T4096 H16 K128 on the H200."""
  b, t, hv, dk = g.shape
  if t % chunk:
    raise ValueError(f"chunk_gates: T={t} is not a multiple of chunk={chunk}")
  if dk % 16:
    raise ValueError(f"chunk_gates: K={dk} is not a multiple of 16")
  bk = 32 if dk % 32 == 0 else 16
  return _jax_triton().triton_call(
      g, t, kernel=_chunk_gates_kernel, out_shape=_structs(((b, t, hv, dk), jnp.float32)),
      grid=(t // chunk, b * hv), num_warps=4, num_stages=1, HV=hv, K=dk, C=chunk, BK=bk)[0]


def supported(chunk: int, dk: int, dv: int) -> str | None:
  """None if these kernels take the sizes (C = 64; K, V multiples of the slice), else why."""
  return blocks.intra_supported("channel-gate", chunk, dk, dv)


@functools.partial(jax.jit, static_argnames=("chunk", "with_inverse", "precision", "num_warps",
                                             "band_stages", "skip_phases", "span", "q_scale",
                                             "slice_stages", "solve"))
def channel_intra_fwd(q, k, kt, vt, G, segments=None, *, chunk: int, with_inverse=False,
                      precision: str = blocks.INTRA_PRECISION,
                      num_warps: int = blocks.CHANNEL_WARPS,
                      band_stages: int = blocks.CHANNEL_BAND_STAGES, skip_phases: int = 0,
                      span: float = blocks.CHANNEL_SPAN, erase=None, write=None,
                      q_scale: float = 1.0,
                      slice_stages: int = blocks.CHANNEL_SLICE_STAGES,
                      solve: str = blocks.CHANNEL_SOLVE):
  """The intra-chunk part for per-channel gates (module docstring).

  q, k, kt, vt: `[B, T, HV, K]` (vt `[B, T, HV, V]`), the scaled queries, keys, erase keys and
  write values as the XLA preparation has them (any float dtype; read as float32); G `[B, T,
  HV, K]` float32, the log gates summed within each chunk; segments: None or (seg, cont, keep)
  `[B, T]` float32 (`gpu_chunks.kernel_segments`). T a multiple of `chunk`.
  Returns (ny, qg, p, u, kg, gc) as `gpu_prepare.prepare_chunks` (ny, qg, kg `[B, HV, Nc, C, K]`
  bf16, p `[B, HV, Nc, C, C]` bf16, u `[B, HV, Nc, C, V]` float32, gc `[B, HV, Nc, K]` float32),
  and M `[B, HV, Nc, C, C]` bf16 after them if `with_inverse`. skip_phases: for timing only,
  phases left out (a sum of `blocks.PHASE_*`; the results are then wrong). span: the bounded-span
  path's bound in nats (`blocks.CHANNEL_SPAN`; 0 = exact diagonal blocks everywhere).
  erase, write: None, or gates that multiply kt and vt on chip, one factor per row (`[B, T,
  HV]`) or per channel (kt's / vt's shape): pass k and v as kt and vt, and k̃ = k ⊙ erase,
  ṽ = v ⊙ write are never written to memory. q_scale: q is multiplied by it on chip (1: q
  comes scaled). slice_stages: software-pipelining depth of the channel-slice loop
  (`blocks.CHANNEL_SLICE_STAGES`). solve (`blocks.CHANNEL_SOLVES`): "fused", NY and U made at
  the end of the forward kernel's programs, NY's column blocks, then U's; "paired", the same,
  each step making NY's and U's blocks of the same columns; "prefetched", "paired" with the
  next step's tiles loaded before this step's products; "kernel", the forward kernel stops
  after M and a second kernel (`_solve_kernel`, one program per chunk and 64-column block)
  makes them from it. The same operands and products every way.
  """
  reason = supported(chunk, q.shape[-1], vt.shape[-1])
  if reason:
    raise ValueError(f"channel_intra_fwd: {reason}")
  if slice_stages not in (1, 2, 3):
    raise ValueError(f"channel_intra_fwd: slice_stages={slice_stages} must be 1, 2 or 3")
  if solve not in blocks.CHANNEL_SOLVES:
    raise ValueError(f"channel_intra_fwd: solve={solve!r} must be one of "
                     f"{blocks.CHANNEL_SOLVES}")
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
  erase_kind, erase = _gate_input(erase, kt, "erase")
  write_kind, write = _gate_input(write, vt, "write")
  split = solve == "kernel"
  keep_m = with_inverse or split
  by_kernel = split and not skip_phases & blocks.PHASE_SOLVE   # the solve kernel makes NY, U
  # (then the forward kernel writes none: placeholders)
  out_shape = _structs(((1,) if by_kernel else (b, hv, nc, c, dk), MM_DTYPE),
                       ((b, hv, nc, c, dk), MM_DTYPE), ((b, hv, nc, c, c), MM_DTYPE),
                       ((1,) if by_kernel else (b, hv, nc, c, dv), f32),
                       ((b, hv, nc, c, dk), MM_DTYPE), ((b, hv, nc, dk), f32),
                       ((b, hv, nc, c, c) if keep_m else (1,), MM_DTYPE))
  skip = _phases(skip_phases) | (blocks.PHASE_SOLVE if split else 0)
  sbk = blocks.solve_bk(dk, dv)
  operands = (*map(_operand, (q, k, kt, vt)), G.astype(f32), *seg, _operand(erase),
              _operand(write))
  ny, qg, p, u, kg, gc, m = _jax_triton().triton_call(
      *operands, t, kernel=_fwd_kernel, out_shape=out_shape, grid=(nc, b * hv),
      num_warps=num_warps, num_stages=1, HV=hv, K=dk, V=dv, C=c, SUBC=SUB, BK=blocks.CHANNEL_BK,
      PACKED=packed, WITH_INVERSE=keep_m, PREC=precision, BAND_STAGES=band_stages, SBK=sbk,
      SKIP=skip, SPAN=_span(span), ERASE=erase_kind, WRITE=write_kind, QS=float(q_scale),
      SLICE_STAGES=int(slice_stages), SOLVE_LOOP=blocks.CHANNEL_SOLVE_LOOPS.get(solve, 0))
  if by_kernel:
    _, _, kt_in, vt_in, g_in, _, cont, _, erase_in, write_in = operands
    ny, u = _jax_triton().triton_call(
        m, kt_in, vt_in, g_in, cont, erase_in, write_in, t, kernel=_solve_kernel,
        out_shape=_structs(((b, hv, nc, c, dk), MM_DTYPE), ((b, hv, nc, c, dv), f32)),
        grid=(nc, b * hv, dk // sbk + dv // sbk), num_warps=blocks.CHANNEL_WARPS, num_stages=1,
        HV=hv, K=dk, V=dv, C=c, SB=sbk, PACKED=packed, ERASE=erase_kind, WRITE=write_kind)
  outs = (ny, qg, p, u, kg, gc)
  return outs + (m,) if with_inverse else outs


def _gate_input(gate, x, name):
  """(kind, array) of an on-chip gate for x `[B, T, HV, D]`: None -> GATE_NONE (a placeholder
  the kernel does not read: x itself); `[B, T, HV]` or `[B, T, HV, 1]` -> GATE_ROW; `[B, T, HV,
  D]` -> GATE_CHANNEL."""
  if gate is None:
    return int(GATE_NONE.value), x
  if gate.shape == x.shape[:3] or gate.shape == x.shape[:3] + (1,):
    return int(GATE_ROW.value), gate.reshape(x.shape[:3])
  if gate.shape == x.shape:
    return int(GATE_CHANNEL.value), gate
  raise ValueError(f"{name} of shape {gate.shape} fits neither one factor per row "
                   f"{x.shape[:3]} nor one per channel {x.shape}")


GRAD_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def check_grad_dtypes(grad_dtypes):
  """(dq, dk, dvt)'s dtypes for the fused backward (None: all float32); each in
  `GRAD_DTYPES`, else ValueError."""
  if grad_dtypes is None:
    return (jnp.dtype(jnp.float32),) * 3
  dtypes = tuple(jnp.dtype(d) for d in grad_dtypes)
  if len(dtypes) != 3 or any(d not in GRAD_DTYPES for d in dtypes):
    raise ValueError(f"channel_intra: grad_dtypes={grad_dtypes!r} must be three of "
                     f"{', '.join(map(str, GRAD_DTYPES))} (dq, dk, dv).")
  return dtypes


def _operand(x):
  """q, k, k̃, ṽ as the kernels read them: bf16 and float32 as they are (every load widens to
  float32 on chip, exactly), anything else as float32. Widening bf16 inputs in XLA first cost a
  float32 copy of each in HBM, written, then read by every launch."""
  return x if x.dtype in (jnp.bfloat16, jnp.float32) else x.astype(jnp.float32)


def _span(span) -> float:
  if not 0.0 <= float(span) <= 80.0:
    raise ValueError(f"span={span!r}: expected 0 (off) or a bound in (0, 80] nats (e^80 is "
                     f"the largest anchor factor the bounded path lets through)")
  return float(span)


def _phases(skip: int) -> int:
  every = blocks.PHASE_SOLVE | blocks.PHASE_ANCHORED | blocks.PHASE_BANDS
  if not isinstance(skip, int) or skip & ~every:
    raise ValueError(f"skip_phases={skip!r}: expected a sum of blocks.PHASE_* (0 to {every})")
  return skip


def _bf16_or_f32(x):
  """x as it is where bf16 or float32 (the kernel reads either: E and dE are bf16 operands
  wherever they are used, so a bf16 copy needs no widening pass), else widened to float32."""
  return x if x.dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)) else x.astype(
      jnp.float32)


def _bwd_call(q, k, kt, vt, G, segments, m, dny, dp, du, cotangents, *, chunk, num_warps,
              band_stages, skip_phases=0, solve_bk=None, span=0.0, states=None, erase=None,
              write=None, q_scale=1.0, grad_dtypes=None, do_rows=False):
  """The backward kernel's launch; cotangents None (the kernel half) or (dqg, dkg, dgc);
  states None, or (h, dh, do, e) for the products made in the kernel (then dny, dp and
  cotangents are not read: `channel_intra_grads_from_states`; do_rows: do in `[B, T, HV, V]`,
  else chunk-major). grad_dtypes: the dtypes of the
  whole gradients dq, dk, dvt (`GRAD_DTYPES`; None: float32), each rounded once on chip."""
  reason = supported(chunk, q.shape[-1], vt.shape[-1])
  if reason:
    raise ValueError(f"channel_intra_bwd: {reason}")
  b, t, hv, dk = q.shape
  dv = vt.shape[-1]
  nc, c = t // chunk, chunk
  f32 = jnp.float32
  packed = segments is not None
  grads = cotangents is not None or states is not None
  products = states is not None
  seg = tuple(x.astype(f32) for x in segments) if packed else (G,) * 3   # unread unless packed
  # Unread placeholders where the kernel half runs alone, or where the products are made here.
  if cotangents is not None:
    dqg, dkg, dgc = (cotangents[0].astype(MM_DTYPE), cotangents[1].astype(MM_DTYPE),
                     cotangents[2].astype(f32))
  else:
    dqg, dkg, dgc = m, m, G
  h, dh, do, e = ((states[0].astype(MM_DTYPE), states[1].astype(MM_DTYPE),
                   states[2].astype(MM_DTYPE), _bf16_or_f32(states[3])) if products
                  else (m, m, m, G))
  dny = m if products else dny.astype(MM_DTYPE)
  dp = m if products else dp.astype(MM_DTYPE)
  if products:
    want = (b, t, hv, dv) if do_rows else (b, hv, nc, c, dv)
    if tuple(do.shape) != want:
      raise ValueError(f"channel_intra_grads_from_states: do {tuple(do.shape)} must be {want} "
                       f"(do_rows={bool(do_rows)}).")
  # The products' scratches (made by the prologue, read back by the body), or placeholders.
  scratch = lambda shape, dtype: (shape if products else (1,), dtype)
  dps = scratch((b, hv, nc, c, c), MM_DTYPE)
  product_scratch = (scratch((b, hv, nc, c, dk), MM_DTYPE),) * 3 + (
      scratch((b, hv, nc, dk), f32),)
  erase_kind, erase = _gate_input(erase, kt, "erase")
  write_kind, write = _gate_input(write, vt, "write")
  if (erase_kind or write_kind) and not grads:
    raise ValueError("channel_intra_bwd: on-chip gates need the fused gradients")
  gate_grads = [((1,) if kind == GATE_NONE.value else gate.shape, f32)
                for kind, gate in ((erase_kind, erase), (write_kind, write))]
  if grads:   # whole gradients in the inputs' layout, dR_k a chunk-major scratch
    dkt_shape = (1,) if erase_kind else (b, t, hv, dk)   # not written with an erase gate
    dq_dt, dk_dt, dv_dt = check_grad_dtypes(grad_dtypes)
    out_shape = _structs(((b, t, hv, dk), dq_dt), (dkt_shape, f32), ((b, t, hv, dk), dk_dt),
                         ((b, hv, nc, c, dk), f32), ((b, t, hv, dv), dv_dt),
                         ((b, hv, nc, c, c), f32), ((b, t, hv, dk), f32), dps, *gate_grads,
                         *product_scratch)
  else:
    out_shape = _structs(*[((b, hv, nc, c, dk), f32)] * 4, ((b, hv, nc, c, dv), f32),
                         ((b, hv, nc, c, c), f32), ((1,), f32), dps, *gate_grads,
                         *product_scratch)
  outs = _jax_triton().triton_call(
      *map(_operand, (q, k, kt, vt)), G.astype(f32), *seg,
      m.astype(MM_DTYPE), dny, dqg, dp, _bf16_or_f32(du), dkg, dgc, h, dh, do, e,
      _operand(erase), _operand(write), t,
      kernel=_bwd_kernel, out_shape=out_shape, grid=(nc, b * hv), num_warps=num_warps,
      num_stages=1, HV=hv, K=dk, V=dv, C=c, SUBC=SUB, BK=blocks.CHANNEL_BK, PACKED=packed,
      GRADS=grads, BAND_STAGES=band_stages,
      SBK=solve_bk or blocks.channel_bwd_solve_bk(dk, dv, hopper=_on_hopper()),
      SKIP=_phases(skip_phases), SPAN=_span(span), PRODUCTS=products,
      DO_ROWS=bool(do_rows and products), ERASE=erase_kind,
      WRITE=write_kind, QS=float(q_scale))
  outs = list(outs[:7]) + [outs[8] if erase_kind else None, outs[9] if write_kind else None]
  return outs


@functools.partial(jax.jit, static_argnames=("chunk", "num_warps", "band_stages", "span"))
def channel_intra_bwd(q, k, kt, vt, G, segments, m, dny, dp, du, *, chunk: int,
                      num_warps: int = blocks.CHANNEL_WARPS,
                      band_stages: int = blocks.CHANNEL_BAND_STAGES,
                      span: float = blocks.CHANNEL_SPAN):
  """The backward of `channel_intra_fwd`'s NY, P and U through the pairs and the solve.

  Arguments as the forward's, plus its bf16 M and the cotangents dny, dp, du (chunk-major).
  Returns (dq, dkt, dk, d_rk, dvt), float32 `[B, HV, Nc, C, D]`: dq, dkt, dk the gradients
  through P and L (pair(Q), pair(K̃); dk from both), d_rk the cotangent of the solve's key
  right-hand side K̃ ⊙ e^G, dvt that of Ṽ. The elementwise terms (QG, KG, gc, the entry and exit
  factors) and dG are the caller's: `lineax_attn.ops.gpu_prepare`. span: as the forward's.
  """
  dq, dkt, dk, d_rk, dvt, *_ = _bwd_call(q, k, kt, vt, G, segments, m, dny, dp, du, None,
                                           chunk=chunk, num_warps=num_warps,
                                           band_stages=band_stages, span=span)
  return dq, dkt, dk, d_rk, dvt


@functools.partial(jax.jit, static_argnames=("chunk", "num_warps", "band_stages", "skip_phases",
                                             "solve_bk", "span"))
def channel_intra_grads(q, k, kt, vt, G, segments, m, dny, dqg, dp, du, dkg, dgc, *, chunk: int,
                        num_warps: int = blocks.CHANNEL_WARPS,
                        band_stages: int = blocks.CHANNEL_BAND_STAGES, skip_phases: int = 0,
                        solve_bk: int | None = None, span: float = blocks.CHANNEL_SPAN):
  """The whole backward of `channel_intra_fwd`'s six outputs in one kernel: what
  `channel_intra_bwd` computes plus the elementwise rest and dG (`_elementwise_grads`), which
  `gpu_prepare.channel_grads` otherwise does in XLA.

  Arguments as `channel_intra_bwd`'s plus the cotangents of QG, KG (chunk-major `[B, HV, Nc, C,
  K]`) and gc (`[B, HV, Nc, K]`); segments (seg, cont, keep) as the forward's. Returns (dq, dk,
  dkt, dvt, dg), float32 `[B, T, HV, D]`: the gradients of q, k, k̃, ṽ and of the log gate g
  whose in-chunk sums are G. skip_phases: as `channel_intra_fwd`'s (timing only); solve_bk:
  columns a step of the solve loops (None: `blocks.channel_bwd_solve_bk`'s; for benchmarks);
  span: as the forward's.
  """
  dq, dkt, dk, _, dvt, _, dg, *_ = _bwd_call(q, k, kt, vt, G, segments, m, dny, dp, du,
                                         (dqg, dkg, dgc), chunk=chunk, num_warps=num_warps,
                                         band_stages=band_stages, skip_phases=skip_phases,
                                         solve_bk=solve_bk, span=span)
  return dq, dk, dkt, dvt, dg


@functools.partial(jax.jit, static_argnames=("chunk", "num_warps", "band_stages", "solve_bk",
                                             "span", "q_scale", "grad_dtypes"))
def channel_intra_grads_gated(q, k, kt, vt, G, segments, m, dny, dqg, dp, du, dkg, dgc, *,
                              chunk: int, num_warps: int = blocks.CHANNEL_WARPS,
                              band_stages: int = blocks.CHANNEL_BAND_STAGES,
                              solve_bk: int | None = None, span: float = blocks.CHANNEL_SPAN,
                              erase=None, write=None, q_scale: float = 1.0, grad_dtypes=None):
  """`channel_intra_grads` (the state pass's cotangents given) with
  `channel_intra_grads_from_states`' gates and q scale on chip and its returns: (dq, dk, dkt,
  dvt, dg, d_erase, d_write), dkt None with an erase gate (dk is then k's whole gradient), dvt
  v's gradient with a write gate. For products made outside the kernel
  (`GpuTuning.state_products`). grad_dtypes: dq's, dk's and dvt's dtypes (None: float32),
  for the caller's bf16 inputs whose whole gradients these are."""
  dq, dkt, dk, _, dvt, _, dg, d_erase, d_write = _bwd_call(
      q, k, kt, vt, G, segments, m, dny, dp, du, (dqg, dkg, dgc), chunk=chunk,
      num_warps=num_warps, band_stages=band_stages, solve_bk=solve_bk, span=span, erase=erase,
      write=write, q_scale=q_scale, grad_dtypes=grad_dtypes)
  return dq, dk, None if erase is not None else dkt, dvt, dg, d_erase, d_write


@functools.partial(jax.jit, static_argnames=("chunk", "num_warps", "band_stages", "solve_bk",
                                             "span", "q_scale", "grad_dtypes", "do_rows"))
def channel_intra_grads_from_states(q, k, kt, vt, G, segments, m, de, do, e, h, dh, *,
                                    chunk: int, num_warps: int = blocks.CHANNEL_WARPS,
                                    band_stages: int = blocks.CHANNEL_BAND_STAGES,
                                    solve_bk: int | None = None,
                                    span: float = blocks.CHANNEL_SPAN, erase=None, write=None,
                                    q_scale: float = 1.0, grad_dtypes=None,
                                    do_rows: bool = False):
  """`channel_intra_grads` with the state pass's cotangent products made in the kernel: where
  that takes dNY, dQG, dP, dKG, dgc from XLA's batched products, this takes what they are made
  of, the state pass's E (`[B, HV, Nc, C, V]` float32), the total dE (its reverse kernel's,
  float32) and dO (bf16, chunk-major), the state entering each chunk h and the cotangent of the
  state leaving it dh (`[B, HV, Nc, K, V]` bf16), and makes dNY = dE hᵀ, dQG = dO hᵀ,
  dP = dO Eᵀ, dKG = E dhᵀ, dgc = Σ_v h ⊙ dh per chunk on chip (bf16 operands, float32
  accumulation, rounded to bf16 as the XLA products are).

  erase, write, q_scale: as `channel_intra_fwd`'s (kt, vt are then k and v; dq is then the
  gradient of the unscaled q). do_rows: dO in the op's `[B, T, HV, V]` (as the states path
  has it), read so by the kernel; else chunk-major. Returns (dq, dk, dkt, dvt,
  dg, d_erase, d_write), float32: as `channel_intra_grads` plus the gates' gradients (None
  where a gate is not given); with an erase gate dk is k's whole gradient (through k̃ too) and
  dkt None; with a write gate dvt is v's gradient."""
  dq, dkt, dk, _, dvt, _, dg, d_erase, d_write = _bwd_call(
      q, k, kt, vt, G, segments, m, None, None, de, None, chunk=chunk, num_warps=num_warps,
      band_stages=band_stages, solve_bk=solve_bk, span=span, states=(h, dh, do, e),
      erase=erase, write=write, q_scale=q_scale, grad_dtypes=grad_dtypes, do_rows=do_rows)
  return dq, dk, None if erase is not None else dkt, dvt, dg, d_erase, d_write
