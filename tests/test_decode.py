"""Decoding tests (docs/MATH.md §8, §9 item 4): a prefill followed by one-token steps reproduces
the parallel forward over the whole sequence, for every mixer (one stack holding all of them, with a
sliding-window KV cache and a right-padded ragged prefill), for hybrids with each routing mode,
and for a prefill continued by a multi-token chunk; `generate` is consistent with the parallel
logits; cache sizes.

Tolerance: float32, relative error <= 1e-4 on the logits (the issue's bound; the linear layers'
scan and chunk forms agree to ~1e-7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lineax_attn.layers import LINEAR_MIXERS
from lineax_attn.models import LanguageModel, ModelConfig, cache_bytes, generate
from helpers import assert_close

EVERY_MIXER = ",".join(LINEAR_MIXERS + ("softmax",))  # every linear mixer of the specs
TOL = 1e-4


def small_config(**overrides) -> ModelConfig:
  base = dict(vocab_size=64, d_model=32, n_layers=3, mixer="gdn", pattern="LSL", num_heads=2,
              num_v_heads=4, head_dim_k=8, head_dim_v=8, attn_heads=4, attn_kv_heads=2,
              mlp_hidden=64, chunk_size=16, implementation="chunk")
  return ModelConfig(**{**base, **overrides})


def _tokens(b, t, seed=0):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, 64, jnp.int32)


def perturb_routing(model: LanguageModel, key) -> None:
  """Non-zero routing parameters, so decoding exercises the routed paths."""
  for i, block in enumerate(model.blocks):
    if hasattr(block, "cler"):
      block.cler.gamma[...] = jnp.full(block.cler.gamma[...].shape, 0.5)
    if hasattr(block, "route"):
      for j, (_, var) in enumerate(nnx.iter_graph(block.route)):
        if isinstance(var, nnx.Param):
          var[...] = 0.2 * jax.random.normal(jax.random.fold_in(key, 100 * i + j), var[...].shape)


@nnx.jit(static_argnames="max_len")
def _parallel_prefill_decode(model, full, full_seg, prompt, prompt_seg, steps, max_len):
  """(parallel logits on `full`, prefill logits on `prompt`, logits of the decode steps)."""
  reference = model(full, full_seg)
  prefill_logits, cache = model.forward(prompt, prompt_seg, max_len=max_len)

  def step(cache, token):
    logits, cache = model.decode_step(token, cache)
    return cache, logits

  _, decoded = jax.lax.scan(step, cache, steps.T)
  return reference, prefill_logits, decoded.transpose(1, 0, 2)


def test_every_mixer_decodes_like_the_parallel_forward_after_a_ragged_prefill():
  # Every mixer in one stack; window 6 < T makes the softmax cache a ring buffer.
  model = LanguageModel(small_config(n_layers=len(LINEAR_MIXERS) + 1, pattern=EVERY_MIXER,
                                     window=6), rngs=nnx.Rngs(0))
  t_full, t_prompt, n_steps = 20, 9, 11
  lengths = [9, 5]  # row 1: 5 real prompt tokens, right-padded to 9
  tokens = _tokens(2, t_full)
  full_seg = jnp.stack([jnp.ones(t_full, jnp.int32),
                        (jnp.arange(t_full) < lengths[1] + n_steps).astype(jnp.int32)])
  prompt = jnp.stack([tokens[0, :t_prompt], jnp.where(jnp.arange(t_prompt) < lengths[1],
                                                      tokens[1, :t_prompt], 0)])
  prompt_seg = (jnp.arange(t_prompt)[None] < jnp.array(lengths)[:, None]).astype(jnp.int32)
  steps = jnp.stack([tokens[b, n:n + n_steps] for b, n in enumerate(lengths)])
  reference, prefill_logits, decoded = _parallel_prefill_decode(
      model, tokens, full_seg, prompt, prompt_seg, steps, t_full)
  for b, n in enumerate(lengths):
    assert_close(prefill_logits[b, :n], reference[b, :n], TOL, f"row {b} prefill")
    # Each row continues at its own length: position n + i.
    assert_close(decoded[b], reference[b, n:n + n_steps], TOL, f"row {b} decode")


@pytest.mark.parametrize("routing, rank", [("cler", None), ("cler_h", None), ("clvr", 4)])
def test_hybrid_with_routing_decodes_like_the_parallel_forward(routing, rank):
  model = LanguageModel(small_config(routing=routing, routing_rank=rank), rngs=nnx.Rngs(0))
  perturb_routing(model, jax.random.key(1))
  tokens = _tokens(2, 16, seed=3)
  reference, prefill_logits, decoded = _parallel_prefill_decode(
      model, tokens, None, tokens[:, :7], None, tokens[:, 7:], 16)
  assert_close(prefill_logits, reference[:, :7], TOL, "prefill")
  assert_close(decoded, reference[:, 7:], TOL, "decode")
  # The routed terms matter: zeroing the routing parameters changes the logits.
  unrouted = nnx.clone(model)
  for path, var in nnx.iter_graph(unrouted):
    if isinstance(var, nnx.Param) and ("cler" in path or "route" in path):
      var[...] = jnp.zeros_like(var[...])
  baseline = _parallel_prefill_decode(unrouted, tokens, None, tokens[:, :7], None, tokens[:, 7:],
                                      16)[0]  # same graph: no new compile
  assert float(jnp.max(jnp.abs(baseline - reference))) > 1e-3


@nnx.jit
def _prefill_extend_decode(model, tokens):
  reference = model(tokens)
  first, cache = model.forward(tokens[:, :6], max_len=tokens.shape[1])
  second, cache = model.forward(tokens[:, 6:13], cache=cache)  # a 7-token chunk after a cache

  def step(cache, token):
    logits, cache = model.decode_step(token, cache)
    return cache, logits

  _, decoded = jax.lax.scan(step, cache, tokens[:, 13:].T)
  return reference, jnp.concatenate([first, second, decoded.transpose(1, 0, 2)], axis=1)


def test_prefill_in_chunks_then_decode():
  model = LanguageModel(small_config(n_layers=2, pattern="gdn2,softmax", window=5),
                        rngs=nnx.Rngs(2))
  reference, pieced = _prefill_extend_decode(model, _tokens(2, 18, seed=4))
  assert_close(pieced, reference, TOL, "prefill 6 + chunk 7 + 5 steps")


def test_generate_is_greedy_on_the_parallel_logits_and_samples_consistently():
  model = LanguageModel(small_config(n_layers=2, pattern="LS"), rngs=nnx.Rngs(3))
  prompt = _tokens(2, 6, seed=5)
  lengths = jnp.array([6, 3])
  n_new = 5
  greedy = generate(model, prompt, max_new_tokens=n_new, prompt_lengths=lengths)
  assert greedy.shape == (2, n_new) and greedy.dtype == jnp.int32

  # Teacher-force each row's prompt + generated tokens through the parallel forward.
  t = 6 + n_new
  full = np.zeros((2, t), np.int32)
  seg = np.zeros((2, t), np.int32)
  for b, n in enumerate(np.asarray(lengths)):
    full[b, :n + n_new] = np.concatenate([np.asarray(prompt[b, :n]), np.asarray(greedy[b])])
    seg[b, :n + n_new] = 1
  logits = nnx.jit(lambda m, x, s: m(x, s))(model, jnp.asarray(full), jnp.asarray(seg))
  for b, n in enumerate(np.asarray(lengths)):
    expected = np.argmax(np.asarray(logits[b, n - 1:n - 1 + n_new]), axis=-1)
    np.testing.assert_array_equal(greedy[b], expected)

  # Sampling: a vanishing temperature is greedy; a key fixes the sample; keys differ.
  cold = generate(model, prompt, max_new_tokens=n_new, prompt_lengths=lengths, temperature=1e-6,
                  rng=jax.random.key(0))
  np.testing.assert_array_equal(cold, greedy)
  warm = lambda seed: generate(model, prompt, max_new_tokens=n_new, prompt_lengths=lengths,
                               temperature=1.0, rng=jax.random.key(seed))
  np.testing.assert_array_equal(warm(1), warm(1))
  assert not np.array_equal(warm(1), warm(2))
  assert int(jnp.min(warm(3))) >= 0 and int(jnp.max(warm(3))) < 64


def test_generate_rejects_bad_arguments():
  model = LanguageModel(small_config(n_layers=1, pattern="L"), rngs=nnx.Rngs(0))
  prompt = _tokens(1, 4)
  with pytest.raises(ValueError, match="rng"):
    generate(model, prompt, max_new_tokens=2, temperature=0.5)
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(model, prompt, max_new_tokens=0)
  with pytest.raises(ValueError, match="max_len"):
    generate(model, prompt, max_new_tokens=3, max_len=5)


def test_cache_sizes():
  model = LanguageModel(small_config(n_layers=3, pattern="LLS"), rngs=nnx.Rngs(0))
  short, long = model.init_cache(2, 16), model.init_cache(2, 1024)
  # Linear layers: conv cache [B, W−1, 2·H·d_k + HV·d_v] and float32 state [B, HV, d_k, d_v],
  # independent of the length.
  assert short[0]["conv"].shape == (2, 3, 2 * 2 * 8 + 4 * 8)
  assert short[0]["state"].shape == (2, 4, 8, 8) and short[0]["state"].dtype == jnp.float32
  assert cache_bytes(short[0]) == cache_bytes(long[0])
  # Softmax: one slot per token, or `window` slots with a sliding window.
  assert long[2]["k"].shape == (2, 1024, 2, 8)
  windowed = LanguageModel(small_config(n_layers=3, pattern="LLS", window=32), rngs=nnx.Rngs(0))
  assert windowed.init_cache(2, 1024)[2]["k"].shape == (2, 32, 2, 8)
