r"""Where one training step of a model spends its GPU time, by kind of kernel and kernel by kernel.

`bench_parallel` says how many tokens a second a config trains; this says what a step is made
of, so that work on a model's speed goes where its time is (issue #17: the 350M hybrids against
the softmax Transformer++). The step is built as `bench_parallel` builds its one-device row
(the config's Trainer on a data=1 mesh), compiled ahead of time, run twice, then run `--steps`
times under `jax.profiler.trace`; the trace's device events are summed per kernel
(`op_profile.kernel_times`) and per step, and grouped into kinds by name (`KINDS`):

    python -m experiments.step_profile --config=configs/mixers.py:paper --config.arm=gdn \
        --config.train.global_batch_size=16 --config.train.grad_accum_steps=1 \
        --out_md=/tmp/step_gdn.md --out_json=/tmp/step_gdn.json

Tables: ms per step of each kind with its share of the summed kernel time, then the `--top`
kernels, each XLA kernel with what the compiled step's HLO says of the instruction of its name:
its output type and the JAX op and line of this repository's code that made it
(`hlo_instructions`; `--hlo_out` keeps the whole text). The summed kernel time can exceed the
step's wall time where kernels overlap (XLA runs independent ones on several streams) and falls
short of it where the device idles.
"""

from __future__ import annotations

import re
import tempfile
import time

from absl import app, flags
import jax
from ml_collections import config_flags

from experiments import cli
from experiments import op_profile
from lineax_attn import bench
from lineax_attn.train import experiment

FLAGS = flags.FlagValues()
_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config (a configs/ file).",
                                          flag_values=FLAGS)
_STEPS = flags.DEFINE_integer("steps", 3, "Traced steps (after two untraced ones).",
                              flag_values=FLAGS)
_TOP = flags.DEFINE_integer("top", 30, "Kernels listed (the rest summed in one row).",
                            flag_values=FLAGS)
_OUT_MD = flags.DEFINE_string("out_md", "", "Markdown tables.", flag_values=FLAGS)
_OUT_JSON = flags.DEFINE_string("out_json", "", "Rows as JSON.", flag_values=FLAGS)
_HLO_OUT = flags.DEFINE_string("hlo_out", "", "If set, the compiled step's optimized HLO text is "
                                "written here (the fusions' names are the kernels').",
                                flag_values=FLAGS)
_PLANE = flags.DEFINE_string("plane_prefix", "/device:GPU", "Trace planes whose kernels are "
                             "summed ('/host:CPU' profiles a CPU run: a check, not a measure).",
                             flag_values=FLAGS)

# Kinds of kernel by name, the first match wins (kernel keys are "cuda_name [hlo_op]").
# "linear mixer": our Mosaic GPU kernels and Triton custom calls, and jla's (not XLA's own
# Triton GEMM fusions, which are "matmul"); "attention": cuDNN's and XLA's
# fused attention; "matmul": cuBLAS / CUTLASS GEMMs; "fusion": XLA's own elementwise and
# reduction kernels; "copy": layout changes and memory moves (a fusion with a transpose in its
# name counts here).
KINDS = (
    ("linear mixer", r"mosaic_gpu|triton_kernel_call|_t0_kernel|chunk_walk|chunk_grads|"
                     r"state_pass|channel_intra|intra_chunk|fused_forward"),
    ("attention", r"cudnn|flash|fmha|attention|sdpa"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|sm90_|dot"),
    ("copy", r"copy|transpose|memcpy|memset"),
    ("fusion", r"fusion|reduce|convert|loop_|input_|wrapped_"),
)


def kind_of(kernel: str) -> str:
  """The `KINDS` name of a kernel key, "other" where none matches."""
  low = kernel.lower()
  for name, pattern in KINDS:
    if re.search(pattern, low):
      return name
  return "other"


def by_kind(times: dict[str, list[float]], steps: int) -> list[dict]:
  """Rows {kind, kernels, ms (per step), share} by time: the kernel times summed per kind."""
  sums: dict[str, list] = {}
  for kernel, durations in times.items():
    entry = sums.setdefault(kind_of(kernel), [0, 0.0])
    entry[0] += 1
    entry[1] += sum(durations)
  total = sum(us for _, us in sums.values()) or 1.0
  return sorted(({"kind": k, "kernels": n, "ms": us / steps / 1e3, "share": us / total}
                 for k, (n, us) in sums.items()), key=lambda r: -r["ms"])


# An HLO instruction line: its name, output type and opcode; and the JAX op that made it.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


_STACK_FRAME = re.compile(r"stack_frame_id=(\d+)")
_TABLE_ROW = re.compile(r'^(\d+) (.*)$')
_OURS = ("lineax_attn/", "pallas_kernels/", "experiments/")


def _source_lines(hlo_text: str) -> dict[str, str]:
  """{stack frame id: "path:line"} from an HLO module's FileNames / FileLocations /
  StackFrames tables: of each frame, the innermost location in this repository's code
  (walking out through its parents), else its own."""
  tables: dict[str, dict[str, str]] = {}
  current = None
  for line in hlo_text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      current = tables.setdefault(line, {})
    elif current is not None and (row := _TABLE_ROW.match(line)):
      current[row.group(1)] = row.group(2)
    elif line.strip():
      current = None
  files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
  fields = lambda text: dict(re.findall(r"(\w+)=(\d+)", text))
  locations = {}
  for k, v in tables.get("FileLocations", {}).items():
    f = fields(v)
    path = files.get(f.get("file_name_id", ""), "?")
    for root in _OURS:   # the path from the repository's root, where it is ours
      if f"/{root}" in path:
        path = root + path.split(f"/{root}", 1)[1]
    locations[k] = f"{path}:{f.get('line', '?')}"
  frames = {k: fields(v) for k, v in tables.get("StackFrames", {}).items()}
  out = {}
  for k in frames:
    seen, frame, chosen = set(), k, None
    while frame in frames and frame not in seen:
      seen.add(frame)
      where = locations.get(frames[frame].get("file_location_id", ""), "?")
      chosen = chosen or where
      if where.startswith(_OURS):
        chosen = where
        break
      # (the text prints a frame's parent as its id + 1, so 1 is "none")
      frame = str(int(frames[frame].get("parent_frame_id", "1")) - 1)
    out[k] = chosen or "?"
  return out


def hlo_instructions(hlo_text: str) -> dict[str, tuple[str, str, str]]:
  """{kernel-style name: (output type, opcode, "JAX op @ source line")} of every instruction
  of an HLO module's text. A GPU kernel made from a fusion carries the fusion's name with "."
  and "-" as "_" (the instruction `%input_scatter_fusion.1` runs as `input_scatter_fusion_1`),
  so a trace's kernel can be looked up here to say what it computes and where it came from."""
  sources = _source_lines(hlo_text)
  found = {}
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name, shape, opcode = match.groups()
    op_name = _OP_NAME.search(line)
    frame = _STACK_FRAME.search(line)
    where = (op_name.group(1).rsplit("/", 1)[-1] if op_name else "") + (
        f" @ {sources.get(frame.group(1), '?')}" if frame else "")
    found.setdefault(re.sub(r"[.\-]", "_", name),
                    (re.sub(r"\{[^}]*\}", "", shape), opcode, where))   # (layouts dropped)
  return found


def build_step(config):
  """(step function, params, opt_state, batch, experiment) of the config on one device."""
  from lineax_attn.data import pipeline as pipeline_lib  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import loop  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.mesh.update(data=1, fsdp=1, tensor=1, sequence=1)
    config.train.eval_batches = 0
  exp = experiment.resolve(config, device_count=1, process_count=1)
  mesh = sharding_lib.make_mesh(*exp.mesh_shape, sequence=exp.mesh.sequence,
                                devices=jax.local_devices()[:1])
  trainer = loop.Trainer(exp, mesh=mesh)
  iterator = pipeline_lib.make_iterator(exp.train_data, shard_index=0, shard_count=1)
  batch = trainer.global_batch(next(iterator))
  params, opt_state = trainer.init()
  return trainer, params, opt_state, batch, exp


def main(argv):
  del argv
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/mixers.py:paper")
  if _STEPS.value < 1 or _TOP.value < 1:
    raise app.UsageError(f"--steps and --top must be >= 1, got {_STEPS.value}, {_TOP.value}")
  trainer, params, opt_state, batch, exp = build_step(_CONFIG.value)
  label = experiment.describe(exp)
  print(f"[step_profile] {label}", flush=True)
  with jax.set_mesh(trainer.mesh):
    t0 = time.perf_counter()
    compiled = trainer.jitted_step.lower(params, opt_state, batch).compile()
    print(f"[step_profile] compiled in {time.perf_counter() - t0:.1f} s", flush=True)
  hlo_text = compiled.as_text() or ""
  if _HLO_OUT.value:
    with open(_HLO_OUT.value, "w") as f:
      f.write(hlo_text)
  instructions = hlo_instructions(hlo_text)
  state = [params, opt_state]

  def step():
    state[0], state[1], metrics = compiled(state[0], state[1], batch)
    return float(jax.device_get(metrics["loss"]))    # waits for the step

  with jax.set_mesh(trainer.mesh):
    step()
    step()
    with tempfile.TemporaryDirectory() as directory:
      with jax.profiler.trace(directory):
        t0 = time.perf_counter()
        for _ in range(_STEPS.value):
          step()
        wall_ms = (time.perf_counter() - t0) * 1e3 / _STEPS.value
      times, _ = op_profile.kernel_times(op_profile.load_trace(directory),
                                          plane_prefix=_PLANE.value)
  steps = _STEPS.value
  kernel_ms = sum(sum(v) for v in times.values()) / steps / 1e3
  kinds = by_kind(times, steps)
  kernels = op_profile.summarize(times, steps, _TOP.value)
  head = (f"Training step of {label}: {exp.tokens_per_step} tokens, wall {wall_ms:.1f} ms a step "
          f"(traced), kernels summed {kernel_ms:.1f} ms, {jax.devices()[0].device_kind}, "
          f"{steps} traced steps.")
  md = [head, "", bench.markdown_table(
            [{**r, "ms": f"{r['ms']:.2f}", "share": f"{r['share']:.1%}"} for r in kinds],
            [("kind", "kind"), ("kernels", "kernels"), ("ms", "ms / step"), ("share", "share")]),
        "", bench.markdown_table(
            [{"kernel": r["kernel"][:150], "kind": kind_of(r["kernel"]),
              "launches": f"{r['launches']:.0f}", "ms": f"{r['us'] / 1e3:.3f}",
              "share": f"{r['share']:.1%}", **_instruction_cells(r["kernel"], instructions)}
             for r in kernels],
            [("kernel", "kernel"), ("kind", "kind"), ("launches", "launches / step"),
             ("ms", "ms / step"), ("share", "share"), ("output", "HLO output"),
             ("op", "JAX op @ source (HLO metadata)")])]
  text = "\n".join(md)
  print(text, flush=True)
  if _OUT_MD.value:
    with open(_OUT_MD.value, "w") as f:
      f.write(text + "\n")
  if _OUT_JSON.value:
    rows = [{**r, **_instruction_cells(r["kernel"], instructions)} for r in kernels]
    bench.write_json(_OUT_JSON.value, rows, kinds=kinds, wall_ms=wall_ms,
                     kernel_ms=kernel_ms, run=label, tokens_per_step=exp.tokens_per_step)


def _instruction_cells(kernel: str, instructions: dict) -> dict:
  """The HLO output type and JAX op of a trace's kernel key ("name [hlo_op]"), where the
  compiled module has an instruction of that name; blank otherwise (custom kernels)."""
  name = re.sub(r"[.\-]", "_", kernel.split(" ")[0])
  shape, opcode, op_name = instructions.get(name, ("", "", ""))
  return {"output": f"{shape} {opcode}".strip(), "op": op_name[-100:]}


def parse_flags(argv: list[str]) -> list[str]:
  """This program's flags (`experiments.cli.parse_flags`); absl's own keep their defaults."""
  rest = cli.parse_flags(argv, FLAGS)
  flags.FLAGS(rest[:1])
  return rest


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
