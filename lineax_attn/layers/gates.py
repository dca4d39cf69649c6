"""Gate parametrisations and their initialisers (docs/MATH.md §2.3-2.6, §4.4).

Every decay leaves here as a log decay g = log α ≤ 0 in float32, the form the ops take (§1.5):

    g = −exp(A_log) · softplus(f + dt_bias)                   every decay (GDN, KDA, GDN-2, ...)
    g = lb · σ(exp(A_log) · (f + dt_bias)),  lb ∈ [−5, 0)     KDA's optional "safe" bounded gate
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lineax_attn.ops import specs

GATE_INITS = ("repo", "fla", "long", "very_long")


def softplus_inverse(y: jax.Array) -> jax.Array:
  """softplus⁻¹(y) = y + log(−expm1(−y)), for y > 0."""
  return y + jnp.log(-jnp.expm1(-y))


def a_log_init(low: float = 1.0, high: float = 16.0):
  """A_log = log A with A ~ U(low, high). The repo uses U(1, 16), FLA's GDN layer U(0, 16)."""

  def init(key, shape, dtype=jnp.float32):
    a = jax.random.uniform(key, shape, jnp.float32, low, high)
    return jnp.log(jnp.maximum(a, 1e-4)).astype(dtype)  # U(0, 16) can draw ~0

  return init


def dt_bias_log_uniform_init(dt_min: float = 1e-3, dt_max: float = 0.1, floor: float = 1e-4):
  """dt_bias = softplus⁻¹(dt), dt ~ LogUniform(dt_min, dt_max) clamped to >= floor."""

  def init(key, shape, dtype=jnp.float32):
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.exp(u * (jnp.log(dt_max) - jnp.log(dt_min)) + jnp.log(dt_min))
    return softplus_inverse(jnp.maximum(dt, floor)).astype(dtype)

  return init


def dt_bias_ones_init(key, shape, dtype=jnp.float32):
  del key
  return jnp.ones(shape, dtype)


def gate_initializers(kind: str, gate_init: str):
  """(A_log init, dt_bias init) of docs/MATH.md §4.4 for a mixer kind and preset ("repo", "fla",
  "long": a slow initial decay for short synthetic runs, or "very_long": ten times slower).
  The "repo" / "fla" values are the mixer's `specs.LayerSpec.decay_init`."""
  if gate_init not in GATE_INITS:
    raise ValueError(f"unknown gate_init {gate_init!r}; expected one of {GATE_INITS}.")
  spec = specs.resolve(kind)
  if spec.layer.decay_init is None:
    raise ValueError(f"mixer {spec.layer_name!r} has no decay to initialise.")
  if gate_init == "long":
    # Long initial memory for short synthetic runs (MQAR): dt ~ LogU(1e-4, 1e-3) puts the
    # per-token log decay in [-0.016, -1e-4] (a horizon of 60 to 10^4 tokens) instead of FLA's
    # ~6-token median horizon, which AdamW needs thousands of steps at 1e-3 to stretch.
    return a_log_init(1.0, 16.0), dt_bias_log_uniform_init(1e-4, 1e-3, floor=1e-5)
  if gate_init == "very_long":
    # Ten times "long" (dt ~ LogU(1e-5, 1e-4): log decays in [-1.6e-3, -1e-5], horizons of 600
    # to 10^5 tokens), for MQAR at T 512, where "long"'s trained GDN kept horizons of 100-300
    # tokens, shorter than the key-query distances (docs/EXPERIMENTS.md, T 512 N 64).
    return a_log_init(1.0, 16.0), dt_bias_log_uniform_init(1e-5, 1e-4, floor=1e-6)
  low, high, dt = spec.layer.decay_init[gate_init]
  return a_log_init(low, high), (dt_bias_ones_init if dt == "ones" else dt_bias_log_uniform_init())


def log_decay(f: jax.Array, a_log: jax.Array, dt_bias: jax.Array,
              lower_bound: float | None = None) -> jax.Array:
  """g = −exp(A_log)·softplus(f + dt_bias), or the bounded lb·σ(exp(A_log)·(f + dt_bias)).

  f, a_log and dt_bias broadcast against each other; everything is float32 and g <= 0.
  """
  f = f.astype(jnp.float32) + dt_bias.astype(jnp.float32)
  a = jnp.exp(a_log.astype(jnp.float32))
  if lower_bound is None:
    return -a * jax.nn.softplus(f)
  return lower_bound * jax.nn.sigmoid(a * f)


def sigmoid_gate(logits: jax.Array, allow_neg_eigval: bool = False) -> jax.Array:
  """β (or GDN-2's erase gate b) = σ(logits) ∈ (0, 1), or 2σ ∈ (0, 2) with `allow_neg_eigval`."""
  s = jax.nn.sigmoid(logits.astype(jnp.float32))
  return 2.0 * s if allow_neg_eigval else s
