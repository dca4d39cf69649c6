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
from lineax_attn.ops.gpu_chunks import kernel_segments, segment_masks, to_chunks
from lineax_attn.ops.gpu_tuning import DEFAULT_TUNING, GpuTuning
from lineax_attn.ops.gpu_vjps import channel_pairs_kernel, interpret_params, vma
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
  """Whether `_core` takes the Triton channel-gate intra kernel for this call: the Triton path
  with `GpuTuning(triton_intra="kernel")`, per-channel gates with an erase key (KDA, GDN-2),
  sizes the kernel takes, outside shard_map (its outputs would lack the varying-axes types)."""
  if kernels != "triton" or tuning.intra != "kernel" or kt is None or g is None or g.ndim != 4:
    return False
  from pallas_kernels.gpu.triton import blocks  # pylint: disable=g-import-not-at-top
  return (blocks.intra_supported("channel-gate", c, q.shape[-1], vt.shape[-1]) is None
          and not vma(q, kt, vt))


def _channel_kernel_call(q, k, kt, vt, g, segidx, c):
  from pallas_kernels.gpu.triton import channel_intra  # pylint: disable=g-import-not-at-top
  b, t, hv, dk = q.shape
  G = jnp.cumsum(g.astype(_F32).reshape(b, t // c, c, hv, dk), axis=2).reshape(b, t, hv, dk)
  segments = None if segidx is None else kernel_segments(segidx, c)
  return channel_intra.channel_intra_fwd(q, k, kt, vt, G, segments, chunk=c)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def channel_intra_kernel(q, k, kt, vt, g, segidx, c, tuning):
  """`prepare_chunks` for per-channel gates with the Triton forward kernel
  (`pallas_kernels.gpu.triton.channel_intra`); the backward recomputes the XLA part and
  differentiates it (what `remat_intra=True` does for the XLA path)."""
  return _channel_kernel_call(q, k, kt, vt, g, segidx, c)


def _channel_intra_fwd(q, k, kt, vt, g, segidx, c, tuning):
  return _channel_kernel_call(q, k, kt, vt, g, segidx, c), (q, k, kt, vt, g, segidx)


def _channel_intra_bwd(c, tuning, res, cts):
  q, k, kt, vt, g, segidx = res
  xla = lambda q, k, kt, vt, g: prepare_chunks(q, k, kt, vt, g, segidx, c=c, tuning=tuning)
  _, vjp = jax.vjp(xla, q, k, kt, vt, g)
  return vjp(cts) + (None,)


channel_intra_kernel.defvjp(_channel_intra_fwd, _channel_intra_bwd)
