r"""Does the MQAR training step compute the same loss and gradients with `chunk` as with the
`scan` oracle, on this backend? (docs/EXPERIMENTS.md, "Why KDA and GDN-2 stayed at chance".)

    python -m experiments.check_mqar_grads    # configs/mqar.py:gpu sizes
    python -m experiments.check_mqar_grads --mixers=kda,gdn2,gdn --dtypes=bfloat16,float32
    python -m experiments.check_mqar_grads --vocab=256 --seq_len=64 --d_model=32   # a CPU smoke run

For each (mixer, dtype) it builds the MQAR model of `configs/mqar.py:gpu` (its `model`
overrides: no output gate, `gate_init="long"`, the sweep's 2-layer stack) once per
implementation, draws one MQAR batch, and computes the trainer's loss (masked cross-entropy over
the full logits) and its gradient under `jax.jit` twice: on one parameter copy, and vmapped over
`--copies` stacked copies as the MQAR loop trains its learning rates. It prints, per case, the
largest relative L2 difference over all parameter leaves between chunk and scan (and between the
vmapped and the single-copy chunk gradients), the same for the evaluation forward's logits
(`recall.mqar_accuracy` runs the jitted model alone), and exits 1 when one exceeds the tolerance
(bfloat16 5e-2: rounding of bf16 activations; float32 1e-3).

The op-level tests compare chunk and scan on the CPU; this program checks the compiled training
step of the recall sweep on the backend that runs it (XLA GPU compiles the per-channel chunk
path of KDA/GDN-2 differently from the scalar one of GDN).
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

from experiments import cli

# The program's own flag set: tests import this module beside other programs that define
# flags of the same names in absl's global FLAGS.
FLAGS = flags.FlagValues()
_MIXERS = flags.DEFINE_list("mixers", "kda,gdn2,gdn", "Mixers to check.", flag_values=FLAGS)
_DTYPES = flags.DEFINE_list("dtypes", "bfloat16,float32", "bfloat16 and/or float32.",
                            flag_values=FLAGS)
_VOCAB = flags.DEFINE_integer("vocab", 8192, "MQAR vocabulary.", flag_values=FLAGS)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "MQAR sequence length.", flag_values=FLAGS)
_NUM_PAIRS = flags.DEFINE_integer("num_pairs", 8, "Key-value pairs per example.", flag_values=FLAGS)
_D_MODEL = flags.DEFINE_integer("d_model", 128, "Model width.", flag_values=FLAGS)
_BATCH = flags.DEFINE_integer("batch", 64, "Examples in the batch.", flag_values=FLAGS)
_COPIES = flags.DEFINE_integer("copies", 3, "Stacked parameter copies of the vmapped step.",
                               flag_values=FLAGS)
_DT_SHIFT = flags.DEFINE_float("dt_shift", 0.0, "Add this to every dt_bias first (e.g. 6: "
                               "per-token decays near e^-A).", flag_values=FLAGS)

TOLERANCE = {"bfloat16": 5e-2, "float32": 1e-3}


def _rel_diffs(a, b) -> dict[str, float]:
  """Relative L2 difference of every leaf of two equal pytrees, by the leaf's path."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  out = {}
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    x, y = x.astype(jnp.float32), y.astype(jnp.float32)
    out[jax.tree_util.keystr(path)] = float(
        jnp.linalg.norm(x - y) / (jnp.linalg.norm(x) + 1e-30))
  return out


def _rel_diff(a, b) -> float:
  return max(_rel_diffs(a, b).values())


def check(mixer: str, dtype: str, *, vocab: int, seq_len: int, num_pairs: int, d_model: int,
          batch: int, copies: int, seed: int = 0, dt_shift: float = 0.0,
          n_layers: int | None = None) -> dict:
  """chunk-vs-scan and vmapped-vs-single agreement of one MQAR training step's gradients.

  `n_layers`: None keeps the sweep's depth (configs/mqar.py); the CPU test uses 1 (each layer
  compiles its own chunk forward and backward, and one is enough to compare them)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from configs import mqar as mqar_config  # pylint: disable=g-import-not-at-top
  from lineax_attn.data import synthetic  # pylint: disable=g-import-not-at-top
  from lineax_attn.evals import recall  # pylint: disable=g-import-not-at-top
  from lineax_attn.models import losses  # pylint: disable=g-import-not-at-top
  from lineax_attn.models.lm import LanguageModel  # pylint: disable=g-import-not-at-top

  overrides = mqar_config.get_config("gpu").model.to_dict()
  overrides["dtype"] = dtype
  if n_layers is not None:
    overrides["n_layers"] = n_layers
  x, y = (jnp.asarray(a) for a in synthetic.mqar(vocab, seq_len, num_pairs, count=batch,
                                                 seed=seed))
  results = {}
  for impl in ("scan", "chunk"):
    cfg = recall.sweep_model_config(mixer, d_model, vocab, **{**overrides, "implementation": impl})
    graphdef, state = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(seed)))
    if dt_shift:  # stronger (or weaker) decays than at init: dt_bias + dt_shift everywhere
      state = jax.tree_util.tree_map_with_path(
          lambda p, a: a + dt_shift if "dt_bias" in jax.tree_util.keystr(p) else a, state)

    def loss_fn(st, graphdef=graphdef):
      logits = nnx.merge(graphdef, st)(x)
      return losses.masked_cross_entropy(logits, y, y != synthetic.IGNORE)

    loss, g = jax.jit(jax.value_and_grad(loss_fn))(state)
    # The evaluation forward (what recall.mqar_accuracy runs: the jitted model alone).
    logits = jax.jit(lambda st, graphdef=graphdef: nnx.merge(graphdef, st)(x))(state)
    results[impl] = (float(loss), g, logits)
    if impl == "chunk":
      stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (copies,) + a.shape), state)
      _, gv = jax.jit(jax.vmap(jax.value_and_grad(loss_fn)))(stacked)
      vmapped = max(_rel_diff(g, jax.tree.map(lambda a, j=j: a[j], gv)) for j in range(copies))
  by_leaf = _rel_diffs(results["scan"][1], results["chunk"][1])
  worst = sorted(by_leaf, key=by_leaf.get, reverse=True)[:3]
  return dict(mixer=mixer, dtype=dtype, backend=jax.default_backend(),
              loss_scan=results["scan"][0], loss_chunk=results["chunk"][0],
              grad_chunk_vs_scan=by_leaf[worst[0]],
              worst_grad_leaves={name: by_leaf[name] for name in worst},
              logits_chunk_vs_scan=_rel_diff(results["scan"][2], results["chunk"][2]),
              grad_vmapped_vs_single=vmapped)


def main(argv) -> None:
  del argv
  failed = False
  for dtype in _DTYPES.value:
    if dtype not in TOLERANCE:
      raise app.UsageError(f"--dtypes: expected bfloat16 and/or float32, got {dtype!r}.")
    for mixer in _MIXERS.value:
      row = check(mixer, dtype, vocab=_VOCAB.value, seq_len=_SEQ_LEN.value,
                  num_pairs=_NUM_PAIRS.value, d_model=_D_MODEL.value, batch=_BATCH.value,
                  copies=_COPIES.value, dt_shift=_DT_SHIFT.value)
      worst = max(row["grad_chunk_vs_scan"], row["grad_vmapped_vs_single"],
                  row["logits_chunk_vs_scan"])
      row["ok"] = worst <= TOLERANCE[dtype]
      row["dt_shift"] = _DT_SHIFT.value
      failed |= not row["ok"]
      print(json.dumps(row), flush=True)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
