"""Mosaic GPU (Hopper) kernels for the intra-chunk part of the delta-rule chunk form
(docs/MATH.md §3.2, §3.6), forward and backward.

Checked against an exact float32 reference and, through the op, against the scan, both in JAX's
Mosaic GPU interpreter (CI) and compiled on an H200 (docs/BENCHMARKS.md, "Last full GPU test
run"). `lineax_attn.ops.pallas_gpu` uses them by default (`GpuTuning(intra="kernel")`).

Resources at K = V = 128 (registers from ptxas on the H200, shared memory as the launch requests
it): forward 248-254 registers, no spills, 108 KiB of shared memory in two phases (so two CTAs
share an SM); backward 255 registers with a 164-byte spill, 207 KiB (one CTA per SM): its live
set is ordered for registers, see the kernel.

What it replaces: the XLA preparation that feeds `state_passing.state_passing_fwd` (1.5 of the
1.84 ms of the GDN forward at B=4 T=4096 H=16 D=128): the chunk-major relayout of q/k/v, the C×C
products, the unit-lower-triangular solve and the gated keys/queries, as ~40 XLA ops writing
float32 temporaries. Here one CTA (one warpgroup) reads one chunk of one head straight from the
`[B, T, H, D]` inputs by TMA and writes the state pass's inputs once.

Per chunk (C = 64 rows; G = within-chunk cumulative log decay, zero for DeltaNet; Gx = G_C − G):

    Γ_ij = exp(G_i − G_j) for i ≥ j, else 0
    P    = scale · (q kᵀ) ⊙ Γ                               (intra-chunk attention, incl. diagonal)
    L    = diag(β) (k kᵀ) ⊙ Γ, strictly lower
    M    = (I + L)^{-1}                                      (float32, see below)
    Y    = M · (k ⊙ β e^{G}),   U = M · (v ⊙ β)             (bf16 operands, float32 accumulation)
    NY = −Y,  QG = scale · q ⊙ e^{G},  KG = k ⊙ e^{Gx}

The inverse: with D the 16×16 block diagonal of L and E = L − D, (I + L) = (I + D)(I + F) with
F = (I + D)^{-1} E strictly block-lower (F⁴ = 0), so M = (I − F)(I + F²)(I + D)^{-1}, and
(I + D)^{-1} = (I − D)(I + D²)(I + D⁴)(I + D⁸) (D¹⁶ = 0). Bounding the powers to 16×16 blocks keeps
their growth (and the cancellation in the sum) as small as in the XLA path's blocked inverse.
Every product runs on wgmma with split-bf16 operands ("bf16x3": a·b ≈ aₕbₕ + aₕbₗ + aₗbₕ with
a = aₕ + aₗ, ~2⁻¹⁶ relative), so M carries about float32-HIGHEST/100 accuracy before it is
rounded to bf16 for its application, as the XLA path rounds it.

Layouts: q, k `[B, T, H, K]`, v `[B, T, HV, V]` bf16 (value head j reads key head j // (HV/H));
beta, G, Gx `[B, HV, T]` float32; T a multiple of 64; K, V in {64, 128}. Outputs as
`state_passing.state_passing_fwd` takes them: ny, qg, kg `[B, HV, Nc, C, K]` bf16,
p `[B, HV, Nc, C, C]` bf16, u `[B, HV, Nc, C, V]` float32; and on request (`with_inverse`, the
backward's residual) m `[B, HV, Nc, C, C]` bf16.

Packed rows (docs/MATH.md §3.5), optional: seg `[B, T]` float32 segment ids, compared only within a
chunk (the glue passes them relative to the chunk's first row: small integers, exact), cont
`[B, T]` (1 where the token continues the segment entering its chunk) and keep `[B, T]` (1 where
it belongs to the chunk's last segment). Then Γ_ij is zeroed across segments, the entry-state
factor e^{G} becomes e^{G}·cont (QG and the key right-hand side) and KG gets a factor keep.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu import mosaic_common as mc
from pallas_kernels.gpu import state_passing as sp

CHUNK = sp.CHUNK
BLOCK = 16            # diagonal block of the inverse
_BF16 = jnp.bfloat16
_F32 = jnp.float32


def supported(chunk: int, dk: int, dv: int) -> str | None:
  """None if the kernel handles these sizes, else why not."""
  if chunk != CHUNK:
    return f"chunk_size={chunk} (the intra-chunk kernel needs {CHUNK})"
  if dk not in (64, 128) or dv not in (64, 128):
    return f"head dims K={dk}, V={dv} (the intra-chunk kernel needs 64 or 128)"
  return None


def _split(x):
  """x (float32) = hi + lo with both bf16 (hi carries 8 bits, lo the next 8)."""
  hi = x.astype(_BF16)
  return hi, (x - hi.astype(_F32)).astype(_BF16)


def _stage(operand, x, square=False):
  """Writes float32 registers x [C, C] into an operand's bf16 smem tiles (hi, lo[, hi again]).

  square: also write the copy of hi that x·x needs (Mosaic GPU's layout inference rejects a
  wgmma whose two operands are the same ref)."""
  hi, lo = _split(x)
  operand[0][...], operand[1][...] = hi, lo
  if square:
    operand[2][...] = hi


def _split_products(*operands):
  """Each (a, b) of staged operands → a·b in float32 on wgmma ("bf16x3"), all in one wgmma
  group: independent products of one round share a single fence and wait."""
  plgpu.commit_smem()
  groups = []
  for a, b in operands:
    b_hi = b[2] if a is b else b[0]
    groups.append((CHUNK, CHUNK, [(a[0], b_hi), (a[0], b[1]), (a[1], b_hi)]))
  return mc.matmuls(*groups)


def _unit_lower_inverse(lmat, ii, jj, tiles):
  """(I + L)^{-1} for strictly lower L [C, C] in registers (the module doc's blocked form), on
  five [C, C] bf16 smem tiles, in seven rounds of wgmma (products of a round are independent)."""
  shift = BLOCK.bit_length() - 1
  same_block = lax.shift_right_logical(ii, shift) == lax.shift_right_logical(jj, shift)
  d = jnp.where(same_block, lmat, 0.0)
  e = lmat - d
  eye = jnp.where(ii == jj, 1.0, 0.0).astype(_F32)
  s, t = (tiles[0], tiles[1], tiles[4]), (tiles[2], tiles[3])
  # (I + D)^{-1} = (I − D)(I + D²)(I + D⁴)(I + D⁸): each power and each partial product from
  # the previous power, so a power and a factor share a round.
  with jax.named_scope("diagonal blocks"):
    _stage(s, d, square=True)
    (pw,) = _split_products((s, s))                 # D²
    z = eye - d
    for last in (False, False, True):
      _stage(s, pw, square=not last)
      _stage(t, z)
      if last:
        (zp,) = _split_products((t, s))
      else:
        pw, zp = _split_products((s, s), (t, s))      # next power, z · current power
      z = z + zp
  with jax.named_scope("off-diagonal"):
    _stage(s, e)
    _stage(t, z)
    (f,) = _split_products((t, s))                  # F = (I + D)^{-1} E
    _stage(s, f, square=True)                       # t still holds z
    f2, fz = _split_products((s, s), (s, t))
    w = z - fz                                      # (I − F) z
    _stage(s, f2)
    _stage(t, w)
    (f2w,) = _split_products((s, t))
  return w + f2w                                    # (I + F²)(I − F) z


def _in_specs(q_ref, k_ref, v_ref, vec_refs, bi, hi, kh, rows):
  """The TMA sources of one chunk: q, k, v tiles and the per-row vectors."""
  srcs = [q_ref.at[bi, rows, kh, :], k_ref.at[bi, rows, kh, :], v_ref.at[bi, rows, hi, :]]
  for r in vec_refs:   # beta, g, gx are [B, HV, T]; seg, cont, keep are [B, T]
    srcs.append(r.at[bi, hi, rows] if len(r.shape) == 3 else r.at[bi, rows])
  return srcs


def _copy_in(srcs, dsts, bars):
  for i, (src, dst) in enumerate(zip(srcs, dsts)):
    plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
  for i in range(len(srcs)):
    plgpu.barrier_wait(bars.at[i])


def _row_factors(vec_s):
  """β, the entry factor e^{G}(·cont) and the exit factor e^{Gx}(·keep), as row vectors."""
  beta_s, g_s, gx_s, _, *seg_s = vec_s
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  beta_row = plgpu.load(beta_s, layout=row_layout)
  entry_row = jnp.exp(plgpu.load(g_s, layout=row_layout))   # entry state decay up to each row
  exit_row = jnp.exp(plgpu.load(gx_s, layout=row_layout))   # from each row to the chunk's end
  if seg_s:
    _, cont_s, keep_s, _ = seg_s
    entry_row = entry_row * plgpu.load(cont_s, layout=row_layout)
    exit_row = exit_row * plgpu.load(keep_s, layout=row_layout)
  return beta_row, entry_row, exit_row


def _chunk_terms(q_s, k_s, vec_s, with_qk=True):
  """What forward and backward share: QKᵀ, KKᵀ, the masked decay Γ and the row factors.

  vec_s: the smem vectors of `_vec_inputs` (G and the segment ids twice: Mosaic GPU's layout
  inference gives one smem ref one register layout, and Γ needs them as rows and as columns).
  """
  c = CHUNK
  _, g_s, _, g_col_s, *seg_s = vec_s
  row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
  g_row = plgpu.load(g_s, layout=row_layout)
  g_col = plgpu.load(g_col_s, layout=col_layout)
  beta_row, entry_row, exit_row = _row_factors(vec_s)
  kt = k_s.transpose((1, 0))
  if with_qk:
    qk, kk = mc.matmuls((c, c, [(q_s, kt)]), (c, c, [(k_s, kt)]))
  else:
    qk, (kk,) = None, mc.matmuls((c, c, [(k_s, kt)]))
  ii, jj = mc.iota(CHUNK, 0), mc.iota(CHUNK, 1)
  lower = ii >= jj
  diff = mc.rows(g_row, (c, c)) - mc.cols(g_col, (c, c))
  decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)
  if seg_s:
    ids, _, _, ids_col = seg_s
    same = (mc.rows(plgpu.load(ids, layout=row_layout), (c, c))
            == mc.cols(plgpu.load(ids_col, layout=col_layout), (c, c)))
    decay = jnp.where(same, decay, 0.0)
  lmat = jnp.where(ii > jj, kk * decay * mc.rows(beta_row, (c, c)), 0.0)
  return dict(qk=qk, kk=kk, decay=decay, lmat=lmat, ii=ii, jj=jj, beta_row=beta_row,
              entry_row=entry_row, exit_row=exit_row)


def _dims(q, v):
  """(B, T, H, K, HV, V, number of chunks, value heads per key head)."""
  b, t, h, dk = q.shape
  hv, dv = v.shape[2], v.shape[3]
  return b, t, h, dk, hv, dv, t // CHUNK, hv // h


def _vec_inputs(beta, g, gx, segments):
  """The per-row vector inputs in kernel order (see `_chunk_terms`)."""
  vecs = (beta, g, gx, g)
  if segments is not None:
    seg, cont, keep = segments
    vecs += (seg, cont, keep, seg)
  return vecs


def _grid(b, hv, nc, dv):
  """One CTA per (batch row, value head, chunk) on a 1-D grid.

  Mosaic GPU launches a 3-D Pallas grid (c, h, b) as CUDA (x = b, y = h, z = c), and CUDA caps
  grid y and z at 65535: a chunk axis there failed to launch once T > 65535·64 ≈ 4.2M tokens.
  Grid x takes up to 2^31 − 1 CTAs (B·HV·T/64 < B·T·HV, bounded by `check_index_range`);
  `_cta_coords` unflattens in the order the 3-D grid launched in (batch fastest, then heads,
  then chunks).
  """
  sp.check_index_range(b, nc * CHUNK, hv, dv)
  return dict(grid=(b * hv * nc,), grid_names=("cta",))


def _cta_coords(b, hv):
  """(batch row, value head, chunk) of this CTA (see `_grid`)."""
  i = lax.axis_index("cta")
  return lax.rem(i, b), lax.rem(lax.div(i, b), hv), lax.div(i, b * hv)


def _vec_specs(packed):
  return [plgpu.SMEM((CHUNK,), _F32)] * (8 if packed else 4)


def intra_chunk_fwd(q, k, v, beta, g, gx, segments=None, *, scale: float, with_inverse=False,
                    profile_dir: str = "", interpret=None):
  """The intra-chunk part of the delta rule (DeltaNet / GDN) for every chunk; see the module doc.

  segments: None or (seg, cont, keep), each `[B, T]` float32.
  with_inverse: also return M = (I + L)^{-1} `[B, HV, Nc, C, C]` bf16, exactly the operand the
    forward applied: `intra_chunk_bwd` takes it instead of inverting again (8 KiB per chunk).
  profile_dir: if set, Mosaic GPU's in-kernel profiler writes a trace of the kernel's named
    phases (per CTA, Chrome trace JSON) there on every call; for measurement, not training.
  Returns (ny, qg, p, u, kg[, m]), the inputs of `state_passing.state_passing_fwd` besides gc
  and s0.
  """
  outs = _intra_chunk_fwd(q, k, v, beta, g, gx, segments, scale=float(scale),
                          with_inverse=bool(with_inverse), profile_dir=profile_dir,
                          interpret=interpret)
  return mc.sync_if_interpreted(outs, interpret)


@functools.partial(jax.jit, static_argnames=("scale", "with_inverse", "profile_dir", "interpret"))
def _intra_chunk_fwd(q, k, v, beta, g, gx, segments, *, scale, with_inverse, interpret,
                     profile_dir=""):
  b, t, h, dk, hv, dv, nc, n_rep = _dims(q, v)
  c = CHUNK
  packed = segments is not None
  vecs = _vec_inputs(beta, g, gx, segments)
  out_type = (jax.ShapeDtypeStruct((b, hv, nc, c, dk), _BF16),   # ny
              jax.ShapeDtypeStruct((b, hv, nc, c, dk), _BF16),   # qg
              jax.ShapeDtypeStruct((b, hv, nc, c, c), _BF16),    # p
              jax.ShapeDtypeStruct((b, hv, nc, c, dv), _F32),    # u
              jax.ShapeDtypeStruct((b, hv, nc, c, dk), _BF16))   # kg
  if with_inverse:
    out_type += (jax.ShapeDtypeStruct((b, hv, nc, c, c), _BF16),)  # m

  def kernel(q_ref, k_ref, v_ref, *refs):
    vec_refs, (ny_ref, qg_ref, p_ref, u_ref, kg_ref, *m_ref) = refs[:len(vecs)], refs[len(vecs):]
    bi, hi, ci = _cta_coords(b, hv)
    rows = pl.ds(ci * c, c)

    # Shared memory in two phases (sequential `run_scoped`s reuse the same bytes), so that two
    # CTAs fit on an SM: 108 KiB at K = V = 128 (q, k, v stay for the whole kernel).
    def body(q_s, k_s, v_s, bars, *vec_s):
      with jax.named_scope("load"):
        _copy_in(_in_specs(q_ref, k_ref, v_ref, vec_refs, bi, hi, hi // n_rep, rows),
                 [q_s, k_s, v_s, *vec_s], bars)
      with jax.named_scope("QK, KK, decay"):
        tm = _chunk_terms(q_s, k_s, vec_s)

      def inverse_phase(*tiles):
        tiles[0][...] = (tm["qk"] * (tm["decay"] * scale)).astype(_BF16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(tiles[0], p_ref.at[bi, hi, ci])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the inverse reuses the tile
        return _unit_lower_inverse(tm["lmat"], tm["ii"], tm["jj"], tiles)

      cc = mc.smem((c, c), _BF16)
      with jax.named_scope("P out, inverse"):
        m = pl.run_scoped(inverse_phase, cc, cc, cc, cc, cc)

      def output_phase(m_s, rk_s, u_s):
        # Right-hand sides with β (and the entry decay for the keys) folded in, rounded once;
        # q, k, v are read for the last time here, so their tiles then stage QG, KG and βV.
        # One tile at a time keeps few [C, D] float32 arrays live.
        m_s[...] = m.astype(_BF16)
        entry = mc.rows(tm["entry_row"], (c, dk))
        kv = k_s[...].astype(_F32)
        rk_s[...] = (kv * mc.rows(tm["beta_row"], (c, dk)) * entry).astype(_BF16)
        k_s[...] = (kv * mc.rows(tm["exit_row"], (c, dk))).astype(_BF16)
        q_s[...] = (q_s[...].astype(_F32) * (entry * scale)).astype(_BF16)
        v_s[...] = (v_s[...].astype(_F32) * mc.rows(tm["beta_row"], (c, dv))).astype(_BF16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_s, qg_ref.at[bi, hi, ci])
        plgpu.copy_smem_to_gmem(k_s, kg_ref.at[bi, hi, ci])
        if with_inverse:
          plgpu.copy_smem_to_gmem(m_s, m_ref[0].at[bi, hi, ci])
        y, u = mc.matmuls((c, dk, [(m_s, rk_s)]), (c, dv, [(m_s, v_s)]))
        rk_s[...] = (-y).astype(_BF16)                   # the wgmmas are done reading rk_s
        u_s[...] = u
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(rk_s, ny_ref.at[bi, hi, ci])
        plgpu.copy_smem_to_gmem(u_s, u_ref.at[bi, hi, ci])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      with jax.named_scope("Y, U, outputs"):
        pl.run_scoped(output_phase, cc, mc.smem((c, dk), _BF16), mc.smem((c, dv), _F32))

    pl.run_scoped(
        body,
        mc.smem((c, dk), _BF16), mc.smem((c, dk), _BF16), mc.smem((c, dv), _BF16),
        plgpu.Barrier(num_barriers=3 + len(vecs)), *_vec_specs(packed))

  return plgpu.kernel(kernel, out_type=out_type, interpret=interpret,
                      compiler_params=mc.compiler_params(profile_dir),
                      **_grid(b, hv, nc, dv))(q, k, v, *vecs)


def intra_chunk_bwd(q, k, v, beta, g, gx, segments, m, dny, dp, du, *, scale: float,
                    profile_dir: str = "", interpret=None):
  """Backward of the kernel's NY, P and U for every chunk (QG and KG are elementwise: the caller).

  With dY = −dNY, dR = Mᵀ[dY | dU] and dL = −dR_k Yᵀ − dR_v Uᵀ (from δM = −M δL M):
    dA = s·dP ⊙ Γ,  dB = dL ⊙ β_row ⊙ Γ (strict),  W = dA ⊙ QKᵀ + dB ⊙ KKᵀ (= dΓ ⊙ Γ)
    dq = dA·K,  dk = dAᵀ·Q + (dB + dBᵀ)·K + (β e)_row ⊙ dR_k,  dv = β_row ⊙ dR_v
    dβ = Σ_j dL ⊙ KKᵀ ⊙ Γ + Σ_k dR_k ⊙ K ⊙ e + Σ_v dR_v ⊙ V
    dG_row = e β Σ_k dR_k ⊙ K + Σ_j W,  dG_col = Σ_i W   (dG_i += dG_row_i − dG_col_i)
  (e = the entry factor e^{G}·cont). Inputs as `intra_chunk_fwd` plus its M (`with_inverse`)
  and dny `[B, HV, Nc, C, K]`, dp `[B, HV, Nc, C, C]` and du `[B, HV, Nc, C, V]`, all bf16.
  Returns dq, dk `[B, HV, Nc, C, K]` (per value head), dv `[B, HV, Nc, C, V]`, and dbeta,
  dg_row, dg_col `[B, HV, T]`, all float32.
  """
  outs = _intra_chunk_bwd(q, k, v, beta, g, gx, segments, m, dny, dp, du, scale=float(scale),
                          profile_dir=profile_dir, interpret=interpret)
  return mc.sync_if_interpreted(outs, interpret)


@functools.partial(jax.jit, static_argnames=("scale", "profile_dir", "interpret"))
def _intra_chunk_bwd(q, k, v, beta, g, gx, segments, m, dny, dp, du, *, scale, interpret,
                     profile_dir=""):
  b, t, h, dk, hv, dv, nc, n_rep = _dims(q, v)
  c = CHUNK
  packed = segments is not None
  vecs = _vec_inputs(beta, g, gx, segments)
  out_type = (jax.ShapeDtypeStruct((b, hv, nc, c, dk), _F32),    # dq
              jax.ShapeDtypeStruct((b, hv, nc, c, dk), _F32),    # dk
              jax.ShapeDtypeStruct((b, hv, nc, c, dv), _F32),    # dv
              jax.ShapeDtypeStruct((b, hv, t), _F32),            # dbeta
              jax.ShapeDtypeStruct((b, hv, t), _F32),            # dg_row
              jax.ShapeDtypeStruct((b, hv, t), _F32))            # dg_col

  def kernel(q_ref, k_ref, v_ref, *refs):
    nv = len(vecs)
    vec_refs = refs[:nv]
    m_ref, dny_ref, dp_ref, du_ref = refs[nv:nv + 4]
    dq_ref, dk_ref, dv_ref, dbeta_ref, dgr_ref, dgc_ref = refs[nv + 4:]
    bi, hi, ci = _cta_coords(b, hv)
    rows = pl.ds(ci * c, c)

    def body(q_s, k_s, v_s, m_s, dny_s, dp_s, du_s, bars, *vec_s):
      srcs = _in_specs(q_ref, k_ref, v_ref, vec_refs, bi, hi, hi // n_rep, rows)
      srcs += [m_ref.at[bi, hi, ci], dny_ref.at[bi, hi, ci], dp_ref.at[bi, hi, ci],
               du_ref.at[bi, hi, ci]]
      with jax.named_scope("load"):
        _copy_in(srcs, [q_s, k_s, v_s, *vec_s, m_s, dny_s, dp_s, du_s], bars)
      beta_row, entry_row, _ = _row_factors(vec_s)
      be_k = mc.rows(beta_row * entry_row, (c, dk))
      cc = mc.smem((c, c), _BF16)

      def grads_phase(rk_s, rv_s, ones, t_a, t_b, t_whi, t_wlo, vout, stage_k, *stage_v):
        stage_v = stage_v[0] if stage_v else stage_k
        with jax.named_scope("Y, U"):
          rk_s[...] = (k_s[...].astype(_F32) * be_k).astype(_BF16)
          rv_s[...] = (v_s[...].astype(_F32) * mc.rows(beta_row, (c, dv))).astype(_BF16)
          plgpu.commit_smem()
          y, u = mc.matmuls((c, dk, [(m_s, rk_s)]), (c, dv, [(m_s, rv_s)]))
          rk_s[...] = y.astype(_BF16)                     # rk_s, rv_s now hold Y and U
          rv_s[...] = u.astype(_BF16)
        with jax.named_scope("dR_v, dv"):
          (d_rv,) = mc.matmuls((c, dv, [(m_s.transpose((1, 0)), du_s)]))
          dbeta = jnp.sum(d_rv * v_s[...].astype(_F32), axis=1)
          stage_v[...] = d_rv * mc.rows(beta_row, (c, dv))
          du_s[...] = d_rv.astype(_BF16)                  # du_s now holds dR_v
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(stage_v, dv_ref.at[bi, hi, ci])
        with jax.named_scope("dR_k"):
          (d_rk,) = mc.matmuls((c, dk, [(m_s.transpose((1, 0)), dny_s)]))
          d_rk = -d_rk                                    # dY = −dNY
          rk_dot = jnp.sum(d_rk * k_s[...].astype(_F32), axis=1)   # Σ_k dR_k ⊙ K
          dny_s[...] = d_rk.astype(_BF16)                 # dny_s now holds dR_k
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          stage_k[...] = d_rk * be_k
          plgpu.commit_smem()
        with jax.named_scope("dL"):
          (d_l,) = mc.matmuls((c, c, [(dny_s, rk_s.transpose((1, 0))),
                                      (du_s, rv_s.transpose((1, 0)))]))
        with jax.named_scope("QK, KK, decay; dA, dB, W"):
          tm2 = _chunk_terms(q_s, k_s, vec_s)
          ii, jj, decay = tm2["ii"], tm2["jj"], tm2["decay"]
          d_l = jnp.where(ii > jj, -d_l, 0.0)
          d_b = d_l * decay * mc.rows(beta_row, (c, c))
          d_a = dp_s[...].astype(_F32) * (decay * scale)
          w = d_a * tm2["qk"] + d_b * tm2["kk"]
          dbeta = dbeta + jnp.sum(d_l * tm2["kk"] * decay, axis=1) + rk_dot * entry_row
          dg_row = rk_dot * beta_row * entry_row + jnp.sum(w, axis=1)
          t_a[...] = d_a.astype(_BF16)
          t_b[...] = d_b.astype(_BF16)
          t_whi[...], t_wlo[...] = _split(w)
          ones[...] = jnp.where(ii >= 0, 1.0, 0.0).astype(_BF16)   # Wᵀ·1 gives column sums
          plgpu.commit_smem()
        with jax.named_scope("dk, column sums"):
          dkk, colsum = mc.matmuls(
              (c, dk, [(t_a.transpose((1, 0)), q_s), (t_b, k_s), (t_b.transpose((1, 0)), k_s)]),
              (c, c, [(t_whi.transpose((1, 0)), ones), (t_wlo.transpose((1, 0)), ones)]))
          stage_k[...] = dkk + stage_k[...]
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(stage_k, dk_ref.at[bi, hi, ci])
          dg_col = jnp.sum(colsum, axis=1) * (1.0 / c)
        with jax.named_scope("dq, vectors out"):
          (dq,) = mc.matmuls((c, dk, [(t_a, k_s)]))
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          stage_k[...] = dq
          for i, x in enumerate((dbeta, dg_row, dg_col)):
            vout.at[i][...] = x
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(stage_k, dq_ref.at[bi, hi, ci])
          for i, dst in enumerate((dbeta_ref, dgr_ref, dgc_ref)):
            plgpu.copy_smem_to_gmem(vout.at[i], dst.at[bi, hi, rows])
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      pl.run_scoped(grads_phase, mc.smem((c, dk), _BF16), mc.smem((c, dv), _BF16),
                    cc, cc, cc, cc, cc, plgpu.SMEM((3, c), _F32), mc.smem((c, dk), _F32),
                    *([] if dv == dk else [mc.smem((c, dv), _F32)]))

    cc = mc.smem((c, c), _BF16)
    pl.run_scoped(
        body,
        mc.smem((c, dk), _BF16), mc.smem((c, dk), _BF16), mc.smem((c, dv), _BF16), cc,
        mc.smem((c, dk), _BF16), cc, mc.smem((c, dv), _BF16),
        plgpu.Barrier(num_barriers=7 + len(vecs)), *_vec_specs(packed))

  return plgpu.kernel(kernel, out_type=out_type, interpret=interpret,
                      compiler_params=mc.compiler_params(profile_dir),
                      **_grid(b, hv, nc, dv))(q, k, v, *vecs, m, dny, dp, du)


def intra_chunk_reference(q, k, v, beta, g, gx, segments=None, *, scale: float):
  """The same outputs in float32 XLA (HIGHEST, exact inverse by `triangular_solve`): the oracle."""
  b, t, h, dk = q.shape
  hv = v.shape[2]
  c, nc = CHUNK, t // CHUNK
  hi = lax.Precision.HIGHEST
  f = lambda x: x.astype(_F32)
  rep = lambda x: jnp.repeat(x, hv // h, axis=2)
  chunks = lambda x: jnp.moveaxis(f(x).reshape(b, nc, c, hv, -1), 3, 1)  # [B, HV, Nc, C, D]
  qc, kc, vc = chunks(rep(q)), chunks(rep(k)), chunks(v)
  per_row = lambda x: f(x).reshape(b, hv, nc, c)
  bc, gc_, gxc = per_row(beta), per_row(g), per_row(gx)
  lower = jnp.tril(jnp.ones((c, c), bool))
  diff = gc_[..., :, None] - gc_[..., None, :]
  decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)
  entry, exit_ = jnp.exp(gc_), jnp.exp(gxc)
  if segments is not None:
    seg, cont, keep = (x.reshape(b, 1, nc, c) for x in segments)
    decay = decay * (seg[..., :, None] == seg[..., None, :])
    entry, exit_ = entry * cont, exit_ * keep
  p = scale * jnp.einsum("...ik,...jk->...ij", qc, kc, precision=hi) * decay
  lmat = bc[..., :, None] * jnp.einsum("...ik,...jk->...ij", kc, kc, precision=hi) * decay
  lmat = jnp.where(jnp.tril(jnp.ones((c, c), bool), k=-1), lmat, 0.0)
  rhs = jnp.concatenate([kc * (bc * entry)[..., None], vc * bc[..., None]], axis=-1)
  sol = lax.linalg.triangular_solve(jnp.eye(c, dtype=_F32) + lmat, rhs, left_side=True,
                                    lower=True, unit_diagonal=True)
  return (-sol[..., :dk], scale * qc * entry[..., None], p, sol[..., dk:],
          kc * exit_[..., None])
