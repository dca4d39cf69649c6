"""`LinearMixer(remat_conv_norm=...)` (and `ModelConfig.remat_conv_norm`): the layer's front
(short conv, SiLU, L2N) and its gated output norm recomputed in the backward; None, the
default, takes each mixer's measured choice.

Two properties: the layer's outputs and gradients do not change (the oracle: the same layer with
the option off, same parameters), and the backward then keeps none of the conv's float32 taps or
boolean segment masks (the oracle: the residuals `jax.vjp` holds, read from its pullback's
leaves). Tolerances, float32: outputs 1e-6 relative (the same operations, fused differently by
XLA); gradients 2e-5 (sums over tokens in another order; the per-head gate parameters' are
small differences of large terms: 4e-6 seen).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lineax_attn.layers import LINEAR_MIXERS, LinearMixer
from lineax_attn.models import config as config_lib
from lineax_attn.models.lm import LanguageModel
from helpers import rel_err

D, B, T = 32, 2, 37     # T: two whole chunks of 16 and a ragged third
DIMS = dict(num_heads=2, num_v_heads=4, head_dim_k=8, head_dim_v=8, chunk_size=16)


def _layer(kind, remat, dtype=jnp.float32):
  return LinearMixer(kind, D, **DIMS, implementation="chunk", dtype=dtype,
                     remat_conv_norm=remat, rngs=nnx.Rngs(0))


def _inputs(dtype=jnp.float32):
  x = jax.random.normal(jax.random.key(1), (B, T, D), dtype)
  # Two documents in row 0 and right padding in row 1: the conv's segment masks are in play.
  seg = np.ones((B, T), np.int32)
  seg[0, 20:] = 2
  seg[1, 30:] = 0
  return x, jnp.asarray(seg)


@nnx.jit
def _values_and_grads(layer, x, seg):
  def loss(layer):
    out = layer.forward(x, seg)
    return jnp.mean(out.y ** 2) + jnp.mean(out.r ** 2), out.y
  (_, y), grads = nnx.value_and_grad(loss, has_aux=True)(layer)
  return y, grads


# What remat_conv_norm recomputes (`conv_silu_l2n`, `gated_head_norm`) depends on the mixer only
# through its output gate, at these DIMS: "none" (linear_attention, deltanet, simple_gla),
# "silu" (gdn, gdn2), "sigmoid" (kda). The default run keeps one mixer per output gate
# (simple_gla, gdn, kda); the others run the same checkpointed code and are `-m slow` (suite
# time). Their layers' chunk-form gradients stay in the default run through
# tests/test_models.py::test_training_steps_through_every_mixer_with_routing (simple_gla, not
# in that model, is kept here), their ops' in tests/test_chunk_vs_scan.py.
_REMAT_DEFAULT = ("simple_gla", "gdn", "kda")


@pytest.mark.parametrize("kind", [pytest.param(k, marks=() if k in _REMAT_DEFAULT else
                                               pytest.mark.slow) for k in LINEAR_MIXERS])
def test_remat_changes_no_value_or_gradient(kind):
  x, seg = _inputs()
  y_on, g_on = _values_and_grads(_layer(kind, True), x, seg)
  y_off, g_off = _values_and_grads(_layer(kind, False), x, seg)
  assert rel_err(y_on, y_off) <= 1e-6
  leaves_on, leaves_off = jax.tree.leaves(g_on), jax.tree.leaves(g_off)
  assert len(leaves_on) == len(leaves_off) >= 4   # in_proj, conv, norm, out_proj at least
  for a, b in zip(leaves_on, leaves_off):
    assert np.all(np.isfinite(np.asarray(a)))
    assert rel_err(a, b) <= 2e-5


def _residuals(layer, x, seg):
  """The per-token arrays `[B, T, ...]` the layer's backward keeps: (dtype, trailing shape)."""
  graphdef, state = nnx.split(layer)

  def loss(state, x):
    return jnp.mean(nnx.merge(graphdef, state)(x, seg).astype(jnp.float32) ** 2)

  # The pullback's leaves are the residuals; traced abstractly (eval_shape), jax.vjp keeps the
  # same residuals it keeps eagerly, without running the forward op by op (an eager vjp compiled
  # ~220 primitives here, ~8 s).
  residuals = jax.eval_shape(lambda s, x: jax.tree.leaves(jax.vjp(loss, s, x)[1]), state, x)
  return [(str(a.dtype), a.shape[2:], a.size * a.dtype.itemsize)
          for a in residuals
          if hasattr(a, "shape") and a.ndim >= 3 and a.shape[:2] == (B, T)]


@pytest.mark.parametrize("kind", ["gdn", "gdn2"])
def test_remat_keeps_no_float32_taps_or_masks_of_the_conv(kind):
  x, seg = _inputs(jnp.bfloat16)
  channels = _layer(kind, True).conv_channels
  taps = lambda res: [r for r in res if r[0] in ("float32", "bool") and r[1] == (channels,)]
  kept_off = _residuals(_layer(kind, False, jnp.bfloat16), x, seg)
  kept_on = _residuals(_layer(kind, True, jnp.bfloat16), x, seg)
  assert taps(kept_off), "the oracle must see the conv's taps when they are kept"
  assert not taps(kept_on)
  assert sum(r[2] for r in kept_on) < 0.5 * sum(r[2] for r in kept_off)


def _linear_layers(**overrides):
  model = LanguageModel(config_lib.tiny(**overrides), rngs=nnx.Rngs(0))
  linear = [blk.mixer for blk in model.blocks if isinstance(blk.mixer, LinearMixer)]
  assert linear
  return linear


def test_model_config_passes_the_option_and_validates_it():
  assert all(not m.remat_conv_norm for m in _linear_layers(mixer="gdn", remat_conv_norm=False))
  assert all(m.remat_conv_norm for m in _linear_layers(mixer="gdn2", remat_conv_norm=True))
  with pytest.raises(ValueError, match="remat_conv_norm"):
    config_lib.tiny(mixer="gdn", remat_conv_norm="yes")
  with pytest.raises(ValueError, match="remat_conv_norm"):
    LinearMixer("gdn", D, **DIMS, remat_conv_norm=1, rngs=nnx.Rngs(0))


# The defaults as measured on the GPU (docs/LAYERS.md, "Memory"): on for every mixer but GDN-2,
# whose 350M step was slower and larger with it. Written out here, not read from the specs, so
# a changed default has to change this table too.
EXPECTED_DEFAULT = {"linear_attention": True, "deltanet": True, "gdn": True, "kda": True,
                    "gdn2": False, "simple_gla": True}


@pytest.mark.parametrize("kind", LINEAR_MIXERS)
def test_default_is_each_mixers_measured_choice(kind):
  assert set(EXPECTED_DEFAULT) == set(LINEAR_MIXERS)
  assert _layer(kind, None).remat_conv_norm is EXPECTED_DEFAULT[kind]
  assert all(m.remat_conv_norm is EXPECTED_DEFAULT[kind] for m in _linear_layers(mixer=kind))
  assert _layer(kind, not EXPECTED_DEFAULT[kind]).remat_conv_norm is not EXPECTED_DEFAULT[kind]


@pytest.mark.parametrize("t", [1, 16])   # one token; exactly one chunk
def test_remat_forward_only_and_decoding_at_the_edges(t):
  # Forward only under jit (no VJP: the checkpoint is only a wrapper), fresh compiles for both
  # settings, then a one-token decoding step from the cache the first call returned (the conv
  # cache passes through the checkpointed front).
  x = jax.random.normal(jax.random.key(5), (B, t + 1, D), jnp.float32)

  @nnx.jit
  def run(layer):
    out = layer.forward(x[:, :t], max_len=t + 1)
    step = layer.decode_step(x[:, t], out.cache)
    return out.y, out.cache["conv"], step.y

  got = run(_layer("gdn", True))
  want = run(_layer("gdn", False))
  for name, a, b in zip(("y", "conv cache", "decoded y"), got, want):
    assert a.shape == b.shape and np.all(np.isfinite(np.asarray(a))), name
    assert rel_err(a, b) <= 1e-6, name
