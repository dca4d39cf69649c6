"""Checkpoints with real orbax in tmp_path: bit-identical state (params, a real Muon optimiser
state, step), the data iterator continuing with the same batches, the config, keep-K and
save-every-N, and restoring onto a sharded target."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from lineax_attn.data import pipeline as P
from lineax_attn.train import checkpoint as C
from lineax_attn.train import optim
from lineax_attn.train import sharding as S

DATA = P.DataConfig(seq_len=24, global_batch_size=2, shuffle_window=6, seed=5)


_TX = optim.make_optimizer(optim.OptimizerConfig(name="muon", warmup_steps=0, total_steps=10))


@jax.jit
def _update(params, opt_state):
  grads = jax.grad(lambda p: jnp.sum(jnp.sin(p["embed"]["embedding"]) @ p["mlp"]["kernel"])
                   + jnp.sum(p["mlp"]["bias"].astype(jnp.float32) ** 2))(params)
  updates, opt_state = _TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _state(step: int):
  """Params (f32 + bf16 leaves) after `step` Muon steps, with the real optimiser state."""
  rng = np.random.default_rng(0)
  params = {"embed": {"embedding": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)},
            "mlp": {"kernel": jnp.asarray(rng.standard_normal((8, 12)), jnp.float32),
                    "bias": jnp.ones(12, jnp.bfloat16)}}
  opt_state = _TX.init(params)
  for _ in range(step):
    params, opt_state = _update(params, opt_state)
  return {"params": params, "opt_state": opt_state, "step": jnp.asarray(step, jnp.int32)}


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _assert_bit_identical(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


def test_save_restore_state_data_and_config(tmp_path):
  state = _state(3)
  it = P.make_iterator(DATA, shard_index=0, shard_count=1)
  for _ in range(5):
    next(it)
  config = ml_collections.ConfigDict({"data": DATA.__dict__, "optimizer": {"name": "muon"},
                                      "mesh": (1, -1, 1)})
  with C.Checkpointer(tmp_path / "ckpt", max_to_keep=3) as ckpt:
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError):
      ckpt.restore(None, _abstract(state))
    assert ckpt.save(3, state, data_iterator=it, config=config)
    # The iterator moves on while the save completes: the saved state is the one at save time.
    expected = [next(it) for _ in range(4)]
    ckpt.wait_until_finished()
    assert {"config", "data", "state"} <= set(os.listdir(tmp_path / "ckpt" / "3"))
    assert os.listdir(tmp_path / "ckpt" / "3" / "data").count("process_0-of-1.json") == 1

  # A new process would do this: fresh manager, fresh iterator of the same pipeline.
  with C.Checkpointer(tmp_path / "ckpt") as ckpt:
    assert ckpt.latest_step() == 3
    fresh = P.make_iterator(DATA, shard_index=0, shard_count=1)
    restored = ckpt.restore(None, _abstract(state), data_iterator=fresh)
    _assert_bit_identical(restored, state)
    got = [next(fresh) for _ in range(4)]
    for a, b in zip(got, expected):
      for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    saved_config = ckpt.restore_config()
    assert saved_config["data"]["seq_len"] == 24 and saved_config["optimizer"] == {"name": "muon"}
    assert saved_config["mesh"] == [1, -1, 1]
    # Training resumes: one more step from the restored state equals step 4 of an unbroken run.
    params, opt_state = _update(restored["params"], restored["opt_state"])
    unbroken = _state(4)
    _assert_bit_identical((params, opt_state), (unbroken["params"], unbroken["opt_state"]))


def test_max_to_keep_and_save_interval(tmp_path):
  state = _state(0)
  with C.Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=2, async_save=False) as ckpt:
    saved = [step for step in range(1, 8) if ckpt.save(step, state)]
    assert saved == [2, 4, 6]
    assert ckpt.all_steps() == [4, 6]          # keep the last 2
    assert not ckpt.should_save(7)
    assert ckpt.save(7, state, force=True)     # the final step, off the interval
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [6, 7] and ckpt.latest_step() == 7
    assert sorted(n for n in os.listdir(tmp_path) if n.isdigit()) == ["6", "7"]
    _assert_bit_identical(ckpt.restore(6, _abstract(state)), state)


def test_restore_onto_a_sharded_target(tmp_path):
  """Saved unsharded, restored with each leaf placed on a (2, 2, 2) mesh by its logical axes."""
  state = {"params": {"kernel": jnp.arange(8 * 12, dtype=jnp.float32).reshape(8, 12),
                      "bias": jnp.arange(12, dtype=jnp.float32)},
           "step": jnp.asarray(7, jnp.int32)}
  with C.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(7, state, config=P.DataConfig())
    mesh = S.make_mesh(2, 2, 2)
    target = {"params": S.shard_params(_abstract(state["params"]),
                                       {"kernel": ("embed", "mlp"), "bias": ("mlp",)}, mesh),
              "step": jax.ShapeDtypeStruct((), jnp.int32)}
    restored = ckpt.restore(7, target)
    _assert_bit_identical(restored, state)
    assert restored["params"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert restored["params"]["kernel"].addressable_shards[0].data.shape == (4, 6)
    assert ckpt.restore_config()["seq_len"] == P.DataConfig().seq_len
