"""experiments/kernel_trace.py on hand-made traces in the profiler's format (oracle: the
durations written into them)."""

from __future__ import annotations

import pytest

from experiments import kernel_trace


def _track(tid, spans):
  """spans: (name, begin µs, end µs) -> the profiler's B/E events, in time order."""
  evs = []
  for name, b, e in spans:
    evs += [{"name": name, "ph": "B", "ts": b, "pid": 1, "tid": tid},
            {"name": name, "ph": "E", "ts": e, "pid": 1, "tid": tid}]
  return sorted(evs, key=lambda ev: (ev["ts"], ev["ph"] == "B"))


def test_means_medians_shares_and_nesting():
  # Two CTAs: load 1 and 3 µs; inverse 4 and 6 µs, with "diagonal blocks" inside it 2 and 2
  # (the second CTA runs it twice, 1 + 1: summed per CTA); spans 5 and 9 µs.
  trace = {"traceEvents": _track(1, [("load", 0, 1), ("inverse", 1, 5),
                                     ("diagonal blocks", 1.5, 3.5)])
           + _track(2, [("load", 10, 13), ("inverse", 13, 19), ("diagonal blocks", 14, 15),
                        ("diagonal blocks", 16, 17)])}
  rows, span = kernel_trace.summarize(trace)
  assert span == pytest.approx(7.0)
  by = {r.name: r for r in rows}
  assert [r.name for r in rows] == ["load", "inverse", "diagonal blocks"]
  assert by["load"].mean_us == pytest.approx(2.0) and by["load"].depth == 0
  assert by["inverse"].mean_us == pytest.approx(5.0) and by["inverse"].median_us == 5.0
  assert by["diagonal blocks"].mean_us == pytest.approx(2.0) and by["diagonal blocks"].depth == 1
  assert by["inverse"].share == pytest.approx(5.0 / 7.0)
  table = kernel_trace.to_markdown(rows, span)
  assert "| &nbsp;&nbsp;diagonal blocks | 2.00 | 2.00 | 29% |" in table
  assert "over 2 CTAs" in table


def test_malformed_traces_are_refused():
  with pytest.raises(ValueError, match="no begin/end"):
    kernel_trace.summarize({"traceEvents": []})
  unbalanced = [{"name": "a", "ph": "B", "ts": 0, "tid": 1},
                {"name": "b", "ph": "E", "ts": 1, "tid": 1}]
  with pytest.raises(ValueError, match="unbalanced end of 'b'"):
    kernel_trace.summarize({"traceEvents": unbalanced})
  with pytest.raises(ValueError, match="'a' never ends"):
    kernel_trace.summarize({"traceEvents": unbalanced[:1]})
