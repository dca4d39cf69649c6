"""Cross-layer routing (docs/MATH.md §5.1-5.3): the parameters and the routed terms.

* **CLER v1** (`"cler"`): the value target of linear layer ℓ_m gets the write residual of the
  most recent earlier linear layer, v′ = v + γ ⊙ N(r^{(ℓ_{m−1})}). γ is zero-initialised, so the
  model starts at the baseline; the first linear layer receives γ·0 (γ stays in the graph, its
  gradient is exactly 0). Softmax layers pass the residual through untouched ("latest" mode).
* **CLER-H** (`"cler_h"`): after the whole block ℓ, h ← h + P_ℓ(N(vec r^{(ℓ)})).
* **CLVR** (`"clvr"`): after the whole block ℓ, h ← h + P_ℓ(vec v^{(ℓ)}), v the write value.

P_ℓ is a bias-free Linear H_v·d_v → d with zero-initialised weight, or at rank r_P a pair
Linear(H_v·d_v → r_P) (default init) then Linear(r_P → d) (zero init). Routing needs no decoding
cache: every routed term is a same-token quantity (§5.6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lineax_attn.layers import partition
from lineax_attn.layers.norm import rms_normalize

ROUTE_EPS = 1e-6  # the N(·) of §5.1/§5.2: r / sqrt(mean(r²) + 1e-6)


class ClerGamma(nnx.Module):
  """CLER v1 injection γ ⊙ N(r) `[B, T, HV, d_v]`; γ is a scalar, per head or per (head, channel)."""

  def __init__(self, num_v_heads: int, head_dim_v: int, *, shape: str = "scalar",
               init: float = 0.0, normalize: bool = False, param_dtype=jnp.float32,
               rngs: nnx.Rngs | None = None):
    del rngs
    dims = {"scalar": (), "head": (num_v_heads, 1), "channel": (num_v_heads, head_dim_v)}
    if shape not in dims:
      raise ValueError(f"CLER gamma shape must be one of {sorted(dims)}, got {shape!r}.")
    self.normalize = normalize
    self.gamma = partition.param(None, nnx.initializers.constant(init), dims[shape], param_dtype,
                                 (None,) * len(dims[shape]))

  def __call__(self, r: jax.Array) -> jax.Array:
    x = rms_normalize(r, ROUTE_EPS) if self.normalize else r.astype(jnp.float32)
    return (self.gamma[...].astype(jnp.float32) * x).astype(r.dtype)


class HiddenRoute(nnx.Module):
  """P_ℓ of CLER-H / CLVR: `[B, T, HV, d_v] -> [B, T, d]`, zero at initialisation."""

  def __init__(self, in_heads: int, head_dim: int, d_model: int, *, rank: int | None = None,
               normalize: bool = False, init_std: float = 0.02, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    in_dim = in_heads * head_dim
    self.normalize = normalize
    self.rank = rank
    zeros = nnx.initializers.zeros
    linear = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if rank is None:
      self.proj = nnx.Linear(in_dim, d_model, kernel_init=partition.partitioned(
          zeros, (partition.HEADS, partition.EMBED)), **linear)
    else:
      self.down = nnx.Linear(in_dim, rank, kernel_init=partition.partitioned(
          nnx.initializers.normal(init_std), (partition.HEADS, partition.RANK)), **linear)
      self.up = nnx.Linear(rank, d_model, kernel_init=partition.partitioned(
          zeros, (partition.RANK, partition.EMBED)), **linear)

  def __call__(self, s: jax.Array) -> jax.Array:
    b, t = s.shape[:2]
    x = s.reshape(b, t, -1)
    if self.normalize:  # over the flattened H_v·d_v vector (§5.2)
      x = rms_normalize(x, ROUTE_EPS).astype(s.dtype)
    if self.rank is None:
      return self.proj(x)
    return self.up(self.down(x))
