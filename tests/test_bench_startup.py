"""experiments/bench_startup.py on CPU: the tiny config's softmax and GDN-2 arms, each in its
own process, one layer, with the batch and length overridden on the command line.

Checks: a row per arm, in order, from two distinct processes; every
stage time is >= 0 and the `at_*` columns are their running sums from the launch (so the
launch-to-imports time is counted); a fresh process compiles exactly three init programs (the
embedding/head/keys program, the one block kind of a pure stack, the optimiser state), not one
per layer; the command-line batch reached the run; the first loss of a model at its init
(logits ≈ 0) is ln(vocabulary) to within 0.05; the Markdown table has the rows.
"""

from __future__ import annotations

import json
import math
import os

from helpers import FAST_CPU_XLA, run_cpu_python


# The stages bench_startup's docstring names, in order (not imported: the program defines absl
# flags at import, which would clash with other programs' flags in the same test process).
STAGES = ("imports", "config", "trainer", "init", "batch", "step_compiled", "step_done")


def test_two_arms_in_fresh_processes(tmp_path):
  out = tmp_path / "startup.json"
  proc = run_cpu_python(["-m", "experiments.bench_startup", "--config=configs/mixers.py:tiny",
                         "--arms", "softmax,gdn2", "--config.train.global_batch_size=2",
                         "--config.train.seq_len=32", "--config.model.chunk_size=16",
                         "--config.model.n_layers=1", f"--json_out={out}"],
                        xla_flags=FAST_CPU_XLA)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = json.loads(out.read_text())
  assert [r["arm"] for r in rows] == ["softmax", "gdn2"]
  assert len({r["pid"] for r in rows} | {os.getpid()}) == 3  # two children, neither this one
  for row in rows:
    total = 0.0
    assert [k[3:-2] for k in row if k.startswith("at_")] == list(STAGES)
    for stage in STAGES:
      assert row[f"{stage}_s"] >= 0, (row["arm"], stage)
      total += row[f"{stage}_s"]
      assert math.isclose(row[f"at_{stage}_s"], total, rel_tol=1e-9, abs_tol=1e-9)
    assert row["at_imports_s"] > 0.1  # the interpreter and jax imports count
    assert row["init_compiles"] == 3, row
    assert 0 < row["init_compile_s"] <= row["init_s"]
    assert 0 < row["step_compile_s"] <= row["step_compiled_s"]
    assert "x 2x32 tokens" in row["run"], row["run"]
    assert abs(row["loss"] - math.log(row["vocab_size"])) < 0.05, row
    assert f"[{row['arm']}] step_done:" in proc.stderr
  table = (tmp_path / "startup.md").read_text()
  assert table.count("\n| softmax |") == 1 and table.count("\n| gdn2 |") == 1
  assert not list(tmp_path.glob("*.tmp.json"))
