"""Summarise a trace of Mosaic GPU's in-kernel profiler: time per named phase, per CTA.

A kernel launched with `plgpu.CompilerParams(profile_space=..., profile_dir=...)` (the
intra-chunk kernels: `profile_dir=` of `pallas_kernels.gpu.intra_chunk`) writes one Chrome
trace JSON per call into profile_dir: begin/end events ("B"/"E", µs) of every
`jax.named_scope` region, one track ("tid") per CTA warpgroup. This turns one such file into a
table: each region's mean and median duration over the CTAs, its share of a CTA's span (first
begin to last end), nested regions indented under their parent.

    python -m experiments.kernel_trace --trace=/tmp/prof/123-trace.json
"""

from __future__ import annotations

import collections
import dataclasses
import json

from absl import app
from absl import flags
import numpy as np

from experiments import cli


@dataclasses.dataclass
class Region:
  name: str
  depth: int          # 0 for top-level regions, 1 for regions inside one, ...
  ctas: int           # CTA tracks in which it ran
  mean_us: float      # per CTA (summed over its occurrences in that CTA)
  median_us: float
  share: float        # mean_us / mean CTA span


def summarize(trace: dict) -> tuple[list[Region], float]:
  """Regions in order of first appearance, and the mean CTA span in µs."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  by_track = collections.defaultdict(list)
  for ev in events:
    if ev.get("ph") in ("B", "E"):
      by_track[ev["tid"]].append(ev)
  if not by_track:
    raise ValueError("trace: no begin/end events (was the kernel run with profile_dir set?)")
  per_region = collections.defaultdict(list)    # name -> [µs per CTA]
  depth, order, spans = {}, [], []
  for evs in by_track.values():
    evs.sort(key=lambda e: e["ts"])
    stack, totals = [], collections.defaultdict(float)
    for ev in evs:
      if ev["ph"] == "B":
        stack.append(ev)
        if ev["name"] not in depth:
          depth[ev["name"]] = len(stack) - 1
          order.append(ev["name"])
      else:
        if not stack or stack[-1]["name"] != ev["name"]:
          raise ValueError(f"trace: unbalanced end of {ev['name']!r} on track {ev['tid']}")
        begin = stack.pop()
        totals[ev["name"]] += ev["ts"] - begin["ts"]
    if stack:
      raise ValueError(f"trace: {stack[-1]['name']!r} never ends on track {evs[0]['tid']}")
    spans.append(evs[-1]["ts"] - evs[0]["ts"])
    for name, us in totals.items():
      per_region[name].append(us)
  span = float(np.mean(spans))
  rows = []
  for name in order:
    xs = np.asarray(per_region[name])
    rows.append(Region(name, depth[name], len(xs), float(xs.mean()), float(np.median(xs)),
                       float(xs.mean()) / span if span > 0 else float("nan")))
  return rows, span


def to_markdown(rows: list[Region], span: float, title: str = "") -> str:
  lines = [f"{title}mean CTA span {span:.2f} µs over {max(r.ctas for r in rows)} CTAs", "",
           "| phase | mean µs | median µs | share of span |", "|---|---|---|---|"]
  for r in rows:
    indent = "&nbsp;&nbsp;" * r.depth
    lines.append(f"| {indent}{r.name} | {r.mean_us:.2f} | {r.median_us:.2f} | {r.share:.0%} |")
  return "\n".join(lines) + "\n"


_TRACE = flags.DEFINE_string("trace", None, "A *-trace.json written by the profiler.")


def main(argv):
  del argv
  with open(_TRACE.value) as f:
    rows, span = summarize(json.load(f))
  print(to_markdown(rows, span))


if __name__ == "__main__":
  flags.mark_flag_as_required("trace")
  app.run(main, flags_parser=cli.parse_flags)
