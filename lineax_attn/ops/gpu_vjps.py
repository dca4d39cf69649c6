"""The custom VJPs that wrap the `pallas_gpu` kernels, and their XLA glue.

* `state_pass`: the state-passing kernels, forward and a reverse kernel for the state
  cotangent, either Mosaic GPU (`pallas_kernels.gpu.state_passing`, Hopper) or Triton
  (`pallas_kernels.gpu.triton.state_pass`, sm_80+; `kernels="triton"`), same contract; the
  other gradients are batched matmuls here. With `pieces` (Mosaic only) every row's chunks are
  passed as that many pieces at once (`gpu_pieces`).
* `intra_kernel`: the intra-chunk kernels of DeltaNet / GDN (`pallas_kernels.gpu.intra_chunk`,
  or its Triton twin `pallas_kernels.gpu.triton.intra_chunk` with `kernels="triton"`); QG/KG
  cotangents, Gx's chain rule and GVA's head sum in XLA.
* `channel_pairs_kernel`: KDA / GDN-2's pair matrices P, L (`pallas_kernels.gpu.channel_pair`),
  backward by its kernel or by `chunked`'s XLA VJP.

Kernel outputs carry no varying-axes types: `vma` / `vary` type them under `jax.shard_map`.
`interpret_params` picks compiled kernels on a GPU backend, the interpreter elsewhere.
"""

from __future__ import annotations

import functools

import jax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
import jax.numpy as jnp

from lineax_attn.ops import chunked
from lineax_attn.ops import gpu_pieces
from lineax_attn.ops.gpu_chunks import from_chunks, kernel_segments, to_chunks
from pallas_kernels.gpu import channel_pair as cp
from pallas_kernels.gpu import intra_chunk as ic
from pallas_kernels.gpu import state_passing as sp

_F32 = jnp.float32
_MM = sp.MM_DTYPE


def interpret_params():
  """None (compile for the GPU) on a GPU backend, else the CPU interpreter."""
  if jax.default_backend() == "gpu":
    return None
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu.InterpretGPUParams()


def vma(*xs) -> frozenset:
  """The manual mesh axes these values vary over (inside `jax.shard_map`; empty outside)."""
  out = frozenset()
  for x in xs:
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)     # jax 0.11: ManualAxisType(varying=...)
    out |= mat.varying if mat is not None else getattr(aval, "vma", frozenset())
  return out


def vary(x, axes: frozenset):
  """x typed as varying over `axes` (Pallas kernel outputs carry no varying-axes type)."""
  missing = tuple(sorted(axes - vma(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


# ----------------------------------------------------------------------------- state pass


def kernel_module(kernels, part):
  """The module of `part` ("state": `state_passing_fwd/bwd`; "intra": `intra_chunk_fwd/bwd`,
  `supported`) for `kernels` ("mosaic" or "triton": the same contract, the Triton modules
  imported lazily since they need the optional extra)."""
  if kernels == "mosaic":
    return sp if part == "state" else ic
  if kernels == "triton":
    if part == "state":
      from pallas_kernels.gpu.triton import state_pass as tsp  # pylint: disable=g-import-not-at-top
      return tsp
    from pallas_kernels.gpu.triton import intra_chunk as tic  # pylint: disable=g-import-not-at-top
    return tic
  raise ValueError(f"`kernels` must be 'mosaic' or 'triton', got {kernels!r}.")


def interpret_kw(kernels, interpret):
  """The Mosaic kernels take `interpret=`; the Triton ones run compiled only (jax-triton has no
  CPU lowering)."""
  return {} if kernels == "triton" else {"interpret": interpret}


def state_pass(ny, qg, p, u, kg, gc, s0, interpret, kernels="mosaic", products="xla",
               pieces=1, out_dtype=jnp.float32):
  """(o, e, s_final) of the state pass on chunk-major inputs (`state_passing_fwd`'s), under
  one custom VJP. pieces > 1 (the Mosaic kernels, outside shard_map): every row's chunks are
  cut into that many pieces passed at once (`gpu_pieces`), the chunks padded to a multiple of
  it with identity chunks (no decay, no write, zero output). out_dtype: o's and e's
  (`state_pass_out_dtype`)."""
  if pieces > 1:
    if kernels != "mosaic" or vma(ny, qg, p, u, kg, gc, s0):
      raise ValueError("state_pass: pieces > 1 needs the Mosaic state-pass kernels outside "
                       f"shard_map (kernels={kernels!r}).")
    nc = u.shape[2]
    extra = -nc % pieces
    if extra:
      pad = lambda x, value=0.0: jnp.pad(x, [(0, 0), (0, 0), (0, extra)] +
                                         [(0, 0)] * (x.ndim - 3), constant_values=value)
      ny, qg, p, u, kg, gc = pad(ny), pad(qg), pad(p), pad(u), pad(kg), pad(gc, 1.0)
    o, e, s_final = _state_pass_vjp(ny, qg, p, u, kg, gc, s0, interpret, (), kernels, products,
                                    pieces, jnp.dtype(out_dtype))
    return o[:, :, :nc], e[:, :, :nc], s_final
  # Under shard_map(check_vma=True) (context parallelism, lineax_attn.parallel) every input,
  # output and cotangent must carry the varying axes its values have; the kernels' outputs carry
  # none. So the inputs are all cast to the union here, and inside the custom VJP (where no
  # transpose of the cast is ever taken: a cast outside it would transpose to a psum and sum
  # per-device cotangents) the kernels' outputs and the cotangents are typed with that union.
  axes = vma(ny, qg, p, u, kg, gc, s0)
  args = [vary(x, axes) for x in (ny, qg, p, u, kg, gc, s0)]
  kernel_module(kernels, "state")  # validates `kernels`
  # products: who makes the backward's products (`GpuTuning.state_products`).
  return _state_pass_vjp(*args, interpret, tuple(sorted(axes)), kernels, products, 1,
                         jnp.dtype(out_dtype))


def state_pass_out_dtype(dtype):
  """The dtype the state pass writes o and e in for a call whose values v have `dtype`:
  bfloat16 for bf16 calls (the op returns them in bf16 anyway, and the backward's products
  read e as a bf16 operand: the same values at half the bytes), float32 otherwise."""
  return jnp.dtype(jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float32)


def primal_values(*xs):
  """The arguments of a `symbolic_zeros=True` custom VJP's forward rule, unwrapped (that rule
  gets its differentiable arguments as `CustomVJPPrimal`s)."""
  return tuple(x.value if isinstance(x, CustomVJPPrimal) else x for x in xs)


def given_cotangents(cts):
  """A `symbolic_zeros=True` backward rule's cotangents, None for each output the caller did
  not use (a `SymbolicZero`), so that no array of zeros is made for it."""
  return tuple(None if isinstance(x, SymbolicZero) else x for x in cts)


# `axes` is static: the backward is traced without the primal's varying-axes types.
# symbolic_zeros: E (the write residual) is rarely an output anyone reads; its cotangent then
# reaches the reverse pass as None, which reads nothing in its place (no [B, T, HV, V] float32
# zeros made and streamed: KDA fwd+bwd 4.050 -> 3.943 ms at B4 T4096 H16 D128 on the H200).
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12))
def _state_pass_vjp(ny, qg, p, u, kg, gc, s0, interpret, axes, kernels, products, pieces,
                    out_dtype):
  del products
  axes = frozenset(axes)
  outs, _ = pass_forward(ny, qg, p, u, kg, gc, s0, interpret, kernels, pieces,
                          save_states=False, out_dtype=out_dtype)
  return tuple(vary(x, axes) for x in outs)


def pass_forward(ny, qg, p, u, kg, gc, s0, interpret, kernels, pieces, *, save_states,
                 out_dtype, o_rows=False):
  """(outputs, Φ): the state pass's (o, e, s_final[, h]) and, with pieces, every piece's
  state map Φ `[P, B, HV, K, K]` (None otherwise). o_rows: o in `[B, T, HV, V]` (the Mosaic
  pass writes it so; the Triton pass's chunk-major o is relaid out here)."""
  fwd = functools.partial(kernel_module(kernels, "state").state_passing_fwd,
                          **interpret_kw(kernels, interpret))
  if o_rows and kernels == "mosaic":
    fwd = functools.partial(fwd, o_rows=True)
  elif o_rows:
    outs, phi = pass_forward(ny, qg, p, u, kg, gc, s0, interpret, kernels, pieces,
                             save_states=save_states, out_dtype=out_dtype)
    return (from_chunks(outs[0]), *outs[1:]), phi
  if pieces == 1:
    return fwd(ny, qg, p, u, kg, gc, s0, save_states=save_states, out_dtype=out_dtype), None
  (b, hv), dk, dv = u.shape[:2], ny.shape[-1], u.shape[-1]
  # The maps [Φ | Ψ]: every piece from [I | 0], its first K columns walking with U = 0.
  (maps,) = fwd(ny, qg, p, u, kg, gc, gpu_pieces.map_start(b * pieces, hv, dk, dv),
                states_only=True, pieces=pieces)
  maps = gpu_pieces.by_piece(maps, b)                            # [P, B, HV, K, K + V]
  phi = maps[..., :dk]
  starts = gpu_pieces.entry_states(phi, maps[..., dk:], s0)
  o, e, s_ends, *h = fwd(ny, qg, p, u, kg, gc, gpu_pieces.from_pieces(starts),
                         save_states=save_states, pieces=pieces, out_dtype=out_dtype)
  return (o, e, gpu_pieces.by_piece(s_ends, b)[-1], *h), phi


def _state_pass_fwd(ny, qg, p, u, kg, gc, s0, interpret, axes, kernels, products, pieces,
                    out_dtype):
  del products
  ny, qg, p, u, kg, gc, s0 = primal_values(ny, qg, p, u, kg, gc, s0)
  axes = frozenset(axes)
  outs, phi = pass_forward(ny, qg, p, u, kg, gc, s0, interpret, kernels, pieces,
                            save_states=True, out_dtype=out_dtype)
  o, e, s_final, h = (vary(x, axes) for x in outs)
  return (o, e, s_final), (ny, qg, p, kg, gc, h, e, phi)


def products_kernel(de, do, e, h, dh, o_rows=False):
  """`state_pass_products` by the Triton kernel (`GpuTuning.state_products="kernel"`); o_rows:
  do in `[B, T, HV, V]`, read so by the kernel."""
  from pallas_kernels.gpu.triton import state_pass as tsp  # pylint: disable=g-import-not-at-top
  return tsp.state_pass_products(de, do, e, h, dh, o_rows=o_rows)


def _triton_blocks():
  from pallas_kernels.gpu.triton import blocks  # pylint: disable=g-import-not-at-top
  return blocks


def _mm(spec, a, b):
  """Batched matmul with bf16 operands and float32 accumulation (docs/MATH.md §3.7)."""
  return jnp.einsum(spec, a.astype(_MM), b.astype(_MM), preferred_element_type=_F32)


def state_pass_products(de, do, e, h, dh):
  """The state pass's cotangents that are batched products (chunk-major arrays): of NY, QG, P,
  KG and the carry decay gc, from dE, dO, E, the state entering each chunk (h) and the
  cotangent of the state leaving it (dh)."""
  d_ny = _mm("...cv,...kv->...ck", de, h)           # E = U + NY·S
  d_qg = _mm("...cv,...kv->...ck", do, h)           # O = QG·S + P·E
  d_p = _mm("...iv,...jv->...ij", do, e)
  d_kg = _mm("...cv,...kv->...ck", e, dh)           # S' = gc⊙S + KGᵀ·E
  d_gc = jnp.sum(dh.astype(_F32) * h.astype(_F32), axis=-1)
  return d_ny, d_qg, d_p, d_kg, d_gc


def cotangent_products(products, de, do, e, h, second, *, o_rows=False):
  """(dNY, dQG, dP, dKG, dgc) as `GpuTuning.state_products` asks ("pass", "kernel", else
  XLA's) after `pass_backward`, whose second result `second` is then the pass's own products
  ("pass") or dh. o_rows: do in `[B, T, HV, V]`, which the products kernel reads as it is."""
  if products == "pass":
    return second
  c, (dk, dv) = e.shape[-2], h.shape[-2:]
  if products == "kernel" and _triton_blocks().supported(c, dk, dv) is None:
    return products_kernel(de, do.astype(_MM), e, h, second, o_rows=o_rows)
  # (sizes the Triton kernels do not take: XLA's products, on chunk-major dO)
  return state_pass_products(de, to_chunks(do, c) if o_rows else do, e, h, second)


def _products_grouped(call):
  """A reverse pass that makes the products, returning (dE, (dNY, dQG, dP, dKG, dgc), ds0)
  where the plain pass returns (dE, dh, ds0)."""
  def grouped(*args, **kwargs):
    de, *products, ds0 = call(*args, **kwargs)
    return de, tuple(products), ds0
  return grouped


def pass_backward(ny, qg, p, kg, gc, h, phi, do, de_ext, ds_final, *, interpret, kernels,
                  pieces, de_dtype=_F32, o_rows=False, e=None):
  """The reverse state pass: (dE, dh, ds0) from the cotangents of o, e and the final state
  (do an array, zeros where o is unused, as the products need it too; de_ext and ds_final None
  where unused), h the saved chunk states and phi `pass_forward`'s maps (pieces > 1). dE in
  de_dtype (bf16 only for callers that read it as a bf16 operand alone). o_rows: do in
  `[B, T, HV, V]` (the Mosaic pass reads it so; for the Triton pass it is relaid out here).
  e: the forward's E, given where the Mosaic pass makes the products itself
  (`GpuTuning.state_products="pass"`): then (dE, (dNY, dQG, dP, dKG, dgc), ds0)."""
  extra = {}
  if o_rows and kernels == "mosaic":
    extra = dict(o_rows=True)
  elif o_rows:
    do = to_chunks(do, ny.shape[-2])
  bwd = functools.partial(kernel_module(kernels, "state").state_passing_bwd, ny, qg, p, kg, gc,
                          do.astype(_MM), None if de_ext is None else de_ext.astype(_F32),
                          **interpret_kw(kernels, interpret), **extra)
  bwd_de = functools.partial(bwd, de_dtype=de_dtype)
  if e is not None:
    bwd_de = _products_grouped(functools.partial(bwd_de, products=(e, h)))
  if pieces == 1:
    ds_final = jnp.zeros(h.shape[:2] + h.shape[3:], _F32) if ds_final is None else ds_final
    return bwd_de(ds_final.astype(_F32))
  # every piece's own entry cotangent, carried back to every piece's end (gpu_pieces)
  b = h.shape[0]
  (local,) = bwd(jnp.zeros((b * pieces,) + h.shape[1:2] + h.shape[3:], _F32),
                 states_only=True, pieces=pieces)
  ends = gpu_pieces.exit_cotangents(phi, gpu_pieces.by_piece(local, b), ds_final)
  de, dh, ds0 = bwd_de(gpu_pieces.from_pieces(ends), pieces=pieces)
  return de, dh, gpu_pieces.by_piece(ds0, b)[0]


def _state_pass_bwd(interpret, axes, kernels, products, pieces, out_dtype, res, cts):
  del out_dtype   # (o's and e's cotangents arrive in it; the reverse pass reads dO as bf16)
  ny, qg, p, kg, gc, h, e, phi = res
  do, de_ext, ds_final = given_cotangents(cts)
  do = jnp.zeros(e.shape, _MM) if do is None else do
  de, second, ds0 = pass_backward(ny, qg, p, kg, gc, h, phi, do, de_ext, ds_final,
                                  interpret=interpret, kernels=kernels, pieces=pieces,
                                  e=e if products == "pass" else None)
  d_ny, d_qg, d_p, d_kg, d_gc = cotangent_products(products, de, do, e, h, second)
  axes = frozenset(axes)
  cts = (d_ny.astype(ny.dtype), d_qg.astype(qg.dtype), d_p.astype(p.dtype), de,
         d_kg.astype(kg.dtype), d_gc, ds0)
  return tuple(vary(ct, axes) for ct in cts)


_state_pass_vjp.defvjp(_state_pass_fwd, _state_pass_bwd, symbolic_zeros=True)


# ----------------------------------------------------------------------------- intra-chunk kernel


def _kernel_inputs(q, k, v, beta, G, segidx, c):
  """The intra-chunk kernels' shared inputs: bf16 q, k, v, the [B, HV, T] rows β, G and
  Gx = G_C − G, and the segment rows (or None). G None: ungated, G = Gx = 0."""
  b, t, hv = v.shape[:3]
  flat = lambda x: x.reshape(b, hv, t)
  if G is None:
    G = jnp.zeros((b, hv, t // c, c), _F32)
  segments = None if segidx is None else kernel_segments(segidx, c)
  return (q.astype(_MM), k.astype(_MM), v.astype(_MM), jnp.moveaxis(beta.astype(_F32), 1, 2),
          flat(G), flat(G[..., -1:] - G), segments)


def _call_intra_fwd(q, k, v, beta, G, segidx, scale, c, interpret, with_inverse, kernels):
  return kernel_module(kernels, "intra").intra_chunk_fwd(
      *_kernel_inputs(q, k, v, beta, G, segidx, c), scale=scale, with_inverse=with_inverse,
      **interpret_kw(kernels, interpret))


def intra_kernel(q, k, v, beta, G, segidx, scale, c, interpret, kernels="mosaic",
                 fused_grads=False, gated=True):
  """The intra-chunk kernels of DeltaNet / GDN (`kernels`: "mosaic" or "triton") as one
  differentiable function of q, k, v, β `[B, T, HV]` and the chunk gates G; returns the state
  pass's (ny, qg, p, u, kg). fused_grads (Triton only, `GpuTuning.intra_grads="kernel"`): the
  backward kernel also finishes the QG / KG terms and dG and writes the gradients in the
  inputs' layout, where there is no GVA (H = HV); else those are XLA's, below.
  gated=False (DeltaNet): G must be None (the kernels get zeros); nothing is differentiated
  with respect to a gate, so no part of dG is made (the Triton backward kernel skips it, the
  Mosaic one's row sums are dropped). Timed for DeltaNet on an H100 (2026-12-07): the fused
  kernel's op 2.076 ms against 2.093 with intra_grads="xla" (docs/BENCHMARKS.md "forty-seventh
  stage"), so "auto" fuses for it as for GDN."""
  kernel_module(kernels, "intra")  # validates `kernels`
  if gated == (G is None):
    raise ValueError(f"intra_kernel: G must be None exactly when gated=False, got "
                     f"gated={gated!r}, G={'None' if G is None else 'an array'}")
  fused = bool(fused_grads) and kernels == "triton" and q.shape[2] == v.shape[2]
  return _intra_kernel_vjp(q, k, v, beta, G, segidx, scale, c, interpret, kernels, fused,
                           bool(gated))


# G is None when ungated: a pytree without leaves, so its cotangent is None (no gradient
# claimed for a gate that is not there).
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _intra_kernel_vjp(q, k, v, beta, G, segidx, scale, c, interpret, kernels, fused, gated):
  del gated
  return _call_intra_fwd(q, k, v, beta, G, segidx, scale, c, interpret, False, kernels)


def _intra_kernel_fwd(q, k, v, beta, G, segidx, scale, c, interpret, kernels, fused, gated):
  del gated
  # The backward takes the forward's bf16 inverse (8 KiB per chunk) instead of inverting again.
  *out, m = _call_intra_fwd(q, k, v, beta, G, segidx, scale, c, interpret, True, kernels)
  return tuple(out), (q, k, v, beta, G, segidx, m)


def _intra_kernel_bwd(scale, c, interpret, kernels, fused, gated, res, cts):
  """The kernel's backward (`intra_chunk_bwd`) plus the elementwise QG / KG terms and the
  chain rule of Gx = G_C − G, the entry factor and GVA's sum over value heads, in XLA; or, with
  `fused`, all of it in the Triton kernel. Ungated, no dG (G's cotangent is None)."""
  q, k, v, beta, G, segidx, m = res
  d_ny, d_qg, d_p, d_u, d_kg = cts
  b, t, hv = v.shape[:3]
  h, n_rep = q.shape[2], hv // q.shape[2]
  inputs = _kernel_inputs(q, k, v, beta, G, segidx, c)
  segments = inputs[-1]
  # The Mosaic kernel has no ungated variant: it makes dG's row sums, dropped below.
  gated_kw = {} if kernels == "mosaic" else {"gated": gated}
  if fused:
    dq, dk, dv, dbeta, dG = kernel_module(kernels, "intra").intra_chunk_bwd(
        *inputs, m, d_ny.astype(_MM), d_p.astype(_MM), d_u.astype(_MM),
        (d_qg.astype(_MM), d_kg.astype(_MM)), scale=scale, **gated_kw)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            jnp.moveaxis(dbeta, 1, 2).astype(beta.dtype),
            dG.reshape(G.shape).astype(G.dtype) if gated else None, None)
  dq, dk, dv, dbeta, dg_row, dg_col = kernel_module(kernels, "intra").intra_chunk_bwd(
      *inputs, m, d_ny.astype(_MM), d_p.astype(_MM), d_u.astype(_MM), scale=scale,
      **gated_kw, **interpret_kw(kernels, interpret))
  if gated:
    entry, exit_ = jnp.exp(G), jnp.exp(G[..., -1:] - G)     # [B, HV, Nc, C]
  else:
    entry = exit_ = jnp.ones((b, hv, t // c, c), _F32)
  if segments is not None:
    cont, keep = (x.reshape(b, 1, t // c, c) for x in segments[1:])
    entry, exit_ = entry * cont, exit_ * keep
  chunks = lambda x: to_chunks(jnp.repeat(x.astype(_F32), n_rep, axis=2), c)
  qc, kc = chunks(q), chunks(k)
  d_qg, d_kg = d_qg.astype(_F32), d_kg.astype(_F32)
  dq = dq + scale * entry[..., None] * d_qg
  dk = dk + exit_[..., None] * d_kg
  heads = lambda x: from_chunks(x).reshape(b, t, h, n_rep, -1).sum(axis=3)
  grads = (heads(dq).astype(q.dtype), heads(dk).astype(k.dtype),
           from_chunks(dv).astype(v.dtype), jnp.moveaxis(dbeta, 1, 2).astype(beta.dtype))
  if not gated:
    return (*grads, None, None)
  d_exit = exit_ * jnp.sum(d_kg * kc, axis=-1)              # dL/dGx
  dG = (dg_row - dg_col).reshape(G.shape) + scale * entry * jnp.sum(d_qg * qc, axis=-1) - d_exit
  dG = dG.at[..., -1].add(jnp.sum(d_exit, axis=-1))         # Gx = G_C − G
  return (*grads, dG.astype(G.dtype), None)


_intra_kernel_vjp.defvjp(_intra_kernel_fwd, _intra_kernel_bwd)


def intra_kernel_backward(res, cts, *, scale, c, interpret, kernels, fused):
  """The intra-chunk kernels' backward outside their custom VJP, for a composition that made
  the state pass's inputs another way (`pallas_gpu`'s fused forward): res = (q, k, v, β, G,
  segidx, M bf16), cts = the cotangents of (NY, QG, P, U, KG); returns (dq, dk, dv, dβ, dG),
  dG None when G is."""
  q, _, _, _, G = res[:5]
  del q
  return _intra_kernel_bwd(scale, c, interpret, kernels, fused, G is not None, res, cts)[:5]


# ----------------------------------------------------------------------------- channel pairs


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def channel_pairs_kernel(q, k, kt, g, interpret, bwd_kernel, diag=cp.DIAG):
  """(P, L) of `chunked._pair_matrices_channel` by the Pallas forward kernel; q, k, kt, g
  [..., C, K]. The backward is the Pallas backward kernel (bwd_kernel) or the XLA VJP of
  `chunked._channel_pair`, once per matrix; diag: the kernels' diagonal-block method."""
  lead, (c, d) = q.shape[:-2], q.shape[-2:]
  flat = lambda x: x.reshape(-1, c, d)
  p, l = cp.channel_pairs_fwd(flat(q), flat(kt), flat(k), flat(g), interpret=interpret,
                              diag=diag)
  return p.reshape(*lead, c, c), l.reshape(*lead, c, c)


def _channel_pairs_kernel_fwd(q, k, kt, g, interpret, bwd_kernel, diag):
  return channel_pairs_kernel(q, k, kt, g, interpret, bwd_kernel, diag), (q, k, kt, g)


def _channel_pairs_kernel_bwd(interpret, bwd_kernel, diag, res, cts):
  q, k, kt, g = res
  back = lambda x, like: x.reshape(like.shape).astype(like.dtype)
  if not bwd_kernel:
    dq, dk_p, dg_p = chunked._channel_pair_bwd("bf16", (q, k, g), cts[0])
    dkt, dk_l, dg_l = chunked._channel_pair_bwd("bf16", (kt, k, g), cts[1])
    return back(dq, q), back(dk_p + dk_l, k), back(dkt, kt), back(dg_p + dg_l, g)
  c, d = q.shape[-2:]
  flat = lambda x: x.reshape(-1, c, d)
  dp, dl = (x.reshape(-1, c, c) for x in cts)
  dq, dkt, dk, dg = cp.channel_pairs_bwd(flat(q), flat(kt), flat(k), flat(g), dp, dl,
                                         interpret=interpret, diag=diag)
  return back(dq, q), back(dk, k), back(dkt, kt), back(dg, g)


channel_pairs_kernel.defvjp(_channel_pairs_kernel_fwd, _channel_pairs_kernel_bwd)
