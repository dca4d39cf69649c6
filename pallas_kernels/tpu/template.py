"""The chunk template as a differentiable op: custom VJP over the Pallas kernels, plus the layout
glue (padding, segments, varlen) between the public [B, T, heads, dim] layout and the kernels.

Every mixer is `delta_template(q, k, kt, vt, g, ...)` with (docs/MATH.md §2.0):

    S̄_t = Diag(e^{g_t}) S_{t−1};   r_t = ṽ_t − S̄_tᵀ k̃_t;
    S_t = S̄_t + k_t r_tᵀ;           o_t = S_tᵀ (scale q_t)

`kt` (k̃) None means no delta edit (linear attention); `g` None means no decay. The glue stays in
plain JAX and is differentiated by autodiff around the kernels' custom VJP: the in-chunk cumsum of
g (so the kernel's dG turns into dg by the reverse cumsum of docs/MATH.md §3.6 step 9), padding,
masking and the varlen re-layout.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu import _common
from pallas_kernels.tpu import kernels
from pallas_kernels.tpu.block_sizes import BlockSizes

_F32 = jnp.float32


def default_interpret():
  """Compiled Mosaic on TPU; the TPU interpreter on any other backend."""
  return False if jax.default_backend() == "tpu" else pltpu.InterpretParams()


# ----------------------------------------------------------------------------------------------
# The custom VJP over kernel-layout arrays.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _template(cfg, q, k, kt, vt, g, init, seg, meta):
  out = kernels.forward(cfg, q, k, kt, vt, g, seg, init, meta, emit_output=True,
                        emit_states=False)
  return out["o"], out["e"], out["final"]


def _template_fwd(cfg, q, k, kt, vt, g, init, seg, meta):
  out = kernels.forward(cfg, q, k, kt, vt, g, seg, init, meta, emit_output=True,
                        emit_states=cfg.save_states)
  saved = out["states"] if cfg.save_states else None
  return (out["o"], out["e"], out["final"]), (q, k, kt, vt, g, init, seg, meta, saved)


def _template_bwd(cfg, res, cotangents):
  q, k, kt, vt, g, init, seg, meta, states = res
  d_o, d_e, d_final = cotangents
  if states is None:  # recompute the chunk-entry states: one more sequential pass
    states = kernels.forward(cfg, q, k, kt, vt, g, seg, init, meta, emit_output=False,
                             emit_states=True)["states"]
  grads = kernels.backward(cfg, q, k, kt, vt, g, seg, states, d_o, d_e, d_final, meta)

  def per_key_head(x):  # GVA: sum over the value heads that share a key head
    if cfg.n_rep == 1:
      return x
    b, t, _ = x.shape
    return x.reshape(b, t, -1, cfg.n_rep, init.shape[2]).sum(axis=3).reshape(b, t, -1)

  return (per_key_head(grads["dq"]).astype(q.dtype), per_key_head(grads["dk"]).astype(k.dtype),
          None if kt is None else grads["dkt"].astype(kt.dtype), grads["dvt"].astype(vt.dtype),
          None if g is None else grads["dg"], grads["dinit"], None, None)


_template.defvjp(_template_fwd, _template_bwd)


# ----------------------------------------------------------------------------------------------
# Layout glue.


def _pad_axis(x, axis, size, mode="constant"):
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, mode=mode)


def _varlen_layout(cu_seqlens, t, c):
  """Places sequence n at chunk `chunk_off[n]` so every sequence starts on a chunk start.

  Returns dest [T] (new position of each token), the padded length (static bound
  (ceil(T/C) + N)·C), and per-chunk seq [Nc] (which sequence the chunk belongs to; trailing
  empty chunks continue the last one as identity steps).
  """
  n = cu_seqlens.shape[0] - 1
  lens = cu_seqlens[1:] - cu_seqlens[:-1]
  chunk_off = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                               jnp.cumsum((lens + c - 1) // c)[:-1].astype(jnp.int32)])
  pos = jnp.arange(t, dtype=jnp.int32)
  seq_of_token = jnp.searchsorted(cu_seqlens[1:], pos, side="right").astype(jnp.int32)
  dest = chunk_off[seq_of_token] * c + (pos - cu_seqlens[seq_of_token])
  n_chunks = -(-t // c) + n
  starts = jnp.zeros((n_chunks,), jnp.int32).at[chunk_off].set(1)
  seq = jnp.cumsum(starts) - 1
  return dest, n_chunks * c, seq.astype(jnp.int32)


def _meta(seq):
  """(seq, first, last) [Nc] int32 from the per-chunk sequence index."""
  first = jnp.concatenate([jnp.ones((1,), bool), seq[1:] != seq[:-1]])
  last = jnp.concatenate([seq[1:] != seq[:-1], jnp.ones((1,), bool)])
  return seq.astype(jnp.int32), first.astype(jnp.int32), last.astype(jnp.int32)


def delta_template(q, k, kt, vt, g, *, scale: float, initial_state=None, output_final_state=False,
                   segidx=None, valid=None, cu_seqlens=None, block_sizes: BlockSizes | None = None,
                   interpret: Any = None, out_dtype=None):
  """The chunkwise template on public-layout arrays.

  Args:
    q, k: `[B, T, H, K]` (float32 or bfloat16). Value head h reads key head h // (HV / H).
    kt: `[B, T, HV, K]` erase key k̃ (already β ⊙ k or b ⊙ k), or None (no delta edit).
    vt: `[B, T, HV, V]` write value ṽ (β ⊙ v or w ⊙ v, or v).
    g: None, `[B, T, HV]` (scalar) or `[B, T, HV, K]` (per channel) log decay, ≤ 0, float32.
    scale: query scale.
    initial_state: `[B, HV, K, V]` (varlen: `[N, HV, K, V]`) float32, or None for zeros.
    output_final_state: return the state after the last real token (per sequence in varlen).
    segidx: `[B, T]` int running segment index (docs/MATH.md §1.7; state resets where it changes).
    valid: `[B, T]` bool, False at padding positions (identity steps, zero outputs).
    cu_seqlens: `[N + 1]` int, varlen mode (B = 1); excludes segidx/valid.
    block_sizes: tiling (`BlockSizes()` by default).
    interpret: False (compiled Mosaic), True or `pltpu.InterpretParams(...)`; None picks compiled
      on TPU and the interpreter elsewhere.
    out_dtype: dtype of o and r (default vt's).

  Returns:
    (o `[B, T, HV, V]`, final_state `[B or N, HV, K, V]` float32 or None, r `[B, T, HV, V]`).
  """
  bs = block_sizes or BlockSizes()
  interpret = default_interpret() if interpret is None else interpret
  b, t, h, dk = q.shape
  hv, dv = vt.shape[2], vt.shape[3]
  if hv % h:
    raise ValueError(f"value heads HV={hv} must be a multiple of key heads H={h}.")
  if cu_seqlens is not None and (segidx is not None or valid is not None):
    raise ValueError("pass either cu_seqlens or segidx/valid, not both.")
  if cu_seqlens is not None and b != 1:
    raise ValueError(f"cu_seqlens (varlen) needs B = 1, got B = {b}.")
  gate = "none" if g is None else ("scalar" if g.ndim == 3 else "channel")
  c = bs.chunk_size
  n_seq = b if cu_seqlens is None else cu_seqlens.shape[0] - 1

  if valid is not None:  # padding rows are identity steps: no decay, no erase, no write
    m = valid[:, :, None].astype(_F32)
    def mask(x):
      return None if x is None else (x * (m if x.ndim == 3 else m[..., None])).astype(x.dtype)
    q, k, kt, vt, g = mask(q), mask(k), mask(kt), mask(vt), mask(g)

  if cu_seqlens is None:
    t_pad = -(-t // c) * c
    place = lambda x: None if x is None else _pad_axis(x, 1, t_pad)
    seq = jnp.zeros((t_pad // c,), jnp.int32)
  else:
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    dest, t_pad, seq = _varlen_layout(cu_seqlens, t, c)
    place = lambda x: None if x is None else (
        jnp.zeros((1, t_pad) + x.shape[2:], x.dtype).at[:, dest].set(x))
  n_chunks = t_pad // c
  dk_pad, dv_pad = bs.padded(dk), bs.padded(dv)

  def to_kernel(x, d_pad):  # [B, T, heads, D] -> [B, T_pad, heads·D_pad] (a free reshape when
    if x is None:           # T and D need no padding)
      return None
    x = _pad_axis(place(x), 3, d_pad)
    return x.reshape(x.shape[0], x.shape[1], -1)

  qk, kk, ktk = to_kernel(q, dk_pad), to_kernel(k, dk_pad), to_kernel(kt, dk_pad)
  vtk = to_kernel(vt, dv_pad)
  gk = None
  if gate == "scalar":
    gk = jnp.swapaxes(place(g.astype(_F32)), 1, 2).reshape(b, hv, n_chunks, 1, c)
    gk = jnp.cumsum(gk, axis=-1)
  elif gate == "channel":
    gk = to_kernel(g.astype(_F32), dk_pad).reshape(b, n_chunks, c, hv * dk_pad)
    gk = jnp.cumsum(gk, axis=2).reshape(b, t_pad, hv * dk_pad)

  seg = None
  if segidx is not None:
    # Tail rows continue the last segment (docs/MATH.md §3.1); values relative to the segment of
    # the token entering each chunk, so row i continues S_0's segment iff seg_i == 0.
    s = _pad_axis(segidx.astype(jnp.int32), 1, t_pad, mode="edge").reshape(b, n_chunks, c)
    entry = jnp.concatenate([s[:, :1, :1], s[:, :-1, -1:]], axis=1)
    seg = (s - entry).astype(_F32).reshape(b, n_chunks, 1, c)

  if initial_state is None:
    init = jnp.zeros((n_seq, hv, dk_pad, dv_pad), _F32)
  else:
    init = _pad_axis(_pad_axis(initial_state.astype(_F32), 2, dk_pad), 3, dv_pad)

  cfg = kernels.KernelConfig(
      gate=gate, erase=kt is not None, segments=seg is not None, scale=float(scale), chunk=c,
      sub=bs.sub_chunk, n_rep=hv // h, out_dtype=jnp.dtype(out_dtype or vt.dtype),
      save_states=bs.save_chunk_states, interpret=interpret,
      vmem_limit_bytes=bs.vmem_limit_bytes)
  o, e, final = _template(cfg, qk, kk, ktk, vtk, gk, init, seg, _meta(seq))

  def from_kernel(x):  # [B, T_pad, HV·V_pad] -> [B, T, HV, V]
    x = x.reshape(x.shape[0], x.shape[1], hv, dv_pad)[..., :dv]
    return x[:, :t] if cu_seqlens is None else x[:, dest]

  final = final[:, :, :dk, :dv] if output_final_state else None
  return from_kernel(o), final, from_kernel(e)


def beta_weighted_delta(q, k, v, g, beta, *, scale=None, **kwargs):
  """The template for the β-weighted mixers (DeltaNet: g None, GDN: g `[B, T, HV]`, KDA: g
  `[B, T, HV, K]`): k̃ = β k (at the value heads), ṽ = β v, output in v's dtype."""
  kt = _common.times(_common.value_heads(k, v.shape[2]), beta)
  return delta_template(q, k, kt, _common.times(v, beta), g,
                        scale=_common.default_scale(scale, q), out_dtype=v.dtype, **kwargs)

