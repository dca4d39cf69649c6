"""Argument checks, segment handling and implementation choice shared by the public ops.

Every public op funnels through `run_mixer`: it validates shapes and dtypes (a `ValueError` that
names the argument and what was expected), turns `segment_ids` / `cu_seqlens` into a
`SegmentLayout`, picks the implementation and casts the results back.

Implementations register themselves by name with `register_implementation`; each receives
already-validated arrays and the mixer name, and returns `(o, final_state, r)` in float32:

    impl(mixer, q, k, v, gates, *, scale, initial_state, layout, chunk_size,
         output_final_state) -> (o, final_state | None, r)

where `gates` is a dict of the mixer's gate arrays (float32) keyed by argument name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from lineax_attn.ops import segments as seg_lib

# Which gates each mixer takes, and the trailing axis each gate carries beyond [B, T, HV]:
# None = scalar per value head, "k" = per key channel, "v" = per value channel.
MIXER_GATES: dict[str, tuple[tuple[str, str | None], ...]] = {
    "linear_attention": (),
    "delta_rule": (("beta", None),),
    "gated_delta_rule": (("g", None), ("beta", None)),
    "kda": (("g", "k"), ("beta", None)),
    "gdn2": (("g", "k"), ("b", "k"), ("w", "v")),
}

_IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {}
# Implementations that may exist later but are not built yet: a clear error, not a KeyError.
_PLANNED: tuple[str, ...] = ()


def register_implementation(name: str, fn: Callable[..., Any]) -> None:
  _IMPLEMENTATIONS[name] = fn


def available_implementations() -> tuple[str, ...]:
  return tuple(_IMPLEMENTATIONS)


def default_implementation(backend: str | None = None) -> str:
  """The best implementation available on `backend` (default: jax's default backend).

  "pallas_tpu" on TPU, "pallas_gpu" on Hopper GPUs (it falls back to "chunk" itself for shapes
  it does not handle), else the chunked pure-JAX form; the scan is an oracle, far too slow to
  train with.
  """
  backend = backend or jax.default_backend()
  if backend == "tpu" and "pallas_tpu" in _IMPLEMENTATIONS:
    return "pallas_tpu"
  if backend == "gpu" and "pallas_gpu" in _IMPLEMENTATIONS:
    from lineax_attn.ops import pallas_gpu  # pylint: disable=g-import-not-at-top
    if pallas_gpu.is_hopper():
      return "pallas_gpu"
  return "chunk"


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _check_float(name: str, x) -> None:
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
    got = getattr(x, "dtype", type(x).__name__)
    raise ValueError(f"`{name}` must be a floating-point array (float32/bfloat16/float16), got {got}.")


def _check_shape(name: str, x, expected: tuple[int, ...], desc: str) -> None:
  if tuple(x.shape) != tuple(expected):
    raise ValueError(f"`{name}` must have shape {desc} = {tuple(expected)}, got {tuple(x.shape)}.")


@dataclasses.dataclass(frozen=True)
class Dims:
  b: int
  t: int
  h: int
  hv: int
  dk: int
  dv: int


def check_qkv(q, k, v) -> Dims:
  """Validates q, k `[B, T, H, K]` and v `[B, T, HV, V]` with HV % H == 0."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    _check_float(name, x)
    if x.ndim != 4:
      raise ValueError(f"`{name}` must be rank 4 [B, T, heads, dim], got shape {tuple(x.shape)}.")
  if q.shape != k.shape:
    raise ValueError(f"`k` must have the shape of `q` [B, T, H, K] = {tuple(q.shape)}, "
                     f"got {tuple(k.shape)}.")
  b, t, h, dk = q.shape
  if v.shape[:2] != (b, t):
    raise ValueError(f"`v` must share B and T with `q` ({b}, {t}), got v shape {tuple(v.shape)}.")
  hv, dv = v.shape[2], v.shape[3]
  if hv % h != 0:
    raise ValueError(f"`v` heads HV={hv} must be a multiple of the q/k heads H={h} (grouped "
                     f"value heads), got v shape {tuple(v.shape)}.")
  if min(b, t, h, dk, dv) == 0:
    raise ValueError(f"empty inputs: q {tuple(q.shape)}, v {tuple(v.shape)}.")
  return Dims(b=b, t=t, h=h, hv=hv, dk=dk, dv=dv)


def check_gate(mixer: str, name: str, x, axis: str | None, dims: Dims):
  _check_float(name, x)
  shape = (dims.b, dims.t, dims.hv)
  desc = "[B, T, HV]"
  if axis == "k":
    shape, desc = shape + (dims.dk,), "[B, T, HV, K]"
  elif axis == "v":
    shape, desc = shape + (dims.dv,), "[B, T, HV, V]"
  _check_shape(name, x, shape, desc + f" for {mixer}")
  if _is_concrete(x):
    # Cheap value checks where the data is concrete (numpy, so nothing is staged into a trace
    # that closes over the array); under jit with traced gates they are the caller's contract.
    xn = np.asarray(x, np.float32)
    if name == "g" and np.any(xn > 0):
      raise ValueError(f"`g` is a log decay and must be <= 0 everywhere (got max {float(np.max(xn))}).")
    if not np.all(np.isfinite(xn)):
      raise ValueError(f"`{name}` contains NaN or Inf.")
  return x.astype(jnp.float32)


def check_scale(scale, dk: int) -> float:
  if scale is None:
    return dk ** -0.5
  try:
    scale = float(scale)
  except (TypeError, ValueError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(f"`scale` must be a Python number, got {type(scale).__name__}.") from e
  if not math.isfinite(scale) or scale <= 0:
    raise ValueError(f"`scale` must be a positive finite number, got {scale}.")
  return scale


def check_chunk_size(chunk_size) -> int:
  if not isinstance(chunk_size, (int, np.integer)) or isinstance(chunk_size, bool) \
      or chunk_size <= 0 or chunk_size % 16 != 0:
    raise ValueError(f"`chunk_size` must be a positive multiple of 16 (16, 32, 64, ...), "
                     f"got {chunk_size!r}.")
  return int(chunk_size)


def check_segments(segment_ids, cu_seqlens, dims: Dims) -> seg_lib.SegmentLayout:
  """Validates `segment_ids` / `cu_seqlens` and builds the layout."""
  if segment_ids is not None and cu_seqlens is not None:
    raise ValueError("pass at most one of `segment_ids` and `cu_seqlens`, not both.")
  if segment_ids is not None:
    if not hasattr(segment_ids, "dtype") or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"`segment_ids` must be an integer array [B, T], got dtype "
                       f"{getattr(segment_ids, 'dtype', type(segment_ids).__name__)}.")
    _check_shape("segment_ids", segment_ids, (dims.b, dims.t), "[B, T]")
    if _is_concrete(segment_ids) and np.any(np.asarray(segment_ids) < 0):
      raise ValueError("`segment_ids` must be >= 0 (0 marks padding).")
    return seg_lib.layout_from_segment_ids(jnp.asarray(segment_ids))
  if cu_seqlens is not None:
    if not hasattr(cu_seqlens, "dtype") or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
      raise ValueError(f"`cu_seqlens` must be an integer array [N + 1], got dtype "
                       f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}.")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
      raise ValueError(f"`cu_seqlens` must have shape [N + 1] with N >= 1, got {tuple(cu_seqlens.shape)}.")
    if dims.b != 1:
      raise ValueError(f"`cu_seqlens` (varlen mode) needs batch size B = 1, got B = {dims.b}.")
    if _is_concrete(cu_seqlens):
      cu = np.asarray(cu_seqlens)
      if cu[0] != 0 or cu[-1] != dims.t or np.any(np.diff(cu) <= 0):
        raise ValueError(f"`cu_seqlens` must be strictly increasing from 0 to T={dims.t}, got {cu.tolist()}.")
    return seg_lib.SegmentLayout(cu_seqlens=jnp.asarray(cu_seqlens, jnp.int32))
  return seg_lib.SegmentLayout()


def check_initial_state(initial_state, dims: Dims, layout: seg_lib.SegmentLayout):
  if initial_state is None:
    return None
  rows = layout.cu_seqlens.shape[0] - 1 if layout.is_varlen else dims.b
  rows_desc = "N (number of sequences in cu_seqlens)" if layout.is_varlen else "B"
  expected = (rows, dims.hv, dims.dk, dims.dv)
  if not hasattr(initial_state, "shape") or tuple(initial_state.shape) != expected:
    raise ValueError(f"`initial_state` must have shape [{rows_desc}, HV, K, V] = {expected}, got "
                     f"{tuple(getattr(initial_state, 'shape', ()))}.")
  if initial_state.dtype != jnp.float32:
    raise ValueError(f"`initial_state` must be float32 (states are always float32), got {initial_state.dtype}.")
  return initial_state


MAX_POSITIONS = 2**31 - 1   # token positions and segment indices are int32 arrays


def check_token_positions(t: int, layout: seg_lib.SegmentLayout, chunk_size: int) -> None:
  """Token positions (segment indices, padding to whole chunks, the varlen re-layout) are int32
  index arrays over the time axis: they must stay below 2^31. Element offsets never are (XLA and
  the kernels index per dimension; docs/KERNELS_GPU.md, "Indexing past 2^31 elements")."""
  padded = -(-t // chunk_size) * chunk_size
  if layout.is_varlen:
    n = layout.cu_seqlens.shape[0] - 1
    positions = padded + n * chunk_size
    if positions > MAX_POSITIONS:
      raise ValueError(f"`cu_seqlens`: T = {t} tokens in N = {n} sequences re-lay onto "
                       f"(ceil(T/C) + N)·C = {positions} positions (C = {chunk_size}), past the "
                       f"int32 limit {MAX_POSITIONS}.")
  elif padded > MAX_POSITIONS:
    raise ValueError(f"`q`: T = {t} tokens ({padded} padded to whole chunks of {chunk_size}) "
                     f"exceed the int32 position limit {MAX_POSITIONS}.")


def resolve_implementation(implementation: str | None) -> Callable[..., Any]:
  name = default_implementation() if implementation is None else implementation
  if name in _IMPLEMENTATIONS:
    return _IMPLEMENTATIONS[name]
  if name in _PLANNED:
    raise ValueError(f"`implementation={name!r}` is not built yet; available: "
                     f"{sorted(_IMPLEMENTATIONS)}.")
  raise ValueError(f"unknown `implementation={name!r}`; expected one of {sorted(_IMPLEMENTATIONS)} or None.")


def run_mixer(mixer: str, q, k, v, gates: Mapping[str, Any], *, scale=None, initial_state=None,
              output_final_state=False, segment_ids=None, cu_seqlens=None, chunk_size=64,
              return_residual=False, implementation=None):
  """Validates, dispatches and casts back. Shared body of the five linear mixers."""
  dims = check_qkv(q, k, v)
  checked = {name: check_gate(mixer, name, gates[name], axis, dims)
             for name, axis in MIXER_GATES[mixer]}
  scale = check_scale(scale, dims.dk)
  chunk_size = check_chunk_size(chunk_size)
  layout = check_segments(segment_ids, cu_seqlens, dims)
  initial_state = check_initial_state(initial_state, dims, layout)
  check_token_positions(dims.t, layout, chunk_size)
  impl = resolve_implementation(implementation)
  f32 = lambda x: x.astype(jnp.float32)
  o, final_state, r = impl(mixer, f32(q), f32(k), f32(v), checked, scale=scale,
                           initial_state=initial_state, layout=layout, chunk_size=chunk_size,
                           output_final_state=bool(output_final_state))
  o = o.astype(v.dtype)
  final_state = final_state if output_final_state else None
  if return_residual:
    return o, final_state, r.astype(v.dtype)
  return o, final_state


_COMMON_DOC = """scale: query scale, default K ** -0.5.
    initial_state: `[B, HV, K, V]` float32 (varlen: `[N, HV, K, V]`), or None for zeros.
    output_final_state: also return the state after the last real token (per sequence in varlen).
    segment_ids: `[B, T]` int; the state resets where the id changes, 0 marks padding (docs/MATH.md §1.7).
    cu_seqlens: `[N + 1]` int, FLA-style varlen with B = 1; sequence n starts from initial_state[n].
    chunk_size: rows per chunk of the chunked forms (a multiple of 16).
    return_residual: also return the write residual r `[B, T, HV, V]` (what CLER routes).
    implementation: "scan" (the reference), "chunk", "pallas_tpu", "pallas_gpu", or None for the
      best on the backend.

  Returns:
    `(o, final_state)`, or `(o, final_state, r)` with `return_residual=True`. o has v's dtype and
    shape `[B, T, HV, V]`; final_state is float32 `[B or N, HV, K, V]`, or None unless asked."""


def with_common_doc(fn):
  """Fills the keyword arguments every linear mixer shares into `fn`'s docstring."""
  fn.__doc__ = fn.__doc__.replace("{common}", _COMMON_DOC)
  return fn
