"""XLA preparation of the `pallas_gpu` state pass: `prepare_chunks` (public; benchmarks call it
as `pallas_gpu.prepare_chunks`).

The intra-chunk part in XLA (`chunked._intra_chunk` with bf16 products), the path of linear
attention, KDA and GDN-2, and of DeltaNet / GDN with `GpuTuning(intra="xla")` or under
`shard_map`; its outputs are the state-pass kernel's inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lineax_attn.ops import chunked
from lineax_attn.ops.gpu_chunks import from_chunks, kernel_segments, segment_masks, to_chunks
from lineax_attn.ops.gpu_tuning import DEFAULT_TUNING, GpuTuning
from lineax_attn.ops import gpu_vjps
from lineax_attn.ops.gpu_vjps import (channel_pairs_kernel, given_cotangents, interpret_params,
                                      kernel_module, primal_values, vma)
from pallas_kernels.gpu import channel_pair as cp
from pallas_kernels.gpu import state_passing as sp

_F32 = jnp.float32
_MM = sp.MM_DTYPE


def prepare_chunks(q, k, kt, vt, g, segidx, *, c, tuning: GpuTuning = DEFAULT_TUNING):
  """XLA part: [B, T, HV, ...] inputs (T a multiple of c) -> the state-pass kernel's inputs.

  kt, vt: the erase key k ⊙ erase (None: no delta edit) and the write value v ⊙ write, called
  `k_erase` / `v_write` everywhere else (the parameter names stay for callers of this public
  function). `tuning.solve` and `tuning.remat_intra` steer it (`GpuTuning`).
  Returns (ny, qg, p, u, kg, gc) in the layouts of `state_passing.state_passing_fwd`.
  """
  G, gate_kind = chunked.chunk_cumulative_gates(g, functools.partial(to_chunks, c=c))
  same = cont = keep = None
  if segidx is not None:
    same, cont, keep = segment_masks(segidx, c)
  chunks = (to_chunks(q, c), to_chunks(k, c), to_chunks(kt, c), to_chunks(vt, c), G)
  # (Under shard_map the kernel's outputs would lack the varying-axes types: XLA there.)
  pairs = None
  if (gate_kind == "channel" and tuning.channel_pair != "xla" and kt is not None
      and not vma(q, k, kt) and cp.supported(c, q.shape[-1]) is None):
    pairs = functools.partial(channel_pairs_kernel, interpret=interpret_params() is not None,
                              bwd_kernel=tuning.channel_pair == "kernel",
                              diag=tuning.pair_diag)
  intra = functools.partial(chunked._intra_chunk, gate_kind=gate_kind, matmul="bf16",
                            solve=tuning.solve, channel_pairs=pairs)
  if tuning.remat_intra:
    intra = jax.checkpoint(intra)
  QG, P, Y, U, KG, decay_chunk = intra(*chunks, same=same, cont=cont, keep=keep)
  dk = q.shape[-1]
  lead = QG.shape[:3]
  ny = jnp.zeros_like(QG) if Y is None else -Y
  gc = (jnp.ones(lead + (dk,), _F32) if decay_chunk is None
        else jnp.broadcast_to(decay_chunk, lead + (dk,)))
  return (ny.astype(_MM), QG.astype(_MM), P.astype(_MM), U.astype(_F32), KG.astype(_MM),
          gc.astype(_F32))


# ------------------------------------------------------------------------- Triton channel kernel


def channel_kernel_applies(q, kt, vt, g, *, c, tuning: GpuTuning, kernels: str) -> bool:
  """Whether `_core` takes the Triton channel-gate intra kernels for this call: asked for (the
  Triton path with its resolved `intra="kernel"`; pallas_gpu with `channel_intra="triton"`, or
  "auto" where the triton extra runs), per-channel gates with an erase key (KDA, GDN-2), sizes
  the kernel takes, outside shard_map (its outputs would lack the varying-axes types)."""
  asked = tuning.intra == "kernel" if kernels == "triton" else tuning.channel_intra != "xla"
  if not asked or kt is None or g is None or g.ndim != 4:
    return False
  if kernels != "triton":   # pallas_gpu borrowing the Triton kernels: say clearly if it cannot
    from lineax_attn.ops import triton_gpu  # pylint: disable=g-import-not-at-top
    if not triton_gpu.available() and tuning.channel_intra == "auto":
      return False
    triton_gpu.require("channel_intra='triton'", "channel_intra='xla'")
  from pallas_kernels.gpu.triton import blocks  # pylint: disable=g-import-not-at-top
  return (blocks.intra_supported("channel-gate", c, q.shape[-1], vt.shape[-1]) is None
          and not vma(q, kt, vt))


def _chunk_gates(g, c):
  """In-chunk cumulative log gates, [B, T, HV, K] -> [B, T, HV, K] float32 (a Triton kernel:
  XLA's cumsum was the largest piece of glue around the channel kernels)."""
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  return channel_intra.chunk_gates(g, chunk=c)


def _chunked_gates(g, c):
  """The same in the chunk-major layout [B, HV, Nc, C, K] of the outputs."""
  return chunked.chunk_cumulative_gates(g.astype(_F32), functools.partial(to_chunks, c=c))[0]


def _channel_kernel_call(q, k, kt, vt, G, segidx, c, span=0.0, erase=None, write=None,
                         q_scale=1.0, solve="fused"):
  """The forward kernel on the chunk-summed gates G (`_chunk_gates`): prepare_chunks' six
  outputs and M (bf16, the backward's residual). span: the bounded-span path's bound
  (`GpuTuning.channel_span`; 0 off); erase, write: gates the kernel applies to kt, vt on chip
  (then k and v); q_scale: q's scale, applied on chip (1: q comes scaled); solve: where NY and
  U are made (`GpuTuning.channel_solve`)."""
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  segments = None if segidx is None else kernel_segments(segidx, c)
  return channel_intra.channel_intra_fwd(q, k, kt, vt, G, segments, chunk=c,
                                         with_inverse=True, span=float(span), erase=erase,
                                         write=write, q_scale=float(q_scale), solve=solve)


def _channel_kernel_bwd_call(q, k, kt, vt, G, segidx, m, d_ny, d_p, d_u, c, span=0.0):
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  segments = None if segidx is None else kernel_segments(segidx, c)
  return channel_intra.channel_intra_bwd(q, k, kt, vt, G, segments, m, d_ny,
                                         d_p, d_u, chunk=c, span=float(span))


def _channel_kernel_grads_call(q, k, kt, vt, G, segidx, m, cts, c, span=0.0):
  """The fused backward kernel: (dq, dk, dkt, dvt, dg) float32 `[B, T, HV, D]`."""
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  segments = None if segidx is None else kernel_segments(segidx, c)
  d_ny, d_qg, d_p, d_u, d_kg, d_gc = cts
  return channel_intra.channel_intra_grads(q, k, kt, vt, G, segments, m, d_ny,
                                           d_qg, d_p, d_u, d_kg, d_gc, chunk=c, span=float(span))


def channel_pair_solve_vjp_reference(q, k, kt, vt, g, segidx, d_ny, d_p, d_u, *, c):
  """The oracle of `channel_intra_bwd` (float32, HIGHEST, exact solve): the cotangents of
  (NY, P, U) = (−M (K̃ ⊙ e^G), pair(Q), M Ṽ), M = (I + pair(K̃))^{-1}, with respect to Q, K̃
  and K through the pairs (G held fixed), the key right-hand side R = K̃ ⊙ e^G and Ṽ; chunk-major
  float32, as the kernel returns them."""
  G = _chunked_gates(g, c)
  same = cont = None
  if segidx is not None:
    same, cont, _ = segment_masks(segidx, c)
  lower = jnp.tril(jnp.ones((c, c), bool))
  strict = jnp.tril(jnp.ones((c, c), bool), k=-1)
  mask = lambda x, m: x * m if same is None else x * m * same

  def parts(Q, Kt, K, R, V):
    with jax.default_matmul_precision("highest"):
      P = mask(chunked._channel_pair(Q, K, G, "highest"), lower)
      L = mask(chunked._channel_pair(Kt, K, G, "highest"), strict)
      eye = jnp.eye(c, dtype=_F32)
      sol = jax.lax.linalg.triangular_solve(eye + L, jnp.concatenate([R, V], -1),
                                            left_side=True, lower=True, unit_diagonal=True)
    return -sol[..., :R.shape[-1]], P, sol[..., R.shape[-1]:]

  entry = jnp.exp(G) if cont is None else jnp.exp(G) * cont[..., None]
  f = lambda x: to_chunks(x.astype(_F32), c)
  primals = (f(q), f(kt), f(k), f(kt) * entry, f(vt))
  _, vjp = jax.vjp(parts, *primals)
  d_q, d_kt, d_k, d_r, d_v = vjp((d_ny.astype(_F32), d_p.astype(_F32), d_u.astype(_F32)))
  return d_q, d_kt, d_k, d_r, d_v


def channel_grads(q, k, kt, vt, g, segidx, pair_grads, cts, *, c):
  """The whole backward of the channel-gate intra part from the kernel's pair/solve cotangents
  (`channel_intra_bwd`'s five) and the outputs' cotangents (d_ny, d_qg, d_p, d_u, d_kg, d_gc):
  the elementwise terms and dG, in XLA. Returns (dq, dk, dkt, dvt, dg) `[B, T, HV, D]`."""
  d_qp, d_ktp, d_kp, d_r, d_vt = pair_grads
  _, d_qg, _, _, d_kg, d_gc = (x.astype(_F32) for x in cts)
  G = _chunked_gates(g, c)
  f = lambda x: to_chunks(x.astype(_F32), c)
  Q, K, Kt = f(q), f(k), f(kt)
  entry, exit_ = jnp.exp(G), jnp.exp(G[..., -1:, :] - G)
  gc = jnp.exp(G[..., -1, :])
  if segidx is not None:
    _, cont, keep = segment_masks(segidx, c)
    entry, exit_ = entry * cont[..., None], exit_ * keep[..., None]
    gc = gc * cont[..., -1:]
  d_exit = exit_ * K * d_kg
  # Pairs depend on G only through A ⊙ e^G and K ⊙ e^{−G}: dG = Q ⊙ dQ + K̃ ⊙ dK̃ − K ⊙ dK there.
  dG = (Q * d_qp + Kt * d_ktp - K * d_kp + entry * (Q * d_qg + Kt * d_r) - d_exit)
  dG = dG.at[..., -1, :].add(jnp.sum(d_exit, axis=-2) + gc * d_gc)
  dg = jnp.flip(jnp.cumsum(jnp.flip(dG, -2), axis=-2), -2)   # G = cumsum(g) within the chunk
  back = lambda x, like: from_chunks(x).astype(like.dtype)
  return (back(d_qp + entry * d_qg, q), back(d_kp + exit_ * d_kg, k),
          back(d_ktp + entry * d_r, kt), back(d_vt, vt), back(dg, g))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def channel_intra_kernel(q, k, kt, vt, g, segidx, c, fused_grads=False, span=0.0,
                         solve="fused"):
  """`prepare_chunks` for per-channel gates with the Triton kernels
  (`pallas_kernels.gpu.triton.channel_intra`): forward, and the backward's pairs and solve,
  the elementwise rest in XLA (`channel_grads`) or, with `fused_grads`
  (`GpuTuning.channel_grads="kernel"`), in the backward kernel itself. span: the kernels'
  bounded-span path (`GpuTuning.channel_span`, 0 off); solve: `GpuTuning.channel_solve`."""
  return _channel_kernel_call(q, k, kt, vt, _chunk_gates(g, c), segidx, c, span,
                              solve=solve)[:6]


def _channel_intra_fwd(q, k, kt, vt, g, segidx, c, fused_grads, span, solve):
  G = _chunk_gates(g, c)   # made once, kept for the backward
  *outs, m = _channel_kernel_call(q, k, kt, vt, G, segidx, c, span, solve=solve)
  return tuple(outs), (q, k, kt, vt, g, G, segidx, m)


def _channel_intra_bwd(c, fused_grads, span, solve, res, cts):
  del solve   # (the forward's)
  q, k, kt, vt, g, G, segidx, m = res
  if fused_grads:
    grads = _channel_kernel_grads_call(q, k, kt, vt, G, segidx, m, cts, c, span)
    return tuple(d.astype(x.dtype) for d, x in zip(grads, (q, k, kt, vt, g))) + (None,)
  d_ny, _, d_p, d_u, _, _ = cts
  pair_grads = _channel_kernel_bwd_call(q, k, kt, vt, G, segidx, m, d_ny, d_p, d_u, c, span)
  return channel_grads(q, k, kt, vt, g, segidx, pair_grads, cts, c=c) + (None,)


channel_intra_kernel.defvjp(_channel_intra_fwd, _channel_intra_bwd)


# ------------------------------------------------------- channel kernels and state pass, one VJP


def _erased_and_written(k, v, erase, write):
  """k̃ = k ⊙ erase and ṽ = v ⊙ write (v where write is None) in float32, as XLA makes them."""
  k32, v32 = k.astype(_F32), v.astype(_F32)
  return k32 * erase, (v32 if write is None else v32 * write)


def _channel_kernel_states_call(q, k, v, erase, write, G, segidx, m, de, do, e, h, second, c,
                                span=0.0, on_chip=True, q_scale=1.0, products="channel"):
  """The fused backward kernel after the state pass's reverse kernel, the gates applied on
  chip (on_chip) or to k̃, ṽ made here (then their chain rule here too): (dq, dk, dv, dg,
  d_erase, d_write), d_write None without a write gate; the gates' gradients have one
  entry per row (`[B, T, HV]`) for `[B, T, HV, 1]` gates. products
  (`GpuTuning.state_products`): who makes the state pass's cotangent products from dE, dO, E and
  the chunk states: "channel" this kernel, "kernel" the Triton products kernel, "xla" XLA;
  "pass": the reverse pass made them. second: `pass_backward`'s second result, dh or (with
  "pass") those products (`gpu_vjps.cotangent_products`).
  The kernel writes the gradients that are whole (dq; dk and dv with the gates on chip) in
  bf16 where q, k, v are bf16: one rounding on chip of what XLA would round after a float32
  round trip through HBM."""
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  segments = None if segidx is None else kernel_segments(segidx, c)
  narrow = lambda x: jnp.bfloat16 if x.dtype == jnp.bfloat16 else _F32
  grad_dtypes = ((narrow(q), narrow(k), narrow(v)) if on_chip else (narrow(q), _F32, _F32))
  grad_dtypes = tuple(jnp.dtype(d).name for d in grad_dtypes)   # (hashable, static)
  # do comes in the op's [B, T, HV, V] layout; the products kernel and the channel kernel's
  # own products read it so, XLA's products take it chunk-major.
  if products == "channel":
    call = functools.partial(channel_intra.channel_intra_grads_from_states, chunk=c,
                             span=float(span), q_scale=float(q_scale), grad_dtypes=grad_dtypes,
                             do_rows=True)
    tail = (de, do, e, h, second)
  else:
    d_ny, d_qg, d_p, d_kg, d_gc = gpu_vjps.cotangent_products(products, de, do, e, h, second,
                                                              o_rows=True)
    call = functools.partial(channel_intra.channel_intra_grads_gated, chunk=c,
                             span=float(span), q_scale=float(q_scale), grad_dtypes=grad_dtypes)
    tail = (d_ny, d_qg, d_p, de, d_kg, d_gc)
  if on_chip:
    dq, dk, _, dv, dg, d_erase, d_write = call(q, k, k, v, G, segments, m, *tail,
                                               erase=erase, write=write)
    return dq, dk, dv, dg, d_erase, d_write
  kt, vt = _erased_and_written(k, v, erase, write)   # remade, not kept from the forward
  dq, dk, dkt, dvt, dg, _, _ = call(q, k, kt, vt, G, segments, m, *tail)
  rows = lambda x, gate: jnp.sum(x, -1) if gate.shape[-1] == 1 else x
  d_erase = rows(dkt * k.astype(_F32), erase)
  d_write = None if write is None else rows(dvt * v.astype(_F32), write)
  return (dq, dk + dkt * erase, dvt if write is None else dvt * write, dg, d_erase, d_write)


def channel_state_core(q, k, v, erase, write, g, s0, segidx, *, c, span, kernels, interpret,
                       gates_on_chip=True, scale=1.0, products="channel",
                       out_dtype=jnp.float32, pieces=1, solve="fused"):
  """KDA / GDN-2's chunk form on the Triton channel kernels and the state pass (`kernels`:
  "mosaic" or "triton") under one custom VJP (`GpuTuning(channel_grads="states")`).

  q, k, v `[B, T, HV, D]` in any float dtype (bf16 is read as it is), T a multiple of c, and
  q's scale (applied on chip); erase `[B, T, HV, 1]` (KDA's β) or
  `[B, T, HV, K]` (GDN-2), write likewise over V or None; the kernels apply them on chip, so
  k̃ = k ⊙ erase and ṽ = v ⊙ write, their float32 copies in HBM and their gradients' epilogue
  in XLA do not exist. The backward runs the state pass's reverse kernel, then one channel
  kernel that also makes the state pass's cotangent products (dNY, dQG, dP, dKG, dgc) from the
  chunk states, E, dE and dO on chip, where the split composition has XLA make them (four
  batched products, a reduction and two float32 -> bf16 copies). gates_on_chip=False
  (`GpuTuning.channel_gates="xla"`, for A/B) makes k̃, ṽ and the gates' chain rule in XLA
  instead, inside the same VJP. products (`GpuTuning.state_products`): "channel" (the channel
  backward kernel makes the products, as above), "kernel" (the Triton products kernel, then
  the channel kernel fed them), "xla" (XLA's products) or "pass" (the Mosaic reverse pass, where
  one CTA holds all of V: `state_passing_bwd(products=...)`). Returns (o, e, s_final) in
  out_dtype (`gpu_vjps.state_pass_out_dtype`): o in the inputs' `[B, T, HV, V]` layout,
  written so by the Mosaic pass, whose reverse (and the products kernel) read dO so too (no
  relayout of o or dO by XLA: ~70 µs of KDA's fwd+bwd at B4 T4096 H16 D128 on an H100), e
  chunk-major. pieces > 1 (the Mosaic pass, T
  a multiple of c·pieces): the state pass cuts every row into that many pieces, as
  `gpu_vjps.state_pass` does (`gpu_pieces`). solve: where the forward kernel makes NY and U
  (`GpuTuning.channel_solve`). Not under shard_map (as the channel kernels)."""
  kernel_module(kernels, "state")  # validates `kernels`
  if pieces > 1 and (kernels != "mosaic" or (q.shape[1] // c) % pieces):
    raise ValueError(f"channel_state_core: pieces={pieces} needs the Mosaic state pass and a "
                     f"chunk count it divides (kernels={kernels!r}, T={q.shape[1]}).")
  return _channel_state_vjp(q, k, v, erase, write, g, s0, segidx, c, float(span), kernels,
                            interpret, bool(gates_on_chip), float(scale), products,
                            jnp.dtype(out_dtype), int(pieces), solve)


# write None: a pytree without leaves, whose cotangent is None.
@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12, 13, 14, 15, 16, 17))
def _channel_state_vjp(q, k, v, erase, write, g, s0, segidx, c, span, kernels, interpret,
                       on_chip, scale, products, out_dtype, pieces, solve):
  return _channel_state_fwd(q, k, v, erase, write, g, s0, segidx, c, span, kernels,
                            interpret, on_chip, scale, products, out_dtype, pieces, solve)[0]


def _channel_state_fwd(q, k, v, erase, write, g, s0, segidx, c, span, kernels, interpret,
                       on_chip, scale, products, out_dtype, pieces, solve):
  del products   # (the backward's)
  q, k, v, erase, write, g, s0, segidx = primal_values(q, k, v, erase, write, g, s0, segidx)
  G = _chunk_gates(g, c)
  if on_chip:
    outs = _channel_kernel_call(q, k, k, v, G, segidx, c, span, erase, write, scale, solve)
  else:
    kt, vt = _erased_and_written(k, v, erase, write)
    outs = _channel_kernel_call(q, k, kt, vt, G, segidx, c, span, q_scale=scale, solve=solve)
  ny, qg, p, u, kg, gc, m = outs
  (o, e, s_final, h), phi = gpu_vjps.pass_forward(ny, qg, p, u, kg, gc, s0, interpret, kernels,
                                                  pieces, save_states=True, out_dtype=out_dtype,
                                                  o_rows=True)
  return (o, e, s_final), (q, k, v, erase, write, g, G, segidx, m, ny, qg, p, kg, gc, e, h, phi)


def _channel_state_bwd(c, span, kernels, interpret, on_chip, scale, products, out_dtype, pieces,
                       solve, res, cts):
  del out_dtype, solve   # (the forward's; the reverse pass and the products read o, e as bf16)
  q, k, v, erase, write, g, G, segidx, m, ny, qg, p, kg, gc, e, h, phi = res
  do, de_ext, ds_final = given_cotangents(cts)   # None: an output the caller did not use
  b, hv, nc, _, dv = e.shape
  do = jnp.zeros((b, nc * c, hv, dv), _MM) if do is None else do.astype(_MM)   # o's layout
  # dE in bf16: every reader below (the products, the channel kernel's Mᵀ dE) takes it as a
  # bf16 operand, so the float32 copy was bytes written and read for one rounding.
  # second: dh, or the reverse pass's own products (state_products "pass")
  de, second, ds0 = gpu_vjps.pass_backward(ny, qg, p, kg, gc, h, phi, do, de_ext, ds_final,
                                           interpret=interpret, kernels=kernels, pieces=pieces,
                                           de_dtype=_MM, o_rows=True,
                                           e=e if products == "pass" else None)
  dq, dk, dv, dg, d_erase, d_write = _channel_kernel_states_call(
      q, k, v, erase, write, G, segidx, m, de, do, e, h, second, c, span, on_chip, scale,
      products=products)
  back = lambda d, x: None if x is None else d.reshape(x.shape).astype(x.dtype)
  return (back(dq, q), back(dk, k), back(dv, v), back(d_erase, erase), back(d_write, write),
          back(dg, g), ds0, None)


_channel_state_vjp.defvjp(_channel_state_fwd, _channel_state_bwd, symbolic_zeros=True)
