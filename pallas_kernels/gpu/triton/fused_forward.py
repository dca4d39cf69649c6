"""The delta rule's chunk form (DeltaNet, GDN) as fused Triton kernels: a gate-free inverse per
chunk, a forward chunk walk and a reverse one (`GpuTuning(forward="fused")`; issue #17's v2
design, the structure jla documents for its kernels, after FlashQLA).

The split of `intra_chunk` + `state_pass` computes, per chunk, the pseudo-value factors
NY = −M (k ⊙ β e), U = M (v ⊙ β), the gated queries / keys QG, KG and the masked scores P in a
parallel kernel, writes them to HBM (~73 KB a chunk and head at K = V = 128) and reads them
back in the chunk walk. Here only one C × C matrix a chunk leaves the chip:

1. `_t0_kernel`, one program per (chunk, batch · value head): the gate-free inverse
   T0 = (I + diag(β) strict(k kᵀ))^{-1} (same segment only when packed), built as the intra
   kernel builds M (`intra_chunk._batched_unit_lower_inverse`), stored in bf16.
2. `_walk_kernel`, one program per (V-tile, batch · value head), walks the chunks with the
   float32 state tile S [K, BLOCK_V] in registers. The gated inverse is T0 with the decay
   applied on the fly: with D = diag(e^{G}), L = D L0 D^{-1}, so M = (I + L)^{-1} = D T0 D^{-1},
   M_ij = T0_ij · Γ_ij (Γ_ij = e^{G_i − G_j} ≤ 1 for i ≥ j: no overflow). Per chunk:

       R = v − e ⊙ (k S)                   E = (M diag β) R      (E = U + NY·S of the split)
       O = s e ⊙ (q S) + (s q kᵀ ⊙ Γ) E      S' = γ S + (k ⊙ x)ᵀ E

   with e = e^{G} (entry), x = e^{G_C − G} (exit), γ = e^{G_C} (zeroed where a segment starts
   inside the chunk, as the split does). O and E are stored straight into the op's
   `[B, T, HV, V]` layout (no transpose after), float32 like the split's.

3. `_reverse_walk_kernel`, the same programs walking the chunks backward with the state
   cotangent dS: the split's reverse pass with NY, QG, P, KG, M made on the fly from q, k, T0
   and the gates (its docstring). The walk's `SAVE_STATES` gives it the chunk states h.

The rest of the backward (the state pass's dNY / dQG / dP / dKG products and the intra-chunk
backward fed with M = T0 ⊙ Γ) is the split's, in `lineax_attn.ops.pallas_gpu._fused_core`.

Products take bf16 operands and float32 accumulators, as the split's kernels; the difference
from the split is where the bf16 roundings fall (here R and M diag β are rounded, there U, NY
and M), not how many there are. K ≤ 128 (the walk holds q and k of a chunk whole).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels.gpu.triton import blocks
from pallas_kernels.gpu.triton.intra_chunk import (_batched_diagonal_inverse,
                                                   _batched_unit_lower_inverse, _chunk_index,
                                                   _gamma, _merge_blocks_short,
                                                   _unit_lower_inverse, _ungated_gamma)
from pallas_kernels.gpu.triton.state_pass import MM_DTYPE, _jax_triton, _on_hopper, _structs

@triton.jit
def _t0_kernel(q_ptr, k_ptr, beta_ptr, seg_ptr, t, scale, t0_ptr, p0_ptr,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
               BK: tl.constexpr, PACKED: tl.constexpr, PREC: tl.constexpr,
               STORE_SCORES: tl.constexpr, INVERSE: tl.constexpr):
  scale = tl.cast(scale, tl.float32)   # jax-triton passes a Python float as float64
  rc, rows, qk_base, _, vec0, chunk = _chunk_index(t, H, HV, K, K, C)
  ii, jj = rc[:, None], rc[None, :]
  rb = tl.arange(0, BK)
  kk = tl.zeros((C, C), tl.float32)
  qk = tl.zeros((C, C), tl.float32)
  for s in tl.range(K // BK):
    k = tl.load(k_ptr + qk_base + ii * (H * K) + (s * BK + rb)[None, :])
    kk = tl.dot(k, tl.trans(k), kk)
    if STORE_SCORES:
      q = tl.load(q_ptr + qk_base + ii * (H * K) + (s * BK + rb)[None, :])
      qk = tl.dot(q, tl.trans(k), qk)
  beta = tl.load(beta_ptr + vec0 + rc)
  lower = _ungated_gamma(seg_ptr, rows, ii, jj, PACKED)
  lmat = tl.where(ii > jj, beta[:, None] * kk * lower, 0.0)
  if INVERSE == 0:      # blocks.T0_INVERSES, in order
    t0 = _unit_lower_inverse(lmat, ii, jj, PREC)
  elif INVERSE == 1:
    t0 = _batched_unit_lower_inverse(lmat, ii, jj, PREC)
  else:
    t0 = _merge_blocks_short(_batched_diagonal_inverse(lmat, PREC), lmat, ii, jj, INVERSE == 3,
                             PREC)
  tl.store(t0_ptr + chunk * C * C + ii * C + jj, t0.to(tl.bfloat16))
  if STORE_SCORES:   # the scores s q kᵀ, unmasked: the walks' Γ masks and gates them
    tl.store(p0_ptr + chunk * C * C + ii * C + jj, (scale * qk).to(tl.bfloat16))


@triton.jit
def _chunk_factors(g_ptr, seg_ptr, cont_ptr, keep_ptr, vec0, row0, rows, rc, ii, jj,
                   C: tl.constexpr, PACKED: tl.constexpr, GATED: tl.constexpr):
  """A chunk's Γ [C, C] (i ≥ j, same segment), entry e, exit x [C] and carry decay γ."""
  if GATED:
    g = tl.load(g_ptr + vec0 + rc)
    g_last = tl.load(g_ptr + vec0 + C - 1)
    gam = _gamma(g, seg_ptr, rows, ii, jj, PACKED)
    entry = tl.exp(g)
    exit_ = tl.exp(g_last - g)
    gc = tl.exp(g_last)
  else:
    gam = _ungated_gamma(seg_ptr, rows, ii, jj, PACKED)
    entry = tl.full((C,), 1.0, tl.float32)
    exit_ = tl.full((C,), 1.0, tl.float32)
    gc = 1.0
  if PACKED:   # a segment starting in the chunk cuts the entry state and the carried state
    entry = entry * tl.load(cont_ptr + rows)
    exit_ = exit_ * tl.load(keep_ptr + rows)
    gc = gc * tl.load(cont_ptr + row0 + C - 1)
  return gam, entry, exit_, gc


@triton.jit
def _scores(q, k, p0_ptr, chunk, ii, jj, gam, scale, C: tl.constexpr,
            STORE_SCORES: tl.constexpr):
  """P = s q kᵀ ⊙ Γ (bf16): from the T0 kernel's stored ungated scores, or made here."""
  if STORE_SCORES:
    p0 = tl.load(p0_ptr + chunk * C * C + ii * C + jj).to(tl.float32)
    return (p0 * gam).to(tl.bfloat16)
  return (scale * tl.dot(q, tl.trans(k)) * gam).to(tl.bfloat16)


@triton.jit
def _walk_program(t, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr):
  """A walk program's (b · HV + hv, chunk count, row / index grids, [K, BV] state offsets and
  the int64 base of its state)."""
  bhv = tl.program_id(1)
  rc = tl.arange(0, C)
  rv = tl.program_id(0) * BV + tl.arange(0, BV)
  kv = tl.arange(0, K)[:, None] * V + rv[None, :]
  return bhv, t // C, rc, rc[:, None], rc[None, :], kv, bhv.to(tl.int64) * K * V


@triton.jit
def _chunk_rows(bhv, ci, t, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr):
  """Chunk ci's first time row, its rows [C], the offsets of its q / k tile [C, K] (key head
  hv // (HV / H)) and v-like tile [C, BV] in the `[B, T, heads, D]` layouts, and the int64 base
  of its rows in the `[B, HV, T]` vectors."""
  b = bhv // HV
  hv = bhv % HV
  rc = tl.arange(0, C)
  row0 = b.to(tl.int64) * t + ci * C
  qk_rows = (row0 * H + hv // (HV // H)) * K + rc[:, None] * (H * K) + tl.arange(0, K)[None, :]
  v_rows = ((row0 * HV + hv) * V + rc[:, None] * (HV * V)
            + (tl.program_id(0) * BV + tl.arange(0, BV))[None, :])
  return row0, row0 + rc, qk_rows, v_rows, bhv.to(tl.int64) * t + ci * C


@triton.jit
def _walk_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, seg_ptr, cont_ptr, keep_ptr, t0_ptr,
                 p0_ptr, s0_ptr, t, scale, o_ptr, e_ptr, sf_ptr, h_ptr,
                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 C: tl.constexpr, BV: tl.constexpr, PACKED: tl.constexpr, GATED: tl.constexpr,
                 STAGES: tl.constexpr, SAVE_STATES: tl.constexpr, STORE_SCORES: tl.constexpr):
  scale = tl.cast(scale, tl.float32)   # (a float64 scale would make the products' sums float64)
  bhv, nc, rc, ii, jj, kv, state0 = _walk_program(t, K, V, C, BV)
  s = tl.load(s0_ptr + state0 + kv)
  for ci in tl.range(0, nc, num_stages=STAGES):
    row0, rows, qk_rows, v_rows, vec0 = _chunk_rows(bhv, ci, t, H, HV, K, V, C, BV)
    q = tl.load(q_ptr + qk_rows)
    k = tl.load(k_ptr + qk_rows)
    v = tl.load(v_ptr + v_rows).to(tl.float32)
    beta = tl.load(beta_ptr + vec0 + rc)
    chunk = bhv.to(tl.int64) * nc + ci
    t0 = tl.load(t0_ptr + chunk * C * C + ii * C + jj).to(tl.float32)
    gam, entry, exit_, gc = _chunk_factors(g_ptr, seg_ptr, cont_ptr, keep_ptr, vec0, row0, rows,
                                           rc, ii, jj, C, PACKED, GATED)
    mb = (t0 * gam * beta[None, :]).to(tl.bfloat16)          # M diag(β)
    p = _scores(q, k, p0_ptr, chunk, ii, jj, gam, scale, C, STORE_SCORES)
    s_mm = s.to(tl.bfloat16)
    if SAVE_STATES:   # the state entering the chunk, as used here (the backward's h)
      tl.store(h_ptr + chunk * K * V + kv, s_mm)
    r = v - entry[:, None] * tl.dot(k, s_mm)
    e = tl.dot(mb, r.to(tl.bfloat16))
    o = tl.dot(p, e.to(tl.bfloat16), (scale * entry)[:, None] * tl.dot(q, s_mm))
    # (k ⊙ x)ᵀ E = kᵀ (x ⊙ E): the row factor goes on the [C, BV] side, so no [C, K] tile is
    # ever made in float32 (at K = 128 those tiles made the walk spill).
    s = tl.dot(tl.trans(k), (exit_[:, None] * e).to(tl.bfloat16), s * gc)
    tl.store(o_ptr + v_rows, o)
    tl.store(e_ptr + v_rows, e)
  tl.store(sf_ptr + state0 + kv, s)


@triton.jit
def _reverse_walk_kernel(q_ptr, k_ptr, beta_ptr, g_ptr, seg_ptr, cont_ptr, keep_ptr, t0_ptr,
                         p0_ptr, do_ptr, dx_ptr, dsf_ptr, t, scale, de_ptr, dh_ptr, ds0_ptr,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         C: tl.constexpr, BV: tl.constexpr, PACKED: tl.constexpr,
                         GATED: tl.constexpr, STAGES: tl.constexpr, STORE_SCORES: tl.constexpr):
  """The state cotangent walked backward, the split's reverse pass with its per-chunk factors
  made on the fly as the forward walk makes them (NY = −M (k ⊙ β e), QG = s q ⊙ e, KG = k ⊙ x,
  P = s q kᵀ ⊙ Γ, M = T0 ⊙ Γ):

      dE = dE_ext + Pᵀ dO + KG dS            dS' = γ dS + QGᵀ dO − (k ⊙ β e)ᵀ (Mᵀ dE)

  dO, dE_ext in the op's `[B, T, HV, V]` layout; dE (float32) and dh (bf16, the cotangent of
  the state leaving each chunk) chunk-major, as the split's reverse kernel writes them."""
  scale = tl.cast(scale, tl.float32)
  bhv, nc, rc, ii, jj, kv, state0 = _walk_program(t, K, V, C, BV)
  cv = rc[:, None] * V + (tl.program_id(0) * BV + tl.arange(0, BV))[None, :]
  ds = tl.load(dsf_ptr + state0 + kv)
  for step in tl.range(0, nc, num_stages=STAGES):
    ci = nc - 1 - step
    row0, rows, qk_rows, v_rows, vec0 = _chunk_rows(bhv, ci, t, H, HV, K, V, C, BV)
    chunk = bhv.to(tl.int64) * nc + ci
    q = tl.load(q_ptr + qk_rows)
    k = tl.load(k_ptr + qk_rows)
    beta = tl.load(beta_ptr + vec0 + rc)
    t0 = tl.load(t0_ptr + chunk * C * C + ii * C + jj).to(tl.float32)
    do = tl.load(do_ptr + v_rows)
    dx = tl.load(dx_ptr + v_rows)
    gam, entry, exit_, gc = _chunk_factors(g_ptr, seg_ptr, cont_ptr, keep_ptr, vec0, row0, rows,
                                           rc, ii, jj, C, PACKED, GATED)
    p = _scores(q, k, p0_ptr, chunk, ii, jj, gam, scale, C, STORE_SCORES)
    mt = tl.trans((t0 * gam).to(tl.bfloat16))
    ds_mm = ds.to(tl.bfloat16)
    tl.store(dh_ptr + chunk * K * V + kv, ds_mm)
    # Row factors of KG, QG, NY go on the [C, BV] side (no [C, K] tile in float32):
    # KG dS = x ⊙ (k dS), QGᵀ dO = qᵀ (s e ⊙ dO), NYᵀ dE = −kᵀ (β e ⊙ Mᵀ dE).
    de = exit_[:, None] * tl.dot(k, ds_mm) + tl.dot(tl.trans(p), do, dx)
    z = tl.dot(mt, de.to(tl.bfloat16))
    ds = tl.dot(tl.trans(q), ((scale * entry)[:, None] * do.to(tl.float32)).to(tl.bfloat16),
                ds * gc)
    ds = tl.dot(tl.trans(k), (-(beta * entry)[:, None] * z).to(tl.bfloat16), ds)
    tl.store(de_ptr + chunk * C * V + cv, de)
  tl.store(ds0_ptr + state0 + kv, ds)


def supported(chunk: int, dk: int, dv: int) -> str | None:
  """None if the fused kernels take these sizes (the Triton kernels' sizes, K <= 128), else why."""
  reason = blocks.supported(chunk, dk, dv)
  if reason is None and dk > 128:
    reason = f"K={dk} (the fused walks hold q, k of a chunk whole: K <= 128)"
  return reason


def _check(q, v):
  b, t, h, dk = q.shape
  hv, dv = v.shape[2], v.shape[3]
  reason = supported(blocks.CHUNK, dk, dv)
  if reason:
    raise ValueError(f"fused_forward: {reason}.")
  if t % blocks.CHUNK or hv % h:
    raise ValueError(f"fused_forward: T={t} must be a multiple of {blocks.CHUNK} and HV={hv} a "
                     f"multiple of H={h}.")
  return b, t, h, dk, hv, dv


def _segment_rows(segments, beta):
  if segments is None:   # unused pointers: the kernels read them only when PACKED
    return (beta,) * 3, False
  return tuple(x.astype(jnp.float32) for x in segments), True


def _launch(dk, dv, launch):
  """The walks' (BLOCK_V, warps, stages): `launch`, else `blocks.FUSED_WALK_LAUNCH` (a timing
  run's override), else `blocks.fused_walk_launch`'s."""
  launch = launch or blocks.FUSED_WALK_LAUNCH or blocks.fused_walk_launch(
      dk, dv, hopper=_on_hopper())
  bv, warps, stages = launch
  if bv not in (16, 32, 64) or dv % bv or warps not in (1, 2, 4, 8) or stages < 1:
    raise ValueError(f"fused_forward: launch={launch} needs BLOCK_V in (16, 32, 64) dividing "
                     f"V={dv}, warps in (1, 2, 4, 8) and stages >= 1")
  return tuple(int(x) for x in launch)


def fused_forward(q, k, v, beta, g, s0, segments=None, *, scale: float, gated: bool = True,
                  save_states: bool = False, scores: str | None = None,
                  launch: tuple[int, int, int] | None = None):
  """(o, e, s_final) of the delta rule's chunk form on a padded call; with save_states also
  (factors, h), the backward's residuals.

  q, k `[B, T, H, K]`, v `[B, T, HV, V]` (T a multiple of 64, HV a multiple of H), beta and the
  chunk-local cumulative log gates g `[B, HV, T]` float32 (g is not read when not `gated`),
  s0 `[B, HV, K, V]` float32, segments None or the (seg, cont, keep) rows `[B, T]` of
  `gpu_chunks.kernel_segments`. Returns o and e `[B, T, HV, V]` float32 (the output and the
  pseudo-values, the write residual), s_final `[B, HV, K, V]` float32, and with save_states
  factors = (t0, p0): t0 `[B, HV, Nc, C, C]` bf16 (the gate-free inverses) and p0 the same
  shape (the ungated scores, where `scores="stored"`) or None, and h `[B, HV, Nc, K, V]` bf16
  (the state entering each chunk).

  scores: `blocks.FUSED_SCORES_CHOICES` (None: `blocks.FUSED_SCORES`), whether the walks make
  the masked scores s q kᵀ themselves, once per V-tile, or read them from the T0 kernel;
  launch: (BLOCK_V, warps, stages) of the walks (None: `blocks.fused_walk_launch`). Both are
  read here, outside the jit, so a changed default takes effect at the next call."""
  scores = _check_scores(scores)
  return _fused_forward(q, k, v, beta, g, s0, segments, scale=float(scale), gated=gated,
                        save_states=save_states, scores=scores,
                        launch=_launch(q.shape[-1], v.shape[-1], launch))


def _check_scores(scores):
  scores = blocks.FUSED_SCORES if scores is None else scores
  if scores not in blocks.FUSED_SCORES_CHOICES:
    raise ValueError(f"fused_forward: scores={scores!r} is not one of "
                     f"{blocks.FUSED_SCORES_CHOICES}")
  return scores


@functools.partial(jax.jit, static_argnames=("scale", "gated", "save_states", "scores",
                                             "launch"))
def _fused_forward(q, k, v, beta, g, s0, segments, *, scale, gated, save_states, scores,
                   launch):
  b, t, h, dk, hv, dv = _check(q, v)
  c, nc, f32 = blocks.CHUNK, t // blocks.CHUNK, jnp.float32
  stored = scores == "stored"
  beta = beta.astype(f32)
  seg, packed = _segment_rows(segments, beta)
  q, k, v = (x.astype(MM_DTYPE) for x in (q, k, v))
  t0, p0 = _t0_call(q, k, beta, seg[0], scale=scale, hv=hv, packed=packed, stored=stored)
  bv, warps, stages = launch
  out_shape = _structs(((b, t, hv, dv), f32), ((b, t, hv, dv), f32), ((b, hv, dk, dv), f32),
                       ((b, hv, nc, dk, dv) if save_states else (1,), MM_DTYPE))
  o, e, s_final, states = _jax_triton().triton_call(
      q, k, v, beta, beta if g is None else g.astype(f32), *seg, t0, p0, s0.astype(f32), t,
      scale, kernel=_walk_kernel, out_shape=out_shape, grid=(dv // bv, b * hv),
      num_warps=warps, num_stages=stages, H=h, HV=hv, K=dk, V=dv, C=c, BV=bv, PACKED=packed,
      GATED=gated, STAGES=stages, SAVE_STATES=save_states, STORE_SCORES=stored)
  if not save_states:
    return o, e, s_final
  return o, e, s_final, (t0, p0 if stored else None), states


def _t0_call(q, k, beta, seg, *, scale, hv, packed, stored, launch=None):
  """`_t0_kernel` over every chunk: (t0, p0 or a placeholder). launch: (warps, BK, inverse),
  else `blocks.T0_LAUNCH` (a timing run's override), else `blocks.t0_launch`'s."""
  b, t, h, dk = k.shape
  c = blocks.CHUNK
  nc = t // c
  warps, bk, inverse = blocks.check_t0_launch(
      launch or blocks.T0_LAUNCH or blocks.t0_launch(dk), dk)
  if stored:   # q kᵀ beside k kᵀ: two [C, BK] slices a step, the intra kernel's slicing
    bk = blocks.INTRA_BK
  return _jax_triton().triton_call(
      q, k, beta, seg, t, scale, kernel=_t0_kernel,
      out_shape=_structs(((b, hv, nc, c, c), MM_DTYPE),
                         ((b, hv, nc, c, c) if stored else (1,), MM_DTYPE)),
      grid=(nc, b * hv), num_warps=warps, num_stages=1, H=h, HV=hv, K=dk, C=c,
      BK=bk, PACKED=packed, PREC=blocks.INTRA_PRECISION, STORE_SCORES=stored,
      INVERSE=blocks.T0_INVERSES.index(inverse))


@functools.partial(jax.jit, static_argnames=("hv", "launch"))
def gate_free_inverse(k, beta, *, hv: int, launch: tuple[int, int, str] | None = None):
  """T0 = (I + diag(β) strict(k kᵀ))⁻¹ of every chunk, `[B, HV, Nc, C, C]` bf16 (the T0 kernel
  alone, for `pallas_kernels.gpu.chunk_walk`). k `[B, T, H, K]` (T a multiple of 64), beta
  `[B, HV, T]` float32; value head hv reads key head hv // (HV / H). Unpacked rows only.
  launch: (warps, BK, inverse) (`blocks.t0_launch` when None; a timing run's knob)."""
  k = k.astype(MM_DTYPE)
  t0, _ = _t0_call(k, k, beta.astype(jnp.float32), beta.astype(jnp.float32), scale=1.0, hv=hv,
                   packed=False, stored=False, launch=launch)
  return t0


def fused_reverse(q, k, beta, g, segments, factors, do, de_ext, ds_final, *, scale: float,
                  gated: bool = True, launch: tuple[int, int, int] | None = None):
  """The reverse state pass of `fused_forward` (`_reverse_walk_kernel`): (de, dh, ds0), as
  `state_pass.state_passing_bwd` returns them (de `[B, HV, Nc, C, V]` float32, dh
  `[B, HV, Nc, K, V]` bf16, ds0 `[B, HV, K, V]` float32), from its inputs' factors (t0, p0 or
  None: the walk makes the scores itself) and the cotangents do, de_ext `[B, T, HV, V]` and
  ds_final."""
  return _fused_reverse(q, k, beta, g, segments, factors, do, de_ext, ds_final,
                        scale=float(scale), gated=gated,
                        launch=_launch(q.shape[-1], do.shape[-1], launch))


@functools.partial(jax.jit, static_argnames=("scale", "gated", "launch"))
def _fused_reverse(q, k, beta, g, segments, factors, do, de_ext, ds_final, *, scale, gated,
                   launch):
  b, t, h, dk, hv, dv = _check(q, do)
  c, nc, f32 = blocks.CHUNK, t // blocks.CHUNK, jnp.float32
  t0, p0 = factors
  stored = p0 is not None
  beta = beta.astype(f32)
  seg, packed = _segment_rows(segments, beta)
  bv, warps, stages = launch
  out_shape = _structs(((b, hv, nc, c, dv), f32), ((b, hv, nc, dk, dv), MM_DTYPE),
                       ((b, hv, dk, dv), f32))
  return tuple(_jax_triton().triton_call(
      q.astype(MM_DTYPE), k.astype(MM_DTYPE), beta, beta if g is None else g.astype(f32), *seg,
      t0, t0 if p0 is None else p0, do.astype(MM_DTYPE), de_ext.astype(f32),
      ds_final.astype(f32), t, scale, kernel=_reverse_walk_kernel, out_shape=out_shape,
      grid=(dv // bv, b * hv), num_warps=warps, num_stages=stages, H=h, HV=hv, K=dk, V=dv, C=c,
      BV=bv, PACKED=packed, GATED=gated, STAGES=stages, STORE_SCORES=stored))
