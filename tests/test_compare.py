"""experiments/compare.py end to end on CPU: the table, the JSON, the plot, skip-finished and
--report_only (what `make run` and the GPU runner rely on)."""

from __future__ import annotations

import json
import math
import os

from helpers import FAST_CPU_XLA, run_cpu_python

ARMS = ("softmax", "gdn")
STEPS = 2
# One layer per arm: the subject is the program's bookkeeping (table, JSON, plot, skip-finished,
# --report_only), which does not depend on depth; each arm's step compiles in half the time.
# The arms, steps, length and batch of test_eval_recall's NIAH pipeline: the same train and eval
# programs, so whichever test runs second loads them from the suite's compilation cache.
OVERRIDES = ["--config.model.n_layers=1", f"--config.train.steps={STEPS}",
             "--config.train.seq_len=128",
             "--config.train.global_batch_size=2", "--config.optim.warmup_steps=1",
             "--config.train.log_every=1", "--config.train.eval_every=2",
             "--config.train.eval_batches=1"]


def _compare(workdir, *extra):
  proc = run_cpu_python(["-m", "experiments.compare", "--config=configs/mixers.py:tiny",
                         f"--workdir={workdir}", f"--arms={','.join(ARMS)}", "--progress=false",
                         *OVERRIDES, *extra], xla_flags=FAST_CPU_XLA)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def _rows(workdir):
  with open(os.path.join(workdir, "results.json")) as f:
    data = json.load(f)
  rows = data["rows"] if isinstance(data, dict) else data
  return {r["arm"]: r for r in rows}


def test_compare_table_plot_rerun_and_report_only(tmp_path):
  """One test, three phases sharing a workdir (xdist may split a module's tests over workers)."""
  finished = tmp_path
  _compare(finished)
  rows = _rows(finished)
  assert tuple(rows) == ARMS
  for arm, row in rows.items():
    assert row["steps"] == STEPS and row["status"] == "completed", row
    # Byte vocabulary: a model that learned nothing sits at ln(256) = 5.55.
    assert math.isfinite(row["val_loss"]) and 0.0 < row["val_loss"] < 6.0, row
    assert row["params"] > 0
  md = open(os.path.join(finished, "results.md")).read()
  for arm in ARMS:
    assert f"| {arm} |" in md
  png = os.path.join(finished, "loss_curves.png")
  assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"

  before = rows
  _compare(finished)                  # finished arms: no training, same numbers
  again = _rows(finished)
  _compare(finished, "--report_only")
  report = _rows(finished)
  for arm in ARMS:
    for key in ("val_loss", "train_loss", "steps", "params"):
      assert again[arm][key] == before[arm][key] == report[arm][key], (arm, key)
    assert report[arm]["status"] == "completed"

  # The same workdir read against a longer schedule: every arm stopped short of it.
  _compare(finished, "--report_only", f"--config.train.steps={2 * STEPS}")
  for arm, row in _rows(finished).items():
    assert row["status"] == f"partial ({STEPS}/{2 * STEPS})", (arm, row["status"])
