"""Resume is bit-exact: `experiments/train.py` run for N = 6 steps in one go equals the same
command stopped after N/2 = 3 steps (`--stop_at_step=3`, the process exits) and re-run in a
new process (it resumes from the checkpoint: params, optimiser state, step, data iterator).

Oracle: the unbroken run. Checked bit for bit: the six training losses (metrics.jsonl, one
record per step) and the final parameters and optimiser state (restored from both final
checkpoints). The model is one chunked GDN layer (AdamW, which spares its decay gates from
weight decay; warmup then WSD decay, so the schedule position must resume too); asynchronous
checkpoints are on. One layer, not a GDN + softmax stack: each of the three processes compiles
the step, and the softmax layer added ~30% to each compile without touching resume (the mixed
stack's step is checked in test_train_sharded).

The three runs are separate processes on one CPU device with XLA's backend optimisation level
0 (faster compiles; all three runs use the same flags, which is what bit-exactness needs).

A run killed with SIGKILL after it logged steps past its last checkpoint, then resumed: the
steps after the checkpoint are trained again, and metrics.jsonl and TensorBoard's event files
hold every step once (the oracle: 1..steps, each once, TensorBoard equal to the JSONL). The
finished run launched once more trains nothing and prints the losses metrics.jsonl recorded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np

from configs import base
from helpers import cpu_env, FAST_CPU_XLA, REPO_ROOT as ROOT, tensorboard_scalars
from lineax_attn.train import checkpoint as checkpoint_lib
from lineax_attn.train import experiment, loop
from lineax_attn.train import sharding as sharding_lib

OVERRIDES = {
    "model.pattern": "L", "model.n_layers": 1, "model.d_model": 32, "model.mlp_hidden": 64, "model.chunk_size": 16,
    "train.steps": 6, "train.seq_len": 64, "train.global_batch_size": 4, "train.log_every": 1,
    "train.checkpoint_every": 3, "train.eval_batches": 0, "train.async_checkpoint": True,
    "optim.warmup_steps": 2, "optim.decay_fraction": 0.5, "mesh.data": 1,
}
ENV = cpu_env(FAST_CPU_XLA, JAX_DEFAULT_MATMUL_PRECISION="highest")


def _command(workdir, *extra, overrides=None):
  return [sys.executable, "-m", "experiments.train", "--config=configs/base.py:tiny",
          f"--workdir={workdir}", "--noprogress",
          *(f"--config.{k}={v}" for k, v in (overrides or OVERRIDES).items()), *extra]


def _start(workdir, *extra, overrides=None):
  return subprocess.Popen(_command(workdir, *extra, overrides=overrides), cwd=ROOT, env=ENV,
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc):
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  return out + err


def _losses(workdir):
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]


def _final_state(workdir, trainer):
  with checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
    steps = ckpt.all_steps()
    return steps, ckpt.restore(6, trainer.abstract_state())


def test_stop_and_resume_is_bit_identical(tmp_path):
  unbroken, split = tmp_path / "unbroken", tmp_path / "split"
  # One after the other: the unbroken run compiles the step into the suite's compilation cache
  # (conftest.py; the environment passes it on) and the two halves load that executable. Side
  # by side, both first runs compiled it (the suite keeps both cores busy anyway).
  _finish(_start(unbroken))
  half_log = _finish(_start(split, "--stop_at_step=3"))
  assert "stopped (stop_at_step=3) at step 3" in half_log
  assert _losses(split) == _losses(unbroken)[:3]
  resumed_log = _finish(_start(split))
  assert "resumed from step 3" in resumed_log and "completed at step 6" in resumed_log

  expected = _losses(unbroken)
  assert [s for s, _ in expected] == [1, 2, 3, 4, 5, 6]
  assert _losses(split) == expected  # exact float equality, all six steps
  assert expected[-1][1] < expected[0][1]

  config = base.get_config("tiny")
  for key, value in OVERRIDES.items():
    section, field = key.split(".")
    config[section][field] = value
  exp = experiment.resolve(config, device_count=1, process_count=1)
  trainer = loop.Trainer(exp, mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
  steps_a, state_a = _final_state(unbroken, trainer)
  steps_b, state_b = _final_state(split, trainer)
  assert steps_a == steps_b == [3, 6]
  leaves_a, leaves_b = jax.tree.leaves(state_a), jax.tree.leaves(state_b)
  assert len(leaves_a) == len(leaves_b) > 20
  for a, b in zip(leaves_a, leaves_b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _records(workdir):
  """metrics.jsonl's records; a torn last line (the process was killed mid-write) is skipped."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  out = []
  for line in open(path):
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError:
      pass
  return out


def _saved_steps(workdir):
  """The committed checkpoint steps (orbax renames a step's temporary directory when done)."""
  directory = os.path.join(workdir, "checkpoints")
  names = os.listdir(directory) if os.path.isdir(directory) else []
  return sorted(int(n) for n in names if n.isdigit())


def _kill_past_a_checkpoint(proc, workdir, timeout=300):
  """SIGKILLs the run once it has logged a step after its latest committed checkpoint. The run
  is frozen (SIGSTOP) while the files are looked at, so what it logged is what it leaves."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    assert proc.poll() is None, "the run ended before it could be killed: " + proc.stderr.read()
    logged = [r["step"] for r in _records(workdir) if r["kind"] == "train"]
    if logged and max(logged) >= 5:
      os.kill(proc.pid, signal.SIGSTOP)
      logged = max(r["step"] for r in _records(workdir) if r["kind"] == "train")
      saved = _saved_steps(workdir)
      if saved and logged > saved[-1]:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        return logged, saved[-1]
      os.kill(proc.pid, signal.SIGCONT)
    time.sleep(0.002)
  raise AssertionError("the run logged no step past a checkpoint in time")


def test_sigkill_then_resume_logs_each_step_once(tmp_path):
  steps = 40
  # One softmax layer: the logs are the subject here, and it compiles fastest.
  overrides = {**OVERRIDES, "model.pattern": "S", "model.n_layers": 1,
               "train.steps": steps, "train.checkpoint_every": 4,
               "train.async_checkpoint": False, "train.eval_batches": 1,
               "train.eval_every": 0, "optim.decay_fraction": 0.25}
  workdir = tmp_path / "run"
  logged, saved = _kill_past_a_checkpoint(_start(workdir, overrides=overrides), workdir)
  before = [r["step"] for r in _records(workdir) if r["kind"] == "train"]
  assert before == list(range(1, logged + 1)) and logged > saved  # steps the resume replays

  resumed_log = _finish(_start(workdir, overrides=overrides))
  assert f"resumed from step {saved}" in resumed_log and f"completed at step {steps}" in resumed_log
  records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]  # every line whole
  train = [r for r in records if r["kind"] == "train"]
  evals = [r for r in records if r["kind"] == "eval"]
  assert [r["step"] for r in train] == list(range(1, steps + 1))
  assert [r["step"] for r in evals] == [0, steps]
  # TensorBoard: each (tag, step) once over all event files, the values of metrics.jsonl.
  expected = {(f"{r['kind']}/{key}", r["step"]): [np.float32(r[key])]
              for r in records for key in ("loss", "lr") if key in r}
  scalars = tensorboard_scalars(workdir / "tensorboard")
  assert {k: v for k, v in scalars.items() if k in expected} == expected
  assert all(len(values) == 1 for values in scalars.values())

  # Finished: launched again, it trains nothing and reports the recorded losses.
  again = _finish(_start(workdir, overrides=overrides))
  assert "already trained" in again
  match = re.search(r"completed at step (\d+); train loss (\S+), validation loss (\S+);", again)
  assert match, again
  assert match.groups() == (str(steps), f"{train[-1]['loss']:.4f}",
                            f"{evals[-1]['loss']:.4f}")
  assert len(open(workdir / "metrics.jsonl").readlines()) == len(records)  # nothing appended
