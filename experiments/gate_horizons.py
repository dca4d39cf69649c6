r"""How long the gated mixers remember at init, per `gate_init` preset: the table that says which
preset an MQAR length needs (docs/EXPERIMENTS.md, "T 512 N 64 with gate_init=very_long").

    python -m experiments.gate_horizons      # the MQAR sweep model, d 128
    python -m experiments.gate_horizons --seq_lens=128,512,2048 --presets=repo,long,very_long

For each (mixer, preset) it builds the model of `configs/mqar.py:gpu` (2 layers, no output
gate) with the preset for `--seeds` seeds, reads every head's / channel's memory horizon at zero
gate input (`recall.gate_horizons`: −1/g, the tokens over which a key keeps 1/e of itself), and
prints the 10th / 50th / 90th percentiles, and for each T the share of channels that keep at
least a tenth of a key over T tokens (horizon ≥ T / ln 10). Parameters only, no training:
seconds on a CPU.
"""

from __future__ import annotations

import math

from absl import app, flags
import numpy as np

from experiments import cli

FLAGS = flags.FlagValues()
_MIXERS = flags.DEFINE_list("mixers", "gdn,kda,gdn2", "Gated mixers.", flag_values=FLAGS)
_PRESETS = flags.DEFINE_list("presets", "repo,fla,long,very_long", "gate_init presets.",
                             flag_values=FLAGS)
_SEQ_LENS = flags.DEFINE_list("seq_lens", "128,256,512", "Distances T of the share columns.",
                              flag_values=FLAGS)
_SEEDS = flags.DEFINE_integer("seeds", 8, "Model seeds pooled per row.", flag_values=FLAGS)
_D_MODEL = flags.DEFINE_integer("d_model", 128, "Model width.", flag_values=FLAGS)


def horizons(mixer: str, preset: str, *, d_model: int, seeds: int) -> np.ndarray:
  """Every gated layer's horizons of the MQAR sweep model, pooled over `seeds` seeds."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from configs import mqar as mqar_config  # pylint: disable=g-import-not-at-top
  from lineax_attn.evals import recall  # pylint: disable=g-import-not-at-top
  from lineax_attn.models.lm import LanguageModel  # pylint: disable=g-import-not-at-top

  overrides = {**mqar_config.get_config("gpu").model.to_dict(), "gate_init": preset}
  cfg = recall.sweep_model_config(mixer, d_model, 256, **overrides)
  return np.concatenate([recall.gate_horizons(LanguageModel(cfg, rngs=nnx.Rngs(s)))
                         for s in range(seeds)])


def table(mixers, presets, seq_lens, *, d_model: int, seeds: int) -> list[dict]:
  rows = []
  for mixer in mixers:
    for preset in presets:
      h = horizons(mixer, preset, d_model=d_model, seeds=seeds)
      p10, p50, p90 = np.percentile(h, [10, 50, 90])
      rows.append(dict(mixer=mixer, preset=preset, channels=int(h.size), p10=float(p10),
                       median=float(p50), p90=float(p90),
                       keeps_a_tenth={t: float(np.mean(h >= t / math.log(10)))
                                      for t in seq_lens}))
  return rows


def _tokens(x: float) -> str:
  return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def to_markdown(rows, seq_lens) -> str:
  head = ("| mixer | gate_init | p10 / median / p90 horizon (tokens) | "
          + " | ".join(f"keeps ≥ 0.1 over T = {t}" for t in seq_lens) + " |")
  lines = [head, "|" + "---|" * (3 + len(seq_lens))]
  for r in rows:
    shares = " | ".join(f"{r['keeps_a_tenth'][t]:.2f}" for t in seq_lens)
    lines.append(f"| {r['mixer']} | {r['preset']} | {_tokens(r['p10'])} / "
                 f"{_tokens(r['median'])} / {_tokens(r['p90'])} | {shares} |")
  return "\n".join(lines)


def main(argv):
  del argv
  seq_lens = [int(t) for t in _SEQ_LENS.value]
  if _SEEDS.value < 1 or any(t < 1 for t in seq_lens):
    raise app.UsageError("--seeds and --seq_lens must be >= 1")
  rows = table(_MIXERS.value, _PRESETS.value, seq_lens, d_model=_D_MODEL.value,
               seeds=_SEEDS.value)
  print(to_markdown(rows, seq_lens), flush=True)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
