r"""Decoding speed: generated tokens/s and memory per sequence, per mixer and for softmax attention
with a KV cache, after prompts of several lengths and at several batch sizes.

    python -m experiments.bench_decode  # tiny CPU default
    python -m experiments.bench_decode --batch=1,64 --prompt_len=4096,32768 --new_tokens=128 \
        --d_model=1024 --n_layers=4 --heads=4 --v_heads=8 --head_dim_k=64 --head_dim_v=64 \
        --attn_heads=16 --attn_kv_heads=4 --attn_head_dim=64 --mlp_hidden=2816 --vocab=32000 \
        --dtype=bfloat16 --json_out=/tmp/decode.json  # the 350M shapes, on a GPU

Each mixer gets a pure stack of --n_layers layers (softmax: a Transformer++ with a KV cache of
prompt + new tokens slots, or --window slots). Per (mixer, batch, prompt length):

* prefill: one jitted call over the prompt that returns the cache (and the last logits); timed.
* decode: one jitted `lax.scan` of --new_tokens greedy steps from that cache; timed (median of
  --repeats, compile excluded); tokens/s = batch · new_tokens / time.
* memory per sequence: the bytes of the decoding cache divided by the batch (conv cache and
  float32 state for linear mixers, K/V for softmax), plus the device's peak memory so far in the
  process (a running maximum over the rows, where the backend reports it).

A row that fails (e.g. out of memory at a large shape) is reported with a note, not fatal.
"""

from __future__ import annotations

import traceback
from typing import Any, Sequence

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
from flax import nnx

from experiments import cli
from lineax_attn import bench
from lineax_attn.models import LanguageModel, ModelConfig, cache_bytes

MIXERS = ("linear_attention", "deltanet", "gdn", "kda", "gdn2", "softmax")
COLUMNS = (
    ("mixer", "mixer"), ("batch", "B"), ("prompt_len", "prompt"), ("new_tokens", "new"),
    ("prefill_ms", "prefill ms"), ("decode_ms", "decode ms"), ("tokens_per_s", "tokens/s"),
    ("ms_per_token", "ms/step"), ("cache_mib_per_seq", "cache MiB/seq"),
    ("peak_mib", "process peak MiB"), ("note", "note"),
)

FLAGS = flags.FLAGS
flags.DEFINE_list("mixers", list(MIXERS), f"Mixers, from {list(MIXERS)}.")
flags.DEFINE_list("batch", ["1", "4"], "Batch sizes.")
flags.DEFINE_list("prompt_len", ["64", "256"], "Prompt lengths.")
flags.DEFINE_integer("new_tokens", 16, "Generated tokens per row.")
flags.DEFINE_integer("vocab", 256, "Vocabulary size.")
flags.DEFINE_integer("d_model", 64, "Model width.")
flags.DEFINE_integer("n_layers", 2, "Layers of each pure stack.")
flags.DEFINE_integer("heads", 2, "Linear mixers: key heads H.")
flags.DEFINE_integer("v_heads", 4, "Linear mixers: value heads HV (a multiple of H).")
flags.DEFINE_integer("head_dim_k", 16, "Linear mixers: d_k.")
flags.DEFINE_integer("head_dim_v", 16, "Linear mixers: d_v.")
flags.DEFINE_integer("attn_heads", 4, "Softmax: query heads.")
flags.DEFINE_integer("attn_kv_heads", 2, "Softmax: key/value heads.")
flags.DEFINE_integer("attn_head_dim", 16, "Softmax: head dim.")
flags.DEFINE_integer("mlp_hidden", 128, "SwiGLU hidden width.")
flags.DEFINE_integer("window", None, "Sliding window of the softmax layers (a ring-buffer cache).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype (states stay float32).")
flags.DEFINE_string("implementation", None, "Linear-op implementation for the prefill (None = best).")
flags.DEFINE_integer("chunk_size", 64, "Chunk size of the chunked prefill.")
flags.DEFINE_integer("repeats", 3, "Timed calls (median reported).")
flags.DEFINE_integer("warmup", 1, "Untimed calls after the compiling call.")
flags.DEFINE_integer("seed", 0, "PRNG seed.")
flags.DEFINE_string("json_out", None, "Also write the rows as JSON here.")


def model_config(mixer: str) -> ModelConfig:
  return ModelConfig(
      vocab_size=FLAGS.vocab, d_model=FLAGS.d_model, n_layers=FLAGS.n_layers, mixer=mixer,
      num_heads=FLAGS.heads, num_v_heads=FLAGS.v_heads, head_dim_k=FLAGS.head_dim_k,
      head_dim_v=FLAGS.head_dim_v, attn_heads=FLAGS.attn_heads, attn_kv_heads=FLAGS.attn_kv_heads,
      attn_head_dim=FLAGS.attn_head_dim, mlp_hidden=FLAGS.mlp_hidden, window=FLAGS.window,
      implementation=FLAGS.implementation, chunk_size=FLAGS.chunk_size, dtype=FLAGS.dtype)


def _peak_mib() -> float | None:
  stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  return stats["peak_bytes_in_use"] / 2 ** 20


def _prefill_fn(graphdef, max_len):
  @jax.jit
  def prefill(state, prompt):
    model = nnx.merge(graphdef, state)
    h, cache = model.hidden_states(prompt, max_len=max_len)
    return model.logits(h[:, -1]), cache  # only the last position's logits: [B, vocab]
  return prefill


def _decode_fn(graphdef, new_tokens):
  @jax.jit
  def decode(state, cache, logits):
    model = nnx.merge(graphdef, state)

    def step(carry, _):
      token, cache = carry
      logits, cache = model.decode_step(token, cache)
      return (jnp.argmax(logits, -1).astype(jnp.int32), cache), token

    (_, cache), tokens = jax.lax.scan(step, (jnp.argmax(logits, -1).astype(jnp.int32), cache),
                                      None, length=new_tokens)
    return tokens, cache
  return decode


def bench_row(mixer: str, batch: int, prompt_len: int) -> dict[str, Any]:
  row = dict(mixer=mixer, batch=batch, prompt_len=prompt_len, new_tokens=FLAGS.new_tokens, note="")
  model = LanguageModel(model_config(mixer), rngs=nnx.Rngs(FLAGS.seed))
  graphdef, state = nnx.split(model)
  max_len = prompt_len + FLAGS.new_tokens
  prompt = jax.random.randint(jax.random.key(FLAGS.seed), (batch, prompt_len), 0, FLAGS.vocab,
                              jnp.int32)
  prefill = _prefill_fn(graphdef, max_len)
  decode = _decode_fn(graphdef, FLAGS.new_tokens)
  try:
    logits, cache = jax.block_until_ready(prefill(state, prompt))
    row["cache_mib_per_seq"] = cache_bytes(cache) / batch / 2 ** 20
    row["prefill_ms"] = bench.time_fn(prefill, state, prompt, repeats=FLAGS.repeats,
                                      warmup=FLAGS.warmup)
    timing = bench.measure(decode, state, cache, logits, repeats=FLAGS.repeats,
                           warmup=FLAGS.warmup)
    row["decode_ms"] = timing.median_ms
    row["ms_per_token"] = timing.median_ms / FLAGS.new_tokens
    row["tokens_per_s"] = batch * FLAGS.new_tokens / (timing.median_ms / 1e3)
    row["peak_mib"] = _peak_mib()
  except Exception as e:  # noqa: BLE001 - one failed row (OOM at a large shape) must not end the sweep
    logging.error("%s B=%d T=%d failed:\n%s", mixer, batch, prompt_len, traceback.format_exc())
    row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
  logging.info("%s", row)
  return row


def run(mixers: Sequence[str], batches: Sequence[int], prompt_lens: Sequence[int]):
  rows = []
  for prompt_len in prompt_lens:  # short prompts first: a long sweep that is cut short still reports
    for batch in batches:
      for mixer in mixers:
        rows.append(bench_row(mixer, batch, prompt_len))
  return rows


def main(argv):
  del argv
  unknown = sorted(set(FLAGS.mixers) - set(MIXERS))
  if unknown:
    raise app.UsageError(f"unknown --mixers {unknown}; expected names from {list(MIXERS)}.")
  batches = [int(b) for b in FLAGS.batch]
  prompt_lens = [int(t) for t in FLAGS.prompt_len]
  if min(batches + prompt_lens + [FLAGS.new_tokens, FLAGS.repeats]) < 1:
    raise app.UsageError("batch sizes, prompt lengths, --new_tokens and --repeats must be >= 1.")
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), dtype {FLAGS.dtype}, "
        f"d_model {FLAGS.d_model}, {FLAGS.n_layers} layers per stack")
  rows = run(FLAGS.mixers, batches, prompt_lens)
  print(bench.markdown_table(rows, COLUMNS))
  if FLAGS.json_out:
    bench.write_json(FLAGS.json_out, rows, backend=jax.default_backend(),
                     flags={k: getattr(FLAGS, k) for k in (
                         "d_model", "n_layers", "heads", "v_heads", "head_dim_k", "head_dim_v",
                         "attn_heads", "attn_kv_heads", "attn_head_dim", "mlp_hidden", "vocab",
                         "dtype", "window", "new_tokens", "implementation")})


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
