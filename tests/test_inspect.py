"""Tests of the inspection helpers (lineax_attn.inspect).

* `capture`: the tensors it records are the ones the layer used: the layer's output y is rebuilt
  from the captured q/k/v/gates/z (scan reference + the layer's own norm and W_out), the layer
  re-run on the captured input gives y, and the last state of the recomputed trajectory equals
  the op's final state (`output_final_state=True`) and the model's own prefill cache state.
* The measures against hand-built oracles: effective rank of a rank-2 matrix with equal singular
  values (2), of the identity (n), of zero (0); a linear-attention state built from orthonormal
  keys returns every stored value exactly (docs/MATH.md §2.2: S_t = Σ_{j<=t} k_j v_jᵀ, so
  S_tᵀ k_j = v_j); forgetting curves of a constant decay; routing summaries.
* The plots draw the panels they promise; validation errors name the argument.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest
from flax import nnx

matplotlib.use("Agg")

from lineax_attn import inspect as li  # noqa: E402
from lineax_attn import ops  # noqa: E402
from lineax_attn.models import LanguageModel, ModelConfig  # noqa: E402
from helpers import assert_close  # noqa: E402

TOL = 1e-5  # float32 scan vs chunk / model path (docs/MATH.md §9: forward rel. error)


def _config(**overrides) -> ModelConfig:
  base = dict(vocab_size=64, d_model=32, n_layers=3, pattern="gdn2,deltanet,softmax",
              num_heads=2, num_v_heads=4, head_dim_k=8, head_dim_v=8, attn_heads=2,
              mlp_hidden=48, chunk_size=16, implementation="scan")  # cheap to compile
  return ModelConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def captured():
  model = LanguageModel(_config(), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 64, jnp.int32)
  # Row 0: two packed segments; row 1: one segment with trailing padding (docs/MATH.md §1.7).
  segment_ids = jnp.array([[1] * 10 + [2] * 14, [1] * 20 + [0] * 4], jnp.int32)
  return model, tokens, segment_ids, li.capture(model, tokens, segment_ids)


def test_capture_reproduces_layer_output_and_final_state(captured):
  model, tokens, segment_ids, result = captured
  assert sorted(result.layers) == [0, 1]  # the linear layers; the softmax layer has no state
  # The checks' own computations run jitted, one compile each (eager dispatch compiled every
  # primitive on its own: 278 compiles, 33 CPU-s).
  _, cache = nnx.jit(lambda m, x, s: m.forward(x, s, max_len=x.shape[1]))(model, tokens,
                                                                           segment_ids)
  for i, cap in result.layers.items():
    mixer = model.blocks[i].mixer
    assert cap.kind == ("gdn2", "deltanet")[i]
    assert cap.states.shape == (2, 24, 4, 8, 8) and cap.states.dtype == jnp.float32
    # y rebuilt from the captured tensors (scan reference, then the layer's norm and W_out).
    rebuilt = nnx.jit(lambda m, o, z, cap=cap: li.layer_output(
        m, dataclasses.replace(cap, o=o, z=z)))(mixer, cap.o, cap.z)
    assert_close(rebuilt, cap.y, TOL, f"layer {i} y from captured tensors")
    # The captured input is the layer's input: re-running the layer gives the captured y.
    assert_close(nnx.jit(lambda m, x, s: m(x, s))(mixer, cap.x, segment_ids), cap.y, TOL,
                 f"layer {i} y from captured x")
    op = getattr(ops, li.OP_NAMES[cap.kind])
    o, final = jax.jit(lambda q, k, v, gates, s: op(
        q, k, v, *gates, segment_ids=s, output_final_state=True, chunk_size=16,
        implementation="chunk"))(cap.q, cap.k, cap.v, tuple(cap.gates.values()), segment_ids)
    assert_close(cap.final_state, final, TOL, f"layer {i} final state vs the op")
    assert_close(cap.o, o, TOL, f"layer {i} o vs the op")
    assert_close(cap.final_state, cache[i]["state"], TOL, f"layer {i} final state vs the cache")
    # Row 0 resets at token 10: the state after token 9 is the first segment's final state.
    _, first = jax.jit(lambda q, k, v, gates: op(q, k, v, *gates, output_final_state=True,
                                                 implementation="scan"))(
        cap.q[:1, :10], cap.k[:1, :10], cap.v[:1, :10],
        tuple(g[:1, :10] for g in cap.gates.values()))
    assert_close(cap.states[:1, 9], first, TOL, f"layer {i} state at the segment end")
  assert set(result.layers[0].gates) == {"g", "b", "w"} and result.layers[0].z is not None
  assert set(result.layers[1].gates) == {"beta"} and result.layers[1].decay is None


def test_capture_and_trajectory_validate_inputs(captured):
  model, tokens, _, result = captured
  with pytest.raises(ValueError, match="max_len"):
    li.capture(model, tokens, max_len=8)
  with pytest.raises(ValueError, match="tokens must be an int array"):
    li.capture(model, tokens.astype(jnp.float32))
  with pytest.raises(ValueError, match="segment_ids must be"):
    li.capture(model, tokens, segment_ids=tokens[:, :3])
  cap = result.layers[0]
  with pytest.raises(ValueError, match="gates for gdn2 must be exactly"):
    li.state_trajectory("gdn2", cap.q, cap.k, cap.v, {"g": cap.gates["g"]})
  with pytest.raises(ValueError, match="max_len"):
    li.state_trajectory("gdn2", cap.q, cap.k, cap.v, cap.gates, max_len=4)
  with pytest.raises(ValueError, match="mixer must be one of"):
    li.state_trajectory("mamba", cap.q, cap.k, cap.v, cap.gates)


def test_effective_rank_and_norms():
  n = 6
  basis = np.linalg.qr(np.random.default_rng(0).normal(size=(n, n)))[0]
  rank2 = 3.0 * (np.outer(basis[:, 0], basis[:, 1]) + np.outer(basis[:, 2], basis[:, 3]))
  rank1 = np.outer(basis[:, 0], basis[:, 5])
  stack = jnp.asarray(np.stack([rank2, np.eye(n), rank1, np.zeros((n, n))]), jnp.float32)
  np.testing.assert_allclose(li.effective_rank(stack), [2.0, n, 1.0, 0.0], rtol=1e-5, atol=1e-5)
  # Frobenius norms: sqrt(2·9), sqrt(n), 1, 0.
  np.testing.assert_allclose(li.state_norms(stack), [math.sqrt(18), math.sqrt(n), 1.0, 0.0],
                             rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="states must be a float array"):
    li.effective_rank(jnp.ones((3,)))


def test_memory_readout_of_orthonormal_linear_attention_state():
  b, t, hv, dk, dv = 1, 6, 2, 8, 4
  rng = np.random.default_rng(0)
  # Per head, t orthonormal keys (rows of an orthogonal matrix) and random values.
  keys = np.stack([np.linalg.qr(rng.normal(size=(dk, dk)))[0][:t] for _ in range(hv)], axis=1)
  keys = jnp.asarray(keys[None], jnp.float32)                       # [1, T, HV, K]
  values = jnp.asarray(rng.normal(size=(b, t, hv, dv)), jnp.float32)
  # The oracle state S_t = Σ_{j<=t} k_j v_jᵀ, built by hand.
  outer = jnp.einsum("bthk,bthv->bthkv", keys, values)
  states = jnp.cumsum(outer, axis=1)
  _, traj, _ = li.state_trajectory("linear_attention", keys, keys, values)
  assert_close(traj, states, 1e-6, "linear-attention trajectory vs Σ k vᵀ")

  read = li.retrieve(states, keys)                                  # [B, HV, T, T, V]
  stored = jnp.moveaxis(values, 2, 1)[:, :, None]                   # v_j, broadcast over t
  lower = np.tril(np.ones((t, t), bool))
  np.testing.assert_allclose(np.asarray(read)[:, :, lower], np.broadcast_to(
      np.asarray(stored), read.shape)[:, :, lower], atol=1e-5)
  np.testing.assert_allclose(np.asarray(read)[:, :, ~lower], 0.0, atol=1e-5)  # not yet written
  cos = np.asarray(li.memory_readout(states, keys, values))
  np.testing.assert_allclose(cos[:, :, lower], 1.0, atol=1e-5)
  assert np.isnan(cos[:, :, ~lower]).all()
  # GVA: one key head serving both value heads gives the same result as repeating it.
  shared = keys[:, :, :1]
  np.testing.assert_allclose(li.memory_readout(states, shared, values),
                             li.memory_readout(states, jnp.repeat(shared, 2, axis=2), values))
  with pytest.raises(ValueError, match="values must be"):
    li.memory_readout(states, keys, values[..., :2])


def test_forgetting_curve_and_half_life():
  c = -0.1
  g = jnp.full((1, 5, 2), c, jnp.float32)
  expected = np.exp(c * np.arange(1, 6))[None, :, None]
  np.testing.assert_allclose(li.forgetting_curve(g), np.broadcast_to(expected, (1, 5, 2)),
                             rtol=1e-6)
  # Channel gates: the mean over K of each channel's curve.
  gk = jnp.stack([jnp.full((1, 5, 2), c), jnp.full((1, 5, 2), 2 * c)], axis=-1)
  both = (np.exp(c * np.arange(1, 6)) + np.exp(2 * c * np.arange(1, 6))) / 2
  np.testing.assert_allclose(li.forgetting_curve(gk)[0, :, 0], both, rtol=1e-6)
  assert li.forgetting_curve(gk, reduce_channels=False).shape == (1, 5, 2, 2)
  np.testing.assert_allclose(li.half_life(g), np.full((1, 2), math.log(2) / 0.1), rtol=1e-6)
  assert np.isinf(np.asarray(li.half_life(jnp.zeros((1, 5, 2))))).all()
  with pytest.raises(ValueError, match="g must be"):
    li.forgetting_curve(jnp.zeros((5, 2)))


def test_routing_summary():
  cler = LanguageModel(_config(routing="cler", cler_gamma="head", cler_gamma_init=0.25,
                               pattern="gdn,softmax,gdn"), rngs=nnx.Rngs(0))
  summary = li.routing_summary(cler)
  assert [s["layer"] for s in summary] == [0, 2]  # one entry per routed (linear) layer
  for s in summary:
    assert s["mode"] == "cler" and s["gamma"].shape == (4, 1)
    np.testing.assert_allclose(s["gamma"], 0.25)
    assert s["gamma_abs_mean"] == pytest.approx(0.25)

  clvr = LanguageModel(_config(routing="clvr", routing_rank=3, pattern="kda,kda,softmax"),
                       rngs=nnx.Rngs(0))
  summary = li.routing_summary(clvr)
  assert [(s["layer"], s["mode"], s["rank"]) for s in summary] == [(0, "clvr", 3), (1, "clvr", 3)]
  assert summary[0]["proj_norm"] == 0.0  # the up factor starts at zero (docs/MATH.md §5.2)
  route = clvr.blocks[1].route
  route.up.kernel[...] = jnp.ones_like(route.up.kernel[...])
  effective = np.asarray(route.down.kernel[...]) @ np.ones(route.up.kernel[...].shape)
  s = li.routing_summary(clvr)[1]
  assert s["proj_norm"] == pytest.approx(np.linalg.norm(effective), rel=1e-5)
  # Head h reads rows h·d_v .. (h+1)·d_v of P.
  np.testing.assert_allclose(s["head_norms"], [np.linalg.norm(effective[h * 8:(h + 1) * 8])
                                               for h in range(4)], rtol=1e-5)
  assert li.routing_summary(LanguageModel(_config(), rngs=nnx.Rngs(0))) == []
  with pytest.raises(ValueError, match="LanguageModel"):
    li.routing_summary(object())


def test_plots_draw_their_panels(captured):
  import matplotlib.pyplot as plt
  _, _, _, result = captured
  cap = result.layers[0]
  fig = li.plot_state_heatmaps(cap.states, times=[0, 5, 23], heads=[0, 3])
  assert len([a for a in fig.axes if a.images]) == 2 * 3
  fig_gates = li.plot_gates(cap)
  assert [a.get_title() for a in fig_gates.axes] == ["decay α = exp(g)", "erase b", "write w"]
  assert len(fig_gates.axes[0].lines) == 4  # one trace per value head
  readout = li.memory_readout(cap.states, cap.k, cap.v)
  fig_readout = li.plot_readout(readout)
  assert len([a for a in fig_readout.axes if a.images]) == 4
  with pytest.raises(ValueError, match="times must lie"):
    li.plot_state_heatmaps(cap.states, times=[30])
  with pytest.raises(ValueError, match="readout must be"):
    li.plot_readout(readout[0])
  plt.close("all")


def test_train_tiny_lowers_the_loss():
  config = _config(vocab_size=384, pattern=None, mixer="gdn", n_layers=1)
  model, losses = li.train_tiny(config, steps=30, batch_size=4, seq_len=16,
                                tokens=li.corpus_tokens(20_000))
  assert len(losses) == 30 and all(np.isfinite(losses))
  # Bytes from a uniform start (ln 384 ≈ 5.95 nats) fall well below it in 30 AdamW steps.
  assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0
  assert isinstance(model, LanguageModel)
  with pytest.raises(ValueError, match="vocab_size"):
    li.train_tiny(_config(), steps=1)
