"""The two `pl.pallas_call`s of the chunk template: a forward pass and a backward pass.

Both run one grid step per (batch row, value head, chunk): grid (B, HV, Nc) with semantics
("parallel", "parallel", "arbitrary"). The chunk axis is last and sequential, and the float32
state (forward) or state cotangent (backward, chunks visited last to first through the index
maps) lives in a VMEM scratch buffer across it. Kernel layout (the glue in `template.py` builds it):

    q, k      [B, T, H·K]     head h is lane block h; value head h reads key head h // n_rep
    kt        [B, T, HV·K]    erase key k̃ (absent for linear attention)
    vt        [B, T, HV·V]    write value ṽ
    g         channel: [B, T, HV·K]; scalar: [B, HV, Nc, 1, C]   in-chunk cumulative log gate
    seg       [B, Nc, 1, C]   float32 segidx − segidx of the token entering the chunk
    init      [N, HV, K, V]   start states; chunk c reads row b + seq[c] where first[c]
    o, e      [B, T, HV·V]    outputs and write residuals
    final     [N, HV, K, V]   written where last[c] (output-block revisiting keeps the last write)
    states    [B, HV, Nc, K, V] chunk-entry states (the backward's S_0)

T is a multiple of C, K and V multiples of 128. The public [B, T, heads, D] layout becomes
[B, T, heads·D] by a free reshape, so a (C, D) block of head h is read in place: no transposes.
`seq`, `first`, `last` ([Nc] int32) are scalar-prefetched into SMEM: one batch row is one sequence (seq = 0), while varlen packs several
sequences along the chunk axis of a single row, each starting on a chunk boundary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu import chunk_math

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static description of one kernel instance (hashable: it keys jit caches and custom_vjp)."""
  gate: str                 # "none" | "scalar" | "channel"
  erase: bool               # delta rule (k̃ present) or plain linear attention
  segments: bool            # per-row segment structure inside chunks
  scale: float
  chunk: int
  sub: int
  n_rep: int                # value heads per key head
  out_dtype: Any            # dtype of o and e (a numpy dtype: hashable)
  save_states: bool
  interpret: Any            # False (compiled) | True | pltpu.InterpretParams
  vmem_limit_bytes: int | None = None

  @property
  def unroll(self) -> bool:
    """Static inner loops when compiled; rolled loops keep the interpreter's program small."""
    return self.interpret is False

  def compiler_params(self):
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                vmem_limit_bytes=self.vmem_limit_bytes)


def _specs(cfg: KernelConfig, dk: int, dv: int, n_chunks: int, reverse: bool):
  """BlockSpecs of the per-chunk inputs, keyed by name; index maps take (b, h, c, *scalar refs)."""
  C = cfg.chunk
  chunk = (lambda c: n_chunks - 1 - c) if reverse else (lambda c: c)
  sq = pl.Squeezed()

  def tok(d, heads="value"):  # a (C, d) block of [B, T, heads·d]
    if heads == "key":
      return pl.BlockSpec((sq, C, d), lambda b, h, c, *_: (b, chunk(c), jax.lax.div(h, cfg.n_rep)))
    return pl.BlockSpec((sq, C, d), lambda b, h, c, *_: (b, chunk(c), h))

  def seq_state():
    return pl.BlockSpec((sq, sq, dk, dv),
                        lambda b, h, c, seq, *_: (b + seq[chunk(c)], h, 0, 0))

  specs = {
      "q": tok(dk, "key"), "k": tok(dk, "key"), "kt": tok(dk), "vt": tok(dv), "v_out": tok(dv),
      "k_out": tok(dk),
      "seg": pl.BlockSpec((sq, sq, 1, C), lambda b, h, c, *_: (b, chunk(c), 0, 0)),
      "state_in": seq_state(),
      "states": pl.BlockSpec((sq, sq, sq, dk, dv), lambda b, h, c, *_: (b, h, chunk(c), 0, 0)),
  }
  if cfg.gate == "channel":
    specs["g"] = tok(dk)
  else:
    specs["g"] = pl.BlockSpec((sq, sq, sq, 1, C), lambda b, h, c, *_: (b, h, chunk(c), 0, 0))
  return specs


def _load_chunk(cfg, refs):
  """Reads one chunk's inputs as float32 values (q pre-scaled)."""
  Q = refs["q"][...].astype(_F32) * cfg.scale
  K = refs["k"][...].astype(_F32)
  Kt = refs["kt"][...].astype(_F32) if cfg.erase else None
  Vt = refs["vt"][...].astype(_F32)
  gates = chunk_math.make_gates(cfg.gate, refs["g"][...] if cfg.gate != "none" else None)
  seg = chunk_math.make_segments(refs["seg"][...]) if cfg.segments else None
  return Q, K, Kt, Vt, gates, seg


def _input_names(cfg):
  names = ["q", "k"] + (["kt"] if cfg.erase else []) + ["vt"]
  names += (["g"] if cfg.gate != "none" else []) + (["seg"] if cfg.segments else [])
  return names


def forward(cfg: KernelConfig, q, k, kt, vt, g, seg, init, meta, *, emit_output: bool,
            emit_states: bool):
  """Runs the forward kernel. Returns a dict with o, e, final (if emit_output), states (if
  emit_states). `meta` = (seq, first, last) int32 [Nc]."""
  b, t = vt.shape[:2]
  _, hv, dk, dv = init.shape
  n_chunks = t // cfg.chunk
  specs = _specs(cfg, dk, dv, n_chunks, reverse=False)
  in_names = _input_names(cfg) + ["init"]
  arrays = {"q": q, "k": k, "kt": kt, "vt": vt, "g": g, "seg": seg, "init": init}
  in_specs = [specs["state_in"] if n == "init" else specs[n] for n in in_names]

  out_names, out_specs, out_shapes = [], [], []
  if emit_output:
    out_names += ["o", "e", "final"]
    out_specs += [specs["v_out"], specs["v_out"], specs["state_in"]]
    out_shapes += [jax.ShapeDtypeStruct(vt.shape, cfg.out_dtype)] * 2
    out_shapes += [jax.ShapeDtypeStruct(init.shape, _F32)]
  if emit_states:
    out_names.append("states")
    out_specs.append(specs["states"])
    out_shapes.append(jax.ShapeDtypeStruct((b, hv, n_chunks, dk, dv), _F32))

  def kernel(seq_ref, first_ref, last_ref, *refs):
    del seq_ref
    refs = dict(zip(in_names + out_names + ["S"], refs))
    c = pl.program_id(2)
    state = refs["S"]

    @pl.when(first_ref[c] == 1)
    def _():
      state[...] = refs["init"][...]

    S0 = state[...]
    if emit_states:
      refs["states"][...] = S0
    Q, K, Kt, Vt, gates, segs = _load_chunk(cfg, refs)
    O, E, S_next = chunk_math.chunk_forward(Q, K, Kt, Vt, gates, segs, S0, cfg.sub, cfg.unroll,
                                            need_output=emit_output)
    state[...] = S_next
    if emit_output:
      refs["o"][...] = O.astype(refs["o"].dtype)
      refs["e"][...] = E.astype(refs["e"].dtype)

      @pl.when(last_ref[c] == 1)
      def _():
        refs["final"][...] = S_next

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3, grid=(b, hv, n_chunks), in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((dk, dv), _F32)])
  outs = pl.pallas_call(
      kernel, out_shape=out_shapes, grid_spec=grid_spec, compiler_params=cfg.compiler_params(),
      interpret=cfg.interpret, name=f"chunk_fwd_{cfg.gate}")(
          *meta, *[arrays[n] for n in in_names])
  return dict(zip(out_names, outs))


def backward(cfg: KernelConfig, q, k, kt, vt, g, seg, states, d_o, d_e, d_final, meta):
  """Runs the backward kernel over chunks last to first.

  Returns dict: dq, dk (per value head, [B, T, HV·K], q's gradient already times scale),
  dkt, dvt, dg (gate layout), dinit ([N, HV, K, V]).
  """
  b, t = vt.shape[:2]
  _, hv, dk, dv = d_final.shape
  n_chunks = t // cfg.chunk
  specs = _specs(cfg, dk, dv, n_chunks, reverse=True)
  in_names = _input_names(cfg) + ["states", "do", "de", "dfinal"]
  arrays = {"q": q, "k": k, "kt": kt, "vt": vt, "g": g, "seg": seg, "states": states,
            "do": d_o, "de": d_e, "dfinal": d_final}
  spec_of = {"do": specs["v_out"], "de": specs["v_out"], "dfinal": specs["state_in"]}
  in_specs = [spec_of.get(n) or specs[n] for n in in_names]

  out_names = ["dq", "dk"] + (["dkt"] if cfg.erase else []) + ["dvt"]
  out_names += (["dg"] if cfg.gate != "none" else []) + ["dinit"]
  per_value_k = jax.ShapeDtypeStruct((b, t, hv * dk), _F32)
  shapes = {"dq": per_value_k, "dk": per_value_k, "dkt": per_value_k,
            "dvt": jax.ShapeDtypeStruct((b, t, hv * dv), _F32),
            "dg": jax.ShapeDtypeStruct(g.shape if g is not None else (), _F32),
            "dinit": jax.ShapeDtypeStruct(d_final.shape, _F32)}
  out_spec_of = {"dq": specs["k_out"], "dk": specs["k_out"], "dkt": specs["k_out"],
                 "dvt": specs["v_out"], "dg": specs["g"], "dinit": specs["state_in"]}

  def kernel(seq_ref, first_ref, last_ref, *refs):
    del seq_ref
    refs = dict(zip(in_names + out_names + ["dS"], refs))
    c = n_chunks - 1 - pl.program_id(2)
    d_state = refs["dS"]

    @pl.when(last_ref[c] == 1)
    def _():
      d_state[...] = refs["dfinal"][...]

    Q, K, Kt, Vt, gates, segs = _load_chunk(cfg, refs)
    dQ, dK, dKt, dVt, dG, dS0 = chunk_math.chunk_backward(
        Q, K, Kt, Vt, gates, segs, refs["states"][...], refs["do"][...].astype(_F32),
        refs["de"][...].astype(_F32), d_state[...], cfg.sub, cfg.unroll)
    refs["dq"][...] = dQ * cfg.scale
    refs["dk"][...] = dK
    if cfg.erase:
      refs["dkt"][...] = dKt
    refs["dvt"][...] = dVt
    if cfg.gate == "channel":
      refs["dg"][...] = dG
    elif cfg.gate == "scalar":
      refs["dg"][...] = chunk_math.col_to_row(dG)
    d_state[...] = dS0

    @pl.when(first_ref[c] == 1)
    def _():
      refs["dinit"][...] = dS0

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3, grid=(b, hv, n_chunks), in_specs=in_specs,
      out_specs=[out_spec_of[n] for n in out_names],
      scratch_shapes=[pltpu.VMEM((dk, dv), _F32)])
  outs = pl.pallas_call(
      kernel, out_shape=[shapes[n] for n in out_names], grid_spec=grid_spec,
      compiler_params=cfg.compiler_params(), interpret=cfg.interpret,
      name=f"chunk_bwd_{cfg.gate}")(*meta, *[arrays[n] for n in in_names])
  return dict(zip(out_names, outs))
