"""The sharded train step equals the single-device step (the pjit way, docs/MATH.md §6 / issue #4).

The same jitted step (explicit in/out shardings from the logical-axis rules) runs on the 8 fake
CPU devices of conftest.py with meshes (data, fsdp, tensor) = (8,1,1) and (2,2,2) (under
-m slow also (1,1,8), (2,1,4) and issue #9's (2,4,1) and (4,1,2)), and on one device. Oracle: the
single-device step. Checked after two AdamW steps (so
the second step consumes a sharded optimiser state): the initial parameters (created in their
shardings by `jax.jit(out_shardings=...)`, one program per block kind, and bit-equal), the two
losses and every updated parameter.
Tolerance (float32, matmul precision highest): rel_err (rms ratio) <= 2e-6 per leaf, losses to
1e-6 relative; only the order of the sharded reductions differs. Adam's eps is 1e-3 here: with
eps 1e-8 the update g / (|g| + eps) of a near-zero gradient turns float32 rounding of g into
differences of order lr (measured: rel_err 2e-5 on the (2,2,2) mesh), which says nothing about
the sharding. Also: gradient accumulation (2 micro-batches) on (2,2,2) equals the same oracle.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from configs import base
from lineax_attn.data import pipeline as pipeline_lib
from lineax_attn.train import experiment, loop
from lineax_attn.train import sharding as sharding_lib
from tests.helpers import rel_err

# (2, 4, 1) and (4, 1, 2) are issue #9's data x fsdp and data x tensor meshes of 8 GPUs; (2, 2, 2)
# runs the same fsdp and tensor code on the default run. (2, 1, 4) (data x tensor) is slow too:
# it lowers the data and tensor shardings of (2, 2, 2) (at tensor = 4). (1, 1, 8) (tensor alone,
# 30 s) is slow since issue #15's suite-time cut: (2, 2, 2) lowers the same tensor shardings.
MESHES = [(8, 1, 1), (2, 2, 2), pytest.param((1, 1, 8), marks=pytest.mark.slow),
          pytest.param((2, 1, 4), marks=pytest.mark.slow),
          pytest.param((2, 4, 1), marks=pytest.mark.slow),
          pytest.param((4, 1, 2), marks=pytest.mark.slow)]


def _config():
  """A GDN + softmax stack whose every sharded width divides 8 (heads, mlp, vocab 384)."""
  config = base.get_config("tiny")
  config.model.update(d_model=32, n_layers=2, pattern="LS", num_heads=2, num_v_heads=4,
                      head_dim_k=16, head_dim_v=16, attn_heads=2, mlp_hidden=64, chunk_size=16)
  config.train.update(global_batch_size=8, seq_len=32, steps=10, eval_batches=0)
  config.optim.update(warmup_steps=0, learning_rate=1e-2, eps=1e-3)
  return config


@pytest.fixture(scope="module")
def setup():
  exp = experiment.resolve(_config())
  batches = []
  it = pipeline_lib.make_iterator(exp.train_data, shard_index=0, shard_count=1)
  for _ in range(2):
    batches.append(next(it))
  single = _run(exp, sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]), batches)
  return exp, batches, single


def _assert_same_step(sharded, single, where):
  np.testing.assert_allclose(sharded["losses"], single["losses"], rtol=1e-6)
  assert single["losses"][1] < single["losses"][0]  # the step did something
  flat_sharded = jax.tree_util.tree_flatten_with_path(sharded["params"])[0]
  flat_single = jax.tree.leaves(single["params"])
  for (path, a), b, init in zip(flat_sharded, flat_single, jax.tree.leaves(single["init"])):
    name = jax.tree_util.keystr(path)
    assert not np.array_equal(b, init), f"{name} was not updated"
    err = rel_err(a, b)
    assert err <= 2e-6, f"{name}: rel_err {err:.2e} on {where}"


# XLA's CPU backend at optimisation level 0 compiles these graphs 2-3x faster; the SPMD
# partitioning of the sharded program, which is what this file tests, is the same.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def _run(exp, mesh, batches):
  trainer = loop.Trainer(exp, mesh=mesh, compiler_options=COMPILER_OPTIONS)
  params, opt_state = trainer.init()
  # Created in their shardings (lm.make_param_init's pieces and the optimiser state).
  for got, want in zip(jax.tree.leaves((params, opt_state)),
                       jax.tree.leaves((trainer.param_shardings, trainer.opt_shardings))):
    assert got.sharding == want
  init = jax.device_get(params)
  losses = []
  for b in batches:
    params, opt_state, metrics = trainer.step(params, opt_state, trainer.global_batch(b))
    losses.append(float(metrics["loss"]))
  return {"init": init, "losses": losses, "params": jax.device_get(params),
          "specs": jax.tree.map(lambda x: x.sharding.spec, params)}


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sharded_step_equals_single_device(setup, shape):
  exp, batches, single = setup
  sharded = _run(exp, sharding_lib.make_mesh(*shape), batches)
  # Something is actually sharded on this mesh (the tensor axis shards the heads and MLP).
  axes_used = {a for spec in jax.tree.leaves(sharded["specs"], is_leaf=lambda x: isinstance(
      x, jax.sharding.PartitionSpec)) for a in spec if a is not None}
  if shape[2] > 1:
    assert "tensor" in axes_used
  if shape[1] > 1:
    assert "fsdp" in axes_used
  for a, b in zip(jax.tree.leaves(sharded["init"]), jax.tree.leaves(single["init"])):
    np.testing.assert_array_equal(a, b)  # the same initial values, whatever the sharding
  _assert_same_step(sharded, single, f"mesh {shape}")


def test_gradient_accumulation_equals_one_batch(setup):
  """train.grad_accum_steps=2 on the (2,2,2) mesh: two micro-batches of 4 rows (one per batch
  shard each), gradients summed in a scan and divided by the batch's token count once."""
  exp, batches, single = setup
  accum = dataclasses.replace(exp, train=dataclasses.replace(exp.train, grad_accum_steps=2))
  _assert_same_step(_run(accum, sharding_lib.make_mesh(2, 2, 2), batches), single,
                    "mesh (2,2,2) with 2 micro-batches")
