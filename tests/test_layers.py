"""Tests of the NNX layers (lineax_attn.layers): shapes, dtypes, gradients, scan = chunk through
the whole layer, the segment-aware short conv against a direct loop, packing = separate at the
layer level, softmax attention's window and RoPE, docs/MATH.md §4.4 initialisation, §4.5 per-layer
parameter counts and construction-time errors.

Tolerances (docs/MATH.md §9, float32 at HIGHEST precision): layer outputs 1e-5.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lineax_attn.layers import LINEAR_MIXERS, LinearMixer, ShortConv, SoftmaxAttention, SwiGLU
from lineax_attn.layers import attention as attention_lib
from lineax_attn.layers import conv as conv_lib
from lineax_attn.models.params import count_params
from helpers import assert_close, rel_err

D = 32
DIMS = dict(num_heads=2, num_v_heads=4, head_dim_k=8, head_dim_v=8, chunk_size=16)


def _mixer(kind, seed=0, **kw):
  return LinearMixer(kind, D, **{**DIMS, **kw}, rngs=nnx.Rngs(seed))


def _x(b=2, t=37, seed=1, d=D):
  return jax.random.normal(jax.random.key(seed), (b, t, d), jnp.float32)


# ------------------------------------------------------------------------------------------
# Every linear mixer: shapes, dtypes, scan = chunk, gradients.


@nnx.jit
def _chunk_scan_and_grads(chunk_layer, scan_layer, x):
  out_c = chunk_layer.forward(x)
  out_s = scan_layer.forward(x)

  def loss(layer):
    out = layer.forward(x)
    return jnp.mean(out.y ** 2) + jnp.mean(out.r ** 2)

  # Gradients through the scan form: cheaper to compile on CPU. The chunk form's backward is
  # checked against it in the op tests, and through the whole model in test_models.
  return out_c, out_s, nnx.grad(loss)(scan_layer)


@pytest.mark.parametrize("kind", LINEAR_MIXERS)
def test_linear_mixer_shapes_scan_equals_chunk_and_grads(kind):
  x = _x()
  chunk_layer = _mixer(kind, implementation="chunk")
  scan_layer = _mixer(kind, implementation="scan")
  # Same seed, same parameters: the two layers differ only in how the op runs.
  for a, b in zip(jax.tree.leaves(nnx.state(chunk_layer)), jax.tree.leaves(nnx.state(scan_layer))):
    np.testing.assert_array_equal(a, b)
  out_c, out_s, grads = _chunk_scan_and_grads(chunk_layer, scan_layer, x)

  assert out_c.y.shape == (2, 37, D) and out_c.y.dtype == jnp.float32
  assert out_c.r.shape == (2, 37, 4, 8) and out_c.v.shape == (2, 37, 4, 8)
  assert out_c.cache is None
  assert_close(out_c.y, out_s.y, 1e-5, f"{kind} y chunk vs scan")
  assert_close(out_c.r, out_s.r, 1e-5, f"{kind} r chunk vs scan")
  assert float(jnp.sqrt(jnp.mean(out_c.y ** 2))) > 0

  # Every parameter is wired in: finite and non-zero gradient.
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    name = jax.tree_util.keystr(path)
    assert np.all(np.isfinite(g)), f"{kind}{name}: non-finite gradient"
    assert float(jnp.max(jnp.abs(g))) > 0, f"{kind}{name}: zero gradient"


def test_linear_attention_residual_is_the_value():
  # docs/MATH.md §2.7: linear attention's r equals its v.
  out = nnx.jit(lambda layer, x: layer.forward(x))(_mixer("linear_attention"), _x(t=20))
  assert_close(out.r, out.v, 1e-6, "r vs v")


# ------------------------------------------------------------------------------------------
# Short conv: segment-aware, padding-aware, cache = last W−1 real inputs of the last segment.


def _segidx_numpy(ids):
  """docs/MATH.md §1.7 by hand: forward-fill padding, count segment starts."""
  ids = np.asarray(ids)
  out = np.zeros_like(ids)
  for b in range(ids.shape[0]):
    real = [t for t in range(ids.shape[1]) if ids[b, t] != 0]
    filled = ids[b].copy()
    prev = ids[b, real[0]]
    for t in range(ids.shape[1]):
      prev = ids[b, t] if ids[b, t] != 0 else prev
      filled[t] = prev
    seg = 1
    for t in range(ids.shape[1]):
      if t > 0 and filled[t] != filled[t - 1]:
        seg += 1
      out[b, t] = seg
  return out


def test_short_conv_matches_direct_loop_with_segments_padding_and_cache():
  b, t, c, width = 2, 13, 3, 4
  rng = np.random.default_rng(0)
  u = rng.normal(size=(b, t, c)).astype(np.float32)
  w = rng.normal(size=(width, c)).astype(np.float32)
  state = rng.normal(size=(b, width - 1, c)).astype(np.float32)
  ids = np.array([[0, 1, 1, 2, 2, 2, 0, 2, 1, 1, 1, 1, 0],     # leading/mid/trailing pad, reused id
                  [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 0, 0, 0]], np.int32)
  valid = ids != 0
  segidx = _segidx_numpy(ids)
  y, new_state = conv_lib.causal_depthwise_conv(
      jnp.asarray(u), jnp.asarray(w), valid=jnp.asarray(valid), segidx=jnp.asarray(segidx),
      state=jnp.asarray(state))

  expected = np.zeros((b, t, c), np.float64)
  for bi in range(b):
    for ti in range(t):
      for j in range(width):
        tau = ti - width + 1 + j
        if tau < 0:  # cache rows continue the row's first segment
          if segidx[bi, ti] == 1:
            expected[bi, ti] += w[j] * state[bi, width - 1 + tau]
        elif valid[bi, tau] and segidx[bi, tau] == segidx[bi, ti]:
          expected[bi, ti] += w[j] * u[bi, tau]
  np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-6)

  # Cache: last 3 real inputs of the last segment, oldest first, zero-filled.
  for bi in range(b):
    last = segidx[bi, -1]
    rows = [u[bi, ti] for ti in range(t) if valid[bi, ti] and segidx[bi, ti] == last]
    if last == 1:
      rows = list(state[bi]) + rows
    rows = rows[-(width - 1):]
    rows = [np.zeros(c, np.float32)] * (width - 1 - len(rows)) + rows
    np.testing.assert_allclose(np.asarray(new_state[bi]), np.stack(rows), rtol=0, atol=0)
  # Row 0's last segment (id 1 at t=8..11) has 4 real inputs: the cache is u[9..11].
  np.testing.assert_array_equal(np.asarray(new_state[0]), u[0, 9:12])


def test_short_conv_init_is_pytorch_default():
  conv = ShortConv(512, 4, rngs=nnx.Rngs(0))
  w = np.asarray(conv.weight[...])
  assert w.shape == (4, 512)
  assert w.min() >= -0.5 and w.max() <= 0.5 and w.std() > 0.25  # U(-1/2, 1/2): std 0.289


# ------------------------------------------------------------------------------------------
# Packing = separate at the layer level (conv reset), docs/MATH.md §9 item 3, trailing padding.


@nnx.jit(static_argnames="max_len")
def _packed_and_separate(layer, x_packed, ids, x_a, x_b, max_len):
  packed = layer.forward(x_packed, ids, max_len=max_len)
  alone_a = layer.forward(x_a, max_len=max_len)
  alone_b = layer.forward(x_b, max_len=max_len)
  return packed, alone_a, alone_b


@pytest.mark.parametrize("kind", ["gdn2", "softmax"])
def test_packing_equals_separate_runs(kind):
  la, lb, pad = 15, 17, 5
  x = _x(b=1, t=la + lb + pad)
  ids = jnp.asarray([[1] * la + [2] * lb + [0] * pad], jnp.int32)
  if kind == "softmax":
    layer = SoftmaxAttention(D, num_heads=4, num_kv_heads=2, output_gate=True, rngs=nnx.Rngs(0))
  else:
    layer = _mixer(kind, implementation="scan")  # the op's chunk form with segments: op tests
  packed, alone_a, alone_b = _packed_and_separate(layer, x, ids, x[:, :la], x[:, la:la + lb], 40)
  assert_close(packed.y[:, :la], alone_a.y, 1e-5, "segment 1")
  assert_close(packed.y[:, la:la + lb], alone_b.y, 1e-5, "segment 2")
  if kind == "softmax":
    # The cache holds the last segment's keys at positions 0..lb-1, like a run on it alone.
    np.testing.assert_array_equal(packed.cache["kpos"], alone_b.cache["kpos"])
    np.testing.assert_array_equal(packed.cache["pos"], [lb])
    assert_close(packed.cache["k"], alone_b.cache["k"], 1e-5, "k cache")
  else:
    assert_close(packed.r[:, la:la + lb], alone_b.r, 1e-5, "r segment 2")
    assert_close(packed.cache["state"], alone_b.cache["state"], 1e-5, "final state")
    np.testing.assert_allclose(packed.cache["conv"], alone_b.cache["conv"], rtol=1e-6)


# ------------------------------------------------------------------------------------------
# Softmax attention: window >= T is full attention; RoPE is relative.


@nnx.jit
def _two_layers(a, b, x):
  return a(x), b(x)


def test_window_at_least_t_equals_full_attention_and_small_window_differs():
  x = _x(t=24)
  make = lambda window: SoftmaxAttention(D, num_heads=4, num_kv_heads=2, window=window,
                                         rngs=nnx.Rngs(3))
  full, wide = _two_layers(make(None), make(24), x)
  assert_close(wide, full, 1e-6, "window = T")
  narrow, _ = _two_layers(make(4), make(None), x)
  assert rel_err(narrow, full) > 1e-2
  # The first 4 positions cannot tell a window of 4 from full attention.
  assert_close(narrow[:, :4], full[:, :4], 1e-6, "first window")


def test_rope_scores_depend_only_on_relative_position():
  key_q, key_k = jax.random.split(jax.random.key(0))
  q = jax.random.normal(key_q, (1, 1, 1, 16))
  k = jax.random.normal(key_k, (1, 1, 1, 16))
  score = lambda p, s: float(jnp.sum(attention_lib.rope(q, jnp.array([[p]]), 500000.0) *
                                     attention_lib.rope(k, jnp.array([[s]]), 500000.0)))
  for p, s, shift in [(5, 2, 100), (7, 7, 1000), (30, 1, 12345)]:
    assert math.isclose(score(p, s), score(p + shift, s + shift), rel_tol=1e-4, abs_tol=1e-5)
  # Rotation keeps the norm, and position 0 is the identity.
  rotated = attention_lib.rope(q, jnp.array([[37]]), 500000.0)
  assert math.isclose(float(jnp.linalg.norm(rotated)), float(jnp.linalg.norm(q)), rel_tol=1e-5)
  np.testing.assert_allclose(attention_lib.rope(q, jnp.array([[0]]), 500000.0), q, rtol=1e-6)


# ------------------------------------------------------------------------------------------
# Compute dtype: bf16 activations, float32 state.


@nnx.jit
def _forward_with_cache(layer, x):
  return layer.forward(x, max_len=x.shape[1])


def test_bf16_layer_keeps_float32_state_and_tracks_float32():
  x = _x(t=20)
  f32 = _mixer("gdn")
  bf16 = _mixer("gdn", dtype=jnp.bfloat16)
  out16 = _forward_with_cache(bf16, x.astype(jnp.bfloat16))
  assert out16.y.dtype == jnp.bfloat16 and out16.r.dtype == jnp.bfloat16
  assert out16.cache["state"].dtype == jnp.float32
  assert out16.cache["conv"].dtype == jnp.bfloat16
  assert bf16.in_proj.kernel[...].dtype == jnp.float32  # float32 master weights
  out32 = _forward_with_cache(f32, x)
  # bf16 rounding of activations through projection, conv, op and norm: a few 1e-3.
  assert rel_err(out16.y.astype(jnp.float32), out32.y) < 3e-2


# ------------------------------------------------------------------------------------------
# Initialisation (docs/MATH.md §4.4).


def test_initialisation_follows_spec():
  gdn = LinearMixer("gdn", 128, num_heads=4, num_v_heads=8, head_dim_k=64, head_dim_v=64,
                    rngs=nnx.Rngs(0))
  a = np.exp(np.asarray(gdn.A_log[...]))
  assert a.shape == (8,) and a.min() >= 1.0 and a.max() <= 16.0
  np.testing.assert_array_equal(gdn.dt_bias[...], np.ones(8))
  w = np.asarray(gdn.in_proj.kernel[...])
  assert abs(w.std() - 0.02) < 0.002 and abs(w.mean()) < 0.002
  np.testing.assert_array_equal(gdn.norm.weight[...], np.ones(64))

  kda = LinearMixer("kda", 128, num_heads=4, num_v_heads=8, head_dim_k=64, head_dim_v=64,
                    rngs=nnx.Rngs(0))
  dt = np.asarray(jax.nn.softplus(kda.dt_bias[...]))  # softplus(softplus⁻¹(dt)) = dt
  assert kda.dt_bias[...].shape == (8, 64)
  assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)
  np.testing.assert_array_equal(kda.z_up.bias[...], np.zeros(8 * 64))

  gdn2 = LinearMixer("gdn2", 128, num_heads=4, num_v_heads=8, head_dim_k=64, head_dim_v=64,
                     rngs=nnx.Rngs(0))
  assert gdn2.A_log[...].shape == (4,) and gdn2.dt_bias[...].shape == (4, 64)
  np.testing.assert_array_equal(gdn2.dt_bias[...], np.ones((4, 64)))

  fla = LinearMixer("gdn", 128, num_heads=4, num_v_heads=8, head_dim_k=64, head_dim_v=64,
                    gate_init="fla", rngs=nnx.Rngs(0))
  dt = np.asarray(jax.nn.softplus(fla.dt_bias[...]))
  assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)

  # "long": dt ~ LogU(1e-4, 1e-3) for every gated kind, A ~ U(1, 16): per-token log decays
  # (f = 0) in [-0.016, -1e-4]; "very_long": dt ~ LogU(1e-5, 1e-4), ten times its memory.
  for preset, lo, hi, rtol in (("long", 1e-4, 1e-3, 1e-4), ("very_long", 1e-5, 1e-4, 1e-3)):
    for kind in ("gdn", "kda", "gdn2"):
      layer = LinearMixer(kind, 128, num_heads=4, num_v_heads=8, head_dim_k=64, head_dim_v=64,
                          gate_init=preset, rngs=nnx.Rngs(0))
      dt = np.asarray(jax.nn.softplus(layer.dt_bias[...]))
      a = np.exp(np.asarray(layer.A_log[...]))
      assert dt.min() >= lo * (1 - rtol) and dt.max() <= hi * (1 + rtol), (preset, kind)
      assert a.min() >= 1.0 - 1e-5 and a.max() <= 16.0 + 1e-4, (preset, kind)
  with pytest.raises(ValueError, match="gate_init"):
    LinearMixer("gdn", 128, num_heads=4, gate_init="short", rngs=nnx.Rngs(0))

  out = LinearMixer("gdn", 128, num_heads=4, num_v_heads=8, head_dim_k=64, head_dim_v=64,
                    out_init_std=0.005, rngs=nnx.Rngs(0))
  assert abs(np.asarray(out.out_proj.kernel[...]).std() - 0.005) < 0.0005


# ------------------------------------------------------------------------------------------
# Per-layer parameter counts at d = 1024 (docs/MATH.md §4.5), counted on abstract layers.


def _count(make):
  return count_params(nnx.eval_shape(lambda: make(nnx.Rngs(0))))


def test_per_layer_parameter_counts_match_spec_table():
  gva = dict(num_heads=4, num_v_heads=8, head_dim_k=64, head_dim_v=64)
  dn = dict(num_heads=4, head_dim_k=64, head_dim_v=128)
  assert _count(lambda r: LinearMixer("gdn", 1024, **gva, rngs=r)) == 2_117_712
  assert _count(lambda r: LinearMixer("deltanet", 1024, **dn, rngs=r)) == 1_581_184
  assert _count(lambda r: LinearMixer("kda", 1024, **gva, rngs=r)) == 1_782_856
  assert _count(lambda r: LinearMixer("gdn2", 1024, **gva, rngs=r)) == 3_150_148
  # The repo's linear attention carries an unused β projection (4 × 1024); ours does not.
  assert _count(lambda r: LinearMixer("linear_attention", 1024, **dn, rngs=r)) == 1_581_184 - 4 * 1024
  sdpa = dict(num_heads=16, num_kv_heads=4, head_dim=64)
  assert _count(lambda r: SoftmaxAttention(1024, **sdpa, rngs=r)) == 2_621_440
  assert _count(lambda r: SoftmaxAttention(1024, **sdpa, output_gate=True, rngs=r)) == 3_670_016
  assert _count(lambda r: SwiGLU(1024, 2816, rngs=r)) == 8_650_752
  assert _count(lambda r: SwiGLU(1024, 2560, rngs=r)) == 7_864_320


# ------------------------------------------------------------------------------------------
# Bad configurations fail at construction with a clear ValueError.


@pytest.mark.parametrize("make, match", [
    (lambda: LinearMixer("gdn", 30, num_heads=4, rngs=nnx.Rngs(0)), "not divisible by num_heads"),
    (lambda: LinearMixer("gdn", 32, num_heads=4, num_v_heads=6, rngs=nnx.Rngs(0)),
     "multiple of num_heads"),
    (lambda: LinearMixer("mamba", 32, num_heads=4, rngs=nnx.Rngs(0)), "unknown linear mixer"),
    (lambda: LinearMixer("gdn", 32, num_heads=4, output_gate="relu", rngs=nnx.Rngs(0)),
     "output_gate"),
    (lambda: LinearMixer("deltanet", 32, num_heads=4, gate_lower_bound=-1.0, rngs=nnx.Rngs(0)),
     "gate_lower_bound"),
    (lambda: LinearMixer("gdn", 32, num_heads=4, chunk_size=20, rngs=nnx.Rngs(0)), "chunk_size"),
    (lambda: SoftmaxAttention(30, num_heads=4, rngs=nnx.Rngs(0)), "not divisible"),
    (lambda: SoftmaxAttention(32, num_heads=4, num_kv_heads=3, rngs=nnx.Rngs(0)), "GQA"),
    (lambda: SoftmaxAttention(32, num_heads=4, window=0, rngs=nnx.Rngs(0)), "window"),
])
def test_bad_layer_configurations_raise(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_softmax_layer_rejects_routed_value():
  layer = SoftmaxAttention(D, num_heads=4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="value_delta"):
    layer.forward(_x(t=4), value_delta=jnp.zeros((2, 4, 4, 8)))


# ------------------------------------------------------------------------------------------
# The MQAR layer configuration (configs/mqar.py: no output gate, gate_init="long"):
# docs/EXPERIMENTS.md, "Why KDA and GDN-2 stayed at chance".


def _layer_log_decay(layer, x):
  """The per-token log decay g the layer hands its op, [B, T, HV] or [B, T, HV, d_k]."""
  p = layer.in_proj(x.astype(layer.dtype))
  parts, start = {}, 0
  for name, width in layer.in_parts:
    parts[name] = p[..., start:start + width]
    start += width
  return np.asarray(layer._gates(x, parts)[0][0], np.float64)


@pytest.mark.parametrize("kind", ["gdn", "kda", "gdn2"])
def test_long_gate_init_gives_every_channel_a_long_memory(kind):
  # g = −A·softplus(f + dt_bias) ≈ −A·dt·e^f with A ~ U(1, 16), dt ~ LogU(1e-4, 1e-3): at
  # f = 0 every channel lies in [−16e-3, −1e-4]; f is N(0, (0.02·√d)²) for GDN / GDN-2 (full
  # rank, ~0.16 here) and ~10x smaller for KDA's low-rank branch, so e^f stays in (1/2, 2).
  # Every channel keeps more than e^{−4.2} of a key over a 128-token MQAR example, and the
  # per-channel kinds (KDA, GDN-2) get the same range as GDN's per-head decay.
  layer = LinearMixer(kind, 64, num_heads=2, output_gate="none", gate_init="long",
                      rngs=nnx.Rngs(3))
  g = _layer_log_decay(layer, _x(b=2, t=32, d=64))
  assert g.shape == ((2, 32, 2) if kind == "gdn" else (2, 32, 2, 32))
  a = np.exp(np.asarray(layer.A_log[...], np.float64))
  base = -(a[:, None] if kind != "gdn" else a) * np.log1p(np.exp(
      np.asarray(layer.dt_bias[...], np.float64)))            # g at f = 0
  assert base.min() > -16e-3 * 1.001 and base.max() < -1e-4 * 0.999
  ratio = g / base
  assert ratio.min() > 0.5 and ratio.max() < 2.0, (ratio.min(), ratio.max())
  assert np.exp(128 * g).min() > np.exp(-4.2)


@pytest.mark.parametrize("kind", ["gdn", "kda", "gdn2"])
def test_repo_and_fla_gate_init_decay_ranges(kind):
  # The LM's default ("repo") and FLA's presets, pinned at the layer's output g:
  # repo GDN / GDN-2 have dt_bias = 1, g ≈ −A·softplus(1) ∈ [−21, −1.31] (no channel keeps a
  # key for one token); KDA's repo = FLA: dt ~ LogU(1e-3, 0.1), g ∈ [−1.6, −1e-3].
  x = _x(b=2, t=16, d=64)
  for preset in ("repo", "fla"):
    layer = LinearMixer(kind, 64, num_heads=2, gate_init=preset, rngs=nnx.Rngs(4))
    g = _layer_log_decay(layer, x)
    if preset == "repo" and kind != "kda":
      lo, hi = -16 * math.log1p(math.e), -math.log1p(math.e)
    else:
      lo, hi = -16 * 0.1, -(1e-4 if kind == "gdn" else 1.0) * 1e-3
    # e^f in (1/2, 2) at init (see the test above).
    assert 2 * lo < g.min() and g.max() < 0.5 * hi, (preset, g.min(), g.max())


@pytest.mark.parametrize("kind", ["kda", "gdn2"])
def test_bf16_mqar_layer_chunk_grads_match_the_scan(kind):
  # The H200 MQAR runs train this layer in bf16 with the chunk form (per-channel path, several
  # chunks); the CPU toys that learned used the scan. Gradients of every parameter agree with
  # the scan oracle at bf16 (rounding of bf16 activations, measured ~1e-3) and the bf16
  # layer tracks the float32 scan.
  x = _x(b=2, t=48, d=64)
  w = jnp.cos(jnp.arange(48.0))[None, :, None]

  def grads(impl, dtype):
    layer = LinearMixer(kind, 64, num_heads=2, output_gate="none", gate_init="long",
                        chunk_size=16, implementation=impl, dtype=dtype, rngs=nnx.Rngs(5))
    # One nnx.jit program (eager dispatch compiled each primitive on its own: 4x the time).
    return nnx.jit(nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32) * w)))(layer)

  g_chunk, g_scan = grads("chunk", jnp.bfloat16), grads("scan", jnp.bfloat16)
  g_oracle = grads("scan", jnp.float32)
  for (path, a), b, c in zip(jax.tree_util.tree_leaves_with_path(g_chunk),
                             jax.tree.leaves(g_scan), jax.tree.leaves(g_oracle)):
    name = f"{kind}{jax.tree_util.keystr(path)}"
    assert rel_err(a, b) < 1e-2, f"{name}: bf16 chunk vs bf16 scan"
    assert rel_err(a, c) < 5e-2, f"{name}: bf16 chunk vs float32 scan"
