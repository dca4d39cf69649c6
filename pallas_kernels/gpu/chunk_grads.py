"""The delta rule's per-chunk gradients (DeltaNet, GDN) in one Mosaic GPU kernel: what the
backward has left to do once the reverse walk (`chunk_walk_reverse`) has made dE and the state
cotangents. It replaces, on the walk path, XLA's state-pass products, the intra-chunk backward
kernel, the chunk-major ↔ `[B, T, H, D]` transposes and the gate reductions between them.

One CTA (one warpgroup) per (batch row, value head, chunk) reads, by TMA and in the layouts
their producers wrote: q, k, v, E and dO `[B, T, H(V), D]`; the gate-free inverse T0; the
gates and β as rows; the state entering the chunk Sᵀ and the cotangent of the state leaving it
dS'ᵀ (`[V, K]`, as the walks store them); dEᵀ (`[V, C]`). With Γ_ij = e^{G_i − G_j} (i ≥ j),
M = T0 ⊙ Γ, P = s q kᵀ ⊙ Γ, e = e^{G}, x = e^{G_C − G}, γ = e^{G_C} (docs/MATH.md §3):

    dA  = s (dO Eᵀ) ⊙ Γ                    dq = dA k + (s e ⊙ dO) Sᵀ
    dR_v = Mᵀ dE        dv = β ⊙ dR_v       dR_k = −Mᵀ (dE Sᵀ) = −dR_v Sᵀ
    Y = M (β e ⊙ k),  U = M (β ⊙ v),       dL = −(dR_k Yᵀ + dR_v Uᵀ) on i > j
    dB = dL ⊙ β_row ⊙ Γ                    dk = dAᵀ q + (dB + dBᵀ) k + (x ⊙ E) dS'ᵀ + β e ⊙ dR_k
    dβ = Σ_j dL ⊙ kkᵀ ⊙ Γ + e Σ_k dR_k ⊙ k + Σ_v dR_v ⊙ v

The gate gradient needs no column sums. Every term in G enters through q e^{G_i}, k e^{±G},
Γ and γ; collecting them (docs/MATH.md §3.6) leaves, for the rows of the chunk,

    dG_i = Σ_k q dq − Σ_k k dk + 2 (β e Σ_k dR_k ⊙ k + β Σ_j dL ⊙ kkᵀ ⊙ Γ)_i

and, at the chunk's last row, the chunk's sum of what x and γ contribute, Σ_i x_i k_i·(E dS'ᵀ)_i
+ γ ⟨S, dS'⟩, which the kernel writes as a row vector ("tail") that the wrapper sums. (The
identity could give the x part too, as a difference of sums; under strong decay, where x is
tiny, that difference lost all precision, so the kernel makes (x ⊙ E) dS'ᵀ on its own.)

Every product takes bf16 operands and a float32 accumulator; dq, dk (per value head) and dv
leave in bf16, dβ and dG in float32. Shared memory at K = V = 128: 222 KiB (one CTA per SM);
tiles of the same shape are reused once their first content is dead (see the kernel).
Linear attention (t0 None: no erase, E = v) keeps only dA, dq, dk = dAᵀ q + E dS'ᵀ and dv = dE
(a kernel of its own below, `_linear_kernel`, on a third of the shared memory).

`warpgroups=2` (`_split_kernel`, K = V): the same products on two warpgroups of one CTA. The
first makes dA, dq and its share of dk (dAᵀ q and the exit term) while the second makes M, dv,
dR, Y, U, dL and dB; the second hands dB, −β e ⊙ dR_v and its vector terms over in shared
memory and signals one mbarrier, and the first finishes dk. One warpgroup's products wait on
their own results (wgmma groups, reductions, exponentials); two let one issue while the other
waits, as jla's per-chunk backward does with three.

Scope: C = 64, K and V in {64, 128}, no packed rows (as the walks). Runs in JAX's Mosaic GPU
interpreter; `chunk_grads_reference` (the VJP of the chunk map, float32, exact inverse) is its
oracle.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu import mosaic_common as mc
from pallas_kernels.gpu.intra_chunk import _cta_coords, _grid

CHUNK = 64
MM_DTYPE = jnp.bfloat16
_F32 = jnp.float32
_WG = plgpu.Layout.WGMMA
_ROWS = plgpu.Layout.WGMMA.reduce(1)
_COLS = plgpu.Layout.WGMMA.reduce(0)


def supported(chunk: int, dk: int, dv: int) -> str | None:
  """None if the kernel takes these sizes, else why not (V = 256 would not fit shared memory)."""
  if chunk != CHUNK:
    return f"chunk_size={chunk} (chunk_grads needs {CHUNK})"
  if dk not in (64, 128) or dv not in (64, 128):
    return f"head dims K={dk}, V={dv} (chunk_grads needs 64 or 128)"
  return None


def chunk_grads(q, k, v, e, do, t0, g, beta, h_t, dh_t, de_t, *, scale: float,
                gated: bool = True, approx_math: bool = False, join_exit: bool = False,
                warpgroups: int = 1, profile_dir: str = "", interpret=None):
  """(dq, dk, dv, dβ, dG) of the delta rule's chunk form, per value head.

  Args:
    q, k: `[B, T, H, K]` bf16; v, e (the pseudo-values the forward used), do: `[B, T, HV, V]`
      bf16; t0: `[B, HV, Nc, C, C]` bf16 gate-free inverses, or None for linear attention
      (then v, g and beta are not read and dβ, dG are None); g: `[B, HV, T]` float32 chunk
      cumulative log gates (ignored when not gated); beta `[B, HV, T]` float32;
      h_t, dh_t: `[B, HV, Nc, V, K]` bf16, the state entering each chunk and the cotangent of
      the state leaving it, transposed; de_t: `[B, HV, Nc, V, C]` bf16, dE transposed.
    approx_math: let Mosaic GPU use approximate math (e^x as ex2.approx.ftz of x·log2 e:
      ~2⁻²² relative, and −1e4 log gates still give 0). Off here; the op turns it on
      (`GpuTuning.approx_math`): on the H200 it took GDN fwd+bwd from 1.202 to 1.164 ms.
    join_exit: (gated) make the exit term (x ⊙ E) dS'ᵀ once, as a second accumulator issued
      with dk's wgmma group, and add it to dk in registers, instead of a group of its own
      before dk's group, which makes it again. One [C, V] × [V, K] product fewer a CTA, two
      [C, K] float32 accumulators live at once. Same result up to float32 summation order;
      on the H200 (2026-12-04) 500 µs a call against 519 (`experiments/bench_chunk_grads.py
      --join_exit=false,true`).
    warpgroups: 1 (the kernel above) or 2 (`_split_kernel`, DeltaNet / GDN with K = V: the
      dq side and the dv / dR / dL side of the chunk on two warpgroups that run at once, dk
      joined at the end; join_exit is implied). The same products in the same precision.
    profile_dir: if set, Mosaic GPU's in-kernel profiler writes a trace of the kernel's named
      phases there on every call (`experiments.kernel_trace` reads it); for measurement.
  Returns:
    dq, dk `[B, T, HV, K]` bf16 (each value head's share: GVA sums them), dv `[B, T, HV, V]`
    bf16, dβ `[B, HV, T]` float32 and dG `[B, HV, T]` float32 (None when not gated): the
    gradient with respect to the chunk cumulative gates G.
  """
  if warpgroups not in (1, 2):
    raise ValueError(f"chunk_grads: warpgroups={warpgroups!r} is not 1 or 2")
  if warpgroups == 2 and (t0 is None or q.shape[-1] != v.shape[-1]):
    raise ValueError("chunk_grads: warpgroups=2 takes the delta rule (t0 given) with K = V, "
                     f"not K={q.shape[-1]}, V={v.shape[-1]}" + (", t0=None" if t0 is None else ""))
  outs = _chunk_grads(q, k, v, e, do, t0, g, beta, h_t, dh_t, de_t, scale=float(scale),
                      gated=bool(gated), approx_math=bool(approx_math),
                      join_exit=bool(join_exit), warpgroups=int(warpgroups),
                      profile_dir=profile_dir, interpret=interpret)
  outs = mc.sync_if_interpreted(outs, interpret)
  if t0 is None:
    return (*outs, None, None)
  if not gated:
    return (*outs, None)
  dq, dk, dv, dbeta, dg_rows, tail = outs
  b, hv, t = dg_rows.shape
  dg = dg_rows.reshape(b, hv, t // CHUNK, CHUNK)
  dg = dg.at[..., -1].add(jnp.sum(tail.reshape(dg.shape), axis=-1))
  return dq, dk, dv, dbeta, dg.reshape(b, hv, t)


@functools.partial(jax.jit, static_argnames=("scale", "gated", "approx_math", "join_exit",
                                             "warpgroups", "profile_dir", "interpret"))
def _chunk_grads(q, k, v, e, do, t0, g, beta, h_t, dh_t, de_t, *, scale, gated, interpret,
                 approx_math=False, join_exit=False, warpgroups=1, profile_dir=""):
  b, t, h, dk = q.shape
  hv, dv = v.shape[2], v.shape[3]
  c = CHUNK
  reason = supported(c, dk, dv)
  if reason or t % c or hv % h:
    raise ValueError("chunk_grads: " + (reason or f"T={t} must be a multiple of {c} and "
                                                  f"HV={hv} a multiple of H={h}") + ".")
  nc, n_rep = t // c, hv // h
  sds = jax.ShapeDtypeStruct
  params = dict(compiler_params=mc.compiler_params(profile_dir, approx_math), interpret=interpret,
                **_grid(b, hv, nc, dv))
  grads = (sds((b, t, hv, dk), MM_DTYPE), sds((b, t, hv, dk), MM_DTYPE),
           sds((b, t, hv, dv), MM_DTYPE))
  if t0 is None:
    return plgpu.kernel(functools.partial(_linear_kernel, b=b, hv=hv, n_rep=n_rep, scale=scale),
                        out_type=grads, **params)(q, k, e, do, h_t, dh_t, de_t)
  out_type = grads + (sds((b, hv, t), _F32),)
  if gated:
    out_type += (sds((b, hv, t), _F32), sds((b, hv, t), _F32))     # dG rows, tail
  n_vec = len(out_type) - 3
  if warpgroups == 2:
    return plgpu.kernel(
        functools.partial(_split_kernel, b=b, hv=hv, n_rep=n_rep, scale=scale, gated=gated),
        out_type=out_type, scratch_types=_split_scratch(dk, n_vec), num_threads=2,
        thread_name="wg", **params)(q, k, v, e, do, t0, g, beta, h_t, dh_t, de_t)

  def kernel(q_ref, k_ref, v_ref, e_ref, do_ref, t0_ref, g_ref, beta_ref, h_ref, dh_ref, de_ref,
             *refs):
    dq_ref, dk_ref, dv_ref, *vec_refs = refs
    bi, hi, ci = _cta_coords(b, hv)
    ki = lax.div(hi, n_rep)
    rows = pl.ds(ci * c, c)

    def body(q_s, k_s, v_s, e_s, do_s, de_s, h_s, dh_s, m_s, ta_s, tb_s, rk_s, drk_s, g_rows,
             g_cols, b_rows, vout, bars):
      _issue_loads((q_ref, k_ref, v_ref, e_ref, do_ref, t0_ref, g_ref, beta_ref, h_ref, dh_ref,
                    de_ref), (q_s, k_s, v_s, e_s, do_s, m_s, g_rows, g_cols, b_rows, h_s, dh_s,
                              de_s), (bi, hi, ci, ki), bars)
      arrived = lambda *names: [plgpu.barrier_wait(bars.at[i]) for i in names]
      # Row sums against k reload it from shared memory rather than hold [C, K] float32 live.
      k_sum = lambda x: jnp.sum(k_s[...].astype(_F32) * x, axis=1)

      with jax.named_scope("gates, M"):
        arrived(0, 1, 2, 3)
        beta_row = plgpu.load(b_rows, layout=_ROWS)
        lower = mc.iota(c, 0) >= mc.iota(c, 1)
        if gated:
          g_row = plgpu.load(g_rows, layout=_ROWS)
          g_last = g_rows[c - 1]
          entry, exit_ = jnp.exp(g_row), jnp.exp(g_last - g_row)
          be_row = beta_row * entry

          decay = lambda: _decay_mask(g_row, g_cols, lower)
          gam = decay()   # kept for dA, next: little else is live yet (the dL phase remakes it)
          m_s[...] = (m_s[...].astype(_F32) * gam).astype(MM_DTYPE)    # M = T0 ⊙ Γ
        else:
          be_row = beta_row
          decay = lambda: jnp.where(lower, 1.0, 0.0)     # T0 is M already
          gam = decay()

      with jax.named_scope("dA, dq"):
        arrived(4, 5, 6, 7)
        (dp,) = mc.matmuls((c, c, [(do_s, e_s.T)]))
        d_a = dp * (gam * scale)
        ta_s[...] = d_a.astype(MM_DTYPE)
        # dO and E are read for the last time as they are: dO becomes s e ⊙ dO, E x ⊙ E.
        if gated:
          do_s[...] = (do_s[...].astype(_F32) * mc.rows(entry * scale, (c, dv))).astype(MM_DTYPE)
          e_s[...] = (e_s[...].astype(_F32) * mc.rows(exit_, (c, dv))).astype(MM_DTYPE)
        else:
          do_s[...] = (do_s[...].astype(_F32) * scale).astype(MM_DTYPE)
        plgpu.commit_smem()
        arrived(8)
        (dq,) = mc.matmuls((c, dk, [(ta_s, k_s), (do_s, h_s)]))
        qdq = jnp.sum(q_s[...].astype(_F32) * dq, axis=1)
        rk_s[...] = dq.astype(MM_DTYPE)               # rk_s stages dq, then holds β e k and Y
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(rk_s, dq_ref.at[bi, rows, hi])

      with jax.named_scope("dv, dR"):
        arrived(9, 10)
        (d_rv,) = mc.matmuls((c, dv, [(m_s.T, de_s.T)]))
        dbeta = jnp.sum(d_rv * v_s[...].astype(_F32), axis=1)
        do_s[...] = (d_rv * mc.rows(beta_row, (c, dv))).astype(MM_DTYPE)   # dv (dq is done)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(do_s, dv_ref.at[bi, rows, hi])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        do_s[...] = d_rv.astype(MM_DTYPE)             # do_s holds dR_v from here on
        v_s[...] = (v_s[...].astype(_F32) * mc.rows(beta_row, (c, dv))).astype(MM_DTYPE)  # β v
        rk_s[...] = (k_s[...].astype(_F32) * mc.rows(be_row, (c, dk))).astype(MM_DTYPE)
        plgpu.commit_smem()
        (d_rk,) = mc.matmuls((c, dk, [(do_s, h_s)]))
        d_rk = -d_rk
        rk_dot = k_sum(d_rk)
        drk_s[...] = d_rk.astype(MM_DTYPE)
        y, u = mc.matmuls((c, dk, [(m_s, rk_s)]), (c, dv, [(m_s, v_s)]))
        rk_s[...] = y.astype(MM_DTYPE)
        v_s[...] = u.astype(MM_DTYPE)
        plgpu.commit_smem()

      with jax.named_scope("dL, dB"):
        d_l, kk = mc.matmuls((c, c, [(drk_s, rk_s.T), (do_s, v_s.T)]), (c, c, [(k_s, k_s.T)]))
        gam = decay()
        lk = jnp.where(mc.iota(c, 0) > mc.iota(c, 1), -d_l, 0.0) * gam   # dL ⊙ Γ
        lkk = jnp.sum(lk * kk, axis=1)
        dbeta = dbeta + lkk + (rk_dot * entry if gated else rk_dot)
        tb_s[...] = (lk * mc.rows(beta_row, (c, c))).astype(MM_DTYPE)   # dB
        plgpu.commit_smem()

      with jax.named_scope("dk, vectors"):
        # dL has read dR_v: do_s becomes −β e ⊙ dR_v, so that dk's β e ⊙ dR_k term
        # (= −β e ⊙ dR_v Sᵀ) joins dk's one accumulator.
        do_s[...] = (do_s[...].astype(_F32) * mc.rows(-be_row, (c, dv))).astype(MM_DTYPE)
        plgpu.commit_smem()
        arrived(11)
        # The exit factors' share, Σ_k k ⊙ (x ⊙ E) dS'ᵀ, is made on its own: through the
        # identity it would be a difference of terms that strong decay makes far larger.
        rest = [(ta_s.T, q_s), (tb_s, k_s), (tb_s.T, k_s), (do_s, h_s)]
        if gated and join_exit:   # one product, two accumulators, summed in registers
          dk_rest, dk_exit = mc.matmuls((c, dk, rest), (c, dk, [(e_s, dh_s)]))
          d_exit = k_sum(dk_exit)
          dk_ = dk_rest + dk_exit
        else:
          if gated:
            (dk_exit,) = mc.matmuls((c, dk, [(e_s, dh_s)]))
            d_exit = k_sum(dk_exit)
          (dk_,) = mc.matmuls((c, dk, rest[:3] + [(e_s, dh_s)] + rest[3:]))
        kdk = k_sum(dk_)
        rk_s[...] = dk_.astype(MM_DTYPE)              # Y was last read by dL
        vout.at[0][...] = dbeta
        if gated:
          wb_row = beta_row * lkk
          twice = be_row * rk_dot + wb_row
          vout.at[1][...] = qdq - kdk + 2.0 * twice
          state_dot = None                            # ⟨S, dS'⟩ over 64-row blocks of Sᵀ
          for r in range(dv // 64):
            blk = pl.ds(r * 64, 64)
            part = jnp.sum(plgpu.load(h_s.at[blk], layout=_WG).astype(_F32)
                           * plgpu.load(dh_s.at[blk], layout=_WG).astype(_F32), axis=1)
            state_dot = part if state_dot is None else state_dot + part
          vout.at[2][...] = d_exit + jnp.exp(g_last) * state_dot
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(rk_s, dk_ref.at[bi, rows, hi])
        for i, dst in enumerate(vec_refs):
          plgpu.copy_smem_to_gmem(vout.at[i], dst.at[bi, hi, rows])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    ck, cv, cc = mc.smem((c, dk), MM_DTYPE), mc.smem((c, dv), MM_DTYPE), mc.smem((c, c), MM_DTYPE)
    vk = mc.smem((dv, dk), MM_DTYPE)
    vec = plgpu.SMEM((c,), _F32)
    pl.run_scoped(body, ck, ck, cv, cv, cv, mc.smem((dv, c), MM_DTYPE), vk, vk, cc, cc, cc, ck,
                  ck, vec, vec, vec, plgpu.SMEM((n_vec, c), _F32),
                  plgpu.Barrier(num_barriers=12))

  return plgpu.kernel(kernel, out_type=out_type, **params)(q, k, v, e, do, t0, g, beta, h_t,
                                                            dh_t, de_t)


def _decay_mask(g_row, g_cols, lower):
  """Γ_ij = e^{G_i − G_j} on i ≥ j (`lower`), 0 above: the chunk's rows of G as loaded (`_ROWS`)
  and its columns read from their shared-memory copy (exponents ≤ 0: no overflow)."""
  n = g_row.shape[0]
  diff = mc.rows(g_row, (n, n)) - mc.cols(plgpu.load(g_cols, layout=_COLS), (n, n))
  return jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)


def _issue_loads(ins, tiles, coords, bars):
  """Starts every load of a CTA's chunk at once, in the order of first use, each on its own
  barrier: 0, 1 the gate rows (as rows and as columns), 2 β, 3 T0, 4 q, 5 k, 6 dO, 7 E, 8 Sᵀ,
  9 dEᵀ, 10 v, 11 dS'ᵀ."""
  q_ref, k_ref, v_ref, e_ref, do_ref, t0_ref, g_ref, beta_ref, h_ref, dh_ref, de_ref = ins
  q_s, k_s, v_s, e_s, do_s, m_s, g_rows, g_cols, b_rows, h_s, dh_s, de_s = tiles
  bi, hi, ci, ki = coords
  rows = pl.ds(ci * CHUNK, CHUNK)
  loads = [(g_ref.at[bi, hi, rows], g_rows), (g_ref.at[bi, hi, rows], g_cols),
           (beta_ref.at[bi, hi, rows], b_rows), (t0_ref.at[bi, hi, ci], m_s),
           (q_ref.at[bi, rows, ki], q_s), (k_ref.at[bi, rows, ki], k_s),
           (do_ref.at[bi, rows, hi], do_s), (e_ref.at[bi, rows, hi], e_s),
           (h_ref.at[bi, hi, ci], h_s), (de_ref.at[bi, hi, ci], de_s),
           (v_ref.at[bi, rows, hi], v_s), (dh_ref.at[bi, hi, ci], dh_s)]
  for i, (src, dst) in enumerate(loads):
    plgpu.copy_gmem_to_smem(src, dst, bars.at[i])


def _split_scratch(d, n_vec):
  """`_split_kernel`'s shared memory (K = V = d): the single-warpgroup kernel's tiles, one
  vector more (the β terms of dG that the second warpgroup hands the first)."""
  cd, cc = mc.smem((CHUNK, d), MM_DTYPE), mc.smem((CHUNK, CHUNK), MM_DTYPE)
  vec = plgpu.SMEM((CHUNK,), _F32)
  return (cd, cd, cd, cd, cd, mc.smem((d, CHUNK), MM_DTYPE), mc.smem((d, d), MM_DTYPE),
          mc.smem((d, d), MM_DTYPE), cc, cc, cc, cd, cd, vec, vec, vec, vec,
          plgpu.SMEM((n_vec, CHUNK), _F32), plgpu.Barrier(num_barriers=12),
          plgpu.Barrier(num_barriers=1))


def _split_kernel(q_ref, k_ref, v_ref, e_ref, do_ref, t0_ref, g_ref, beta_ref, h_ref, dh_ref,
                  de_ref, dq_ref, dk_ref, dv_ref, *refs, b, hv, n_rep, scale, gated):
  """The per-chunk gradients on two warpgroups (K = V), the single-warpgroup kernel's products
  split by what they depend on:

      warpgroup 0: dA = s (dO Eᵀ) ⊙ Γ, dq = dA k + (s e ⊙ dO) Sᵀ; then, while warpgroup 1 works,
                   its share of dk, dAᵀ q + (x ⊙ E) dS'ᵀ (the exit term in an accumulator of
                   its own, for dG's tail), and ⟨S, dS'⟩; after warpgroup 1's signal, the rest
                   of dk, (dB + dBᵀ) k − (β e ⊙ dR_v) Sᵀ, and dG's rows.
      warpgroup 1: M = T0 ⊙ Γ, dR_v = Mᵀ dE, dv, dR_k = −dR_v Sᵀ, Y, U, dL, dB, dβ; it hands
                   dB, −β e ⊙ dR_v, dβ and its share of dG over in shared memory.

  Neither writes a tile the other reads before the signal (one mbarrier), so the first two
  phases of each run at once. Each waits on the load barrier of every tile it reads (the
  interpreter's copies are done when issued, so a missing wait would pass its tests). dR_v lives transposed in dEᵀ's tile once Mᵀ dE has read it, and
  dv is staged in dR_k's tile before dR_k exists: K = V makes every [C, D] tile one shape."""
  (dbeta_ref, *dg_refs), scratch = refs[:-20], refs[-20:]
  (q_s, k_s, v_s, e_s, do_s, de_s, h_s, dh_s, m_s, ta_s, tb_s, rk_s, drk_s, g_rows, g_cols,
   b_rows, twice_s, vout, bars, wg1_done) = scratch
  vec_refs = [dbeta_ref, *dg_refs]
  c = CHUNK
  d = q_ref.shape[-1]
  bi, hi, ci = _cta_coords(b, hv)
  ki = lax.div(hi, n_rep)
  rows = pl.ds(ci * c, c)
  wg = lax.axis_index("wg")
  arrived = lambda *names: [plgpu.barrier_wait(bars.at[i]) for i in names]
  k_sum = lambda x: jnp.sum(k_s[...].astype(_F32) * x, axis=1)
  lower = lambda: mc.iota(c, 0) >= mc.iota(c, 1)

  def gates():
    """(β, e, x, β e rows, Γ) of the chunk (e = x = 1, Γ the lower triangle ungated)."""
    beta_row = plgpu.load(b_rows, layout=_ROWS)
    if not gated:
      one = jnp.ones_like(beta_row)
      return beta_row, one, one, beta_row, jnp.where(lower(), 1.0, 0.0)
    g_row = plgpu.load(g_rows, layout=_ROWS)
    entry, exit_ = jnp.exp(g_row), jnp.exp(g_rows[c - 1] - g_row)
    return beta_row, entry, exit_, beta_row * entry, _decay_mask(g_row, g_cols, lower())

  @pl.when(wg == 0)
  def _dq_side():
    _issue_loads((q_ref, k_ref, v_ref, e_ref, do_ref, t0_ref, g_ref, beta_ref, h_ref, dh_ref,
                  de_ref), (q_s, k_s, v_s, e_s, do_s, m_s, g_rows, g_cols, b_rows, h_s, dh_s,
                            de_s), (bi, hi, ci, ki), bars)
    with jax.named_scope("dA, dq"):
      arrived(0, 1, 2)
      _, entry, exit_, _, gam = gates()
      arrived(4, 5, 6, 7)
      (dp,) = mc.matmuls((c, c, [(do_s, e_s.T)]))
      ta_s[...] = (dp * (gam * scale)).astype(MM_DTYPE)
      do_s[...] = (do_s[...].astype(_F32) * mc.rows(entry * scale, (c, d))).astype(MM_DTYPE)
      if gated:
        e_s[...] = (e_s[...].astype(_F32) * mc.rows(exit_, (c, d))).astype(MM_DTYPE)
      plgpu.commit_smem()
      arrived(8)
      (dq,) = mc.matmuls((c, d, [(ta_s, k_s), (do_s, h_s)]))
      qdq = jnp.sum(q_s[...].astype(_F32) * dq, axis=1)
      do_s[...] = dq.astype(MM_DTYPE)               # s e ⊙ dO was last read by dq
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(do_s, dq_ref.at[bi, rows, hi])
    with jax.named_scope("dk, own share"):
      arrived(11)
      dk_own, dk_exit = mc.matmuls((c, d, [(ta_s.T, q_s)]), (c, d, [(e_s, dh_s)]))
      d_exit = k_sum(dk_exit) if gated else None
      dk_own = dk_own + dk_exit
      state_dot = None                              # ⟨S, dS'⟩ over 64-row blocks of Sᵀ
      for r in range(d // 64 if gated else 0):
        blk = pl.ds(r * 64, 64)
        part = jnp.sum(plgpu.load(h_s.at[blk], layout=_WG).astype(_F32)
                       * plgpu.load(dh_s.at[blk], layout=_WG).astype(_F32), axis=1)
        state_dot = part if state_dot is None else state_dot + part
    with jax.named_scope("dk, vectors"):
      plgpu.barrier_wait(wg1_done.at[0])
      (dk_rest,) = mc.matmuls((c, d, [(tb_s, k_s), (tb_s.T, k_s), (de_s.T, h_s)]))
      dk_ = dk_own + dk_rest
      kdk = k_sum(dk_)
      rk_s[...] = dk_.astype(MM_DTYPE)              # Y was last read by warpgroup 1's dL
      if gated:
        twice = plgpu.load(twice_s, layout=_ROWS)
        vout.at[1][...] = qdq - kdk + 2.0 * twice
        vout.at[2][...] = d_exit + jnp.exp(g_rows[c - 1]) * state_dot
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(rk_s, dk_ref.at[bi, rows, hi])
      for i, dst in enumerate(vec_refs):
        plgpu.copy_smem_to_gmem(vout.at[i], dst.at[bi, hi, rows])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  @pl.when(wg == 1)
  def _dv_side():
    with jax.named_scope("M, dv, dR"):
      arrived(0, 1, 2, 3)
      beta_row, entry, _, be_row, gam = gates()
      if gated:
        m_s[...] = (m_s[...].astype(_F32) * gam).astype(MM_DTYPE)    # M = T0 ⊙ Γ
        plgpu.commit_smem()
      arrived(5, 9, 10)   # k (β e k, k kᵀ, dR_k's row sums), dEᵀ, v
      (d_rv,) = mc.matmuls((c, d, [(m_s.T, de_s.T)]))
      dbeta = jnp.sum(d_rv * v_s[...].astype(_F32), axis=1)
      drk_s[...] = (d_rv * mc.rows(beta_row, (c, d))).astype(MM_DTYPE)   # dv, staged
      de_s.T[...] = d_rv.astype(MM_DTYPE)          # dR_v (dEᵀ was last read by Mᵀ dE)
      v_s[...] = (v_s[...].astype(_F32) * mc.rows(beta_row, (c, d))).astype(MM_DTYPE)  # β v
      rk_s[...] = (k_s[...].astype(_F32) * mc.rows(be_row, (c, d))).astype(MM_DTYPE)   # β e k
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(drk_s, dv_ref.at[bi, rows, hi])
      arrived(8)
      (d_rk,) = mc.matmuls((c, d, [(de_s.T, h_s)]))
      d_rk = -d_rk
      rk_dot = k_sum(d_rk)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # dv's copy has read drk_s
      drk_s[...] = d_rk.astype(MM_DTYPE)
      y, u = mc.matmuls((c, d, [(m_s, rk_s)]), (c, d, [(m_s, v_s)]))
      rk_s[...] = y.astype(MM_DTYPE)
      v_s[...] = u.astype(MM_DTYPE)
      plgpu.commit_smem()
    with jax.named_scope("dL, dB"):
      d_l, kk = mc.matmuls((c, c, [(drk_s, rk_s.T), (de_s.T, v_s.T)]), (c, c, [(k_s, k_s.T)]))
      lk = jnp.where(mc.iota(c, 0) > mc.iota(c, 1), -d_l, 0.0) * gam   # dL ⊙ Γ
      lkk = jnp.sum(lk * kk, axis=1)
      vout.at[0][...] = dbeta + lkk + rk_dot * entry
      if gated:
        twice_s[...] = be_row * rk_dot + beta_row * lkk
      tb_s[...] = (lk * mc.rows(beta_row, (c, c))).astype(MM_DTYPE)   # dB
      # dL has read dR_v: its tile becomes −β e ⊙ dR_v, dk's share of (β e ⊙ dR_k).
      de_s.T[...] = (plgpu.load(de_s.T, layout=_WG).astype(_F32)
                     * mc.rows(-be_row, (c, d))).astype(MM_DTYPE)
      plgpu.commit_smem()
      plgpu.barrier_arrive(wg1_done.at[0])


def _linear_kernel(q_ref, k_ref, e_ref, do_ref, h_ref, dh_ref, de_ref, dq_ref, dk_ref, dv_ref, *,
                   b, hv, n_rep, scale):
  """Linear attention's chunk gradients (E = v, no erase, no gates):
      dA = s (dO Eᵀ) ⊙ causal    dq = dA k + s dO Sᵀ    dk = dAᵀ q + E dS'ᵀ    dv = dE."""
  c = CHUNK
  bi, hi, ci = _cta_coords(b, hv)
  ki = lax.div(hi, n_rep)
  rows = pl.ds(ci * c, c)
  dk, dv = q_ref.shape[-1], e_ref.shape[-1]

  def body(q_s, k_s, e_s, do_s, de_s, h_s, dh_s, ta_s, out_k, bars):
    loads = [(q_ref.at[bi, rows, ki], q_s), (k_ref.at[bi, rows, ki], k_s),
             (do_ref.at[bi, rows, hi], do_s), (e_ref.at[bi, rows, hi], e_s),
             (h_ref.at[bi, hi, ci], h_s), (de_ref.at[bi, hi, ci], de_s),
             (dh_ref.at[bi, hi, ci], dh_s)]
    for i, (src, dst) in enumerate(loads):
      plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
    arrived = lambda *names: [plgpu.barrier_wait(bars.at[i]) for i in names]
    with jax.named_scope("dA, dq"):
      arrived(0, 1, 2, 3)
      (dp,) = mc.matmuls((c, c, [(do_s, e_s.T)]))
      causal = mc.iota(c, 0) >= mc.iota(c, 1)
      ta_s[...] = jnp.where(causal, dp * scale, 0.0).astype(MM_DTYPE)
      do_s[...] = (do_s[...].astype(_F32) * scale).astype(MM_DTYPE)
      plgpu.commit_smem()
      arrived(4)
      (dq,) = mc.matmuls((c, dk, [(ta_s, k_s), (do_s, h_s)]))
      out_k[...] = dq.astype(MM_DTYPE)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_k, dq_ref.at[bi, rows, hi])
    with jax.named_scope("dv, dk"):
      arrived(5)
      # dv = dE: dEᵀ is read transposed into registers and staged where s dO was (dq is done).
      do_s[...] = plgpu.load(de_s.T, layout=_WG)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(do_s, dv_ref.at[bi, rows, hi])
      arrived(6)
      (dk_,) = mc.matmuls((c, dk, [(ta_s.T, q_s), (e_s, dh_s)]))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # dq's copy has read out_k
      out_k[...] = dk_.astype(MM_DTYPE)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_k, dk_ref.at[bi, rows, hi])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  ck, cv = mc.smem((c, dk), MM_DTYPE), mc.smem((c, dv), MM_DTYPE)
  vk = mc.smem((dv, dk), MM_DTYPE)
  pl.run_scoped(body, ck, ck, cv, cv, mc.smem((dv, c), MM_DTYPE), vk, vk,
                mc.smem((c, c), MM_DTYPE), ck, plgpu.Barrier(num_barriers=7))


def chunk_grads_reference(q, k, v, e, do, g, beta, h_t, dh_t, de_t, *, scale: float,
                          gated: bool = True, delta: bool = True):
  """The same gradients as the VJP of one chunk's map, in float32 at Precision.HIGHEST with the
  exact inverse (a triangular solve, not T0): the kernel's oracle. Arguments as `chunk_grads`
  (without t0); every array is read in float32.

  The chunk map, with the state entering S, E_f the pseudo-values the forward produced and held
  fixed where O and the leaving state read them (their own cotangent dE already carries those
  paths, as the reverse walk made it):
      E = (I + L)⁻¹ (β ⊙ v) − (I + L)⁻¹ (β e ⊙ k) S,    L = diag(β) (k kᵀ ⊙ Γ) strictly lower
      O = s (e ⊙ q) S + P E_f,    S' = γ S + (x ⊙ k)ᵀ E_f
  and the scalar ⟨dO, O⟩ + ⟨dE, E⟩ + ⟨dS', S'⟩ is differentiated with respect to q, k, v, β and
  G (per value head: q and k repeated over the value heads of a group). delta=False: linear
  attention, E = v (g and beta unread; dβ and dG None)."""
  hp = lax.Precision.HIGHEST
  f = lambda x: x.astype(_F32)
  b, t, h, dk = q.shape
  hv = v.shape[2]
  c, nc = CHUNK, t // CHUNK
  chunks = lambda x: jnp.moveaxis(f(x).reshape(b, nc, c, hv, -1), 3, 1)   # [B, HV, Nc, C, D]
  rep = lambda x: jnp.repeat(x, hv // h, axis=2)
  per_row = lambda x: f(x).reshape(b, hv, nc, c)
  s_in = jnp.swapaxes(f(h_t), -1, -2)                                     # [B, HV, Nc, K, V]
  ds_out = jnp.swapaxes(f(dh_t), -1, -2)
  d_e = jnp.swapaxes(f(de_t), -1, -2)                                     # [B, HV, Nc, C, V]
  e_f, d_o = chunks(e), chunks(do)
  lower = jnp.tril(jnp.ones((c, c), bool))
  strict = jnp.tril(jnp.ones((c, c), bool), -1)
  mm = lambda spec, x, y: jnp.einsum(spec, x, y, precision=hp)

  def loss(qc, kc, vc, bc, gc):
    gam = jnp.where(lower, jnp.exp(jnp.where(lower, gc[..., :, None] - gc[..., None, :], 0.0)),
                    0.0)
    entry, exit_, gamma = jnp.exp(gc), jnp.exp(gc[..., -1:] - gc), jnp.exp(gc[..., -1])
    p = scale * mm("...ik,...jk->...ij", qc, kc) * gam
    lmat = jnp.where(strict, bc[..., :, None] * mm("...ik,...jk->...ij", kc, kc) * gam, 0.0)
    eye = jnp.eye(c, dtype=_F32)
    solve = lambda rhs: lax.linalg.triangular_solve(eye + lmat, rhs, left_side=True,
                                                    lower=True, unit_diagonal=True)
    e_new = vc if not delta else (
        solve(vc * bc[..., None])
        - mm("...ck,...kv->...cv", solve(kc * (bc * entry)[..., None]), s_in))
    o = scale * mm("...ck,...kv->...cv", qc * entry[..., None], s_in) + mm(
        "...ij,...jv->...iv", p, e_f)
    s_out = gamma[..., None, None] * s_in + mm("...ck,...cv->...kv", kc * exit_[..., None], e_f)
    return jnp.sum(d_o * o) + jnp.sum(d_e * e_new) + jnp.sum(ds_out * s_out)

  gated = gated and delta
  gc = per_row(g) if gated else jnp.zeros((b, hv, nc, c), _F32)
  bc = per_row(beta) if delta else jnp.ones((b, hv, nc, c), _F32)
  grads = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(chunks(rep(q)), chunks(rep(k)), chunks(v),
                                                  bc, gc)
  dq, dk_, dv, dbeta, dg = grads
  back = lambda x: jnp.moveaxis(x, 1, 3).reshape(b, t, hv, -1)
  return (back(dq), back(dk_), back(dv), dbeta.reshape(b, hv, t) if delta else None,
          dg.reshape(b, hv, t) if gated else None)
