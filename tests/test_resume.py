"""Resume is bit-exact: `experiments/train.py` run for N = 6 steps in one go equals the same
command stopped after N/2 = 3 steps (`--stop_at_step=3`, the process exits) and re-run in a
new process (it resumes from the checkpoint: params, optimiser state, step, data iterator).

Oracle: the unbroken run. Checked bit for bit: the six training losses (metrics.jsonl, one
record per step) and the final parameters and optimiser state (restored from both final
checkpoints). The model is a GDN + softmax stack (chunked GDN, AdamW, warmup then WSD decay,
so the schedule position must resume too); asynchronous checkpoints are on.

The three runs are separate processes on one CPU device with XLA's backend optimisation level
0 (faster compiles; all three runs use the same flags, which is what bit-exactness needs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np

from configs import base
from lineax_attn.train import checkpoint as checkpoint_lib
from lineax_attn.train import experiment, loop
from lineax_attn.train import sharding as sharding_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {
    "model.pattern": "LS", "model.d_model": 32, "model.mlp_hidden": 64, "model.chunk_size": 16,
    "train.steps": 6, "train.seq_len": 64, "train.global_batch_size": 4, "train.log_every": 1,
    "train.checkpoint_every": 3, "train.eval_batches": 0, "train.async_checkpoint": True,
    "optim.warmup_steps": 2, "optim.decay_fraction": 0.5, "mesh.data": 1,
}
ENV = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DEFAULT_MATMUL_PRECISION="highest",
           XLA_FLAGS="--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0")


def _command(workdir, *extra):
  return [sys.executable, "-m", "experiments.train", "--config=configs/base.py:tiny",
          f"--workdir={workdir}", "--noprogress",
          *(f"--config.{k}={v}" for k, v in OVERRIDES.items()), *extra]


def _start(workdir, *extra):
  return subprocess.Popen(_command(workdir, *extra), cwd=ROOT, env=ENV, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


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
  # The unbroken run and the first half run side by side (two cores).
  first = _start(unbroken)
  half = _start(split, "--stop_at_step=3")
  _finish(first)
  half_log = _finish(half)
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
