"""Every input check of the public ops raises a `ValueError` that says what was wrong.

One case per check of `lineax_attn/ops/api.py` (linear mixers) and `attention.py` (softmax),
each triggered on otherwise valid inputs and matched against the message. A final pair of tests
makes sure the valid baseline inputs pass, so each case fails for the reason it names.

The last part covers checked mode (`ops.checked`, `ops.debug_checks`; checkify underneath): the
value contract on traced arguments under `jax.jit` / `jax.grad` / `jax.vmap` / sharding, one case
per violation, the same results as unchecked calls on valid inputs, and the mode being part of
jit's cache key.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import threading

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import pytest

from lineax_attn import ops
from lineax_attn.ops import api
from lineax_attn.ops import specs
from helpers import assert_close, make_inputs

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
  # The spec's gates in order; a log decay is `g_scalar` or `g_channel` by its axis.
  key = lambda gate: (("g_channel" if gate.axis else "g_scalar") if gate.is_log_decay
                      else gate.name)
  gates = tuple(x[key(gate)] for gate in specs.resolve(mixer).gates)
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
    # Gate ranges: beta and b in [0, 2] (negative eigenvalues reach 2), w in [0, 1].
    ("beta_above_2", lambda: _call("delta_rule", beta=_arr((B, T, HV), value=0.5).at[1, 4, 3].set(2.5)),
     re.escape("`beta` must lie in [0, 2] everywhere, got min 0.5, max 2.5")),
    ("beta_negative", lambda: _call("kda", beta=_arr((B, T, HV), value=0.5).at[0, 0, 0].set(-0.25)),
     re.escape("`beta` must lie in [0, 2] everywhere, got min -0.25, max 0.5")),
    ("gdn_beta_above_2", lambda: _call("gated_delta_rule", beta=_arr((B, T, HV), value=2.01)),
     re.escape("`beta` must lie in [0, 2]")),
    ("b_above_2", lambda: _call("gdn2", b=_arr((B, T, HV, DK), value=0.5).at[0, 1, 2, 0].set(3.0)),
     re.escape("`b` must lie in [0, 2] everywhere, got min 0.5, max 3.0")),
    ("b_negative", lambda: _call("gdn2", b=_arr((B, T, HV, DK), value=-1e-3)),
     re.escape("`b` must lie in [0, 2]")),
    ("w_above_1", lambda: _call("gdn2", w=_arr((B, T, HV, DV), value=0.5).at[1, 0, 0, 5].set(1.5)),
     re.escape("`w` must lie in [0, 1] everywhere, got min 0.5, max 1.5")),
    ("w_negative", lambda: _call("gdn2", w=_arr((B, T, HV, DV), value=-0.5)),
     re.escape("`w` must lie in [0, 1]")),
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
     re.escape("`segment_ids` must be >= 0 (0 marks padding), got min -1")),
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
    ("unknown_implementation", lambda: _call("delta_rule", implementation="fused"),
     r"unknown `implementation='fused'`"),
    # Tuning: only the chosen implementation's tuning type (or None).
    ("tuning_for_chunk", lambda: _call("delta_rule", implementation="chunk", tuning=ops.GpuTuning()),
     r"`tuning` must be None for implementation='chunk' \(it takes no tuning\), got GpuTuning\("),
    ("tuning_for_scan", lambda: _call("kda", implementation="scan", tuning=ops.GpuTuning(intra="xla")),
     r"`tuning` must be None for implementation='scan'"),
    ("tuning_wrong_type", lambda: _call("gated_delta_rule", implementation="pallas_gpu", tuning="xla"),
     r"`tuning` for implementation='pallas_gpu' must be a GpuTuning or None, got 'xla'"),
    ("tuning_dict", lambda: _call("delta_rule", implementation="pallas_gpu", tuning={"intra": "xla"}),
     r"`tuning` for implementation='pallas_gpu' must be a GpuTuning or None"),
]


@pytest.mark.parametrize("trigger,match", [c[1:] for c in LINEAR_CASES], ids=[c[0] for c in LINEAR_CASES])
def test_linear_mixer_rejects(trigger, match):
  with pytest.raises(ValueError, match=match):
    trigger()


@pytest.mark.parametrize("field,value", [("intra", "cuda"), ("intra", None), ("solve", "lu"),
                                         ("solve", 1), ("remat_intra", 1), ("remat_intra", "yes")])
def test_gpu_tuning_rejects_bad_fields(field, value):
  with pytest.raises(ValueError, match=rf"GpuTuning\.{field} must be .*, got {re.escape(repr(value))}"):
    ops.GpuTuning(**{field: value})


def test_gpu_tuning_is_frozen_hashable_and_defaults_to_the_module_default():
  from lineax_attn.ops import pallas_gpu  # pylint: disable=g-import-not-at-top
  default = ops.GpuTuning()
  assert default == pallas_gpu.DEFAULT_TUNING and hash(default) == hash(pallas_gpu.DEFAULT_TUNING)
  assert (default.intra, default.solve, default.remat_intra) == ("kernel", "inverse", True)
  other = ops.GpuTuning(intra="xla")
  assert other != default and len({default, other, ops.GpuTuning(intra="xla")}) == 2
  with pytest.raises(dataclasses.FrozenInstanceError):
    default.intra = "xla"


@pytest.mark.parametrize("mixer", ops.MIXERS)
def test_valid_baseline_passes(mixer):
  """The untouched inputs of the cases above are accepted (so each case fails for its reason).

  The checks run before dispatch, so one implementation (the scan) is enough here.
  """
  o, s = _call(mixer, implementation="scan", output_final_state=True,
               initial_state=_state(), segment_ids=_IDS.at[0, -1].set(0))
  assert o.shape == (B, T, HV, DV) and s.shape == (B, HV, DK, DV)


def test_gate_range_ends_pass_eagerly():
  """The ranges are closed, and beta, b reach 2 (the layer's `allow_neg_eigval` gives 2σ(·))."""
  o, _ = _call("delta_rule", beta=_arr((B, T, HV), value=2.0).at[0, 0, 0].set(0.0))
  assert np.all(np.isfinite(o))
  o, _ = _call("gdn2", g_channel=_arr((B, T, HV, DK), value=0.0), b=_arr((B, T, HV, DK), value=2.0),
               w=_arr((B, T, HV, DV), value=1.0).at[0, 0, 0, 0].set(0.0))
  assert np.all(np.isfinite(o))


def test_qkv_finiteness_is_checked_eagerly_only_in_checked_mode():
  """NaN in q/k/v/initial_state is not part of the default eager checks (it would copy the
  largest arrays to the host on every eager call, and NaN inputs show up in o), only of checked
  mode."""
  bad_v = _arr((B, T, HV, DV)).at[1, 2, 3, 4].set(jnp.nan)
  o, _ = _call("delta_rule", v=bad_v)
  assert np.isnan(np.asarray(o)).any()
  with ops.debug_checks(), pytest.raises(ValueError, match="`v` contains NaN or Inf"):
    _call("delta_rule", v=bad_v)
  with ops.debug_checks(), pytest.raises(ValueError, match="`initial_state` contains NaN or Inf"):
    _call("delta_rule", initial_state=_state().at[0, 0, 0, 0].set(jnp.inf))


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


# ----------------------------------------------------------------------------------------------
# Checked mode: the value contract on traced arguments.

# Tiny shapes: B1 T8 H1 K16 V16.
_TB, _TT, _TK = 1, 8, 16
_GATE_NAMES = {mixer: tuple(name for name, _ in api.MIXER_GATES[mixer]) for mixer in ops.MIXERS}


def _tiny(mixer, b=_TB):
  """Valid tiny inputs of `mixer` as (positional arrays by name, keyword arrays)."""
  args, kwargs = make_inputs(mixer, b=b, t=_TT, h=1, dk=_TK, dv=_TK, seed=3)
  names = ("q", "k", "v") + _GATE_NAMES[mixer]
  return dict(zip(names, args)), kwargs


def _apply(mixer, implementation, arrays, kwargs):
  names = ("q", "k", "v") + _GATE_NAMES[mixer]
  return getattr(ops, mixer)(*(arrays[n] for n in names), implementation=implementation, **kwargs)


# One jitted function per (mixer, implementation): every array, keywords included, is traced;
# the cases below only change values, so they share its traces.
_JITTED = {}


def _jitted(mixer, implementation):
  key = (mixer, implementation)
  if key not in _JITTED:
    _JITTED[key] = jax.jit(lambda arrays, kwargs: _apply(mixer, implementation, arrays, kwargs))
  return _JITTED[key]


def _case(mixer, implementation="chunk", kwargs=None, **changes):
  """(jitted op, arrays, keywords): tiny valid inputs with `changes[name](array)` applied."""
  def make():
    arrays, kw = _tiny(mixer)
    if kwargs is not None:
      kw = dict(kwargs)
    for name, change in changes.items():
      if name in arrays:
        arrays[name] = change(arrays[name])
      else:
        kw[name] = change(kw.get(name))
    return _jitted(mixer, implementation), arrays, kw
  return make


_set = lambda index, value: (lambda x: x.at[index].set(value))
_const = lambda value: (lambda _: value)
_VARLEN = lambda cu: _case("delta_rule", kwargs={}, cu_seqlens=_const(jnp.asarray(cu, jnp.int32)))

JIT_CASES = [
    ("g_positive", _case("gated_delta_rule", g=_set((0, 3, 0), 0.5)),
     r"`g` is a log decay and must be <= 0 everywhere \(got max 0.5\)"),
    ("g_positive_scan", _case("kda", "scan", g=_set((0, 5, 0, 7), 0.25)),
     r"`g` is a log decay and must be <= 0 everywhere \(got max 0.25\)"),
    ("g_positive_kda", _case("kda", g=_set((0, 5, 0, 7), 0.25)),
     r"`g` is a log decay and must be <= 0 everywhere \(got max 0.25\)"),
    ("g_nan", _case("kda", g=_set((0, 1, 0, 2), jnp.nan)), "`g` contains NaN or Inf"),
    ("g_nan_and_positive", _case("kda", g=lambda x: x.at[0, 1, 0, 2].set(jnp.nan).at[0, 2].set(1.0)),
     "`g` contains NaN or Inf"),
    ("g_minus_inf", _case("gated_delta_rule", g=_set((0, 0, 0), -jnp.inf)), "`g` contains NaN or Inf"),
    ("gdn2_g_positive", _case("gdn2", g=_set((0, 7, 0, 0), 1.0)), r"`g` is a log decay.*\(got max 1.0\)"),
    ("beta_above_2", _case("delta_rule", beta=_set((0, 2, 0), 2.5)),
     re.escape("`beta` must lie in [0, 2] everywhere") + r", got min \S+, max 2.5"),
    ("beta_negative", _case("gated_delta_rule", beta=_set((0, 6, 0), -0.5)),
     re.escape("`beta` must lie in [0, 2] everywhere, got min -0.5")),
    ("beta_negative_kda", _case("kda", beta=_set((0, 6, 0), -0.5)),
     re.escape("`beta` must lie in [0, 2] everywhere, got min -0.5")),
    ("beta_nan", _case("delta_rule", beta=_set((0, 4, 0), jnp.nan)), "`beta` contains NaN or Inf"),
    ("b_above_2", _case("gdn2", b=_set((0, 3, 0, 9), 2.5)),
     re.escape("`b` must lie in [0, 2] everywhere") + r", got min \S+, max 2.5"),
    ("b_negative", _case("gdn2", b=_set((0, 3, 0, 9), -0.125)),
     re.escape("`b` must lie in [0, 2] everywhere, got min -0.125")),
    ("w_above_1", _case("gdn2", w=_set((0, 0, 0, 15), 1.25)),
     re.escape("`w` must lie in [0, 1] everywhere") + r", got min \S+, max 1.25"),
    ("w_negative", _case("gdn2", w=_set((0, 0, 0, 15), -0.75)),
     re.escape("`w` must lie in [0, 1] everywhere, got min -0.75")),
    ("w_inf", _case("gdn2", w=_set((0, 1, 0, 1), jnp.inf)), "`w` contains NaN or Inf"),
    ("cu_seqlens_not_increasing", _VARLEN((0, 5, 3, 8)),
     re.escape("`cu_seqlens` must be strictly increasing from 0 to T=8, got [0 5 3 8]")),
    ("cu_seqlens_repeated", _VARLEN((0, 4, 4, 8)),
     re.escape("`cu_seqlens` must be strictly increasing from 0 to T=8, got [0 4 4 8]")),
    ("cu_seqlens_wrong_end", _VARLEN((0, 4, 7)),
     re.escape("`cu_seqlens` must be strictly increasing from 0 to T=8, got [0 4 7]")),
    ("cu_seqlens_beyond_end", _VARLEN((0, 4, 9)),
     re.escape("`cu_seqlens` must be strictly increasing from 0 to T=8, got [0 4 9]")),
    ("cu_seqlens_not_from_0", _VARLEN((1, 4, 8)),
     re.escape("`cu_seqlens` must be strictly increasing from 0 to T=8, got [1 4 8]")),
    ("segment_ids_negative", _case("gated_delta_rule", segment_ids=_const(
        jnp.asarray([[1, 1, 1, 2, 2, -3, 2, 0]], jnp.int32))),
     re.escape("`segment_ids` must be >= 0 (0 marks padding), got min -3")),
    # Checked mode only: no NaN/Inf in q, k, v and initial_state.
    ("q_nan", _case("kda", q=_set((0, 2, 0, 0), jnp.nan)), "`q` contains NaN or Inf"),
    ("k_inf", _case("linear_attention", k=_set((0, 7, 0, 3), -jnp.inf)), "`k` contains NaN or Inf"),
    ("v_nan", _case("gdn2", v=_set((0, 0, 0, 0), jnp.nan)), "`v` contains NaN or Inf"),
    ("initial_state_nan", _case("delta_rule", initial_state=_set((0, 0, 3, 4), jnp.nan)),
     "`initial_state` contains NaN or Inf"),
]
_IDS_OF = lambda cases: [c[0] for c in cases]


@pytest.mark.parametrize("make,match", [c[1:] for c in JIT_CASES], ids=_IDS_OF(JIT_CASES))
def test_checked_mode_rejects_under_jit(make, match):
  """`ops.checked(jitted)` on traced arguments raises a ValueError naming the argument."""
  fn, arrays, kwargs = make()
  with pytest.raises(ValueError, match=match):
    ops.checked(fn)(arrays, kwargs)


@pytest.mark.parametrize("implementation", ("chunk", "scan"))
def test_checked_mode_with_checkify_directly(implementation):
  """The documented low-overhead form: jit of checkify, traced inside `debug_checks()`, then
  `err.throw()`; valid inputs give no error."""
  arrays, kwargs = _tiny("kda")
  fn = jax.jit(checkify.checkify(lambda a, kw: _apply("kda", implementation, a, kw)))
  with ops.debug_checks():
    err_ok, _ = fn(arrays, kwargs)
    err, _ = fn(dict(arrays, g=arrays["g"].at[0, 5, 0, 7].set(0.25)), kwargs)
  err_ok.throw()
  with pytest.raises(checkify.JaxRuntimeError,
                     match=r"`g` is a log decay and must be <= 0 everywhere \(got max 0.25\)"):
    err.throw()


@pytest.mark.parametrize("make,match", [c[1:] for c in JIT_CASES[:3]], ids=_IDS_OF(JIT_CASES[:3]))
def test_unchecked_mode_does_not_check_traced_values(make, match):
  """The documented default: traced values are the caller's contract, nothing raises."""
  del match
  assert not ops.debug_checks_enabled()
  fn, arrays, kwargs = make()
  o, _ = fn(arrays, kwargs)
  assert o.shape == (_TB, _TT, 1, _TK)


def test_checked_mode_needs_functionalizing_under_jit():
  """Checked mode on and a plain jax.jit: the compile fails loudly instead of running unchecked."""
  fn, arrays, kwargs = _case("delta_rule")()
  with ops.debug_checks(), pytest.raises(ValueError, match="not functionalized"):
    fn(arrays, kwargs)


@pytest.mark.parametrize("mixer", ops.MIXERS)
def test_checked_mode_keeps_results_on_valid_inputs(mixer):
  """Valid inputs (segment ids, an initial state, gates at the ends of their closed ranges) pass
  checked mode, and the output and final state equal those of the same jitted function
  unchecked."""
  arrays, kwargs = _tiny(mixer)
  for gate in specs.resolve(mixer).gates:
    name = gate.name
    for t, end in enumerate((gate.low, gate.high)):
      if end is not None:
        arrays[name] = arrays[name].at[0, t].set(end)
  kwargs["segment_ids"] = jnp.asarray([[1, 1, 2, 2, 2, 3, 3, 0]], jnp.int32)
  f = jax.jit(lambda a, kw: _apply(mixer, "chunk", a, dict(kw, output_final_state=True)))
  o_off, s_off = f(arrays, kwargs)
  o_on, s_on = ops.checked(f)(arrays, kwargs)
  np.testing.assert_allclose(np.asarray(o_on), np.asarray(o_off), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(s_on), np.asarray(s_off), rtol=1e-6, atol=1e-7)


def test_checked_mode_under_grad():
  """jit(grad): a bad gate is reported; on valid inputs the gradients equal the unchecked ones."""
  arrays, kwargs = _tiny("gated_delta_rule")
  loss = lambda a: jnp.sum(_apply("gated_delta_rule", "chunk", a, kwargs)[0] ** 2)
  grad = jax.jit(jax.grad(loss))
  g_off = grad(arrays)
  g_on = ops.checked(grad)(arrays)
  for name in arrays:
    np.testing.assert_allclose(np.asarray(g_on[name]), np.asarray(g_off[name]), rtol=1e-6, atol=1e-7)
  bad = dict(arrays, beta=arrays["beta"].at[0, 3, 0].set(-1.0))
  with pytest.raises(ValueError, match=re.escape("`beta` must lie in [0, 2] everywhere, got min -1.0")):
    ops.checked(grad)(bad)


def test_checked_mode_under_vmap():
  """jit(vmap): one bad example of the mapped batch is reported, with its own values; valid
  batches give the unchecked results."""
  arrays, _ = _tiny("delta_rule")
  stacked = {n: jnp.stack([x, x * 0.5]) for n, x in arrays.items()}
  cu = jnp.asarray([[0, 4, 8], [0, 2, 8]], jnp.int32)
  f = jax.jit(jax.vmap(lambda a, c: _apply("delta_rule", "chunk", a, {"cu_seqlens": c})[0]))
  o_off = f(stacked, cu)
  o_on = ops.checked(f)(stacked, cu)
  np.testing.assert_allclose(np.asarray(o_on), np.asarray(o_off), rtol=1e-6, atol=1e-7)
  with pytest.raises(ValueError, match=r"`beta` must lie in \[0, 2\] everywhere, got min \S+, max 2.75"):
    ops.checked(f)(dict(stacked, beta=stacked["beta"].at[1, 0, 4, 0].set(2.75)), cu)
  with pytest.raises(ValueError, match=re.escape("`cu_seqlens` must be strictly increasing from 0 to "
                                                 "T=8, got [0 6 6]")):
    ops.checked(f)(stacked, cu.at[1, 1:].set(6))


def test_checked_mode_sharded_jit_and_shard_map():
  """On 2 devices: data-parallel jit(value_and_grad) and a shard_map report the bad shard's gate
  (checkify carries the error out; a raising host callback would leave the other device waiting
  in the gradient all-reduce)."""
  mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:2])
  spec = jax.sharding.PartitionSpec("data")
  arrays, _ = _tiny("delta_rule", b=2)
  bad = dict(arrays, beta=arrays["beta"].at[1, 6, 0].set(2.125))  # in the second device's rows
  put = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))
  loss = lambda a: jnp.sum(_apply("delta_rule", "chunk", a, {})[0] ** 2)
  step = ops.checked(jax.jit(jax.value_and_grad(loss)))
  value, _ = step(put(arrays))
  assert np.isfinite(float(value))
  with pytest.raises(ValueError, match=r"`beta` must lie in \[0, 2\] everywhere, got min \S+, max 2.125"):
    step(put(bad))
  per_shard = jax.jit(jax.shard_map(lambda a: _apply("delta_rule", "chunk", a, {})[0],
                                    mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
  with pytest.raises(ValueError, match=r"`beta` must lie in \[0, 2\] everywhere, got min \S+, max 2.125"):
    ops.checked(per_shard)(bad)


def test_checked_mode_is_part_of_the_jit_cache_key():
  """A function jitted and run unchecked is retraced, checked, when called in checked mode, and
  its unchecked trace is reused once checks are off again."""
  traces = []

  @jax.jit
  def f(q, k, v, g, beta):
    traces.append(ops.debug_checks_enabled())
    return ops.gated_delta_rule(q, k, v, g, beta, implementation="chunk")[0]

  arrays, _ = _tiny("gated_delta_rule")
  bad = dict(arrays, g=arrays["g"].at[0, 0, 0].set(0.5))
  args = (bad["q"], bad["k"], bad["v"], bad["g"], bad["beta"])
  f(*args)                                 # compiled unchecked: no error
  with pytest.raises(ValueError, match="`g` is a log decay"):
    ops.checked(f)(*args)
  f(*args)                                 # unchecked again, from the cache
  assert traces == [False, True]


def test_checked_mode_adds_nothing_when_off():
  """Off: the traced op has no check at all. On: a check per checked value."""
  arrays, kwargs = _tiny("gdn2")
  kwargs["segment_ids"] = jnp.ones((_TB, _TT), jnp.int32)
  f = lambda a, kw: _apply("gdn2", "chunk", a, kw)[0]
  prims = lambda jaxpr: [e.primitive.name for e in jaxpr.eqns]
  assert "check" not in prims(jax.make_jaxpr(f)(arrays, kwargs).jaxpr)
  with ops.debug_checks():
    on = prims(jax.make_jaxpr(f)(arrays, kwargs).jaxpr)
  # g, b, w: finite + range each; segment_ids; q, k, v, initial_state: finite.
  assert on.count("check") == 3 * 2 + 1 + 4


def test_unchecked_jit_matches_the_scan_on_out_of_range_gates():
  """Checks off, an out-of-range beta under jit is computed as given: the chunk form equals the
  scan on the same values (no error, no clipping)."""
  arrays, _ = _tiny("delta_rule")
  arrays["beta"] = arrays["beta"].at[0, 2, 0].set(2.5)
  o_chunk = _jitted("delta_rule", "chunk")(arrays, {})[0]
  o_scan = _jitted("delta_rule", "scan")(arrays, {})[0]
  assert_close(o_chunk, o_scan, 1e-5, "chunk vs scan, beta = 2.5")


def test_checked_mode_softmax_attention():
  """softmax_attention in checked mode: traced NaN queries and negative segment ids."""
  q = jnp.full((1, _TT, 2, _TK), 0.1)
  kv = jnp.full((1, _TT, 1, _TK), 0.2)
  ids = jnp.ones((1, _TT), jnp.int32)
  f = jax.jit(lambda q, k, v, ids: ops.softmax_attention(q, k, v, segment_ids=ids, implementation="xla"))
  np.testing.assert_allclose(np.asarray(ops.checked(f)(q, kv, kv, ids)), np.asarray(f(q, kv, kv, ids)),
                             rtol=1e-6)
  with pytest.raises(ValueError, match="`q` contains NaN or Inf"):
    ops.checked(f)(q.at[0, 1, 1, 0].set(jnp.nan), kv, kv, ids)
  with pytest.raises(ValueError, match=re.escape("`segment_ids` must be >= 0 (0 marks padding), got min -1")):
    ops.checked(f)(q, kv, kv, ids.at[0, 2].set(-1))


def test_checked_rejects_a_non_callable():
  with pytest.raises(ValueError, match="`fn` must be callable, got int"):
    ops.checked(3)


def test_debug_checks_switches():
  """The context manager is thread-local and restores on exit; `set_debug_checks` is global."""
  assert not ops.debug_checks_enabled()
  with ops.debug_checks():
    assert ops.debug_checks_enabled()
    with ops.debug_checks(False):
      assert not ops.debug_checks_enabled()
    assert ops.debug_checks_enabled()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(ops.debug_checks_enabled()))
    thread.start()
    thread.join()
    assert seen == [False]  # another thread keeps the global setting
  assert not ops.debug_checks_enabled()
  try:
    ops.set_debug_checks(True)
    assert ops.debug_checks_enabled()
    with ops.debug_checks(False):
      assert not ops.debug_checks_enabled()
    assert ops.debug_checks_enabled()
  finally:
    ops.set_debug_checks(False)
  assert not ops.debug_checks_enabled()
  with pytest.raises(ValueError, match="`enabled` must be a bool, got 'yes'"):
    ops.debug_checks("yes")
  with pytest.raises(ValueError, match="`enabled` must be a bool, got 1"):
    ops.set_debug_checks(1)


@pytest.mark.parametrize("raw,expected", [("", False), ("0", False), ("off", False), ("1", True),
                                          ("True", True), (" yes ", True)])
def test_debug_checks_environment_values(monkeypatch, raw, expected):
  monkeypatch.setenv("LINEAX_DEBUG_CHECKS", raw)
  assert api._env_debug_checks() is expected


def test_debug_checks_environment_rejects_other_values(monkeypatch):
  monkeypatch.setenv("LINEAX_DEBUG_CHECKS", "2")
  with pytest.raises(ValueError, match="environment variable `LINEAX_DEBUG_CHECKS` must be 0 or 1"):
    api._env_debug_checks()


def test_debug_checks_environment_variable_sets_the_default():
  """LINEAX_DEBUG_CHECKS=1 at import switches checked mode on (a fresh interpreter)."""
  env = dict(os.environ, LINEAX_DEBUG_CHECKS="1", JAX_PLATFORMS="cpu")
  code = "from lineax_attn import ops; print(ops.debug_checks_enabled())"
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True, timeout=120)
  assert out.stdout.strip() == "True"
