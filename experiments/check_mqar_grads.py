r"""Does the MQAR training step compute the same loss and gradients with `chunk` as with the
`scan` oracle, on this backend? (docs/EXPERIMENTS.md, "Why KDA and GDN-2 stayed at chance".)

    python -m experiments.check_mqar_grads                         # configs/mqar.py:gpu sizes
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

import argparse
import json
import sys

TOLERANCE = {"bfloat16": 5e-2, "float32": 1e-3}


def _rel_diff(a, b) -> float:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  worst = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = x.astype(jnp.float32), y.astype(jnp.float32)
    worst = max(worst, float(jnp.linalg.norm(x - y) / (jnp.linalg.norm(x) + 1e-30)))
  return worst


def check(mixer: str, dtype: str, *, vocab: int, seq_len: int, num_pairs: int, d_model: int,
          batch: int, copies: int, seed: int = 0, dt_shift: float = 0.0) -> dict:
  """chunk-vs-scan and vmapped-vs-single agreement of one MQAR training step's gradients."""
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
  return dict(mixer=mixer, dtype=dtype, backend=jax.default_backend(),
              loss_scan=results["scan"][0], loss_chunk=results["chunk"][0],
              grad_chunk_vs_scan=_rel_diff(results["scan"][1], results["chunk"][1]),
              logits_chunk_vs_scan=_rel_diff(results["scan"][2], results["chunk"][2]),
              grad_vmapped_vs_single=vmapped)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--mixers", default="kda,gdn2,gdn")
  p.add_argument("--dtypes", default="bfloat16,float32")
  p.add_argument("--vocab", type=int, default=8192)
  p.add_argument("--seq_len", type=int, default=128)
  p.add_argument("--num_pairs", type=int, default=8)
  p.add_argument("--d_model", type=int, default=128)
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--copies", type=int, default=3)
  p.add_argument("--dt_shift", type=float, default=0.0,
                 help="add this to every dt_bias first (e.g. 6: per-token decays near e^-A)")
  args = p.parse_args(argv)
  failed = False
  for dtype in args.dtypes.split(","):
    if dtype not in TOLERANCE:
      raise ValueError(f"--dtypes: expected bfloat16 and/or float32, got {dtype!r}.")
    for mixer in args.mixers.split(","):
      row = check(mixer, dtype, vocab=args.vocab, seq_len=args.seq_len,
                  num_pairs=args.num_pairs, d_model=args.d_model, batch=args.batch,
                  copies=args.copies, dt_shift=args.dt_shift)
      worst = max(row["grad_chunk_vs_scan"], row["grad_vmapped_vs_single"],
                  row["logits_chunk_vs_scan"])
      row["ok"] = worst <= TOLERANCE[dtype]
      row["dt_shift"] = args.dt_shift
      failed |= not row["ok"]
      print(json.dumps(row), flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
