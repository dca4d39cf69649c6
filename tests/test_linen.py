"""Linen wrappers (lineax_attn.linen): a wrapped layer inside a plain Linen model trains one step,
computes the same function as the NNX layer with the same weights, keeps the logical axis names,
and every wrapper initialises and runs.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lineax_attn import linen as lxl
from lineax_attn.layers import LinearMixer
from lineax_attn.models import ModelConfig
from helpers import assert_close

MIXER_ARGS = dict(kind="gdn", d_model=32, num_heads=2, num_v_heads=4, head_dim_k=8, head_dim_v=8,
                  implementation="scan")  # the bridge is under test here, not the op


class TinyLinenModel(nn.Module):
  """Someone else's Linen model with our layers dropped in."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(32)(x)
    h = h + lxl.LinearMixer(**MIXER_ARGS, name="mixer")(lxl.RMSNorm(dim=32)(h))
    h = h + lxl.SoftmaxAttention(d_model=32, num_heads=4, num_kv_heads=2, name="attn")(h)
    return nn.Dense(3)(h)


def test_linen_model_with_wrapped_layers_trains_one_step():
  x = jax.random.normal(jax.random.key(0), (2, 12, 5))
  y = jax.random.normal(jax.random.key(1), (2, 12, 3))
  model = TinyLinenModel()
  params = jax.jit(model.init)(jax.random.key(2), x)["params"]

  def loss_fn(params):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

  tx = optax.adam(1e-2)
  opt_state = tx.init(params)

  @jax.jit
  def train_step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    return new_params, loss, loss_fn(new_params), grads

  new_params, loss, new_loss, grads = train_step(params, opt_state)
  assert np.isfinite(float(loss))
  for leaf in jax.tree.leaves(nn.unbox(grads)):
    assert np.all(np.isfinite(leaf))
  mixer_grads = nn.unbox(grads)["mixer"]
  assert float(jnp.max(jnp.abs(mixer_grads["in_proj"]["kernel"]))) > 0
  assert float(jnp.max(jnp.abs(mixer_grads["A_log"]))) > 0
  assert float(new_loss) < float(loss)
  assert not np.array_equal(nn.unbox(new_params)["mixer"]["in_proj"]["kernel"],
                            nn.unbox(params)["mixer"]["in_proj"]["kernel"])

  # Logical axis names survive the bridge.
  specs = nn.get_partition_spec(params)
  assert tuple(specs["mixer"]["in_proj"]["kernel"]) == ("embed", "heads")
  assert tuple(specs["attn"]["out_proj"]["kernel"]) == ("heads", "embed")


def test_linen_wrapper_computes_the_nnx_layer():
  x = jax.random.normal(jax.random.key(0), (2, 20, 32))
  wrapped = lxl.LinearMixer(**MIXER_ARGS)
  variables = jax.jit(wrapped.init)(jax.random.key(1), x)
  y_linen = jax.jit(wrapped.apply)(variables, x)
  # The same weights in the NNX layer.
  layer = LinearMixer(**MIXER_ARGS, rngs=nnx.Rngs(7))
  state = nnx.state(layer)
  nnx.replace_by_pure_dict(state, nn.unbox(variables["params"]))
  nnx.update(layer, state)
  y_nnx = nnx.jit(lambda m, x: m(x))(layer, x)
  assert_close(y_linen, y_nnx, 1e-6, "linen vs nnx")
  # Another method through `nnx_method`.
  out = jax.jit(lambda v, x: wrapped.apply(v, x, nnx_method="forward"))(variables, x)
  assert out.r.shape == (2, 20, 4, 8)


def test_every_linen_wrapper_initialises_and_runs():
  key = jax.random.key(0)
  x = jax.random.normal(key, (2, 8, 16))
  cases = [
      (lxl.RMSNorm(dim=16), (x,), (2, 8, 16)),
      (lxl.SwiGLU(d_model=16, hidden=24), (x,), (2, 8, 16)),
      (lxl.GatedHeadNorm(head_dim=4, gate="silu"), (x.reshape(2, 8, 4, 4), x.reshape(2, 8, 4, 4)),
       (2, 8, 4, 4)),
      (lxl.SoftmaxAttention(d_model=16, num_heads=2, window=4, output_gate=True), (x,), (2, 8, 16)),
  ]
  for module, args, shape in cases:
    variables = jax.jit(module.init)(key, *args)
    assert jax.jit(module.apply)(variables, *args).shape == shape
  conv = lxl.ShortConv(channels=16, width=4)
  y, state = jax.jit(conv.apply)(jax.jit(conv.init)(key, x), x)
  assert y.shape == (2, 8, 16) and state.shape == (2, 3, 16)
  config = ModelConfig(vocab_size=32, d_model=16, n_layers=2, pattern="LS", num_heads=2,
                       attn_heads=2, mlp_hidden=32, implementation="scan")
  lm = lxl.LanguageModel(config=config)
  tokens = jnp.zeros((2, 8), jnp.int32)
  logits = jax.jit(lm.apply)(jax.jit(lm.init)(key, tokens), tokens)
  assert logits.shape == (2, 8, 32) and logits.dtype == jnp.float32
