"""Tests of `softmax_attention` (docs/MATH.md §2.1, §9.18).

Oracles: a float64 numpy loop that builds the neighbourhood N(t) of §2.1 position by position
(its own segment index, not `segments.py`), a hand-computed tiny case, per-segment runs, and the
dense "reference" implementation for "xla" and "cudnn".
Tolerances (docs/MATH.md §9): float32 outputs 1e-5, float32 gradients 5e-5; bfloat16 (cuDNN)
outputs 5e-3 and gradients 1e-2 against the float32 reference on the same bf16-rounded inputs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lineax_attn import ops
from helpers import assert_close

TOL = 1e-5
GRAD_TOL = 5e-5


def _qkv(b=2, t=24, h=4, h_kv=2, d=16, seed=0, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (b, t, h, d), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (b, t, h_kv, d), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (b, t, h_kv, d), jnp.float32).astype(dtype)
  return q, k, v


def _np_segidx(ids):
  """Running segment index of one row (docs/MATH.md §1.7), written as plain Python."""
  ids = [int(i) for i in ids]
  real = [i for i in ids if i != 0]
  last = real[0] if real else 0  # leading padding takes the first real id
  filled = []
  for i in ids:
    last = i if i != 0 else last
    filled.append(last)
  segidx, count = [], 0
  for t, f in enumerate(filled):
    count += 1 if t == 0 or f != filled[t - 1] else 0
    segidx.append(count)
  return segidx


def np_attention(q, k, v, *, scale=None, causal=True, window=None, segment_ids=None):
  """float64 masked softmax, one query at a time: o_t = softmax over N(t) of §2.1."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, h, d = q.shape
  n_rep = h // k.shape[2]
  scale = d ** -0.5 if scale is None else scale
  out = np.zeros(q.shape, np.float64)
  for bi in range(b):
    ids = None if segment_ids is None else np.asarray(segment_ids)[bi]
    segidx = None if ids is None else _np_segidx(ids)
    for ti in range(t):
      if ids is not None and ids[ti] == 0:
        continue  # padding query: output 0
      keys = [s for s in range(t)
              if (not causal or s <= ti)
              and (window is None or ti - s < window)
              and (ids is None or (ids[s] != 0 and segidx[s] == segidx[ti]))]
      for hi in range(h):
        kh = hi // n_rep
        logits = np.array([q[bi, ti, hi] @ k[bi, s, kh] for s in keys]) * scale
        w = np.exp(logits - logits.max())
        out[bi, ti, hi] = (w[:, None] * v[bi, keys, kh]).sum(0) / w.sum()
  return out


def _attn(q, k, v, impl, segment_ids=None, **kw):
  """Jitted op; segment_ids is a traced argument (closing over it hits the api.py bug below)."""
  fn = lambda q, k, v, ids: ops.softmax_attention(q, k, v, implementation=impl, segment_ids=ids, **kw)
  return jax.jit(fn)(q, k, v, segment_ids)


# Leading padding, a reused id (1, 2, 1), padding inside segment 2, padding between two segments,
# a single-token segment (3) and trailing padding. Row 1: no padding, two segments.
SEGMENT_IDS = np.array([
    [0, 0, 1, 1, 1, 2, 2, 0, 2, 2, 0, 1, 1, 1, 1, 3, 2, 2, 2, 2, 2, 0, 0, 0],
    [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7],
], np.int32)


def test_reference_hand_computed():
  """Tiny case, T = 2, D = 2, scale 0.5: the softmax weights written out by hand."""
  q = np.array([[1.0, 0.0], [0.5, -1.0]])
  k = np.array([[2.0, 1.0], [-1.0, 3.0]])
  v = np.array([[1.0, -2.0], [3.0, 4.0]])
  as_op = lambda x: jnp.asarray(x[None, :, None, :], jnp.float32)  # [1, 2, 1, 2]
  scale = 0.5
  # logits[t][s] = scale * q_t . k_s
  l00, l01 = scale * 2.0, scale * -1.0
  l10, l11 = scale * (1.0 - 1.0), scale * (-0.5 - 3.0)
  mix = lambda a, b: (math.exp(a) * v[0] + math.exp(b) * v[1]) / (math.exp(a) + math.exp(b))
  causal = np.stack([v[0], mix(l10, l11)])
  full = np.stack([mix(l00, l01), mix(l10, l11)])
  for is_causal, expected in ((True, causal), (False, full)):
    o = ops.softmax_attention(as_op(q), as_op(k), as_op(v), scale=scale, causal=is_causal,
                              implementation="reference")
    np.testing.assert_allclose(np.asarray(o)[0, :, 0], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("h_kv", [4, 2, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_xla_equals_reference(causal, h_kv):
  """GQA with H = 4 and H_kv in {4, 2, 1}; the reference also matches the numpy loop."""
  q, k, v = _qkv(h=4, h_kv=h_kv, t=20)
  ref = _attn(q, k, v, "reference", causal=causal)
  assert_close(_attn(q, k, v, "xla", causal=causal), ref, TOL, "xla vs reference")
  assert_close(ref, np_attention(q, k, v, causal=causal), TOL, "reference vs numpy")


@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window_matches_numpy(window):
  """Query t sees keys t − W < s <= t; window 1 is the identity o_t = v_t."""
  q, k, v = _qkv(h=4, h_kv=2, t=20, seed=1)
  expected = np_attention(q, k, v, window=window)
  for impl in ("reference", "xla"):
    assert_close(_attn(q, k, v, impl, window=window), expected, TOL, f"{impl} window={window}")
  if window == 1:
    np.testing.assert_allclose(expected, np.repeat(np.asarray(v, np.float64), 2, axis=2), rtol=1e-12)


@pytest.mark.parametrize("extra", [0, 7])
def test_window_at_least_t_equals_full_causal(extra):
  q, k, v = _qkv(t=20, seed=2)
  for impl in ("reference", "xla"):
    full = _attn(q, k, v, impl)
    windowed = _attn(q, k, v, impl, window=q.shape[1] + extra)
    assert_close(windowed, full, TOL, f"{impl} window=T+{extra}")


# Jitted: one compile per segment length (eagerly, every primitive compiled per length).
_reference_attention = jax.jit(
    lambda q, k, v: ops.softmax_attention(q, k, v, implementation="reference"))


def _per_segment_expected(q, k, v, segment_ids):
  """Runs each segment's real tokens on their own (reference, causal); padding stays 0."""
  expected = np.zeros(q.shape, np.float32)
  for b, ids in enumerate(segment_ids):
    segidx = np.array(_np_segidx(ids))
    for s in np.unique(segidx):
      pos = np.nonzero((segidx == s) & (ids != 0))[0]
      if pos.size == 0:
        continue
      o = _reference_attention(q[b:b + 1, pos], k[b:b + 1, pos], v[b:b + 1, pos])
      expected[b, pos] = np.asarray(o[0])
  return expected


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_segments_equal_separate_runs(impl):
  """Packing = separate (docs/MATH.md §9.3), a reused id, leading/middle/trailing padding."""
  q, k, v = _qkv(t=SEGMENT_IDS.shape[1], seed=3)
  seg = jnp.asarray(SEGMENT_IDS)
  o = np.asarray(_attn(q, k, v, impl, segment_ids=seg))
  assert np.all(np.isfinite(o))
  assert np.all(o[SEGMENT_IDS == 0] == 0), "outputs at padding positions must be exactly 0"
  assert_close(o, _per_segment_expected(q, k, v, SEGMENT_IDS), TOL, f"{impl} vs separate runs")
  assert_close(o, np_attention(q, k, v, segment_ids=SEGMENT_IDS), TOL, f"{impl} vs numpy")


def test_segments_with_window_and_all_padding_row():
  """Window and segments together (distance counts padding positions); an all-padding row is 0."""
  ids = SEGMENT_IDS.copy()
  ids[1] = 0
  q, k, v = _qkv(t=ids.shape[1], seed=4)
  expected = np_attention(q, k, v, window=4, segment_ids=ids)
  for impl in ("reference", "xla"):
    o = np.asarray(_attn(q, k, v, impl, window=4, segment_ids=jnp.asarray(ids)))
    assert np.all(np.isfinite(o)) and np.all(o[1] == 0)
    assert_close(o, expected, TOL, f"{impl} window+segments")


def test_segment_ids_closed_over_under_jit():
  """segment_ids captured by a jitted function (a concrete array, not an argument) must work.

  Exposes a bug in `api.check_segments`: its `bool(jnp.any(segment_ids < 0))` check runs on a
  concrete array but inside a trace, so the comparison is staged and `bool` raises
  TracerBoolConversionError.
  """
  q, k, v = _qkv(t=SEGMENT_IDS.shape[1], seed=9)
  ids = jnp.asarray(SEGMENT_IDS)
  o = jax.jit(lambda q, k, v: ops.softmax_attention(q, k, v, segment_ids=ids))(q, k, v)
  assert_close(o, _attn(q, k, v, "xla", segment_ids=ids), TOL, "closed-over vs argument")


def _grads(impl, q, k, v, ct, segment_ids=None, **kw):
  loss = lambda q, k, v, ids: jnp.sum(ops.softmax_attention(
      q, k, v, implementation=impl, segment_ids=ids, **kw).astype(jnp.float32) * ct)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, segment_ids)


@pytest.mark.parametrize("case", [
    dict(causal=True), dict(causal=False), dict(window=5),
    dict(segment_ids=SEGMENT_IDS), dict(segment_ids=SEGMENT_IDS, window=4)])
def test_xla_gradients_match_reference(case):
  q, k, v = _qkv(t=SEGMENT_IDS.shape[1], seed=5)
  ct = jax.random.normal(jax.random.key(6), q.shape, jnp.float32)
  if "segment_ids" in case:
    case = dict(case, segment_ids=jnp.asarray(case["segment_ids"]))
  ref = _grads("reference", q, k, v, ct, **case)
  got = _grads("xla", q, k, v, ct, **case)
  for name, x, r in zip(("dq", "dk", "dv"), got, ref):
    assert np.all(np.isfinite(np.asarray(r))), f"reference {name} not finite"
    assert_close(x, r, GRAD_TOL, f"xla {name} {sorted(case)}")
  if "segment_ids" in case:  # a padding query's output is 0, so its dq is 0
    dq = np.asarray(got[0])
    assert np.all(dq[SEGMENT_IDS == 0] == 0)


@pytest.mark.parametrize("case", [
    dict(causal=True), dict(causal=False), dict(window=17), dict(segment_ids=SEGMENT_IDS)])
def test_cudnn_matches_reference(case):
  """cuDNN (bf16) vs the float32 reference on the same bf16-rounded inputs; GPU only."""
  if jax.default_backend() != "gpu":
    pytest.skip(f"cuDNN attention needs a GPU; backend is {jax.default_backend()!r}")
  t = 128
  ids = None
  if "segment_ids" in case:  # stretch the 24-token layout to T = 128
    ids = np.repeat(SEGMENT_IDS, -(-t // SEGMENT_IDS.shape[1]), axis=1)[:, :t]
    case = dict(case, segment_ids=jnp.asarray(ids))
  q, k, v = _qkv(t=t, d=64, seed=7, dtype=jnp.bfloat16)
  f32 = lambda x: x.astype(jnp.float32)
  o = _attn(q, k, v, "cudnn", **case)
  assert o.dtype == jnp.bfloat16
  assert_close(o, _attn(f32(q), f32(k), f32(v), "reference", **case), 5e-3, "cudnn o")
  if ids is not None:
    assert np.all(np.asarray(o, np.float32)[ids == 0] == 0)
  ct = jax.random.normal(jax.random.key(8), q.shape, jnp.float32)
  got = _grads("cudnn", q, k, v, ct, **case)
  ref = _grads("reference", f32(q), f32(k), f32(v), ct, **case)
  for name, x, r in zip(("dq", "dk", "dv"), got, ref):
    assert_close(x, r, 1e-2, f"cudnn {name}")
