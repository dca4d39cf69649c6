"""Argument checks, segment handling and implementation choice shared by the public ops.

Every public op funnels through `run_mixer`: it validates shapes and dtypes (a `ValueError` that
names the argument and what was expected), checks values (below), turns `segment_ids` /
`cu_seqlens` into a `SegmentLayout`, picks the implementation and casts the results back.

Value checks (the contract of docs/OP_CONTRACT.md): concrete arrays (eager calls) are always
checked with numpy. Traced arrays (under `jax.jit`, `jax.grad`, `jax.vmap`, ...) are checked only
in checked mode, `checked(f)`, `debug_checks()`, `set_debug_checks(True)` or
`LINEAX_DEBUG_CHECKS=1`: each is reduced on device to a few numbers and checked with
`jax.experimental.checkify.check`, so a violation comes back as checkify's error (a `ValueError`
naming the argument) from the functionalized function. The mode is a `jax.make_user_context`, so
it is part of jit's cache key: flipping it retraces a jitted function instead of reusing a trace
made in the other mode.

Every mixer is a `specs.MixerSpec` (lineax_attn/ops/specs.py): its gates, their shapes and
ranges are read from there. Implementations register themselves by name with
`register_implementation`, optionally with `supports(call) -> None | reason`: for a `Call` it
rejects, dispatch runs "chunk" instead and logs the reason once (`select_implementation`).
`register_deferred_implementation` names the module instead, imported the first time the
implementation runs or its `supports` / tuning type is needed (the kernel modules pull in
Mosaic GPU / TPU and Pallas, seconds of import that a process not using them should not pay).
Each receives already-validated arrays and the mixer name (q, k, v upcast to float32, or in the
caller's dtypes for an implementation registered with `keeps_input_dtypes=True`, which then
upcasts itself where it computes in float32), and returns `(o, final_state, r)` in float32:

    impl(mixer, q, k, v, gates, *, scale, initial_state, layout, chunk_size,
         output_final_state, tuning) -> (o, final_state | None, r)

where `gates` is a dict of the mixer's gate arrays (float32) keyed by argument name, and
`tuning` is the implementation's static tuning (an instance of the `tuning_type` it registered
with, e.g. `pallas_gpu.GpuTuning`) or None for its default; an implementation registered
without a tuning type always gets None. Tunings are frozen, hashable values read at trace time,
so each distinct one is a separate trace under `jax.jit` (static arguments or closures).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import math
import os
from typing import Any, Callable, Mapping

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from lineax_attn.ops import segments as seg_lib
from lineax_attn.ops import specs

# Which gates each mixer takes, and the trailing axis each gate carries beyond [B, T, HV]:
# None = scalar per value head, "k" = per key channel, "v" = per value channel (`specs.Gate`).
MIXER_GATES: Mapping[str, tuple[tuple[str, str | None], ...]] = specs.SpecView("gate_axes")

_IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {}
# The tuning class each implementation accepts (None: it takes no tuning, only tuning=None).
_TUNING_TYPES: dict[str, type | None] = {}
# supports(call) -> None | reason, per implementation (None: it runs every call).
_SUPPORTS: dict[str, Callable[["Call"], str | None] | None] = {}
# Implementations that take q, k, v in the caller's dtypes (`register_implementation`).
_KEEPS_DTYPES: dict[str, bool] = {}
# The fallback reasons already logged, per implementation (one log line per reason).
_FALLBACK_LOGGED: dict[str, set[str]] = {}
FALLBACK = "chunk"


def register_implementation(name: str, fn: Callable[..., Any], *,
                            tuning_type: type | None = None,
                            supports: Callable[["Call"], str | None] | None = None,
                            keeps_input_dtypes: bool = False) -> None:
  """Registers `fn` as `implementation=name`.

  tuning_type: the class of the static `tuning=` values it accepts (None: it takes none).
  supports: `supports(call) -> None | reason` for a `Call`; where it gives a reason, `run_mixer`
    runs the "chunk" implementation instead and logs the reason once (None: `fn` runs all).
  keeps_input_dtypes: `fn` gets q, k, v in the caller's dtypes (a kernel that reads bf16 need
    not have a float32 copy made in memory first) and upcasts them itself.
  """
  _IMPLEMENTATIONS[name] = fn
  _TUNING_TYPES[name] = tuning_type
  _SUPPORTS[name] = supports
  _KEEPS_DTYPES[name] = bool(keeps_input_dtypes)
  _FALLBACK_LOGGED.setdefault(name, set())


class _Deferred:
  """Stands in `_IMPLEMENTATIONS` for an implementation whose module is not imported yet.

  Calling it imports the module and registers the real function (`_load`), so code that calls
  `_IMPLEMENTATIONS[name]` directly still works."""

  def __init__(self, name: str, module: str, fn: str, tuning_type: str | None,
               supports: str | None, keeps_input_dtypes: bool = False):
    self.name, self.module, self.fn = name, module, fn
    self.tuning_type, self.supports = tuning_type, supports
    self.keeps_input_dtypes = keeps_input_dtypes

  def __call__(self, *args, **kwargs):
    return _load(self.name)(*args, **kwargs)

  def __repr__(self):
    return f"<deferred implementation {self.name!r}: {self.module}.{self.fn}>"


def register_deferred_implementation(name: str, module: str, fn: str, *,
                                     tuning_type: str | None = None,
                                     supports: str | None = None,
                                     keeps_input_dtypes: bool = False) -> None:
  """Registers `implementation=name` as the attribute `fn` of `module`, imported on first use.

  tuning_type, supports: attribute names in `module` with the meaning they have in
  `register_implementation` (None: none). The module is imported when the implementation runs,
  when `select_implementation` asks its `supports`, or when `check_tuning` sees a tuning for it,
  whichever comes first; it is then registered with `register_implementation`.
  """
  _IMPLEMENTATIONS[name] = _Deferred(name, module, fn, tuning_type, supports,
                                     keeps_input_dtypes)
  _TUNING_TYPES[name] = None
  _SUPPORTS[name] = None
  _KEEPS_DTYPES[name] = bool(keeps_input_dtypes)
  _FALLBACK_LOGGED.setdefault(name, set())


def _load(name: str) -> Callable[..., Any]:
  """The function registered as `name`, importing its module first if it was deferred."""
  fn = _IMPLEMENTATIONS[name]
  if isinstance(fn, _Deferred):
    module = importlib.import_module(fn.module)
    register_implementation(
        name, getattr(module, fn.fn),
        tuning_type=None if fn.tuning_type is None else getattr(module, fn.tuning_type),
        supports=None if fn.supports is None else getattr(module, fn.supports),
        keeps_input_dtypes=fn.keeps_input_dtypes)
  return _IMPLEMENTATIONS[name]


def _deferred(name: str) -> _Deferred | None:
  fn = _IMPLEMENTATIONS.get(name)
  return fn if isinstance(fn, _Deferred) else None


def fallback_logged(name: str) -> set[str]:
  """The fallback reasons of implementation `name` logged so far (clear it to log them again)."""
  return _FALLBACK_LOGGED.setdefault(name, set())


def available_implementations() -> tuple[str, ...]:
  return tuple(_IMPLEMENTATIONS)


def default_implementation(backend: str | None = None) -> str:
  """The best implementation available on `backend` (default: jax's default backend).

  "pallas_tpu" on TPU, "pallas_gpu" on Hopper GPUs, "triton" on other NVIDIA GPUs where the
  optional `triton` extra is installed (for calls an implementation's `supports` rejects,
  `run_mixer` runs "chunk" instead), else the chunked pure-JAX form; the scan is an oracle, far
  too slow to train with.
  """
  backend = backend or jax.default_backend()
  if backend == "tpu" and "pallas_tpu" in _IMPLEMENTATIONS:
    return "pallas_tpu"
  if backend == "gpu" and "pallas_gpu" in _IMPLEMENTATIONS:
    from lineax_attn.ops import pallas_gpu  # pylint: disable=g-import-not-at-top
    if pallas_gpu.is_hopper():
      return "pallas_gpu"
  if backend == "gpu" and "triton" in _IMPLEMENTATIONS:
    from lineax_attn.ops import triton_gpu  # pylint: disable=g-import-not-at-top
    if triton_gpu.available():
      return "triton"
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


# ----------------------------------------------------------------------------------------------
# Checked mode and value checks.

_DEBUG_CHECKS_ENV = "LINEAX_DEBUG_CHECKS"


def _env_debug_checks() -> bool:
  raw = os.environ.get(_DEBUG_CHECKS_ENV, "").strip().lower()
  if raw in ("", "0", "false", "no", "off"):
    return False
  if raw in ("1", "true", "yes", "on"):
    return True
  raise ValueError(f"environment variable `{_DEBUG_CHECKS_ENV}` must be 0 or 1 (or false/true), "
                   f"got {raw!r}.")


# A jit-cache-sensitive context: a function jitted with checks off is retraced, not reused, when
# it is called with checks on (and back), so a cached trace is never silently unchecked.
_DEBUG_CHECKS = jax.make_user_context(default_value=_env_debug_checks())


def _check_enabled_arg(enabled) -> bool:
  if not isinstance(enabled, (bool, np.bool_)):
    raise ValueError(f"`enabled` must be a bool, got {enabled!r}.")
  return bool(enabled)


def debug_checks(enabled: bool = True):
  """Context manager: checked mode on (or off) in this thread, restored on exit.

  In checked mode the ops also check their *traced* arguments against the value contract
  (docs/OP_CONTRACT.md): gates finite and in range (g <= 0; beta, b in [0, 2]; w in [0, 1]),
  `cu_seqlens` strictly increasing from 0 to T, `segment_ids` >= 0, and no NaN/Inf in q, k, v or
  `initial_state`. The checks are `jax.experimental.checkify` checks, so a jitted function must
  be functionalized to run them, or its compile fails with "Cannot abstractly evaluate a
  checkify.check which was not functionalized": use `checked(f)`, or

      f_checked = jax.jit(checkify.checkify(f))
      with lineax_attn.ops.debug_checks():
        err, out = f_checked(*args)
      err.throw()     # ValueError subclass: "`g` is a log decay and must be <= 0 ..."

  The mode is read when a function is traced, and it is part of `jax.jit`'s cache key: a
  function jitted earlier with checks off is retraced (checked) when called with checks on, and
  its unchecked trace is reused again once they are off.

  Args:
    enabled: True to check traced values, False to switch checked mode off inside the block.
  """
  return _DEBUG_CHECKS(_check_enabled_arg(enabled))


def set_debug_checks(enabled: bool) -> None:
  """Switches checked mode on or off for the whole process (see `debug_checks`).

  `LINEAX_DEBUG_CHECKS=1` in the environment sets the same default at import. A
  `debug_checks(...)` block overrides it in its thread.
  """
  _DEBUG_CHECKS.set_global(_check_enabled_arg(enabled))


def debug_checks_enabled() -> bool:
  """Whether checked mode is on here (this thread's `debug_checks` block, else the global)."""
  return bool(_DEBUG_CHECKS.value)


def checked(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn` with the ops' value checks on traced arguments: it is traced in checked mode and
  functionalized with `checkify.checkify`, and a violation is raised as a `ValueError` (checkify's
  `JaxRuntimeError`) naming the argument, after the call.

  Pass a jitted function, `checked(jax.jit(step))(state, batch)`: checkify then retraces only the
  outer call each time, without recompiling; an unjitted `fn` is traced in full on every call.
  Works with `jax.grad`, `jax.vmap`, sharded `jax.jit` and `jax.shard_map` inside `fn`.
  """
  if not callable(fn):
    raise ValueError(f"`fn` must be callable, got {type(fn).__name__}.")
  functionalized = checkify.checkify(fn)

  @functools.wraps(fn)
  def run(*args, **kwargs):
    with debug_checks(True):
      err, out = functionalized(*args, **kwargs)
    err.throw()
    return out

  return run


# The closed range each gate must lie in (None: unbounded), from the specs (`specs.Gate`). beta
# and b are write/erase strengths, σ(·) ∈ (0, 1) from the layer, or 2σ(·) ∈ (0, 2) with negative
# eigenvalues (`allow_neg_eigval`): with unit keys I − β k kᵀ has eigenvalues in [−1, 1] exactly
# for β ∈ [0, 2]. Keyed by gate name: a name means the same range in every mixer.
GATE_RANGES: dict[str, tuple[float | None, float | None]] = {
    gate.name: (gate.low, gate.high) for spec in specs.SPECS.values() for gate in spec.gates}


# A rule maps (xp, x) to a list of (ok, message template, format values), computed with numpy
# (xp = np: concrete arrays, checked now) or jax.numpy (xp = jnp: traced arrays, checked by
# checkify at run time). The templates are shared, so eager and checked-mode errors read the same.

def _finite_rule(name):
  def rule(xp, x):
    return [(xp.all(xp.isfinite(x)), f"`{name}` contains NaN or Inf.", {})]
  return rule


def _gate_rule(gate: specs.Gate):
  name, low, high = gate.name, gate.low, gate.high

  def rule(xp, x):
    finite = xp.isfinite(x)
    lo = xp.min(xp.where(finite, x, xp.inf)).astype(xp.float32)
    hi = xp.max(xp.where(finite, x, -xp.inf)).astype(xp.float32)
    checks = [(xp.all(finite), f"`{name}` contains NaN or Inf.", {})]
    if gate.is_log_decay:
      checks.append((hi <= high, f"`{name}` is a log decay and must be <= 0 everywhere "
                     "(got max {hi}).", {"hi": hi}))
    else:
      checks.append((xp.logical_and(lo >= low, hi <= high),
                     f"`{name}` must lie in [{low:g}, {high:g}] everywhere, got min {{lo}}, max {{hi}}.",
                     {"lo": lo, "hi": hi}))
    return checks
  return rule


def _segment_ids_rule(xp, x):
  lowest = xp.min(x)
  return [(lowest >= 0, "`segment_ids` must be >= 0 (0 marks padding), got min {lowest}.",
           {"lowest": lowest})]


def _cu_seqlens_rule(t):
  def rule(xp, cu):
    ok = xp.logical_and(xp.logical_and(cu[0] == 0, cu[-1] == t), xp.all(cu[1:] > cu[:-1]))
    return [(ok, f"`cu_seqlens` must be strictly increasing from 0 to T={t}, got {{cu}}.", {"cu": cu})]
  return rule


def _check_values(x, rule, *, always: bool = True) -> None:
  """Checks `x` against `rule`: at once with numpy (a ValueError) if it is concrete and the check
  is `always` on or checked mode is; with `checkify.check` if it is traced and checked mode is on."""
  if _is_concrete(x):
    if always or debug_checks_enabled():
      floating = jnp.issubdtype(x.dtype, jnp.floating)
      for ok, template, values in rule(np, np.asarray(x, np.float32) if floating else np.asarray(x)):
        if not ok:
          raise ValueError(template.format(**values))
  elif debug_checks_enabled():
    for ok, template, values in rule(jnp, x):
      checkify.check(ok, template, **values)


def check_finite(named_arrays) -> None:
  """Checked mode only: no NaN/Inf in the (name, array) pairs (None arrays are skipped)."""
  for name, x in named_arrays:
    if x is not None:
      _check_values(x, _finite_rule(name), always=False)


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
  """Validates one gate's dtype and shape, then its values: finite and in the range of its
  `specs.Gate` (concrete arrays always, traced ones in checked mode). Returns it as float32."""
  gate = specs.resolve(mixer).gate(name)
  _check_float(name, x)
  shape = (dims.b, dims.t, dims.hv)
  desc = "[B, T, HV]"
  if axis == "k":
    shape, desc = shape + (dims.dk,), "[B, T, HV, K]"
  elif axis == "v":
    shape, desc = shape + (dims.dv,), "[B, T, HV, V]"
  _check_shape(name, x, shape, desc + f" for {mixer}")
  _check_values(x, _gate_rule(gate))
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
  """Validates `segment_ids` / `cu_seqlens` (values: see `_check_values`) and builds the layout."""
  if segment_ids is not None and cu_seqlens is not None:
    raise ValueError("pass at most one of `segment_ids` and `cu_seqlens`, not both.")
  if segment_ids is not None:
    if not hasattr(segment_ids, "dtype") or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"`segment_ids` must be an integer array [B, T], got dtype "
                       f"{getattr(segment_ids, 'dtype', type(segment_ids).__name__)}.")
    _check_shape("segment_ids", segment_ids, (dims.b, dims.t), "[B, T]")
    _check_values(segment_ids, _segment_ids_rule)
    return seg_lib.layout_from_segment_ids(jnp.asarray(segment_ids))
  if cu_seqlens is not None:
    if not hasattr(cu_seqlens, "dtype") or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
      raise ValueError(f"`cu_seqlens` must be an integer array [N + 1], got dtype "
                       f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}.")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
      raise ValueError(f"`cu_seqlens` must have shape [N + 1] with N >= 1, got {tuple(cu_seqlens.shape)}.")
    if dims.b != 1:
      raise ValueError(f"`cu_seqlens` (varlen mode) needs batch size B = 1, got B = {dims.b}.")
    _check_values(cu_seqlens, _cu_seqlens_rule(dims.t))
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


def resolve_implementation(implementation: str | None) -> str:
  """The registered implementation name `implementation` stands for (None: the default)."""
  name = default_implementation() if implementation is None else implementation
  if name in _IMPLEMENTATIONS:
    return name
  raise ValueError(f"unknown `implementation={name!r}`; expected one of {sorted(_IMPLEMENTATIONS)} or None.")


def check_tuning(tuning, name: str):
  """`tuning` for the implementation registered as `name`: None, or an instance of its
  `tuning_type` (ValueError naming `tuning` otherwise)."""
  if tuning is None:
    return None
  deferred = _deferred(name)
  if deferred is not None and deferred.tuning_type is not None:
    _load(name)
  tuning_type = _TUNING_TYPES.get(name)
  if tuning_type is None:
    raise ValueError(f"`tuning` must be None for implementation={name!r} (it takes no tuning), "
                     f"got {tuning!r}.")
  if not isinstance(tuning, tuning_type):
    raise ValueError(f"`tuning` for implementation={name!r} must be a {tuning_type.__name__} or "
                     f"None, got {tuning!r}.")
  return tuning


@dataclasses.dataclass(frozen=True)
class Call:
  """What an implementation's `supports(call)` sees: the validated, static facts of one call."""
  spec: specs.MixerSpec
  dims: Dims
  chunk_size: int
  varlen: bool
  tuning: Any


def select_implementation(name: str, call: Call) -> str:
  """`name`, or "chunk" where `name`'s `supports(call)` gives a reason (logged once per reason,
  on the implementation's logger `lineax_attn.ops.<name>`, like FLA's backend `verify()`)."""
  deferred = _deferred(name)
  if deferred is not None and deferred.supports is not None:
    _load(name)
  supports = _SUPPORTS.get(name)
  reason = None if supports is None else supports(call)
  if not reason:
    return name
  logged = fallback_logged(name)
  if reason not in logged:
    logged.add(reason)
    logging.getLogger(f"lineax_attn.ops.{name}").warning(
        "%s: %s; %s falls back to implementation=%r.", name, reason, call.spec.name, FALLBACK)
  return FALLBACK


def run_mixer(mixer: str, q, k, v, gates: Mapping[str, Any], *, scale=None, initial_state=None,
              output_final_state=False, segment_ids=None, cu_seqlens=None, chunk_size=64,
              return_residual=False, implementation=None, tuning=None):
  """Validates, dispatches and casts back. Shared body of the linear mixers."""
  spec = specs.resolve(mixer)
  mixer = spec.name
  dims = check_qkv(q, k, v)
  checked = {gate.name: check_gate(mixer, gate.name, gates[gate.name], gate.axis, dims)
             for gate in spec.gates}
  scale = check_scale(scale, dims.dk)
  chunk_size = check_chunk_size(chunk_size)
  layout = check_segments(segment_ids, cu_seqlens, dims)
  initial_state = check_initial_state(initial_state, dims, layout)
  check_token_positions(dims.t, layout, chunk_size)
  check_finite((("q", q), ("k", k), ("v", v), ("initial_state", initial_state)))
  name = resolve_implementation(implementation)
  tuning = check_tuning(tuning, name)
  selected = select_implementation(name, Call(spec=spec, dims=dims, chunk_size=chunk_size,
                                              varlen=layout.is_varlen, tuning=tuning))
  if selected != name:  # the fallback runs with its own default tuning
    name, tuning = selected, None
  impl = _load(name)
  f32 = lambda x: x.astype(jnp.float32)
  qkv = (q, k, v) if _KEEPS_DTYPES.get(name) else (f32(q), f32(k), f32(v))
  o, final_state, r = impl(mixer, *qkv, checked, scale=scale,
                           initial_state=initial_state, layout=layout, chunk_size=chunk_size,
                           output_final_state=bool(output_final_state), tuning=tuning)
  o = o.astype(v.dtype)
  final_state = final_state if output_final_state else None
  if return_residual:
    return o, final_state, r.astype(v.dtype)
  return o, final_state


_COMMON_DOC = """scale: query scale, default K ** -0.5.
    initial_state: `[B, HV, K, V]` float32 (varlen: `[N, HV, K, V]`), or None for zeros.
    output_final_state: also return the state after the last real token (per sequence in varlen).
    segment_ids: `[B, T]` int >= 0; the state resets where the id changes, 0 marks padding
      (docs/MATH.md §1.7).
    cu_seqlens: `[N + 1]` int, strictly increasing from 0 to T, FLA-style varlen with B = 1;
      sequence n starts from initial_state[n].
    chunk_size: rows per chunk of the chunked forms (a multiple of 16).
    return_residual: also return the write residual r `[B, T, HV, V]` (what CLER routes).
    implementation: "scan" (the reference), "chunk", "pallas_tpu", "pallas_gpu", "triton", or
      None for the best on the backend.
    tuning: implementation-specific static tuning (e.g. `pallas_gpu.GpuTuning`); None = the
      implementation's default. A frozen, hashable value read at trace time: each distinct
      tuning is its own trace under `jax.jit`. Implementations without tuning take only None.

  q, k, v may have any float dtype and gates may be float32, bfloat16 or float16; all are upcast
  to float32 inside, and states are always float32.

  Returns:
    `(o, final_state)`, or `(o, final_state, r)` with `return_residual=True`. o has v's dtype and
    shape `[B, T, HV, V]`; final_state is float32 `[B or N, HV, K, V]`, or None unless asked.

  Raises:
    ValueError: naming the argument, for a wrong shape, dtype or option (a `tuning` that is not
      the chosen implementation's tuning type, too), and for a value outside
      the contract where the array is concrete (eager calls): a gate with NaN/Inf or out of range
      (g <= 0; beta, b in [0, 2]; w in [0, 1]), `cu_seqlens` not strictly increasing from 0 to
      T, a negative `segment_ids`. Traced values (under `jax.jit`, `jax.grad`, `jax.vmap`) are
      checked only in checked mode: `lineax_attn.ops.checked(jax.jit(f))(...)` runs the same
      checks, plus NaN/Inf in q, k, v and initial_state, through `jax.experimental.checkify` and
      raises checkify's error (a ValueError subclass) with the same text. See docs/OP_CONTRACT.md."""


def make_op(spec: specs.MixerSpec) -> Callable[..., Any]:
  """The public op of `spec`: `op(q, k, v, *gates, scale=None, ...)` with the gates as
  positional (or keyword) arguments in the spec's order, over `run_mixer`."""
  gate_names = spec.gate_names

  def op(q, k, v, *gate_args, scale=None, initial_state=None, output_final_state=False,
         segment_ids=None, cu_seqlens=None, chunk_size=64, return_residual=False,
         implementation=None, tuning=None, **gate_kwargs):
    if len(gate_args) + len(gate_kwargs) != len(gate_names) or not set(gate_kwargs) <= set(
        gate_names[len(gate_args):]):
      raise ValueError(f"{spec.name} takes the gates {gate_names} (after q, k, v), got "
                       f"{len(gate_args)} positional and {sorted(gate_kwargs)} by keyword.")
    gates = dict(zip(gate_names, gate_args), **gate_kwargs)
    return run_mixer(spec.name, q, k, v, gates, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, segment_ids=segment_ids,
                     cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                     return_residual=return_residual, implementation=implementation,
                     tuning=tuning)

  positional = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                for n in ("q", "k", "v") + gate_names]
  keywords = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d) for n, d in (
      ("scale", None), ("initial_state", None), ("output_final_state", False),
      ("segment_ids", None), ("cu_seqlens", None), ("chunk_size", 64),
      ("return_residual", False), ("implementation", None), ("tuning", None))]
  op.__signature__ = inspect.Signature(positional + keywords)
  op.__name__ = op.__qualname__ = spec.name
  op.__module__ = "lineax_attn.ops"
  gate_doc = "".join(f"\n    {g.name}: `{_GATE_SHAPE_DOC[g.axis]}` {g.doc}." for g in spec.gates)
  op.__doc__ = (f"{spec.name}: {spec.summary}.\n\n  Args:\n    q, k: `[B, T, H, K]` queries and keys "
                f"(L2-normalised by the layer; scaled here by `scale`)."
                f"\n    v: `[B, T, HV, V]` values; HV must be a multiple of H (value head j reads "
                f"key head j // (HV/H)).{gate_doc}"
                f"\n    {_COMMON_DOC}\n  ")
  return op


_GATE_SHAPE_DOC = {None: "[B, T, HV]", "k": "[B, T, HV, K]", "v": "[B, T, HV, V]"}
