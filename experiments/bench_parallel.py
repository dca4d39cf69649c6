"""Data parallel vs context parallel training on the local devices (docs/CONTEXT_PARALLEL.md).

    # 2 GPUs, the `small` GDN 2:1 hybrid (8 layers, T 1024, 32 rows per step):
    python -m experiments.bench_parallel --config=configs/mixers.py:small --config.arm=gdn \
        --out_md=runs/bench_parallel/results.md
    # CPU smoke run with 2 fake devices:
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \
        python -m experiments.bench_parallel --config=configs/mixers.py:tiny --steps=3 \
        --out_md=/tmp/bench_parallel.md

On N local devices it trains the config's model with the same batches in three modes:

* `single`: one device (the oracle);
* `data`: data parallel, mesh (data=N): each device takes B/N rows;
* `context`: context parallel, mesh (sequence=N): each device takes T/N tokens of every row
  (linear mixers: local pass + all_gather of the shard transitions; softmax: all-gathered K/V).

For each it reports the compile time, the median step time after the first step, tokens/s,
per-device memory (XLA's compiled estimate of the step: arguments + outputs + temporaries −
aliased; on GPU also the device's peak bytes in use), the losses of the first steps and their
relative error against the one-device run. With `--isolate` (default) each mode runs in a fresh
subprocess, so the device peak of one mode is not the leftover of another. Writes a Markdown
table to --out_md and the rows as JSON next to it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags, logging
from ml_collections import config_flags
import numpy as np

from lineax_attn.train import experiment

MODES = ("single", "data", "context")

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file and size, e.g. configs/mixers.py:small.", lock_config=True)
_MODES = flags.DEFINE_list("modes", list(MODES), "Which of single, data, context to run.")
_STEPS = flags.DEFINE_integer("steps", 10, "Training steps per mode (the first one compiles).")
_LOSS_STEPS = flags.DEFINE_integer("loss_steps", 5, "Losses compared with the one-device run.")
_LOSS_RTOL = flags.DEFINE_float(
    "loss_rtol", 5e-3, "The 'matches' column: max relative loss error allowed (bf16 runs "
    "differ by rounding; float32 runs agree to ~1e-5).")
_DEVICES = flags.DEFINE_integer("devices", None, "Devices to use (default: all local).")
_ISOLATE = flags.DEFINE_boolean("isolate", True, "Run each mode in its own subprocess.")
_OUT_MD = flags.DEFINE_string("out_md", "runs/bench_parallel/results.md", "Markdown table.")
_MODE_JSON = flags.DEFINE_string("mode_json", None, "Internal: run one mode, write its row here.")


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def _mode_config(config, mode: str, n: int):
  """The config with the mesh of `mode` on n devices (loss eval off: it is a timing run)."""
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.mesh.update(data=1, fsdp=1, tensor=1, sequence=1)
    if mode == "data":
      config.mesh.data = n
    elif mode == "context":
      config.mesh.sequence = n
    config.train.eval_batches = 0
  return config


def run_mode(config, mode: str, n: int, steps: int) -> dict:
  """Trains `steps` steps in `mode` on the first n (1 for single) devices; returns the row."""
  import jax  # pylint: disable=g-import-not-at-top
  from lineax_attn.data import pipeline as pipeline_lib  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import loop  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import sharding as sharding_lib  # pylint: disable=g-import-not-at-top

  count = 1 if mode == "single" else n
  exp = experiment.resolve(_mode_config(config, mode, n), device_count=count, process_count=1)
  devices = jax.local_devices()[:count]
  mesh = sharding_lib.make_mesh(*exp.mesh_shape, sequence=exp.mesh.sequence, devices=devices)
  trainer = loop.Trainer(exp, mesh=mesh)
  iterator = pipeline_lib.make_iterator(exp.train_data, shard_index=0, shard_count=1)
  local_batches = [next(iterator) for _ in range(steps)]  # the same batches in every mode
  params, opt_state = trainer.init()
  row = {"mode": mode, "devices": count,
         "mesh": ",".join(f"{a}={s}" for a, s in trainer.mesh.shape.items() if s > 1) or "-",
         "tokens_per_step": exp.tokens_per_step}

  batch = trainer.global_batch(local_batches[0])
  t0 = time.perf_counter()
  with jax.set_mesh(trainer.mesh):
    compiled = trainer.jitted_step.lower(params, opt_state, batch).compile()
  row["compile_s"] = time.perf_counter() - t0
  memory = compiled.memory_analysis()
  if memory is not None:
    row["compiled_mib_per_device"] = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                                      + memory.temp_size_in_bytes
                                      - memory.alias_size_in_bytes) / 2**20
  losses, times = [], []
  for i, local in enumerate(local_batches):
    batch = trainer.global_batch(local)
    t0 = time.perf_counter()
    params, opt_state, metrics = trainer.step(params, opt_state, batch)
    loss = float(jax.device_get(metrics["loss"]))  # waits for the step
    times.append(time.perf_counter() - t0)
    losses.append(loss)
    _log(f"[{mode}] step {i + 1}/{steps}: loss {loss:.5f}, {times[-1] * 1e3:.1f} ms")
  steady = times[1:] or times
  row["step_ms"] = float(np.median(steady)) * 1e3
  row["tokens_per_s"] = exp.tokens_per_step / (row["step_ms"] / 1e3)
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
  if all(p is not None for p in peaks):
    row["device_peak_mib"] = max(peaks) / 2**20
  row["losses"] = losses
  row["run"] = experiment.describe(exp)
  return row


def _run_isolated(mode: str, n: int) -> dict:
  """This program with --mode_json in a subprocess (fresh device memory statistics)."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "row.json")
    argv = [a for a in sys.argv[1:] if not a.startswith(("--mode_json", "--modes", "--isolate",
                                                         "--noisolate"))]
    cmd = [sys.executable, "-m", "experiments.bench_parallel", *argv, f"--modes={mode}",
           f"--devices={n}", f"--mode_json={out}", "--noisolate"]
    proc = subprocess.run(cmd, check=False)
    if proc.returncode != 0:
      return {"mode": mode, "note": f"failed (exit {proc.returncode})"}
    with open(out) as f:
      return json.load(f)


def _compare(rows: list[dict], loss_steps: int, rtol: float) -> None:
  """Adds the max relative loss error against the one-device run over the first steps."""
  ref = next((r for r in rows if r.get("mode") == "single" and "losses" in r), None)
  for row in rows:
    if ref is None or "losses" not in row:
      continue
    a = np.asarray(row["losses"][:loss_steps], np.float64)
    b = np.asarray(ref["losses"][:loss_steps], np.float64)
    row["loss_rel_err"] = float(np.max(np.abs(a - b) / np.abs(b)))
    row["matches"] = "yes" if row["loss_rel_err"] <= rtol else "NO"
    row["first_losses"] = " ".join(f"{x:.4f}" for x in a)


COLUMNS = [("mode", "mode"), ("mesh", "mesh"), ("devices", "devices"),
           ("step_ms", "step ms (median)"), ("tokens_per_s", "tokens/s"),
           ("compiled_mib_per_device", "compiled MiB/device"),
           ("device_peak_mib", "device peak MiB"), ("compile_s", "compile s"),
           ("first_losses", "first losses"), ("loss_rel_err", "max rel err vs single"),
           ("matches", "matches"),
           ("note", "note")]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/mixers.py:small")
  bad = sorted(set(_MODES.value) - set(MODES))
  if bad:
    raise app.UsageError(f"unknown --modes {bad}; expected a subset of {MODES}")
  if _STEPS.value < 2 or _LOSS_STEPS.value < 1:
    raise app.UsageError("--steps must be >= 2 (the first compiles) and --loss_steps >= 1")
  import jax  # pylint: disable=g-import-not-at-top
  n = _DEVICES.value or jax.local_device_count()
  if n < 1 or n > jax.local_device_count():
    raise app.UsageError(f"--devices={n}, but {jax.local_device_count()} local devices")
  if n == 1 and any(m != "single" for m in _MODES.value):
    _log("warning: one device: the data and context modes equal the single one")
  steps = max(_STEPS.value, _LOSS_STEPS.value)

  if _MODE_JSON.value:  # one mode, in a subprocess of the run below
    row = run_mode(_CONFIG.value, _MODES.value[0], n, steps)
    with open(_MODE_JSON.value, "w") as f:
      json.dump(row, f)
    return

  rows = []
  for mode in _MODES.value:
    _log(f"== {mode} on {1 if mode == 'single' else n} device(s)")
    try:
      row = (_run_isolated(mode, n) if _ISOLATE.value
             else run_mode(_CONFIG.value, mode, n, steps))
    except ValueError as e:  # e.g. a batch or length that does not split over the devices
      row = {"mode": mode, "note": f"invalid: {e}"}
    rows.append(row)
  _compare(rows, _LOSS_STEPS.value, _LOSS_RTOL.value)
  # The model and run (the mesh part differs per mode and is in the table).
  run = next((r["run"].split(", mesh")[0] for r in rows if "run" in r), "")
  table = "\n".join([
      f"# Data vs context parallel training ({n} x {jax.devices()[0].device_kind})", "",
      f"{run}", "",
      f"{steps} steps per mode on the same batches; step time = median after the first step; "
      f"loss error = max over the first {_LOSS_STEPS.value} steps of |loss − loss_single| / "
      f"loss_single ('matches': <= {_LOSS_RTOL.value:g}).", "",
      _markdown(rows), ""])
  out = os.path.abspath(_OUT_MD.value)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    f.write(table)
  with open(os.path.splitext(out)[0] + ".json", "w") as f:
    json.dump(rows, f, indent=2)
  print(table)


def _markdown(rows):
  from lineax_attn import bench  # pylint: disable=g-import-not-at-top
  return bench.markdown_table(rows, COLUMNS)


if __name__ == "__main__":
  app.run(main, flags_parser=experiment.parse_flags)
