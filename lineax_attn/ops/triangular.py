"""(I + L)^{-1} for strictly lower-triangular L by matmuls only, with a closed-form VJP.

The intra-chunk solve of the chunk form (docs/MATH.md §3.7). A batched `triangular_solve` of
many 64×64 systems is slow on GPUs (one small serial solve per system), and autodiff through
it is slower still; this inverse is ~30 small matmuls forward and two C×C matmuls backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def _inverse_by_blocks(L, block=16):
  """Each 16×16 diagonal block N = −L_bb is nilpotent, so (I − N)^{-1} = Σ_{j<16} N^j
  = (I + N)(I + N²)(I + N⁴)(I + N⁸); blocks are then merged pairwise with
  [[A, 0], [B, D]]^{-1} = [[A^{-1}, 0], [−D^{-1} B A^{-1}, D^{-1}]]. Float32 at HIGHEST."""
  c = L.shape[-1]
  b = min(block, c)
  if c % b or (c // b) & (c // b - 1):
    raise ValueError(f"unit_lower_inverse: L must be [..., C, C] with C <= {block} or "
                     f"{block}·2^n, got C={c}.")
  mm = lambda x, y: jnp.einsum("...ij,...jk->...ik", x, y, precision=_HI)
  eye = jnp.eye(b, dtype=L.dtype)
  invs = []
  for i in range(c // b):
    n = -L[..., i * b:(i + 1) * b, i * b:(i + 1) * b]
    z, pw = eye + n, n
    for _ in range(max(b.bit_length() - 2, 0)):   # 16 -> N², N⁴, N⁸
      pw = mm(pw, pw)
      z = z + mm(z, pw)
    invs.append(z)
  while len(invs) > 1:
    size = invs[0].shape[-1]
    merged = []
    for j in range(0, len(invs), 2):
      a_inv, d_inv = invs[j], invs[j + 1]
      r0, c0 = (j + 1) * size, j * size
      lower_left = -mm(mm(d_inv, L[..., r0:r0 + size, c0:c0 + size]), a_inv)
      top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
      bottom = jnp.concatenate([lower_left, d_inv], axis=-1)
      merged.append(jnp.concatenate([top, bottom], axis=-2))
    invs = merged
  return invs[0]


@jax.custom_vjp
def unit_lower_inverse(L):
  """(I + L)^{-1} for strictly lower-triangular L `[..., C, C]` (C 16·2^n or ≤ 16), float32.

  Backward by the closed form instead of autodiff through the forward's matmuls: with
  X = (I + L)^{-1}, dX = −X dL X, so L̄ = −Xᵀ X̄ Xᵀ restricted to the strictly lower triangle
  (L's other entries are structurally zero).
  """
  return _inverse_by_blocks(L)


def _fwd(L):
  x = _inverse_by_blocks(L)
  return x, x


def _bwd(x, x_bar):
  c = x.shape[-1]
  xt = jnp.swapaxes(x, -1, -2)
  l_bar = -jnp.einsum("...ij,...jk,...kl->...il", xt, x_bar, xt, precision=_HI)
  return (jnp.where(jnp.tril(jnp.ones((c, c), bool), k=-1), l_bar, 0.0),)


unit_lower_inverse.defvjp(_fwd, _bwd)
