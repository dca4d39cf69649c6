"""The DeltaNet / GDN / linear attention walks of `implementation="pallas_gpu"` as
differentiable cores: `walk_core` (the warp-specialised Mosaic GPU walks, `GpuTuning(forward=
"walk")`) and `walk_pieces_core` (the same with every row cut into pieces that walk at once,
`GpuTuning(row_pieces=P)`), plus the backward they share with the fused Triton path
(`grads_after_reverse`).

`pallas_gpu.delta_family` decides which runs; this module only composes the kernels of
`pallas_kernels.gpu` (`chunk_walk`, `chunk_walk_reverse`, `chunk_grads`) and the T0 inverse.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lineax_attn.ops import gpu_pieces
from lineax_attn.ops.gpu_chunks import kernel_segments, segment_masks, to_chunks
from lineax_attn.ops.gpu_pieces import by_piece, from_pieces
from lineax_attn.ops.gpu_tuning import GpuTuning
from lineax_attn.ops.gpu_vjps import (given_cotangents, intra_kernel_backward, primal_values,
                                      state_pass_products)

_F32 = jnp.float32

# `intra_chunk_bwd_from_states` runs only up to these head dims. Compiled on the H200
# (2026-12-03) its products' V loop in two steps of 64 gave a wrong dk at K = V = 128 (a triton
# 3.6 miscompile; Triton's interpreter computes it right); one step of 128, the kernel's default
# since, is right (every fused-path op test passed compiled at 128: docs/data/
# test_triton_gpu_h200_2026-12-03_fused_k128.log) but slow: the kernel took 1.6 ms there, and
# GDN fwd+bwd with forward="fused" 3.23 ms against 2.80 with XLA's products. So wider heads keep
# XLA's products.
_FROM_STATES_MAX_DIM = 64


def grads_after_reverse(q, k, v, beta, G, segidx, t0, h, e, de, dh, do, *, scale, c,
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


def walk_forward(q, k, v, beta_rows, g_rows, s0, scale, c, interpret, *, save_states=False,
                 approx_math=False):
  """(o, e, s_final[, t0, h]) of DeltaNet / GDN by the Mosaic walk, or of linear attention
  (beta_rows None: no erase, no T0); q, k unrepeated and unscaled, beta_rows `[B, HV, T]`,
  g_rows the chunk cumulative log gates `[B, HV, T]` or None (ungated). o and e come back
  float32 (the walk writes bf16; XLA folds the two casts into the op's cast to v's dtype); with
  save_states also the gate-free inverses (None for linear attention) and the bf16 chunk states
  transposed, h_t `[B, HV, Nc, V, K]` bf16, the backward's residuals. approx_math: the walk's
  e^x as ex2.approx (`WalkOptions.approx_math`)."""
  from pallas_kernels.gpu import chunk_walk  # pylint: disable=g-import-not-at-top
  hv = v.shape[2]
  t0 = None if beta_rows is None else gate_free_inverse(k, beta_rows, hv, c)
  bf = lambda x: x.astype(jnp.bfloat16)
  outs = chunk_walk.chunk_walk(bf(q), bf(k), bf(v), t0, *kernel_rows(beta_rows, g_rows, v),
                               jnp.swapaxes(s0.astype(_F32), -1, -2),
                               scale=float(scale), gated=g_rows is not None,
                               save_states=save_states, approx_math=approx_math,
                               interpret=interpret)
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
# do its work. G: the chunk cumulative gates `[B, HV, Nc, C]` (None ungated). walk_opts: a
# `WalkOptions`.
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def walk_core(q, k, v, beta, G, s0, scale, c, interpret, walk_opts):
  return walk_forward(q, k, v, *walk_rows(beta, G), s0, scale, c, interpret,
                      approx_math=walk_opts.approx_math)


class WalkOptions(NamedTuple):
  """What a tuning sets for the walks' path (hashable: a nondiff argument of its VJPs): the
  `chunk_grads` options (approx_math also reaches every walk) and the reverse walks'
  `overlap` (`GpuTuning.walk_overlap`)."""
  approx_math: bool
  join_exit: bool
  grads_warpgroups: int
  overlap: bool


def walk_options(tuning: GpuTuning) -> WalkOptions:
  return WalkOptions(tuning.approx_math, tuning.join_exit, tuning.grads_warpgroups,
                     tuning.walk_overlap)


def walk_rows(beta, G):
  if beta is None:    # linear attention
    return None, None
  b, t, hv = beta.shape
  return jnp.moveaxis(beta.astype(_F32), 1, 2), None if G is None else G.reshape(b, hv, t)


def kernel_rows(beta_rows, g_rows, v):
  """The (gate, β) rows `[B, HV, T]` the walks copy: β stands in for an ungated mixer's gates
  and zeros for linear attention's β (the kernels read neither)."""
  if beta_rows is None:
    b, t, hv = v.shape[:3]
    beta_rows = jnp.zeros((b, hv, t), _F32)
  return (beta_rows if g_rows is None else g_rows), beta_rows


def walk_core_fwd(q, k, v, beta, G, s0, scale, c, interpret, walk_opts):
  q, k, v, beta, G, s0 = primal_values(q, k, v, beta, G, s0)   # (symbolic_zeros)
  o, e, s_final, t0, h = walk_forward(q, k, v, *walk_rows(beta, G), s0, scale, c, interpret,
                                       save_states=True, approx_math=walk_opts.approx_math)
  return (o, e, s_final), (q, k, v, beta, G, t0, h, e.astype(jnp.bfloat16))


def walk_core_bwd(scale, c, interpret, walk_opts, res, cts):
  q, k, v, beta, G, t0, h_t, e = res
  # Outputs the caller does not use come as symbolic zeros: an unused residual e (the usual
  # case) costs the reverse walk no copies and XLA no [B, T, HV, V] broadcast of zeros.
  do, de_ext, ds_final = given_cotangents(cts)
  dsf_t = (jnp.zeros((v.shape[0], v.shape[2], v.shape[3], q.shape[-1]), _F32)
           if ds_final is None else jnp.swapaxes(ds_final.astype(_F32), -1, -2))
  *grads, ds0_t = walk_grads(q, k, v, beta, G, t0, h_t, e, do, de_ext, dsf_t, scale=scale, c=c,
                             interpret=interpret, walk_opts=walk_opts)
  return (*grads, jnp.swapaxes(ds0_t, -1, -2))


def walk_grads(q, k, v, beta, G, t0, h_t, e, do, de_ext, dsf_t, *, scale, c, interpret,
               walk_opts):
  """(dq, dk, dv, dβ, dG, ds0_t) of the walks from the forward's residuals (t0, the chunk states
  h_t, e bf16) and the cotangents: do and de_ext `[B, T, HV, V]` (None: zero), dsf_t the final
  state's, transposed `[B, HV, V, K]` float32. The reverse walk, then one kernel per chunk."""
  from pallas_kernels.gpu import chunk_grads  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gpu import chunk_walk_reverse  # pylint: disable=g-import-not-at-top
  if do is None:
    do = jnp.zeros(v.shape, jnp.bfloat16)
  gate_rows, beta_rows = kernel_rows(*walk_rows(beta, G), v)
  bf = lambda x: x.astype(jnp.bfloat16)
  de_t, dh_t, ds0_t = chunk_walk_reverse.chunk_walk_reverse(
      bf(q), bf(k), t0, gate_rows, beta_rows, bf(do), None if de_ext is None else bf(de_ext),
      dsf_t, scale=float(scale), gated=G is not None, overlap=walk_opts.overlap,
      approx_math=walk_opts.approx_math, interpret=interpret)
  b, t, h, dk = q.shape
  hv, dv = v.shape[2:]
  if chunk_grads.supported(c, dk, dv) is not None:   # (linear attention never walks there)
    grads = grads_after_reverse(q, k, v, beta, G, None, t0, jnp.swapaxes(h_t, -1, -2), e,
                                jnp.swapaxes(de_t, -1, -2), jnp.swapaxes(dh_t, -1, -2), do,
                                scale=scale, c=c, interpret=interpret, kernels="mosaic",
                                from_states=False)
    return grads + (ds0_t,)
  dq, dk_, dv_, dbeta, dG = chunk_grads.chunk_grads(
      bf(q), bf(k), bf(v), e, bf(do), t0, gate_rows, beta_rows, h_t, dh_t, de_t,
      scale=float(scale), gated=G is not None, interpret=interpret,
      approx_math=walk_opts.approx_math, join_exit=walk_opts.join_exit,
      # two warpgroups take the delta rule at K = V (chunk_grads' own rule); else one
      warpgroups=walk_opts.grads_warpgroups if t0 is not None and dk == dv else 1)
  if hv != h:   # GVA: each value head's share of its key head's gradient, summed in float32
    heads = lambda x: jnp.sum(x.reshape(b, t, h, hv // h, dk).astype(_F32), axis=3)
    dq, dk_ = heads(dq), heads(dk_)
  return (dq.astype(q.dtype), dk_.astype(k.dtype), dv_.astype(v.dtype),
          None if beta is None else jnp.moveaxis(dbeta, 1, 2).astype(beta.dtype),
          None if G is None else dG.reshape(G.shape).astype(G.dtype), ds0_t)


walk_core.defvjp(walk_core_fwd, walk_core_bwd, symbolic_zeros=True)


# ------------------------------------------------------------------ rows cut into pieces
# `GpuTuning(row_pieces=P)` (the maths: `gpu_pieces`): each row is cut into P pieces of T/P
# tokens that walk at once as P rows of the batch. Forward: the maps' walk from [I | 0] (its
# first K state columns with v = 0; `maps_walk`, one or two chains per CTA), the entry states
# composed, then the ordinary walk of every piece; backward: the reverse walk of every piece
# from a zero end cotangent (`states_only`: its entry cotangent alone), the final state's
# cotangent carried back to every piece's end, then the ordinary backward of every piece.
# Linear attention makes its maps and entry cotangents by products instead
# (`_piece_products`). The maps come from the walk itself (bf16 operands, float32 state), so
# forward and gradients are the unsplit op's up to that rounding.


def _pieces_time(x, p):
  """`[B, T, ...]` -> `[B·P, T/P, ...]` (piece j of row b at row b·P + j); None stays None."""
  return None if x is None else x.reshape((x.shape[0] * p, x.shape[1] // p) + x.shape[2:])


def _rows_time(x, b):
  """The inverse of `_pieces_time`."""
  return None if x is None else x.reshape((b, -1) + x.shape[2:])


def _pieces_heads(x, p):
  """`[B, HV, N, ...]` (time or chunks on axis 2) -> `[B·P, HV, N/P, ...]`."""
  if x is None:
    return None
  b, hv, n = x.shape[:3]
  x = jnp.moveaxis(x.reshape((b, hv, p, n // p) + x.shape[3:]), 2, 1)
  return x.reshape((b * p, hv, n // p) + x.shape[4:])


def _rows_heads(x, b):
  """The inverse of `_pieces_heads`."""
  if x is None:
    return None
  bp, hv, n = x.shape[:3]
  x = jnp.moveaxis(x.reshape((b, bp // b, hv, n) + x.shape[3:]), 1, 2)
  return x.reshape((b, hv, -1) + x.shape[4:])


def _piece_maps(k, v, t0, gate_rows, beta_rows, gated, interpret, chains, approx_math):
  """The maps of every piece (inputs already in pieces): the walk from [I | 0] whose first K
  state columns walk with v = 0 (`maps_walk`, `chains` 64-column chains per CTA), its
  transposed end state `[B·P, HV, K + V, K]` float32 holding Φᵀ in rows :K and Ψᵀ in rows K:."""
  from pallas_kernels.gpu import maps_walk  # pylint: disable=g-import-not-at-top
  bp, _, hv, dv = v.shape
  bf = lambda x: x.astype(jnp.bfloat16)
  start_t = jnp.swapaxes(gpu_pieces.map_start(bp, hv, k.shape[-1], dv), -1, -2)
  return maps_walk.maps_walk(bf(k), bf(v), t0, gate_rows, beta_rows, start_t, gated=gated,
                             chains=chains, approx_math=approx_math, interpret=interpret)[0]


def _piece_products(x, y):
  """Σ_t x_tᵀ y_t over every piece's tokens, `[B·P, HV, K, V]` float32 from x `[B·P, T/P, H,
  K]` (its key head read by each value head) and y `[B·P, T/P, HV, V]`, bf16 operands as the
  walks read them: linear attention's Ψ (x = k, y = v) and its entry cotangent D (x = q,
  y = dO, times the scale), since without decay or erase S_t = S_in + Σ_{s<t} k_sᵀ v_s."""
  hv, h = y.shape[2], x.shape[2]
  x = jnp.repeat(x.astype(jnp.bfloat16), hv // h, axis=2)
  return jnp.einsum("bthk,bthv->bhkv", x, y.astype(jnp.bfloat16),
                    preferred_element_type=_F32)


def _walk_pieces_forward(q, k, v, beta, G, s0, scale, c, interpret, pieces, chains, *,
                         save_states, approx_math):
  """(o, e, s_final[, residuals]) of the walks with every row in `pieces` pieces, the maps'
  walk with `chains` chains per CTA; arguments as `walk_core`'s (T a multiple of 64·pieces).
  approx_math reaches both walks."""
  from pallas_kernels.gpu import chunk_walk  # pylint: disable=g-import-not-at-top
  b, hv, dk = q.shape[0], v.shape[2], q.shape[-1]
  q_p, k_p, v_p, beta_p = (_pieces_time(x, pieces) for x in (q, k, v, beta))
  # T0 made in the pieces' layout (k_p is a free reshape of k), not relaid out after.
  beta_rows, g_rows = walk_rows(beta_p, _pieces_heads(G, pieces))
  t0_p = None if beta_rows is None else gate_free_inverse(k_p, beta_rows, hv, c)
  gate_rows, beta_rows = kernel_rows(beta_rows, g_rows, v_p)      # `[B·P, HV, T/P]`
  if t0_p is None:   # linear attention: Φ = I and Ψ = Σ kᵀ v over the piece, no maps' walk
    psi = by_piece(_piece_products(k_p, v_p), b)                 # [P, B, HV, K, V]
    phi_t = jnp.broadcast_to(jnp.eye(dk, dtype=_F32), psi.shape[:3] + (dk, dk))
    starts = gpu_pieces.entry_states(phi_t, psi, s0)
  else:
    end_t = by_piece(_piece_maps(k_p, v_p, t0_p, gate_rows, beta_rows, G is not None,
                                 interpret, chains, approx_math), b)   # [P, B, HV, K + V, K]
    # (The walks hold states transposed: end_t holds Φᵀ in rows :K, Ψᵀ in rows K:.)
    phi_t = end_t[:, :, :, :dk]
    starts = gpu_pieces.entry_states(jnp.swapaxes(phi_t, -1, -2),
                                     jnp.swapaxes(end_t[:, :, :, dk:], -1, -2), s0)
  bf = lambda x: x.astype(jnp.bfloat16)
  outs = chunk_walk.chunk_walk(bf(q_p), bf(k_p), bf(v_p), t0_p, gate_rows, beta_rows,
                               from_pieces(jnp.swapaxes(starts, -1, -2)), scale=float(scale),
                               gated=G is not None, save_states=save_states,
                               approx_math=approx_math, interpret=interpret)
  o, e = (_rows_time(x, b).astype(_F32) for x in outs[:2])
  s_final = jnp.swapaxes(by_piece(outs[2], b)[-1], -1, -2)
  if not save_states:
    return o, e, s_final
  return o, e, s_final, (t0_p, outs[3], phi_t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def walk_pieces_core(q, k, v, beta, G, s0, scale, c, interpret, walk_opts, pieces, chains):
  """`walk_core` with every row cut into `pieces` pieces (T a multiple of 64·pieces), the
  maps' walk with `chains` (1 or 2) chains per CTA."""
  return _walk_pieces_forward(q, k, v, beta, G, s0, scale, c, interpret, pieces, chains,
                              save_states=False, approx_math=walk_opts.approx_math)


def _walk_pieces_core_fwd(q, k, v, beta, G, s0, scale, c, interpret, walk_opts, pieces,
                          chains):
  q, k, v, beta, G, s0 = primal_values(q, k, v, beta, G, s0)   # (symbolic_zeros)
  o, e, s_final, (t0_p, h_t, phi_t) = _walk_pieces_forward(
      q, k, v, beta, G, s0, scale, c, interpret, pieces, chains, save_states=True,
      approx_math=walk_opts.approx_math)
  return (o, e, s_final), (q, k, v, beta, G, t0_p, h_t, phi_t, e.astype(jnp.bfloat16))


def _walk_pieces_core_bwd(scale, c, interpret, walk_opts, pieces, chains, res, cts):
  del chains   # (the maps' walk is forward only)
  from pallas_kernels.gpu import chunk_walk_reverse  # pylint: disable=g-import-not-at-top
  q, k, v, beta, G, t0_p, h_t, phi_t, e = res
  do, de_ext, ds_final = given_cotangents(cts)
  b, hv, dv, dk = q.shape[0], v.shape[2], v.shape[3], q.shape[-1]
  if do is None:
    do = jnp.zeros(v.shape, jnp.bfloat16)
  q_p, k_p, v_p, beta_p, do_p, de_p, e_p = (_pieces_time(x, pieces)
                                            for x in (q, k, v, beta, do, de_ext, e))
  G_p = _pieces_heads(G, pieces)
  gate_p, beta_rows_p = kernel_rows(*walk_rows(beta_p, G_p), v_p)
  bf = lambda x: x.astype(jnp.bfloat16)
  # Every piece's entry cotangent from its own outputs alone (a zero end cotangent): for linear
  # attention s Σ qᵀ dO over the piece, else the states-only reverse walk.
  if t0_p is None:
    local_t = jnp.swapaxes(by_piece(_piece_products(q_p, do_p), b) * scale, -1, -2)
  else:
    local_t = by_piece(chunk_walk_reverse.chunk_walk_reverse(
        bf(q_p), bf(k_p), t0_p, gate_p, beta_rows_p, bf(do_p),
        None if de_p is None else bf(de_p), jnp.zeros((b * pieces, hv, dv, dk), _F32),
        scale=float(scale), gated=G is not None, states_only=True, overlap=walk_opts.overlap,
        approx_math=walk_opts.approx_math, interpret=interpret)[0], b)   # [P, B, HV, V, K]
  # dS_in = Φᵀ dS_out + D, from the final state's cotangent back to every piece's end.
  ends = gpu_pieces.exit_cotangents(jnp.swapaxes(phi_t, -1, -2),
                                    jnp.swapaxes(local_t, -1, -2), ds_final)
  dq, dk_, dv_, dbeta, dG, ds0_t = walk_grads(
      q_p, k_p, v_p, beta_p, G_p, t0_p, h_t, e_p, do_p, de_p,
      from_pieces(jnp.swapaxes(ends, -1, -2)),
      scale=scale, c=c, interpret=interpret, walk_opts=walk_opts)
  return (_rows_time(dq, b), _rows_time(dk_, b), _rows_time(dv_, b), _rows_time(dbeta, b),
          _rows_heads(dG, b), jnp.swapaxes(by_piece(ds0_t, b)[0], -1, -2))


walk_pieces_core.defvjp(_walk_pieces_core_fwd, _walk_pieces_core_bwd, symbolic_zeros=True)
