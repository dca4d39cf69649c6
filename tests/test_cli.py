"""The experiments/ programs' command lines (experiments/cli.py): `--help` of every program
exits 0 and prints its module docstring as written (no line-continuation gaps: a backslash at
a line's end stays, so the example commands can be pasted into a shell), then its flags; a bad
flag exits 2 with one line naming it."""

from __future__ import annotations

import ast
import glob
import os
import re
import subprocess
import sys

from helpers import REPO_ROOT as ROOT, cpu_env, run_cpu_python

ENV = cpu_env()


def _programs() -> dict[str, str]:
  """module name -> docstring, for every experiments/*.py that is a program."""
  out = {}
  for path in sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py"))):
    source = open(path).read()
    if 'if __name__ == "__main__":' in source:
      out[os.path.basename(path)[:-3]] = ast.get_docstring(ast.parse(source), clean=False)
  return out


def _run(module, *args):
  return subprocess.Popen([sys.executable, "-m", f"experiments.{module}", *args], cwd=ROOT,
                          env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_help_of_every_program():
  programs = _programs()
  assert {"train", "compare", "eval_recall", "bench_ops", "kernel_trace"} <= set(programs)
  procs = {m: _run(m, "--help") for m in programs}  # side by side: mostly import time
  for module, proc in procs.items():
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (module, err[-2000:])
    doc = programs[module].strip()
    assert out.startswith(doc), (module, out[:500])
    assert re.search(r"^flags:$", out, re.M) and "--" in out[len(doc):], module
    if module == "train":  # a continued example command reads as in the source
      assert "--config.arm=gdn \\\n        --workdir=runs/mixers_tiny/gdn" in out
    gaps = [line for line in out.splitlines() if re.search(r"\S {8,}\S", line)]
    assert not gaps, (module, gaps)


def test_bad_flag_exits_2_naming_it():
  procs = [_run("kernel_trace", "--bogus"),
           _run("eval_recall", "--config=configs/mqar.py:cpu", "--config.model.d_modl=8")]
  expected = ["error: invalid command line: Unknown command line flag 'bogus'\n",
              "error: invalid command line: unknown config field in --config.model.d_modl=8: "
              "'d_modl'\n"]
  for proc, line in zip(procs, expected):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and err.endswith(line), err[-2000:]


def test_programs_import_no_kernels_or_grain():
  # The programs' imports stay light (issue #15): the Mosaic GPU / TPU kernel modules load when
  # their implementation is used, grain and orbax when a dataset or checkpoint is made.
  heavy = ("lineax_attn.ops.pallas_gpu", "lineax_attn.ops.pallas_tpu", "pallas_kernels",
           "jax.experimental.pallas", "grain", "orbax")
  script = ("import sys\n"
            "import experiments.train, experiments.bench_ops, lineax_attn.train.checkpoint\n"
            f"print(sorted(m for m in sys.modules if m.startswith({heavy!r})))\n")
  proc = run_cpu_python(["-c", script], timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == "[]", proc.stdout
