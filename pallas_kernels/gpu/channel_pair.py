"""Pallas (Triton backend) kernels for the two per-channel pair matrices of KDA / GDN-2, fwd, bwd.

    P_ij = Σ_c Q_ic  K_jc e^{G_ic − G_jc}    L_ij = Σ_c K̃_ic K_jc e^{G_ic − G_jc}    (j <= i)

for one chunk (i, j < C), zero above the diagonal; G is the within-chunk cumulative log decay
per key channel (non-increasing down the chunk), K̃ the erase keys. P is the masked intra-chunk
attention and L the strictly-lower system matrix of the chunk form (the caller applies the
strict / segment masks). In XLA these products build and write the anchored sub-chunk tensors
of their exponentials ([.., 16, 16, K] per sub-chunk pair) to HBM; here nothing but the C×C
results leaves the chip (timings: docs/BENCHMARKS.md run 7).

Work split: one program per (chunk, 16-row block b), both matrices at once (they share K, G
and every exponential).

Exactness and range (docs/MATH.md §3.4 rule 3), as the XLA form: the columns j before block b
are anchored at n = the first row of b, e^{G_i − G_j} = e^{G_i − G_n} e^{G_n − G_j}, both
exponents <= 0, and reduced by one bf16 dot per matrix ([16, K] × [K, C], float32
accumulation, the columns at or after n zeroed); the 16×16 diagonal block is an exact
float32 elementwise sum, one column j per step, with the exponent masked before exp (so log
gates down to −1e4 per step stay finite).

The diagonal block has a second method, `diag="levels"`: a pair i > j of the block is split
at the highest bit where i and j differ (half size h = 8, 4, 2, 1) and anchored at m = the first
row of i's half, e^{G_i − G_j} = e^{G_i − G_m} e^{G_m − G_j}, both exponents <= 0 again; each
level is one masked [16, ds] × [ds, 16] tf32 product, and i = j (e^0) is an exact elementwise
sum. It trades the 16 cross-lane reductions and strided column stores per matrix of "columns"
for four small tensor-core products (and half the exponentials); the backward mirrors it.

Backward (`channel_pairs_bwd`), from dP and dL, by program (chunk, block b):
  dQ_i = Σ_{j<=i} dP_ij K_j ⊙ e^{G_i − G_j}, dK̃_i likewise from dL  (rows i in b; anchor n as
         in the forward);
  dK_j = Σ_{i>=j} (dP_ij Q_i + dL_ij K̃_i) ⊙ e^{G_i − G_j}  (rows j in b; the rows i after b
         are anchored at m = the first row after b: e^{G_i − G_m} e^{G_m − G_j}, both <= 0);
  dG = Q ⊙ dQ + K̃ ⊙ dK̃ − K ⊙ dK  (the matrices depend on G only through Q ⊙ e^G, K̃ ⊙ e^G and
       K ⊙ e^{−G}).

Layouts: Q, K, K̃ `[N, C, D]` (any float dtype; bf16 in the pallas_gpu path), G `[N, C, D]`
float32, P, L, dP, dL `[N, C, C]` float32; C a power of two in [16, 128], D one in [32, 256].
Imports nothing of lineax_attn.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

SUB = 16     # rows per block: one program per (chunk, block)
DS = 64      # channels per slice; with NUM_WARPS the fastest measured pair (BENCHMARKS run 7)
_F32 = jnp.float32
_BF16 = jnp.bfloat16
NUM_WARPS = 8
# How the exact 16×16 diagonal block is made: "columns" (one column per step, elementwise
# float32: 16 cross-lane reductions and strided stores per matrix) or "levels" (binary
# anchoring, below: four masked [16, ds] × [ds, 16] tf32 dots and the i = j term).
DIAG_CHOICES = ("columns", "levels")
DIAG = "columns"


def supported(c: int, d: int) -> str | None:
  """None if the kernels handle chunk size c and key dim d, else why not."""
  if c % SUB or c > 128 or c & (c - 1):
    return f"chunk_size={c} (the channel-pair kernels need a power of two in [{SUB}, 128])"
  if d < 32 or d > 256 or d & (d - 1):
    return f"K={d} (the channel-pair kernels need a power of two in [32, 256])"
  return None


def _masked_exp(x, mask):
  return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def _dot(a, b, *, trans_a=False, trans_b=False):
  return pltriton.dot(a.astype(_BF16), b.astype(_BF16), trans_a=trans_a, trans_b=trans_b)


def _dot32(a, b, *, trans_a=False, trans_b=False):
  return pltriton.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=True)


def _levels(g_ref, r0, ch, g_b):
  """The binary-anchored factors of the diagonal block, one level per half size h = 8, 4, 2, 1.

  A pair i > j of the block belongs to exactly one level: the h with i, j in the same block of
  2h rows, i in its second half and j in its first. With m the first row of that second half,
  e^{G_i − G_j} = e^{G_i − G_m} · e^{G_m − G_j}, both exponents <= 0 (j < m <= i), so each level
  is one masked product of finite factors. Yields (row factor [SUB, ds] on second-half rows,
  column factor [SUB, ds] on first-half rows, pair mask [SUB, SUB]).
  """
  i = jax.lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (1, SUB), 1)
  for h in (8, 4, 2, 1):
    second = (i // h) % 2 == 1                                        # [SUB, 1]
    g_m = jnp.zeros_like(g_b)
    for a in range(SUB // (2 * h)):       # the anchor row of each 2h-row block
      g_m = jnp.where(i // (2 * h) == a, g_ref[pl.ds(r0 + a * 2 * h + h, 1), ch], g_m)
    row = _masked_exp(g_b - g_m, second)
    col = _masked_exp(g_m - g_b, jnp.logical_not(second))
    pairs = (i // (2 * h) == j // (2 * h)) & ((i // h) % 2 == 1) & ((j // h) % 2 == 0)
    yield row, col, pairs


def _fwd_kernel(q_ref, kt_ref, k_ref, g_ref, p_ref, l_ref, *, c, d, ds, diag):
  r0 = pl.program_id(1) * SUB
  rows = pl.ds(r0, SUB)
  col = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0)
  i = jax.lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)
  p = jnp.zeros((SUB, c), _F32)
  l = jnp.zeros((SUB, c), _F32)
  p_d = jnp.zeros((SUB, SUB), _F32)   # the diagonal block ("levels")
  l_d = jnp.zeros((SUB, SUB), _F32)
  for s in range(d // ds):      # channel slices bound the live registers
    ch = pl.ds(s * ds, ds)
    anchor = g_ref[pl.ds(r0, 1), ch]                                 # [1, ds]
    # Columns before the block, anchored at its first row (both exponents <= 0).
    k_col = k_ref[:, ch].astype(_F32) * _masked_exp(anchor - g_ref[:, ch], col < r0)
    row = jnp.exp(g_ref[rows, ch] - anchor)
    p += _dot(q_ref[rows, ch].astype(_F32) * row, k_col, trans_b=True)   # [SUB, C]
    l += _dot(kt_ref[rows, ch].astype(_F32) * row, k_col, trans_b=True)
    if diag == "levels":
      g_b = g_ref[rows, ch]
      q_b, kt_b, k_b = (x[rows, ch].astype(_F32) for x in (q_ref, kt_ref, k_ref))
      for row_f, col_f, pairs in _levels(g_ref, r0, ch, g_b):
        kc = k_b * col_f
        p_d += jnp.where(pairs, _dot32(q_b * row_f, kc, trans_b=True), 0.0)
        l_d += jnp.where(pairs, _dot32(kt_b * row_f, kc, trans_b=True), 0.0)
      eye = i == jax.lax.broadcasted_iota(jnp.int32, (1, SUB), 1)     # i = j: e^0, exact
      p_d += jnp.where(eye, jnp.sum(q_b * k_b, axis=1)[:, None], 0.0)
      l_d += jnp.where(eye, jnp.sum(kt_b * k_b, axis=1)[:, None], 0.0)
  out_col = jax.lax.broadcasted_iota(jnp.int32, (SUB, c), 1)
  off_block = (out_col < r0) | (out_col >= r0 + SUB)
  pltriton.store(p_ref, p, mask=off_block)
  pltriton.store(l_ref, l, mask=off_block)
  if diag == "levels":
    p_ref[:, rows] = p_d
    l_ref[:, rows] = l_d
    return
  # The diagonal block, exact: column r0 + j is Σ_c (Q|K̃)_ic K_jc e^{G_ic − G_jc}, i >= j,
  # stored as it is made (the columns are independent: no serial chain through registers).
  g_b = g_ref[rows, :]
  q_b, kt_b = q_ref[rows, :].astype(_F32), kt_ref[rows, :].astype(_F32)
  for j in range(SUB):
    k_j = k_ref[pl.ds(r0 + j, 1), :].astype(_F32)
    w = k_j * _masked_exp(g_b - g_ref[pl.ds(r0 + j, 1), :], i >= j)   # [SUB, D]
    p_ref[:, pl.ds(r0 + j, 1)] = jnp.sum(q_b * w, axis=1)[:, None]
    l_ref[:, pl.ds(r0 + j, 1)] = jnp.sum(kt_b * w, axis=1)[:, None]


def _bwd_kernel(q_ref, kt_ref, k_ref, g_ref, dp_ref, dl_ref, dpt_ref, dlt_ref,
                dq_ref, dkt_ref, dk_ref, dg_ref, *, c, d, ds, diag):
  r0 = pl.program_id(1) * SUB
  blk = pl.ds(r0, SUB)
  pos = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0)
  i = jax.lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)
  dp_rows, dl_rows = dp_ref[blk, :], dl_ref[blk, :]                  # [SUB, C]: dP_ij, i in b
  dp_cols, dl_cols = dpt_ref[blk, :], dlt_ref[blk, :]                # [SUB, C]: dP_ij, j in b
  m = jnp.minimum(r0 + SUB, c - 1)   # the first row after b (none after the last block)
  for s in range(d // ds):           # channel slices: independent, and bound the registers
    ch = pl.ds(s * ds, ds)
    g_all, g_b = g_ref[:, ch], g_ref[blk, ch]
    q_b, kt_b = q_ref[blk, ch].astype(_F32), kt_ref[blk, ch].astype(_F32)
    # dQ, dK̃ of the rows in b from the columns before b (anchor n = r0).
    anchor = g_ref[pl.ds(r0, 1), ch]
    row = jnp.exp(g_b - anchor)
    k_col = k_ref[:, ch].astype(_F32) * _masked_exp(anchor - g_all, pos < r0)
    dq = row * _dot(dp_rows, k_col)
    dkt = row * _dot(dl_rows, k_col)
    # dK of the rows in b from the rows after b (anchor m).
    g_m = g_ref[pl.ds(m, 1), ch]
    later = _masked_exp(g_all - g_m, pos >= r0 + SUB)                # [C, ds], <= 1
    dk = jnp.exp(g_m - g_b) * (_dot(dp_cols, q_ref[:, ch].astype(_F32) * later)
                               + _dot(dl_cols, kt_ref[:, ch].astype(_F32) * later))
    if diag == "levels":
      # The diagonal block by the forward's levels: dQ_i += row_i Σ_j W_ij col_j K_j,
      # dK_j += col_j Σ_i W_ij row_i Q_i (W = dP, dL on the level's pairs), plus i = j.
      dp_d, dl_d = dp_ref[blk, blk], dl_ref[blk, blk]                  # [SUB, SUB]
      k_b = k_ref[blk, ch].astype(_F32)
      for row_f, col_f, pairs in _levels(g_ref, r0, ch, g_b):
        wp, wl = jnp.where(pairs, dp_d, 0.0), jnp.where(pairs, dl_d, 0.0)
        kc = k_b * col_f
        dq += row_f * _dot32(wp, kc)
        dkt += row_f * _dot32(wl, kc)
        dk += col_f * (_dot32(wp, q_b * row_f, trans_a=True)
                       + _dot32(wl, kt_b * row_f, trans_a=True))
      eye = i == jax.lax.broadcasted_iota(jnp.int32, (1, SUB), 1)
      wp_ii = jnp.sum(jnp.where(eye, dp_d, 0.0), axis=1)[:, None]      # dP_ii [SUB, 1]
      wl_ii = jnp.sum(jnp.where(eye, dl_d, 0.0), axis=1)[:, None]
      dq += wp_ii * k_b
      dkt += wl_ii * k_b
      dk += wp_ii * q_b + wl_ii * kt_b
    # The diagonal block, exact and by elementwise accumulation only: dQ, dK̃ one key row
    # r0 + j per step, dK one query row r0 + j per step.
    for j in range(SUB if diag == "columns" else 0):
      r = pl.ds(r0 + j, 1)
      k_j, g_j = k_ref[r, ch].astype(_F32), g_ref[r, ch]
      e = _masked_exp(g_b - g_j, i >= j)                              # [SUB(i), ds]
      dq += dp_ref[blk, r] * k_j * e                                  # dP_{i, r0+j}
      dkt += dl_ref[blk, r] * k_j * e
      e = _masked_exp(g_j - g_b, i <= j)                              # [SUB(keys), ds]
      dk += (dpt_ref[blk, r] * q_ref[r, ch].astype(_F32)               # dP_{r0+j, key}
             + dlt_ref[blk, r] * kt_ref[r, ch].astype(_F32)) * e
    dq_ref[:, ch] = dq
    dkt_ref[:, ch] = dkt
    dk_ref[:, ch] = dk
    dg_ref[:, ch] = q_b * dq + kt_b * dkt - k_ref[blk, ch].astype(_F32) * dk


def _call(kernel, ins, outs, interpret, num_warps, ds, diag):
  if diag not in DIAG_CHOICES:
    raise ValueError(f"channel_pairs: diag must be one of {DIAG_CHOICES}, got {diag!r}.")
  n, c, d = ins[0].shape
  whole = lambda x: pl.BlockSpec((None, c, x.shape[-1]), lambda i, b: (i, 0, 0))
  return pl.pallas_call(
      functools.partial(kernel, c=c, d=d, ds=min(ds, d), diag=diag),
      grid=(n, c // SUB),
      in_specs=[whole(x) for x in ins],
      out_specs=[pl.BlockSpec((None, SUB, o.shape[-1]), lambda i, b: (i, b, 0)) for o in outs],
      out_shape=outs,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
  )(*ins)


def _check(q, kt, k, g):
  if q.ndim != 3 or not q.shape == kt.shape == k.shape == g.shape:
    raise ValueError(f"channel_pairs: Q, K̃, K, G must share one [N, C, D] shape, got "
                     f"{q.shape}, {kt.shape}, {k.shape}, {g.shape}.")
  reason = supported(q.shape[1], q.shape[2])
  if reason:
    raise ValueError(f"channel_pairs: {reason}.")


def channel_pairs_fwd(q, kt, k, g, *, interpret=False, num_warps=NUM_WARPS, slice_k=DS,
                      diag=DIAG):
  """(P, L) `[N, C, C]` float32 from Q, K̃, K, G `[N, C, D]` (module docstring)."""
  _check(q, kt, k, g)
  n, c, _ = q.shape
  out = jax.ShapeDtypeStruct((n, c, c), _F32)
  p, l = _call(_fwd_kernel, (q, kt, k, g.astype(_F32)), [out, out], interpret, num_warps, slice_k,
               diag)
  return p, l


def channel_pairs_bwd(q, kt, k, g, dp, dl, *, interpret=False, num_warps=NUM_WARPS,
                      slice_k=DS, diag=DIAG):
  """(dQ, dK̃, dK, dG) `[N, C, D]` float32 for the cotangents dP, dL `[N, C, C]`."""
  _check(q, kt, k, g)
  n, c, d = q.shape
  for name, x in (("dP", dp), ("dL", dl)):
    if x.shape != (n, c, c):
      raise ValueError(f"channel_pairs_bwd: {name} must be {(n, c, c)}, got {x.shape}.")
  outs = [jax.ShapeDtypeStruct((n, c, d), _F32)] * 4
  dp, dl = dp.astype(_F32), dl.astype(_F32)
  # The transposes give the dK pass its cotangent columns as rows (loads of contiguous rows).
  ins = (q, kt, k, g.astype(_F32), dp, dl, jnp.swapaxes(dp, 1, 2), jnp.swapaxes(dl, 1, 2))
  return tuple(_call(_bwd_kernel, ins, outs, interpret, num_warps, slice_k, diag))
