r"""Start-up time of training, launch to the first step, per arm (issue #15).

    # one H200, the 350M arms (global batch 16, no micro-batches, as bench_parallel measured):
    python -m experiments.bench_startup --config=configs/mixers.py:paper \
        --arms=softmax,gdn2,kda,gdn --json_out=runs/bench_startup/paper.json
    # CPU smoke run:
    JAX_PLATFORMS=cpu python -m experiments.bench_startup --config=configs/mixers.py:tiny \
        --arms=softmax,gdn2 --json_out=/tmp/startup.json

Each arm runs in a fresh Python process (so no traced function, compiled program or loaded
module carries over from another arm; JAX's persistent compilation cache is switched off) that
records the wall time from its launch (the parent's clock just before it starts the process, so
interpreter start-up and imports count) to the end of each stage:

* `imports`: jax, flax and lineax_attn imported;
* `config`: the arm's experiment resolved (`experiment.resolve`);
* `trainer`: `loop.Trainer` built (abstract model, shardings, optimiser);
* `init`: `trainer.init()` returned and its arrays are ready (parameters and optimiser state);
* `batch`: the first batch read and placed (`trainer.global_batch`);
* `step_compiled`: the first train step lowered and compiled (`jitted_step.lower(...).compile()`);
* `step_done`: that compiled step run once, its loss read back.

With `--compile_only` the init, the batch and the run are skipped: the step is lowered and
compiled on abstract inputs (`jax.ShapeDtypeStruct`s with the trainer's shardings), so the 350M
models' compile can be measured on a CPU that could not hold or run them:

    JAX_PLATFORMS=cpu python -m experiments.bench_startup --config=configs/mixers.py:paper \
        --arms=softmax,gdn2 --compile_only --config.model.scan_layers=false --json_out=...

Either way the row has the process CPU seconds of the step's lowering and of its compile
(`step_lower_cpu_s`, `step_compile_cpu_s`) and the lines of the optimised HLO
(`step_hlo_lines`).

It also sums XLA's backend compile time (the `/jax/core/compile/backend_compile_duration`
events) inside `init` and inside the step compile, and counts the programs compiled there.
Defaults: `train.global_batch_size=16`, `train.grad_accum_steps=1` (`--config.train...` flags
override them), no validation batches. Prints a progress line per stage and the Markdown table;
writes the rows (and the Markdown next to the JSON, `.md`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

LAUNCH = time.time()  # this process's own launch, when the parent gave none

from absl import app, flags, logging  # noqa: E402  (the launch clock comes first)
from ml_collections import config_flags  # noqa: E402

from experiments import cli  # noqa: E402
from lineax_attn.train import experiment  # noqa: E402

STAGES = ("imports", "config", "trainer", "init", "batch", "step_compiled", "step_done")
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# experiments/bench_parallel.py's one-H200 rows: 16 rows of the config's length, one micro-batch.
DEFAULT_TRAIN = {"global_batch_size": 16, "grad_accum_steps": 1}

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file and size, e.g. configs/mixers.py:paper.", lock_config=True)
_ARMS = flags.DEFINE_list("arms", None, "Arms of the config to time, each in its own process "
                          "(default: the config's `arm`).")
_JSON_OUT = flags.DEFINE_string("json_out", "runs/bench_startup/startup.json",
                                "The rows as JSON; the Markdown table goes next to it (.md).")
_COMPILE_ONLY = flags.DEFINE_boolean(
    "compile_only", False, "Skip init, batch and the run: lower and compile the step on "
    "abstract inputs (measures the compile of models too large for the machine).")
_ISOLATE = flags.DEFINE_boolean("isolate", True, "Run each arm in a fresh subprocess.")
_ARM_JSON = flags.DEFINE_string("arm_json", None, "Internal: time one arm, write its row here.")
_LAUNCH_TIME = flags.DEFINE_float("launch_time", None, "Internal: the parent's time.time() "
                                  "just before it started this process.")


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def arm_config(config, arm: str, overridden=()):
  """The config of one timing run: `arm`, DEFAULT_TRAIN (except the fields in `overridden`, e.g.
  "train.global_batch_size" set on the command line), no validation."""
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.arm = arm
    for name, value in DEFAULT_TRAIN.items():
      if f"train.{name}" not in overridden:
        config.train[name] = value
    config.train.eval_batches = 0
  return config


def time_arm(config, arm: str, launch: float, overridden=()) -> dict:
  """Runs the stages of the module docstring for `arm` (config: `arm_config`'s); returns the
  row (seconds from `launch`, a time.time(), to each stage's end, and per stage)."""
  import jax  # pylint: disable=g-import-not-at-top

  # Every program compiles here: no persistent cache (JAX_COMPILATION_CACHE_DIR) is read.
  jax.config.update("jax_enable_compilation_cache", False)
  compiles: list[float] = []
  listener = lambda event, seconds, **_: (  # noqa: E731
      compiles.append(seconds) if event == _COMPILE_EVENT else None)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    return _time_stages(config, arm, launch, overridden, compiles)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def _time_stages(config, arm, launch, overridden, compiles) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from lineax_attn.data import pipeline as pipeline_lib  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import loop  # pylint: disable=g-import-not-at-top

  row: dict = {"arm": arm, "pid": os.getpid()}
  last = [launch]

  def stage(name: str) -> None:
    now = time.time()
    row[f"{name}_s"] = now - last[0]
    row[f"at_{name}_s"] = now - launch
    last[0] = now
    _log(f"[{arm}] {name}: {row[f'{name}_s']:.2f} s (launch + {row[f'at_{name}_s']:.2f} s)")

  stage("imports")
  exp = experiment.resolve(arm_config(config, arm, overridden))
  stage("config")
  trainer = loop.Trainer(exp)
  row["num_params"], row["vocab_size"] = trainer.num_params, exp.model.vocab_size
  stage("trainer")
  compile_only = _COMPILE_ONLY.value
  before = len(compiles)
  if compile_only:
    params, opt_state = trainer.abstract_params, trainer.abstract_opt_state
  else:
    params, opt_state = jax.block_until_ready(trainer.init())
  row["init_compiles"] = len(compiles) - before
  row["init_compile_s"] = sum(compiles[before:])
  stage("init")
  if compile_only:
    batch = {k: jax.ShapeDtypeStruct((exp.train.global_batch_size, exp.train.seq_len),
                                     jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=trainer.batch_sharding)
             for k in _batch_keys(trainer)}
  else:
    iterator = pipeline_lib.make_iterator(exp.train_data)
    batch = jax.block_until_ready(trainer.global_batch(next(iterator)))
  stage("batch")
  before = len(compiles)
  with jax.set_mesh(trainer.mesh):
    cpu = time.process_time()
    lowered = trainer.jitted_step.lower(params, opt_state, batch)
    row["step_lower_cpu_s"] = time.process_time() - cpu
    cpu = time.process_time()
    compiled = lowered.compile()
    row["step_compile_cpu_s"] = time.process_time() - cpu
  row["step_compile_s"] = sum(compiles[before:])
  stage("step_compiled")
  row["step_hlo_lines"] = len(compiled.as_text().splitlines())
  if not compile_only:
    with jax.set_mesh(trainer.mesh):
      _, _, metrics = compiled(params, opt_state, batch)
    row["loss"] = float(jax.device_get(metrics["loss"]))
    stage("step_done")
  row["scan_layers"] = exp.model.scan_layers
  row["device"] = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
  row["run"] = experiment.describe(exp)
  return row


def _batch_keys(trainer) -> tuple[str, ...]:
  return ("inputs", "targets", "loss_mask") + (("segment_ids",) if trainer.use_segment_ids
                                               else ())


def _run_isolated(arm: str, json_path: str) -> dict:
  """This program for one arm in a fresh process; a failure is the row's note."""
  argv, skip = [], False
  ours = ("--arms", "--json_out", "--arm_json", "--launch_time")
  for arg in sys.argv[1:]:
    if skip:  # the value of `--arms VALUE` (absl also takes the value as the next argument)
      skip = False
    elif arg in ours:
      skip = True
    elif not arg.startswith(tuple(f"{a}=" for a in ours) + ("--isolate", "--noisolate")):
      argv.append(arg)
  cmd = [sys.executable, "-m", "experiments.bench_startup", *argv, f"--arms={arm}",
         f"--arm_json={json_path}", "--noisolate"]
  launch = time.time()
  proc = subprocess.run([*cmd, f"--launch_time={launch!r}"], check=False)
  if proc.returncode != 0 or not os.path.exists(json_path):
    return {"arm": arm, "note": f"failed (exit {proc.returncode}; see the log above)"}
  with open(json_path) as f:
    return json.load(f)


COLUMNS = ([("arm", "arm"), ("num_params", "params")]
           + [(f"at_{s}_s", f"{s} (s from launch)") for s in STAGES]
           + [("init_s", "init s"), ("init_compile_s", "XLA compile in init s"),
              ("init_compiles", "programs compiled in init"),
              ("step_compiled_s", "step lower+compile s"),
              ("step_compile_s", "XLA compile in step s"),
              ("step_lower_cpu_s", "step lower CPU s"),
              ("step_compile_cpu_s", "step compile CPU s"),
              ("step_hlo_lines", "optimised HLO lines"), ("scan_layers", "scan_layers"),
              ("loss", "first loss"),
              ("note", "note")])


def markdown(rows: list[dict]) -> str:
  from lineax_attn import bench  # pylint: disable=g-import-not-at-top
  device = next((r["device"] for r in rows if "device" in r), "")
  run = next((r["run"] for r in rows if "run" in r), "")
  return "\n".join([
      f"# Start-up time ({device})", "", run, "",
      "Wall seconds from the process launch to the end of each stage (one fresh process per "
      "arm); `XLA compile` sums XLA's backend compile events.", "",
      bench.markdown_table(rows, COLUMNS), ""])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/mixers.py:paper")
  overridden = config_flags.get_override_values(flags.FLAGS["config"])
  arms = _ARMS.value or [config.get("arm", "")]
  known = experiment.arm_names(config)
  bad = [a for a in arms if a and a not in known]
  if bad:
    raise app.UsageError(f"unknown --arms {bad}; the config has {known}")

  if _ARM_JSON.value:  # one arm, in a subprocess of the run below
    launch = _LAUNCH_TIME.value if _LAUNCH_TIME.value is not None else LAUNCH
    row = time_arm(config, arms[0], launch, overridden)
    with open(_ARM_JSON.value, "w") as f:
      json.dump(row, f)
    return

  out = os.path.abspath(_JSON_OUT.value)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  rows = []
  for i, arm in enumerate(arms):
    _log(f"== {arm or '(base)'}")
    if _ISOLATE.value:
      row = _run_isolated(arm, f"{os.path.splitext(out)[0]}.{i}.tmp.json")
    else:
      row = time_arm(config, arm, LAUNCH if i == 0 else time.time(), overridden)
    rows.append(row)
    with open(out, "w") as f:  # after every arm: a run cut short keeps what it measured
      json.dump(rows, f, indent=2)
  for i in range(len(arms)):
    tmp = f"{os.path.splitext(out)[0]}.{i}.tmp.json"
    if os.path.exists(tmp):
      os.remove(tmp)
  table = markdown(rows)
  with open(os.path.splitext(out)[0] + ".md", "w") as f:
    f.write(table)
  print(table)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
