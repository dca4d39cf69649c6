"""Mesh construction and logical-axis rules on the 8 fake CPU devices of conftest.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from lineax_attn.train import sharding as S


def test_eight_devices():
  assert jax.device_count() == 8


@pytest.mark.parametrize("sizes,expected", [
    ((8, 1, 1), (8, 1, 1)),
    ((2, 2, 2), (2, 2, 2)),
    ((1, 1, 8), (1, 1, 8)),
    ((1, -1, 1), (1, 8, 1)),
    ((-1, 2, 1), (4, 2, 1)),
    ((2, 1, -1), (2, 1, 4)),
])
def test_make_mesh(sizes, expected):
  mesh = S.make_mesh(*sizes)
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert tuple(mesh.shape[a] for a in mesh.axis_names) == expected
  assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 3
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


@pytest.mark.parametrize("sizes,match", [
    ((3, 1, 1), r"data=3, fsdp=1, tensor=1.*= 3 but 8 devices"),
    ((2, 2, 1), r"= 4 but 8 devices"),
    ((2, 2, 4), r"= 16 but 8 devices"),
    ((-1, -1, 1), r"at most one may be -1.*\['data', 'fsdp'\]"),
    ((0, 8, 1), r"\['data'\]"),
    ((-1, 3, 1), r"multiple of 3 devices"),
])
def test_impossible_mesh_fails_naming_the_axes(sizes, match):
  with pytest.raises(ValueError, match=match):
    S.make_mesh(*sizes)


def test_logical_to_pspec_default_rules():
  mesh = S.make_mesh(2, 2, 2)
  f = lambda axes: S.logical_to_pspec(axes, mesh=mesh)  # noqa: E731
  assert f(("embed", "mlp")) == P("fsdp", "tensor")
  assert f(("mlp", "embed")) == P("tensor", "fsdp")
  assert f(("vocab", "embed")) == P("tensor", "fsdp")
  assert f(("embed", "heads", "kv")) == P("fsdp", "tensor", None)
  assert f(("batch", "length", "embed")) == P(("data", "fsdp"), None, None)
  # Unknown names and None are replicated.
  assert f(("not_a_rule", "embed")) == P(None, "fsdp")
  assert f((None, None)) == P(None, None)
  assert f(None) == P()
  # A mesh axis shards one dimension only: the leftmost keeps it.
  assert f(("embed", "embed")) == P("fsdp", None)
  assert f(("heads", "mlp")) == P("tensor", None)
  assert f(("batch", "embed")) == P(("data", "fsdp"), None)
  # Axes the mesh lacks are dropped; the first rule for a name wins.
  small = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  assert S.logical_to_pspec(("batch", "embed"), mesh=small) == P("data", None)
  rules = (("embed", "tensor"), ("embed", "fsdp"))
  assert S.logical_to_pspec(("embed",), rules, mesh) == P("tensor")
  # A PartitionSpec of logical names works too.
  assert f(P("embed", "vocab")) == P("fsdp", "tensor")


def test_shard_params_places_shards_and_checks_divisibility():
  mesh = S.make_mesh(2, 2, 2)
  params = {
      "embed": {"embedding": jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8)},
      "mlp": {"kernel": jnp.arange(8 * 12, dtype=jnp.float32).reshape(8, 12),
              "bias": jnp.arange(12, dtype=jnp.float32)},
      "scale": jnp.ones(8),
  }
  axes = {"embed": {"embedding": ("vocab", "embed")},
          "mlp": {"kernel": ("embed", "mlp"), "bias": ("mlp",)},
          "scale": None}
  placed = S.shard_params(params, axes, mesh)
  specs = jax.tree.map(lambda x: x.sharding.spec, placed)
  assert specs == {"embed": {"embedding": P("tensor", "fsdp")},
                   "mlp": {"kernel": P("fsdp", "tensor"), "bias": P("tensor")},
                   "scale": P()}
  shard_shapes = jax.tree.map(lambda x: x.addressable_shards[0].data.shape, placed)
  assert shard_shapes == {"embed": {"embedding": (8, 4)},
                          "mlp": {"kernel": (4, 6), "bias": (6,)}, "scale": (8,)}
  for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The shard on each device is the matching block of the array.
  kernel = placed["mlp"]["kernel"]
  for shard in kernel.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(params["mlp"]["kernel"])[shard.index])

  # Abstract leaves: shardings only, no transfer.
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  abs_placed = S.shard_params(abstract, axes, mesh)
  assert jax.tree.map(lambda x: x.sharding.spec, abs_placed) == specs

  S.shard_params({"w": jnp.ones((6, 12))}, {"w": ("embed", "mlp")}, mesh)  # 6/2 and 12/2: fine
  with pytest.raises(ValueError, match=r"\['w'\].*dimension 1 \(size 5\).*tensor"):
    S.shard_params({"w": jnp.ones((6, 5))}, {"w": ("embed", "mlp")}, mesh)


def test_nnx_logical_axes_round_trip():
  class Tiny(nnx.Module):

    def __init__(self):
      init = nnx.initializers.lecun_normal()
      self.up = nnx.Linear(8, 16, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                           rngs=nnx.Rngs(0))
      self.blocks = nnx.List([nnx.Linear(16, 8, rngs=nnx.Rngs(1))])

  with nnx.use_eager_sharding(False):
    model = Tiny()
  state = nnx.state(model, nnx.Param)
  axes = S.nnx_logical_axes(state)
  assert axes == {"up": {"kernel": ("embed", "mlp"), "bias": None},
                  "blocks": {0: {"kernel": None, "bias": None}}}
  pure = nnx.to_pure_dict(state)
  placed = S.shard_params(pure, axes, S.make_mesh(1, 4, 2))
  assert placed["up"]["kernel"].sharding.spec == P("fsdp", "tensor")
  assert placed["blocks"][0]["kernel"].sharding.spec == P()


def test_shard_batch():
  mesh = S.make_mesh(2, 2, 2)
  batch = {"inputs": np.arange(8 * 6, dtype=np.int32).reshape(8, 6),
           "loss_mask": np.ones((8, 6), np.float32)}
  placed = S.shard_batch(batch, mesh)
  for k, v in placed.items():
    assert v.sharding.spec == P(("data", "fsdp"))
    assert v.addressable_shards[0].data.shape == (2, 6)
    np.testing.assert_array_equal(np.asarray(v), batch[k])
  # A jitted reduction over the sharded batch gives the plain answer.
  total = jax.jit(lambda b: jnp.sum(b["inputs"] * b["loss_mask"]))(placed)
  assert int(total) == int(batch["inputs"].sum())
