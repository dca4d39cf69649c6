"""experiments/op_profile.py's trace reading on a CPU: events summed per name against known
durations (annotated sleeps), and the per-call table arithmetic and the device spans' busy /
idle split by hand."""

from __future__ import annotations

import time
import types

import jax
import pytest

from experiments import op_profile


def test_kernel_times_reads_annotated_regions_from_a_real_trace():
  # Three regions of a known name, each at least 20 ms long (a sleep inside), traced by the
  # real profiler: read back from the host plane, they are three events of >= 20 ms each,
  # and together no longer than the traced wall time.
  probe = lambda: time.sleep(0.02)

  def fn():
    with jax.profiler.TraceAnnotation("op_profile_probe"):
      probe()
    return jax.numpy.zeros(())

  times, read, wall_ms, _ = op_profile.profile_call(fn, (), iters=3, plane_prefix="/host:CPU")
  assert read, "no host line was read"
  got = times["op_profile_probe"]
  assert len(got) == 3
  assert all(us >= 20_000 for us in got), got
  assert sum(got) / 1e3 <= 3 * wall_ms + 1.0


def test_summarize_per_call_rows_and_the_tail():
  # Two calls traced: "a" ran twice a call for 30 + 10 µs, "b" once for 20, "c" once for 2.
  times = {"a": [30.0, 10.0, 30.0, 10.0], "b": [20.0, 20.0], "c": [2.0, 2.0]}
  rows = op_profile.summarize(times, calls=2, top=2)
  assert [r["kernel"] for r in rows] == ["a", "b", "(1 others)"]
  assert [r["launches"] for r in rows] == [2.0, 1.0, 1.0]
  assert [r["us"] for r in rows] == [40.0, 20.0, 2.0]
  assert sum(r["share"] for r in rows) == pytest.approx(1.0)
  assert rows[0]["share"] == pytest.approx(40 / 62)


def _line(name, events):
  return types.SimpleNamespace(
      name=name, events=[types.SimpleNamespace(name="k", start_ns=a, duration_ns=b - a, stats={})
                         for a, b in events])


def test_module_spans_split_each_call_into_busy_and_idle():
  # Two module runs on one GPU plane, kernels on two streams (times in ns). Run 1 spans
  # 1,000-9,000: kernels 1,000-3,000 and 2,000-4,000 overlap (busy 3,000), then 6,000-9,000
  # (3,000): busy 6,000 of 8,000. Run 2 spans 20,000-24,000, one kernel 21,000-23,000: busy
  # 2,000. A kernel on another plane and the summary lines are not counted.
  gpu = types.SimpleNamespace(name="/device:GPU:0", lines=[
      _line("XLA Modules", [(1_000, 9_000), (20_000, 24_000)]),
      _line("XLA Ops", [(1_000, 9_000)]),
      _line("Stream #1", [(1_000, 3_000), (6_000, 9_000), (21_000, 23_000)]),
      _line("Stream #2", [(2_000, 4_000)])])
  other = types.SimpleNamespace(name="/host:CPU", lines=[_line("python", [(0, 30_000)])])
  spans = op_profile.module_spans(types.SimpleNamespace(planes=[other, gpu]))
  assert spans == [(8.0, 6.0), (4.0, 2.0)]


def test_module_spans_without_a_module_line_cut_the_calls_at_the_widest_gaps():
  # No "XLA Modules" line: three calls of two kernels each, 1,000 ns between a call's kernels
  # and >= 5,000 between calls (the host's dispatch). Call 2's kernels overlap (busy 3,000 of
  # its span 3,000); a one-kernel gap inside a call is narrower than any between calls.
  gpu = types.SimpleNamespace(name="/device:GPU:0", lines=[_line("Stream #1", [
      (0, 1_000), (2_000, 3_000),                      # call 1: span 3,000, busy 2,000
      (10_000, 12_000), (11_000, 13_000),              # call 2: span 3,000, busy 3,000
      (20_000, 21_000), (22_500, 24_000)])])           # call 3: span 4,000, busy 2,500
  spans = op_profile.module_spans(types.SimpleNamespace(planes=[gpu]), calls=3)
  assert spans == [(3.0, 2.0), (3.0, 3.0), (4.0, 2.5)]
  assert op_profile.module_spans(types.SimpleNamespace(planes=[gpu])) == []   # calls unknown


def test_op_function_dependent_mode_takes_the_output_into_its_cotangent():
  # op_profile.op_function's fwdbwd_dep on the XLA chunk form (CPU): its gradients are those of
  # the fixed-cotangent call with do + DEP_WEIGHT · o as the cotangent (the dependent loss
  # <o, do> + w |o|² / 2 has that gradient); an unknown mode is refused.
  import jax.numpy as jnp
  import numpy as np
  from experiments import peer_ops
  shape = (1, 64, 2, 16)
  dep, dep_args = op_profile.op_function("gated_delta_rule", "chunk", "fwdbwd_dep", shape)
  fixed, args = op_profile.op_function("gated_delta_rule", "chunk", "fwdbwd", shape)
  fwd, fwd_args = op_profile.op_function("gated_delta_rule", "chunk", "fwd", shape)
  do, inputs = args[0], args[1:]
  o = fwd(*fwd_args).astype(jnp.float32)
  _, want = fixed(do + peer_ops.DEP_WEIGHT * o, *inputs)
  _, plain = fixed(do, *inputs)
  _, got = dep(*dep_args)
  assert len(got) == len(want) == len(inputs)
  for g, w, p in zip(got, want, plain):
    g, w, p = (np.asarray(x, np.float32) for x in (g, w, p))
    scale = np.abs(w).max()
    # the same float32 sums (equal on this CPU), far inside the o term's own ~1e-3 share
    assert np.abs(g - w).max() <= 1e-6 * scale
    assert np.abs(g - p).max() >= 1e-4 * scale
  with pytest.raises(ValueError, match="mode"):
    op_profile.op_function("gated_delta_rule", "chunk", "bwd", shape)
