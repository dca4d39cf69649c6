"""The multi-process path on CPU: two local processes, `jax.distributed.initialize` with a
localhost coordinator, 4 fake CPU devices each, train 3 steps on a (data=8) mesh that spans
both processes. Each process reads its own shard of the documents (the pipeline shards by
`jax.process_index()`), global batches come from `jax.make_array_from_process_local_data`,
and both processes save the final checkpoint together (orbax).

Oracle: a single-process run on the 8 devices of conftest.py with the same mesh and the same
global batches (rows of shard 0 of 2, then rows of shard 1 of 2). Checked: both processes
report the same per-step losses as the oracle (relative 1e-6: only the all-reduce differs),
the metrics log is written once (process 0), and the checkpoint written by the two processes
restores here to parameters within rel_err 1e-5 of the oracle's.

Everything compiles with XLA's backend optimisation level 0 (faster compiles). The oracle's
all-reduce runs in one process and the workers' through gloo, hence a tolerance rather than bit
equality.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import jax
import numpy as np

from configs import base
from lineax_attn.data import pipeline as pipeline_lib
from lineax_attn.train import checkpoint as checkpoint_lib
from lineax_attn.train import experiment, loop
from lineax_attn.train import sharding as sharding_lib
from tests.helpers import cpu_env, fast_cpu_xla, rel_err, REPO_ROOT as ROOT

STEPS = 3

WORKER = """
import json, sys
from lineax_attn.train import distributed
port, process_id, workdir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
distributed.initialize("on", coordinator_address=f"localhost:{port}", num_processes=2,
                       process_id=process_id)
import jax
from tests.test_multiprocess import make_config
from lineax_attn.train import loop
result = loop.train(make_config(), workdir, progress=False)
print("RESULT " + json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                              "devices": jax.device_count(), "local": jax.local_device_count(),
                              "losses": result.losses}), flush=True)
"""


def make_config():
  config = base.get_config("tiny")
  # One softmax layer: the subject is the multi-process plumbing (data shards, global arrays,
  # the gloo all-reduce, the joint checkpoint), which is the same for any model; a GDN layer
  # tripled each of the three compiles. test_train_sharded covers GDN on a data mesh.
  config.model.update(pattern="S", n_layers=1, d_model=32, mlp_hidden=64, chunk_size=16)
  config.train.update(steps=STEPS, seq_len=64, global_batch_size=8, log_every=1,
                      eval_batches=0, checkpoint_every=0, async_checkpoint=False)
  config.optim.update(warmup_steps=1)
  config.mesh.update(data=8, fsdp=1, tensor=1)
  return config


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _oracle():
  """Single process, 8 devices: the global batches the two processes assemble."""
  exp = experiment.resolve(make_config())
  trainer = loop.Trainer(exp, mesh=sharding_lib.make_mesh(8, 1, 1),
                         compiler_options={"xla_backend_optimization_level": 0})
  shards = [pipeline_lib.make_iterator(exp.train_data, shard_index=i, shard_count=2)
            for i in range(2)]
  params, opt_state = trainer.init()
  losses = []
  for _ in range(STEPS):
    parts = [next(it) for it in shards]
    batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    params, opt_state, metrics = trainer.step(params, opt_state, trainer.global_batch(batch))
    losses.append(float(metrics["loss"]))
  return trainer, losses, jax.device_get(params)


def test_two_processes_match_one(tmp_path):
  port = _free_port()
  env = cpu_env(fast_cpu_xla(4), PYTHONPATH=ROOT)
  workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(port), str(i), str(tmp_path)],
                              cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for i in range(2)]
  trainer, expected, expected_params = _oracle()  # meanwhile, in this process
  results = []
  for proc in workers:
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    line = next(l for l in out.splitlines() if l.startswith("RESULT "))
    results.append(json.loads(line[len("RESULT "):]))

  assert sorted(r["process"] for r in results) == [0, 1]
  for r in results:
    assert (r["processes"], r["devices"], r["local"]) == (2, 8, 4)
    np.testing.assert_allclose(r["losses"], expected, rtol=1e-6)
  assert results[0]["losses"] == results[1]["losses"]
  assert expected[-1] < expected[0]

  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, STEPS + 1))
  with checkpoint_lib.Checkpointer(tmp_path / "checkpoints") as ckpt:
    assert ckpt.all_steps() == [STEPS]
    restored = ckpt.restore(STEPS, trainer.abstract_state())
  assert int(restored["step"]) == STEPS
  for a, b in zip(jax.tree.leaves(restored["params"]), jax.tree.leaves(expected_params)):
    assert rel_err(a, b) <= 1e-5
