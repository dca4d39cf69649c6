"""Every input check of the public ops raises a `ValueError` that says what was wrong.

One case per check of `lineax_attn/ops/api.py` (linear mixers) and `attention.py` (softmax),
each triggered on otherwise valid inputs and matched against the message. A final pair of tests
makes sure the valid baseline inputs pass, so each case fails for the reason it names.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from lineax_attn import ops
from lineax_attn.ops import api

B, T, H, HV, DK, DV = 2, 5, 2, 4, 3, 6


def _arr(shape, dtype=np.float32, value=0.1):
  return jnp.full(shape, value, dtype)


def _valid():
  """Valid inputs for every mixer: q, k, v and the gate arrays by name."""
  return {
      "q": _arr((B, T, H, DK)), "k": _arr((B, T, H, DK)), "v": _arr((B, T, HV, DV)),
      "beta": _arr((B, T, HV), value=0.5), "g_scalar": _arr((B, T, HV), value=-0.1),
      "g_channel": _arr((B, T, HV, DK), value=-0.1), "b": _arr((B, T, HV, DK), value=0.5),
      "w": _arr((B, T, HV, DV), value=0.5),
  }


def _call(mixer, *, implementation="scan", **override):
  """Calls `ops.<mixer>` on valid inputs with some positional arrays or keywords replaced."""
  x = _valid()
  x.update({name: override.pop(name) for name in list(override) if name in x})
  gates = {
      "linear_attention": (),
      "delta_rule": (x["beta"],),
      "gated_delta_rule": (x["g_scalar"], x["beta"]),
      "kda": (x["g_channel"], x["beta"]),
      "gdn2": (x["g_channel"], x["b"], x["w"]),
  }[mixer]
  return getattr(ops, mixer)(x["q"], x["k"], x["v"], *gates, implementation=implementation,
                             **override)


def _state(rows=B, dtype=jnp.float32):
  return jnp.zeros((rows, HV, DK, DV), dtype)


def _one_row(**override):
  """B = 1 inputs for the varlen (cu_seqlens) cases."""
  x = {"q": _arr((1, T, H, DK)), "k": _arr((1, T, H, DK)), "v": _arr((1, T, HV, DV)),
       "beta": _arr((1, T, HV), value=0.5)}
  x.update(override)
  return x


_CU = lambda *xs: jnp.asarray(xs, jnp.int32)
_IDS = jnp.ones((B, T), jnp.int32)

LINEAR_CASES = [
    # q, k, v shapes and dtypes.
    ("q_rank", lambda: _call("delta_rule", q=_arr((B, T, H * DK))), "`q` must be rank 4"),
    ("k_rank", lambda: _call("delta_rule", k=_arr((B, T, H, DK, 1))), "`k` must be rank 4"),
    ("v_rank", lambda: _call("delta_rule", v=_arr((B, T, HV * DV))), "`v` must be rank 4"),
    ("k_shape", lambda: _call("delta_rule", k=_arr((B, T, H, DK + 1))),
     "`k` must have the shape of `q`"),
    ("v_batch", lambda: _call("delta_rule", v=_arr((B + 1, T, HV, DV))),
     "`v` must share B and T with `q`"),
    ("v_time", lambda: _call("delta_rule", v=_arr((B, T + 1, HV, DV))),
     "`v` must share B and T with `q`"),
    ("hv_not_multiple", lambda: _call("linear_attention", v=_arr((B, T, 3, DV))),
     "must be a multiple of the q/k heads H=2"),
    ("empty", lambda: _call("linear_attention", q=_arr((B, 0, H, DK)), k=_arr((B, 0, H, DK)),
                            v=_arr((B, 0, HV, DV))), "empty inputs"),
    ("q_int", lambda: _call("linear_attention", q=jnp.ones((B, T, H, DK), jnp.int32)),
     "`q` must be a floating-point array"),
    ("v_int", lambda: _call("linear_attention", v=jnp.ones((B, T, HV, DV), jnp.int32)),
     "`v` must be a floating-point array"),
    # Gate shapes and dtypes.
    ("beta_shape", lambda: _call("delta_rule", beta=_arr((B, T, H))),
     re.escape("`beta` must have shape [B, T, HV] for delta_rule = (2, 5, 4)")),
    ("scalar_g_shape", lambda: _call("gated_delta_rule", g_scalar=_arr((B, T, HV, DK), value=-0.1)),
     re.escape("`g` must have shape [B, T, HV] for gated_delta_rule")),
    ("channel_g_shape", lambda: _call("kda", g_channel=_arr((B, T, HV), value=-0.1)),
     re.escape("`g` must have shape [B, T, HV, K] for kda = (2, 5, 4, 3)")),
    ("kda_beta_shape", lambda: _call("kda", beta=_arr((B, T, HV, 1))),
     re.escape("`beta` must have shape [B, T, HV] for kda")),
    ("b_shape", lambda: _call("gdn2", b=_arr((B, T, HV, DV))),
     re.escape("`b` must have shape [B, T, HV, K] for gdn2 = (2, 5, 4, 3)")),
    ("w_shape", lambda: _call("gdn2", w=_arr((B, T, HV, DK))),
     re.escape("`w` must have shape [B, T, HV, V] for gdn2 = (2, 5, 4, 6)")),
    ("beta_int", lambda: _call("delta_rule", beta=jnp.ones((B, T, HV), jnp.int32)),
     "`beta` must be a floating-point array"),
    ("g_positive", lambda: _call("gated_delta_rule", g_scalar=_arr((B, T, HV), value=0.5)),
     r"`g` is a log decay and must be <= 0 everywhere \(got max 0.5"),
    ("channel_g_positive", lambda: _call("kda", g_channel=_arr((B, T, HV, DK)).at[1, 2, 3, 0].set(1e-3)),
     "`g` is a log decay and must be <= 0"),
    ("beta_nan", lambda: _call("delta_rule", beta=_arr((B, T, HV)).at[0, 1, 2].set(jnp.nan)),
     "`beta` contains NaN or Inf"),
    ("g_nan", lambda: _call("kda", g_channel=_arr((B, T, HV, DK), value=-0.1).at[0, 0, 0, 0].set(jnp.nan)),
     "`g` contains NaN or Inf"),
    ("w_inf", lambda: _call("gdn2", w=_arr((B, T, HV, DV)).at[0, 0, 0, 0].set(jnp.inf)),
     "`w` contains NaN or Inf"),
    # Scale and chunk size.
    ("scale_zero", lambda: _call("delta_rule", scale=0.0), "`scale` must be a positive finite number"),
    ("scale_negative", lambda: _call("delta_rule", scale=-1.0), "`scale` must be a positive finite number"),
    ("scale_inf", lambda: _call("delta_rule", scale=float("inf")), "`scale` must be a positive finite number"),
    ("scale_not_number", lambda: _call("delta_rule", scale=(1.0,)), "`scale` must be a Python number"),
    ("chunk_not_multiple", lambda: _call("delta_rule", chunk_size=24),
     "`chunk_size` must be a positive multiple of 16"),
    ("chunk_zero", lambda: _call("delta_rule", chunk_size=0), "`chunk_size` must be a positive multiple of 16"),
    ("chunk_float", lambda: _call("delta_rule", chunk_size=32.0), "`chunk_size` must be a positive multiple of 16"),
    # Segment ids.
    ("segment_ids_shape", lambda: _call("delta_rule", segment_ids=jnp.ones((B, T + 1), jnp.int32)),
     re.escape("`segment_ids` must have shape [B, T] = (2, 5)")),
    ("segment_ids_float", lambda: _call("delta_rule", segment_ids=jnp.ones((B, T), jnp.float32)),
     "`segment_ids` must be an integer array"),
    ("segment_ids_negative", lambda: _call("delta_rule", segment_ids=_IDS.at[1, 3].set(-1)),
     r"`segment_ids` must be >= 0"),
    ("segments_and_cu_seqlens", lambda: _call("delta_rule", **_one_row(),
                                               segment_ids=jnp.ones((1, T), jnp.int32),
                                               cu_seqlens=_CU(0, T)),
     "pass at most one of `segment_ids` and `cu_seqlens`"),
    # cu_seqlens.
    ("cu_seqlens_batch", lambda: _call("delta_rule", cu_seqlens=_CU(0, 2, T)),
     "needs batch size B = 1, got B = 2"),
    ("cu_seqlens_start", lambda: _call("delta_rule", **_one_row(), cu_seqlens=_CU(1, 3, T)),
     "must be strictly increasing from 0 to T=5"),
    ("cu_seqlens_end", lambda: _call("delta_rule", **_one_row(), cu_seqlens=_CU(0, 3, T - 1)),
     "must be strictly increasing from 0 to T=5"),
    ("cu_seqlens_beyond_end", lambda: _call("delta_rule", **_one_row(), cu_seqlens=_CU(0, 3, T + 1)),
     "must be strictly increasing from 0 to T=5"),
    ("cu_seqlens_not_increasing", lambda: _call("delta_rule", **_one_row(), cu_seqlens=_CU(0, 3, 3, T)),
     "must be strictly increasing"),
    ("cu_seqlens_decreasing", lambda: _call("delta_rule", **_one_row(), cu_seqlens=_CU(0, 4, 2, T)),
     "must be strictly increasing"),
    ("cu_seqlens_float", lambda: _call("delta_rule", **_one_row(),
                                       cu_seqlens=jnp.asarray([0.0, 5.0], jnp.float32)),
     "`cu_seqlens` must be an integer array"),
    ("cu_seqlens_rank", lambda: _call("delta_rule", **_one_row(), cu_seqlens=jnp.zeros((2, 2), jnp.int32)),
     re.escape("`cu_seqlens` must have shape [N + 1] with N >= 1")),
    ("cu_seqlens_too_short", lambda: _call("delta_rule", **_one_row(), cu_seqlens=_CU(0)),
     re.escape("`cu_seqlens` must have shape [N + 1] with N >= 1")),
    # initial_state.
    ("initial_state_shape", lambda: _call("delta_rule", initial_state=_state(rows=B + 1)),
     re.escape("`initial_state` must have shape [B, HV, K, V] = (2, 4, 3, 6)")),
    ("initial_state_key_heads", lambda: _call("delta_rule", initial_state=jnp.zeros((B, H, DK, DV))),
     re.escape("`initial_state` must have shape [B, HV, K, V]")),
    ("initial_state_varlen_rows", lambda: _call("delta_rule", **_one_row(), cu_seqlens=_CU(0, 2, T),
                                                initial_state=_state(rows=1)),
     re.escape("`initial_state` must have shape [N (number of sequences in cu_seqlens), HV, K, V] "
               "= (2, 4, 3, 6)")),
    ("initial_state_bf16", lambda: _call("delta_rule", initial_state=_state(dtype=jnp.bfloat16)),
     "`initial_state` must be float32"),
    ("initial_state_float64_numpy", lambda: _call("delta_rule", initial_state=np.zeros((B, HV, DK, DV))),
     "`initial_state` must be float32"),
    # Implementation.
    ("unknown_implementation", lambda: _call("delta_rule", implementation="triton"),
     r"unknown `implementation='triton'`"),
]


@pytest.mark.parametrize("trigger,match", [c[1:] for c in LINEAR_CASES], ids=[c[0] for c in LINEAR_CASES])
def test_linear_mixer_rejects(trigger, match):
  with pytest.raises(ValueError, match=match):
    trigger()


def test_planned_implementation_not_built_yet(monkeypatch):
  """A planned implementation that is not registered (here "pallas_tpu", as before its kernels
  landed) gives a clear "not built yet" error naming what is available, not a KeyError."""
  monkeypatch.delitem(api._IMPLEMENTATIONS, "pallas_tpu", raising=False)
  monkeypatch.setattr(api, "_PLANNED", tuple(set(api._PLANNED) | {"pallas_tpu"}))
  with pytest.raises(ValueError, match=r"`implementation='pallas_tpu'` is not built yet; available: "
                                       r"\[.*'scan'.*\]"):
    _call("kda", implementation="pallas_tpu")


@pytest.mark.parametrize("mixer", ops.MIXERS)
def test_valid_baseline_passes(mixer):
  """The untouched inputs of the cases above are accepted (so each case fails for its reason).

  The checks run before dispatch, so one implementation (the scan) is enough here.
  """
  o, s = _call(mixer, implementation="scan", output_final_state=True,
               initial_state=_state(), segment_ids=_IDS.at[0, -1].set(0))
  assert o.shape == (B, T, HV, DV) and s.shape == (B, HV, DK, DV)


def test_valid_varlen_baseline_passes():
  o, s = _call("delta_rule", **_one_row(), cu_seqlens=_CU(0, 2, T), initial_state=_state(rows=2),
               output_final_state=True)
  assert o.shape == (1, T, HV, DV) and s.shape == (2, HV, DK, DV)


# ----------------------------------------------------------------------------------------------
# softmax_attention.

D, H_KV = 4, 2


def _attn(**override):
  x = {"q": _arr((B, T, 4, D)), "k": _arr((B, T, H_KV, D)), "v": _arr((B, T, H_KV, D))}
  x.update({name: override.pop(name) for name in list(override) if name in x})
  override.setdefault("implementation", "reference")
  return ops.softmax_attention(x["q"], x["k"], x["v"], **override)


ATTENTION_CASES = [
    ("q_rank", lambda: _attn(q=_arr((B, T, 4 * D))), "`q` must be rank 4"),
    ("k_rank", lambda: _attn(k=_arr((B, T, H_KV, D, 1))), "`k` must be rank 4"),
    ("v_rank", lambda: _attn(v=_arr((T, H_KV, D))), "`v` must be rank 4"),
    ("q_int", lambda: _attn(q=jnp.ones((B, T, 4, D), jnp.int32)), "`q` must be a floating-point array"),
    ("v_shape", lambda: _attn(v=_arr((B, T, H_KV, D + 1))), "`v` must have the shape of `k`"),
    ("k_head_dim", lambda: _attn(k=_arr((B, T, H_KV, D + 1)), v=_arr((B, T, H_KV, D + 1))),
     re.escape("`k` must have shape [B, T, H_kv, D]")),
    ("k_time", lambda: _attn(k=_arr((B, T + 1, H_KV, D)), v=_arr((B, T + 1, H_KV, D))),
     re.escape("`k` must have shape [B, T, H_kv, D]")),
    ("heads_not_multiple", lambda: _attn(k=_arr((B, T, 3, D)), v=_arr((B, T, 3, D))),
     r"query heads 4 must be a multiple of key/value heads 3"),
    ("window_zero", lambda: _attn(window=0), "`window` must be a positive int or None"),
    ("window_float", lambda: _attn(window=2.0), "`window` must be a positive int or None"),
    ("window_bool", lambda: _attn(window=True), "`window` must be a positive int or None"),
    ("window_not_causal", lambda: _attn(window=2, causal=False), "`window` needs `causal=True`"),
    ("scale_negative", lambda: _attn(scale=-0.5), "`scale` must be a positive finite number"),
    ("segment_ids_shape", lambda: _attn(segment_ids=jnp.ones((B, T - 1), jnp.int32)),
     re.escape("`segment_ids` must have shape [B, T]")),
    ("segment_ids_negative", lambda: _attn(segment_ids=_IDS.at[0, 0].set(-2)), "`segment_ids` must be >= 0"),
    ("unknown_implementation", lambda: _attn(implementation="flash"), r"unknown `implementation='flash'`"),
]


@pytest.mark.parametrize("trigger,match", [c[1:] for c in ATTENTION_CASES],
                         ids=[c[0] for c in ATTENTION_CASES])
def test_softmax_attention_rejects(trigger, match):
  with pytest.raises(ValueError, match=match):
    trigger()


@pytest.mark.parametrize("implementation", ("reference", "xla"))
def test_softmax_attention_valid_baseline_passes(implementation):
  o = _attn(implementation=implementation, window=2, segment_ids=_IDS)
  assert o.shape == (B, T, 4, D)
