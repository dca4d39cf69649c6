"""The paper's sequence-length timing study (docs/MATH.md §7.3): training-step time against T at a
fixed number of tokens per step.

    python -m experiments.bench_seq_scaling  # tiny CPU default
    python -m experiments.bench_seq_scaling --preset=paper --out=runs/seq_scaling_h200

Variants (`--variants`): `gdn_pure` (every layer GDN), `gdn_hybrid` (the 2:1 GDN:softmax
stack, layer i softmax iff (i + 1) mod 3 == 0) and `softmax` (all softmax: the reference
curve); any mixer name works as `<mixer>_pure` / `<mixer>_hybrid`. For each T the batch is
tokens_per_step / T rows (at least 1), so the work per step is fixed for the linear layers and
grows linearly in T for softmax attention.

Presets:

* `tiny` (default; CPU, a few minutes): 3 layers (LLL / LLS / SSS), d 64, vocab 256,
  T in {128, 256, 512}, 2,048 tokens per step, 3 timed steps after 1 warm-up.
* `paper`: the repo's timing model (docs/MATH.md §6.3: 6 layers, d 256, FFN 256, GDN 4 x 64 keys /
  8 x 64 values, SDPA 4/1 heads of 64, vocabulary 32,000), T in {1K, ..., 64K}, 131,072 tokens
  per step (the paper's micro-batch x T; its 4M-token global batch is 32 such micro-batches, so
  tokens/s are comparable and step times scale by 32), bf16 compute, 30 timed steps after 5.

Each step is a full AdamW training step (forward, backward, update), jitted once; timing
follows `lineax_attn.bench.measure` (compile excluded, warm-up, median and 20/80 quantiles).
Peak memory is XLA's compiled estimate (arguments + outputs + temporaries of the step) and, on
GPU, the device's peak bytes in use so far. Writes `results.md`, `results.json` and
`seq_scaling.png` (tokens/s and step time against T, one line per variant) under --out.
"""

from __future__ import annotations

import os

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments import cli
from lineax_attn import bench
from lineax_attn.models import LanguageModel, get_config, losses
from lineax_attn.train import optim

PRESETS = {
    "tiny": dict(lengths=(128, 256, 512), tokens_per_step=2048, steps=3, warmup=1,
                 dtype="float32",
                 model=dict(vocab_size=256, d_model=64, n_layers=3, num_heads=2, num_v_heads=2,
                            head_dim_k=32, head_dim_v=32, attn_heads=2, attn_kv_heads=1,
                            attn_head_dim=32, mlp_hidden=64)),
    "paper": dict(lengths=(1024, 2048, 4096, 8192, 16384, 32768, 65536), tokens_per_step=131072,
                  steps=30, warmup=5, dtype="bfloat16", model={}),
}

_PRESET = flags.DEFINE_enum("preset", "tiny", list(PRESETS), "Model size and default lengths.")
_LENGTHS = flags.DEFINE_list("lengths", None, "Sequence lengths (default: the preset's).")
_TOKENS = flags.DEFINE_integer("tokens_per_step", None, "Tokens per step (default: preset's).")
_VARIANTS = flags.DEFINE_list("variants", ["gdn_pure", "gdn_hybrid", "softmax"],
                              "<mixer>_pure, <mixer>_hybrid or softmax.")
_STEPS = flags.DEFINE_integer("steps", None, "Timed steps per point (default: preset's).")
_WARMUP = flags.DEFINE_integer("warmup", None, "Untimed steps after compiling.")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Compute dtype.")
_IMPL = flags.DEFINE_string("implementation", None, "Linear-op implementation (None: best).")
_ATTN_IMPL = flags.DEFINE_string("attn_implementation", None, "Attention implementation.")
_OUT = flags.DEFINE_string("out", "runs/bench_seq_scaling", "Output directory.")

COLUMNS = (("variant", "variant"), ("stack", "stack"), ("seq_len", "T"), ("batch", "B"),
           ("step_ms", "step ms (median)"), ("p20_ms", "p20"), ("p80_ms", "p80"),
           ("tokens_per_s", "tokens/s"), ("compiled_mib", "compiled peak MiB"),
           ("device_peak_mib", "device peak MiB"), ("note", "note"))


def model_config(variant: str, preset: str, dtype: str):
  """The timing model of the preset with the variant's stack."""
  if variant == "softmax":
    mixer, freq = "softmax", None
  else:
    mixer, _, kind = variant.rpartition("_")
    if kind not in ("pure", "hybrid") or not mixer:
      raise ValueError(f"variant {variant!r}: expected <mixer>_pure, <mixer>_hybrid or softmax")
    freq = 3 if kind == "hybrid" else None
  overrides = dict(PRESETS[preset]["model"], mixer=mixer, linear_attention_freq=freq,
                   dtype=dtype, implementation=_IMPL.value,
                   attn_implementation=_ATTN_IMPL.value)
  if mixer == "softmax":
    overrides["attn_output_gate"] = False
  return get_config("timing_model", **overrides)


def train_step_fn(config):
  """(jitted step, params, opt_state): one AdamW step on [B, T] tokens."""
  model = LanguageModel(config, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  tx = optim.make_optimizer(optim.OptimizerConfig(name="adamw", warmup_steps=0, total_steps=100))
  opt_state = tx.init(params)

  def loss_fn(p, tokens):
    logits = nnx.merge(graphdef, p)(tokens[:, :-1])
    return losses.masked_cross_entropy(logits, tokens[:, 1:])

  @jax.jit
  def step(p, o, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(p, tokens)
    updates, o = tx.update(grads, o, p)
    return optax.apply_updates(p, updates), o, loss

  return step, params, opt_state


def measure_point(variant: str, seq_len: int, batch: int, preset: str, dtype: str, steps: int,
                  warmup: int) -> dict:
  config = model_config(variant, preset, dtype)
  stack = "".join("S" if k == "softmax" else "L" for k in config.layer_types)
  row = {"variant": variant, "stack": stack, "seq_len": seq_len, "batch": batch}
  step, params, opt_state = train_step_fn(config)
  tokens = jax.random.randint(jax.random.key(seq_len), (batch, seq_len + 1), 0,
                              config.vocab_size, jnp.int32)
  try:
    compiled = step.lower(params, opt_state, tokens).compile()
    memory = bench.compiled_memory_bytes(compiled)
    if memory is not None:
      row["compiled_mib"] = memory / 2**20
    timing = bench.measure(compiled, params, opt_state, tokens, repeats=steps, warmup=warmup)
  except Exception as e:  # pylint: disable=broad-except
    # Out of memory at long T is a result of the study, not a crash of the benchmark.
    row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return row
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    row["device_peak_mib"] = stats["peak_bytes_in_use"] / 2**20
  row.update(step_ms=timing.median_ms, p20_ms=timing.p20_ms, p80_ms=timing.p80_ms,
             tokens_per_s=batch * seq_len / (timing.median_ms / 1e3))
  return row


def _formatted(row: dict) -> dict:
  out = dict(row)
  for key in ("step_ms", "p20_ms", "p80_ms", "compiled_mib", "device_peak_mib"):
    if isinstance(row.get(key), float):
      out[key] = f"{row[key]:,.1f}"
  if isinstance(row.get("tokens_per_s"), float):
    out["tokens_per_s"] = f"{row['tokens_per_s']:,.0f}"
  return out


def plot(rows, path: str, title: str) -> None:
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    logging.warning("matplotlib is missing: no plot (the JSON has the numbers)")
    return
  fig, (ax_tps, ax_ms) = plt.subplots(1, 2, figsize=(11, 4.2))
  for variant in dict.fromkeys(r["variant"] for r in rows):
    points = [(r["seq_len"], r) for r in rows if r["variant"] == variant and "step_ms" in r]
    if not points:
      continue
    xs = [t for t, _ in points]
    stack = points[0][1]["stack"]
    label = f"{variant} ({stack})"
    ax_tps.plot(xs, [r["tokens_per_s"] for _, r in points], marker="o", label=label)
    ax_ms.plot(xs, [r["step_ms"] for _, r in points], marker="o", label=label)
  for ax, name in ((ax_tps, "tokens/s"), (ax_ms, "step time (ms)")):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T (tokens per step fixed)")
    ax.set_ylabel(name)
    ax.grid(alpha=0.3)
  ax_ms.set_yscale("log")
  ax_tps.legend(fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  preset = PRESETS[_PRESET.value]
  lengths = [int(x) for x in (_LENGTHS.value or preset["lengths"])]
  tokens = _TOKENS.value or preset["tokens_per_step"]
  steps = _STEPS.value or preset["steps"]
  warmup = preset["warmup"] if _WARMUP.value is None else _WARMUP.value
  dtype = _DTYPE.value or preset["dtype"]
  for variant in _VARIANTS.value:
    model_config(variant, _PRESET.value, dtype)  # a bad variant fails before any compute

  rows = []
  for seq_len in lengths:
    batch = max(1, tokens // seq_len)
    for variant in _VARIANTS.value:
      row = measure_point(variant, seq_len, batch, _PRESET.value, dtype, steps, warmup)
      rows.append(row)
      done = (f"{row['step_ms']:.1f} ms, {row['tokens_per_s']:,.0f} tok/s" if "step_ms" in row
              else row.get("note", ""))
      print(f"T={seq_len:>6} B={batch:>4} {variant:<12} {done}", flush=True)

  os.makedirs(_OUT.value, exist_ok=True)
  device = jax.devices()[0]
  title = (f"{_PRESET.value} timing model, {tokens:,} tokens/step, {dtype}, "
           f"{device.device_kind}")
  table = bench.markdown_table([_formatted(r) for r in rows], COLUMNS)
  with open(os.path.join(_OUT.value, "results.md"), "w") as f:
    f.write(f"# Sequence-length scaling: {title}\n\n{table}\n")
  bench.write_json(os.path.join(_OUT.value, "results.json"), rows, preset=_PRESET.value,
                   tokens_per_step=tokens, dtype=dtype, device=device.device_kind,
                   steps=steps, warmup=warmup)
  plot(rows, os.path.join(_OUT.value, "seq_scaling.png"), title)
  print(f"\n{title}\n\n{table}\n\nwrote {_OUT.value}/results.md, results.json, seq_scaling.png")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
