"""The training loop (lineax_attn.train.loop) on tiny models, on one CPU device.

* The masked cross-entropy against a numpy log-softmax oracle.
* AdamW and Muon both lower the training and the validation loss of a tiny GDN model, and the
  run leaves its logs: metrics.jsonl (one train record per step, eval records at 0 and the
  end), TensorBoard events, config.json and the final checkpoint.
* A NaN learning rate that starts at the WSD decay phase (min_learning_rate = NaN) stops the
  run at the first bad step with a message naming the step and the last good checkpoint; that
  checkpoint stays and holds finite parameters, and nothing of the bad step is saved.
* The FLOPs model and the MFU estimate against hand-computed values.
* MetricWriter restarting from a step (a resume after a kill) keeps exactly the records up to
  it, in metrics.jsonl and in TensorBoard's event files (read back from the TFRecord bytes).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from helpers import tensorboard_scalars
from lineax_attn.train import checkpoint as checkpoint_lib
from lineax_attn.train import experiment, loop, metrics
from lineax_attn.train import progress as progress_lib
from lineax_attn.train import sharding as sharding_lib


def test_masked_cross_entropy_matches_numpy():
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((2, 5, 7)).astype(np.float32) * 3
  targets = rng.integers(0, 7, (2, 5)).astype(np.int32)
  mask = (rng.random((2, 5)) > 0.4).astype(np.float32)
  log_probs = logits - np.log(np.sum(np.exp(logits.astype(np.float64)), -1, keepdims=True))
  nll = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
  expected = np.sum(nll * mask) / np.sum(mask)
  got = loop.masked_cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
  np.testing.assert_allclose(float(got), expected, rtol=1e-6)
  total, count = loop.cross_entropy_sums(jnp.asarray(logits), jnp.asarray(targets),
                                         jnp.zeros_like(jnp.asarray(mask)))
  assert float(total) == 0.0 and float(count) == 0.0
  assert float(loop.masked_cross_entropy(jnp.asarray(logits), jnp.asarray(targets),
                                         jnp.zeros((2, 5)))) == 0.0


def _tiny(mixer="gdn", n_layers=1, **train):
  config = base.get_config("tiny")
  config.model.update(mixer=mixer, d_model=32, n_layers=n_layers, mlp_hidden=64, chunk_size=16)
  config.train.update({**dict(global_batch_size=8, seq_len=64, log_every=1, eval_every=0,
                              eval_batches=1, checkpoint_every=0, async_checkpoint=False),
                       **train})
  config.mesh.update(data=1)
  return config


def _single_device(config):
  return experiment.resolve(config, device_count=1, process_count=1)


# XLA's CPU backend at optimisation level 0: 2-3x faster compiles for these tiny models.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def _train_on_one_device(config, workdir, **kwargs):
  # One device: the tiny runs need no mesh, and one device compiles fastest.
  mesh = sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  return loop.train(_single_device(config), str(workdir), progress=False, mesh=mesh,
                    compiler_options=COMPILER_OPTIONS, **kwargs)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_both_optimizers_reduce_the_loss(tmp_path, optimizer):
  config = _tiny(steps=30)
  config.optim.update(base.MUON["tiny"] if optimizer == "muon" else {"name": "adamw"})
  config.optim.update(warmup_steps=3)
  result = _train_on_one_device(config, tmp_path)
  assert result.completed and result.final_step == 30 and len(result.losses) == 30
  first, last = result.losses[0], float(np.mean(result.losses[-5:]))
  assert abs(first - np.log(384)) < 0.1  # untrained: about uniform over the padded vocab 384
  assert last < first - 1.5, (optimizer, first, last)
  (step0, val0), (step30, val30) = result.eval_losses
  assert (step0, step30) == (0, 30) and val30 < val0 - 1.5

  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  train = [r for r in records if r["kind"] == "train"]
  assert [r["step"] for r in train] == list(range(1, 31))
  np.testing.assert_array_equal([r["loss"] for r in train], result.losses)
  assert all(r["tokens_per_s"] > 0 for r in train[2:]) and "mfu" not in train[-1]  # CPU: n/a
  assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 30]
  assert any(n.startswith("events.out.tfevents") for n in os.listdir(tmp_path / "tensorboard"))
  assert json.load(open(tmp_path / "config.json"))["optim"]["name"] == optimizer
  with checkpoint_lib.Checkpointer(tmp_path / "checkpoints") as ckpt:
    assert ckpt.all_steps() == [30]


def test_nan_stops_and_keeps_the_last_good_checkpoint(tmp_path):
  config = _tiny("softmax", steps=10, checkpoint_every=4, keep_checkpoints=5)
  # The WSD decay starts at step index 8 (the 9th update): lr = min + ... = NaN from there.
  config.optim.update(warmup_steps=0, decay_fraction=0.2, min_learning_rate=float("nan"))
  config.train.eval_batches = 0
  with pytest.raises(loop.NonFiniteLossError) as info:
    _train_on_one_device(config, tmp_path)
  message = str(info.value)
  assert "non-finite training loss at step 9" in message
  assert "the last good checkpoint is step 8" in message
  with checkpoint_lib.Checkpointer(tmp_path / "checkpoints") as ckpt:
    assert ckpt.all_steps() == [4, 8]
    trainer = loop.Trainer(_single_device(config),
                           mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    state = ckpt.restore(8, trainer.abstract_state())
  assert int(state["step"]) == 8
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state["params"]))
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 9))
  assert records[-1]["kind"] == "error" and records[-1]["last_good_checkpoint"] == 8


def test_flops_and_mfu_by_hand():
  config = _tiny("softmax", n_layers=2, steps=10)
  config.optim.warmup_steps = 0
  exp = _single_device(config)
  m = exp.model  # d 32, 2 softmax layers of 2 heads x 16, vocab 384, untied
  trainer = loop.Trainer(exp, mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
  n = trainer.num_params
  attention = 2 * 4 * 2 * 16 * (64 / 2)  # layers x 4 x heads x d_h x causal context T/2
  expected = 3 * (2 * (n - 384 * 32) + attention)
  assert metrics.train_flops_per_token(m, n, 64) == pytest.approx(expected)

  class Device:
    platform, device_kind = "gpu", "NVIDIA H200"

  class Cpu:
    platform, device_kind = "cpu", "cpu"

  assert metrics.peak_flops(Device()) == 989e12 and metrics.peak_flops(Cpu()) is None
  assert metrics.mfu(1e9, 989e3, [Device(), Device()]) == pytest.approx(0.5)
  assert metrics.mfu(1e9, 1e3, [Cpu()]) is None
  line = progress_lib.Progress("run", 100, enabled=False).line(
      50, 2.5, val_loss=2.75, tokens_per_s=12345.0, mfu=None, eta_s=75)
  assert line == "[run]  step  50/100  loss 2.5000  val 2.7500  12.3k tok/s  mfu n/a  eta 0:01:15"


def test_metric_writer_restart_drops_the_replayed_steps(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path))
  for step in range(1, 7):
    writer.write(step, "train", {"loss": float(step), "lr": 0.5})
  writer.write(4, "eval", {"loss": 0.75})
  writer.write(6, "eval", {"loss": 0.25})
  writer.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 7, "kind": "tr')  # the torn last line of a killed process
  assert [r["step"] for r in metrics.read_metrics(str(tmp_path)) if r["kind"] == "train"] == [
      1, 2, 3, 4, 5, 6]

  # Resumed from the checkpoint of step 4: steps 5 and 6 run again.
  writer = metrics.MetricWriter(str(tmp_path), discard_after_step=4)
  writer.write(5, "train", {"loss": 50.0, "lr": 0.5})
  writer.close()
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [(r["kind"], r["step"], r["loss"]) for r in rows] == [
      ("train", 1, 1.0), ("train", 2, 2.0), ("train", 3, 3.0), ("train", 4, 4.0),
      ("eval", 4, 0.75), ("train", 5, 50.0)]
  expected = {(f"{r['kind']}/{key}", r["step"]): [r[key]] for r in rows
              for key in ("loss", "lr") if key in r}
  assert tensorboard_scalars(tmp_path / "tensorboard") == expected

  # A fresh start (no checkpoint) keeps nothing.
  metrics.MetricWriter(str(tmp_path), discard_after_step=-1).close()
  assert open(tmp_path / "metrics.jsonl").read() == ""
  assert tensorboard_scalars(tmp_path / "tensorboard") == {}
