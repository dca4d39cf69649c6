"""The `pallas_gpu` implementation: Mosaic GPU kernels (Hopper) for the chunk form, with XLA glue.

Split of the chunk form (docs/MATH.md §3.2); docs/KERNELS_GPU.md has the call path and the kernels'
resources:

* **Intra-chunk, DeltaNet and GDN (Mosaic GPU, the default `GpuTuning(intra="kernel")`):**
  `pallas_kernels.gpu.intra_chunk`, forward and backward kernels, one CTA per chunk; the
  forward's bf16 inverse is the backward's residual; QG/KG cotangents, Gx's chain rule and GVA's
  head sum stay in XLA (`gpu_vjps._intra_kernel_bwd`).
* **Intra-chunk otherwise (XLA, differentiated by autodiff):** `chunked._intra_chunk` with
  `matmul="bf16"`: the masked intra-chunk attention P, the WY/UT solve Y = Z(K̃⊙Γ), U = ZṼ,
  the gated queries/keys QG, KG and the chunk decay gc, every matmul with bf16 operands and
  float32 accumulation (per-channel gates: the overflow-free sub-chunk form, its exact diagonal
  blocks elementwise in float32); the unit-lower-triangular systems are inverted in float32
  (`ops.triangular`: blocked inverse by matmuls, closed-form VJP) and the inverse is applied
  with bf16 operands. Linear attention, KDA and GDN-2 always take this path; DeltaNet and GDN
  with `GpuTuning(intra="xla")` and under `shard_map` (the kernel outputs carry no varying-axes
  types).
* **Sequential state pass (Mosaic GPU kernels, `pallas_kernels.gpu.state_passing`):**
  E = U − Y·S, O = QG·S + P·E, S' = gc⊙S + KGᵀ·E with the float32 state on chip; its backward is
  a reverse kernel for the state cotangent (docs/MATH.md §3.6 steps 1-2) plus batched matmuls,
  wired as a `jax.custom_vjp`.

* **Walks (linear attention, DeltaNet, GDN; `GpuTuning(forward="walk")`; "auto", the default,
  where the triton extra runs):** the warp-specialised Mosaic GPU walks of
  `pallas_kernels.gpu.chunk_walk` and `chunk_walk_reverse` instead of the intra-chunk forward
  and the state pass: a gate-free inverse T0 per chunk (none for linear attention), then one
  walk that makes every per-chunk factor on chip with the state transposed in registers;
  differentiated, the reverse walk and one kernel per chunk for dq, dk, dv, dβ, dG
  (`pallas_kernels.gpu.chunk_grads`; V = 256 keeps XLA's products and the split's backward),
  wired in `gpu_walks.walk_core`. On the H200 (2026-12-04) fwd+bwd GDN 1.16 ms, DeltaNet 1.24,
  linear attention 0.67 against the split's 2.36 / 2.15 / 1.95 (docs/BENCHMARKS.md "fifteenth
  stage"). Packed rows keep the split.
* **KDA / GDN-2 under one VJP (`GpuTuning(channel_grads="states")`, the default here since
  2026-12-06):** the Triton channel kernels and the state pass in
  `gpu_prepare.channel_state_core`, reading q, k, v in the caller's dtype; the state pass's
  products made by the products kernel (the default), XLA, or the channel backward kernel
  itself (`state_products="channel"`: timed slower, docs/BENCHMARKS.md "eighteenth stage"),
  and with `channel_gates="kernel"` (the default) the erase / write gates applied on chip, so
  k̃, ṽ and their float32 gradients never reach HBM. Rows in pieces as on the split.
* **Fused (DeltaNet / GDN, `GpuTuning(forward="fused")`, opt-in; on the H200 slower than the
  split in fwd+bwd, docs/BENCHMARKS.md "twelfth stage"):** the Triton
  kernels of `pallas_kernels.gpu.triton.fused_forward` instead of the intra-chunk kernel and
  the state pass: a gate-free inverse T0 per chunk, a forward and a reverse chunk walk that make
  M = T0 ⊙ Γ and the other per-chunk factors on the fly; then one Triton kernel per chunk for
  dq, dk, dv, dβ, dG that also makes the state pass's products (`_fused_core`).

Handled: all five linear mixers, initial_state / final_state, GVA, segment_ids, T not a multiple
of the chunk, return_residual. Needs chunk_size 64, K = 64 or 128, V a multiple of 64, and
B·T·HV < 2^31 rows (TMA coordinates are 32-bit per dimension; docs/KERNELS_GPU.md, "Indexing
past 2^31 elements"). Anything else (other sizes, `cu_seqlens` varlen, a GPU that is not Hopper)
falls back to the `chunk` implementation with one log line per reason; never silently wrong.

Tuning (which intra-chunk path, which solve, remat of the XLA part) is a frozen `GpuTuning`
passed to the ops as `tuning=` (None = `DEFAULT_TUNING`); it is a static value read at trace
time, so every distinct tuning is its own trace under `jax.jit`.

Off GPU the kernels run in JAX's Mosaic GPU interpreter (slow; for tests).

Modules, one job each (this one is the entry `api` registers and re-exports the public names of
the others, so `pallas_gpu.GpuTuning`, `pallas_gpu.prepare_chunks` etc. stay valid):

* `pallas_gpu` (here): `supports` / `unsupported_reason` / `is_hopper` for the dispatch, and
  `pallas_gpu_delta_family`, which composes the parts below.
* `gpu_tuning`: `GpuTuning`, `DEFAULT_TUNING`, `check_tuning` (no jax, no kernels).
* `gpu_chunks`: chunk-major relayout and segment masks (plain jnp).
* `gpu_vjps`: the custom VJPs around the kernels (state pass, intra-chunk, channel pairs) and
  the varying-axes typing of their outputs under `shard_map`.
* `gpu_prepare`: `prepare_chunks`, the XLA intra-chunk preparation feeding the state pass.
* `gpu_walks`: the walks as differentiable cores (`walk_core`; `walk_pieces_core`, rows cut
  into pieces by `GpuTuning(row_pieces=P)`).
* `gpu_pieces`: how many pieces a row is cut into, and the composition of their entry states
  and exit cotangents (walks and state pass alike).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lineax_attn.ops import api
from lineax_attn.ops import chunked
from lineax_attn.ops import gpu_pieces
from lineax_attn.ops import gpu_walks
from lineax_attn.ops import specs
from lineax_attn.ops.gpu_chunks import from_chunks, kernel_segments, segment_masks, to_chunks
# Re-exported: `pallas_gpu.X` stays the public spelling of these (api, benchmarks, tests, docs).
from lineax_attn.ops.gpu_prepare import (channel_intra_kernel, channel_kernel_applies,
                                         channel_state_core, prepare_chunks)
from lineax_attn.ops.gpu_tuning import (DEFAULT_TUNING, INTRA_CHOICES, PAIR_CHOICES,
                                        SOLVE_CHOICES, GpuTuning, channel_grads_choice,
                                        check_tuning, fused_intra_grads)
from lineax_attn.ops.gpu_vjps import (interpret_params, intra_kernel, kernel_module, state_pass,
                                      state_pass_out_dtype, vma)
from pallas_kernels.gpu import state_passing as sp

__all__ = ["DEFAULT_TUNING", "INTRA_CHOICES", "PAIR_CHOICES", "SOLVE_CHOICES", "GpuTuning",
           "check_tuning", "is_hopper", "pallas_gpu_delta_family", "prepare_chunks", "supports",
           "unsupported_reason"]

# The fallback reasons `api` has logged for pallas_gpu (clear it to log them again).
_warned: set[str] = api.fallback_logged("pallas_gpu")
_F32 = jnp.float32


def is_hopper(device=None) -> bool:
  """True on an NVIDIA compute-capability-9.x GPU (H100, H200, H800, GH200)."""
  device = device or jax.devices()[0]
  if device.platform != "gpu":
    return False
  cc = getattr(device, "compute_capability", None)
  if cc is not None:
    return str(cc).startswith("9.")
  kind = device.device_kind.upper()
  return any(name in kind for name in ("H100", "H200", "H800", "GH200"))


def unsupported_reason(*, dk: int, dv: int, chunk_size: int, varlen: bool, b: int = 1,
                       t: int = 1, hv: int = 1) -> str | None:
  """Why `pallas_gpu` cannot run this call (None if it can); t is the sequence length."""
  if varlen:
    return "cu_seqlens (varlen) is not handled by the pallas_gpu kernels yet"
  reason = sp.supported(chunk_size, dk, dv)
  if reason:
    return reason
  reason = sp.index_range_reason(b, -(-t // chunk_size) * chunk_size, hv, dv)
  if reason:
    return reason
  if jax.default_backend() == "gpu" and not is_hopper():
    return f"GPU {jax.devices()[0].device_kind} is not Hopper (wgmma/TMA need sm_90)"
  return None


def supports(call) -> str | None:
  """`api.Call` -> None, or why `pallas_gpu` cannot run it (dispatch then runs "chunk")."""
  d = call.dims
  return unsupported_reason(dk=d.dk, dv=d.dv, chunk_size=call.chunk_size, varlen=call.varlen,
                            b=d.b, t=d.t, hv=d.hv)


# ----------------------------------------------------------------------------- composition


def state_kernels(tuning: GpuTuning, kernels: str) -> str:
  """Whose state-pass kernels run: the path's own, or on the Mosaic path the Triton ones
  where `tuning.state_pass="triton"` asks (ValueError where the triton extra cannot run)."""
  if kernels != "mosaic" or tuning.state_pass == "mosaic":
    return kernels
  from lineax_attn.ops import triton_gpu  # pylint: disable=g-import-not-at-top
  triton_gpu.require("state_pass='triton'", "state_pass='mosaic'")
  return "triton"


def state_products(tuning: GpuTuning, state: str = "mosaic", dk: int = 0, dv: int = 0) -> str:
  """Who makes the state pass's backward products (`GpuTuning.state_products`): "kernel" only
  where the triton extra runs (asked for by name without it: a ValueError, not a silent
  fallback); "pass" only on the Mosaic pass (`state`) at head dims (dk, dv) where one CTA
  holds all of V (else a ValueError); "auto" takes "pass" where it can run (timed faster at
  K = V = 64: docs/BENCHMARKS.md "thirty-fourth stage"), else the kernel where the triton extra
  runs, else XLA's products."""
  from lineax_attn.ops import triton_gpu  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gpu import state_passing  # pylint: disable=g-import-not-at-top
  reason = ("the Mosaic state pass makes them (state_pass='mosaic' on pallas_gpu), not "
            f"{state!r}" if state != "mosaic" else state_passing.products_reason(dk, dv))
  if tuning.state_products == "pass":
    if reason:
      raise ValueError(f"GpuTuning.state_products='pass': {reason}.")
    return "pass"
  if tuning.state_products == "auto":
    if reason is None:
      return "pass"
    return "kernel" if triton_gpu.available() else "xla"
  if tuning.state_products in ("xla", "channel"):   # (the channel kernels ask for triton)
    return tuning.state_products
  triton_gpu.require("state_products='kernel'", "state_products='xla'")
  return "kernel"


def _pass_pieces(tuning: GpuTuning, state: str, ny, u, s0) -> int:
  """The pieces the state pass cuts rows into (`GpuTuning.row_pieces`): on the Mosaic pass
  outside shard_map; 1 (rows whole) elsewhere. ny, u, s0: the pass's chunk-major −Y
  `[B, HV, Nc, C, K]`, pseudo-values `[B, HV, Nc, C, V]` and initial state."""
  if state != "mosaic" or vma(ny, u, s0):
    return 1
  b, hv, nc, c, dv = u.shape
  return gpu_pieces.row_pieces(tuning, b, hv, ny.shape[-1], dv, nc * c, c)


def _core(q, k, k_erase, v_write, g, s0, segidx, *, c, interpret, tuning, kernels,
          out_dtype=jnp.float32):
  """Chunk form on [B, T, HV, ...] inputs (T a multiple of c): (o, e, s_final), o and e in
  out_dtype (`gpu_vjps.state_pass_out_dtype`)."""
  if channel_kernel_applies(q, k_erase, v_write, g, c=c, tuning=tuning, kernels=kernels):
    # (The backward's rest fused in its kernel unless "xla" is asked for by name.)
    fused = channel_grads_choice(tuning, kernels) != "xla"
    ny, qg, p, u, kg, gc = channel_intra_kernel(q, k, k_erase, v_write, g, segidx, c, fused,
                                                float(tuning.channel_span),
                                                tuning.channel_solve)
  else:
    ny, qg, p, u, kg, gc = prepare_chunks(q, k, k_erase, v_write, g, segidx, c=c,
                                          tuning=tuning)
  state = state_kernels(tuning, kernels)
  o, e, s_final = state_pass(ny, qg, p, u, kg, gc, s0, interpret, state,
                             state_products(tuning, state, ny.shape[-1], u.shape[-1]),
                             _pass_pieces(tuning, state, ny, u, s0), out_dtype)
  return from_chunks(o), from_chunks(e), s_final


def _core_intra_kernel(q, k, v, beta, g, s0, segidx, *, scale, c, interpret, kernels,
                       fused_grads=False, state="mosaic", tuning=DEFAULT_TUNING,
                       out_dtype=jnp.float32):
  """`_core` for DeltaNet / GDN with the intra-chunk kernel; q, k unrepeated and unscaled.
  state: whose state-pass kernels run ("mosaic" or "triton": `state_kernels`)."""
  b, t, hv = v.shape[:3]
  dk = q.shape[-1]
  if g is None:
    G = jnp.zeros((b, hv, t // c, c), _F32)
  else:
    G, _ = chunked.chunk_cumulative_gates(g.astype(_F32), functools.partial(to_chunks, c=c))
  # DeltaNet: G (zeros) only for gc below; the kernels know it is ungated and make no dG.
  ny, qg, p, u, kg = intra_kernel(q, k, v, beta, None if g is None else G, segidx, float(scale),
                                  c, interpret, kernels, fused_grads, gated=g is not None)
  gc = jnp.exp(G[..., -1:])
  if segidx is not None:   # a segment starting inside the chunk resets the entry state
    gc = gc * segment_masks(segidx, c)[1][..., -1:]
  gc = jnp.broadcast_to(gc, G.shape[:3] + (dk,))
  o, e, s_final = state_pass(ny, qg, p, u, kg, gc, s0, interpret, state,
                             pieces=_pass_pieces(tuning, state, ny, u, s0), out_dtype=out_dtype)
  return from_chunks(o), from_chunks(e), s_final


def fused_forward_applies(tuning: GpuTuning, dk: int, dv: int, chunk_size: int) -> bool:
  """Whether a DeltaNet / GDN call on the intra-kernel path runs the fused kernels of
  `pallas_kernels.gpu.triton.fused_forward` (`GpuTuning.forward="fused"`; sizes they do not
  take keep the split). ValueError where the triton extra cannot run."""
  if tuning.forward != "fused":
    return False
  from lineax_attn.ops import triton_gpu  # pylint: disable=g-import-not-at-top
  triton_gpu.require("forward='fused'", "forward='split'")
  from pallas_kernels.gpu.triton import fused_forward as ff  # pylint: disable=g-import-not-at-top
  return ff.supported(chunk_size, dk, dv) is None


# forward="fused": the chunk form in the fused kernels of `pallas_kernels.gpu.triton.
# fused_forward`, forward (T0, then the walk) and reverse (the state cotangent walked back with the
# same factors made on the fly), then the intra-chunk backward fed with M = T0 ⊙ Γ: with H = HV
# the Triton kernel that also makes the state pass's products (`intra_chunk_bwd_from_states`),
# with GVA XLA's products and the split's backward. G: the chunk cumulative gates (None ungated).
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _fused_core(q, k, v, beta, G, s0, segidx, scale, c, interpret, kernels):
  del interpret, kernels
  return _fused_forward(q, k, v, beta, G, s0, segidx, scale, c, save_states=False)


def _fused_forward(q, k, v, beta, G, s0, segidx, scale, c, *, save_states):
  from pallas_kernels.gpu.triton import fused_forward as ff  # pylint: disable=g-import-not-at-top
  b, t, hv = v.shape[:3]
  return ff.fused_forward(q, k, v, jnp.moveaxis(beta.astype(_F32), 1, 2),
                          None if G is None else G.reshape(b, hv, t), s0,
                          None if segidx is None else kernel_segments(segidx, c),
                          scale=float(scale), gated=G is not None, save_states=save_states)


def _fused_core_fwd(q, k, v, beta, G, s0, segidx, scale, c, interpret, kernels):
  del interpret, kernels
  o, e, s_final, factors, h = _fused_forward(q, k, v, beta, G, s0, segidx, scale, c,
                                             save_states=True)
  return (o, e, s_final), (q, k, v, beta, G, segidx, factors, h, e)


def _fused_core_bwd(scale, c, interpret, kernels, res, cts):
  from pallas_kernels.gpu.triton import fused_forward as ff  # pylint: disable=g-import-not-at-top
  q, k, v, beta, G, segidx, factors, h, e = res
  do, de_ext, ds_final = cts
  b, t, hv = v.shape[:3]
  segments = None if segidx is None else kernel_segments(segidx, c)
  beta_rows = jnp.moveaxis(beta.astype(_F32), 1, 2)                 # [B, HV, T]
  de, dh, ds0 = ff.fused_reverse(q, k, beta_rows, None if G is None else G.reshape(b, hv, t),
                                 segments, factors, do, de_ext, ds_final, scale=float(scale),
                                 gated=G is not None)
  return gpu_walks.grads_after_reverse(
      q, k, v, beta, G, segidx, factors[0], h, e, de, dh, do, scale=scale, c=c,
      interpret=interpret, kernels=kernels, from_states=True) + (ds0, None)


_fused_core.defvjp(_fused_core_fwd, _fused_core_bwd)


def walk_applies(tuning: GpuTuning, dk: int, dv: int, chunk_size: int, kernels: str,
                 packed: bool) -> bool:
  """Whether a DeltaNet / GDN call runs the warp-specialised Mosaic GPU walk of
  `pallas_kernels.gpu.chunk_walk`: `GpuTuning.forward="walk"`, or "auto" where the triton extra
  runs (the walk was timed with its T0 kernel; with XLA's inverse it is untimed), on the
  Mosaic kernels' path, sizes the walk takes, rows not packed. Other calls keep the split."""
  from lineax_attn.ops import triton_gpu  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gpu import chunk_walk  # pylint: disable=g-import-not-at-top
  wanted = tuning.forward == "walk" or (tuning.forward == "auto" and triton_gpu.available())
  return (wanted and kernels == "mosaic" and not packed
          and chunk_walk.supported(chunk_size, dk, dv) is None)


def _linear_walk_applies(tuning: GpuTuning, dk: int, dv: int, chunk_size: int, kernels: str,
                         packed: bool) -> bool:
  """Linear attention walks wherever DeltaNet / GDN would (`walk_applies`: "walk", or "auto"
  where the triton extra runs) and `chunk_grads` takes the sizes (its backward has no
  fallback). Compiled and timed on the H200 (2026-12-04): 0.67 ms fwd+bwd at B4 T4096 H16 D128
  against the split's 1.95 and GDN's 1.27."""
  from pallas_kernels.gpu import chunk_grads  # pylint: disable=g-import-not-at-top
  return (walk_applies(tuning, dk, dv, chunk_size, kernels, packed)
          and chunk_grads.supported(chunk_size, dk, dv) is None)



def _walk(q, k, v, beta, g, s0, *, scale, c, interpret, tuning: GpuTuning):
  """(o, e, s_final) of the walks (`gpu_walks`) on `[B, T, ...]` inputs: linear attention when
  beta is None; g the log gates or None. Pads T to a multiple of the chunk, or of the chunk
  times the pieces when rows are cut (`gpu_pieces.row_pieces`; padding rows are identity
  steps), and slices the outputs back to T."""
  (b, t), (hv, dv) = q.shape[:2], v.shape[2:]
  pieces = gpu_pieces.row_pieces(tuning, b, hv, q.shape[-1], dv, t, c, maps=beta is not None,
                                 max_chains=gpu_pieces.WALK_MAPS_CHAINS)
  t_pad = -(-t // (c * pieces)) * c * pieces
  pad = functools.partial(chunked.pad_time, t_pad=t_pad)
  G = None
  if g is not None:
    G, _ = chunked.chunk_cumulative_gates(pad(g).astype(_F32), functools.partial(to_chunks, c=c))
  args = (pad(q), pad(k), pad(v), pad(beta), G, s0, scale, c, interpret,
          gpu_walks.walk_options(tuning))
  if pieces == 1:
    o, e, s_final = gpu_walks.walk_core(*args)
  else:
    chains = gpu_pieces.walk_maps_chains(tuning, pieces, b, hv, q.shape[-1], dv)
    o, e, s_final = gpu_walks.walk_pieces_core(*args, pieces, chains)
  return o[:, :t], e[:, :t], s_final


def _intra_kernel_applies(mixer, dk, dv, chunk_size, tuning, kernels) -> bool:
  return (tuning.intra == "kernel" and specs.resolve(mixer).gpu_intra_kernel
          and kernel_module(kernels, "intra").supported(chunk_size, dk, dv) is None)


def pallas_gpu_delta_family(mixer, q, k, v, gates, *, scale, initial_state, layout, chunk_size,
                            output_final_state=False, tuning=None):
  """The `pallas_gpu` implementation (see `api.run_mixer` for the contract).

  tuning: a `GpuTuning`, or None for `DEFAULT_TUNING`. Calls that `supports` rejects never get
  here: `api` dispatch runs "chunk" for them (with one log line per reason).
  """
  tuning = check_tuning(tuning)
  b, t, h, dk = q.shape
  hv, dv = v.shape[2], v.shape[3]
  reason = unsupported_reason(dk=dk, dv=dv, chunk_size=chunk_size, varlen=layout.is_varlen,
                              b=b, t=t, hv=hv)
  if reason:  # called directly, past the dispatch: refuse rather than run wrong
    raise ValueError(f"pallas_gpu cannot run this call: {reason}; call it through the op "
                     f"(implementation='pallas_gpu' falls back to 'chunk').")
  return delta_family(mixer, q, k, v, gates, scale=scale, initial_state=initial_state,
                      layout=layout, chunk_size=chunk_size,
                      output_final_state=output_final_state, tuning=tuning, kernels="mosaic")


def delta_family(mixer, q, k, v, gates, *, scale, initial_state, layout, chunk_size,
                 output_final_state, tuning: GpuTuning, kernels: str):
  """The composition shared by the GPU kernel paths: the intra-chunk part (the kernels of
  `kernels` for DeltaNet / GDN with `tuning.intra="kernel"`, else XLA), then the state-pass
  kernels of `kernels` ("mosaic": `pallas_gpu`'s Mosaic GPU kernels; "triton": `triton_gpu`'s).
  Arguments as `api.run_mixer`'s, q, k, v in the caller's dtypes (the implementations register
  with `keeps_input_dtypes`): every path upcasts them to float32 here, as `api` would, but the
  channel kernels' one-VJP path, which reads them as they are; sizes checked by the caller."""
  b, t, h, dk = q.shape
  hv, dv = v.shape[2], v.shape[3]
  q_in, k_in, v_in = q, k, v
  q, k, v = (x.astype(_F32) for x in (q, k, v))
  # The state pass writes o and e in bf16 for bf16 calls (what the op returns anyway).
  out_dtype = state_pass_out_dtype(v_in.dtype)
  g, erase, write = chunked.canonical_gates(mixer, v, gates)
  c = chunk_size
  t_pad = -(-t // c) * c
  pad = functools.partial(chunked.pad_time, t_pad=t_pad)
  s0 = jnp.zeros((b, hv, dk, dv), _F32) if initial_state is None else initial_state
  segidx = None if layout.segidx is None else chunked.pad_time(layout.segidx, t_pad, mode="edge")
  m = None
  if layout.valid is not None:
    # Padding rows are identity steps: no decay, no erase, no write, zero output (the write is
    # masked below, on the path's own write factor).
    m = layout.valid[:, :, None].astype(_F32)                 # [B, T, 1]
    q, k = q * m[..., None], k * m[..., None]
    # (0 / 1 factors: exact in any dtype, so the kept inputs keep theirs.)
    q_in, k_in = (x * m[..., None].astype(x.dtype) for x in (q_in, k_in))
    g = None if g is None else g * (m if g.ndim == 3 else m[..., None])
  # (Under shard_map the kernel's outputs would lack the varying-axes types: XLA path there.)
  interpret = interpret_params() if kernels == "mosaic" else None
  if (g is None and erase is None and write is None and not vma(q, k, v)
      and _linear_walk_applies(tuning, dk, dv, chunk_size, kernels, segidx is not None)):
    # Linear attention on the walks without their erase (E = v).
    vw = v if m is None else v * m[..., None]
    o, e, s_final = _walk(q, k, vw, None, None, s0, scale=scale, c=c, interpret=interpret,
                          tuning=tuning)
    return o, (s_final if output_final_state else None), e
  if _intra_kernel_applies(mixer, dk, dv, chunk_size, tuning, kernels) and not vma(q, k, v):
    beta = gates["beta"] if m is None else gates["beta"] * m
    if walk_applies(tuning, dk, dv, chunk_size, kernels, segidx is not None):
      o, e, s_final = _walk(q, k, v, beta, g, s0, scale=scale, c=c, interpret=interpret,
                            tuning=tuning)
      return o, (s_final if output_final_state else None), e
    if fused_forward_applies(tuning, dk, dv, chunk_size):
      G = None
      if g is not None:
        G, _ = chunked.chunk_cumulative_gates(pad(g).astype(_F32),
                                              functools.partial(to_chunks, c=c))
      o, e, s_final = _fused_core(pad(q), pad(k), pad(v), pad(beta), G, s0, segidx, scale, c,
                                  interpret, kernels)
    else:
      o, e, s_final = _core_intra_kernel(pad(q), pad(k), pad(v), pad(beta), pad(g), s0, segidx,
                                         scale=scale, c=c, interpret=interpret, kernels=kernels,
                                         fused_grads=fused_intra_grads(tuning, g is not None),
                                         state=state_kernels(tuning, kernels), tuning=tuning,
                                         out_dtype=out_dtype)
    return o[:, :t], (s_final if output_final_state else None), e[:, :t]
  n_rep = hv // h
  if (channel_grads_choice(tuning, kernels) == "states" and erase is not None
      and channel_kernel_applies(q, k, v, g, c=c, tuning=tuning, kernels=kernels)):
    # KDA / GDN-2's channel kernels and state pass under one custom VJP; the erase / write
    # gates go to the kernels (padding rows: a zero write, as on the split path below).
    if m is not None:
      write = m[..., None] if write is None else write * m[..., None]
    # Rows cut into pieces as on the split path (the Mosaic pass only): T padded to a multiple
    # of c·pieces with identity steps (zero q, k, gates and writes), as `pad` does to c.
    state = state_kernels(tuning, kernels)
    pieces = (gpu_pieces.row_pieces(tuning, b, hv, dk, dv, t_pad, c) if state == "mosaic"
              else 1)
    t_cut = -(-t // (c * pieces)) * c * pieces
    pad_cut = functools.partial(chunked.pad_time, t_pad=t_cut)
    seg_cut = (None if layout.segidx is None
               else chunked.pad_time(layout.segidx, t_cut, mode="edge"))
    # q, k, v as the caller gave them (bf16 stays bf16 in memory; the kernels widen it on chip
    # and scale q there).
    rep = lambda x: jnp.repeat(x, n_rep, axis=2)
    o, e, s_final = channel_state_core(pad_cut(rep(q_in)), pad_cut(rep(k_in)), pad_cut(v_in),
                                       pad_cut(erase), pad_cut(write), pad_cut(g), s0, seg_cut,
                                       c=c, scale=float(scale), span=tuning.channel_span,
                                       interpret=interpret, kernels=state,
                                       gates_on_chip=tuning.channel_gates == "kernel",
                                       products=state_products(tuning, state, dk, dv),
                                       out_dtype=out_dtype, pieces=pieces,
                                       solve=tuning.channel_solve)
    return (o[:, :t], (s_final if output_final_state else None), from_chunks(e)[:, :t])
  q = jnp.repeat(q, n_rep, axis=2) * scale
  k = jnp.repeat(k, n_rep, axis=2)
  k_erase = None if erase is None else k * erase
  v_write = v if write is None else v * write
  if m is not None:
    v_write = v_write * m[..., None]
  o, e, s_final = _core(pad(q), pad(k), pad(k_erase), pad(v_write), pad(g), s0, segidx, c=c,
                        interpret=interpret, tuning=tuning, kernels=kernels,
                        out_dtype=out_dtype)
  return o[:, :t], (s_final if output_final_state else None), e[:, :t]
