"""Sizes the Triton kernels take and their block sizes, fixed per size and GPU family (no
run-time autotuning).

Plain Python (no triton import), so the dispatch and CPU tests can read it without the extra.

How the numbers were chosen: by timing on the H200 where one was at hand, and elsewhere by what
ptxas reports off GPU (`python -m experiments.triton_ptxas --arch=80`: registers a thread,
spill bytes and shared memory of each kernel as jax-triton compiles it), since a kernel that
spills inside its loop runs at a fraction of its speed. The tables of both are in
docs/BENCHMARKS.md ("The Triton path, fourth stage") and docs/data/triton_ptxas_2026-12-02_*.
"""

from __future__ import annotations

CHUNK = 64          # rows of a chunk (tl.dot's M); the chunk form's default
HEAD_DIMS_K = (16, 32, 64, 128, 256)


def _block_v(dv: int, cap: int) -> int:
  """The largest of 64 / 32 / 16 that is at most `cap` and divides dv."""
  for bv in (64, 32, 16):
    if bv <= cap and dv % bv == 0:
      return bv
  raise ValueError(f"dv={dv} must be a multiple of 16")


def state_launch(dk: int, dv: int, *, reverse: bool = False,
                 hopper: bool = False) -> tuple[int, int, int]:
  """(BLOCK_V, warps, pipeline stages) of the state pass at head dims (dk, dv), forward or
  reverse, on Hopper or another GPU.

  One program owns a float32 state tile [K, BLOCK_V] in registers for the whole sequence plus
  one chunk's operand tiles, and walks the chunks with the loop software-pipelined
  (`tl.range(num_stages=...)`; triton 3.6 ignored the launch's num_stages for this loop, so
  H200 timings before 2026-12-02 are of 1 stage).

  * Hopper, K <= 128: BLOCK_V 64, 4 warps; forward 3 stages, reverse 2. Timed on the H200
    (GDN, B4 T4096 H16 K = V = 128, 2026-12-02, `bench_triton_parts --state_launches`):
    forward 0.46-0.56 ms at 64:4:2, **0.32 at 64:4:3** (Mosaic's: 0.33), 0.54 at 32:4:2, 0.48
    at 64:8:2; reverse 0.41-0.43 at 64:4:2, 0.69 at 32:4:2, 0.42 at 64:8:2, and at 3 stages
    over Hopper's 227 KB of shared memory.
  * other GPUs (sm_80 / sm_86 / sm_89), K <= 128: BLOCK_V 32, 8 warps, 2 stages. Untimed (no
    such GPU here); chosen by ptxas: Hopper's launch spills there at K = V = 128 (the forward
    ~1.1 KB a thread on sm_80, the reverse compiled to 32 registers and 11 KB of spills), 32:8:2
    spills nothing in either kernel at K = 64 or 128 on sm_80, sm_86 and sm_89 and takes 66 KB
    of shared memory at most, inside sm_86 / sm_89's 99 KB a block.
  * K = 256, any GPU: BLOCK_V 16, 8 warps, 1 stage (no shared memory for a second copy of its
    tiles): spill-free on sm_80 / sm_86 / sm_90, where 32:4:1 spilled. Untimed.
  """
  if dk > 128:
    return _block_v(dv, 16), 8, 1
  if hopper:
    return _block_v(dv, 64), 4, 2 if reverse else 3
  return _block_v(dv, 32), 8, 2


def supported(chunk: int, dk: int, dv: int) -> str | None:
  """None if the Triton kernels take these sizes, else why not (for the dispatch's log line)."""
  if chunk != CHUNK:
    return f"chunk_size={chunk} (the Triton kernels need {CHUNK})"
  if dk not in HEAD_DIMS_K:
    return f"head dim K={dk} (the Triton kernels need K in {HEAD_DIMS_K})"
  if dv % 16 or dv > 512:
    return f"head dim V={dv} (the Triton kernels need a multiple of 16, at most 512)"
  return None


# The delta-rule intra-chunk kernels (`intra_chunk.py`), one program per chunk, timed by
# `experiments.bench_triton_parts` on the H200 (GDN, B4 T4096 H16 D128, 2026-12-02, today's
# 4 -> 16 -> 64 inverse):
# * warps: 4. The forward took 0.74 ms at 4 warps and 0.88 at 8 (tf32 products), the backward
#   1.16 and 1.60: 8 warps' synchronisation cost more than 4 warps' extra registers a thread.
# * the inverse's products (tl.dot input_precision): "tf32", one tensor-core pass, 0.74 ms;
#   "tf32x3" (three passes, near float32) took 1.72 and "ieee" (float32 on the CUDA cores)
#   4.60, all three at the same error (1.9e-3). The inverse is arranged so that tf32 is enough
#   (`intra_chunk`'s docstring).
# * slices (`intra_chunk`'s docstring): as whole [64, D] tiles both kernels spilled at K = V =
#   128 (ptxas, triton 3.6, sm_90a, off GPU; 255 registers in every case): forward 2164 bytes
#   of spill stores at 4 warps, 1060 at 8, 3964 packed at 4; backward 2100 at 4, 1756 at 8,
#   3072 packed at 4; at K = V = 64, 784 / 1580 bytes at 4 warps. Sliced with INTRA_BK = 16,
#   nothing spills at K = V = 64 or 128, packed or not, 4 or 8 warps: 4 warps 203-230
#   registers forward, 234-252 backward; 8 warps 172-211 and 191-199. BK = 32 spilled
#   40-48 bytes in the 4-warp backward at K = V = 64 and needed 242-255 registers. 4 warps
#   kept: at these counts both give 8 resident warps an SM by registers (two 4-warp
#   programs or one 8-warp), and 4 warps timed faster before the slicing. Speed not re-timed
#   since the slicing (no GPU at the rewrite): time 4 and 8 warps with
#   `experiments.bench_triton_parts`.
INTRA_WARPS = 4
INTRA_BK = 16
# Software-pipelining depth of those kernels' slice loops (`tl.range`; eight [64, 16] slices of
# K or V each, loaded from HBM while the previous slice's small dots run). 2, timed on the H200
# (GDN, B4 T4096 H16 D128, 2026-12-02 15:20 UTC, `bench_triton_parts --slice_stages=1,2`):
# forward 0.758 -> 0.684 ms, backward 1.304 -> 1.039. ptxas (off GPU) at 2 stages: shared
# memory unchanged (32-38 KB), spills about as at 1 (sm_80 4-20 bytes in the backward against
# 0-88, sm_86 0-60 against 0-84; sm_90a 56 bytes in the packed K = 64 backward, else 0).
INTRA_SLICE_STAGES = 2
INTRA_HEAD_DIMS = (64, 128)   # the sizes the intra kernels were checked (and ptxas'd) at
# The per-channel kernels (`channel_intra.py`) walk K in slices of CHANNEL_BK channels, so that
# no program holds a whole float32 [64, K] tile. Their first version held q, k, k̃ and G as four
# [64, K] float32 tiles and took 4.89 ms for the KDA forward at 8 warps, 5.34 at 4, where XLA's
# part takes 2.88 (H200, B4 T4096 H16 K128, 2026-12-02). ptxas (triton 3.6, sm_90a, compiled
# off GPU) confirms the spills: at 8 warps and K = V = 128 both of its kernels used 255
# registers a thread and spilled 692 bytes (forward) and 2118 (backward); 780 and 2856 packed.
# Sliced, at 8 warps: BK = 16 spills nothing in either kernel (K = V = 128 packed or not, K = V = 64;
# 231-244 registers forward, 150-188 backward); BK = 32 still spilled 8-20 bytes a kernel and
# BK = 64 ~600-900. At 4 warps BK = 16 keeps the forward spill-free (236-254) but the backward
# spills 4-56 bytes. Timed sliced on the H200 (KDA, B4 T4096 H16 K128, 2026-12-02,
# `bench_triton_parts --mixers=kda`): forward 2.46 ms at 4 warps, 3.22 at 8; the backward's
# kernel half 3.15 at 4, 5.21 at 8 (XLA's forward part: 2.85). So 4 warps: twice the programs
# resident an SM outweigh the backward's few spilled bytes.
# Re-timed with today's kernels through the op (H100, 2026-12-06, B4 T4096 H16 D128 fwd+bwd,
# queued, 3 rounds): the backward kernel at 8 warps KDA 3.81 -> 4.42 ms, GDN-2 4.18 -> 4.88; the
# forward at 8, 4.55 / 4.90 (docs/data/channel_warps_h100_2026-12-06.log). Still 4.
CHANNEL_WARPS = 4
CHANNEL_BK = 16
# Software-pipelining depth of the channel kernels' diagonal-band loops (`tl.range`): each of
# the 16 bands reads its partner rows of G and K (and in the backward of Q, K̃, dP, dL) from
# global memory, one dependent round trip per band at 1 stage. At 2, triton 3.6 stages the next
# band's loads as async copies (4 in the forward's TTGIR, none at 1) with no extra registers or
# spills on sm_90a / sm_80 (ptxas off GPU). 1 until timed on a GPU
# (`bench_triton_parts --band_stages=1,2`).
CHANNEL_BAND_STAGES = 1
# Software-pipelining depth of the channel forward's slice loop (`tl.range` over the K // BK
# channel slices): at 2 triton 3.6 loads the next slice's q, k, k̃, G and anchor rows as async
# copies while this slice's products run (28 in the TTGIR); ptxas (sm_90a, K = V = 128): 255
# registers and no spills without packing (1 stage: 196-211, none), 20-36 bytes packed (8-44).
# Timed on an H100 (2026-12-06, B4 T4096 H16 D128): slower. The op's fwd+bwd KDA 3.73 -> 3.80
# ms, GDN-2 4.10 -> 4.20; the kernel alone with the gates on chip 0.91 / 1.05 / 0.94 ms at 1 / 2
# / 3 stages (`bench_triton_parts --mixers=kda --channel_slice_stages=1,2,3`). So 1.
CHANNEL_SLICE_STAGES = 1
# Where the channel forward makes NY = −M (K̃ ⊙ e^G) and U = M Ṽ: "fused", at the end of each
# forward program (the two solve loops, after the inverse); "kernel", in a second kernel from the
# stored M, one program per chunk and 64-column block, at the occupancy of its few registers.
# On an H100 (2026-12-06) the fused forward took ~0.3-0.4 of its ~1.0 ms wall time in those
# loops (`bench_triton_parts --phase_costs`), but "kernel" is slower (B4 T4096 H16 D128: the
# forward with the gates on chip 0.862 -> 0.965 ms; the op's fwd+bwd KDA 3.72 -> 3.78, GDN-2
# 4.07 -> 4.20), as were the loops' operands loaded before the inverse (0.992) and the loops
# software-pipelined (0.887; both tried in 53c2212 and removed). So "fused".
# "paired": the fused loops as one, each step making NY's and U's blocks of the same columns;
# "prefetched" (the default since 2026-12-07): that, with the next step's tiles loaded before
# this step's products (docs/KERNELS_GPU.md "The solve loops paired or prefetched"): the same
# values to the bit, faster in every round on an H100 (B4 T4096 H16 D128 fwd+bwd, 5 rounds:
# KDA 3.507 -> 3.484 ms, GDN-2 3.906 -> 3.901; "paired" 3.500 and 3.901). CHANNEL_SOLVE_LOOPS:
# the forward kernel's SOLVE_LOOP for each.
CHANNEL_SOLVES = ("fused", "paired", "prefetched", "kernel")
CHANNEL_SOLVE_LOOPS = {"fused": 0, "paired": 1, "prefetched": 2}
CHANNEL_SOLVE = "prefetched"
# The bounded-span path of the channel kernels (docs/KERNELS_GPU.md "Toward KDA / GDN-2 at jla's
# speed"): 0 keeps the exact float32 diagonal blocks everywhere. Above 0, a channel slice of a
# chunk whose every 16-row sub-chunk decays by at most CHANNEL_SPAN nats (in every channel of
# the slice) takes its diagonal blocks on the tensor cores like the off-diagonal ones, anchored
# at the sub-chunk's first row: the factors are e^x with |x| <= CHANNEL_SPAN (finite in float32
# and bf16 up to ~88), bf16 operands instead of float32 sums. Other slices keep the exact path.
# 80 (the bound jla's vector-gate kernels use): on the H200 (2026-12-04, B4 T4096 H16 D128,
# fwd+bwd) KDA 4.62 ms and GDN-2 4.84 against 5.65 / 5.82 with 0 (docs/BENCHMARKS.md
# "fifteenth stage").
CHANNEL_SPAN = 80.0


def solve_bk(dk: int, dv: int) -> int:
  """Columns a step of the intra-chunk forward kernels' solve loops (NY = −M R, U = M Ṽ; both
  the delta-rule and the per-channel kernels) take: the widest of 64 / 32 / 16 dividing both
  head dims. Only M is live there, so wide steps fit. (The TTGIR converts M to the product's
  operand layout once per step, but the channel forward's SASS, sm_90a at K = V = 128, packs
  M's operand registers once before the loops: that conversion costs nothing a step.)"""
  for bk in (64, 32, 16):
    if dk % bk == 0 and dv % bk == 0:
      return bk
  return CHANNEL_BK


def channel_bwd_solve_bk(dk: int, dv: int, *, hopper: bool) -> int:
  """Columns a step of the channel backward's solve loops (Y, dR = Mᵀ dY, −dL += dR Yᵀ) take.
  ptxas of the fused backward (off GPU, K = V = 128, 4 warps): sm_90a at 16 columns 124 / 296
  bytes of spills (plain / packed) and 125 barriers, at 32 92 / 292 and 69 barriers, at 64 no
  fewer barriers and more code; sm_80 / sm_86 spill 0-50 bytes more at 32 than at 16. So
  Hopper takes 32 (where dividing), other GPUs 16."""
  bk = 32 if hopper else CHANNEL_BK
  return bk if dk % bk == 0 and dv % bk == 0 else CHANNEL_BK


def grads_bk(dk: int, *, hopper: bool, fused: bool = False) -> int:
  """Columns a step of the delta-rule backward's dq / dk loop takes. Its two [C, C] operands
  (dA, dB + dBᵀ) are loop-invariant, but triton 3.6 converts them to the products' operand
  layout inside every step (TTGIR), so fewer, wider steps convert less. ptxas (off GPU, K = V =
  128, packed or not, 2 slice stages): sm_90a spill-free at 16, 32 and 64 columns (234-255
  registers; shared 39 / 53 / 82 KB; barriers 166 / 142 / 124); sm_80 spills 4-20 bytes at 16,
  0-12 at 32, 8-48 at 64, sm_86 32-64 at all three. So Hopper takes 64, other GPUs 32.
  `fused` (the kernel that also finishes the QG / KG terms, two more tiles a step): on sm_90a
  at K = 128 0 / 0-4 / 176-256 bytes of spills at 16 / 32 / 64, so Hopper takes 32 there."""
  widths = ((32, 16) if fused else (64, 32, 16)) if hopper else (32, 16)
  for bk in widths:
    if dk % bk == 0:
      return bk
  return INTRA_BK


def from_states_vs(dv: int) -> int:
  """Value columns a step of `intra_chunk_bwd_from_states`'s in-kernel products (its `_abt`
  loops): all of V in one step up to 128, else 64. Compiled by triton 3.6 on the H200 the
  two-step loop (V = 128 at 64 a step) gave a wrong dk, at one or two slice stages, while one
  step of 128 matched XLA's products in every result (tests/test_triton_gpu.py,
  `test_from_states_backward_matches_the_glue`, 2026-12-03); Triton's interpreter gets both
  right. Above 128 the steps are the untested multi-step loop, which the op does not call.
  The price (ptxas, sm_90a, K = V = 128): 392-412 B of spills a thread and 160 KB of shared
  memory, against 4-44 B and 36 KB in steps of 64; untimed."""
  return dv if dv <= 128 else 64


# Phases of the channel kernels a timing run may leave out (`skip_phases`, a sum of these; the
# results are then wrong): what each costs is the time it takes off (bench_triton_parts
# --phase_costs). Never set by the op.
PHASE_SOLVE = 1       # the solve loops (forward: NY, U; backward: Y, U, dR and dL)
PHASE_ANCHORED = 2    # the anchored off-diagonal products
PHASE_BANDS = 4       # the exact diagonal-band loops
INTRA_PRECISIONS = ("ieee", "tf32x3", "tf32")
INTRA_PRECISION = "tf32"
# How the delta-rule intra forward builds M = (I + L)^{-1} (`intra_chunk.intra_chunk_fwd`):
# "tiles", ten full-tile 64 × 64 products (about 0.475 of the forward's 0.609 ms on the H200,
# 2026-12-02, docs/BENCHMARKS.md "seventh stage"), or "batched", the 4 → 16 levels as batched
# products of the four 16 × 16 diagonal blocks and only the 16 → 64 merge full-tile.
# "batched" since the interleaved A/B of 2026-12-03 (`experiments/bench_ab.py`, 15 rounds,
# docs/BENCHMARKS.md "ninth stage"): batched / tiles, paired per round, 0.972 (DeltaNet fwd),
# 0.977 (fwd+bwd), 0.965 (GDN fwd), 1.005 (fwd+bwd); same errors.
INTRA_INVERSES = ("tiles", "batched")
INTRA_INVERSE = "batched"
# The T0 kernel's inverses (`t0_launch`): the intra kernel's, and two forms of the batched one
# whose 16 -> 64 merge is three dependent products deep instead of four
# (`intra_chunk._merge_blocks_short`), with float32 (tf32) or bf16 operands. Timed on the H200
# (2026-12-04, `experiments/bench_t0.py`; `t0_launch`'s docstring): batched_short 2 % faster
# at the same error; batched_bf16 27 % faster at 6.9e-4 against 4.8e-4, the default. In
# Triton's interpreter (float32 products exact) the bf16 merges' error was 6.7e-4 against
# 4.1e-4 on independent unit keys, but 5.0e-3 against 8.9e-4 on correlated ones (keys 0.9 of a
# shared direction); the op's own error did not move with it (`t0_launch`).
T0_INVERSES = INTRA_INVERSES + ("batched_short", "batched_bf16")


def intra_supported(kind: str, chunk: int, dk: int, dv: int) -> str | None:
  """None if the intra-chunk kernels of `kind` ("delta-rule", "channel-gate") take the sizes."""
  if chunk != CHUNK:
    return f"chunk_size={chunk} (the Triton {kind} intra-chunk kernels need {CHUNK})"
  if dk not in INTRA_HEAD_DIMS or dv not in INTRA_HEAD_DIMS:
    return (f"head dims K={dk}, V={dv} (the Triton {kind} intra-chunk kernels need "
            f"{' or '.join(map(str, INTRA_HEAD_DIMS))})")
  return None


# The custom call the kernels lower to (`ffi_call`): "legacy" is jax-triton 0.3.1's own
# ("triton_kernel_call", which XLA never puts into a command buffer, so every Triton kernel
# splits the op's CUDA graph); "ffi" is jaxlib's typed-FFI twin "triton_kernel_call_ffi", which
# XLA's command buffers can take (where the running jaxlib lacks it, "ffi" falls back to
# "legacy"). Read at trace time. On the H200 of the eleventh stage (docs/BENCHMARKS.md), with
# 2.2 ms ops, no difference; with today's 0.75-0.8 ms GDN / DeltaNet ops on an H100 ("forty-
# first stage") "ffi" is 0.7-1.5 % faster (the T0 kernel no longer splits the op's graph), KDA
# 0.5 %, GDN-2 level: the default since.
CALL_TARGETS = ("legacy", "ffi")
CALL_TARGET = "ffi"


# Where `fused_forward`'s walks get the masked scores s q kᵀ: "walk", each program makes them
# (once per V-tile of a chunk, the one product of the walk that is not of the state), or
# "stored", the T0 kernel makes them once per chunk beside T0 and writes them (bf16, 8 KB a
# chunk), and the walks read them. "walk": on the H200 (docs/BENCHMARKS.md, "twelfth stage")
# stored made the GDN forward 0.81 -> 1.05 ms (its walk spills nothing but takes 116 KB of
# shared memory at two stages: one program an SM), and at one stage 0.86.
FUSED_SCORES_CHOICES = ("walk", "stored")
FUSED_SCORES = "walk"
# A timing run's override of `fused_walk_launch` (BLOCK_V, warps, stages), None in the library.
FUSED_WALK_LAUNCH: tuple[int, int, int] | None = None


# A timing run's override of `t0_launch` (warps, BK, inverse), None in the library.
T0_LAUNCH: tuple[int, int, str] | None = None


def t0_launch(dk: int) -> tuple[int, int, str]:
  """(warps, BK, inverse) of the T0 kernel (`fused_forward._t0_kernel`, the walks' gate-free
  inverse): BK key columns a step of its k kᵀ loop, the inverse as `T0_INVERSES`.

  It holds only k kᵀ and the inverse (none of the intra kernel's NY / U / P tiles, whose
  launch it started from), so its k kᵀ takes the whole key width in one step. Timed on the
  H200 (`experiments/bench_t0.py`, B4 T4096 H16 K128, 7 interleaved rounds of 50 queued calls,
  2026-12-04): 4:16:batched (the intra kernel's launch) 100.0 µs, 4:64:batched 86.2,
  **4:128:batched 81.6**, 2:128:batched 96.9, 4:128:tiles 112.4, 2:64:tiles 163.4; each
  round's range under 6 µs; T0's error the same in all (4.8e-4 rms against the float32
  inverse). The floor (k read, T0 written once) is 21 µs. Later the same day (docs/BENCHMARKS.md
  "nineteenth stage"): 4:128:batched 79.9 µs, 4:128:batched_short (its 16 -> 64 merge three
  dependent products deep instead of four) 78.1 at 4.5e-4, **4:128:batched_bf16** (the same
  with bf16 merges) 58.5 at 6.9e-4. T0 alone errs more with bf16 merges on strongly correlated
  keys (5.0e-3 against 8.9e-4 in the interpreter), but it is stored in bf16 anyway and the op
  does not see it: GDN's forward error against the float32 chunk form in the interpreters,
  K = 128, was 4.47e-3 either way on independent keys and 4.93e-3 against 4.92e-3 on keys 0.9
  of a shared direction; its gradients the same but dG there, 2.41e-2 against 2.24e-2."""
  return 4, min(128, dk), "batched_bf16"


def check_t0_launch(launch, dk: int) -> tuple[int, int, str]:
  """launch as (warps, BK, inverse), checked against head dim dk."""
  try:
    warps, bk, inverse = launch
    warps, bk = int(warps), int(bk)
  except (TypeError, ValueError):
    raise ValueError(f"T0 launch {launch!r} is not (warps, BK, inverse)") from None
  if warps not in (1, 2, 4, 8) or bk not in (16, 32, 64, 128) or dk % bk or (
      inverse not in T0_INVERSES):
    raise ValueError(f"T0 launch {launch!r} needs warps in (1, 2, 4, 8), BK in (16, 32, 64, "
                     f"128) dividing K={dk} and an inverse in {T0_INVERSES}")
  return warps, bk, inverse


def fused_walk_launch(dk: int, dv: int, *, hopper: bool = False) -> tuple[int, int, int]:
  """(BLOCK_V, warps, pipeline stages) of `fused_forward`'s two chunk walks (K <= 128).

  Chosen by ptxas off GPU (`python -m experiments.triton_ptxas --kernels=fused_forward`, GDN,
  unpacked, 2026-12-03), untimed. Each program holds q, k of a chunk whole ([C, K] bf16), the
  [C, C] factors and the float32 state tile [K, BLOCK_V]; BLOCK_V 64 at 4 warps spilled 156 B
  (walk) / 584 B (reverse walk) a thread at K = V = 128 on sm_90a, 8 warps more. BLOCK_V 32:
  on sm_90a at 4 warps 96 / 120 B at K = 128 and 28 / 108 B at K = 64 (the state pass
  forward's own launch spills 80 B at K = 128); on sm_80 at 8 warps 40 / 80 B (K = 128) and
  32 / 0 B (K = 64), where 4 warps spilled 276 / 524 B. BLOCK_V 16 spills least but loads q, k
  and makes q kᵀ once per 16 value columns. So: 32 columns, 4 warps on Hopper, 8 elsewhere,
  2 stages. Timed on the H200 (GDN / DeltaNet forward, B4 T4096 H16 K = V = 128, 2026-12-03,
  `bench_ab` variants `#launch=`): 32:4:2 0.768 / 0.596 ms; 32:4:1 0.857 / 0.655; 32:4:3
  0.919 / 0.592; 64:4:2 0.793 / 0.669; 32:8:2 1.203 / 0.881; 16:4:2 1.049 / 0.737. Kept."""
  if dk > 128:
    raise ValueError(f"fused_walk_launch: K={dk} > 128 is not taken by the fused forward")
  return _block_v(dv, 32), 4 if hopper else 8, 2
