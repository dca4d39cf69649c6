"""The delta rule's forward (DeltaNet, GDN) as one warp-specialised Mosaic GPU chunk walk
(issue #17's v2 forward; `GpuTuning(forward="walk")`).

The Triton walk of `triton/fused_forward.py` computes the right thing but spends ~9 µs a chunk:
one instruction stream does the chunk's masks, scores and output *and* the serial state chain,
with every wgmma operand passing registers → shared memory first. Here one CTA per
(batch, value head, 64 value columns) runs three warpgroups on the same chunk ring:

* **memory** (few registers): streams q, k, v, the gate-free inverse T0 and the gate vectors of
  the next chunks into a `stages`-deep ring by TMA;
* **state**: holds the state transposed, Sᵀ `[BV, K]` float32, in registers and runs only the
  chain that carries it from chunk to chunk. Holding Sᵀ makes every product of the chain
  register-A wgmma (Sᵀ, Rᵀ and (x ⊙ E)ᵀ are the left operands, q/k/M̃ the shared-memory ones),
  so the chain never waits on its own shared-memory stores:

      Rᵀ = vᵀ − (Sᵀ kᵀ) ⊙ eᵀ        Eᵀ = Rᵀ M̃ᵀ        Sᵀ ← γ Sᵀ + (Eᵀ ⊙ xᵀ) k

  It publishes the bf16 Sᵀ and E of each chunk in a double buffer;
* **output**: makes the chunk's factors while the state warpgroup works, M̃ = T0 ⊙ Γ · diag(β)
  (written over T0 in the ring, so the chain reads it from there) and P = s q kᵀ ⊙ Γ, then
  O = s e ⊙ (q S) + P E from the published tiles, and stores O and E. `overlap` (three
  parts, timed on the H200 and no gain: docs/KERNELS_GPU.md "Overlapped products") moves
  waits of both warpgroups beside products.

The maths is the split's and the Triton walk's (docs/MATH.md §3; `fused_forward`'s docstring):
with D = diag(e^{G}), the gated inverse is M = D T0 D⁻¹, M_ij = T0_ij e^{G_i − G_j}, every
factor ≤ 1 on the lower triangle (no overflow however strong the decay); e = e^{G} (entry),
x = e^{G_C − G} (exit), γ = e^{G_C}. Products take bf16 operands and float32 accumulators; the
state is float32 throughout. E and O leave the kernel in bf16 (E: the tile the output read).

Linear attention is the same walk without the erase (`t0=None`): E = v, no Rᵀ, no M̃, so the
chain is the state update alone.

Scope: T a multiple of 64, K = 64 or 128, V a multiple of 64, GVA (key head = value head //
(HV / H)), an initial state. Packed segments are not taken (the caller keeps the Triton walk
for them). Forward only: under differentiation the op runs the split's custom VJP.
Written in the `plgpu.kernel` style, so JAX's Mosaic GPU interpreter runs it on CPU.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu import mosaic_common as mc
from pallas_kernels.gpu.state_passing import check_index_range

MM_DTYPE = jnp.bfloat16
CHUNK = 64
BLOCK_V = 64
SMEM_LIMIT = 227 * 1024      # Hopper's shared memory per CTA
# Registers per thread of each warpgroup (setmaxnreg; a multiple of 8, the three summing to at
# most 512 so that one CTA of 384 threads fits the SM's 64K registers).
STATE_REGS, OUTPUT_REGS, MEMORY_REGS = 232, 232, 40

_WG = plgpu.Layout.WGMMA
_ROWS = plgpu.Layout.WGMMA.reduce(1)   # a [C] vector indexing the rows of a WGMMA tile
_COLS = plgpu.Layout.WGMMA.reduce(0)   # ... its columns


def supported(chunk: int, dk: int, dv: int) -> str | None:
  """None if the walk takes these sizes, else why not."""
  if chunk != CHUNK:
    return f"chunk_size={chunk} (the Mosaic walk needs {CHUNK})"
  if dk not in (64, 128):
    return f"head dim K={dk} (the Mosaic walk needs K = 64 or 128)"
  if dv % BLOCK_V:
    return f"head dim V={dv} (the Mosaic walk needs a multiple of {BLOCK_V})"
  return None


def ring_stages(dk: int, bv: int = BLOCK_V) -> int:
  """Deepest input ring (2 to 4 chunks) whose shared memory fits with the fixed buffers."""
  per_stage = (2 * CHUNK * dk + CHUNK * bv + CHUNK * CHUNK) * 2 + 4 * CHUNK * 4
  # published Sᵀ and E, the output tiles (two each), the float32 state's staging tile
  fixed = 2 * bv * dk * 2 + 2 * CHUNK * bv * 2 + 2 * CHUNK * bv * 2 + bv * dk * 4 + 2048
  for stages in (4, 3, 2):
    if stages * per_stage + fixed <= SMEM_LIMIT:
      return stages
  raise ValueError(f"chunk_walk: K={dk} does not fit two ring stages in shared memory")


def stream_ring(issue, nc: int, stages: int, in_free):
  """The memory warpgroup's loop: fills the ring, then refills each slot with the chunk
  `stages` steps later once `in_free` says both compute warpgroups are done with it.
  issue(step, slot) starts the step's copies."""
  for n in range(min(stages, nc)):
    issue(n, n)

  @pl.loop(stages, nc)
  def _refill(n):
    slot = lax.rem(n, stages)
    plgpu.barrier_wait(in_free.at[slot])
    issue(n, slot)

  # Observe the last releases too: a barrier must not be left with phases its waiter has not
  # seen (the interpreter checks it; on the GPU it is a few cheap waits).
  for n in range(max(nc - stages, 0), nc):
    plgpu.barrier_wait(in_free.at[n % stages])


def copy_chunk_keys(refs, rings, bi, ki, hi, n, slot, bar):
  """Starts the TMA copies both walks need of chunk n into ring `slot`: q and k (key head ki),
  T0 (unless t0 is None: linear attention), the gates three times (one copy per register layout
  read from it: the state warpgroup's columns, the other's rows and columns) and β. refs: (q,
  k, t0, g, beta) in HBM; rings: (q_s, k_s, m_s, (g_state, g_rows, g_cols), b_cols)."""
  q_ref, k_ref, t0_ref, g_ref, beta_ref = refs
  q_s, k_s, m_s, g_rings, b_cols = rings
  rows = pl.ds(n * CHUNK, CHUNK)
  plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, ki], q_s.at[slot], bar)
  plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, ki], k_s.at[slot], bar)
  if t0_ref is not None:
    plgpu.copy_gmem_to_smem(t0_ref.at[bi, hi, n], m_s.at[slot], bar)
  for dst in g_rings:
    plgpu.copy_gmem_to_smem(g_ref.at[bi, hi, rows], dst.at[slot], bar)
  plgpu.copy_gmem_to_smem(beta_ref.at[bi, hi, rows], b_cols.at[slot], bar)


def decay_mask(g_rows, g_cols, slot, gated: bool):
  """Γ of the chunk in `slot`, [C, C] float32 in the WGMMA layout: e^{G_i − G_j} on i ≥ j, else
  0 (every exponent ≤ 0; ungated, the causal mask). g_rows / g_cols: the gate ring read as
  rows / columns."""
  c = CHUNK
  lower = mc.iota(c, 0) >= mc.iota(c, 1)
  if not gated:
    return jnp.where(lower, 1.0, 0.0)
  g_row = plgpu.load(g_rows.at[slot], layout=_ROWS)
  g_col = plgpu.load(g_cols.at[slot], layout=_COLS)
  diff = mc.rows(g_row, (c, c)) - mc.cols(g_col, (c, c))
  return jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)


def load_state(src, buf, bar):
  """A float32 `[BV, K]` state tile from HBM into registers (WGMMA layout) through `buf`."""
  plgpu.copy_gmem_to_smem(src, buf, bar.at[0])
  plgpu.barrier_wait(bar.at[0])
  return plgpu.load(buf, layout=_WG)


def store_state(x, buf, dst):
  """Registers → `buf` → HBM, waiting for the copy."""
  buf[...] = x
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(buf, dst)
  plgpu.wait_smem_to_gmem(0)


def product(a, b, shape, stage=None):
  """a · b into a fresh float32 accumulator (a: bf16 registers or a shared-memory ref).

  JAX's Mosaic GPU interpreter (jax 0.11.2) runs wgmma only from shared memory, so there a
  register operand is first stored to `stage` (a scratch tile the kernel allocates only when
  interpreted); compiled, `stage` is None and the operand stays in registers."""
  return products([(a, b, shape, stage)])[0]


def products(items):
  """Independent products issued at once and waited for together (one wait, their latencies
  overlapped), each `(a, b, shape, stage)` as `product` takes it; their values in order. An
  item may instead be a callable, run between the issues: a barrier wait that only the later
  products need, which the earlier ones then run through. Register operands stay live until
  the wait: group only what fits the registers."""
  issues, shapes = [], []
  for item in items:
    if callable(item):
      issues.append(item)
      continue
    a, b, shape, stage = item
    if stage is not None and isinstance(a, jax.Array):
      stage[...] = a
      plgpu.commit_smem()
      a = stage
    issues.append((a, b))
    shapes.append(shape)

  def body(*accs):
    acc = iter(accs)
    for issue in issues:
      if callable(issue):
        issue()
      else:
        plgpu.wgmma(next(acc), *issue)
    return tuple(x[...] for x in accs)

  return pl.run_scoped(body, *(plgpu.ACC(shape, jnp.float32) for shape in shapes))


def chunk_walk(q, k, v, t0, g, beta, s0t, *, scale: float, gated: bool = True,
               save_states: bool = False, overlap: bool | str = False, made_m: bool = False,
               approx_math: bool = False, interpret=None):
  """(o, e, s_final_t[, h_t]) of the delta rule's chunk form, or of linear attention.

  Args:
    q, k: `[B, T, H, K]` bf16; v `[B, T, HV, V]` bf16 (T a multiple of 64, HV a multiple of H).
    t0: `[B, HV, Nc, C, C]` bf16, the gate-free inverses (I + diag(β) strict(k kᵀ))⁻¹; or None
      for linear attention (no erase: E = v, S ← γ S + kᵀ E; beta is then not read).
    g: `[B, HV, T]` float32 chunk-local cumulative log gates (read only when `gated`).
    beta: `[B, HV, T]` float32.
    s0t: `[B, HV, V, K]` float32, the initial state transposed.
    save_states: also return h_t, the bf16 state entering every chunk (transposed, exactly
      the operand the chunk used): the backward's residual.
    overlap: which of the walk's waits to overlap, as a "+"-joined string of OVERLAP_PARTS
      (True: all three, False: none): "publish", the state warpgroup issues its products
      before publishing Sᵀ and E, which then run beside them; "ahead", the output warpgroup
      makes the next chunk's M̃, which the state chain waits for, as soon as this chunk's
      products are in, before O's epilogue; "group", it issues q S and P E together (one
      wait, not two). The same results whatever the parts.
    made_m: t0 holds M̃ = T0 ⊙ Γ · diag(β) already, made by the caller (beta is then not
      read): the state chain reads it from the ring as soon as the chunk lands, and the
      output warpgroup neither makes it nor is waited for. Its results differ from the walk's
      own M̃ by M̃'s rounding to bf16 (once, where the walk rounds T0 and then M̃). A timing
      probe (`bench_walks --made_m`): 4 % off the gated step on the H100, so no caller uses it.
    approx_math: e^x as ex2.approx (Mosaic GPU's approximate math): the gated walk's
      exponentials are a third of its state warpgroup's instructions, which set its step
      (docs/KERNELS_GPU.md, "What sets the walks' step"). Timed on the H100 (2026-12-05,
      `bench_walks --approx_math`, B4 T16384 H16 D128) the gated step went 2.30 → 2.21 µs, on
      the H200 2.18 → 1.94; the op passes `GpuTuning.approx_math` (on by default).
  Returns:
    o `[B, T, HV, V]` bf16 (its products' operands are bf16 already; rounding it here saves
    the float32 round trip through HBM), e `[B, T, HV, V]` bf16 (the pseudo-values, the write
    residual), s_final_t `[B, HV, V, K]` float32 (the final state transposed), and with
    save_states h_t `[B, HV, Nc, V, K]` bf16.
  """
  if s0t.shape[2] != v.shape[3]:
    raise ValueError(f"chunk_walk: s0t {tuple(s0t.shape)} must hold V = {v.shape[3]} state "
                     "columns (a wider state with leading v = 0 columns: maps_walk).")
  if made_m and t0 is None:
    raise ValueError("chunk_walk: made_m=True needs M̃ in t0 (linear attention has none).")
  outs = _chunk_walk(q, k, v, t0, g, beta, s0t, scale=float(scale), gated=bool(gated),
                     save_states=bool(save_states), overlap=overlap_parts(overlap),
                     made_m=bool(made_m), approx_math=bool(approx_math), interpret=interpret)
  return mc.sync_if_interpreted(outs, interpret)


OVERLAP_PARTS = ("publish", "ahead", "group")


def overlap_parts(overlap) -> frozenset:
  """`chunk_walk`'s `overlap` as the set of its parts (hashable: a static argument)."""
  if isinstance(overlap, bool):
    return frozenset(OVERLAP_PARTS if overlap else ())
  parts = frozenset(overlap.split("+")) if isinstance(overlap, str) and overlap else None
  if parts is None or not parts <= set(OVERLAP_PARTS):
    raise ValueError(f"chunk_walk: overlap must be a bool or a '+'-joined string of "
                     f"{OVERLAP_PARTS}, got {overlap!r}.")
  return parts


def kernel_args(args):
  """Both walks' HBM inputs: `args` without the inputs a call does not have (None: t0 for
  linear attention, dE_ext without a residual), and a function putting each None back in its
  place among the kernel's input refs."""
  absent = [i for i, x in enumerate(args) if x is None]

  def with_absent(refs):
    refs = list(refs)
    for i in absent:
      refs.insert(i, None)
    return tuple(refs)
  return tuple(x for x in args if x is not None), with_absent


@functools.partial(jax.jit, static_argnames=("scale", "gated", "save_states", "overlap",
                                             "made_m", "approx_math", "interpret"))
def _chunk_walk(q, k, v, t0, g, beta, s0t, *, scale, gated, save_states, interpret,
                overlap=frozenset(), made_m=False, approx_math=False):
  b, t, h, dk = q.shape
  hv, dv = v.shape[2], v.shape[3]
  c, bv, f32 = CHUNK, BLOCK_V, jnp.float32
  publish, group = "publish" in overlap, "group" in overlap
  reason = supported(c, dk, dv)
  if reason or t % c or hv % h:
    why = reason or f"T={t} must be a multiple of {c} and HV={hv} a multiple of H={h}"
    raise ValueError(f"chunk_walk: {why}.")
  check_index_range(b, t, hv, dv)
  nc, n_rep = t // c, hv // h
  stages = ring_stages(dk, bv)
  out_type = [jax.ShapeDtypeStruct((b, t, hv, dv), MM_DTYPE),
              jax.ShapeDtypeStruct((b, t, hv, dv), MM_DTYPE),
              jax.ShapeDtypeStruct((b, hv, dv, dk), f32)]
  if save_states:
    out_type.append(jax.ShapeDtypeStruct((b, hv, nc, dv, dk), MM_DTYPE))
  vec = plgpu.SMEM((stages, c), f32)
  # In-bar arrivals: one per TMA copy of a chunk (q, k, v, T0 and the four gate vectors).
  delta = t0 is not None
  n_copies = 8 if delta else 7

  def kernel(q_ref, k_ref, v_ref, t0_ref, g_ref, beta_ref, s0_ref, o_ref, e_ref, sf_ref, h_ref,
             q_s, k_s, v_s, m_s, g_state, g_rows, g_cols, b_cols, s_pub, e_pub, o_out, s_f32,
             in_bar, in_free, m_ready, pub_ready, pub_free, s_bar, stage_k=None, stage_c=None,
             stage_p=None):
    bi, hi, vi = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
    ki = lax.div(hi, n_rep)
    vs = pl.ds(vi * bv, bv)
    wg = lax.axis_index("wg")

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(MEMORY_REGS, action="decrease")

      def issue(n, slot):
        rows = pl.ds(n * c, c)
        bar = in_bar.at[slot]
        copy_chunk_keys((q_ref, k_ref, t0_ref, g_ref, beta_ref),
                        (q_s, k_s, m_s, (g_state, g_rows, g_cols), b_cols), bi, ki, hi, n, slot,
                        bar)
        plgpu.copy_gmem_to_smem(v_ref.at[bi, rows, hi, vs], v_s.at[slot], bar)

      stream_ring(issue, nc, stages, in_free)

    @pl.when(wg == 0)
    def _state():
      plgpu.set_max_registers(STATE_REGS, action="increase")
      s_init = load_state(s0_ref.at[bi, hi, vs], s_f32, s_bar)

      def step(n, s_t):
        slot = lax.rem(n, stages)
        half = lax.rem(n, 2)
        plgpu.barrier_wait(in_bar.at[slot])

        @pl.when(n >= 2)
        def _():   # the output warpgroup has read what was published two chunks ago
          plgpu.barrier_wait(pub_free.at[half])

        s_lo = s_t.astype(MM_DTYPE)

        def publish_s():   # Sᵀ for the output warpgroup (and, saving states, for h)
          if save_states:   # this tile's copy to h from two chunks back must have read it
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
          s_pub.at[half][...] = s_lo
          if save_states:
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(s_pub.at[half], h_ref.at[bi, hi, n, vs])

        def publish_e():   # E, then the output warpgroup may read both
          e_pub.at[half].T[...] = e_t.astype(MM_DTYPE)
          plgpu.commit_smem()
          plgpu.barrier_arrive(pub_ready.at[half])

        # Overlapped, the chain's products are issued first and the publishing runs while they
        # do: Sᵀ beside Sᵀ kᵀ, E beside the state update.
        if not (publish and delta):
          publish_s()
        if gated:
          g_col = plgpu.load(g_state.at[slot], layout=_COLS)
          g_last = g_state[slot, c - 1]
          entry = mc.cols(jnp.exp(g_col), (bv, c))
          exit_ = mc.cols(jnp.exp(g_last - g_col), (bv, c))
          decay = jnp.exp(g_last)
        # Rᵀ = vᵀ − (Sᵀ kᵀ) ⊙ eᵀ, then Eᵀ = Rᵀ M̃ᵀ once the output warpgroup has made M̃;
        # linear attention writes v itself.
        v_t = plgpu.load(v_s.at[slot].T, layout=_WG).astype(f32)
        if delta:
          if publish:
            (ks_t,) = products([(s_lo, k_s.at[slot].T, (bv, c), stage_k), publish_s])
          else:
            ks_t = product(s_lo, k_s.at[slot].T, (bv, c), stage_k)
          r_t = v_t - (ks_t * entry if gated else ks_t)
          if not made_m:
            plgpu.barrier_wait(m_ready.at[slot])
          e_t = product(r_t.astype(MM_DTYPE), m_s.at[slot].T, (bv, c), stage_c)
        else:
          e_t = v_t
        if not publish:
          publish_e()
        # Sᵀ ← γ Sᵀ + (Eᵀ ⊙ xᵀ) k
        xe_t = (e_t * exit_ if gated else e_t).astype(MM_DTYPE)
        if publish:
          (s_next,) = products([(xe_t, k_s.at[slot], (bv, dk), stage_c), publish_e])
        else:
          s_next = product(xe_t, k_s.at[slot], (bv, dk), stage_c)
        plgpu.barrier_arrive(in_free.at[slot])
        return s_next + (s_t * decay if gated else s_t)

      s_t = lax.fori_loop(0, nc, step, s_init)
      for n in range(max(nc - 2, 0), nc):   # the last releases of the published tiles
        plgpu.barrier_wait(pub_free.at[n % 2])
      store_state(s_t, s_f32, sf_ref.at[bi, hi, vs])

    @pl.when(wg == 1)
    def _output():
      plgpu.set_max_registers(OUTPUT_REGS, action="increase")

      def make_m(slot, gam):   # M̃ = T0 ⊙ Γ · diag(β) over T0 in the ring: the state's Eᵀ = Rᵀ M̃ᵀ
        beta_col = plgpu.load(b_cols.at[slot], layout=_COLS)
        t0_tile = plgpu.load(m_s.at[slot], layout=_WG).astype(f32)
        m_s.at[slot][...] = (t0_tile * gam * mc.cols(beta_col, (c, c))).astype(MM_DTYPE)
        plgpu.commit_smem()
        plgpu.barrier_arrive(m_ready.at[slot])

      # Overlapped, the next chunk's M̃ is made as soon as this chunk's products are in, before
      # O's epilogue: the state chain waits for it (chunk 0's comes before the loop). Its Γ is
      # carried into the next step for P, so each chunk's mask is made once (gated, remaking it
      # cost the walk 13 %: docs/KERNELS_GPU.md).
      ahead = "ahead" in overlap and delta and not made_m
      carry_gam = ahead and gated
      gam0 = None
      if ahead:
        plgpu.barrier_wait(in_bar.at[0])
        gam0 = decay_mask(g_rows, g_cols, 0, gated)
        make_m(0, gam0)

      def step(n, carry):
        slot = lax.rem(n, stages)
        half = lax.rem(n, 2)
        rows = pl.ds(n * c, c)
        if not ahead:   # (ahead: waited for in the step before)
          plgpu.barrier_wait(in_bar.at[slot])
        gam = carry if carry_gam else decay_mask(g_rows, g_cols, slot, gated)
        if gated:
          entry = mc.rows(jnp.exp(plgpu.load(g_rows.at[slot], layout=_ROWS)) * scale, (c, bv))
        else:
          entry = scale
        if delta and not ahead and not made_m:
          make_m(slot, gam)
        qk = product(q_s.at[slot], k_s.at[slot].T, (c, c))
        p = (qk * (gam * scale)).astype(MM_DTYPE)
        plgpu.barrier_wait(pub_ready.at[half])
        plgpu.copy_smem_to_gmem(e_pub.at[half], e_ref.at[bi, rows, hi, vs])
        if group:   # one wait for both
          qs, pe = products([(q_s.at[slot], s_pub.at[half].T, (c, bv), None),
                             (p, e_pub.at[half], (c, bv), stage_p)])
        else:
          qs = product(q_s.at[slot], s_pub.at[half].T, (c, bv))
          pe = product(p, e_pub.at[half], (c, bv), stage_p)
        plgpu.barrier_arrive(in_free.at[slot])
        if ahead:
          # The last step makes no M̃; its Γ is the last chunk's again (a value to carry, unused).
          nxt = lax.rem(jnp.minimum(n + 1, nc - 1), stages)

          @pl.when(n + 1 < nc)
          def _():
            plgpu.barrier_wait(in_bar.at[nxt])

          gam_next = decay_mask(g_rows, g_cols, nxt, gated)

          @pl.when(n + 1 < nc)
          def _():
            make_m(nxt, gam_next)

        # E's copy (and the copy of O two chunks back, from o_out[half]) done reading.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.barrier_arrive(pub_free.at[half])
        o_out.at[half][...] = (qs * entry + pe).astype(MM_DTYPE)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_out.at[half], o_ref.at[bi, rows, hi, vs])
        return gam_next if carry_gam else carry

      lax.fori_loop(0, nc, step, gam0 if carry_gam else None)
      plgpu.wait_smem_to_gmem(0)

  scratch = dict(
      q_s=mc.smem((stages, c, dk), MM_DTYPE), k_s=mc.smem((stages, c, dk), MM_DTYPE),
      v_s=mc.smem((stages, c, bv), MM_DTYPE), m_s=mc.smem((stages, c, c), MM_DTYPE),
      g_state=vec, g_rows=vec, g_cols=vec, b_cols=vec,
      s_pub=mc.smem((2, bv, dk), MM_DTYPE), e_pub=mc.smem((2, c, bv), MM_DTYPE),
      o_out=mc.smem((2, c, bv), MM_DTYPE), s_f32=plgpu.SMEM((bv, dk), f32),
      in_bar=plgpu.Barrier(num_arrivals=n_copies, num_barriers=stages),
      in_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      m_ready=plgpu.Barrier(num_barriers=stages),
      pub_ready=plgpu.Barrier(num_barriers=2), pub_free=plgpu.Barrier(num_barriers=2),
      s_bar=plgpu.Barrier(num_barriers=1))
  if interpret is not None:   # staging tiles for register operands (`product`)
    scratch.update(stage_k=mc.smem((bv, dk), MM_DTYPE), stage_c=mc.smem((bv, c), MM_DTYPE),
                   stage_p=mc.smem((c, c), MM_DTYPE))

  ins, with_absent = kernel_args((q, k, v, t0, g, beta, s0t))

  def body(*refs):
    names = list(scratch)
    n_in = len(ins) + len(out_type)
    outs = refs[len(ins):n_in] + (() if save_states else (None,))
    return kernel(*with_absent(refs[:len(ins)]), *outs, **dict(zip(names, refs[n_in:])))

  return plgpu.kernel(body, out_type=tuple(out_type), scratch_types=tuple(scratch.values()),
                      grid=(b, hv, dv // bv), grid_names=("b", "h", "v"), num_threads=3,
                      thread_name="wg", interpret=interpret,
                      compiler_params=mc.compiler_params(approx_math=approx_math))(*ins)


def chunk_walk_reference(q, k, v, t0, g, beta, s0t, *, scale: float, gated: bool = True):
  """The same walk as a float32 `lax.scan` over chunks at Precision.HIGHEST, with the kernel's
  bf16 roundings of the product operands (Sᵀ, Rᵀ, M̃, P, E, (x ⊙ E)): the oracle the kernel
  must match to float32 accumulation noise. Same arguments (t0 None: linear attention);
  returns (o, e, s_final_t, h_t) in float32, h_t the bf16-rounded state entering each chunk
  `[B, HV, Nc, V, K]`."""
  hp = lax.Precision.HIGHEST
  f32 = jnp.float32
  rnd = lambda x: x.astype(MM_DTYPE).astype(f32)
  b, t, h, dk = q.shape
  hv, dv = v.shape[2:]
  c, nc, n_rep = CHUNK, t // CHUNK, hv // h
  split = lambda x: jnp.moveaxis(x.reshape(b, nc, c, *x.shape[2:]), 1, 0)   # [Nc, B, C, ...]
  qc, kc = (jnp.repeat(split(x.astype(f32)), n_rep, axis=3) for x in (q, k))
  vc = split(v.astype(f32))
  gc = jnp.moveaxis(g.astype(f32).reshape(b, hv, nc, c), 2, 0) if gated else None
  bc = jnp.moveaxis(beta.astype(f32).reshape(b, hv, nc, c), 2, 0)
  delta = t0 is not None
  tc = jnp.moveaxis(t0.astype(f32), 2, 0) if delta else jnp.zeros((nc, b, hv, c, c), f32)
  lower = jnp.tril(jnp.ones((c, c), bool))

  def step(s_t, xs):   # s_t [B, HV, V, K]
    q_, k_, v_, t0_, g_, b_ = xs     # q_, k_ [B, C, HV, K]; v_ [B, C, HV, V]; t0_ [B, HV, C, C]
    if gated:
      diff = jnp.where(lower, g_[..., :, None] - g_[..., None, :], 0.0)
      gam = jnp.where(lower, jnp.exp(diff), 0.0)
      entry, exit_, decay = jnp.exp(g_), jnp.exp(g_[..., -1:] - g_), jnp.exp(g_[..., -1])
    else:
      gam = jnp.broadcast_to(lower.astype(f32), t0_.shape)
      entry = exit_ = jnp.ones(b_.shape, f32)
      decay = jnp.ones(b_.shape[:-1], f32)
    s_lo = rnd(s_t)
    ks = jnp.einsum("bhvk,bchk->bhvc", s_lo, k_, precision=hp)
    if delta:
      r_t = jnp.einsum("bchv->bhvc", v_) - ks * entry[:, :, None, :]
      m = rnd(t0_ * gam * b_[:, :, None, :])
      e_t = jnp.einsum("bhvj,bhij->bhvi", rnd(r_t), m, precision=hp)
    else:   # linear attention: E = v
      e_t = jnp.einsum("bchv->bhvc", v_)
    e_lo = rnd(e_t)
    p = rnd(jnp.einsum("bihk,bjhk->bhij", q_, k_, precision=hp) * gam * scale)
    o = (jnp.einsum("bihk,bhvk->bhiv", q_, s_lo, precision=hp) * (entry * scale)[..., None]
         + jnp.einsum("bhij,bhvj->bhiv", p, e_lo, precision=hp))
    s_next = (s_t * decay[..., None, None]
              + jnp.einsum("bhvc,bchk->bhvk", rnd(e_t * exit_[:, :, None, :]), k_, precision=hp))
    return s_next, (o, e_t, s_lo)

  s_t, (o, e_t, h_t) = lax.scan(step, s0t.astype(f32),
                           (qc, kc, vc, tc, gc if gated else bc, bc))
  # [Nc, B, HV, C, V] -> [B, T, HV, V]
  to_rows = lambda x: jnp.transpose(x, (1, 0, 3, 2, 4)).reshape(b, t, hv, dv)
  o = to_rows(o)
  e = to_rows(jnp.swapaxes(e_t, -1, -2))
  return o, e, s_t, jnp.moveaxis(h_t, 0, 2)
