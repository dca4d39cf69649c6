"""simple GLA (decay only, S_t = e^{g_t} S_{t−1} + k_t v_tᵀ), added as one `specs.MixerSpec`.

The oracle is Mamba-2's SSD in its quadratic ("attention") form, computed in numpy float64:

    y_t = Σ_{s ≤ t} (C_t · B_s) exp(A Σ_{r=s+1..t} dt_r) dt_s x_s + exp(A Σ_{r ≤ t} dt_r) S_0ᵀ C_t

which is simple GLA with q = C, k = B, v = dt·x, g = dt·A and scale 1. The parametrised suites
(chunk vs scan, kernels, layers, decoding, context parallelism) pick the mixer up from the spec
list; this file checks the maths itself and the layer's parametrisation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import assert_close
from lineax_attn import ops
from lineax_attn.layers import LinearMixer
from lineax_attn.models.params import count_params
from lineax_attn.ops import specs

B, T, H, HV, N, P = 2, 40, 1, 2, 16, 8   # N: SSD state size (K), P: head dim (V)


def _ssd_inputs(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((B, T, HV, P))
  b_in = rng.standard_normal((B, T, H, N)) / np.sqrt(N)
  c_in = rng.standard_normal((B, T, H, N)) / np.sqrt(N)
  dt = np.log1p(np.exp(rng.standard_normal((B, T, HV)) - 1.0))   # softplus: dt > 0
  a = -np.exp(rng.uniform(-1.0, 1.0, HV))                         # A < 0 per head
  s0 = rng.standard_normal((B, HV, N, P))
  return x, b_in, c_in, dt, a, s0


def _ssd_quadratic(x, b_in, c_in, dt, a, s0):
  """Mamba-2's SSD, quadratic form, float64 (GVA: value head j reads B/C head j // (HV/H))."""
  rep = HV // H
  bh, ch = np.repeat(b_in, rep, axis=2), np.repeat(c_in, rep, axis=2)
  cum = np.cumsum(dt * a, axis=1)                                   # [B, T, HV]
  seg = cum[:, :, None, :] - cum[:, None, :, :]                     # [B, t, s, HV]
  causal = np.tril(np.ones((T, T), bool))[None, :, :, None]
  decay = np.where(causal, np.exp(np.where(causal, seg, 0.0)), 0.0)
  scores = np.einsum("bthn,bshn->btsh", ch, bh) * decay
  y = np.einsum("btsh,bsh,bshp->bthp", scores, dt, x)
  y += np.exp(cum)[..., None] * np.einsum("bthn,bhnp->bthp", ch, s0)
  final = np.exp(cum[:, -1])[..., None, None] * s0 + np.einsum(
      "bsh,bshn,bshp->bhnp", np.exp(cum[:, -1:] - cum) * dt, bh, x)
  return y, final


@pytest.mark.parametrize("impl", ["scan", "chunk", "pallas_tpu"])
def test_simple_gla_is_mamba2_ssd(impl):
  x, b_in, c_in, dt, a, s0 = _ssd_inputs()
  y_ref, final_ref = _ssd_quadratic(x, b_in, c_in, dt, a, s0)
  f32 = lambda z: jnp.asarray(z, jnp.float32)
  o, final, r = ops.simple_gla(f32(c_in), f32(b_in), f32(dt[..., None] * x), f32(dt * a),
                               scale=1.0, initial_state=f32(s0), output_final_state=True,
                               return_residual=True, chunk_size=16, implementation=impl)
  assert_close(o, y_ref, 1e-5, f"{impl} o")
  assert_close(final, final_ref, 1e-5, f"{impl} final state")
  assert_close(r, dt[..., None] * x, 1e-6, f"{impl} r = v (no delta edit)")


def test_simple_gla_spec_names_and_validation():
  spec = specs.resolve("Simple_GLA")
  assert spec.name == "simple_gla" and spec.gate_names == ("g",)
  x, b_in, c_in, dt, a, _ = _ssd_inputs()
  f32 = lambda z: jnp.asarray(z, jnp.float32)
  with pytest.raises(ValueError, match="`g` is a log decay and must be <= 0"):
    ops.simple_gla(f32(c_in), f32(b_in), f32(x), f32(-dt * a))
  with pytest.raises(ValueError, match=r"`g` must have shape \[B, T, HV\]"):
    ops.simple_gla(f32(c_in), f32(b_in), f32(x), f32(dt * a)[..., None])


def test_simple_gla_layer_has_a_gdn_style_decay_and_no_beta():
  layer = LinearMixer("simple_gla", 64, num_heads=2, num_v_heads=4, head_dim_k=16, head_dim_v=8,
                      rngs=nnx.Rngs(0))
  assert layer.output_gate == "none"     # as linear attention
  assert [name for name, _ in layer.in_parts] == ["q", "k", "v", "f"]
  assert layer.A_log[...].shape == (4,) and layer.dt_bias[...].shape == (4,)
  qk, vw = 2 * 16, 4 * 8
  conv = (2 * qk + vw) * 4                          # depthwise, width 4, no bias
  expected = 64 * (2 * qk + vw + 4) + conv + 4 + 4 + 8 + vw * 64   # + A_log, dt_bias, norm
  assert count_params(nnx.eval_shape(lambda: LinearMixer(
      "simple_gla", 64, num_heads=2, num_v_heads=4, head_dim_k=16, head_dim_v=8,
      rngs=nnx.Rngs(0)))) == expected
  x = jax.random.normal(jax.random.key(1), (2, 12, 64))
  f = layer.in_proj(x)[..., -4:]                   # the last in-projection part: f [B, T, HV]
  (g,), z = layer._gates(x, {"f": f})  # pylint: disable=protected-access
  want = -jnp.exp(layer.A_log[...]) * jax.nn.softplus(f + layer.dt_bias[...])
  assert z is None
  assert_close(g, want, 1e-6, "g = -exp(A_log) softplus(f + dt_bias)")
  out = nnx.jit(lambda m, x: m.forward(x))(layer, x)  # one compile, not one per primitive
  assert out.y.shape == (2, 12, 64) and bool(jnp.all(jnp.isfinite(out.y)))
