r"""Where one call of an op spends its GPU time: every kernel it launches, from a profiler trace.

`bench_kernels` says how long an op takes; this says what the time is made of, kernel by kernel
(the Triton and Mosaic GPU kernels, XLA's fusions and copies, cuBLAS), so that the next
optimisation goes where the time is. Each (mixer, implementation, mode) is compiled, run twice,
then run `--iters` times under `jax.profiler.trace`; the trace's device events are summed per
kernel and divided by the calls:

    python -m experiments.op_profile --mixers=gated_delta_rule,kda --impls=triton,pallas_gpu \
        --shape=4,4096,16,128 --modes=fwdbwd --out_md=/tmp/profile.md --out_json=/tmp/p.json

Table: per op, each kernel's launches per call, µs per call and share of the device time, and
the op's device time beside its wall time (their gap: launch overhead and idle device). Each
call's span on the device (first kernel start to last kernel end: the device's "XLA Modules"
line where the trace has one, else the calls cut at the kernels' widest gaps) is split into
busy (the union of its kernels' intervals) and idle (the gaps: launch latency, host work
inside the call, waits). Summed kernel times above busy mean kernels ran side by side (e.g.
independent nodes of a CUDA graph). A
kernel is named by its CUDA name and, where the trace has it, the HLO op that launched it (so
the `_fwd_kernel`s of different Triton modules are told apart by their custom call).
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile
import time

from absl import app, flags
import jax
import jax.numpy as jnp

from experiments import cli

# The program's own flag set (not absl's global one): its names are the other benchmarks' too,
# and tests import several programs into one process.
FLAGS = flags.FlagValues()
_MIXERS = flags.DEFINE_list("mixers", "gated_delta_rule,kda", "Ops of lineax_attn.ops to profile.",
                            flag_values=FLAGS)
_IMPLS = flags.DEFINE_list("impls", "triton,pallas_gpu",
                           "Implementations to profile, each optionally with a GpuTuning "
                           "('pallas_gpu@forward=walk'); 'jla' profiles jax-linear-attention's "
                           "Mosaic GPU kernels for the same op.",
                           flag_values=FLAGS)
_SHAPE = flags.DEFINE_string("shape", "4,4096,16,128", "B,T,H,D (K = V = D, HV = H).",
                             flag_values=FLAGS)
_MODES = flags.DEFINE_list("modes", "fwd,fwdbwd", "Of fwd, fwdbwd, fwdbwd_dep (the cotangent "
                           "made from the output), fwdbwd_grads (the gradients alone: what XLA "
                           "drops when the loss is not returned), as `bench_ab` times them: "
                           "`peer_ops.MODES` (with XLA_FLAGS=--xla_enable_command_buffers_during_"
                           "profiling=true the trace keeps the timed run's CUDA graphs).",
                           flag_values=FLAGS)
_ITERS = flags.DEFINE_integer("iters", 5, "Traced calls (after two untraced ones).",
                              flag_values=FLAGS)
_TOP = flags.DEFINE_integer("top", 25, "Kernels listed per op (the rest summed in one row).",
                            flag_values=FLAGS)
_OUT_MD = flags.DEFINE_string("out_md", "", "Markdown tables.", flag_values=FLAGS)
_OUT_JSON = flags.DEFINE_string("out_json", "", "Rows as JSON.", flag_values=FLAGS)
_HLO_DIR = flags.DEFINE_string("hlo_dir", "", "Where to write each op's compiled HLO text "
                               "(MIXER_IMPL_MODE.hlo.txt): what XLA's fusions between the "
                               "kernels are made of.", flag_values=FLAGS)


def parse_flags(argv: list[str]) -> list[str]:
  """This program's flags (`experiments.cli.parse_flags`); absl's own keep their defaults."""
  rest = cli.parse_flags(argv, FLAGS)
  flags.FLAGS(rest[:1])
  return rest

# Lines of a device plane that repeat what the stream lines hold (module / op / step spans).
_SUMMARY_LINES = ("XLA Modules", "XLA Ops", "Steps", "TensorFlow Ops", "Framework Name Scope",
                  "Framework Ops", "Source code", "XLA TraceMe", "Launch Stats")


def log(*a):
  print(*a, flush=True)


def kernel_times(profile, *, plane_prefix: str = "/device:GPU",
                 lines=None) -> tuple[dict[str, list[float]], list[str]]:
  """{kernel: [durations in µs]} over the trace's planes whose name starts with
  `plane_prefix`, from the lines named in `lines` (None: every line but the summary ones), and
  the line names read. A kernel's key is its event name, with " [hlo_op]" where the event
  carries the HLO op that launched it."""
  found = collections.defaultdict(list)
  read = []
  for plane in profile.planes:
    if not plane.name.startswith(plane_prefix):
      continue
    for line in plane.lines:
      if (line.name in _SUMMARY_LINES) if lines is None else (line.name not in lines):
        continue
      read.append(f"{plane.name}:{line.name}")
      for event in line.events:
        stats = dict(event.stats)
        hlo = stats.get("hlo_op")
        key = event.name if not hlo or hlo == event.name else f"{event.name} [{hlo}]"
        found[key].append(event.duration_ns / 1e3)
  return dict(found), read


def _busy(kernels, lo, hi) -> float:
  """The union of the (sorted) kernel intervals inside [lo, hi], in the same units."""
  busy, end = 0.0, lo
  for a, b in kernels:
    a, b = max(a, end), min(b, hi)
    if b > a:
      busy, end = busy + (b - a), b
  return busy


def module_spans(profile, *, calls: int = 0,
                 plane_prefix: str = "/device:GPU") -> list[tuple[float, float]]:
  """(span, busy) in µs of every call on the device planes: from the device's "XLA Modules"
  line where the trace has one (a module event's length, and the union of the kernel
  intervals inside it); else, with `calls` given, by cutting the kernels, sorted by start, at
  their calls − 1 widest gaps (each traced call is waited for, so the host's dispatch of the
  next one separates them)."""
  spans = []
  for plane in profile.planes:
    if not plane.name.startswith(plane_prefix):
      continue
    modules, kernels = [], []
    for line in plane.lines:
      if line.name == "XLA Modules":
        modules += [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events]
      elif line.name not in _SUMMARY_LINES:
        kernels += [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events]
    kernels.sort()
    if not modules and calls > 0 and len(kernels) >= calls:
      ends = [kernels[0][1]]
      for _, b in kernels[1:]:
        ends.append(max(ends[-1], b))        # the latest end so far: gaps between kernels
      gaps = sorted(range(1, len(kernels)), key=lambda i: kernels[i][0] - ends[i - 1])
      cuts = sorted(gaps[len(gaps) - (calls - 1):]) if calls > 1 else []
      bounds = [0] + cuts + [len(kernels)]
      modules = [(kernels[i][0], ends[j - 1]) for i, j in zip(bounds, bounds[1:])]
    for lo, hi in modules:
      spans.append(((hi - lo) / 1e3, _busy(kernels, lo, hi) / 1e3))
  return spans


def summarize(times: dict[str, list[float]], calls: int, top: int) -> list[dict]:
  """Rows {kernel, launches (per call), us (per call), share} by time, the tail summed."""
  total = sum(sum(v) for v in times.values()) or 1.0
  rows = sorted(({"kernel": k, "launches": len(v) / calls, "us": sum(v) / calls,
                  "share": sum(v) / total} for k, v in times.items()),
                key=lambda r: -r["us"])
  if len(rows) > top:
    rest = rows[top:]
    rows = rows[:top] + [{"kernel": f"({len(rest)} others)",
                          "launches": sum(r["launches"] for r in rest),
                          "us": sum(r["us"] for r in rest),
                          "share": sum(r["share"] for r in rest)}]
  return rows


def load_trace(directory: str):
  """The ProfileData of the one trace `jax.profiler.trace(directory)` wrote."""
  from jax._src.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  files = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
  if len(files) != 1:
    raise RuntimeError(f"expected one .xplane.pb under {directory}, found {files}")
  return ProfileData.from_file(files[0])


def profile_call(fn, args, *, iters: int, plane_prefix: str = "/device:GPU"):
  """(kernel times, lines read, wall ms per call, module spans) of `fn(*args)` traced `iters`
  times (spans: `module_spans`, one (span, busy) per call where the trace has them)."""
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as directory:
    with jax.profiler.trace(directory):
      start = time.perf_counter()
      for _ in range(iters):
        jax.block_until_ready(fn(*args))
      wall_ms = (time.perf_counter() - start) * 1e3 / iters
    profile = load_trace(directory)
    times, read = kernel_times(profile, plane_prefix=plane_prefix)
    spans = module_spans(profile, calls=iters, plane_prefix=plane_prefix)
  return times, read, wall_ms, spans


def op_function(mixer: str, impl: str, mode: str, shape):
  """(jitted fn, args) of one op call: the forward, or <o, do> and its gradients w.r.t. every
  input (fwdbwd_dep: with do + `peer_ops.DEP_WEIGHT` · o as the cotangent; fwdbwd_grads: the
  gradients alone, `peer_ops.MODES`)."""
  from experiments import peer_ops  # pylint: disable=g-import-not-at-top
  from lineax_attn import bench, ops  # pylint: disable=g-import-not-at-top
  if mode not in peer_ops.MODES:
    raise ValueError(f"mode {mode!r} is not one of {peer_ops.MODES}")
  b, t, h, d = shape
  args = list(bench.mixer_inputs(mixer, batch=b, seq_len=t, heads=h, v_heads=h, head_dim_k=d,
                                 head_dim_v=d, dtype=jnp.bfloat16))
  impl, _, tuning_text = impl.partition("@")   # "pallas_gpu@forward=walk;...": a GpuTuning
  tuning = ops.GpuTuning.parse(tuning_text.replace(";", ",")) if tuning_text else None
  if impl == "jla":   # the peer's kernels, profiled the same way (their kernel breakdown is
    # the target each of ours is measured against)
    fwd = peer_ops.jla_op(mixer, ops.specs.resolve(mixer).gate_names)
  else:
    op = getattr(ops, mixer)
    fwd = lambda *a: op(*a, implementation=impl, tuning=tuning)[0]
  if mode == "fwd":
    return jax.jit(fwd), args
  do = jax.random.normal(jax.random.key(1), args[2].shape, jnp.float32)
  return jax.jit(peer_ops.grad_fn(fwd, len(args), dependent=mode == "fwdbwd_dep",
                                  with_loss=mode != "fwdbwd_grads")), [do] + args


def main(argv):
  del argv
  from lineax_attn import bench  # pylint: disable=g-import-not-at-top
  shape = tuple(int(x) for x in _SHAPE.value.split(","))
  if len(shape) != 4:
    raise app.UsageError(f"--shape={_SHAPE.value!r}: expected B,T,H,D")
  log(f"[profile] {jax.devices()[0].device_kind}, jax {jax.__version__}, shape {shape}")
  all_rows, sections = [], []
  for mixer in _MIXERS.value:
    for impl in _IMPLS.value:
      for mode in _MODES.value:
        name = f"{mixer} {impl} {mode}"
        try:
          fn, args = op_function(mixer, impl, mode, shape)
          if _HLO_DIR.value:
            os.makedirs(_HLO_DIR.value, exist_ok=True)
            path = os.path.join(_HLO_DIR.value, f"{mixer}_{impl}_{mode}.hlo.txt".replace("/", "_"))
            with open(path, "w") as f:
              f.write(fn.lower(*args).compile().as_text())
          times, read, wall_ms, spans = profile_call(fn, args, iters=_ITERS.value)
        except Exception as e:  # noqa: BLE001 - one failing op must not stop the others
          log(f"[error] {name}: {type(e).__name__}: {str(e)[:300]}")
          continue
        if not times:
          log(f"[error] {name}: no device events (lines read: {read})")
          continue
        rows = summarize(times, _ITERS.value, _TOP.value)
        device_us = sum(sum(v) for v in times.values()) / _ITERS.value
        span_text = ""
        if spans:
          span_us = sum(s for s, _ in spans) / len(spans)
          busy_us = sum(b for _, b in spans) / len(spans)
          span_text = (f"; on the device {span_us / 1e3:.3f} ms from first start to last end, "
                       f"busy {busy_us / 1e3:.3f}, idle {(span_us - busy_us) / 1e3:.3f} "
                       f"({len(spans)} module runs)")
        log(f"[ok] {name}: device {device_us / 1e3:.3f} ms, wall {wall_ms:.3f} ms per call, "
            f"{sum(len(v) for v in times.values()) / _ITERS.value:.0f} launches{span_text}")
        for r in rows:
          log(f"    {r['us']:9.1f} us  {100 * r['share']:5.1f} %  x{r['launches']:g}  "
              f"{r['kernel'][:150]}")
        all_rows += [dict(r, mixer=mixer, impl=impl, mode=mode, device_ms=device_us / 1e3,
                          wall_ms=wall_ms, spans_us=spans) for r in rows]
        table = bench.markdown_table(
            [dict(r, us=f"{r['us']:.1f}", share=f"{100 * r['share']:.1f} %",
                  kernel=r["kernel"].replace("|", "/")[:160]) for r in rows],
            [("kernel", "kernel [HLO op]"), ("launches", "launches per call"),
             ("us", "µs per call"), ("share", "share")])
        sections.append(f"### {name}: device {device_us / 1e3:.3f} ms, wall {wall_ms:.3f} ms "
                        f"per call{span_text}\n\n{table}\n")
  if _OUT_MD.value:
    with open(_OUT_MD.value, "w") as f:
      f.write(f"# Kernels per op call ({jax.devices()[0].device_kind}, shape "
              f"{','.join(map(str, shape))}, bf16 inputs, {_ITERS.value} traced calls)\n\n"
              + "\n".join(sections))
  if _OUT_JSON.value:
    bench.write_json(_OUT_JSON.value, all_rows, shape=shape, iters=_ITERS.value,
                     device=jax.devices()[0].device_kind, jax=jax.__version__)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
