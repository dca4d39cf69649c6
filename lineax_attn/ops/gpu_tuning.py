"""Static tuning of the GPU kernel implementations (`pallas_gpu`, `triton`): `GpuTuning` and its
checks.

Its own module, importing neither jax nor the kernels; `pallas_gpu` re-exports every name
here (`pallas_gpu.GpuTuning` stays the public spelling).
"""

from __future__ import annotations

import dataclasses

INTRA_CHOICES = ("kernel", "xla")
TRITON_INTRA_CHOICES = ("auto", "kernel", "xla")
CHANNEL_INTRA_CHOICES = ("auto", "xla", "triton")
CHANNEL_GRADS_CHOICES = ("auto", "xla", "kernel", "states")
CHANNEL_GATES_CHOICES = ("kernel", "xla")
INTRA_GRADS_CHOICES = ("auto", "xla", "kernel")
PAIR_CHOICES = ("xla", "kernel_fwd", "kernel")
PAIR_DIAG_CHOICES = ("columns", "levels")  # = pallas_kernels.gpu.channel_pair.DIAG_CHOICES
SOLVE_CHOICES = ("inverse", "trsm")
STATE_PASS_CHOICES = ("mosaic", "triton")
STATE_PRODUCTS_CHOICES = ("auto", "xla", "kernel", "channel", "pass")
FORWARD_CHOICES = ("auto", "split", "fused", "walk")
# = pallas_kernels.gpu.triton.blocks.CHANNEL_SOLVES
CHANNEL_SOLVE_CHOICES = ("fused", "paired", "prefetched", "kernel")


@dataclasses.dataclass(frozen=True)
class GpuTuning:
  """Static tuning of the `pallas_gpu` implementation: pass as `tuning=` to the ops.

  Frozen and hashable, read at trace time: under `jax.jit` each distinct value is part of the
  traced program, so a function jitted with one tuning is retraced, never silently reused, when
  called with another (make it a static argument, or close over it).

  Attributes:
    intra: who computes the intra-chunk part of DeltaNet / GDN: "kernel"
      (`pallas_kernels.gpu.intra_chunk`, forward and backward Mosaic GPU kernels, the faster:
      docs/BENCHMARKS.md run 5) or "xla" (the
      XLA path; also what runs under shard_map). Linear attention, KDA and GDN-2 always take the
      XLA path.
    solve: how the XLA path solves the intra-chunk unit-lower-triangular systems: "inverse"
      (blocked inverse by matmuls, `ops.triangular.unit_lower_inverse`, applied with bf16
      operands) or "trsm" (`lax.linalg.triangular_solve` in float32).
    channel_pair: who computes the per-channel pair matrices P and L of KDA / GDN-2 inside the
      XLA intra-chunk path: "xla" (`chunked._channel_pair`, forward and backward), "kernel_fwd"
      (the Pallas-on-Triton forward kernel of `pallas_kernels.gpu.channel_pair`, both matrices
      in one launch, nothing but the C×C results leaving the chip; the XLA backward) or
      "kernel" (its forward and backward kernels). H200 numbers: docs/BENCHMARKS.md run 7.
    pair_diag: how those kernels make the exact 16×16 diagonal block: "columns" (one column
      per step, elementwise float32) or "levels" (binary-anchored tf32 products; the module
      docstring of `pallas_kernels.gpu.channel_pair`).
    remat_intra: whether the backward recomputes the XLA intra-chunk part (`jax.checkpoint`:
      less memory) or keeps its residuals (the C×C products and the inverse per chunk: a faster
      backward).
    triton_intra: who computes the intra-chunk part under implementation="triton" (where
      `intra` is not read): "kernel" takes the Triton kernels, for DeltaNet / GDN those of
      `pallas_kernels.gpu.triton.intra_chunk`, for KDA / GDN-2 those of
      `pallas_kernels.gpu.triton.channel_intra` (both forward and backward); "xla" the XLA part;
      "auto" (the default) the kernels wherever they exist, measured faster than XLA's part on
      the H200 for all four (docs/BENCHMARKS.md "The Triton path, fifth stage": GDN fwd+bwd
      2.6 ms against 4.7, KDA 6.0 against 11.1). Linear attention and simple GLA always take
      the XLA part.
    channel_intra: who computes KDA / GDN-2's intra-chunk part under implementation="pallas_gpu":
      "triton", the Triton kernels of `pallas_kernels.gpu.triton.channel_intra` (forward and
      backward; they run on Hopper too and need the `triton` extra: a ValueError without it);
      "xla" the XLA part (`channel_pair` steers it); "auto" (the default) the Triton kernels
      where the extra is installed and JAX runs on CUDA, else XLA's part. On the H200 KDA
      fwd+bwd takes 5.8 ms with the Triton kernels against 11.0-11.3 with XLA's part
      (docs/BENCHMARKS.md "The Triton path, fifth stage").
    channel_grads: who computes the elementwise rest of those Triton channel kernels' backward
      (the entry / exit factors' terms and dG with its in-chunk reverse cumsum, on both GPU
      paths): "kernel" (fused into the backward kernel's last slice loop,
      `pallas_kernels.gpu.triton.channel_intra.channel_intra_grads`, which then writes whole
      gradients in the inputs' layout; KDA fwd+bwd 7.38 ms against 8.06 on the H200,
      docs/BENCHMARKS.md "The Triton path, fifth stage") or "xla"
      (`gpu_prepare.channel_grads`, several passes over float32 [B, HV, Nc, C, K] arrays and
      the layout transposes after the kernel half) or "states" (as "kernel", and that kernel
      also makes the state pass's cotangent products dNY, dQG, dP, dKG and dgc from the chunk
      states, E, dE and dO on chip, with the state pass under the same custom VJP
      (`gpu_prepare.channel_state_core`): four batched products, a reduction and two float32
      copies of XLA's fewer between the kernels, ~0.4 ms of KDA's 4.1 at B4 T4096 H16 D128 by
      the H200's profile of 2026-12-04; `channel_gates` below says who applies KDA / GDN-2's
      erase and write gates there, `state_products` who makes the products: the channel kernel
      as described with "channel", XLA or the products kernel otherwise. Tested in the
      interpreters against the split composition and the scan, compiled tests passed; timed on
      the H200 (2026-12-04, docs/BENCHMARKS.md "eighteenth stage") it was slower with the
      channel kernel making the products: KDA fwd+bwd 5.14 ms against 4.05, its backward kernel
      3.48 ms against 1.90; with the products kernel and the gates in XLA 3.89 against 3.82
      ("nineteenth stage"). With the products kernel and the gates on chip (the combination not
      timed then) it is the fastest: on an H100 (2026-12-06, "thirty-second stage") KDA 4.04 ms
      against 4.27, GDN-2 4.38 against 4.53) or "auto" (the default: "states" on
      pallas_gpu's Mosaic path, "kernel" on the `triton` implementation, where "states" is
      untimed).
    channel_gates: with channel_grads="states", who makes k̃ = k ⊙ erase and ṽ = v ⊙ write:
      "kernel" (the channel kernels on chip, from k, v and the gates; the backward kernel then
      writes k's and v's whole gradients and the gates' own, so k̃, ṽ, dk̃, dṽ never exist in
      HBM: ~0.3 ms of XLA passes less for KDA at B4 T4096 H16 D128 by the 2026-12-04 profile,
      at 530 / 740 bytes of spills against 156 / 172 in ptxas; timed 2026-12-04: KDA 5.16 ms
      against 5.14 with "xla") or "xla"
      (float32 arrays made and chained in XLA, as on the other paths). Unread otherwise.
      Either way that path reads q, k, v in the caller's dtype and scales q on chip.
    intra_grads: the same choice for the Triton DeltaNet / GDN intra kernels
      (`implementation="triton"`): "xla" (the backward kernel's chunk-major dq, dk, dv, then
      the QG / KG terms, dG and the transposes in XLA, `gpu_vjps._intra_kernel_bwd`), "kernel"
      (all of it in the backward kernel, gradients stored in the inputs' layout; without GVA
      only, H = HV, else XLA's as before) or "auto" (the default: "kernel" for both). Timed
      on the H200 (docs/BENCHMARKS.md "The Triton path, seventh stage"): GDN fwd+bwd 2.55 ms
      fused against 2.53 with XLA's glue, DeltaNet 2.24 against 2.41 since the backward kernel
      skips all dG work when there is no gate (`GATED=False`); before that skip DeltaNet was
      faster with XLA's glue (2.53 against 2.68, "sixth stage").
    state_pass: whose state-pass kernels `implementation="pallas_gpu"` runs: "mosaic" (the
      default, `pallas_kernels.gpu.state_passing`) or "triton" (`pallas_kernels.gpu.triton.
      state_pass`, the same contract; needs the triton extra: a ValueError without it). Alone
      on the H200 the Triton pass took 0.281 / 0.383 ms forward / reverse against Mosaic's
      0.456 / 0.430 (docs/BENCHMARKS.md "sixth stage"), but inside the whole op the two are
      within 2 % ("tenth stage"), so the default stays "mosaic". The Triton path always runs
      its own.
    state_products: who makes the state pass's backward products (dNY = dE Sᵀ, dQG = dO Sᵀ,
      dP = dO Eᵀ, dKG = E dS'ᵀ, dgc = Σ S ⊙ dS') on the paths with a state pass (KDA, GDN-2;
      DeltaNet / GDN off the walks): "xla" (four batched products, a reduction and float32 ->
      bf16 copies of dE and E), "kernel" (`pallas_kernels.gpu.triton.state_pass.
      state_pass_products`: one Triton program a chunk reading each operand once; needs the
      triton extra: a ValueError without it), "pass" (the Mosaic reverse state pass makes them
      from the tiles it holds, `state_passing_bwd(products=...)`, so dh never leaves the chip:
      only where one CTA holds all of V, K = V = 64, on the Mosaic pass; a ValueError
      elsewhere; on the H100 at B4 T4096 H32 D64 KDA 3.604 → 3.528 ms, GDN-2 3.878 → 3.792,
      docs/BENCHMARKS.md "thirty-fourth stage"), "auto" (the default: "pass" where it can run,
      else "kernel" where the triton extra runs, else "xla"), or, with channel_grads="states"
      only, "channel" (the channel backward kernel makes them itself, in a prologue running
      the products kernel's code: `channel_intra_grads_from_states`; on the H100 KDA 3.80 ms
      against "kernel"'s 3.69, same stage). Under "states" the others feed the channel
      kernel the products, its gates and q's scale still on chip. On the H200 (2026-12-04,
      B4 T4096 H16 D128, `bench_ab` queued, 5 rounds; "nineteenth stage") "kernel" took KDA
      fwd+bwd from 3.952 ms to 3.817 and GDN-2 from 4.131 to 3.998.
    forward: how DeltaNet / GDN (on the intra-kernel path) compute the chunk form: "split"
      (the intra-chunk kernel writes NY, QG, P, U, KG for the state pass, whose residuals the
      backward reads), "walk" (below), "auto" (the default: "walk" on `pallas_gpu` where the
      triton extra runs, for its T0 kernel, else "split") or "fused" (the Triton walks:
      `pallas_kernels.gpu.triton.fused_forward`: a gate-free inverse T0 per chunk, then one
      chunk walk that applies T0 ⊙ Γ on the fly and stores only O, E and, for the backward,
      the chunk states; the backward walks the state cotangent back with the same on-the-fly
      factors, then runs the split's intra-chunk backward with M = T0 ⊙ Γ; a ValueError
      without the triton extra; K > 128 keeps "split"; on the H200 right but slower than
      "split", docs/BENCHMARKS.md "twelfth stage"). "walk": the warp-specialised Mosaic GPU
      walks (`pallas_kernels.gpu.chunk_walk`, `chunk_walk_reverse`: a memory, a factor / output
      and a state warpgroup per CTA, the state transposed in registers), T0 from the Triton T0
      kernel or, without the extra, XLA's inverse; differentiated, the forward walk saves the
      chunk states, the reverse walk makes dE and the state cotangents, then one kernel per
      chunk makes dq, dk, dv, dβ, dG (`pallas_kernels.gpu.chunk_grads`; V = 256: XLA's
      products and the split's intra-chunk backward). Linear attention takes the same walks
      without T0 and erase. On the H200 (2026-12-04, B4 T4096 H16 D128; docs/BENCHMARKS.md
      "fifteenth stage") fwd+bwd GDN 1.16 ms, DeltaNet 1.24, linear attention 0.67 against the
      split's 2.36 / 2.15 / 1.95 (jla: GDN 0.88, DeltaNet 0.94). Mosaic kernels only
      (`implementation="pallas_gpu"`), rows not packed, K in {64, 128}; other calls keep
      "split".
    channel_span: the per-channel Triton kernels' bounded-span path (KDA, GDN-2;
      `pallas_kernels.gpu.triton.blocks.CHANNEL_SPAN`): a bound in (0, 80] nats (80, the
      default) lets every channel slice of a chunk whose 16-row sub-chunks decay by at most
      that much take the 16 × 16 diagonal blocks of the pair matrices on the tensor cores
      (bf16 operands, factors e^x with |x| ≤ the bound); steeper slices, and every slice with
      0, compute them exactly in float32. On the H200 (2026-12-04) 80 took KDA fwd+bwd from
      5.65 to 4.62 ms and GDN-2 from 5.82 to 4.84 (docs/KERNELS_GPU.md, "Toward KDA / GDN-2").
    channel_solve: where the per-channel Triton forward (KDA, GDN-2) makes NY = −M (K̃ ⊙ e^G)
      and U = M Ṽ (`pallas_kernels.gpu.triton.blocks.CHANNEL_SOLVE`), the same products every
      way: "fused", in the forward kernel's two solve loops after the inverse; "paired", those
      loops as one, each step making NY's and U's blocks of the same columns (their loads in
      flight together, half the steps); "prefetched" (the default), "paired" with the next
      step's tiles loaded before this step's products; "kernel", in a second kernel from the
      stored M, one program per chunk and 64-column block. On an H100 (2026-12-07, B4 T4096 H16
      D128 fwd+bwd, 5 rounds) "prefetched" was faster than "fused" in every round (KDA 3.507 ->
      3.484 ms, GDN-2 3.906 -> 3.901), "paired" in between; "kernel" slower (2026-12-06: KDA
      3.72 -> 3.78, GDN-2 4.07 -> 4.20), kept opt-in for other cards.
    approx_math: whether the walk path's kernels compute e^x as ex2.approx (relative error
      ~2⁻²², far below their bf16 operands') instead of the exact float32 exp: the per-chunk
      backward (`pallas_kernels.gpu.chunk_grads`) and, since 2026-12-05, the walks (forward,
      reverse, and the maps' walk of rows in pieces). On by default: on
      the H200 (2026-12-04, B4 T4096 H16 D128, `bench_ab`, 5 rounds) GDN fwd+bwd took 1.164 ms
      with it in `chunk_grads` against 1.202 without (jla 0.878); standalone the gated
      kernel's mean CTA span fell from 26.5 to 24.7 µs (`experiments.bench_chunk_grads`). In
      the walks (2026-12-05, `bench_walks`, B4 T16384 H16 D128) it took the gated forward step
      from 2.18 to 1.94 µs on the H200 (its state warpgroup's instructions set the step) and
      from 2.30 to 2.21 on the H100; the reverse step 2.49 → 2.44 and 3.00 → 3.07 (noise).
      Ungated mixers compute no e^x there.
    join_exit: whether that gated kernel makes its exit product (x ⊙ E) dS'ᵀ once, as a second
      accumulator issued with dk's wgmma group (`chunk_grads(join_exit=True)`), instead of in
      a group of its own and again inside dk's. On by default: on the H200 (2026-12-04, B4
      T4096 H16 D128, device time) the gated kernel took 500 µs a call against 519 (its last
      phase 7.2 µs a CTA against 8.3) and GDN fwd+bwd 0.919 ms against 0.933
      (docs/BENCHMARKS.md "seventeenth stage"); its compiled tests pass. The two-warpgroup
      kernel (grads_warpgroups=2, the default) always makes it so: join_exit=False takes
      effect only where one warpgroup runs (grads_warpgroups=1, or K != V).
    grads_warpgroups: 1 or 2 warpgroups for that per-chunk backward (`chunk_grads(warpgroups=)`).
      With 2 (the default; DeltaNet / GDN at K = V, other calls keep 1) one warpgroup makes
      dA, dq and its share of dk while the other makes M, dv, dR, Y, U, dL and dB, and dk is
      joined at the end (jla's kernel overlaps its products the same way, on three). On the
      H200 (2026-12-04, B4 T4096 H16 D128; docs/BENCHMARKS.md "nineteenth stage") the gated
      kernel took 370 µs a call against 493 and the ungated 332 against 486; GDN fwd+bwd
      0.778 ms against 0.902, DeltaNet 0.706 against 0.854 (`bench_ab` queued, 5 rounds).
    row_pieces: cut every row into this many pieces that walk at once, on the walks (linear
      attention, DeltaNet, GDN) and on the Mosaic state pass (KDA, GDN-2; not on the Triton
      pass or under `shard_map`); 1: rows whole;
      0 ("auto", the default): `gpu_pieces.auto_row_pieces` picks 1, 2, 4 or 8 (each piece ≥
      8 chunks) by a model of latency-bound passes in waves of one CTA per SM, with step
      costs and a fixed cost measured on the H200 (`gpu_pieces`). For small B·HV and long T,
      where the passes' B·HV·V/64 CTAs leave most SMs idle (B1 T65536 H16 V128: 32 of the
      H200's 132). Exact: a pass from [I | 0] gives each piece's affine map S_out = Φ S_in +
      Ψ, the entry states are composed from the maps, then every piece walks from its own;
      the backward likewise (`gpu_pieces`). It costs one more forward pass (K columns wider,
      states only) and one more reverse pass; linear attention none (Φ = I, and Ψ and the
      entry cotangents are plain products). The walks pad T to a multiple of 64·row_pieces
      with identity steps; the state pass pads its chunks with identity chunks and keeps the
      pieces in place (`gpu_vjps.state_pass`). On the H200 at B1 T65536 H16 D128
      (2026-12-05, docs/BENCHMARKS.md "twenty-first stage", fwd+bwd) the rule's 4 pieces
      took GDN from 5.84 to 3.84 ms (1.75x jla's time to 1.15x), DeltaNet 4.97 → 3.37, KDA
      17.23 → 15.86, GDN-2 17.93 → 16.56; at B2 T32768 it keeps whole rows (2 pieces were
      1 % slower there), and at B4 and in the 350M models rows stay whole.
    maps_chains: chains of 64 state columns per CTA in the walks' maps' pass when rows are cut
      (`pallas_kernels.gpu.maps_walk`): 1, 2 (two state warpgroups share one CTA's ring and
      factors, so two latency-bound chains are in flight per SM), or 0 ("auto", the default,
      `gpu_pieces.maps_chains`: 2 where that saves waves, e.g. B1 T65536 H16 K = V = 128 in
      4 pieces, 256 chains on 132 SMs: 542 µs a call on two chains a CTA against 657 on one).
    walk_overlap: whether the reverse walks (`chunk_walk_reverse`: the backward's and, with rows
      in pieces, the states-only pass) issue each of the chain's first two products with an
      independent one (k dS with Pᵀ dO, then Mᵀ dE with qᵀ dO) and wait for each pair once:
      three waits a chunk instead of five, with dSᵀ and dEᵀ stored and copied out while a
      product runs. Same products, operands and sums: the same results to the bit. On the
      H200 (2026-12-05, docs/BENCHMARKS.md "twenty-fourth stage", B4 T16384 H16 D128) the
      reverse step went from 2.54 to 2.41 µs gated and 2.45 to 2.26 ungated, and ptxas's
      spills from 148 bytes to 8; but the op, fwd+bwd at B4 T4096, gained ≤ 3 % on the H200
      and nothing on the H100 ("twenty-fifth stage"), where Nsight Compute found the walks
      bound by bandwidth and their own instructions, not by these waits. Off by default: that
      gain does not justify a default the whole compiled suite has not run with. (The
      forward walk's own overlap, `chunk_walk`'s `overlap` parts, gained nothing there and is
      no tuning: docs/KERNELS_GPU.md.)
  """

  intra: str = "kernel"
  solve: str = "inverse"
  channel_pair: str = "xla"
  pair_diag: str = "columns"
  remat_intra: bool = True
  triton_intra: str = "auto"
  channel_intra: str = "auto"
  channel_grads: str = "auto"
  channel_gates: str = "kernel"
  intra_grads: str = "auto"
  state_pass: str = "mosaic"
  state_products: str = "auto"
  forward: str = "auto"
  channel_span: float = 80.0   # = blocks.CHANNEL_SPAN (literal: no kernel import at start-up)
  channel_solve: str = "prefetched"   # = blocks.CHANNEL_SOLVE
  approx_math: bool = True
  join_exit: bool = True
  grads_warpgroups: int = 2
  row_pieces: int = 0
  maps_chains: int = 0
  walk_overlap: bool = False

  def __post_init__(self):
    for name, allowed in (("intra", INTRA_CHOICES), ("solve", SOLVE_CHOICES),
                          ("channel_pair", PAIR_CHOICES), ("pair_diag", PAIR_DIAG_CHOICES),
                          ("triton_intra", TRITON_INTRA_CHOICES),
                          ("channel_intra", CHANNEL_INTRA_CHOICES),
                          ("channel_grads", CHANNEL_GRADS_CHOICES),
                          ("channel_gates", CHANNEL_GATES_CHOICES),
                          ("intra_grads", INTRA_GRADS_CHOICES),
                          ("state_pass", STATE_PASS_CHOICES),
                          ("state_products", STATE_PRODUCTS_CHOICES),
                          ("forward", FORWARD_CHOICES),
                          ("channel_solve", CHANNEL_SOLVE_CHOICES)):
      value = getattr(self, name)
      if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"GpuTuning.{name} must be one of {allowed}, got {value!r}.")
    for name in ("remat_intra", "approx_math", "join_exit", "walk_overlap"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"GpuTuning.{name} must be a bool, got {getattr(self, name)!r}.")
    if self.state_products == "channel" and self.channel_grads != "states":
      raise ValueError("GpuTuning.state_products='channel' (the channel kernel makes the "
                       "products) needs channel_grads='states', got channel_grads="
                       f"{self.channel_grads!r}.")
    pieces = self.row_pieces
    if isinstance(pieces, bool) or not isinstance(pieces, int) or not 0 <= pieces <= 64:
      raise ValueError(f"GpuTuning.row_pieces must be an int in [0, 64] (1: rows whole, 0: "
                       f"auto), got {pieces!r}.")
    chains = self.maps_chains
    if isinstance(chains, bool) or not isinstance(chains, int) or chains not in (0, 1, 2):
      raise ValueError(f"GpuTuning.maps_chains must be 0 (auto), 1 or 2, got {chains!r}.")
    wgs = self.grads_warpgroups
    if isinstance(wgs, bool) or not isinstance(wgs, int) or wgs not in (1, 2):
      raise ValueError(f"GpuTuning.grads_warpgroups must be 1 or 2, got {wgs!r}.")
    span = self.channel_span
    if isinstance(span, bool) or not isinstance(span, (int, float)) or not 0 <= span <= 80:
      raise ValueError(f"GpuTuning.channel_span must be a number of nats in [0, 80] (0: off), "
                       f"got {span!r}.")

  @classmethod
  def parse(cls, text: str) -> "GpuTuning":
    """A GpuTuning from "field=value,..." (the command line's spelling, e.g.
    "remat_intra=false,channel_pair=kernel"); unnamed fields keep their defaults."""
    if not isinstance(text, str):
      raise ValueError(f"GpuTuning.parse takes a string, got {text!r}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
      name, sep, value = (x.strip() for x in item.partition("="))
      if not sep or name not in fields:
        raise ValueError(f"GpuTuning: {item!r} is not field=value with a field of "
                         f"{sorted(fields)} (in {text!r}).")
      if fields[name].type in (bool, "bool"):
        if value.lower() not in ("true", "false"):
          raise ValueError(f"GpuTuning.{name} must be true or false, got {value!r}.")
        values[name] = value.lower() == "true"
      elif fields[name].type in (int, "int"):
        if not value.isdigit():
          raise ValueError(f"GpuTuning.{name} must be an integer, got {value!r}.")
        values[name] = int(value)
      elif fields[name].type in (float, "float"):
        try:
          values[name] = float(value)
        except ValueError:
          raise ValueError(f"GpuTuning.{name} must be a number, got {value!r}.") from None
      else:
        values[name] = value
    return cls(**values)


DEFAULT_TUNING = GpuTuning()


def fused_intra_grads(tuning: GpuTuning, gated: bool) -> bool:
  """Whether the Triton DeltaNet / GDN backward kernel finishes the gradients itself
  (`GpuTuning.intra_grads`; "auto" fuses for both mixers, gated or not: the ungated kernel
  skips the gate's work). `gated` is kept so that a future default can differ by mixer."""
  del gated
  return tuning.intra_grads in ("auto", "kernel")


def channel_grads_choice(tuning: GpuTuning, kernels: str) -> str:
  """`tuning.channel_grads` with "auto" resolved for the kernels' path: "states" on the Mosaic
  path (`pallas_gpu`, timed fastest there), "kernel" on the Triton one (`triton`)."""
  if tuning.channel_grads != "auto":
    return tuning.channel_grads
  return "states" if kernels == "mosaic" else "kernel"


def check_tuning(tuning) -> GpuTuning:
  """`tuning` as a GpuTuning: None gives `DEFAULT_TUNING`; anything else is a ValueError."""
  if tuning is None:
    return DEFAULT_TUNING
  if not isinstance(tuning, GpuTuning):
    raise ValueError(f"`tuning` for implementation='pallas_gpu' must be a "
                     f"pallas_gpu.GpuTuning or None, got {tuning!r}.")
  return tuning
