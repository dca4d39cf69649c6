"""Optimisers and schedule (docs/MATH.md §6.5): WSD values by hand, the parameter split (which
group gets Muon, which AdamW, which weight decay and LR), clipping, and loss reduction on a tiny
model."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lineax_attn.train import optim

V, D, H = 32, 16, 32


def _params(seed=0):
  rng = np.random.default_rng(seed)
  n = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  return {
      "embed": {"embedding": n(V, D)},
      "mlp": {"up": {"kernel": n(D, H) / math.sqrt(D), "bias": jnp.zeros(H)},
              "down": {"kernel": n(H, D) / math.sqrt(H), "bias": jnp.zeros(D)}},
      "conv": {"kernel": n(4, D)},
      "norm": {"scale": jnp.ones(D)},
      "lm_head": {"kernel": n(D, V) / math.sqrt(D)},
  }


def _loss(p):
  """A tiny LM-shaped regression: token x -> (5x + 3) mod V through embed, MLP, head."""
  x = jnp.arange(V)
  y = (5 * x + 3) % V
  h = p["embed"]["embedding"][x]
  h = h + p["conv"]["kernel"][0] * h
  up = jax.nn.relu(h @ p["mlp"]["up"]["kernel"] + p["mlp"]["up"]["bias"])
  h = h + up @ p["mlp"]["down"]["kernel"] + p["mlp"]["down"]["bias"]
  logits = (h * p["norm"]["scale"]) @ p["lm_head"]["kernel"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# ------------------------------------------------------------------------------ schedule


def test_wsd_minus_sqrt_values():
  peak, floor, total, warm = 3e-4, 3e-5, 1000, 100
  lr = optim.wsd_schedule(peak, floor, total, warm, decay_fraction=0.2)
  assert float(lr(0)) == 0.0
  np.testing.assert_allclose(float(lr(50)), peak / 2, rtol=1e-6)  # linear warmup
  np.testing.assert_allclose(float(lr(100)), peak, rtol=1e-6)     # warmup end
  np.testing.assert_allclose(float(lr(500)), peak, rtol=1e-6)     # stable
  np.testing.assert_allclose(float(lr(800)), peak, rtol=1e-6)     # decay starts at 1000 - 200
  # x = 50/200 = 1/4: lr = min + (peak - min)(1 - sqrt(1/4)) = min + (peak - min)/2.
  np.testing.assert_allclose(float(lr(850)), floor + (peak - floor) * 0.5, rtol=1e-6)
  # x = 0.81: 1 - 0.9 = 0.1.
  np.testing.assert_allclose(float(lr(962)), floor + (peak - floor) * (1 - math.sqrt(0.81)),
                             rtol=1e-5)
  np.testing.assert_allclose(float(lr(1000)), floor, rtol=1e-6)   # end = min_lr
  np.testing.assert_allclose(float(lr(5000)), floor, rtol=1e-6)
  steps = np.arange(100, 1001)
  values = np.asarray(jax.vmap(lr)(steps))
  assert np.all(np.diff(values) <= 1e-12)  # never increases after warmup


def test_wsd_paper_settings_and_other_shapes():
  # docs/MATH.md §6.5: 28,610 iterations, warmup 200, the last 20% (5,722 iterations) decay.
  lr = optim.wsd_schedule(3.6e-4, 3.6e-5, 28_610, 200)
  np.testing.assert_allclose(float(lr(28_610 - 5_722)), 3.6e-4, rtol=1e-6)
  np.testing.assert_allclose(float(lr(28_610 - 5_722 + 1)), 3.6e-5 + 3.24e-4 * (1 - math.sqrt(1 / 5722)),
                             rtol=1e-5)
  # LR ablation: 2000 iterations, warmup 5, decay over the last 10 (decay_steps overrides).
  lr = optim.wsd_schedule(1e-3, 1e-4, 2000, 5, decay_steps=10)
  np.testing.assert_allclose(float(lr(1990)), 1e-3, rtol=1e-6)
  np.testing.assert_allclose(float(lr(1995)), 1e-4 + 9e-4 * (1 - math.sqrt(0.5)), rtol=1e-5)
  lin = optim.wsd_schedule(1.0, 0.0, 100, 0, decay_fraction=0.5, decay="linear")
  cos = optim.wsd_schedule(1.0, 0.0, 100, 0, decay_fraction=0.5, decay="cosine")
  np.testing.assert_allclose(float(lin(75)), 0.5, rtol=1e-6)
  np.testing.assert_allclose(float(cos(75)), 0.5, rtol=1e-6)
  np.testing.assert_allclose(float(cos(60)), 0.5 * (1 + math.cos(math.pi * 0.2)), rtol=1e-6)
  assert float(lin(0)) == 1.0  # no warmup
  with pytest.raises(ValueError, match="decay"):
    optim.wsd_schedule(1.0, 0.0, 100, 0, decay="exp")
  with pytest.raises(ValueError, match="warmup_steps"):
    optim.wsd_schedule(1.0, 0.0, 100, 90, decay_fraction=0.2)


# ---------------------------------------------------------------------------- the split


def test_param_groups():
  groups = optim.param_groups(_params())
  assert groups == {
      "embed": {"embedding": "embed"},
      "mlp": {"up": {"kernel": "matrix", "bias": "vector"},
              "down": {"kernel": "matrix", "bias": "vector"}},
      "conv": {"kernel": "conv"},
      "norm": {"scale": "vector"},
      "lm_head": {"kernel": "head"},
  }
  # Gate constants are "vector" at any rank: KDA's per-channel dt_bias [HV, K], a routing γ.
  assert optim.param_groups({"mixer": {"A_log": jnp.ones(4), "dt_bias": jnp.ones((4, 16)),
                                       "w_kernel": jnp.ones((4, 16))},
                             "route": {"gamma": jnp.ones((2, 8))}}) == {
      "mixer": {"A_log": "vector", "dt_bias": "vector", "w_kernel": "matrix"},
      "route": {"gamma": "vector"}}
  # Paths through lists / nnx-style integer keys.
  assert optim.param_groups({"layers": [{"w": jnp.ones((2, 2))}, {"b": jnp.ones(2)}]}) == {
      "layers": [{"w": "matrix"}, {"b": "vector"}]}


def _one_step(config, grads, params):
  tx = optim.make_optimizer(config)
  return jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(grads, params)


def test_adamw_weight_decay_only_on_matrices():
  """Zero gradients: Adam's part is 0, so the update is -lr * wd * param exactly where weight
  decay applies (matrices, conv, head) and 0 on embeddings and vectors."""
  params = _params()
  cfg = optim.OptimizerConfig(name="adamw", learning_rate=1e-2, min_learning_rate=1e-3,
                              warmup_steps=0, total_steps=100, weight_decay=0.1)
  updates, _ = _one_step(cfg, jax.tree.map(jnp.zeros_like, params), params)
  groups = optim.param_groups(params)
  for g, u, p in zip(jax.tree.leaves(groups), jax.tree.leaves(updates), jax.tree.leaves(params)):
    want = -1e-2 * 0.1 * p if g in ("matrix", "conv", "head") else jnp.zeros_like(p)
    np.testing.assert_allclose(u, want, rtol=1e-6, atol=1e-12, err_msg=g)


def test_muon_split_lrs_and_orthogonal_updates():
  params = _params()
  rng = np.random.default_rng(1)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
  lr, adam_lr = 3.6e-4, 1.5e-3
  cfg = optim.OptimizerConfig(name="muon", learning_rate=lr, min_learning_rate=lr / 10,
                              adam_learning_rate=adam_lr, warmup_steps=0, total_steps=100,
                              weight_decay=0.0, clip_norm=None)
  updates, _ = _one_step(cfg, grads, params)
  # Adam's first step is lr * g / (|g| + eps): every entry has magnitude adam_lr.
  for path in [("embed", "embedding"), ("lm_head", "kernel"), ("conv", "kernel"),
               ("norm", "scale"), ("mlp", "up", "bias")]:
    u = updates
    for key in path:
      u = u[key]
    g = grads
    for key in path:
      g = g[key]
    np.testing.assert_allclose(np.abs(u), adam_lr, rtol=1e-4, err_msg=str(path))
    assert np.all(np.sign(u) == -np.sign(g))
  # Muon on the matrices: -lr * sqrt(max(m, n)) * O, O ~ orthogonal (Newton-Schulz with
  # optax's coefficients leaves singular values in about [0.6, 1.2]).
  for name in ("up", "down"):
    u = np.asarray(updates["mlp"][name]["kernel"], np.float64)
    sv = np.linalg.svd(u / (-lr * math.sqrt(max(u.shape))), compute_uv=False)
    assert 0.5 < sv.min() and sv.max() < 1.3, (name, sv)
    # It is not Adam: entries are not all of one magnitude.
    assert np.std(np.abs(u)) > 0.2 * np.mean(np.abs(u))
  # The floor of the Adam group keeps the same min/peak ratio.
  sched = optim.schedules(cfg)
  np.testing.assert_allclose(float(sched["adam_lr"](100)), adam_lr / 10, rtol=1e-6)


def test_muon_weight_decay_on_matrices_only():
  params = _params()
  cfg = optim.OptimizerConfig(name="muon", learning_rate=0.02, min_learning_rate=0.002,
                              adam_learning_rate=0.01, warmup_steps=0, total_steps=100,
                              weight_decay=0.1)
  updates, _ = _one_step(cfg, jax.tree.map(jnp.zeros_like, params), params)
  groups = optim.param_groups(params)
  for g, u, p in zip(jax.tree.leaves(groups), jax.tree.leaves(updates), jax.tree.leaves(params)):
    want = -0.02 * 0.1 * p if g == "matrix" else jnp.zeros_like(p)
    np.testing.assert_allclose(u, want, rtol=1e-5, atol=1e-12, err_msg=g)


def test_global_norm_clipping():
  params = _params()
  grads = jax.tree.map(lambda p: 100.0 * jnp.ones_like(p), params)
  norm = float(optax.tree.norm(grads))
  for clip in (1.0, None):
    cfg = optim.OptimizerConfig(name="adamw", warmup_steps=0, total_steps=10, clip_norm=clip)
    _, state = _one_step(cfg, grads, params)
    mu = optax.tree_utils.tree_get(state, "mu")
    scale = 1.0 / norm if clip else 1.0
    for m, g in zip(jax.tree.leaves(mu), jax.tree.leaves(grads)):
      np.testing.assert_allclose(m, 0.1 * g * scale, rtol=1e-5)  # mu = (1 - b1) * clipped g


def test_config_errors():
  with pytest.raises(ValueError, match="learning_rat"):
    optim.OptimizerConfig.from_mapping({"learning_rat": 1e-3})
  with pytest.raises(ValueError, match="sgd"):
    optim.OptimizerConfig(name="sgd")
  cfg = optim.OptimizerConfig.from_mapping({"name": "muon"}, learning_rate=3.6e-4)
  assert cfg.name == "muon" and cfg.learning_rate == 3.6e-4


# -------------------------------------------------------------------------- tiny model


@pytest.mark.parametrize("name,kw", [
    ("adamw", dict(learning_rate=3e-2, min_learning_rate=3e-3)),
    ("muon", dict(learning_rate=2e-2, min_learning_rate=2e-3, adam_learning_rate=3e-2)),
    # Muon alone (the AdamW group frozen at LR 0): the matrices by themselves reduce the loss.
    ("muon", dict(learning_rate=2e-2, min_learning_rate=2e-3, adam_learning_rate=0.0)),
])
def test_optimisers_reduce_the_loss(name, kw):
  cfg = optim.OptimizerConfig(name=name, total_steps=30, warmup_steps=3, **kw)
  tx = optim.make_optimizer(cfg)
  params = _params()

  @jax.jit
  def run(params):
    def step(carry, _):
      p, s = carry
      loss, g = jax.value_and_grad(_loss)(p)
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), loss

    (params, _), losses = jax.lax.scan(step, (params, tx.init(params)), None, length=30)
    return params, losses

  new, losses = run(params)
  first, last = float(losses[0]), float(_loss(new))
  assert np.isfinite(last)
  if kw.get("adam_learning_rate") == 0.0:
    for path in [("embed", "embedding"), ("lm_head", "kernel"), ("norm", "scale")]:
      np.testing.assert_array_equal(new[path[0]][path[1]], params[path[0]][path[1]])
    assert last < 0.7 * first, (first, last)
  else:
    assert last < 0.1 * first, (first, last)  # log(32) = 3.5 -> well under 0.35
