"""The delta rule's reverse state pass (DeltaNet, GDN) as a warp-specialised Mosaic GPU walk:
the backward partner of `chunk_walk` (`GpuTuning(forward="walk")` under differentiation).

Walking the chunks backward with the cotangent dS of the state leaving the chunk, the pass
computes what the split's reverse kernel computes from stored NY, QG, P, KG, but makes every
factor on chip from q, k, the gate-free inverse T0 and the gates (as the Triton reverse walk of
`triton/fused_forward.py` does). With M = T0 ⊙ Γ, P = s q kᵀ ⊙ Γ, e = e^{G}, x = e^{G_C − G},
γ = e^{G_C}:

    dE  = dE_ext + Pᵀ dO + x ⊙ (k dS)          (the pseudo-values' cotangent)
    dS' = γ dS + qᵀ (s e ⊙ dO) − kᵀ (β e ⊙ Mᵀ dE)    (the cotangent of the state entering)

One CTA per (batch, value head, 64 value columns), three warpgroups on one chunk ring:

* **memory**: streams q, k, dO, dE_ext, T0 and the gate vectors by TMA;
* **factors**: makes M (over T0 in the ring) and P of each chunk, off the chain;
* **state**: holds dSᵀ `[BV, K]` float32 in registers. As in the forward walk, holding the
  transpose makes the chain's three products register-operand wgmma:

      (k dS)ᵀ = dSᵀ kᵀ     dEᵀ = dE_extᵀ + dOᵀ P + (k dS)ᵀ ⊙ xᵀ     (Mᵀ dE)ᵀ = dEᵀ M
      dSᵀ ← γ dSᵀ + (s e ⊙ dO)ᵀ q − ((Mᵀ dE)ᵀ ⊙ (β e)ᵀ) k

  It stores dEᵀ and the dSᵀ leaving each chunk in bf16, the residuals of the rest of the
  backward (`chunk_grads`, which reads them as they are; every product there takes bf16
  operands, so nothing is lost by rounding here).

Outputs are transposed (`[.., V, C]`, `[.., V, K]`): `chunk_grads` reads these tiles as the
wgmma operands it needs. Same sizes and scope as `chunk_walk` (no packed rows). Runs in JAX's
Mosaic GPU interpreter (register operands staged through scratch tiles there, as in
`chunk_walk`).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu import mosaic_common as mc
from pallas_kernels.gpu.chunk_walk import (BLOCK_V, CHUNK, MEMORY_REGS, MM_DTYPE, OUTPUT_REGS,
                                           SMEM_LIMIT, STATE_REGS, _COLS, _WG, copy_chunk_keys,
                                           decay_mask, kernel_args, load_state, product,
                                           products, store_state, stream_ring, supported)
from pallas_kernels.gpu.state_passing import check_index_range


def ring_stages(dk: int, bv: int = BLOCK_V) -> int:
  """Deepest input ring (2 to 4 chunks) that fits beside the fixed buffers."""
  c = CHUNK
  per_stage = (2 * c * dk + 2 * c * bv + 2 * c * c) * 2 + 4 * c * 4   # q, k, dO, dE_ext, T0, P
  fixed = bv * dk * 2 + 2 * bv * c * 2 + bv * dk * 4 + 2048   # dSᵀ copy-out, dEᵀ out, dS₀/dS_T
  for stages in (4, 3, 2):
    if stages * per_stage + fixed <= SMEM_LIMIT:
      return stages
  raise ValueError(f"chunk_walk_reverse: K={dk} does not fit two ring stages in shared memory")


def chunk_walk_reverse(q, k, t0, g, beta, do, de_ext, dsf_t, *, scale: float, gated: bool = True,
                       states_only: bool = False, overlap: bool = False,
                       approx_math: bool = False, interpret=None):
  """(de_t, dh_t, ds0_t): the reverse state pass of `chunk_walk`.

  Args:
    q, k, t0, g, beta: as `chunk_walk` takes them (t0 None: linear attention, whose state
      cotangent has no erase term: dS' = γ dS + qᵀ (s e ⊙ dO)).
    do, de_ext: `[B, T, HV, V]` bf16, the cotangents of o and of e; de_ext may be None (e
      unused downstream: no copies, no add).
    dsf_t: `[B, HV, V, K]` float32, the cotangent of the final state, transposed.
    states_only: return only (ds0_t,): dE and the chunk cotangents are made but not stored (the
      entry cotangents of rows cut into pieces, `gpu_walks.walk_pieces_core`).
    overlap: issue each of the chain's first two products together with an independent one
      (three waits a chunk instead of five), the copies out of dS and dE running beside them.
      The same results (`GpuTuning.walk_overlap`; off by default, docs/BENCHMARKS.md
      "twenty-fifth stage").
    approx_math: e^x as ex2.approx, as `chunk_walk` takes it. Timed (2026-12-05, B4 T16384
      H16 D128): the gated step 2.49 → 2.44 µs on the H200, 3.00 → 3.07 on the H100 (noise);
      the op passes `GpuTuning.approx_math` to every walk alike.
  Returns:
    de_t `[B, HV, Nc, V, C]` bf16 (dE of each chunk, transposed), dh_t `[B, HV, Nc, V, K]`
    bf16 (dS leaving each chunk, transposed, exactly as used), ds0_t `[B, HV, V, K]` float32.
  """
  outs = _chunk_walk_reverse(q, k, t0, g, beta, do, de_ext, dsf_t, scale=float(scale),
                             gated=bool(gated), states_only=bool(states_only),
                             overlap=bool(overlap), approx_math=bool(approx_math),
                             interpret=interpret)
  return mc.sync_if_interpreted(outs, interpret)


@functools.partial(jax.jit, static_argnames=("scale", "gated", "states_only", "overlap",
                                             "approx_math", "interpret"))
def _chunk_walk_reverse(q, k, t0, g, beta, do, de_ext, dsf_t, *, scale, gated, states_only,
                        interpret, overlap=False, approx_math=False):
  b, t, h, dk = q.shape
  hv, dv = do.shape[2], do.shape[3]
  c, bv, f32 = CHUNK, BLOCK_V, jnp.float32
  reason = supported(c, dk, dv)
  if reason or t % c or hv % h:
    raise ValueError("chunk_walk_reverse: " + (reason or f"T={t} must be a multiple of {c} "
                                                         f"and HV={hv} a multiple of H={h}") + ".")
  check_index_range(b, t, hv, dv)
  nc, n_rep = t // c, hv // h
  stages = ring_stages(dk, bv)
  out_type = (jax.ShapeDtypeStruct((b, hv, nc, dv, c), MM_DTYPE),
              jax.ShapeDtypeStruct((b, hv, nc, dv, dk), MM_DTYPE),
              jax.ShapeDtypeStruct((b, hv, dv, dk), f32))
  if states_only:
    out_type = out_type[2:]
  vec = plgpu.SMEM((stages, c), f32)
  with_dx, delta = de_ext is not None, t0 is not None
  n_copies = 7 + with_dx + delta   # q, k, dO, (dE_ext,) (T0,) and four gate vectors per chunk

  def kernel(q_ref, k_ref, t0_ref, g_ref, beta_ref, do_ref, dx_ref, dsf_ref, de_ref, dh_ref,
             ds0_ref, q_s, k_s, do_s, dx_s, m_s, p_s, g_state, b_cols, g_rows, g_cols, s_pub,
             de_out, s_f32, in_bar, in_free, factors_ready, s_bar, stage_k=None, stage_c=None,
             stage_q=None):
    bi, hi, vi = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
    ki = lax.div(hi, n_rep)
    vs = pl.ds(vi * bv, bv)
    wg = lax.axis_index("wg")

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(MEMORY_REGS, action="decrease")

      def issue(j, slot):   # step j walks chunk nc - 1 - j
        rows = pl.ds((nc - 1 - j) * c, c)
        bar = in_bar.at[slot]
        copy_chunk_keys((q_ref, k_ref, t0_ref, g_ref, beta_ref),
                        (q_s, k_s, m_s, (g_state, g_rows, g_cols), b_cols), bi, ki, hi,
                        nc - 1 - j, slot, bar)
        plgpu.copy_gmem_to_smem(do_ref.at[bi, rows, hi, vs], do_s.at[slot], bar)
        if with_dx:
          plgpu.copy_gmem_to_smem(dx_ref.at[bi, rows, hi, vs], dx_s.at[slot], bar)

      stream_ring(issue, nc, stages, in_free)

    @pl.when(wg == 0)
    def _state():
      plgpu.set_max_registers(STATE_REGS, action="increase")
      ds_init = load_state(dsf_ref.at[bi, hi, vs], s_f32, s_bar)

      def step(j, ds_t):
        n = nc - 1 - j
        slot = lax.rem(j, stages)
        half = lax.rem(j, 2)
        plgpu.barrier_wait(in_bar.at[slot])
        ds_lo = ds_t.astype(MM_DTYPE)

        def store_dh():
          if not states_only:
            # Per step two copy-outs (dSᵀ from s_pub, then dEᵀ from de_out[half]); at most the
            # last step's dEᵀ may still be reading, so s_pub and de_out[half] are free.
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            s_pub[...] = ds_lo
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(s_pub, dh_ref.at[bi, hi, n, vs])

        def store_de(de_lo):
          if not states_only:
            de_out.at[half][...] = de_lo
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(de_out.at[half], de_ref.at[bi, hi, n, vs])

        if not overlap:
          store_dh()
        beta_col = plgpu.load(b_cols.at[slot], layout=_COLS)
        if gated:
          g_col = plgpu.load(g_state.at[slot], layout=_COLS)
          g_last = g_state[slot, c - 1]
          entry = jnp.exp(g_col)
          exit_ = mc.cols(jnp.exp(g_last - g_col), (bv, c))
          decay = jnp.exp(g_last)
          out_scale = mc.cols(entry * scale, (bv, c))
          key_scale = mc.cols(beta_col * entry, (bv, c))
        else:
          out_scale = scale
          key_scale = mc.cols(beta_col, (bv, c))
        sdo = lambda: (plgpu.load(do_s.at[slot].T, layout=_WG).astype(jnp.float32)
                       * out_scale).astype(MM_DTYPE)               # (s e ⊙ dO)ᵀ, bf16
        if overlap:
          # Three waits a chunk, not five: each of the chain's first two products (k dS, then
          # Mᵀ dE) is issued with an independent one (Pᵀ dO, then qᵀ dO), both waited for at
          # once; k dS runs while dSᵀ is copied out and P is awaited, the second pair while dEᵀ
          # is. Same products, operands and sums as below.
          kds_t, pdo_t = products([(ds_lo, k_s.at[slot].T, (bv, c), stage_k),    # the chain
                                   store_dh,
                                   lambda: plgpu.barrier_wait(factors_ready.at[slot]),
                                   (do_s.at[slot].T, p_s.at[slot], (bv, c), None)])
        else:
          kds_t = product(ds_lo, k_s.at[slot].T, (bv, c), stage_k)        # the chain
          qdo_t = product(sdo(), q_s.at[slot], (bv, dk), stage_c)
          plgpu.barrier_wait(factors_ready.at[slot])
          pdo_t = product(do_s.at[slot].T, p_s.at[slot], (bv, c))
        de_t = pdo_t + (kds_t * exit_ if gated else kds_t)
        if with_dx:
          de_t = de_t + plgpu.load(dx_s.at[slot].T, layout=_WG).astype(jnp.float32)
        if not overlap:
          if not states_only:
            store_de(de_t.astype(MM_DTYPE))
        else:   # dEᵀ's copy out runs beside the products
          de_lo = de_t.astype(MM_DTYPE)
          if delta:
            z_t, qdo_t = products([(de_lo, m_s.at[slot], (bv, c), stage_c),    # the chain
                                   (sdo(), q_s.at[slot], (bv, dk), stage_q),
                                   lambda: store_de(de_lo)])
          else:
            (qdo_t,) = products([(sdo(), q_s.at[slot], (bv, dk), stage_q),
                                 lambda: store_de(de_lo)])
        ds_next = (ds_t * decay if gated else ds_t) + qdo_t
        if delta:
          if not overlap:
            z_t = product(de_t.astype(MM_DTYPE), m_s.at[slot], (bv, c), stage_c)   # the chain
          kz_t = product((z_t * key_scale).astype(MM_DTYPE), k_s.at[slot], (bv, dk), stage_c)
          ds_next = ds_next - kz_t
        plgpu.barrier_arrive(in_free.at[slot])
        return ds_next

      ds_t = lax.fori_loop(0, nc, step, ds_init)
      store_state(ds_t, s_f32, ds0_ref.at[bi, hi, vs])

    @pl.when(wg == 1)
    def _factors():
      plgpu.set_max_registers(OUTPUT_REGS, action="increase")

      def step(j, carry):
        slot = lax.rem(j, stages)
        plgpu.barrier_wait(in_bar.at[slot])
        gam = decay_mask(g_rows, g_cols, slot, gated)
        if delta:
          t0_tile = plgpu.load(m_s.at[slot], layout=_WG).astype(jnp.float32)
          m_s.at[slot][...] = (t0_tile * gam).astype(MM_DTYPE)        # M = T0 ⊙ Γ
        qk = product(q_s.at[slot], k_s.at[slot].T, (c, c))
        p_s.at[slot][...] = (qk * (gam * scale)).astype(MM_DTYPE)     # P = s q kᵀ ⊙ Γ
        plgpu.commit_smem()
        plgpu.barrier_arrive(factors_ready.at[slot])
        plgpu.barrier_arrive(in_free.at[slot])
        return carry

      lax.fori_loop(0, nc, step, None)

  scratch = dict(
      q_s=mc.smem((stages, c, dk), MM_DTYPE), k_s=mc.smem((stages, c, dk), MM_DTYPE),
      do_s=mc.smem((stages, c, bv), MM_DTYPE), dx_s=mc.smem((stages, c, bv), MM_DTYPE),
      m_s=mc.smem((stages, c, c), MM_DTYPE), p_s=mc.smem((stages, c, c), MM_DTYPE),
      g_state=vec, b_cols=vec, g_rows=vec, g_cols=vec,
      s_pub=mc.smem((bv, dk), MM_DTYPE), de_out=mc.smem((2, bv, c), MM_DTYPE),
      s_f32=plgpu.SMEM((bv, dk), f32),
      in_bar=plgpu.Barrier(num_arrivals=n_copies, num_barriers=stages),
      in_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      factors_ready=plgpu.Barrier(num_barriers=stages), s_bar=plgpu.Barrier(num_barriers=1))
  if interpret is not None:   # staging tiles for register operands (`chunk_walk.product`)
    scratch.update(stage_k=mc.smem((bv, dk), MM_DTYPE), stage_c=mc.smem((bv, c), MM_DTYPE),
                   stage_q=mc.smem((bv, c), MM_DTYPE))

  ins, with_absent = kernel_args((q, k, t0, g, beta, do, de_ext, dsf_t))
  n_io = len(ins) + len(out_type)

  def body(*refs):
    outs = refs[len(ins):n_io]
    if states_only:
      outs = (None, None) + outs
    return kernel(*with_absent(refs[:len(ins)]), *outs, **dict(zip(scratch, refs[n_io:])))

  return plgpu.kernel(body, out_type=out_type, scratch_types=tuple(scratch.values()),
                      grid=(b, hv, dv // bv), grid_names=("b", "h", "v"), num_threads=3,
                      thread_name="wg", interpret=interpret,
                      compiler_params=mc.compiler_params(approx_math=approx_math))(*ins)


def chunk_walk_reverse_reference(q, k, t0, g, beta, do, de_ext, dsf_t, *, scale: float,
                                 gated: bool = True):
  """The same reverse pass as a float32 `lax.scan` over the chunks backward at
  Precision.HIGHEST, with the kernel's bf16 operand roundings: the kernel's oracle. Same
  arguments and results (de_t and dh_t in float32)."""
  hp = lax.Precision.HIGHEST
  f32 = jnp.float32
  rnd = lambda x: x.astype(MM_DTYPE).astype(f32)
  b, t, h, dk = q.shape
  hv, dv = do.shape[2:]
  c, nc, n_rep = CHUNK, t // CHUNK, hv // h
  split = lambda x: jnp.moveaxis(x.astype(f32).reshape(b, nc, c, *x.shape[2:]), 1, 0)
  qc, kc = (jnp.repeat(split(x), n_rep, axis=3) for x in (q, k))     # [Nc, B, C, HV, K]
  doc = split(do)                                                     # [Nc, B, C, HV, V]
  dxc = jnp.zeros_like(doc) if de_ext is None else split(de_ext)
  gc = jnp.moveaxis(g.astype(f32).reshape(b, hv, nc, c), 2, 0)
  bc = jnp.moveaxis(beta.astype(f32).reshape(b, hv, nc, c), 2, 0)
  delta = t0 is not None
  tc = jnp.moveaxis(t0.astype(f32), 2, 0) if delta else jnp.zeros((nc, b, hv, c, c), f32)
  lower = jnp.tril(jnp.ones((c, c), bool))

  def step(ds_t, xs):   # ds_t [B, HV, V, K]
    q_, k_, do_, dx_, t0_, g_, b_ = xs
    if gated:
      gam = jnp.where(lower, jnp.exp(jnp.where(lower, g_[..., :, None] - g_[..., None, :], 0.)),
                      0.0)
      entry, exit_, decay = jnp.exp(g_), jnp.exp(g_[..., -1:] - g_), jnp.exp(g_[..., -1])
    else:
      gam = jnp.broadcast_to(lower.astype(f32), t0_.shape)
      entry = exit_ = jnp.ones(b_.shape, f32)
      decay = jnp.ones(b_.shape[:-1], f32)
    col = lambda x: x[:, :, None, :]          # [B, HV, C] over the rows of a [B, HV, V, C] tile
    ds_lo = rnd(ds_t)
    kds = jnp.einsum("bhvk,bchk->bhvc", ds_lo, k_, precision=hp)
    do_t = jnp.einsum("bchv->bhvc", do_)
    dx_t = jnp.einsum("bchv->bhvc", dx_)
    qdo = jnp.einsum("bhvc,bchk->bhvk", rnd(do_t * col(entry * scale)), q_, precision=hp)
    p = rnd(jnp.einsum("bihk,bjhk->bhij", q_, k_, precision=hp) * gam * scale)
    m = rnd(t0_ * gam)
    de_t = dx_t + jnp.einsum("bhvi,bhij->bhvj", do_t, p, precision=hp) + kds * col(exit_)
    ds_next = ds_t * decay[..., None, None] + qdo
    if delta:   # (linear attention: no erase term)
      z = jnp.einsum("bhvi,bhij->bhvj", rnd(de_t), m, precision=hp)
      ds_next = ds_next - jnp.einsum("bhvc,bchk->bhvk", rnd(z * col(b_ * entry)), k_,
                                     precision=hp)
    return ds_next, (de_t, ds_lo)

  xs = (qc, kc, doc, dxc, tc, gc if gated else bc, bc)
  ds0, (de_t, dh_t) = lax.scan(step, dsf_t.astype(f32), tuple(x[::-1] for x in xs))
  return jnp.moveaxis(de_t[::-1], 0, 2), jnp.moveaxis(dh_t[::-1], 0, 2), ds0
