r"""Data parallel vs context parallel training on the local devices (docs/CONTEXT_PARALLEL.md).

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

`--meshes` replaces the modes by explicit meshes, `;`-separated, each a `,`-separated list of
axis sizes over data, fsdp, tensor, sequence (missing = 1); one row per mesh, named by its spec:

    # 8 GPUs: data, data x fsdp, data x tensor, data x context, and the one-GPU oracle:
    python -m experiments.bench_parallel --config=configs/mixers.py:small --config.arm=gdn \
        --meshes="data=1;data=2;data=8;data=2,fsdp=4;data=4,tensor=2;data=2,sequence=4" \
        --reference=paper --out_md=runs/bench_parallel_x8/small.md

The mesh table adds tokens/s per device, MFU (the FLOPs model of lineax_attn/train/metrics.py
against `--peak_tflops` per device, 989.4 = H200/H100 dense bf16), and the scaling efficiency
tokens/s / (devices x tokens/s of the one-device row), and of a `data=2` row when there is one
(tokens/s / (devices / 2 x its tokens/s)). A mesh larger than the local devices, or one the
config's batch, length or heads do not split over, becomes a row with a note saying why; the
other rows still run. `--reference=paper` (or any text) adds a line under the table with the
paper's Megatron throughput (docs/MATH.md §6.7 Table C). The table and JSON are rewritten after
every row, and `--merge_json=<an earlier run's .json>` continues a study split over several calls
(its meshes are not run again). docs/PODS.md has the 8-GPU study commands.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags, logging
from ml_collections import config_flags
import numpy as np

from experiments import cli
from lineax_attn.train import experiment

MODES = ("single", "data", "context")
MESH_AXES = ("data", "fsdp", "tensor", "sequence")
# docs/MATH.md §6.7 Table C: Megatron on 4 GH200s, 50-iteration smoke runs, AdamW.
PAPER_REFERENCE = ("paper (Megatron, 4 x GH200, 350M 2:1 GDN-2 hybrid, AdamW, seq 4096): "
                   "147,756 tokens/s per GPU, 265.0 TFLOP/s per GPU (docs/MATH.md §6.7 Table C)")

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
_MESHES = flags.DEFINE_string(
    "meshes", None, "Explicit meshes instead of --modes, ';'-separated, each ','-separated "
    "axis=size over data, fsdp, tensor, sequence (missing = 1), e.g. "
    "'data=1;data=8;data=2,fsdp=4;data=4,tensor=2;data=2,sequence=4'.")
_PEAK_TFLOPS = flags.DEFINE_float(
    "peak_tflops", 989.4, "Peak TFLOP/s per device for the MFU column of --meshes (989.4: "
    "H200/H100 dense bf16).")
_MERGE_JSON = flags.DEFINE_string(
    "merge_json", None, "--meshes: rows of an earlier run of the same config (its .json) to "
    "put first; their meshes are not run again (split a study over several calls).")
_REFERENCE = flags.DEFINE_string(
    "reference", "", "A line under the --meshes table; 'paper' = the paper's Megatron "
    "throughput of docs/MATH.md §6.7 Table C.")


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def parse_meshes(text: str) -> list[tuple[str, dict[str, int]]]:
  """`"data=1;data=2,fsdp=4"` -> [(spec, {data, fsdp, tensor, sequence} sizes)], in order.

  A missing axis is 1. Raises a ValueError naming the part that is not `axis=int >= 1` over
  MESH_AXES, a repeated axis, or an empty list.
  """
  meshes = []
  for spec in (part.strip() for part in text.split(";")):
    if not spec:
      continue
    sizes = dict.fromkeys(MESH_AXES, 1)
    seen = set()
    for item in (x.strip() for x in spec.split(",")):
      axis, _, value = item.partition("=")
      axis = axis.strip()
      if axis not in MESH_AXES or axis in seen or not value.strip().isdigit():
        raise ValueError(f"--meshes: {item!r} in mesh {spec!r} is not axis=size with axis one "
                         f"of {MESH_AXES} (each at most once) and size an int >= 1")
      sizes[axis] = int(value)
      if sizes[axis] < 1:
        raise ValueError(f"--meshes: {item!r} in mesh {spec!r}: the size must be >= 1")
      seen.add(axis)
    meshes.append((spec, sizes))
  if not meshes:
    raise ValueError(f"--meshes={text!r} names no mesh; e.g. 'data=1;data=8'")
  return meshes


def _mesh_config(config, sizes: dict[str, int]):
  """The config with an explicit mesh (loss eval off: it is a timing run)."""
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.mesh.update(**sizes)
    config.train.eval_batches = 0
  return config


def _mode_sizes(mode: str, n: int) -> dict[str, int]:
  sizes = dict.fromkeys(MESH_AXES, 1)
  if mode == "data":
    sizes["data"] = n
  elif mode == "context":
    sizes["sequence"] = n
  return sizes


def _mode_config(config, mode: str, n: int):
  """The config with the mesh of `mode` on n devices (loss eval off: it is a timing run)."""
  return _mesh_config(config, _mode_sizes(mode, n))


def run_mode(config, mode: str, n: int, steps: int) -> dict:
  """Trains `steps` steps in `mode` on the first n (1 for single) devices; returns the row."""
  count = 1 if mode == "single" else n
  row, _ = _train(_mode_config(config, mode, n), count, steps, {"mode": mode}, mode)
  return row


def run_mesh(config, spec: str, sizes: dict[str, int], steps: int) -> dict:
  """Trains `steps` steps on the mesh `sizes` over the first prod(sizes) local devices; the row
  also has the parameter count and the training FLOPs per token (metrics.py's model)."""
  row, trainer = _train(_mesh_config(config, sizes), math.prod(sizes.values()), steps,
                        {"spec": spec}, spec)
  row["num_params"] = trainer.num_params
  row["flops_per_token"] = trainer.flops_per_token()
  return row


def _train(config, count: int, steps: int, head: dict, label: str):
  """Trains `steps` steps of config (its mesh set) on the first `count` local devices; returns
  (the row, starting with `head`; the Trainer)."""
  import jax  # pylint: disable=g-import-not-at-top
  from lineax_attn import bench  # pylint: disable=g-import-not-at-top
  from lineax_attn.data import pipeline as pipeline_lib  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import loop  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import sharding as sharding_lib  # pylint: disable=g-import-not-at-top

  exp = experiment.resolve(config, device_count=count, process_count=1)
  devices = jax.local_devices()[:count]
  mesh = sharding_lib.make_mesh(*exp.mesh_shape, sequence=exp.mesh.sequence, devices=devices)
  trainer = loop.Trainer(exp, mesh=mesh)
  iterator = pipeline_lib.make_iterator(exp.train_data, shard_index=0, shard_count=1)
  local_batches = [next(iterator) for _ in range(steps)]  # the same batches in every mode
  params, opt_state = trainer.init()
  row = {**head, "devices": count,
         "mesh": ",".join(f"{a}={s}" for a, s in trainer.mesh.shape.items() if s > 1) or "-",
         "tokens_per_step": exp.tokens_per_step}

  batch = trainer.global_batch(local_batches[0])
  t0 = time.perf_counter()
  with jax.set_mesh(trainer.mesh):
    compiled = trainer.jitted_step.lower(params, opt_state, batch).compile()
  row["compile_s"] = time.perf_counter() - t0
  memory = bench.compiled_memory_bytes(compiled)
  if memory is not None:
    row["compiled_mib_per_device"] = memory / 2**20
  losses, times = [], []
  for i, local in enumerate(local_batches):
    batch = trainer.global_batch(local)
    t0 = time.perf_counter()
    params, opt_state, metrics = trainer.step(params, opt_state, batch)
    loss = float(jax.device_get(metrics["loss"]))  # waits for the step
    times.append(time.perf_counter() - t0)
    losses.append(loss)
    _log(f"[{label}] step {i + 1}/{steps}: loss {loss:.5f}, {times[-1] * 1e3:.1f} ms")
  steady = times[1:] or times
  row["step_ms"] = float(np.median(steady)) * 1e3
  row["tokens_per_s"] = exp.tokens_per_step / (row["step_ms"] / 1e3)
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
  if all(p is not None for p in peaks):
    row["device_peak_mib"] = max(peaks) / 2**20
  row["losses"] = losses
  row["run"] = experiment.describe(exp)
  row["device"] = devices[0].device_kind   # experiments/must_line.py checks the GPU
  return row, trainer


def _child_argv() -> list[str]:
  """This program's arguments less the ones that pick what to run (the child gets its own)."""
  out, skip = [], False
  for arg in sys.argv[1:]:
    if skip:  # the value of `--meshes VALUE` (absl also takes the value as the next argument)
      skip = False
    elif arg in ("--mode_json", "--modes", "--meshes", "--merge_json"):
      skip = True
    elif not arg.startswith(("--mode_json=", "--modes=", "--meshes=", "--merge_json=",
                             "--isolate", "--noisolate")):
      out.append(arg)
  return out


def _run_isolated(mode: str, n: int) -> dict:
  """This program with --mode_json in a subprocess (fresh device memory statistics)."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "row.json")
    cmd = [sys.executable, "-m", "experiments.bench_parallel", *_child_argv(), f"--modes={mode}",
           f"--devices={n}", f"--mode_json={out}", "--noisolate"]
    proc = subprocess.run(cmd, check=False)
    if proc.returncode != 0:
      return {"mode": mode, "note": f"failed (exit {proc.returncode})"}
    with open(out) as f:
      return json.load(f)


def _run_mesh_isolated(spec: str, sizes: dict[str, int], n: int) -> dict:
  """One mesh in a subprocess; its errors come back as the row's note."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "row.json")
    cmd = [sys.executable, "-m", "experiments.bench_parallel", *_child_argv(),
           f"--meshes={spec}", f"--devices={n}", f"--mode_json={out}", "--noisolate"]
    proc = subprocess.run(cmd, check=False)
    if proc.returncode != 0 or not os.path.exists(out):  # e.g. killed, or a crash in XLA
      return {"spec": spec, "devices": math.prod(sizes.values()),
              "note": f"failed (exit {proc.returncode}; see the log above)"}
    with open(out) as f:
      return json.load(f)


def _run_mesh_caught(config, spec: str, sizes: dict[str, int], steps: int) -> dict:
  """run_mesh, with an error (heads that do not split, out of memory) as the row's note."""
  try:
    return run_mesh(config, spec, sizes, steps)
  except Exception as e:  # pylint: disable=broad-except  # one bad mesh must not end the table
    message = " ".join(str(e).split())[:300]
    _log(f"[{spec}] failed: {type(e).__name__}: {message}")
    return {"spec": spec, "devices": math.prod(sizes.values()),
            "note": f"failed: {type(e).__name__}: {message}"}


def mesh_problem(config, sizes: dict[str, int], local_devices: int) -> str | None:
  """Why the mesh cannot run here (too few devices; a batch or length `experiment.resolve`
  rejects), or None. Heads that do not split over `tensor` fail later, in the run."""
  count = math.prod(sizes.values())
  if count > local_devices:
    return f"skipped: the mesh needs {count} devices, {local_devices} local"
  try:
    experiment.resolve(_mesh_config(config, sizes), device_count=count, process_count=1)
  except ValueError as e:
    return f"invalid: {e}"
  return None


def _compare(rows: list[dict], loss_steps: int, rtol: float, ref: dict | None = None) -> None:
  """Adds the max relative loss error against the one-device run (`ref`; default the `single`
  mode's row) over the first steps."""
  if ref is None:
    ref = next((r for r in rows if r.get("mode") == "single" and "losses" in r), None)
  for row in rows:
    if ref is None or "losses" not in row:
      continue
    a = np.asarray(row["losses"][:loss_steps], np.float64)
    b = np.asarray(ref["losses"][:loss_steps], np.float64)
    row["loss_rel_err"] = float(np.max(np.abs(a - b) / np.abs(b)))
    row["matches"] = "yes" if row["loss_rel_err"] <= rtol else "NO"
    row["first_losses"] = " ".join(f"{x:.4f}" for x in a)


def _is_data2(row: dict) -> bool:
  sizes = row.get("sizes", {})
  return sizes.get("data") == 2 and math.prod(sizes.values()) == 2


def add_scaling(rows: list[dict], peak_tflops: float) -> None:
  """Adds tokens/s per device, MFU (FLOPs per token x tokens/s / (peak x devices); the FLOPs
  model is lineax_attn/train/metrics.py's) and the scaling efficiency against the one-device
  row and, if there is one, the `data=2` row: tokens/s / (devices / d_ref x tokens/s_ref)."""
  timed = [r for r in rows if "tokens_per_s" in r]
  one = next((r for r in timed if r["devices"] == 1), None)
  two = next((r for r in timed if _is_data2(r)), None)
  for row in timed:
    row["tokens_per_s_per_device"] = row["tokens_per_s"] / row["devices"]
    row["mfu"] = (row["flops_per_token"] * row["tokens_per_s"]
                  / (peak_tflops * 1e12 * row["devices"]))
    row["mfu_pct"] = f"{100 * row['mfu']:.1f}" if row["mfu"] >= 1e-3 else f"{100 * row['mfu']:.1e}"
    for ref, key in ((one, "efficiency"), (two, "efficiency_vs_data2")):
      if ref is not None:
        row[key] = row["tokens_per_s"] / (row["devices"] / ref["devices"] * ref["tokens_per_s"])


COLUMNS = [("mode", "mode"), ("mesh", "mesh"), ("devices", "devices"),
           ("step_ms", "step ms (median)"), ("tokens_per_s", "tokens/s"),
           ("compiled_mib_per_device", "compiled MiB/device"),
           ("device_peak_mib", "device peak MiB"), ("compile_s", "compile s"),
           ("first_losses", "first losses"), ("loss_rel_err", "max rel err vs single"),
           ("matches", "matches"),
           ("note", "note")]


def mesh_columns(peak_tflops: float, with_data2: bool) -> list[tuple[str, str]]:
  """The --meshes table's columns (the data=2 efficiency only when that row exists)."""
  return ([("spec", "mesh"), ("devices", "devices"), ("step_ms", "step ms (median)"),
           ("tokens_per_s", "tokens/s"), ("tokens_per_s_per_device", "tokens/s/device"),
           ("mfu_pct", f"MFU % (peak {peak_tflops:g} TFLOP/s/device)"),
           ("efficiency", "scaling eff. vs 1 device")]
          + ([("efficiency_vs_data2", "scaling eff. vs data=2")] if with_data2 else [])
          + [("compiled_mib_per_device", "compiled MiB/device"),
             ("device_peak_mib", "device peak MiB"), ("compile_s", "compile s"),
             ("first_losses", "first losses"), ("loss_rel_err", "max rel err vs 1 device"),
             ("matches", "matches"), ("note", "note")])


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
  meshes = None
  if _MESHES.value is not None:
    try:
      meshes = parse_meshes(_MESHES.value)
    except ValueError as e:
      raise app.UsageError(str(e)) from e
    if _PEAK_TFLOPS.value <= 0:
      raise app.UsageError(f"--peak_tflops={_PEAK_TFLOPS.value} must be > 0")
  import jax  # pylint: disable=g-import-not-at-top
  n = _DEVICES.value or jax.local_device_count()
  if n < 1 or n > jax.local_device_count():
    raise app.UsageError(f"--devices={n}, but {jax.local_device_count()} local devices")
  steps = max(_STEPS.value, _LOSS_STEPS.value)
  if meshes is not None:
    _main_meshes(meshes, n, steps)
    return
  if n == 1 and any(m != "single" for m in _MODES.value):
    _log("warning: one device: the data and context modes equal the single one")

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
  _write(table, rows)


def _main_meshes(meshes: list[tuple[str, dict[str, int]]], n: int, steps: int) -> None:
  """--meshes: one row per mesh (each in its own subprocess with --isolate)."""
  config = _CONFIG.value
  if _MODE_JSON.value:  # one mesh, in a subprocess of the run below
    spec, sizes = meshes[0]
    row = _run_mesh_caught(config, spec, sizes, steps)
    with open(_MODE_JSON.value, "w") as f:
      json.dump(row, f)
    return

  rows = _merged_rows(config) if _MERGE_JSON.value else []
  done = {r["spec"] for r in rows}
  for spec, sizes in meshes:
    if spec in done:
      _log(f"== mesh {spec}: from {_MERGE_JSON.value}")
      continue
    count = math.prod(sizes.values())
    _log(f"== mesh {spec} on {count} device(s)")
    problem = mesh_problem(config, sizes, n)
    if problem is not None:
      _log(f"[{spec}] {problem}")
      row = {"spec": spec, "devices": count, "note": problem}
    elif _ISOLATE.value:
      row = _run_mesh_isolated(spec, sizes, n)
    else:
      row = _run_mesh_caught(config, spec, sizes, steps)
    row["sizes"] = sizes
    rows.append(row)
    # The table so far, after every row: a run cut short (a time limit) keeps what it measured.
    _write(_mesh_table(rows, n, steps), rows, echo=False)
  _write(_mesh_table(rows, n, steps), rows)


def _merged_rows(config) -> list[dict]:
  """The rows of --merge_json; a UsageError if they trained another model or run."""
  with open(_MERGE_JSON.value) as f:
    rows = json.load(f)
  for row in rows:
    if "spec" not in row or "sizes" not in row:
      raise app.UsageError(f"--merge_json={_MERGE_JSON.value}: not the JSON of a --meshes run")
    if "run" in row:
      sizes = row["sizes"]
      exp = experiment.resolve(_mesh_config(config, sizes), device_count=math.prod(
          sizes.values()), process_count=1)
      ours, theirs = (experiment.describe(exp).split(", mesh")[0], row["run"].split(", mesh")[0])
      if ours != theirs:
        raise app.UsageError(f"--merge_json: row {row['spec']!r} ran {theirs!r}, this config is "
                             f"{ours!r}")
  return rows


def _mesh_table(rows: list[dict], n: int, steps: int) -> str:
  """The --meshes Markdown (adds the loss errors, MFU and efficiencies to rows)."""
  import jax  # pylint: disable=g-import-not-at-top
  from lineax_attn import bench  # pylint: disable=g-import-not-at-top
  one = next((r for r in rows if r.get("devices") == 1 and "losses" in r), None)
  _compare(rows, _LOSS_STEPS.value, _LOSS_RTOL.value, ref=one)
  add_scaling(rows, _PEAK_TFLOPS.value)
  run = next((r["run"].split(", mesh")[0] for r in rows if "run" in r), "")
  params = next((r["num_params"] for r in rows if "num_params" in r), None)
  flops = next((r["flops_per_token"] for r in rows if "flops_per_token" in r), None)
  model = (f"{run}; {params:,} parameters, {flops / 1e9:.4g} GFLOPs per trained token"
           if params is not None else run)
  reference = PAPER_REFERENCE if _REFERENCE.value == "paper" else _REFERENCE.value
  columns = mesh_columns(_PEAK_TFLOPS.value, any(_is_data2(r) for r in rows))
  return "\n".join([
      f"# Parallel training meshes ({n} x {jax.devices()[0].device_kind})", "",
      model, "",
      f"{steps} steps per mesh on the same batches; step time = median after the first step; "
      f"MFU = FLOPs per token (lineax_attn/train/metrics.py) x tokens/s / ({_PEAK_TFLOPS.value:g} "
      f"TFLOP/s x devices) (--peak_tflops); scaling efficiency = tokens/s / (devices x tokens/s "
      f"of the 1-device row) (vs data=2: / (devices / 2 x tokens/s of data=2)); loss error = max "
      f"over the first {_LOSS_STEPS.value} steps of |loss − loss_1| / loss_1 against the "
      f"1-device row ('matches': <= {_LOSS_RTOL.value:g}).", "",
      bench.markdown_table(rows, columns), "",
      *([reference, ""] if reference else [])])


def _write(table: str, rows: list[dict], echo: bool = True) -> None:
  """The table to --out_md, the rows as JSON next to it; echo: print the table too."""
  out = os.path.abspath(_OUT_MD.value)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    f.write(table)
  with open(os.path.splitext(out)[0] + ".json", "w") as f:
    json.dump(rows, f, indent=2)
  if echo:
    print(table)


def _markdown(rows):
  from lineax_attn import bench  # pylint: disable=g-import-not-at-top
  return bench.markdown_table(rows, COLUMNS)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
