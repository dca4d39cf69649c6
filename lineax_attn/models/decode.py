"""Decoding: caches, prefill, one-token steps and `generate` under `jax.jit` (docs/MATH.md §8).

Per layer the cache is the mixer's own: for a linear mixer the conv cache (the last W − 1 real
pre-conv inputs) and the float32 recurrent state, constant in the sequence length; for softmax
attention the RoPE'd KV cache (a ring buffer of `window` slots with a sliding window).

    tokens = generate(model, prompt, max_new_tokens=32)                     # greedy
    tokens = generate(model, prompt, max_new_tokens=32, temperature=0.8, rng=jax.random.key(0),
                      prompt_lengths=lengths)                              # ragged, sampled

Ragged prompts are right-padded; `prompt_lengths[b]` real tokens each. Each row then continues
at its own length (its RoPE position, conv cache and state come from its real tokens only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lineax_attn.models.lm import LanguageModel


def init_cache(model: LanguageModel, batch: int, max_len: int) -> list:
  """Empty per-layer caches for `batch` rows of up to `max_len` tokens."""
  return model.init_cache(batch, max_len)


def prefill(model: LanguageModel, tokens: jax.Array, segment_ids: jax.Array | None = None, *,
            max_len: int) -> tuple[jax.Array, list]:
  """Runs the prompt in parallel: (logits `[B, T, vocab]`, cache for up to max_len tokens)."""
  return model.forward(tokens, segment_ids, max_len=max_len)


def decode_step(model: LanguageModel, tokens: jax.Array, cache: list) -> tuple[jax.Array, list]:
  """tokens `[B]` -> (logits `[B, vocab]`, new cache)."""
  return model.decode_step(tokens, cache)


def cache_bytes(cache) -> int:
  """Total bytes of a cache pytree (divide by the batch for bytes per sequence)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


def _pick(logits, key, temperature, greedy):
  if greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "max_len", "greedy",
                                             "ragged"))
def _generate(graphdef, state, prompt, lengths, key, temperature, *, max_new_tokens, max_len,
              greedy, ragged):
  model = nnx.merge(graphdef, state)
  b, t = prompt.shape
  segment_ids = (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.int32) if ragged else None
  h, cache = model.hidden_states(prompt, segment_ids, max_len=max_len)
  last = model.logits(h[jnp.arange(b), lengths - 1])  # logits at each row's last real token
  keys = jax.random.split(key, max_new_tokens)
  first = _pick(last, keys[0], temperature, greedy)

  def step(carry, step_key):
    token, cache = carry
    logits, cache = model.decode_step(token, cache)
    nxt = _pick(logits, step_key, temperature, greedy)
    return (nxt, cache), nxt

  _, rest = jax.lax.scan(step, (first, cache), keys[1:])
  return jnp.concatenate([first[:, None], rest.T], axis=1)


def generate(model: LanguageModel, prompt: jax.Array, *, max_new_tokens: int,
             temperature: float = 0.0, rng: jax.Array | None = None,
             prompt_lengths: jax.Array | None = None, max_len: int | None = None) -> jax.Array:
  """Greedy (temperature 0) or temperature sampling, compiled with `jax.jit`.

  Args:
    prompt: `[B, T]` int tokens, right-padded when `prompt_lengths` is given.
    max_new_tokens: tokens to generate per row (>= 1).
    temperature: 0 for greedy, > 0 to sample from softmax(logits / temperature).
    rng: a `jax.random.key`, needed when sampling.
    prompt_lengths: `[B]` real tokens per row (1..T); None = all T.
    max_len: cache length (default T + max_new_tokens).

  Returns:
    `[B, max_new_tokens]` int32 generated tokens.
  """
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}.")
  greedy = temperature == 0
  if not greedy and rng is None:
    raise ValueError("sampling (temperature > 0) needs `rng`.")
  b, t = prompt.shape
  max_len = t + max_new_tokens if max_len is None else max_len
  if max_len < t + max_new_tokens:
    raise ValueError(f"max_len={max_len} is shorter than prompt + new tokens = {t + max_new_tokens}.")
  ragged = prompt_lengths is not None
  lengths = (jnp.full((b,), t, jnp.int32) if prompt_lengths is None
             else jnp.asarray(prompt_lengths, jnp.int32))
  key = jax.random.key(0) if rng is None else rng
  graphdef, state = nnx.split(model)
  return _generate(graphdef, state, jnp.asarray(prompt, jnp.int32), lengths, key,
                   jnp.float32(max(temperature, 1e-6)), max_new_tokens=max_new_tokens,
                   max_len=max_len, greedy=greedy, ragged=ragged)
