"""Summarise Nsight Compute's source page of one kernel: where its warps were sampled, by SASS
instruction and by opcode.

`experiments/run_gpu_ncu.sh` profiles a walk kernel with `ncu --set full` and exports the
report's source page (`ncu --import R --page source --csv --print-source sass`): one row per
SASS instruction with, among other columns, how often warp-state sampling found a warp there
("Warp Stall Sampling (All Samples)"; "(Not-issued Samples)": the warp could not issue). A
sample lands on the instruction a warp is about to issue, so the samples on a wait (a
`SYNCS...TRYWAIT` on an mbarrier, `WARPGROUP.DEPBAR` for a wgmma group, `BAR.SYNC`) are the
time spent waiting there. Columns are found by name, so the export's other columns may come and
go between ncu versions.

    python3 -m experiments.ncu_stalls --csv=/tmp/ncu/walk_gated_overlap-false_sass.csv --top=25

prints the total, the samples per warpgroup region, the top instructions (address, samples,
share, cumulative share, SASS, main stall reason), and the samples per opcode family (the opcode
up to its first dot, e.g. HGMMA, SYNCS, MUFU).

Warpgroup regions: a warp-specialised Mosaic GPU kernel opens each warpgroup's code with a
register reallocation (`USETMAXREG`, from `plgpu.set_max_registers`), in the order the kernel's
`pl.when` branches come (the walks: memory, state, output); a region runs from one to the next,
the last to the final EXIT. Its samples and main stall reasons (ncu's per-reason columns,
`stall_*`) say which warpgroup waits and on what: `long_sb` on a branch after an mbarrier's
`TRYWAIT` is time spent waiting on that barrier.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import io
import re

from absl import app
from absl import flags

from experiments import cli

ALL_SAMPLES = "Warp Stall Sampling (All Samples)"
NOT_ISSUED = "Warp Stall Sampling (Not-issued Samples)"


@dataclasses.dataclass
class Row:
  address: str
  sass: str
  samples: float
  not_issued: float
  reasons: dict[str, float] = dataclasses.field(default_factory=dict)   # stall_* columns

  def main_reason(self) -> str:
    return max(self.reasons, key=self.reasons.get) if any(self.reasons.values()) else "-"


def _number(text: str) -> float:
  text = text.strip().replace(",", "")
  try:
    return float(text) if text else 0.0
  except ValueError:
    return 0.0


def read_source_page(text: str) -> list[Row]:
  """The rows of an exported source page. ncu prints its own lines (==PROF==, a kernel title)
  before the CSV; the table starts at the first line that names the sampling column."""
  lines = text.splitlines()
  start = next((i for i, line in enumerate(lines) if ALL_SAMPLES in line), None)
  if start is None:
    raise ValueError(f"csv: no column {ALL_SAMPLES!r}; is this `ncu --page source --csv`?")
  reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
  source = next((n for n in reader.fieldnames if n.strip().lower() == "source"), None)
  address = next((n for n in reader.fieldnames if n.strip().lower() == "address"), None)
  if source is None:
    raise ValueError("csv: no 'Source' column (the SASS text)")
  reasons = [n for n in reader.fieldnames if n.startswith("stall_") and "Not Issued" not in n]
  rows = []
  for rec in reader:
    rows.append(Row(address=(rec.get(address) or "").strip() if address else "",
                    sass=(rec.get(source) or "").strip(),
                    samples=_number(rec.get(ALL_SAMPLES) or ""),
                    not_issued=_number(rec.get(NOT_ISSUED) or ""),
                    reasons={n[len("stall_"):]: _number(rec.get(n) or "") for n in reasons}))
  return rows


def regions(rows: list[Row]) -> list[tuple[str, int, int]]:
  """(name, first row, end row) of each warpgroup's code: "prologue" up to the first
  USETMAXREG, then one region per USETMAXREG (named by its register count, e.g. "wg 1 (40
  regs)"), the last up to the final EXIT; then "tail" (out-of-line code after it). One region
  "all" when the kernel has no USETMAXREG."""
  marks = [i for i, r in enumerate(rows) if "USETMAXREG" in r.sass]
  if not marks:
    return [("all", 0, len(rows))]
  exits = [i for i, r in enumerate(rows) if re.search(r"(^|\s)EXIT\b", r.sass)]
  end = exits[-1] + 1 if exits and exits[-1] > marks[-1] else len(rows)
  out = [("prologue", 0, marks[0])]
  for n, (a, b) in enumerate(zip(marks, marks[1:] + [end])):
    regs = re.search(r"0x([0-9a-f]+)\s*$", rows[a].sass)
    out.append((f"wg {n + 1}" + (f" ({int(regs[1], 16)} regs)" if regs else ""), a, b))
  out.append(("tail", end, len(rows)))
  return out


def opcode_family(sass: str) -> str:
  """HGMMA.64x128x16.F32.BF16 ... → HGMMA; '@!P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P0, ...' →
  SYNCS.PHASECHK (SYNCS's kinds differ in what they wait on, so they keep two parts)."""
  words = [w for w in sass.split() if not w.startswith("@")]
  if not words:
    return "?"
  parts = words[0].rstrip(";").split(".")
  return ".".join(parts[:2]) if parts[0] in ("SYNCS", "WARPGROUP", "BAR") else parts[0]


def summarize(rows: list[Row], top: int) -> str:
  total = sum(r.samples for r in rows)
  if total <= 0:
    raise ValueError("csv: no warp-state samples in any row (was SourceCounters collected?)")
  out = [f"{len(rows)} SASS instructions, {total:.0f} samples "
         f"({sum(r.not_issued for r in rows) / total:.0%} not issued)", "",
         "| region | instructions | samples | share | main stall reasons |",
         "|---|---|---|---|---|"]
  for name, a, b in regions(rows):
    part = rows[a:b]
    got = sum(r.samples for r in part)
    if not part or got <= 0:
      continue
    why = collections.Counter()
    for r in part:
      why.update(r.reasons)
    main = ", ".join(f"{k} {v / got:.0%}" for k, v in why.most_common(3) if v > 0)
    out.append(f"| {name} | {len(part)} | {got:.0f} | {got / total:.1%} | {main or '-'} |")
  out += ["", "| address | samples | share | cumulative | SASS | main stall reason |",
          "|---|---|---|---|---|---|"]
  cum = 0.0
  for r in sorted(rows, key=lambda r: -r.samples)[:top]:
    cum += r.samples
    out.append(f"| {r.address} | {r.samples:.0f} | {r.samples / total:.1%} | {cum / total:.1%} "
               f"| `{r.sass[:90]}` | {r.main_reason()} |")
  families = collections.Counter()
  counts = collections.Counter()
  for r in rows:
    family = opcode_family(r.sass)
    families[family] += r.samples
    counts[family] += 1
  out += ["", "| opcode | instructions | samples | share |", "|---|---|---|---|"]
  out += [f"| {name} | {counts[name]} | {s:.0f} | {s / total:.1%} |"
          for name, s in families.most_common() if s > 0]
  return "\n".join(out)


_CSV = flags.DEFINE_string("csv", None, "An exported source page (ncu --page source --csv).")
_TOP = flags.DEFINE_integer("top", 25, "Instructions to list, most sampled first.")


def main(argv):
  del argv
  with open(_CSV.value) as f:
    print(summarize(read_source_page(f.read()), _TOP.value))


if __name__ == "__main__":
  flags.mark_flag_as_required("csv")
  app.run(main, flags_parser=cli.parse_flags)
