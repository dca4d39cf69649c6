r"""Trains one model (one arm of a comparison) and resumes where it stopped.

    python -m experiments.train --config=configs/mixers.py:tiny --config.arm=gdn \
        --workdir=runs/mixers_tiny/gdn
    python -m experiments.train --config=configs/base.py:small --config.model.mixer=kda \
        --config.train.steps=500 --workdir=runs/kda_small

Every config field can be overridden on the command line (`--config.section.field=value`); a
field given there wins over the arm's (`--config.arm=gdn --config.model.mixer=kda` trains KDA,
and says so). An unknown field, arm, mixer or implementation, or a mesh that does not fit the
devices, fails before any compute and before `--workdir` is written, with a message that names
it. A WSD warmup + decay longer than `train.steps` (a 30-step trial of a 250-step config) is
scaled down to fit, with a note; see docs/TRAINING.md. Re-running the same command resumes from
the last checkpoint in `--workdir` (the logs drop what the killed run wrote after it); a
finished run prints its recorded losses. Multi-host: `--distributed=auto` (default) starts
`jax.distributed` on SLURM and TPU pods; see docs/PODS.md.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import cli
from lineax_attn.train import distributed, experiment

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file and size, e.g. configs/mixers.py:tiny.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints and logs go here.", required=True)
_STOP_AT = flags.DEFINE_integer(
    "stop_at_step", None, "Stop after this step with a checkpoint (resume later).")
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed", "auto", distributed.MODES,
    "jax.distributed.initialize: auto (on SLURM / TPU pods / with a coordinator), on, off.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's id.")
_PROGRESS = flags.DEFINE_boolean("progress", True, "Print the progress line.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/mixers.py:tiny")
  # Before any JAX call: the multi-process runtime must start first.
  distributed.initialize(_DISTRIBUTED.value, coordinator_address=_COORDINATOR.value,
                         num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value)
  from lineax_attn.train import loop  # pylint: disable=g-import-not-at-top

  try:
    # The command line's --config.* fields win over the arm's (ml_collections applied them
    # before the arm was known).
    exp = experiment.resolve(_CONFIG.value, command_line=config_flags.get_override_values(
        flags.FLAGS["config"]))
    trainer = loop.Trainer(exp)  # abstract: checks that every parameter splits over the mesh
  except (ValueError, FileNotFoundError) as e:
    print(f"error: invalid config: {e}", file=sys.stderr)
    sys.exit(2)
  try:
    result = loop.train(exp, _WORKDIR.value, stop_at_step=_STOP_AT.value,
                        progress=_PROGRESS.value, trainer=trainer)
  except loop.NonFiniteLossError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(3)
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_index() == 0:
    status = "completed" if result.completed else f"stopped ({result.stop_reason})"
    val = "n/a" if result.eval_loss is None else f"{result.eval_loss:.4f}"
    train_loss = "n/a" if result.train_loss is None else f"{result.train_loss:.4f}"
    print(f"{result.name}: {status} at step {result.final_step}; train loss {train_loss}, "
          f"validation loss {val}; logs in {_WORKDIR.value}")
  if result.stop_reason == "SIGTERM":
    sys.exit(1)  # not finished: re-run the command to resume


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
