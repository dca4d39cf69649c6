r"""Runs every arm of a comparison config, then writes a results table and a loss-curve plot.

    python -m experiments.compare --config=configs/mixers.py:tiny --workdir=runs/mixers_tiny
    python -m experiments.compare --config=configs/routing.py:small --arms=gdn,gdn_clvr \
        --workdir=runs/routing_small

Each arm trains in `<workdir>/<arm>` (experiments/train.py's loop, one arm after the other in
this process); re-running the command resumes unfinished arms and skips finished ones. Then:

* `<workdir>/results.md` and `results.json`: per arm the stack, parameters, final training loss
  (mean of the last log interval), final validation loss, tokens/s (steady state), MFU, steps,
  status, and the paper's number where the config gives one (`config.paper`), else "n/a".
* `<workdir>/loss_curves.png`: validation loss (left) and training loss (right) against
  training tokens, all arms on one figure.

Config overrides apply to every arm (`--config.train.steps=50`); an arm's own overrides win.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import cli
from lineax_attn.train import distributed, experiment

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Comparison config and size, e.g. configs/mixers.py:tiny.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "One sub-directory per arm.", required=True)
_ARMS = flags.DEFINE_list("arms", None, "Arms to run (default: all, in the config's order).")
_DISTRIBUTED = flags.DEFINE_enum("distributed", "auto", distributed.MODES,
                                 "jax.distributed.initialize: auto, on or off.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's id.")
_PROGRESS = flags.DEFINE_boolean("progress", True, "Print the progress lines.")
_REPORT_ONLY = flags.DEFINE_boolean(
    "report_only", False, "Train nothing: write the table and plot from the arms' metrics as "
    "they are (an arm cut short by a time limit reports its last step, status 'partial').")

COLUMNS = (("arm", "arm"), ("stack", "stack"), ("optimizer", "optimizer"), ("params", "params"),
           ("train_loss", "train loss"), ("val_loss", "val loss"), ("paper", "paper val loss"),
           ("tokens_per_s", "tokens/s"), ("mfu", "MFU"), ("steps", "steps"),
           ("status", "status"))


def _stack(model) -> str:
  letters = "".join("S" if k == "softmax" else "L" for k in model.layer_types)
  kinds = [k for k in dict.fromkeys(model.layer_types) if k != "softmax"]
  name = "+".join(kinds + (["softmax"] if "S" in letters else []))
  return f"{name} {letters}" + (f" {model.routing}" if model.routing else "")


def summarize(arm: str, exp, workdir: str, status: str, num_params: int, paper) -> dict:
  """One table row from the arm's metrics.jsonl (so resumed and skipped arms report too)."""
  from lineax_attn.train import metrics  # pylint: disable=g-import-not-at-top

  records = metrics.read_metrics(workdir)
  train = [r for r in records if r["kind"] == "train"]
  evals = [r for r in records if r["kind"] == "eval"]
  last = train[-1] if train else {}
  return {
      "arm": arm, "stack": _stack(exp.model), "optimizer": exp.optim.name,
      "params": num_params,
      "train_loss": last.get("loss"), "val_loss": evals[-1]["loss"] if evals else None,
      "paper": "n/a" if paper is None else paper,
      "tokens_per_s": last.get("tokens_per_s"),
      "mfu": "n/a" if last.get("mfu") is None else f"{100 * last['mfu']:.1f}%",
      "steps": last.get("step", 0), "status": status,
      "curves": {"train": [(r["tokens"], r["loss"]) for r in train if "tokens" in r],
                 "eval": [(r["tokens"], r["loss"]) for r in evals if "tokens" in r]},
  }


def _formatted(row: dict) -> dict:
  """Table cells: losses to 4 decimals, counts with thousands separators."""
  out = dict(row)
  for key in ("train_loss", "val_loss", "paper"):
    if isinstance(row.get(key), float):
      out[key] = f"{row[key]:.4f}"
  for key in ("params", "tokens_per_s"):
    if isinstance(row.get(key), (int, float)):
      out[key] = f"{row[key]:,.0f}"
  return out


def plot(rows, path: str, title: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (ax_val, ax_train) = plt.subplots(1, 2, figsize=(12, 4.5))
  for row in rows:
    label = f"{row['arm']} ({row['stack']})"
    for ax, kind in ((ax_val, "eval"), (ax_train, "train")):
      points = [(t, loss) for t, loss in row["curves"][kind] if isinstance(loss, float)]
      if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o" if kind == "eval" else None, markersize=3, label=label)
  for ax, name in ((ax_val, "validation loss"), (ax_train, "training loss (log-interval mean)")):
    ax.set_xlabel("training tokens")
    ax.set_ylabel(name)
    ax.grid(alpha=0.3)
  # The first points (near ln(vocab)) would flatten everything else.
  for ax in (ax_val, ax_train):
    finals = [line.get_ydata()[-1] for line in ax.get_lines()]
    starts = [max(line.get_ydata()[min(1, len(line.get_ydata()) - 1):], default=0)
              for line in ax.get_lines()]
    if finals:
      ax.set_ylim(min(finals) - 0.1, max(starts) + 0.1)
  ax_val.legend(fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/mixers.py:tiny")
  distributed.initialize(_DISTRIBUTED.value, coordinator_address=_COORDINATOR.value,
                         num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value)
  import jax  # pylint: disable=g-import-not-at-top
  from lineax_attn import bench  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import loop  # pylint: disable=g-import-not-at-top

  names = experiment.arm_names(config)
  if not names:
    raise app.UsageError(f"{config.get('name')} names no arms; compare.py needs config.arms")
  selected = _ARMS.value or names
  unknown = [a for a in selected if a not in names]
  if unknown:
    print(f"error: unknown arm(s) {unknown}; the config's arms: {names}", file=sys.stderr)
    sys.exit(2)
  # Every arm is validated before the first one trains.
  try:
    experiments = {arm: experiment.resolve(config, arm=arm) for arm in selected}
    trainers = {arm: loop.Trainer(exp) for arm, exp in experiments.items()}  # abstract checks
  except (ValueError, FileNotFoundError) as e:
    print(f"error: invalid config: {e}", file=sys.stderr)
    sys.exit(2)

  paper = config.paper.to_dict() if "paper" in config else {}
  workdir = os.path.abspath(_WORKDIR.value)
  is_main = jax.process_index() == 0
  rows = []
  for arm, exp in experiments.items():
    arm_dir = os.path.join(workdir, arm)
    if _REPORT_ONLY.value:
      row = summarize(arm, exp, arm_dir, "", trainers[arm].num_params, paper.get(arm))
      done = row["steps"] >= exp.train.steps
      row["status"] = "completed" if done else f"partial ({row['steps']}/{exp.train.steps})"
      rows.append(row)
      continue
    try:
      result = loop.train(exp, arm_dir, progress=_PROGRESS.value, trainer=trainers[arm])
      status = "completed" if result.completed else f"stopped ({result.stop_reason})"
      num_params = result.num_params
    except loop.NonFiniteLossError as e:
      status = "diverged (NaN/Inf)"
      num_params = trainers[arm].num_params
      print(f"error: {e}", file=sys.stderr)
    rows.append(summarize(arm, exp, arm_dir, status, num_params, paper.get(arm)))
    if status.startswith("stopped"):  # preempted (SIGTERM): re-run the command to resume
      print(f"{arm}: {status}; the remaining arms did not run", file=sys.stderr)
      sys.exit(1)

  if not is_main:
    return
  name = str(config.get("name", "comparison"))
  table = bench.markdown_table([_formatted(r) for r in rows], COLUMNS)
  any_exp = next(iter(experiments.values()))
  header = (f"# {name}\n\n{any_exp.train.steps} steps x {any_exp.train.global_batch_size} x "
            f"{any_exp.train.seq_len} tokens, {jax.device_count()} {jax.devices()[0].platform} "
            f"device(s). Train loss: mean of the last log interval; val loss: the fixed "
            f"validation batches at the last step; tokens/s: median steady-state step.\n\n")
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write(header + table + "\n")
  bench.write_json(os.path.join(workdir, "results.json"), rows, name=name,
                   devices=jax.device_count(), platform=jax.devices()[0].platform)
  png = os.path.join(workdir, "loss_curves.png")
  plot(rows, png, f"{name}: {len(rows)} arms")
  print(f"\n{header}{table}\n\nwrote {workdir}/results.md, results.json and {png}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
