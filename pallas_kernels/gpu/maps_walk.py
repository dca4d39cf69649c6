"""The maps' walk of rows cut into pieces: the delta rule's state chain alone, one or two
chains per CTA (DeltaNet, GDN; `GpuTuning(row_pieces=P)`).

A row cut into pieces first walks every piece from [I | 0], its first L state columns with
v = 0: the final state is then the piece's affine map [Φ | Ψ] (`lineax_attn.ops.gpu_pieces`).
That walk needs no output, only the chain of `chunk_walk`'s state warpgroup,

    Rᵀ = vᵀ − (Sᵀ kᵀ) ⊙ eᵀ        Eᵀ = Rᵀ M̃ᵀ        Sᵀ ← γ Sᵀ + (Eᵀ ⊙ xᵀ) k,

and the factor M̃ = T0 ⊙ Γ · diag(β) it reads (q is not read at all).

Why a kernel of its own. The chain is latency-bound: three dependent products a chunk, each
of them small, so one chain leaves the SM's tensor cores mostly idle, and `chunk_walk` runs
one CTA of 384 threads per SM. The maps' state is (L + V) / V times wider than the main
walk's, so at B1 H16 K = V = 128 in 4 pieces it is 256 chains of 64 columns: two waves on
the H200's 132 SMs, the largest share of the pieces' forward. With `chains=2` one CTA walks
two 64-column blocks of the same (row, head) at once, each chain in its own warpgroup, so
two chains are in flight per SM (one wave there). Both read one ring of k, T0, gates and β,
and one warpgroup makes M̃ for both. Warpgroups (threads 128 each):

* 0 .. chains − 1, **state**: Sᵀ `[64, K]` float32 in registers, the chain above;
* chains, **factors**: M̃ over T0 in the ring (all the chain needs that is not in the ring);
* chains + 1, **memory**: TMA of k, T0, the gate vectors, β and each chain's v tile.

Registers per thread (setmaxnreg, multiples of 8): one chain 232 / 232 / 40 as `chunk_walk`;
two chains 192 in each state warpgroup, 88 and 40 in the others (128 threads × 512 = the
SM's 64K registers). With an odd
number of column blocks the last CTA's second chain walks the last block again and does not
store it. L + V must be a multiple of 64; the leading columns (v = 0) read v's first tile
scaled by 0, so no [0 | v] array is made.

Scope: T a multiple of 64, K = 64 or 128, V a multiple of 64, GVA, gated (GDN) or not
(DeltaNet). Linear attention has no maps' walk (its Φ = I and Ψ = Σ kᵀ v are products).
Written in the `plgpu.kernel` style, so JAX's Mosaic GPU interpreter runs it on CPU.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu import chunk_walk as cw
from pallas_kernels.gpu import mosaic_common as mc
from pallas_kernels.gpu.state_passing import check_index_range

C = cw.CHUNK
BV = cw.BLOCK_V
# Registers per thread (state, factors, memory) by chains per CTA: 128 threads · (chains ·
# state + factors + memory) ≤ the SM's 64K, so one CTA fits an SM.
REGS = {1: (cw.STATE_REGS, cw.OUTPUT_REGS, cw.MEMORY_REGS), 2: (192, 88, 40)}

_WG = plgpu.Layout.WGMMA
_COLS = plgpu.Layout.WGMMA.reduce(0)


def ring_stages(dk: int, chains: int) -> int:
  """Deepest ring (2 to 4 chunks) of k, T0, the four gate / β vectors and `chains` v tiles
  that fits shared memory beside each chain's float32 state staging tile."""
  per_stage = (C * dk + C * C + chains * C * BV) * 2 + 4 * C * 4
  fixed = chains * BV * dk * 4 + 2048
  for stages in (4, 3, 2):
    if stages * per_stage + fixed <= cw.SMEM_LIMIT:
      return stages
  raise ValueError(f"maps_walk: K={dk} with {chains} chains does not fit two ring stages")


def maps_walk(k, v, t0, g, beta, s0t, *, gated: bool = True, chains: int = 1,
              approx_math: bool = False, interpret=None):
  """(s_final_t,): the delta rule's final state from s0t, no outputs.

  Args:
    k: `[B, T, H, K]` bf16; v `[B, T, HV, V]` bf16 (T a multiple of 64, HV a multiple of H).
    t0: `[B, HV, Nc, C, C]` bf16, the gate-free inverses (I + diag(β) strict(k kᵀ))⁻¹.
    g: `[B, HV, T]` float32 chunk-local cumulative log gates (read only when `gated`).
    beta: `[B, HV, T]` float32.
    s0t: `[B, HV, L + V, K]` float32, the initial state transposed; its first L columns (L ≥ 0
      a multiple of 64) walk with v = 0.
    chains: 64-column blocks per CTA, 1 or 2 (two chains in flight per SM).
    approx_math: e^x as ex2.approx, as `chunk_walk` takes it.
  Returns:
    (s_final_t,) `[B, HV, L + V, K]` float32, the final state transposed.
  """
  if chains not in (1, 2):
    raise ValueError(f"maps_walk: chains={chains} must be 1 or 2.")
  width, dv = s0t.shape[2], v.shape[3]
  if width < dv or (width - dv) % BV:
    raise ValueError(f"maps_walk: s0t {tuple(s0t.shape)} must hold the V = {dv} state columns "
                     f"and at most a multiple of {BV} more.")
  if t0 is None:
    raise ValueError("maps_walk: t0 is None; linear attention's maps are products, not a walk.")
  out = _maps_walk(k, v, t0, g, beta, s0t, gated=bool(gated), chains=int(chains),
                   approx_math=bool(approx_math), interpret=interpret)
  return mc.sync_if_interpreted(out, interpret)


@functools.partial(jax.jit, static_argnames=("gated", "chains", "approx_math", "interpret"))
def _maps_walk(k, v, t0, g, beta, s0t, *, gated, chains, interpret, approx_math=False):
  b, t, h, dk = k.shape
  hv, dv = v.shape[2], v.shape[3]
  f32 = jnp.float32
  reason = cw.supported(C, dk, dv)
  if reason or t % C or hv % h:
    why = reason or f"T={t} must be a multiple of {C} and HV={hv} a multiple of H={h}"
    raise ValueError(f"maps_walk: {why}.")
  check_index_range(b, t, hv, dv)
  nc, n_rep = t // C, hv // h
  blocks = s0t.shape[2] // BV          # 64-column blocks of the state
  lead = blocks - dv // BV             # ... of them walking with v = 0
  stages = ring_stages(dk, chains)
  state_regs, factor_regs, memory_regs = REGS[chains]
  factors_wg, memory_wg = chains, chains + 1
  vec = plgpu.SMEM((stages, C), f32)

  def kernel(k_ref, v_ref, t0_ref, g_ref, beta_ref, s0_ref, sf_ref, k_s, v_s, m_s, g_state,
             g_rows, g_cols, b_cols, s_f32, in_bar, in_free, m_ready, s_bar, stage_k=None,
             stage_c=None):
    bi, hi, ci = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
    ki = lax.div(hi, n_rep)
    wg = lax.axis_index("wg")
    # The state block of each chain (an odd count's spare chain repeats the last one).
    block = [jnp.minimum(ci * chains + j, blocks - 1) for j in range(chains)]

    @pl.when(wg == memory_wg)
    def _memory():
      plgpu.set_max_registers(memory_regs, action="decrease")

      def issue(n, slot):
        rows = pl.ds(n * C, C)
        bar = in_bar.at[slot]
        plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, ki], k_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(t0_ref.at[bi, hi, n], m_s.at[slot], bar)
        for dst in (g_state, g_rows, g_cols):   # one copy per register layout read from it
          plgpu.copy_gmem_to_smem(g_ref.at[bi, hi, rows], dst.at[slot], bar)
        plgpu.copy_gmem_to_smem(beta_ref.at[bi, hi, rows], b_cols.at[slot], bar)
        for j in range(chains):
          v_cols = pl.ds(jnp.maximum(block[j] - lead, 0) * BV, BV)
          plgpu.copy_gmem_to_smem(v_ref.at[bi, rows, hi, v_cols], v_s.at[slot, j], bar)

      cw.stream_ring(issue, nc, stages, in_free)

    @pl.when(wg == factors_wg)
    def _factors():
      plgpu.set_max_registers(factor_regs, action="increase" if chains == 1 else "decrease")

      @pl.loop(0, nc)
      def _step(n):   # M̃ = T0 ⊙ Γ · diag(β), written over T0 in the ring
        slot = lax.rem(n, stages)
        plgpu.barrier_wait(in_bar.at[slot])
        gam = cw.decay_mask(g_rows, g_cols, slot, gated)
        beta_col = plgpu.load(b_cols.at[slot], layout=_COLS)
        t0_tile = plgpu.load(m_s.at[slot], layout=_WG).astype(f32)
        m_s.at[slot][...] = (t0_tile * gam * mc.cols(beta_col, (C, C))).astype(cw.MM_DTYPE)
        plgpu.commit_smem()
        plgpu.barrier_arrive(m_ready.at[slot])
        plgpu.barrier_arrive(in_free.at[slot])

    for j in range(chains):
      @pl.when(wg == j)
      def _state(j=j):
        plgpu.set_max_registers(state_regs, action="increase")
        vs = pl.ds(block[j] * BV, BV)
        plgpu.copy_gmem_to_smem(s0_ref.at[bi, hi, vs], s_f32.at[j], s_bar.at[j])
        plgpu.barrier_wait(s_bar.at[j])
        s_init = plgpu.load(s_f32.at[j], layout=_WG)
        v_on = jnp.where(block[j] >= lead, 1.0, 0.0).astype(f32)   # 0: a leading column
        st_k = None if stage_k is None else stage_k.at[j]
        st_c = None if stage_c is None else stage_c.at[j]

        def step(n, s_t):
          slot = lax.rem(n, stages)
          plgpu.barrier_wait(in_bar.at[slot])
          s_lo = s_t.astype(cw.MM_DTYPE)
          v_t = plgpu.load(v_s.at[slot, j].T, layout=_WG).astype(f32) * v_on
          ks_t = cw.product(s_lo, k_s.at[slot].T, (BV, C), st_k)
          if gated:
            g_col = plgpu.load(g_state.at[slot], layout=_COLS)
            g_last = g_state[slot, C - 1]
            r_t = v_t - ks_t * mc.cols(jnp.exp(g_col), (BV, C))
          else:
            r_t = v_t - ks_t
          plgpu.barrier_wait(m_ready.at[slot])
          e_t = cw.product(r_t.astype(cw.MM_DTYPE), m_s.at[slot].T, (BV, C), st_c)
          if gated:
            e_t = e_t * mc.cols(jnp.exp(g_last - g_col), (BV, C))
          s_next = cw.product(e_t.astype(cw.MM_DTYPE), k_s.at[slot], (BV, dk), st_c)
          plgpu.barrier_arrive(in_free.at[slot])
          return s_next + (s_t * jnp.exp(g_last) if gated else s_t)

        s_t = lax.fori_loop(0, nc, step, s_init)

        @pl.when(ci * chains + j < blocks)   # the spare chain stores nothing
        def _store():
          cw.store_state(s_t, s_f32.at[j], sf_ref.at[bi, hi, vs])

  scratch = dict(
      k_s=mc.smem((stages, C, dk), cw.MM_DTYPE), v_s=mc.smem((stages, chains, C, BV), cw.MM_DTYPE),
      m_s=mc.smem((stages, C, C), cw.MM_DTYPE), g_state=vec, g_rows=vec, g_cols=vec,
      b_cols=vec, s_f32=plgpu.SMEM((chains, BV, dk), f32),
      # one arrival per TMA copy of a chunk: k, T0, three gate copies, β, and each chain's v
      in_bar=plgpu.Barrier(num_arrivals=6 + chains, num_barriers=stages),
      in_free=plgpu.Barrier(num_arrivals=chains + 1, num_barriers=stages),
      m_ready=plgpu.Barrier(num_barriers=stages),
      s_bar=plgpu.Barrier(num_barriers=chains))
  if interpret is not None:   # staging tiles for register operands (`chunk_walk.product`)
    scratch.update(stage_k=mc.smem((chains, BV, dk), cw.MM_DTYPE),
                   stage_c=mc.smem((chains, BV, C), cw.MM_DTYPE))

  def body(*refs):
    names = list(scratch)
    return kernel(*refs[:7], **dict(zip(names, refs[7:])))

  return plgpu.kernel(body, out_type=(jax.ShapeDtypeStruct(s0t.shape, f32),),
                      scratch_types=tuple(scratch.values()),
                      grid=(b, hv, -(-blocks // chains)), grid_names=("b", "h", "v"),
                      num_threads=chains + 2, thread_name="wg", interpret=interpret,
                      compiler_params=mc.compiler_params(approx_math=approx_math))(
                          k, v, t0, g, beta, s0t)
