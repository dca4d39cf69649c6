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
  wired in `_walk_train_core`. On the H200 (2026-12-04) fwd+bwd GDN 1.16 ms, DeltaNet 1.24,
  linear attention 0.67 against the split's 2.36 / 2.15 / 1.95 (docs/BENCHMARKS.md "fifteenth
  stage"). Packed rows keep the split.
* **KDA / GDN-2 under one VJP (`GpuTuning(channel_grads="states")`, opt-in):** the Triton
  channel kernels and the state pass in `gpu_prepare.channel_state_core`; the state pass's
  products made by the channel backward kernel itself (`state_products="channel"`: timed
  slower, docs/BENCHMARKS.md "eighteenth stage"), the products kernel or XLA, and with
  `channel_gates="kernel"` the erase / write gates applied on chip.
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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lineax_attn.ops import api
from lineax_attn.ops import chunked
from lineax_attn.ops import specs
from lineax_attn.ops.gpu_chunks import from_chunks, kernel_segments, segment_masks, to_chunks
# Re-exported: `pallas_gpu.X` stays the public spelling of these (api, benchmarks, tests, docs).
from lineax_attn.ops.gpu_prepare import (channel_intra_kernel, channel_kernel_applies,
                                         channel_state_core, prepare_chunks)
from lineax_attn.ops.gpu_tuning import (DEFAULT_TUNING, INTRA_CHOICES, PAIR_CHOICES,
                                        SOLVE_CHOICES, GpuTuning, check_tuning,
                                        fused_intra_grads)
from lineax_attn.ops.gpu_vjps import (given_cotangents, interpret_params, intra_kernel,
                                      kernel_module, primal_values, state_pass, vma)
from lineax_attn.ops.gpu_vjps import intra_kernel_backward, state_pass_products
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


def state_products(tuning: GpuTuning) -> str:
  """Who makes the state pass's backward products (`GpuTuning.state_products`): "kernel" only
  where the triton extra runs (asked for by name without it: a ValueError, not a silent
  fallback); "auto" takes it there and XLA's products elsewhere."""
  from lineax_attn.ops import triton_gpu  # pylint: disable=g-import-not-at-top
  if tuning.state_products == "auto":
    return "kernel" if triton_gpu.available() else "xla"
  if tuning.state_products in ("xla", "channel"):   # (the channel kernels ask for triton)
    return tuning.state_products
  triton_gpu.require("state_products='kernel'", "state_products='xla'")
  return "kernel"


def _core(q, k, k_erase, v_write, g, s0, segidx, *, c, interpret, tuning, kernels):
  """Chunk form on [B, T, HV, ...] inputs (T a multiple of c): (o, e, s_final)."""
  if channel_kernel_applies(q, k_erase, v_write, g, c=c, tuning=tuning, kernels=kernels):
    ny, qg, p, u, kg, gc = channel_intra_kernel(q, k, k_erase, v_write, g, segidx, c,
                                                tuning.channel_grads == "kernel",
                                                float(tuning.channel_span))
  else:
    ny, qg, p, u, kg, gc = prepare_chunks(q, k, k_erase, v_write, g, segidx, c=c,
                                          tuning=tuning)
  o, e, s_final = state_pass(ny, qg, p, u, kg, gc, s0, interpret, state_kernels(tuning, kernels),
                             state_products(tuning))
  return from_chunks(o), from_chunks(e), s_final


def _core_intra_kernel(q, k, v, beta, g, s0, segidx, *, scale, c, interpret, kernels,
                       fused_grads=False, state="mosaic"):
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
  o, e, s_final = state_pass(ny, qg, p, u, kg, gc, s0, interpret, state)
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


# `intra_chunk_bwd_from_states` runs only up to these head dims. Compiled on the H200
# (2026-12-03) its products' V loop in two steps of 64 gave a wrong dk at K = V = 128 (a triton
# 3.6 miscompile; Triton's interpreter computes it right); one step of 128, the kernel's default
# since, is right (every fused-path op test passed compiled at 128: docs/data/
# test_triton_gpu_h200_2026-12-03_fused_k128.log) but slow: the kernel took 1.6 ms there, and
# GDN fwd+bwd with forward="fused" 3.23 ms against 2.80 with XLA's products. So wider heads keep
# XLA's products.
_FROM_STATES_MAX_DIM = 64

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
  return _grads_after_reverse(q, k, v, beta, G, segidx, factors[0], h, e, de, dh, do,
                              scale=scale, c=c, interpret=interpret, kernels=kernels,
                              from_states=True) + (ds0, None)


def _grads_after_reverse(q, k, v, beta, G, segidx, t0, h, e, de, dh, do, *, scale, c,
                         interpret, kernels, from_states):
  """(dq, dk, dv, dβ, dG) of the delta rule's chunk form once the reverse state pass has made
  de `[B, HV, Nc, C, V]` (float32 or bf16) and dh `[B, HV, Nc, K, V]` bf16: the intra-chunk
  backward fed with M = T0 ⊙ Γ, after the state pass's products (made inside the Triton kernel when
  `from_states` and its sizes allow, else in XLA), and γ's share of dG. h: the chunk states, e
  the pseudo-values `[B, T, HV, V]`."""
  b, t, hv = v.shape[:3]
  segments = None if segidx is None else kernel_segments(segidx, c)
  beta_rows = jnp.moveaxis(beta.astype(_F32), 1, 2)                 # [B, HV, T]
  m = t0
  if G is not None:    # M = T0 ⊙ Γ, Γ_ij = e^{G_i − G_j} on i ≥ j (T0 is zero elsewhere)
    lower = jnp.tril(jnp.ones((c, c), bool))
    diff = jnp.where(lower, G[..., :, None] - G[..., None, :], 0.0)
    m = (t0.astype(_F32) * jnp.where(lower, jnp.exp(diff), 0.0)).astype(t0.dtype)
  if (from_states and q.shape[2] == hv
      and max(q.shape[-1], v.shape[-1]) <= _FROM_STATES_MAX_DIM):
    # One Triton kernel per chunk: the state pass's products (dNY, dQG, dP, dKG) made inside
    # from E, dE, dO and the chunk states, never written to HBM, then the intra backward.
    from pallas_kernels.gpu.triton import intra_chunk as tic  # pylint: disable=g-import-not-at-top
    g_rows = jnp.zeros((b, hv, t), _F32) if G is None else G.reshape(b, hv, t)
    dq, dk_, dv, dbeta, dG = tic.intra_chunk_bwd_from_states(
        q, k, v, beta_rows, g_rows, segments, m, de, h, dh, e, do,
        scale=float(scale), gated=G is not None)
    dq, dk_, dv = dq.astype(q.dtype), dk_.astype(k.dtype), dv.astype(v.dtype)
    dbeta = jnp.moveaxis(dbeta, 1, 2).astype(beta.dtype)
    dG = None if G is None else dG.reshape(G.shape)
    d_gc = None if G is None else jnp.sum(dh.astype(_F32) * h.astype(_F32), axis=(-2, -1))
  else:   # GVA, wider heads: the products in XLA, the split's intra backward (which sums
    # over value heads)
    d_ny, d_qg, d_p, d_kg, d_gc = state_pass_products(de, to_chunks(do, c), to_chunks(e, c), h,
                                                      dh)
    dq, dk_, dv, dbeta, dG = intra_kernel_backward(
        (q, k, v, beta, G, segidx, m), (d_ny, d_qg, d_p, de, d_kg), scale=scale, c=c,
        interpret=interpret, kernels=kernels, fused=False)
    d_gc = None if G is None else jnp.sum(d_gc, axis=-1)
  if G is not None:    # γ = e^{G_C} (cut by a segment start in the chunk) scales the carry
    gc = jnp.exp(G[..., -1])
    if segidx is not None:
      gc = gc * segment_masks(segidx, c)[1][..., -1]
    dG = dG.at[..., -1].add((d_gc * gc).astype(dG.dtype))
  return dq, dk_, dv, dbeta, dG


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


def gate_free_inverse(k, beta_rows, hv: int, c: int):
  """T0 = (I + diag(β) strict(k kᵀ))⁻¹ per chunk, `[B, HV, Nc, C, C]` bf16: the Triton T0
  kernel where the triton extra runs, else XLA's blocked inverse (`triangular`, float32)."""
  from lineax_attn.ops import triton_gpu  # pylint: disable=g-import-not-at-top
  if triton_gpu.available():
    from pallas_kernels.gpu.triton import fused_forward as ff  # pylint: disable=g-import-not-at-top
    return ff.gate_free_inverse(k, beta_rows, hv=hv)
  from lineax_attn.ops import triangular  # pylint: disable=g-import-not-at-top
  b, t, h, dk = k.shape
  kc = to_chunks(jnp.repeat(k.astype(_F32), hv // h, axis=2), c)       # [B, HV, Nc, C, K]
  kk = jnp.einsum("bhnik,bhnjk->bhnij", kc, kc, precision=jax.lax.Precision.HIGHEST)
  beta_c = beta_rows.astype(_F32).reshape(b, hv, t // c, c)
  lower = jnp.tril(kk * beta_c[..., :, None], -1)
  return triangular.unit_lower_inverse(lower).astype(jnp.bfloat16)


def _walk_forward(q, k, v, beta_rows, g_rows, s0, scale, c, interpret, *, save_states=False):
  """(o, e, s_final[, t0, h]) of DeltaNet / GDN by the Mosaic walk, or of linear attention
  (beta_rows None: no erase, no T0); q, k unrepeated and unscaled, beta_rows `[B, HV, T]`,
  g_rows the chunk cumulative log gates `[B, HV, T]` or None (ungated). o and e come back
  float32 (the walk writes bf16; XLA folds the two casts into the op's cast to v's dtype); with
  save_states also the gate-free inverses (None for linear attention) and the bf16 chunk states
  transposed, h_t `[B, HV, Nc, V, K]` bf16, the backward's residuals."""
  from pallas_kernels.gpu import chunk_walk  # pylint: disable=g-import-not-at-top
  hv = v.shape[2]
  t0 = None if beta_rows is None else gate_free_inverse(k, beta_rows, hv, c)
  bf = lambda x: x.astype(jnp.bfloat16)
  outs = chunk_walk.chunk_walk(bf(q), bf(k), bf(v), t0, *_kernel_rows(beta_rows, g_rows, v),
                               jnp.swapaxes(s0.astype(_F32), -1, -2),
                               scale=float(scale), gated=g_rows is not None,
                               save_states=save_states, interpret=interpret)
  o, e, s_final = outs[0].astype(_F32), outs[1].astype(_F32), jnp.swapaxes(outs[2], -1, -2)
  if not save_states:
    return o, e, s_final
  return o, e, s_final, t0, outs[3]


# forward="walk" (and "auto" where it walks): trained through the Mosaic walks both ways (a
# walk forward cannot pair with the split's backward, which reads the split's intra-chunk
# residuals). The forward walk saves the chunk states; the reverse walk (`chunk_walk_reverse`)
# makes dE and the state cotangents from q, k, T0 and the gates; then one kernel per chunk
# (`chunk_grads`) makes dq, dk, dv, dβ and dG from them in the inputs' layout. Where that
# kernel does not take the sizes (V = 256), XLA's products and the split's intra-chunk backward
# do its work. G: the chunk cumulative gates `[B, HV, Nc, C]` (None ungated). grads_opts:
# (`GpuTuning.approx_math`, `GpuTuning.join_exit`, `GpuTuning.grads_warpgroups`), for
# chunk_grads.
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _walk_train_core(q, k, v, beta, G, s0, scale, c, interpret, grads_opts):
  del grads_opts
  return _walk_forward(q, k, v, *_walk_rows(beta, G), s0, scale, c, interpret)


def _grads_opts(tuning: GpuTuning) -> tuple[bool, bool, int]:
  """The `chunk_grads` options a tuning sets (hashable: a nondiff argument of the walk's VJP)."""
  return tuning.approx_math, tuning.join_exit, tuning.grads_warpgroups


def _walk_rows(beta, G):
  if beta is None:    # linear attention
    return None, None
  b, t, hv = beta.shape
  return jnp.moveaxis(beta.astype(_F32), 1, 2), None if G is None else G.reshape(b, hv, t)


def _kernel_rows(beta_rows, g_rows, v):
  """The (gate, β) rows `[B, HV, T]` the walks copy: β stands in for an ungated mixer's gates
  and zeros for linear attention's β (the kernels read neither)."""
  if beta_rows is None:
    b, t, hv = v.shape[:3]
    beta_rows = jnp.zeros((b, hv, t), _F32)
  return (beta_rows if g_rows is None else g_rows), beta_rows


def _walk_train_core_fwd(q, k, v, beta, G, s0, scale, c, interpret, grads_opts):
  del grads_opts
  q, k, v, beta, G, s0 = primal_values(q, k, v, beta, G, s0)   # (symbolic_zeros)
  o, e, s_final, t0, h = _walk_forward(q, k, v, *_walk_rows(beta, G), s0, scale, c, interpret,
                                       save_states=True)
  return (o, e, s_final), (q, k, v, beta, G, t0, h, e.astype(jnp.bfloat16))


def _walk_train_core_bwd(scale, c, interpret, grads_opts, res, cts):
  from pallas_kernels.gpu import chunk_grads  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gpu import chunk_walk_reverse  # pylint: disable=g-import-not-at-top
  q, k, v, beta, G, t0, h_t, e = res
  # Outputs the caller does not use come as symbolic zeros: an unused residual e (the usual
  # case) costs the reverse walk no copies and XLA no [B, T, HV, V] broadcast of zeros.
  do, de_ext, ds_final = given_cotangents(cts)
  if do is None:
    do = jnp.zeros(v.shape, jnp.bfloat16)
  if ds_final is None:
    ds_final = jnp.zeros((*v.shape[:1], v.shape[2], q.shape[-1], v.shape[-1]), _F32)
  gate_rows, beta_rows = _kernel_rows(*_walk_rows(beta, G), v)
  bf = lambda x: x.astype(jnp.bfloat16)
  de_t, dh_t, ds0_t = chunk_walk_reverse.chunk_walk_reverse(
      bf(q), bf(k), t0, gate_rows, beta_rows, bf(do), None if de_ext is None else bf(de_ext),
      jnp.swapaxes(ds_final.astype(_F32), -1, -2), scale=float(scale), gated=G is not None,
      interpret=interpret)
  ds0 = jnp.swapaxes(ds0_t, -1, -2)
  b, t, h, dk = q.shape
  hv, dv = v.shape[2:]
  if chunk_grads.supported(c, dk, dv) is not None:   # (linear attention never walks there)
    grads = _grads_after_reverse(q, k, v, beta, G, None, t0, jnp.swapaxes(h_t, -1, -2), e,
                                 jnp.swapaxes(de_t, -1, -2), jnp.swapaxes(dh_t, -1, -2), do,
                                 scale=scale, c=c, interpret=interpret, kernels="mosaic",
                                 from_states=False)
    return grads + (ds0,)
  dq, dk_, dv_, dbeta, dG = chunk_grads.chunk_grads(
      bf(q), bf(k), bf(v), e, bf(do), t0, gate_rows, beta_rows, h_t, dh_t, de_t,
      scale=float(scale), gated=G is not None, interpret=interpret, approx_math=grads_opts[0],
      join_exit=grads_opts[1],
      # two warpgroups take the delta rule at K = V (chunk_grads' own rule); else one
      warpgroups=grads_opts[2] if t0 is not None and dk == dv else 1)
  if hv != h:   # GVA: each value head's share of its key head's gradient, summed in float32
    heads = lambda x: jnp.sum(x.reshape(b, t, h, hv // h, dk).astype(_F32), axis=3)
    dq, dk_ = heads(dq), heads(dk_)
  return (dq.astype(q.dtype), dk_.astype(k.dtype), dv_.astype(v.dtype),
          None if beta is None else jnp.moveaxis(dbeta, 1, 2).astype(beta.dtype),
          None if G is None else dG.reshape(G.shape).astype(G.dtype), ds0)


_walk_train_core.defvjp(_walk_train_core_fwd, _walk_train_core_bwd, symbolic_zeros=True)


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
    o, e, s_final = _walk_train_core(pad(q), pad(k), pad(vw), None, None, s0, scale, c,
                                     interpret, _grads_opts(tuning))
    return o[:, :t], (s_final if output_final_state else None), e[:, :t]
  if _intra_kernel_applies(mixer, dk, dv, chunk_size, tuning, kernels) and not vma(q, k, v):
    beta = gates["beta"] if m is None else gates["beta"] * m
    walk = walk_applies(tuning, dk, dv, chunk_size, kernels, segidx is not None)
    if walk or fused_forward_applies(tuning, dk, dv, chunk_size):
      G = None
      if g is not None:
        G, _ = chunked.chunk_cumulative_gates(pad(g).astype(_F32),
                                              functools.partial(to_chunks, c=c))
      if walk:
        o, e, s_final = _walk_train_core(pad(q), pad(k), pad(v), pad(beta), G, s0, scale, c,
                                         interpret, _grads_opts(tuning))
      else:
        o, e, s_final = _fused_core(pad(q), pad(k), pad(v), pad(beta), G, s0, segidx, scale, c,
                                    interpret, kernels)
    else:
      o, e, s_final = _core_intra_kernel(pad(q), pad(k), pad(v), pad(beta), pad(g), s0, segidx,
                                         scale=scale, c=c, interpret=interpret, kernels=kernels,
                                         fused_grads=fused_intra_grads(tuning, g is not None),
                                         state=state_kernels(tuning, kernels))
    return o[:, :t], (s_final if output_final_state else None), e[:, :t]
  n_rep = hv // h
  if (tuning.channel_grads == "states" and erase is not None
      and channel_kernel_applies(q, k, v, g, c=c, tuning=tuning, kernels=kernels)):
    # KDA / GDN-2's channel kernels and state pass under one custom VJP; the erase / write
    # gates go to the kernels (padding rows: a zero write, as on the split path below).
    if m is not None:
      write = m[..., None] if write is None else write * m[..., None]
    # q, k, v as the caller gave them (bf16 stays bf16 in memory; the kernels widen it on chip
    # and scale q there).
    rep = lambda x: jnp.repeat(x, n_rep, axis=2)
    o, e, s_final = channel_state_core(pad(rep(q_in)), pad(rep(k_in)), pad(v_in), pad(erase),
                                       pad(write), pad(g), s0, segidx, c=c, scale=float(scale),
                                       span=tuning.channel_span,
                                       interpret=interpret,
                                       kernels=state_kernels(tuning, kernels),
                                       gates_on_chip=tuning.channel_gates == "kernel",
                                       products=state_products(tuning))
    return (from_chunks(o)[:, :t], (s_final if output_final_state else None),
            from_chunks(e)[:, :t])
  q = jnp.repeat(q, n_rep, axis=2) * scale
  k = jnp.repeat(k, n_rep, axis=2)
  k_erase = None if erase is None else k * erase
  v_write = v if write is None else v * write
  if m is not None:
    v_write = v_write * m[..., None]
  o, e, s_final = _core(pad(q), pad(k), pad(k_erase), pad(v_write), pad(g), s0, segidx, c=c,
                        interpret=interpret, tuning=tuning, kernels=kernels)
  return o[:, :t], (s_final if output_final_state else None), e[:, :t]
