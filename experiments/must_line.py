"""Issue #17's must line, read from the benchmarks' raw JSON: one table of every target, what
was measured, and whether it is met.

Issue #17 is resolved only when all of its targets are met by measurements of one day with the
final code. The numbers come from four programs (and a pytest log); transcribing them by hand
into docs/BENCHMARKS.md is where mistakes creep in, so this program reads the files those
programs wrote and judges them against the issue's bounds:

    python3 -m experiments.must_line \\
      --ops=docs/data/bench_ab_h200_2026-12-04h_final_queued.json,docs/data/bench_ab_h200_2026-12-04h_linear_attention_queued.json \\
      --fwd_err=docs/data/bench_kernels_h200_2026-12-04h_fwd_err.json \\
      --train=docs/data/bench_parallel_paper_softmax_h200_2026-12-04h.json,... \\
      --sweep=docs/data/bench_kernels_h200_2026-12-04e_sweep.json \\
      --tests=docs/data/test_gpu_h200_2026-12-04h_compiled_suite.log

The targets (the issue's words; where it gives no number, our reading, written here):

* `--ops` (`experiments.bench_ab` JSON, fwd+bwd rows with `pallas_gpu` and `jla`): at B4 T4096
  H16 D128, ours / jla (the median over rounds of the per-round ratio, as bench_ab pairs them)
  ≤ 1.3 for GDN and DeltaNet and ≤ 1.5 for KDA and GDN-2; linear attention's time ≤ GDN's.
  "Head dims 64 and 128 must both be fast": our reading is the same bounds at D = 64 (any
  shape of the files with D = 64; bench_ab's `--shape=4,4096,32,64` keeps the tokens and the
  heads' width of the D = 128 table).
* `--fwd_err` (`experiments.bench_kernels --modes=fwd` JSON): every mixer's forward error
  against the float32 chunk form ≤ 6e-3 (relative rms).
* `--train` (`experiments.bench_parallel` JSON, one file per arm of one run): tokens/s of the
  350M 2:1 hybrids ≥ 190,000 for GDN and ≥ 150,000 for KDA and GDN-2, and every linear hybrid
  ≥ the softmax Transformer++ of the same files.
* `--sweep` (`experiments.bench_kernels --sweep_tokens` JSON): "time must stay flat" from T 1K
  to 64K at fixed tokens. Our reading: the slowest point of the sweep within `--flat_tolerance`
  (1.10) of the fastest, per mixer; jla's rise is printed beside ours.
  Every mixer of `SWEEP_MIXERS` (run_gpu_must.sh's default sweep) gets a row; where jla's
  points cover a shorter range than ours (its long rows cut by the time budget), its rise is
  marked with its range.
* `--tests` (pytest logs of the compiled GPU suite): no test failed or errored in any of them.
* The machine: the issue measures on one H200, so every file that names its GPU (bench_ab and
  bench_kernels in their meta, bench_parallel per row since 2026-12-05) must name an H200.
  Files of another GPU still get their ratios judged, but the table says they are not the
  issue's machine.

A target whose file is not given, or holds no row for it, reads "not measured". The program
exits 0 whatever it finds: the table is the verdict.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Sequence

from absl import app
from absl import flags

from experiments import cli
from lineax_attn import bench

OP_SHAPE = (4, 4096, 16, 128)
OP_BOUNDS = {"gated_delta_rule": 1.3, "delta_rule": 1.3, "kda": 1.5, "gdn2": 1.5}
FWD_ERR_BOUND = 6e-3
FWD_ERR_MIXERS = ("gated_delta_rule", "delta_rule", "kda", "gdn2", "linear_attention")
TRAIN_FLOORS = {"gdn": 190_000, "kda": 150_000, "gdn2": 150_000}
NAMES = {"gated_delta_rule": "GDN", "delta_rule": "DeltaNet", "kda": "KDA", "gdn2": "GDN-2",
         "linear_attention": "linear attention"}
SWEEP_MIXERS = ("gated_delta_rule", "delta_rule", "kda")
ARM_NAMES = {"gdn": "GDN 2:1", "kda": "KDA 2:1", "gdn2": "GDN-2 2:1"}   # configs/mixers.py arms
MET, NOT_MET, NOT_MEASURED = "met", "not met", "not measured"

# The program's own flag set (not absl's global one): tests import it beside other programs
# that define the same names (--out_md, ...).
FLAGS = flags.FlagValues()
_F = {"flag_values": FLAGS}
_OPS = flags.DEFINE_list("ops", [], "experiments.bench_ab JSON files (fwd+bwd rows).", **_F)
_FWD_ERR = flags.DEFINE_list("fwd_err", [], "experiments.bench_kernels --modes=fwd JSON files.",
                             **_F)
_TRAIN = flags.DEFINE_list("train", [], "experiments.bench_parallel JSON files, one per arm.",
                           **_F)
_SWEEP = flags.DEFINE_list("sweep", [], "experiments.bench_kernels --sweep_tokens JSON files.",
                           **_F)
_TESTS = flags.DEFINE_list("tests", [], "pytest logs of the compiled GPU suite.", **_F)
_FLAT = flags.DEFINE_float("flat_tolerance", 1.10,
                           "The sweep is flat when its slowest point is within this factor of "
                           "its fastest.", **_F)
_OUT_MD = flags.DEFINE_string("out_md", None, "Also write the table here (Markdown).", **_F)
_OUT_JSON = flags.DEFINE_string("out_json", None, "Also write the rows here (JSON).", **_F)


def _sci(x: float) -> str:
  """6e-3, 4.8e-3: the exponent without its padding zero."""
  mantissa, exponent = f"{x:.1e}".split("e")
  return f"{mantissa.removesuffix('.0')}e{int(exponent)}"


def _read(paths: Iterable[str], flag: str, parse=json.load) -> list[Any]:
  """Every file of a flag, parsed; a file that is missing or not what the flag takes is a
  usage error naming the flag."""
  out = []
  for path in paths:
    try:
      with open(path) as f:
        out.append(parse(f))
    except (OSError, ValueError) as e:
      raise app.UsageError(f"--{flag}: cannot read {path}: {e}") from e
  return out


def _row(target: str, measured: str, status: str, source: str = "") -> dict[str, str]:
  return {"target": target, "measured": measured, "status": status, "source": source}


def op_ratios(files: Sequence[dict]) -> dict[tuple[str, tuple[int, ...]], dict[str, float]]:
  """{(mixer, shape): {"ours_ms", "jla_ms", "ratio"}} from bench_ab files' fwd+bwd rows (the
  ratio where the file paired pallas_gpu with jla as its baseline; the last file wins)."""
  found = {}
  for data in files:
    meta = data["meta"]
    shape = tuple(meta["shape"])
    for result in data["results"]:
      if result["mode"] != "fwdbwd":
        continue
      rows = {r["variant"]: r for r in result["rows"]}
      if "pallas_gpu" not in rows:
        continue
      entry = {"ours_ms": rows["pallas_gpu"]["median_ms"]}
      if "jla" in rows:
        entry["jla_ms"] = rows["jla"]["median_ms"]
      if meta.get("baseline") == "jla" and "ratio_median" in rows["pallas_gpu"]:
        entry["ratio"] = rows["pallas_gpu"]["ratio_median"]
      found[(result["mixer"], shape)] = entry
  return found


def op_rows(files: Sequence[dict]) -> list[dict[str, str]]:
  """The op table's targets at B4 T4096 H16 D128 and the same bounds at D = 64."""
  found = op_ratios(files)
  rows = []
  d64 = sorted({shape for _, shape in found if shape[3] == 64})
  for shape, label in [(OP_SHAPE, "")] + [(s, f" at D = 64 (B{s[0]} T{s[1]} H{s[2]})")
                                         for s in d64]:
    for mixer, bound in OP_BOUNDS.items():
      target = f"{NAMES[mixer]} ≤ {bound}x jla{label}"
      entry = found.get((mixer, shape), {})
      if "ratio" not in entry:
        rows.append(_row(target, "", NOT_MEASURED))
        continue
      ratio = entry["ratio"]
      rows.append(_row(target, f"{ratio:.3f}x ({entry['ours_ms']:.3f} ms against "
                               f"{entry['jla_ms']:.3f})", MET if ratio <= bound else NOT_MET,
                       "bench_ab"))
  if not d64:
    rows.append(_row("head dim 64 as fast (the same bounds)", "", NOT_MEASURED))
  la, gdn = (found.get((m, OP_SHAPE), {}).get("ours_ms")
             for m in ("linear_attention", "gated_delta_rule"))
  target = "linear attention ≤ GDN's time"
  if la is None or gdn is None:
    rows.append(_row(target, "", NOT_MEASURED))
  else:
    rows.append(_row(target, f"{la:.3f} ms against {gdn:.3f}", MET if la <= gdn else NOT_MET,
                     "bench_ab"))
  return rows


def fwd_err_rows(files: Sequence[dict]) -> list[dict[str, str]]:
  errs = {}
  for data in files:
    for r in data["results"]:
      if r.get("impl") == "pallas_gpu" and r.get("mode") == "fwd" and \
          r.get("err_vs_chunk") is not None:
        errs[r["mixer"]] = r["err_vs_chunk"]
  target = f"forward error vs the float32 chunk form ≤ {_sci(FWD_ERR_BOUND)}"
  missing = [m for m in FWD_ERR_MIXERS if m not in errs]
  if len(missing) == len(FWD_ERR_MIXERS):
    return [_row(target, "", NOT_MEASURED)]
  worst = max(errs, key=errs.get)
  measured = ", ".join(f"{NAMES.get(m, m)} {_sci(e)}" for m, e in errs.items())
  if missing:
    return [_row(target, f"{measured}; no row for {', '.join(missing)}", NOT_MEASURED,
                 "bench_kernels")]
  return [_row(target, measured, MET if errs[worst] <= FWD_ERR_BOUND else NOT_MET,
               "bench_kernels")]


def train_arm(result: dict) -> str:
  """The arm of a bench_parallel result, from its `run` line ("mixers_paper/gdn: ...")."""
  match = re.match(r"[^/:]*/([^:\s]+):", result.get("run", ""))
  if match is None:
    raise ValueError(f"--train: no arm in the run line {result.get('run')!r}")
  return match.group(1)


def train_rows(files: Sequence[list]) -> list[dict[str, str]]:
  tps = {}
  for data in files:
    for result in data:
      tps[train_arm(result)] = result["tokens_per_s"]
  rows = []
  softmax = tps.get("softmax")
  for arm, floor in TRAIN_FLOORS.items():
    target = f"350M {ARM_NAMES[arm]} ≥ {floor:,} tok/s and ≥ softmax"
    if arm not in tps or softmax is None:
      rows.append(_row(target, "", NOT_MEASURED))
      continue
    ok = tps[arm] >= floor and tps[arm] >= softmax
    rows.append(_row(target, f"{tps[arm]:,.0f} ({tps[arm] / softmax:.2f}x softmax's "
                             f"{softmax:,.0f})", MET if ok else NOT_MET, "bench_parallel"))
  return rows


def sweep_rises(files: Sequence[dict]) -> dict[tuple[str, str], tuple[float, list]]:
  """{(mixer, impl): (slowest / fastest, [(shape, ms), ...])} over the H16 fwd+bwd sweep points
  (the shapes of one B·T; the H 96 row the sweep adds is not a point of it)."""
  points = {}
  for data in files:
    for r in data["results"]:
      if r.get("mode") != "fwdbwd" or r.get("ms") is None:
        continue
      heads = r["shape"][2]
      points.setdefault((r["mixer"], r["impl"], heads), []).append((tuple(r["shape"]), r["ms"]))
  rises = {}
  for (mixer, impl, _), pts in points.items():
    by_tokens = {}
    for shape, ms in pts:
      by_tokens.setdefault(shape[0] * shape[1], []).append((shape, ms))
    sweep = max(by_tokens.values(), key=len)     # the sweep: most points of one B·T
    if len(sweep) < 2:
      continue
    times = [ms for _, ms in sweep]
    rises[(mixer, impl)] = (max(times) / min(times), sorted(sweep, key=lambda p: p[0][1]))
  return rises


def _lengths(pts: list) -> str:
  return f"T {pts[0][0][1]}-{pts[-1][0][1]}"


def sweep_rows(files: Sequence[dict], tolerance: float) -> list[dict[str, str]]:
  rises = sweep_rises(files)
  measured = {m for m, impl in rises if impl == "pallas_gpu"}
  target = f"the T sweep at fixed tokens stays flat (slowest ≤ {tolerance:.2f}x fastest)"
  rows = []
  for mixer in [m for m in NAMES if m in measured or m in SWEEP_MIXERS]:
    if mixer not in measured:
      rows.append(_row(f"{NAMES[mixer]}: {target}", "", NOT_MEASURED))
      continue
    rise, pts = rises[(mixer, "pallas_gpu")]
    jla = rises.get((mixer, "jla"))
    beside = ""
    if jla:
      only = f" over {_lengths(jla[1])} only" if _lengths(jla[1]) != _lengths(pts) else ""
      beside = f"; jla {jla[0]:.2f}x{only}"
    rows.append(_row(f"{NAMES[mixer]}: {target}", f"{rise:.2f}x over {_lengths(pts)}{beside}",
                     MET if rise <= tolerance else NOT_MET, "bench_kernels"))
  return rows


def device_rows(ops, fwd_err, train, sweep) -> list[dict[str, str]]:
  """One row: do the files name one H200? (bench_parallel rows before 2026-12-05 name none.)"""
  named = [d["meta"].get("device") for d in [*ops, *fwd_err, *sweep]]
  named += [r.get("device") for data in train for r in data]
  devices = sorted({d for d in named if d})
  unnamed = sum(d is None for d in named)
  target = "measured on one H200 (the issue's machine)"
  if not devices:
    return [_row(target, "", NOT_MEASURED)]
  note = f" ({unnamed} of {len(named)} results without a GPU name)" if unnamed else ""
  ok = all("H200" in d for d in devices)
  return [_row(target, ", ".join(devices) + note, MET if ok else NOT_MET, "meta")]


def pytest_summary(text: str) -> dict[str, int]:
  """The counts of a pytest log's last summary line ("386 passed, 2 failed, 6 skipped ...")."""
  lines = [l for l in text.splitlines() if re.search(r"\d+ (passed|failed|error)", l)]
  if not lines:
    raise ValueError("--tests: no pytest summary line in the log")
  return {word.rstrip("s"): int(n) for n, word in
          re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", lines[-1])}


def tests_rows(texts: Sequence[str]) -> list[dict[str, str]]:
  target = "all compiled GPU tests pass"
  if not texts:
    return [_row(target, "", NOT_MEASURED)]
  counts = [pytest_summary(t) for t in texts]
  bad = sum(c.get("failed", 0) + c.get("error", 0) for c in counts)
  measured = "; ".join(", ".join(f"{n} {k}" for k, n in c.items()) for c in counts)
  return [_row(target, measured, NOT_MET if bad else MET, "pytest")]


def must_rows(ops, fwd_err, train, sweep, tests, tolerance) -> list[dict[str, str]]:
  return (op_rows(ops) + fwd_err_rows(fwd_err) + train_rows(train)
          + sweep_rows(sweep, tolerance) + tests_rows(tests)
          + device_rows(ops, fwd_err, train, sweep))


COLUMNS = [("target", "target"), ("measured", "measured"), ("status", "status"),
           ("source", "from")]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  read = lambda flag: _read(flag.value, flag.name)
  try:
    rows = must_rows(read(_OPS), read(_FWD_ERR), read(_TRAIN), read(_SWEEP),
                     _read(_TESTS.value, "tests", lambda f: f.read()), _FLAT.value)
  except (KeyError, TypeError, ValueError) as e:   # a file of another program's format
    raise app.UsageError(f"a file is not in the format its flag takes: {e!r}") from e
  unmet = [r for r in rows if r["status"] != MET]
  table = bench.markdown_table([dict(r, status=f"**{r['status']}**") for r in rows], COLUMNS)
  verdict = ("every target met" if not unmet else
             f"{len(unmet)} of {len(rows)} targets not met or not measured")
  text = f"# Issue #17's must line\n\n{table}\n\n{verdict}\n"
  print(text)
  if _OUT_MD.value:
    with open(_OUT_MD.value, "w") as f:
      f.write(text)
  if _OUT_JSON.value:
    bench.write_json(_OUT_JSON.value, rows, verdict=verdict)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
