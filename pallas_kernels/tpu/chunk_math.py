"""Per-chunk math of the chunkwise delta-family kernels, on float32 values inside a kernel body.

One template covers all five mixers (docs/MATH.md §2.0, §3.2): per chunk of C rows, with
Q = scale·q, K, an erase key K̃ (absent for linear attention), a write value Ṽ and the in-chunk
cumulative log gate G (absent, one scalar per row, or one value per key channel):

    P_ij = Σ_c Q_ic K_jc e^{G_ic − G_jc} (j ≤ i)      L_ij = Σ_c K̃_ic K_jc e^{G_ic − G_jc} (j < i)
    Z = (I + L)^{-1};  Y = Z (K̃ ⊙ Γc);  U = Z Ṽ;  E = U − Y S_0
    O = (Q ⊙ Γc) S_0 + P E;   S_C = c_C e^{G_C} ⊙ S_0 + (K ⊙ e^{G_C − G} ⊙ keep)ᵀ E

with Γc = e^G ⊙ c (c_i = 1 while row i continues the segment that owns S_0; keep_j = 1 for rows
of the chunk's last segment) and L, P masked to same-segment pairs (docs/MATH.md §3.5).
`chunk_backward` is docs/MATH.md §3.6 steps 1-8 with the segment substitutions.

Everything here is written with ops that Mosaic lowers: 2-D matmuls (plain, A·Bᵀ and Aᵀ·B),
elementwise ops, lane/sublane reductions with keepdims, iota masks, static aligned row slices and
`pltpu.roll` along rows. No 3-D intermediates, no gathers. `pltpu.roll` only runs inside a kernel.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

_F32 = jnp.float32
_HI = lax.Precision.HIGHEST


def dot(a, b):
  """a @ b, float32 accumulate."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_HI, preferred_element_type=_F32)


def dot_nt(a, b):
  """a @ bᵀ."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI, preferred_element_type=_F32)


def dot_tn(a, b):
  """aᵀ @ b."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HI, preferred_element_type=_F32)


def fori(lo, hi, body, carry, unroll):
  """`for i in range(lo, hi): carry = body(i, carry)`: a Python loop (static indices, what the
  compiled kernel uses) or a `fori_loop` (a much smaller program for the CPU interpreter)."""
  if unroll:
    for i in range(lo, hi):
      carry = body(i, carry)
    return carry
  return lax.fori_loop(lo, hi, body, carry)


def _iota(shape, axis):
  return lax.broadcasted_iota(jnp.int32, shape, axis)


def row_to_col(x):
  """[1, n] -> [n, 1] without a transpose: an identity mask and a lane sum (exact)."""
  n = x.shape[1]
  eye = _iota((n, n), 0) == _iota((n, n), 1)
  return jnp.sum(jnp.where(eye, x, 0.0), axis=1, keepdims=True)


def col_to_row(x):
  """[n, 1] -> [1, n] (exact)."""
  n = x.shape[0]
  eye = _iota((n, n), 0) == _iota((n, n), 1)
  return jnp.sum(jnp.where(eye, x, 0.0), axis=0, keepdims=True)


def masked_exp(x, mask):
  """exp(x) where mask else 0, never evaluating exp of a masked (possibly positive) argument."""
  return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def _scale(x, factor):
  return x if factor is None else x * factor


@dataclasses.dataclass(frozen=True)
class Gates:
  """The decay of one chunk. kind: "none" | "scalar" | "channel".

  G: channel [C, K]; scalar: Gcol [C, 1] and Grow [1, C]. Derived:
    decay_in    [C, K] / [C, 1]: e^G (decay of S_0 up to row i);
    decay_out   [C, K] / [C, 1]: e^{G_C − G} (decay of row j's write up to the chunk end);
    decay_chunk [1, K] / [1, 1]: e^{G_C} (decay of S_0 across the chunk).
  (The same names as lineax_attn's chunk form.)
  """
  kind: str
  G: jax.Array | None = None
  Gcol: jax.Array | None = None
  Grow: jax.Array | None = None

  @property
  def decay_in(self):
    if self.kind == "channel":
      return jnp.exp(self.G)
    if self.kind == "scalar":
      return jnp.exp(self.Gcol)
    return None

  @property
  def G_last(self):
    if self.kind == "channel":
      return self.G[-1:, :]
    if self.kind == "scalar":
      return self.Gcol[-1:, :]
    return None

  @property
  def decay_out(self):
    if self.kind == "none":
      return None
    g = self.G if self.kind == "channel" else self.Gcol
    return jnp.exp(self.G_last - g)

  @property
  def decay_chunk(self):
    return None if self.kind == "none" else jnp.exp(self.G_last)


def make_gates(kind, g):
  """g: channel [C, K] cumulative gate, scalar [1, C] cumulative gate (row layout), or None."""
  if kind == "channel":
    return Gates(kind, G=g)
  if kind == "scalar":
    return Gates(kind, Gcol=row_to_col(g), Grow=g)
  return Gates("none")


@dataclasses.dataclass(frozen=True)
class Segments:
  """Segment structure of one chunk, from the row `rel` [1, C] = segidx − segidx(entry token).

  same [C, C] bool: same segment; cont [C, 1]: row continues S_0's segment (c_i);
  keep [C, 1]: row belongs to the chunk's last segment; cont_last [1, 1]: c_C.
  """
  same: jax.Array
  cont: jax.Array
  keep: jax.Array
  cont_last: jax.Array


def make_segments(rel_row):
  rel_col = row_to_col(rel_row)
  last = jnp.max(rel_row, axis=1, keepdims=True)          # segidx is non-decreasing in a chunk
  return Segments(same=rel_col == rel_row,
                  cont=(rel_col == 0).astype(_F32),
                  keep=(rel_col == last).astype(_F32),
                  cont_last=(last == 0).astype(_F32))


def _segment_decays(gates, seg):
  """Row factors of the S_0 terms (Γ ⊙ c) and of the state update (e^{G_C − G} ⊙ keep), and the
  S_0 decay across the chunk (c_C e^{G_C})."""
  decay_in, decay_out, decay_chunk = gates.decay_in, gates.decay_out, gates.decay_chunk
  if seg is not None:
    decay_in = seg.cont if decay_in is None else decay_in * seg.cont
    decay_out = seg.keep if decay_out is None else decay_out * seg.keep
    decay_chunk = seg.cont_last if decay_chunk is None else decay_chunk * seg.cont_last
  return decay_in, decay_out, decay_chunk


def _decay_state(S, decay_chunk):
  """Diag(decay_chunk) S for decay_chunk [1, K] (per key channel) or [1, 1]."""
  if decay_chunk is None:
    return S
  if decay_chunk.shape[1] == 1:
    return S * decay_chunk
  return S * row_to_col(decay_chunk)


# ----------------------------------------------------------------------------------------------
# Pair matrices P (j ≤ i) and L (j < i).


def _channel_pairs(Q, K, Kt, G, sub, need_p, unroll):
  """Per-channel gates: sub-chunks anchored at their first row (exactly overflow-free).

  Off-diagonal sub-block pairs (block(j) < block(i)), anchored at n = first row of i's block:
  e^{G_i − G_j} = e^{G_i − G_n} e^{G_n − G_j}, both exponents ≤ 0, one matmul per block row.
  Diagonal blocks: for each row offset d = i − j < sub, the exact per-channel product of row i
  with row i − d (a `roll` by d rows), summed over channels.
  """
  c = K.shape[0]
  ns = c // sub
  rows = _iota((c, 1), 0)
  P_blocks, L_blocks = [], []
  for p in range(ns):
    n = p * sub
    if p == 0:
      if need_p:
        P_blocks.append(jnp.zeros((sub, c), _F32))
      if Kt is not None:
        L_blocks.append(jnp.zeros((sub, c), _F32))
      continue
    anchor = G[n:n + sub][:1]                                     # G_n, [1, K]
    row_fac = jnp.exp(G[n:n + sub] - anchor)                      # [sub, K]
    K_col = K * masked_exp(anchor - G, rows < n)                  # [C, K], rows j ≥ n zero
    if need_p:
      P_blocks.append(dot_nt(Q[n:n + sub] * row_fac, K_col))
    if Kt is not None:
      L_blocks.append(dot_nt(Kt[n:n + sub] * row_fac, K_col))
  P = jnp.concatenate(P_blocks, axis=0) if need_p else None
  L = jnp.concatenate(L_blocks, axis=0) if Kt is not None else None

  ri, cj = _iota((c, c), 0), _iota((c, c), 1)
  offset = lax.rem(rows, sub)                                     # row index inside its block
  if need_p:  # d = 0: the diagonal itself, no decay
    P = P + jnp.where(cj == ri, jnp.sum(Q * K, axis=1, keepdims=True), 0.0)

  def offset_d(d, carry):
    P, L = carry
    valid = offset >= d                                           # row i − d in the same block
    K_shift = pltpu.roll(K, d, 0) * masked_exp(G - pltpu.roll(G, d, 0), valid)
    on_diag = cj == ri - d
    if need_p:
      pd = jnp.where(valid, jnp.sum(Q * K_shift, axis=1, keepdims=True), 0.0)
      P = P + jnp.where(on_diag, pd, 0.0)
    if Kt is not None:
      ld = jnp.where(valid, jnp.sum(Kt * K_shift, axis=1, keepdims=True), 0.0)
      L = L + jnp.where(on_diag, ld, 0.0)
    return P, L

  P, L = fori(1, sub, offset_d, (P, L), unroll)
  return P, L


def _channel_pair_grads(dP, dL, Q, K, Kt, G, sub, unroll):
  """Adjoint of `_channel_pairs`: (dQ, dK, dKt) from dP and dL (either may be None)."""
  c, dk = K.shape
  ns = c // sub
  rows = _iota((c, 1), 0)
  dQ_blocks, dKt_blocks = [], []
  dK = jnp.zeros((c, dk), _F32)
  for p in range(ns):
    n = p * sub
    if p == 0:
      dQ_blocks.append(jnp.zeros((sub, dk), _F32))
      dKt_blocks.append(jnp.zeros((sub, dk), _F32))
      continue
    anchor = G[n:n + sub][:1]
    row_fac = jnp.exp(G[n:n + sub] - anchor)
    col_fac = masked_exp(anchor - G, rows < n)
    K_col = K * col_fac
    # Columns j ≥ n of dP's row block meet zero rows of K_col: only off-diagonal blocks count.
    if dP is not None:
      dP_p = dP[n:n + sub]
      dQ_blocks.append(dot(dP_p, K_col) * row_fac)
      dK = dK + dot_tn(dP_p, Q[n:n + sub] * row_fac) * col_fac
    else:
      dQ_blocks.append(jnp.zeros((sub, dk), _F32))
    if dL is not None:
      dL_p = dL[n:n + sub]
      dKt_blocks.append(dot(dL_p, K_col) * row_fac)
      dK = dK + dot_tn(dL_p, Kt[n:n + sub] * row_fac) * col_fac
    else:
      dKt_blocks.append(jnp.zeros((sub, dk), _F32))
  dQ = jnp.concatenate(dQ_blocks, axis=0)
  dKt = jnp.concatenate(dKt_blocks, axis=0)

  ri, cj = _iota((c, c), 0), _iota((c, c), 1)
  offset = lax.rem(rows, sub)
  if dP is not None:  # d = 0
    pd = jnp.sum(jnp.where(cj == ri, dP, 0.0), axis=1, keepdims=True)
    dQ, dK = dQ + pd * K, dK + pd * Q

  def offset_d(d, carry):
    dQ, dK, dKt = carry
    valid = offset >= d
    on_diag = cj == ri - d
    decay = masked_exp(G - pltpu.roll(G, d, 0), valid)             # e^{G_i − G_{i−d}}
    K_shift = pltpu.roll(K, d, 0) * decay
    # Row i's weight on pair (i, i − d); row i − d gets the mirrored term (a roll back by d).
    if dP is not None:
      pd = jnp.where(valid, jnp.sum(jnp.where(on_diag, dP, 0.0), axis=1, keepdims=True), 0.0)
      dQ = dQ + pd * K_shift
      dK = dK + pltpu.roll(pd * Q * decay, c - d, 0)
    if dL is not None:
      ld = jnp.where(valid, jnp.sum(jnp.where(on_diag, dL, 0.0), axis=1, keepdims=True), 0.0)
      dKt = dKt + ld * K_shift
      dK = dK + pltpu.roll(ld * Kt * decay, c - d, 0)
    return dQ, dK, dKt

  dQ, dK, dKt = fori(1, sub, offset_d, (dQ, dK, dKt), unroll)
  return dQ, dK, dKt


def pair_matrices(Q, K, Kt, gates, seg, sub, unroll, need_p=True):
  """P [C, C] (j ≤ i) and L [C, C] (j < i), masked to same-segment pairs. Kt None -> L None."""
  c = K.shape[0]
  ri, cj = _iota((c, c), 0), _iota((c, c), 1)
  causal, strict = cj <= ri, cj < ri
  if gates.kind == "channel":
    P, L = _channel_pairs(Q, K, Kt, gates.G, sub, need_p, unroll)
  else:
    if gates.kind == "scalar":
      decay = masked_exp(gates.Gcol - gates.Grow, causal)      # e^{G_i − G_j}, j ≤ i
    else:
      decay = causal.astype(_F32)
    P = dot_nt(Q, K) * decay if need_p else None
    L = None if Kt is None else dot_nt(Kt, K) * jnp.where(strict, decay, 0.0)
  if seg is not None:
    P = None if P is None else jnp.where(seg.same, P, 0.0)
    L = None if L is None else jnp.where(seg.same, L, 0.0)
  return P, L


def pair_grads(dP, dL, Q, K, Kt, gates, sub, unroll):
  """(dQ, dK, dKt) through P and L; dP, dL are the gradients of the masked matrices."""
  if gates.kind == "channel":
    dQ, dK, dKt = _channel_pair_grads(dP, dL, Q, K, Kt, gates.G, sub, unroll)
    return dQ, dK, (dKt if dL is not None else None)
  c = K.shape[0]
  if gates.kind == "scalar":
    decay = masked_exp(gates.Gcol - gates.Grow, _iota((c, c), 1) <= _iota((c, c), 0))
    dP = dP * decay
    dL = None if dL is None else dL * decay
  dQ, dK = dot(dP, K), dot_tn(dP, Q)
  dKt = None
  if dL is not None:
    dKt = dot(dL, K)
    dK = dK + dot_tn(dL, Kt)
  return dQ, dK, dKt


# ----------------------------------------------------------------------------------------------
# The triangular solve.


def unit_lower_inverse(L, sub, unroll):
  """Z = (I + L)^{-1} for strictly lower-triangular L [C, C], in float32.

  Diagonal sub×sub blocks by forward substitution (one row of every block per step), then block
  rows merged in order: Z = Z_d − (Z_d L_off) Z, which finalises one more block row per pass
  (the blocked forward substitution of docs/MATH.md §3.7; no powers of L are formed).
  """
  c = L.shape[0]
  ns = c // sub
  ri, cj = _iota((c, c), 0), _iota((c, c), 1)
  block_i, block_j = lax.div(ri, sub), lax.div(cj, sub)
  L_diag = jnp.where(block_i == block_j, L, 0.0)
  Z_diag = (ri == cj).astype(_F32)
  offset = lax.rem(_iota((c, 1), 0), sub)
  Z_diag = fori(1, sub, lambda r, Z: Z - jnp.where(offset == r, dot(L_diag, Z), 0.0), Z_diag,
                unroll)
  if ns == 1:
    return Z_diag
  A = dot(Z_diag, jnp.where(block_j < block_i, L, 0.0))
  Z = Z_diag
  for _ in range(ns - 1):
    Z = Z_diag - dot(A, Z)
  return Z


# ----------------------------------------------------------------------------------------------
# One chunk, forward and backward.


def chunk_forward(Q, K, Kt, Vt, gates, seg, S0, sub, unroll, need_output=True):
  """Returns (O [C, V] or None, E [C, V], S_C [K, V])."""
  decay_in, decay_out, decay_chunk = _segment_decays(gates, seg)
  P, L = pair_matrices(Q, K, Kt, gates, seg, sub, unroll, need_p=need_output)
  if Kt is None:
    E = Vt
  else:
    Z = unit_lower_inverse(L, sub, unroll)
    Y = dot(Z, _scale(Kt, decay_in))
    E = dot(Z, Vt) - dot(Y, S0)
  O = dot(_scale(Q, decay_in), S0) + dot(P, E) if need_output else None
  S_next = _decay_state(S0, decay_chunk) + dot_tn(_scale(K, decay_out), E)
  return O, E, S_next


def chunk_backward(Q, K, Kt, Vt, gates, seg, S0, dO, dE_ext, dS, sub, unroll):
  """docs/MATH.md §3.6 steps 1-8 for one chunk.

  Args: the chunk's inputs, its entry state S0 [K, V], the cotangents of O, E (the routed
    residual) and of the state leaving the chunk dS [K, V].
  Returns: dQ, dK, dKt (None without erase), dVt, dG (channel [C, K], scalar [C, 1], or None),
    dS0 [K, V] (carried to the previous chunk).
  """
  c = K.shape[0]
  ri, cj = _iota((c, c), 0), _iota((c, c), 1)
  causal, strict = cj <= ri, cj < ri
  if seg is not None:
    causal, strict = causal & seg.same, strict & seg.same
  decay_in, decay_out, decay_chunk = _segment_decays(gates, seg)
  P, L = pair_matrices(Q, K, Kt, gates, seg, sub, unroll)
  QG = _scale(Q, decay_in)
  KG = _scale(K, decay_out)
  if Kt is None:
    E = Vt
  else:
    Z = unit_lower_inverse(L, sub, unroll)
    KtG = _scale(Kt, decay_in)
    Y = dot(Z, KtG)
    E = dot(Z, Vt) - dot(Y, S0)

  dE = dot_tn(P, dO) + dot(KG, dS) + dE_ext                          # 1
  dS0 = _decay_state(dS, decay_chunk) + dot_tn(QG, dO)               # 2
  dL = dKt = None
  if Kt is None:
    dVt = dE
  else:
    dS0 = dS0 - dot_tn(Y, dE)
    dY = -dot_nt(dE, S0)                                             # 3
    dZ = dot_nt(dY, KtG) + dot_nt(dE, Vt)                            # 4
    dL = -jnp.where(strict, dot_nt(dot_tn(Z, dZ), Z), 0.0)
    dKt = _scale(dot_tn(Z, dY), decay_in)                            # 5 (then ⊙ Γc, step 7)
    dVt = dot_tn(Z, dE)
  dP = jnp.where(causal, dot_nt(dO, E), 0.0)                         # 6
  dK_state = _scale(dot_nt(E, dS), decay_out)                        # 7
  dQ_pair, dK_pair, dKt_pair = pair_grads(dP, dL, Q, K, Kt, gates, sub, unroll)
  dQ = _scale(dot_nt(dO, S0), decay_in) + dQ_pair
  dK = dK_state + dK_pair
  if Kt is not None:
    dKt = dKt + dKt_pair

  dG = None
  if gates.kind != "none":                                           # 8
    # Every gate factor is e^{±G}: dG = Q⊙dQ + K̃⊙dK̃ − K⊙dK, plus the e^{G_C} terms on row C.
    dG = Q * dQ - K * dK
    if Kt is not None:
      dG = dG + Kt * dKt
    # Row C: Diag(c_C e^{G_C}) S_0 and e^{G_C} inside e^{G_C − G_j}.
    last_row = (col_to_row(jnp.sum(S0 * dS, axis=1, keepdims=True)) * decay_chunk
                + jnp.sum(K * dK_state, axis=0, keepdims=True))      # [1, K]
    is_last = _iota((c, 1), 0) == c - 1
    if gates.kind == "scalar":
      dG = jnp.sum(dG, axis=1, keepdims=True) + jnp.where(
          is_last, jnp.sum(last_row, axis=1, keepdims=True), 0.0)
    else:
      dG = dG + jnp.where(is_last, last_row, 0.0)
  return dQ, dK, dKt, dVt, dG, dS0
