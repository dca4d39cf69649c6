"""The `pallas_gpu` implementation: Mosaic GPU kernels (Hopper) for the chunk form, with XLA glue.

Split of the chunk form (docs/MATH.md §3.2); docs/KERNELS_GPU.md has the call path and the kernels'
resources:

* **Intra-chunk, DeltaNet and GDN (Mosaic GPU, the default `GpuTuning(intra="kernel")`):**
  `pallas_kernels.gpu.intra_chunk`, forward and backward kernels, one CTA per chunk; the
  forward's bf16 inverse is the backward's residual; QG/KG cotangents, Gx's chain rule and GVA's
  head sum stay in XLA (`_intra_kernel_bwd`).
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

Handled: all five linear mixers, initial_state / final_state, GVA, segment_ids, T not a multiple
of the chunk, return_residual. Needs chunk_size 64, K = 64 or 128, V a multiple of 64, and
B·T·HV < 2^31 rows (TMA coordinates are 32-bit per dimension; docs/KERNELS_GPU.md, "Indexing
past 2^31 elements"). Anything else (other sizes, `cu_seqlens` varlen, a GPU that is not Hopper)
falls back to the `chunk` implementation with one log line per reason; never silently wrong.

Tuning (which intra-chunk path, which solve, remat of the XLA part) is a frozen `GpuTuning`
passed to the ops as `tuning=` (None = `DEFAULT_TUNING`); it is a static value read at trace
time, so every distinct tuning is its own trace under `jax.jit`.

Off GPU the kernels run in JAX's Mosaic GPU interpreter (slow; for tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lineax_attn.ops import api
from lineax_attn.ops import chunked
from lineax_attn.ops import specs
from pallas_kernels.gpu import channel_pair as cp
from pallas_kernels.gpu import intra_chunk as ic
from pallas_kernels.gpu import state_passing as sp

# The fallback reasons `api` has logged for pallas_gpu (clear it to log them again).
_warned: set[str] = api.fallback_logged("pallas_gpu")
_F32 = jnp.float32
_MM = sp.MM_DTYPE
INTRA_CHOICES = ("kernel", "xla")
PAIR_CHOICES = ("xla", "kernel_fwd", "kernel")
SOLVE_CHOICES = ("inverse", "trsm")


@dataclasses.dataclass(frozen=True)
class GpuTuning:
  """Static tuning of the `pallas_gpu` implementation: pass as `tuning=` to the ops.

  Frozen and hashable, read at trace time: under `jax.jit` each distinct value is part of the
  traced program, so a function jitted with one tuning is retraced, never silently reused, when
  called with another (make it a static argument, or close over it).

  Attributes:
    intra: who computes the intra-chunk part of DeltaNet / GDN: "kernel"
      (`pallas_kernels.gpu.intra_chunk`, forward and backward Mosaic GPU kernels: GDN fwd+bwd
      2.5 ms vs 4.6 ms at B4 T4096 H16 D128 on an H200, docs/BENCHMARKS.md run 5) or "xla" (the
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
    remat_intra: whether the backward recomputes the XLA intra-chunk part (`jax.checkpoint`:
      less memory) or keeps its residuals (the C×C products and the inverse per chunk: a faster
      backward).
  """

  intra: str = "kernel"
  solve: str = "inverse"
  channel_pair: str = "xla"
  remat_intra: bool = True

  def __post_init__(self):
    for name, allowed in (("intra", INTRA_CHOICES), ("solve", SOLVE_CHOICES),
                          ("channel_pair", PAIR_CHOICES)):
      value = getattr(self, name)
      if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"GpuTuning.{name} must be one of {allowed}, got {value!r}.")
    if not isinstance(self.remat_intra, bool):
      raise ValueError(f"GpuTuning.remat_intra must be a bool, got {self.remat_intra!r}.")


DEFAULT_TUNING = GpuTuning()


def check_tuning(tuning) -> GpuTuning:
  """`tuning` as a GpuTuning: None gives `DEFAULT_TUNING`; anything else is a ValueError."""
  if tuning is None:
    return DEFAULT_TUNING
  if not isinstance(tuning, GpuTuning):
    raise ValueError(f"`tuning` for implementation='pallas_gpu' must be a "
                     f"pallas_gpu.GpuTuning or None, got {tuning!r}.")
  return tuning


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


def _interpret_params():
  """None (compile for the GPU) on a GPU backend, else the CPU interpreter."""
  if jax.default_backend() == "gpu":
    return None
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu.InterpretGPUParams()


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


# ----------------------------------------------------------------------------- state pass


def _vma(*xs) -> frozenset:
  """The manual mesh axes these values vary over (inside `jax.shard_map`; empty outside)."""
  out = frozenset()
  for x in xs:
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)     # jax 0.11: ManualAxisType(varying=...)
    out |= mat.varying if mat is not None else getattr(aval, "vma", frozenset())
  return out


def _vary(x, axes: frozenset):
  """x typed as varying over `axes` (Pallas kernel outputs carry no varying-axes type)."""
  missing = tuple(sorted(axes - _vma(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _state_pass(ny, qg, p, u, kg, gc, s0, interpret):
  # Under shard_map(check_vma=True) (context parallelism, lineax_attn.parallel) every input,
  # output and cotangent must carry the varying axes its values have; the kernels' outputs carry
  # none. So the inputs are all cast to the union here, and inside the custom VJP (where no
  # transpose of the cast is ever taken: a cast outside it would transpose to a psum and sum
  # per-device cotangents) the kernels' outputs and the cotangents are typed with that union.
  axes = _vma(ny, qg, p, u, kg, gc, s0)
  args = [_vary(x, axes) for x in (ny, qg, p, u, kg, gc, s0)]
  return _state_pass_vjp(*args, interpret, tuple(sorted(axes)))


# `axes` is static: the backward is traced without the primal's varying-axes types.
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _state_pass_vjp(ny, qg, p, u, kg, gc, s0, interpret, axes):
  axes = frozenset(axes)
  outs = sp.state_passing_fwd(ny, qg, p, u, kg, gc, s0, interpret=interpret)
  return tuple(_vary(x, axes) for x in outs)


def _state_pass_fwd(ny, qg, p, u, kg, gc, s0, interpret, axes):
  axes = frozenset(axes)
  outs = sp.state_passing_fwd(ny, qg, p, u, kg, gc, s0, save_states=True, interpret=interpret)
  o, e, s_final, h = (_vary(x, axes) for x in outs)
  return (o, e, s_final), (ny, qg, p, kg, gc, h, e)


def _mm(spec, a, b):
  """Batched matmul with bf16 operands and float32 accumulation (docs/MATH.md §3.7)."""
  return jnp.einsum(spec, a.astype(_MM), b.astype(_MM), preferred_element_type=_F32)


def _state_pass_bwd(interpret, axes, res, cts):
  ny, qg, p, kg, gc, h, e = res
  do, de_ext, ds_final = cts
  de, dh, ds0 = sp.state_passing_bwd(ny, qg, p, kg, gc, do.astype(_MM), de_ext.astype(_F32),
                                     ds_final.astype(_F32), interpret=interpret)
  # h = state entering each chunk, dh = cotangent of the state leaving it.
  d_ny = _mm("...cv,...kv->...ck", de, h)           # E = U + NY·S
  d_qg = _mm("...cv,...kv->...ck", do, h)           # O = QG·S + P·E
  d_p = _mm("...iv,...jv->...ij", do, e)
  d_kg = _mm("...cv,...kv->...ck", e, dh)           # S' = gc⊙S + KGᵀ·E
  d_gc = jnp.sum(dh.astype(_F32) * h.astype(_F32), axis=-1)
  axes = frozenset(axes)
  cts = (d_ny.astype(ny.dtype), d_qg.astype(qg.dtype), d_p.astype(p.dtype), de,
         d_kg.astype(kg.dtype), d_gc, ds0)
  return tuple(_vary(ct, axes) for ct in cts)


_state_pass_vjp.defvjp(_state_pass_fwd, _state_pass_bwd)


# ----------------------------------------------------------------------------- intra-chunk


def _to_chunks(x, c):
  """[B, T, HV, ...] -> [B, HV, Nc, C, ...]."""
  if x is None:
    return None
  b, t, hv = x.shape[:3]
  x = x.reshape(b, t // c, c, hv, *x.shape[3:])
  return jnp.moveaxis(x, 3, 1)


def _from_chunks(x):
  """[B, HV, Nc, C, D] -> [B, T, HV, D]."""
  b, hv, nc, c, d = x.shape
  return jnp.moveaxis(x, 1, 3).reshape(b, nc * c, hv, d)


def _segment_masks(segidx, c):
  """segidx [B, T] -> same [B, 1, Nc, C, C], cont and keep [B, 1, Nc, C] (docs/MATH.md §3.5)."""
  b, t = segidx.shape
  sc = segidx.reshape(b, 1, t // c, c)
  prev = jnp.concatenate([segidx[:, :1], segidx[:, c - 1:-1:c]], axis=1)   # [B, Nc]
  entry = prev[:, None, :, None]
  same = sc[..., :, None] == sc[..., None, :]
  cont = (sc == entry).astype(_F32)
  keep = (sc == sc[..., -1:]).astype(_F32)
  return same, cont, keep


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _channel_pairs_kernel(q, k, kt, g, interpret, bwd_kernel):
  """(P, L) of `chunked._pair_matrices_channel` by the Pallas forward kernel; q, k, kt, g
  [..., C, K]. The backward is the Pallas backward kernel (bwd_kernel) or the XLA VJP of
  `chunked._channel_pair`, once per matrix."""
  lead, (c, d) = q.shape[:-2], q.shape[-2:]
  flat = lambda x: x.reshape(-1, c, d)
  p, l = cp.channel_pairs_fwd(flat(q), flat(kt), flat(k), flat(g), interpret=interpret)
  return p.reshape(*lead, c, c), l.reshape(*lead, c, c)


def _channel_pairs_kernel_fwd(q, k, kt, g, interpret, bwd_kernel):
  return _channel_pairs_kernel(q, k, kt, g, interpret, bwd_kernel), (q, k, kt, g)


def _channel_pairs_kernel_bwd(interpret, bwd_kernel, res, cts):
  q, k, kt, g = res
  back = lambda x, like: x.reshape(like.shape).astype(like.dtype)
  if not bwd_kernel:
    dq, dk_p, dg_p = chunked._channel_pair_bwd("bf16", (q, k, g), cts[0])
    dkt, dk_l, dg_l = chunked._channel_pair_bwd("bf16", (kt, k, g), cts[1])
    return back(dq, q), back(dk_p + dk_l, k), back(dkt, kt), back(dg_p + dg_l, g)
  lead, (c, d) = q.shape[:-2], q.shape[-2:]
  flat = lambda x: x.reshape(-1, c, d)
  dp, dl = (x.reshape(-1, c, c) for x in cts)
  dq, dkt, dk, dg = cp.channel_pairs_bwd(flat(q), flat(kt), flat(k), flat(g), dp, dl,
                                         interpret=interpret)
  return back(dq, q), back(dk, k), back(dkt, kt), back(dg, g)


_channel_pairs_kernel.defvjp(_channel_pairs_kernel_fwd, _channel_pairs_kernel_bwd)


def prepare_chunks(q, k, kt, vt, g, segidx, *, c, tuning: GpuTuning = DEFAULT_TUNING):
  """XLA part: [B, T, HV, ...] inputs (T a multiple of c) -> the state-pass kernel's inputs.

  kt, vt: the erase key k ⊙ erase (None: no delta edit) and the write value v ⊙ write, called
  `k_erase` / `v_write` everywhere else (the parameter names stay for callers of this public
  function). `tuning.solve` and `tuning.remat_intra` steer it (`GpuTuning`).
  Returns (ny, qg, p, u, kg, gc) in the layouts of `state_passing.state_passing_fwd`.
  """
  G, gate_kind = chunked.chunk_cumulative_gates(g, functools.partial(_to_chunks, c=c))
  same = cont = keep = None
  if segidx is not None:
    same, cont, keep = _segment_masks(segidx, c)
  chunks = (_to_chunks(q, c), _to_chunks(k, c), _to_chunks(kt, c), _to_chunks(vt, c), G)
  # (Under shard_map the kernel's outputs would lack the varying-axes types: XLA there.)
  pairs = None
  if (gate_kind == "channel" and tuning.channel_pair != "xla" and kt is not None
      and not _vma(q, k, kt) and cp.supported(c, q.shape[-1]) is None):
    pairs = functools.partial(_channel_pairs_kernel, interpret=_interpret_params() is not None,
                              bwd_kernel=tuning.channel_pair == "kernel")
  intra = functools.partial(chunked._intra_chunk, gate_kind=gate_kind, matmul="bf16",
                            solve=tuning.solve, channel_pairs=pairs)
  if tuning.remat_intra:
    intra = jax.checkpoint(intra)
  QG, P, Y, U, KG, gC = intra(*chunks, same=same, cont=cont, keep=keep)
  dk = q.shape[-1]
  lead = QG.shape[:3]
  ny = jnp.zeros_like(QG) if Y is None else -Y
  gc = jnp.ones(lead + (dk,), _F32) if gC is None else jnp.broadcast_to(gC, lead + (dk,))
  return (ny.astype(_MM), QG.astype(_MM), P.astype(_MM), U.astype(_F32), KG.astype(_MM),
          gc.astype(_F32))


def _core(q, k, k_erase, v_write, g, s0, segidx, *, c, interpret, tuning):
  """Chunk form on [B, T, HV, ...] inputs (T a multiple of c): (o, e, s_final)."""
  ny, qg, p, u, kg, gc = prepare_chunks(q, k, k_erase, v_write, g, segidx, c=c, tuning=tuning)
  o, e, s_final = _state_pass(ny, qg, p, u, kg, gc, s0, interpret)
  return _from_chunks(o), _from_chunks(e), s_final


# -------------------------------------------- intra-chunk kernel (GpuTuning.intra = "kernel")


def _kernel_segments(segidx, c):
  """segidx [B, T] -> the kernel's (seg, cont, keep), each [B, T] float32.

  The kernel compares segment ids only within a chunk, so seg is segidx minus the id of the
  chunk's first row: in [0, C), exact in float32 (segidx, a running count up to T, is not once
  it passes 2^24)."""
  b, t = segidx.shape
  _, cont, keep = _segment_masks(segidx, c)
  chunks = segidx.reshape(b, t // c, c)
  seg = (chunks - chunks[:, :, :1]).astype(_F32).reshape(b, t)
  return seg, cont.reshape(b, t), keep.reshape(b, t)


def _kernel_inputs(q, k, v, beta, G, segidx, c):
  """The intra-chunk kernels' shared inputs: bf16 q, k, v, the [B, HV, T] rows β, G and
  Gx = G_C − G, and the segment rows (or None)."""
  b, t, hv = v.shape[:3]
  flat = lambda x: x.reshape(b, hv, t)
  segments = None if segidx is None else _kernel_segments(segidx, c)
  return (q.astype(_MM), k.astype(_MM), v.astype(_MM), jnp.moveaxis(beta.astype(_F32), 1, 2),
          flat(G), flat(G[..., -1:] - G), segments)


def _call_intra_fwd(q, k, v, beta, G, segidx, scale, c, interpret, with_inverse):
  return ic.intra_chunk_fwd(*_kernel_inputs(q, k, v, beta, G, segidx, c), scale=scale,
                            with_inverse=with_inverse, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _intra_kernel(q, k, v, beta, G, segidx, scale, c, interpret):
  return _call_intra_fwd(q, k, v, beta, G, segidx, scale, c, interpret, with_inverse=False)


def _intra_kernel_fwd(q, k, v, beta, G, segidx, scale, c, interpret):
  # The backward takes the forward's bf16 inverse (8 KiB per chunk) instead of inverting again.
  *out, m = _call_intra_fwd(q, k, v, beta, G, segidx, scale, c, interpret, with_inverse=True)
  return tuple(out), (q, k, v, beta, G, segidx, m)


def _intra_kernel_bwd(scale, c, interpret, res, cts):
  """The kernel's backward (`intra_chunk_bwd`) plus the elementwise QG / KG terms and the
  chain rule of Gx = G_C − G, the entry factor and GVA's sum over value heads, in XLA."""
  q, k, v, beta, G, segidx, m = res
  d_ny, d_qg, d_p, d_u, d_kg = cts
  b, t, hv = v.shape[:3]
  h, n_rep = q.shape[2], hv // q.shape[2]
  inputs = _kernel_inputs(q, k, v, beta, G, segidx, c)
  segments = inputs[-1]
  dq, dk, dv, dbeta, dg_row, dg_col = ic.intra_chunk_bwd(
      *inputs, m, d_ny.astype(_MM), d_p.astype(_MM), d_u.astype(_MM), scale=scale,
      interpret=interpret)
  entry, exit_ = jnp.exp(G), jnp.exp(G[..., -1:] - G)       # [B, HV, Nc, C]
  if segments is not None:
    cont, keep = (x.reshape(b, 1, t // c, c) for x in segments[1:])
    entry, exit_ = entry * cont, exit_ * keep
  chunks = lambda x: _to_chunks(jnp.repeat(x.astype(_F32), n_rep, axis=2), c)
  qc, kc = chunks(q), chunks(k)
  d_qg, d_kg = d_qg.astype(_F32), d_kg.astype(_F32)
  dq = dq + scale * entry[..., None] * d_qg
  dk = dk + exit_[..., None] * d_kg
  d_exit = exit_ * jnp.sum(d_kg * kc, axis=-1)              # dL/dGx
  dG = (dg_row - dg_col).reshape(G.shape) + scale * entry * jnp.sum(d_qg * qc, axis=-1) - d_exit
  dG = dG.at[..., -1].add(jnp.sum(d_exit, axis=-1))         # Gx = G_C − G
  heads = lambda x: _from_chunks(x).reshape(b, t, h, n_rep, -1).sum(axis=3)
  return (heads(dq).astype(q.dtype), heads(dk).astype(k.dtype),
          _from_chunks(dv).astype(v.dtype), jnp.moveaxis(dbeta, 1, 2).astype(beta.dtype),
          dG.astype(G.dtype), None)


_intra_kernel.defvjp(_intra_kernel_fwd, _intra_kernel_bwd)


def _core_intra_kernel(q, k, v, beta, g, s0, segidx, *, scale, c, interpret):
  """`_core` for DeltaNet / GDN with the intra-chunk kernel; q, k unrepeated and unscaled."""
  b, t, hv = v.shape[:3]
  dk = q.shape[-1]
  if g is None:
    G = jnp.zeros((b, hv, t // c, c), _F32)
  else:
    G, _ = chunked.chunk_cumulative_gates(g.astype(_F32), functools.partial(_to_chunks, c=c))
  ny, qg, p, u, kg = _intra_kernel(q, k, v, beta, G, segidx, float(scale), c, interpret)
  gc = jnp.exp(G[..., -1:])
  if segidx is not None:   # a segment starting inside the chunk resets the entry state
    gc = gc * _segment_masks(segidx, c)[1][..., -1:]
  gc = jnp.broadcast_to(gc, G.shape[:3] + (dk,))
  o, e, s_final = _state_pass(ny, qg, p, u, kg, gc, s0, interpret)
  return _from_chunks(o), _from_chunks(e), s_final


def _intra_kernel_applies(mixer, dk, dv, chunk_size, tuning) -> bool:
  return (tuning.intra == "kernel" and specs.resolve(mixer).gpu_intra_kernel
          and ic.supported(chunk_size, dk, dv) is None)


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
    g = None if g is None else g * (m if g.ndim == 3 else m[..., None])
  # (Under shard_map the kernel's outputs would lack the varying-axes types: XLA path there.)
  if _intra_kernel_applies(mixer, dk, dv, chunk_size, tuning) and not _vma(q, k, v):
    beta = gates["beta"] if m is None else gates["beta"] * m
    o, e, s_final = _core_intra_kernel(pad(q), pad(k), pad(v), pad(beta), pad(g), s0, segidx,
                                       scale=scale, c=c, interpret=_interpret_params())
    return o[:, :t], (s_final if output_final_state else None), e[:, :t]
  n_rep = hv // h
  q = jnp.repeat(q, n_rep, axis=2) * scale
  k = jnp.repeat(k, n_rep, axis=2)
  k_erase = None if erase is None else k * erase
  v_write = v if write is None else v * write
  if m is not None:
    v_write = v_write * m[..., None]
  o, e, s_final = _core(pad(q), pad(k), pad(k_erase), pad(v_write), pad(g), s0, segidx, c=c,
                        interpret=_interpret_params(), tuning=tuning)
  return o[:, :t], (s_final if output_final_state else None), e[:, :t]
