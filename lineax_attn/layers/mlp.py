"""SwiGLU feed-forward block (docs/MATH.md §6.1): W_down(SiLU(x W_gate) ⊙ (x W_up)), no bias."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lineax_attn.layers import partition


class SwiGLU(nnx.Module):
  """`[..., d] -> [..., d]` through a hidden width `hidden` (the FFN size)."""

  def __init__(self, d_model: int, hidden: int, *, init_std: float = 0.02,
               out_init_std: float | None = None, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    if hidden <= 0:
      raise ValueError(f"SwiGLU hidden width must be positive, got {hidden}.")
    out_init_std = init_std if out_init_std is None else out_init_std
    up = partition.partitioned(nnx.initializers.normal(init_std), (partition.EMBED, partition.MLP))
    down = partition.partitioned(nnx.initializers.normal(out_init_std),
                                 (partition.MLP, partition.EMBED))
    common = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.gate_proj = nnx.Linear(d_model, hidden, kernel_init=up, **common)
    self.up_proj = nnx.Linear(d_model, hidden, kernel_init=up, **common)
    self.down_proj = nnx.Linear(hidden, d_model, kernel_init=down, **common)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
