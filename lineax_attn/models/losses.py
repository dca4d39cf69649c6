"""The language-model loss: masked token cross-entropy, the one implementation in the repo.

    total, count = cross_entropy_sums(logits, targets, mask)   # the loop sums over micro-batches
    loss = masked_cross_entropy(logits, targets, mask)         # total / count

The training loop (`lineax_attn.train.loop`), the recall evals (`lineax_attn.evals.recall`),
`lineax_attn.inspect.train_tiny` and the benchmarks all call these, so they measure the same
number: the mean over counted positions of log Σ_v exp(logits_v) − logits_target, in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check(logits, targets, mask) -> None:
  if not hasattr(logits, "shape") or logits.ndim < 1 or not jnp.issubdtype(logits.dtype,
                                                                          jnp.floating):
    raise ValueError(f"`logits` must be a floating-point array [..., V], got "
                     f"{getattr(logits, 'dtype', type(logits).__name__)} of shape "
                     f"{tuple(getattr(logits, 'shape', ()))}.")
  if not hasattr(targets, "dtype") or not jnp.issubdtype(targets.dtype, jnp.integer):
    raise ValueError(f"`targets` must be an integer array of token ids, got "
                     f"{getattr(targets, 'dtype', type(targets).__name__)}.")
  if tuple(targets.shape) != tuple(logits.shape[:-1]):
    raise ValueError(f"`targets` must have the shape of `logits` without its vocabulary axis, "
                     f"{tuple(logits.shape[:-1])}, got {tuple(targets.shape)}.")
  if mask is not None and tuple(getattr(mask, "shape", ())) != tuple(targets.shape):
    raise ValueError(f"`mask` must have the shape of `targets` {tuple(targets.shape)}, got "
                     f"{tuple(getattr(mask, 'shape', ()))}.")


def cross_entropy_sums(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None
                       ) -> tuple[jax.Array, jax.Array]:
  """(sum of the masked token NLL, number of counted tokens), both float32 scalars.

  Args:
    logits: `[..., V]` float (any float dtype; computed in float32).
    targets: `[...]` int token ids in [0, V) where counted; uncounted positions may hold any
      id (e.g. an ignore label of -100): they are neither read nor differentiated through.
    mask: `[...]` 1 = counted, 0 = not (bool or float; fractional values weight the token);
      None counts every position.
  """
  _check(logits, targets, mask)
  logits = logits.astype(jnp.float32)
  mask = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
  safe_targets = jnp.where(mask != 0, targets, 0).astype(jnp.int32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, safe_targets[..., None], axis=-1)[..., 0]
  return jnp.sum((log_z - target_logit) * mask), jnp.sum(mask)


def masked_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None
                         ) -> jax.Array:
  """Mean token NLL over the counted tokens (0 when none is counted); see `cross_entropy_sums`."""
  total, count = cross_entropy_sums(logits, targets, mask)
  return total / jnp.maximum(count, 1.0)
