"""Reusable pieces of the benchmark programs: timing, random inputs, error metric, tables.

    fwd = jax.jit(f)
    ms = time_fn(fwd, *args, repeats=10, warmup=3)      # median wall time, compile excluded

Methodology (docs/MATH.md §7.3): compile once (the first call, untimed), run `warmup` more calls,
then time `repeats` calls one by one with `jax.block_until_ready`; report the median (and the
20/80 percentiles with `measure`; `measure_with_output` also keeps the first call's output,
`compiled_memory_bytes` reads a compiled executable's memory). `interleave` times several
variants in rounds whose order rotates, each call waited for or queued (`time_round`), after a
second of untimed calls that lets an idle GPU's clocks rise (`settle`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lineax_attn.ops import specs


@dataclasses.dataclass(frozen=True)
class Timing:
  """Wall times of one function in milliseconds over `repeats` timed calls."""

  median_ms: float
  p20_ms: float
  p80_ms: float
  repeats: int

  @classmethod
  def from_times(cls, times_ms: Sequence[float]) -> Timing:
    """The median and 20/80 percentiles (linearly interpolated) of wall times in ms; for calls
    timed elsewhere (e.g. torch with its own synchronisation)."""
    if len(times_ms) < 1:
      raise ValueError("times_ms is empty: need at least one timed call.")
    p20, p50, p80 = np.percentile(times_ms, [20, 50, 80])
    return cls(median_ms=float(p50), p20_ms=float(p20), p80_ms=float(p80), repeats=len(times_ms))


def _check_counts(repeats: int, warmup: int) -> None:
  if repeats < 1 or warmup < 0:
    raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}.")


def _time_calls(fn: Callable[..., Any], args, repeats: int, warmup: int,
                settle_s: float = 0.0) -> Timing:
  """`settle_s` seconds of untimed calls (`settle`, where > 0), `warmup` more, then `repeats`
  timed one by one (after the first call)."""
  if settle_s > 0:
    settle({"fn": Step(lambda: fn(*args), jax.block_until_ready)}, settle_s)
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return Timing.from_times(times)


def _check_settle(settle_s: float) -> None:
  if settle_s < 0:
    raise ValueError(f"settle_s must be >= 0, got {settle_s}")


def measure(fn: Callable[..., Any], *args, repeats: int = 10, warmup: int = 3,
            settle_s: float = 0.0) -> Timing:
  """Times `fn(*args)`: one untimed call (compiles a jitted fn), `settle_s` seconds of untimed
  calls (for a GPU left idle by the compile: `settle`), `warmup` calls, `repeats` timed."""
  _check_counts(repeats, warmup)
  _check_settle(settle_s)
  jax.block_until_ready(fn(*args))  # compile (and first-run allocation) stays out of the numbers
  return _time_calls(fn, args, repeats, warmup, settle_s)


def measure_with_output(fn: Callable[..., Any], *args, repeats: int = 10, warmup: int = 3,
                        settle_s: float = 0.0) -> tuple[Timing, Any]:
  """`measure`, also returning the output of the first (untimed) call, so a benchmark can check
  the numbers it timed without one more call. The output stays alive while the rest is timed
  (`measure` drops it at once: use that where memory is tight)."""
  _check_counts(repeats, warmup)
  _check_settle(settle_s)
  out = jax.block_until_ready(fn(*args))
  return _time_calls(fn, args, repeats, warmup, settle_s), out


# Interleaved rounds (`experiments/bench_ab.py`, `bench_t0.py`): how a round times a call.
TIMINGS = ("waited", "queued")


class Step(NamedTuple):
  """A variant's call, launched without waiting for it, and how to wait for what it returns."""
  call: Callable[[], Any]
  wait: Callable[[Any], Any]


def time_round(step, iters: int, warmup: int, timing: str = "waited") -> float:
  """One round of a variant, ms a call. timing "waited": the median of `iters` calls, each
  waited for (the host's dispatch and the wait are in every number); "queued": `iters` calls
  launched back to back and waited for once, the total over iters (the device's time a call
  when the host keeps ahead, as in training). step: a `Step`, or a plain callable that waits
  by itself."""
  if not isinstance(step, Step):
    step = Step(step, lambda _: None)
  for _ in range(warmup):
    step.wait(step.call())
  if timing == "queued":
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):   # (in-order on one device: waiting for the last waits for all)
      out = step.call()
    step.wait(out)
    return (time.perf_counter() - t0) * 1e3 / iters
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    step.wait(step.call())
    times.append((time.perf_counter() - t0) * 1e3)
  return Timing.from_times(times).median_ms


def settle(steps: dict, seconds: float, iters: int = 1, timing: str = "waited") -> int:
  """Untimed rounds of every step in turn (`time_round` with `iters` and `timing`, no warm-up)
  until `seconds` have passed (at least one round); returns how many rounds ran.

  Why: a GPU left idle (while the steps compiled) starts timing at low clocks: in 34 of the 96
  `bench_ab` runs in docs/data up to 2026-12-07 the first variant's first round was over 1.15x
  its median (up to 3x), and a round's `warmup` of a few calls did not hide it. And the first
  burst of queued calls is slow by itself: one variant alone (linear attention's must row) ran
  its first queued round at 2-3x the rest in all eight runs up to 2026-12-07, after a second of
  waited calls too; so `interleave` settles in the rounds' own mode."""
  if seconds < 0:
    raise ValueError(f"seconds must be >= 0, got {seconds}")
  t0, done = time.perf_counter(), 0
  while True:
    for step in steps.values():
      time_round(step, iters, 0, timing)
    done += 1
    if time.perf_counter() - t0 >= seconds:
      return done


def interleave(steps: dict, rounds: int, iters: int, warmup: int,
               timing: str = "waited", settle_s: float = 1.0) -> dict[str, list[float]]:
  """Per variant, its time (ms a call) in each round; the order rotates by one each round.
  The steps first run untimed rounds for `settle_s` seconds (`settle`; 0: one round)."""
  if timing not in TIMINGS:
    raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
  names = list(steps)
  settle(steps, settle_s, iters, timing)
  medians = {n: [] for n in names}
  for r in range(rounds):
    for n in names[r % len(names):] + names[:r % len(names)]:
      medians[n].append(time_round(steps[n], iters, warmup, timing))
  return medians


def compiled_memory_bytes(compiled) -> int | None:
  """Device memory of a compiled executable (`jax.jit(f).lower(...).compile()`): arguments +
  outputs + temporaries − donated (aliased) buffers, from its `memory_analysis()`; None where
  the backend reports none."""
  try:
    memory = compiled.memory_analysis()
  except Exception:  # noqa: BLE001  (not every backend implements it)
    return None
  if memory is None:
    return None
  return int(memory.argument_size_in_bytes + memory.output_size_in_bytes
             + memory.temp_size_in_bytes - memory.alias_size_in_bytes)


def time_fn(fn: Callable[..., Any], *args, repeats: int = 10, warmup: int = 3) -> float:
  """Median milliseconds of `fn(*args)`, compile excluded (see `measure`)."""
  return measure(fn, *args, repeats=repeats, warmup=warmup).median_ms


def forward_backward(fn: Callable[..., jax.Array]) -> Callable[..., Any]:
  """`(cotangent, *args) -> (loss, grads of every arg)` for `fn(*args) -> array`.

  The loss is <fn(*args), cotangent> in float32, so the backward pass sees a dense random
  cotangent, as in training. Not jitted: wrap it in `jax.jit` before timing.
  """

  def loss(args, cotangent):
    return jnp.sum(fn(*args).astype(jnp.float32) * cotangent)

  grad_fn = jax.value_and_grad(loss)
  return lambda cotangent, *args: grad_fn(args, cotangent)


# Bounds on `max_rel_err` (max|o − o_ref| / max|o_ref|) above which a benchmark row is marked
# wrong and the program exits non-zero. They are loose on purpose: a benchmark catches broken
# numbers (a miscompile reads 1e+34), the tests hold the tight tolerances. float32 paths agree
# with the scan to ~1e-6; bf16/fp16 inputs or matmul operands (pallas_gpu's kernels, cuDNN)
# round at ~4e-3 per element and accumulate to ~1e-2 worst-case over a row.
MAX_REL_ERR_FLOAT32 = 1e-3
MAX_REL_ERR_LOW_PRECISION = 5e-2
# Implementations whose matmul operands are bf16 whatever the input dtype.
LOW_PRECISION_IMPLEMENTATIONS = ("pallas_gpu", "triton", "cudnn")


def error_tolerance(dtype, implementation: str) -> float:
  """The `max_rel_err` bound for a row of `implementation` on inputs of `dtype`."""
  low = (jnp.dtype(dtype) != jnp.float32) or implementation in LOW_PRECISION_IMPLEMENTATIONS
  return MAX_REL_ERR_LOW_PRECISION if low else MAX_REL_ERR_FLOAT32


def error_verdict(err: float | None, tol: float) -> str:
  """"ok", "" (no error measured) or "WRONG: ..." for a row's error against its bound."""
  if err is None:
    return ""
  if np.isfinite(err) and err <= tol:
    return "ok"
  return f"WRONG: max rel err {err:.2e} > {tol:.0e}"


def max_rel_err(x, ref) -> float:
  """max|x − ref| / max|ref| in float64 (0 when both are 0): a worst-case relative error."""
  x = np.asarray(x, np.float64)
  ref = np.asarray(ref, np.float64)
  if x.shape != ref.shape:
    raise ValueError(f"shape mismatch: {x.shape} vs {ref.shape}")
  num = float(np.max(np.abs(x - ref), initial=0.0))
  den = float(np.max(np.abs(ref), initial=0.0))
  if not np.isfinite(num):
    return float("inf")
  if den == 0.0:
    return 0.0 if num == 0.0 else float("inf")
  return num / den


H200_HBM_TB_S = 4.8   # HBM3e peak of an H200 (the floor's bandwidth; copies reach ~4.3)
H100_HBM_TB_S = 3.35  # HBM3 peak of an H100 SXM ("NVIDIA H100 80GB HBM3")


def hbm_tb_s(device_kind: str) -> float:
  """The peak HBM bandwidth (TB/s) of the GPU `device_kind` names, for the traffic floor: an
  H100 SXM's, else an H200's (the issue's machine; other GPUs have no floor of their own yet)."""
  if not isinstance(device_kind, str):
    raise ValueError(f"device_kind must be a str, got {device_kind!r}.")
  if "H100" in device_kind and "HBM3" in device_kind:
    return H100_HBM_TB_S
  return H200_HBM_TB_S


def sweep_rise(times) -> str:
  """The rise of a T sweep at fixed tokens, slowest over fastest, as its table prints it: "–"
  below two known points, and "(n of m points)" after it where some points have no time (None:
  skipped by a time budget, or failed)."""
  known = [x for x in times if x is not None]
  if len(known) < 2:
    return "–"
  rise = f"{max(known) / min(known):.2f}x"
  return rise if len(known) == len(times) else f"{rise} ({len(known)} of {len(times)} points)"


def sweep_timing_order(points):
  """The order a T sweep's points (B, T, ...) are timed in: the longest T, the shortest, then the
  rest from long to short. A time budget skips the points it would overrun, so it then drops
  inner points and keeps both ends of the rise (2026-12-07 a 200 s budget lost GDN's T 65,536,
  the one point that decides whether the sweep is flat, when the points ran short to long)."""
  by_t = sorted(points, key=lambda p: p[1])
  if len(by_t) <= 2:
    return by_t[::-1]
  return [by_t[-1], by_t[0]] + by_t[-2:0:-1]


def traffic_floor_ms(mixer: str, mode: str, *, batch: int, seq_len: int, heads: int,
                     v_heads: int, head_dim_k: int, head_dim_v: int, io_bytes: int = 2,
                     gate_bytes: int = 4, tb_s: float = H200_HBM_TB_S) -> float:
  """The time an op cannot beat at `tb_s` TB/s: its inputs read and outputs written once.

  fwd reads q, k, v (`io_bytes` each element) and the gates (`gate_bytes`, shapes from the
  spec) and writes o; "fwdbwd" adds the backward's minimum, reading q, k, v, the gates and do
  and writing dq, dk, dv and the gates' cotangents (states and chunk intermediates kept on
  chip or recomputed: a floor, not a design). Compute is not the bound at these shapes (the
  chunked form's FLOPs take a few µs at the tensor peak).
  """
  if mode not in ("fwd", "fwdbwd"):
    raise ValueError(f"mode must be 'fwd' or 'fwdbwd', got {mode!r}.")
  spec = specs.resolve(mixer)
  b, t, h, hv, dk, dv = batch, seq_len, heads, v_heads, head_dim_k, head_dim_v
  qk, vo = 2 * b * t * h * dk * io_bytes, b * t * hv * dv * io_bytes
  gates = sum(int(np.prod(specs.gate_shape(g, b=b, t=t, hv=hv, dk=dk, dv=dv)))
              for g in spec.gates) * gate_bytes
  fwd = qk + vo + gates + vo                       # q, k, v, gates in; o out
  total = fwd if mode == "fwd" else fwd + (qk + vo + gates + vo) + (qk + vo + gates)
  return total / (tb_s * 1e12) * 1e3


def _l2norm(x):
  return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def mixer_inputs(mixer: str, *, batch: int, seq_len: int, heads: int, v_heads: int,
                 head_dim_k: int, head_dim_v: int, dtype=jnp.float32, seed: int = 0):
  """Random positional inputs of `lineax_attn.ops.<mixer>` as in docs/MATH.md §9.

  q, k `[B, T, H, K]` unit-norm, v `[B, T, HV, V]` ~ N(0, 1) in `dtype`; float32 gates drawn as
  `specs.random_gates` (β, b, w = σ(N(0, 1)), g = logsigmoid(N(0, 1)), each gate's shape from
  its spec), here with jax.random on the device (benchmark shapes are large).
  """
  b, t, h, hv, dk, dv = batch, seq_len, heads, v_heads, head_dim_k, head_dim_v
  if mixer not in specs.SPECS:
    raise ValueError(f"unknown mixer {mixer!r}; expected one of {sorted(specs.SPECS)}.")
  spec = specs.SPECS[mixer]
  keys = jax.random.split(jax.random.key(seed), 3 + len(spec.gates))
  n = lambda i, shape: jax.random.normal(keys[i], shape, jnp.float32)
  q = _l2norm(n(0, (b, t, h, dk))).astype(dtype)
  k = _l2norm(n(1, (b, t, h, dk))).astype(dtype)
  v = n(2, (b, t, hv, dv)).astype(dtype)
  gate_key = {name: 3 + i for i, name in enumerate(spec.gate_names)}
  gates = specs.random_gates(spec, lambda name, shape: n(gate_key[name], shape), b=b, t=t, hv=hv,
                             dk=dk, dv=dv)
  return (q, k, v) + gates


def attention_inputs(*, batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                     dtype=jnp.float32, seed: int = 0):
  """Random q `[B, T, H, D]`, k and v `[B, T, H_kv, D]` ~ N(0, 1) for `softmax_attention`."""
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (batch, seq_len, heads, head_dim), jnp.float32)
  k = jax.random.normal(keys[1], (batch, seq_len, kv_heads, head_dim), jnp.float32)
  v = jax.random.normal(keys[2], (batch, seq_len, kv_heads, head_dim), jnp.float32)
  return tuple(x.astype(dtype) for x in (q, k, v))


def _cell(value: Any) -> str:
  if value is None:
    return ""
  if isinstance(value, float):
    if not np.isfinite(value):
      return str(value)
    return f"{value:.2e}" if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e5) else f"{value:.3f}"
  return str(value)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
  """A Markdown table; `columns` are (key in each row, header). Missing keys print empty."""
  lines = ["| " + " | ".join(header for _, header in columns) + " |",
           "|" + "|".join("---" for _ in columns) + "|"]
  for row in rows:
    lines.append("| " + " | ".join(_cell(row.get(key)) for key, _ in columns) + " |")
  return "\n".join(lines)


def write_json(path: str, rows: Sequence[Mapping[str, Any]], **metadata) -> None:
  """Writes `{"metadata": ..., "rows": [...]}`; non-finite floats become null."""
  clean = lambda v: None if isinstance(v, float) and not np.isfinite(v) else v
  payload = {"metadata": metadata, "rows": [{k: clean(v) for k, v in r.items()} for r in rows]}
  with open(path, "w") as f:
    json.dump(payload, f, indent=2)
    f.write("\n")
