"""The token cross-entropy (`lineax_attn.models.losses`), shared by the training loop, the recall
evals and `inspect.train_tiny`: values and gradients against hand-computed numbers, masked
positions (an ignore label of -100 included), bf16 logits, jit, and the argument checks."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lineax_attn.models import losses

# Three positions over a vocabulary of 2. Position 0: logits (0, 0), target 0: NLL = log 2.
# Position 1: logits (log 3, 0), target 1: NLL = log(3 + 1) - 0 = log 4. Position 2 is masked
# out, with an ignore label and extreme logits that would dominate if it were counted.
LOGITS = jnp.asarray([[[0.0, 0.0], [math.log(3.0), 0.0], [100.0, -100.0]]], jnp.float32)
TARGETS = jnp.asarray([[0, 1, -100]], jnp.int32)
MASK = jnp.asarray([[1, 1, 0]], jnp.float32)


def test_sums_and_mean_match_hand_computed_values():
  total, count = losses.cross_entropy_sums(LOGITS, TARGETS, MASK)
  np.testing.assert_allclose(float(total), 3 * math.log(2.0), rtol=1e-6)   # log 2 + log 4
  assert float(count) == 2.0
  np.testing.assert_allclose(float(losses.masked_cross_entropy(LOGITS, TARGETS, MASK)),
                             1.5 * math.log(2.0), rtol=1e-6)
  # A bool mask is the same mask.
  np.testing.assert_allclose(float(losses.masked_cross_entropy(LOGITS, TARGETS, MASK > 0)),
                             1.5 * math.log(2.0), rtol=1e-6)


def test_no_mask_counts_every_position():
  logits, targets = LOGITS[:, :2], TARGETS[:, :2]
  np.testing.assert_allclose(float(losses.masked_cross_entropy(logits, targets)),
                             1.5 * math.log(2.0), rtol=1e-6)
  assert float(losses.cross_entropy_sums(logits, targets)[1]) == 2.0


def test_nothing_counted_gives_zero():
  total, count = losses.cross_entropy_sums(LOGITS, TARGETS, jnp.zeros((1, 3)))
  assert float(total) == 0.0 and float(count) == 0.0
  assert float(losses.masked_cross_entropy(LOGITS, TARGETS, jnp.zeros((1, 3)))) == 0.0


def test_gradient_is_softmax_minus_onehot_and_zero_where_masked():
  # d mean / d logits = (softmax − onehot(target)) / count on counted rows, 0 on masked rows
  # (finite, although the masked row's target is -100).
  grad = jax.jit(jax.grad(lambda x: losses.masked_cross_entropy(x, TARGETS, MASK)))(LOGITS)
  want = np.asarray([[[0.5 - 1.0, 0.5], [0.75, 0.25 - 1.0], [0.0, 0.0]]]) / 2.0
  np.testing.assert_allclose(np.asarray(grad), want, atol=1e-6)


def test_bf16_logits_are_computed_in_float32():
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4, 5)) * 4, jnp.bfloat16)
  targets = jnp.asarray([[0, 1, 2, 3], [4, 3, 2, 1]], jnp.int32)
  x = np.asarray(logits, np.float64)          # the bf16 values, exactly
  nll = np.log(np.exp(x).sum(-1)) - np.take_along_axis(x, np.asarray(targets)[..., None], -1)[..., 0]
  got = losses.masked_cross_entropy(logits, targets)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(float(got), nll.mean(), rtol=1e-6)


@pytest.mark.parametrize("args,match", [
    ((LOGITS, TARGETS.astype(jnp.float32), MASK), "`targets` must be an integer array"),
    ((LOGITS, TARGETS[:, :2], MASK), r"`targets` must have the shape of `logits` without its "
                                     r"vocabulary axis, \(1, 3\), got \(1, 2\)"),
    ((LOGITS, TARGETS, MASK[:, :2]), r"`mask` must have the shape of `targets` \(1, 3\)"),
    ((TARGETS, TARGETS, MASK), "`logits` must be a floating-point array"),
])
def test_bad_arguments_are_named(args, match):
  with pytest.raises(ValueError, match=match):
    losses.cross_entropy_sums(*args)
