"""Experiment configs: the `ml_collections.ConfigDict` layout, comparison arms, and validation.

A config (see `configs/base.py`) has five sections and up to four top-level fields:

* `model`: every `ModelConfig` field (`vocab_size=None`: the tokenizer's, padded to 128).
* `data`: the `DataConfig` fields less `seq_len` and `global_batch_size` (they live in `train`),
  plus `path` (if set, replaces `source`) and `validation_path`; built into two `DataConfig`s
  (training, and validation: the embedded corpus's validation split, or `validation_path`).
* `optim`: the `OptimizerConfig` fields less `total_steps` (= `train.steps`).
* `train`: `TrainSettings` (steps, batch, length, micro-batches, intervals, seed, keep).
* `mesh`: `MeshSettings`, the `data`, `fsdp`, `tensor` sizes (one may be -1: fill) and the
  `sequence` (context parallel) size, 1 by default (docs/CONTEXT_PARALLEL.md).

`name` names the comparison, `paper` (optional) maps arms to the paper's reported validation
loss for compare.py's table, `arms` maps an arm name to overrides (a nested dict of the same
sections, e.g. `{"model": {"mixer": "kda"}}`), and `arm` picks one of them ("" = the base
config as it is). `resolve(config)` applies the arm, builds and validates every dataclass and the
mesh against the device count, and returns an `Experiment`; every error (an unknown field, an
unknown arm, an impossible mesh, a batch that does not split over the mesh, a vocabulary smaller
than the tokenizer's) is a ValueError that names the field, raised before any compute.

Locked ConfigDicts make `--config.model.not_a_field=1` fail at flag parsing with the key's name.
Optional fields (default None) are typed placeholders, so `--config.model.num_v_heads=8` parses;
an optional string field of the model set to "None" (`--config.model.implementation=None`) is
None.

Precedence: the config file, then the arm's overrides, then the command line. ml_collections
applies `--config.*` flags to the config before the arm is known, so `resolve(config,
command_line=...)` takes the flags' values (`config_flags.get_override_values(FLAGS["config"])`)
and sets them again over the arm's: `--config.arm=gdn --config.model.mixer=kda` trains KDA (with
a note that the command line replaced the arm's value). Without `command_line` (compare.py runs
every arm) an arm's own fields win.

The WSD schedule must fit in `train.steps`: warmup_steps + decay steps (`optim.decay_steps`, or
round(decay_fraction * train.steps)) <= train.steps. When it does not (a 30-step trial run of a
config made for 250 steps), both are scaled down by the same factor to fill train.steps, keeping
their ratio: warmup' = warmup * steps // (warmup + decay), decay' = steps - warmup' (tiny's 25 +
6 in 30 steps: 24 + 6), and `Experiment.notes` says so; when either was set on the command line,
it is an error that names the flags to set instead.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict

from lineax_attn.data import pipeline as pipeline_lib
from lineax_attn.data import synthetic as synthetic_lib
from lineax_attn.data import tokenizers as tokenizers_lib
from lineax_attn.models.config import ModelConfig, canonical_mixer
from lineax_attn.ops import api as ops_api
from lineax_attn.ops import attention as attention_ops
from lineax_attn.train import optim as optim_lib
from lineax_attn.train import sharding as sharding_lib

SECTIONS = ("model", "data", "optim", "train", "mesh")
# name: the comparison; arm / arms: see below; paper: arm -> the paper's final validation loss
# (compare.py's "paper" column; only comparisons at the paper's size set it).
TOP_LEVEL = ("name", "arm", "arms", "paper")
# Fields set from another section, so that each number lives in one place.
DATA_FROM_TRAIN = ("seq_len", "global_batch_size")
OPTIM_FROM_TRAIN = ("total_steps",)
DATA_EXTRA = {"path": "", "validation_path": ""}


@dataclasses.dataclass(frozen=True)
class TrainSettings:
  """The loop's own settings (the `train` section)."""

  steps: int = 200
  global_batch_size: int = 8          # rows per step over all processes
  seq_len: int = 128
  grad_accum_steps: int = 1           # micro-batches per step (gradients summed in a scan)
  log_every: int = 10                 # progress line, JSONL and TensorBoard interval
  eval_every: int = 50                # validation interval (0: only at the end)
  eval_batches: int = 2               # a fixed set of validation batches (0: no validation)
  checkpoint_every: int = 100         # save interval (0: only at the end); also at the end
  keep_checkpoints: int = 2
  seed: int = 0                       # parameter init (the data order has data.seed)
  async_checkpoint: bool = True

  def __post_init__(self):
    for name in ("steps", "global_batch_size", "seq_len", "grad_accum_steps", "log_every",
                 "keep_checkpoints"):
      if getattr(self, name) < 1:
        raise ValueError(f"train.{name}={getattr(self, name)} must be >= 1")
    for name in ("eval_every", "eval_batches", "checkpoint_every"):
      if getattr(self, name) < 0:
        raise ValueError(f"train.{name}={getattr(self, name)} must be >= 0")


@dataclasses.dataclass(frozen=True)
class MeshSettings:
  """Mesh axis sizes (the `mesh` section); one may be -1 (all remaining devices)."""

  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  sequence: int = 1                   # context parallel: the time axis split over this many


@dataclasses.dataclass(frozen=True)
class Experiment:
  """A resolved, validated config: everything the loop needs, and the config it came from."""

  name: str
  arm: str
  model: ModelConfig
  train_data: pipeline_lib.DataConfig
  eval_data: pipeline_lib.DataConfig | None
  optim: optim_lib.OptimizerConfig
  train: TrainSettings
  mesh: MeshSettings
  mesh_shape: tuple[int, int, int]
  config: ml_collections.ConfigDict   # the base config with the arm applied, arms removed
  # One-line notes on values resolve() derived or replaced (a scaled schedule, an arm's field
  # replaced by the command line); the training loop prints them.
  notes: tuple[str, ...] = ()

  @property
  def tokens_per_step(self) -> int:
    return self.train.global_batch_size * self.train.seq_len

  @property
  def run_name(self) -> str:
    return f"{self.name}/{self.arm}" if self.arm else self.name


# ----------------------------------------------------------------------------- building


_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def _field_type(field: dataclasses.Field) -> type:
  """The scalar type of a field, from its (string) annotation: "int | None" -> int."""
  annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
  for part in annotation.replace(" ", "").split("|"):
    if part in _TYPES:
      return _TYPES[part]
  default = field.default
  return type(default) if default is not None else str


def dataclass_section(cls, *, exclude=(), **overrides) -> ml_collections.ConfigDict:
  """A ConfigDict of a dataclass's fields with its defaults; None defaults become typed
  placeholders (so the command line can set them)."""
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(overrides) - known)
  if unknown:
    raise ValueError(f"Unknown {cls.__name__} field(s) {unknown}")
  section = ml_collections.ConfigDict()
  for field in dataclasses.fields(cls):
    if field.name in exclude:
      continue
    value = overrides.get(field.name, field.default)
    if value is dataclasses.MISSING:
      raise ValueError(f"{cls.__name__}.{field.name} has no default")
    if isinstance(value, list):
      value = tuple(value)
    if value is None:
      value = config_dict.placeholder(_field_type(field))
    setattr(section, field.name, value)
  return section


def base_config() -> ml_collections.ConfigDict:
  """The defaults of every section (a tiny CPU run on the embedded corpus); unlocked.

  Derived from the dataclasses. Config files do not call it (configs are data and import no
  training code): `configs/base.py` spells the same defaults out, and tests/test_configs.py
  checks that the two agree field by field.
  """
  config = ml_collections.ConfigDict()
  config.name = "base"
  config.arm = ""
  config.model = dataclass_section(ModelConfig, vocab_size=None)
  config.data = dataclass_section(pipeline_lib.DataConfig, exclude=DATA_FROM_TRAIN)
  for key, value in DATA_EXTRA.items():
    setattr(config.data, key, value)
  config.optim = dataclass_section(optim_lib.OptimizerConfig, exclude=OPTIM_FROM_TRAIN)
  config.train = dataclass_section(TrainSettings)
  config.mesh = dataclass_section(MeshSettings)
  config.arms = ml_collections.ConfigDict()
  return config


# ----------------------------------------------------------------------------- arms


def _apply_overrides(target: ml_collections.ConfigDict, overrides: Mapping[str, Any],
                     where: str) -> None:
  for key, value in overrides.items():
    path = f"{where}.{key}" if where else key
    if key not in target:
      known = sorted(target.keys())
      raise ValueError(f"Unknown config field {path!r} (known fields under "
                       f"{where or 'the top level'}: {known})")
    current = target[key]
    if isinstance(current, ml_collections.ConfigDict):
      if not isinstance(value, Mapping):
        raise ValueError(f"Config field {path!r} is a section; got {value!r}")
      _apply_overrides(current, value, path)
    else:
      try:
        target[key] = tuple(value) if isinstance(value, list) else value
      except TypeError as e:
        raise ValueError(f"Config field {path!r}: {e}") from e


def arm_names(config: ml_collections.ConfigDict) -> list[str]:
  return list(config.arms.to_dict()) if "arms" in config else []


def apply_arm(config: ml_collections.ConfigDict, arm: str | None = None
              ) -> ml_collections.ConfigDict:
  """A copy of config with arm's overrides applied (arm None: `config.arm`), arms removed.

  A config without `arms` whose `arm` is the arm asked for is one applied already (a run's
  `Experiment.config`, its config.json): it is returned as it is.
  Raises a ValueError naming an unknown arm or an unknown field of the arm's overrides.
  """
  arm = config.get("arm", "") if arm is None else arm
  arms = config.arms.to_dict() if "arms" in config else {}
  if arm and "arms" not in config and arm == config.get("arm", ""):
    out = copy.deepcopy(config)
    out.lock()
    return out
  out = copy.deepcopy(config)
  out.unlock()
  for key in ("arms", "paper"):
    if key in out:
      del out[key]
  out.arm = arm or ""
  if arm:
    if arm not in arms:
      raise ValueError(f"Unknown arm {arm!r} of config {config.get('name', '')!r}; "
                       f"arms: {sorted(arms)}")
    if "arm" in arms[arm] or "arms" in arms[arm]:
      raise ValueError(f"Arm {arm!r} may not set 'arm' or 'arms'")
    _apply_overrides(out, arms[arm], "")
  out.lock()
  return out


# ----------------------------------------------------------------------------- command line


def _apply_command_line(resolved: ml_collections.ConfigDict, command_line: Mapping[str, Any],
                        arm: str) -> list[str]:
  """Sets the command line's fields again over the arm's (in place); notes on the ones the arm
  had changed. `command_line`: dotted path -> value, as ml_collections parsed it."""
  notes = []
  for path, value in command_line.items():
    keys = path.split(".")
    if keys[0] in ("arm", "arms", "paper"):
      continue  # the arm's name, or fields of the arms: already in the config
    target = resolved
    for depth, key in enumerate(keys):
      if not isinstance(target, ml_collections.ConfigDict) or key not in target:
        raise ValueError(f"Unknown config field {path!r} on the command line (no "
                         f"{'.'.join(keys[:depth + 1])!r})")
      if depth < len(keys) - 1:
        target = target[key]
    value = tuple(value) if isinstance(value, list) else value
    current = target[keys[-1]]
    if current != value:
      notes.append(f"--config.{path}={value!r} replaces {path}={current!r} of arm {arm!r}")
      target[keys[-1]] = value
  return notes


def _fit_schedule(optim: optim_lib.OptimizerConfig, explicit: set[str]
                  ) -> tuple[optim_lib.OptimizerConfig, list[str]]:
  """The optimiser config with a WSD schedule that fits in total_steps (module docstring)."""
  total, warmup = optim.total_steps, optim.warmup_steps
  decay = (optim.decay_steps if optim.decay_steps is not None
           else int(round(optim.decay_fraction * total)))
  if warmup < 0 or decay < 0 or warmup + decay <= total:
    return optim, []  # fits (negative values: wsd_schedule's error names them)
  decay_source = (f"optim.decay_steps={decay}" if optim.decay_steps is not None else
                  f"{decay} decay steps (optim.decay_fraction={optim.decay_fraction:g} of "
                  f"{total})")
  flags_set = sorted(explicit & {"optim.warmup_steps", "optim.decay_steps",
                                 "optim.decay_fraction"})
  if flags_set:
    raise ValueError(
        f"optim.warmup_steps={warmup} + {decay_source} exceed train.steps={total} and "
        f"{', '.join('--config.' + f for f in flags_set)} came from the command line: set "
        f"--config.optim.warmup_steps and --config.optim.decay_steps (or "
        f"--config.optim.decay_fraction) so that warmup + decay <= train.steps")
  new_warmup = warmup * total // (warmup + decay)
  new_decay = total - new_warmup
  note = (f"optim.warmup_steps={warmup} + {decay_source} do not fit in train.steps={total}: "
          f"scaled both by {total}/{warmup + decay} to warmup_steps={new_warmup}, "
          f"decay_steps={new_decay} (set --config.optim.warmup_steps and "
          f"--config.optim.decay_steps to choose)")
  return dataclasses.replace(optim, warmup_steps=new_warmup, decay_steps=new_decay), [note]


def _check_model_names(model_values: dict[str, Any]) -> None:
  """The model's named choices, checked here so that a typo fails before the workdir exists
  (the layers would only reject an implementation at the first forward pass)."""
  try:
    canonical_mixer(model_values.get("mixer"))
  except ValueError as e:
    raise ValueError(f"model.mixer: {e}") from e
  implementation = model_values.get("implementation")
  if implementation is not None and implementation not in ops_api.available_implementations():
    raise ValueError(f"model.implementation={implementation!r} is not an implementation of the "
                     f"linear mixers; expected one of "
                     f"{sorted(ops_api.available_implementations())} or None (the best for the "
                     f"backend; on the command line --config.model.implementation=None)")
  attn = model_values.get("attn_implementation")
  if attn is not None and attn not in attention_ops.IMPLEMENTATIONS:
    raise ValueError(f"model.attn_implementation={attn!r} is not a softmax attention "
                     f"implementation; expected one of {list(attention_ops.IMPLEMENTATIONS)} "
                     f"or None (the best for the backend)")


def _none_strings(model_values: dict[str, Any]) -> dict[str, Any]:
  """Optional string fields given as "None" (the command line's only way to write None)."""
  optional = {f.name for f in dataclasses.fields(ModelConfig) if f.default is None}
  return {k: None if k in optional and isinstance(v, str) and v.strip().lower() == "none" else v
          for k, v in model_values.items()}


# ----------------------------------------------------------------------------- resolving


def _section_dict(config, name: str) -> dict[str, Any]:
  if name not in config:
    raise ValueError(f"The config has no {name!r} section (sections: {SECTIONS})")
  return config[name].to_dict()


def _data_configs(config, train: TrainSettings):
  data = _section_dict(config, "data")
  path, validation_path = data.pop("path", ""), data.pop("validation_path", "")
  for name in DATA_FROM_TRAIN:
    if name in data:
      raise ValueError(f"data.{name} is set by train.{name}; remove it from the data section")
  data.update(seq_len=train.seq_len, global_batch_size=train.global_batch_size)
  if path:
    data["source"] = path
  train_data = pipeline_lib.DataConfig.from_mapping(data)
  eval_data = None
  if train.eval_batches > 0:
    if validation_path:
      eval_data = dataclasses.replace(train_data, source=validation_path)
    elif train_data.source == "embedded" or synthetic_lib.is_mqar_source(train_data.source):
      eval_data = dataclasses.replace(train_data, split="validation")
    else:
      raise ValueError("train.eval_batches > 0 needs data.validation_path for a corpus given by "
                       "path (or set train.eval_batches=0)")
  if eval_data is not None:
    # Validation batches are a fixed, unshuffled-window sample; a different seed from training;
    # the corpus alone (no needle documents), so validation losses compare across data mixes.
    eval_data = dataclasses.replace(eval_data, shuffle_window=0, seed=eval_data.seed + 1,
                                    niah_mix=0.0)
  return train_data, eval_data


def resolve(config: ml_collections.ConfigDict, *, arm: str | None = None,
            device_count: int | None = None, process_count: int | None = None,
            command_line: Mapping[str, Any] | None = None) -> Experiment:
  """Applies the arm and validates everything (ValueError naming the field) without compute.

  Args:
    config: a config of `base_config()`'s layout.
    arm: the arm to apply (None: `config.arm`).
    device_count, process_count: for the mesh checks (default: jax's).
    command_line: the `--config.*` fields given on the command line (dotted path -> value,
      `config_flags.get_override_values(FLAGS["config"])`): they win over the arm's values,
      and a schedule that does not fit is an error rather than scaled when they set it (see
      the module docstring). None: an arm's fields win.
  """
  extra = sorted(set(config.keys()) - set(SECTIONS) - set(TOP_LEVEL))
  if extra:
    raise ValueError(f"Unknown top-level config field(s) {extra}; expected {SECTIONS} and "
                     f"{TOP_LEVEL}")
  resolved = apply_arm(config, arm)
  command_line = dict(command_line or {})
  notes = []
  if command_line:
    with resolved.unlocked():
      notes += _apply_command_line(resolved, command_line, str(resolved.arm))

  train_values = _section_dict(resolved, "train")
  try:
    train = TrainSettings(**train_values)
  except TypeError as e:
    raise ValueError(f"train section: {e}") from e
  mesh_values = _section_dict(resolved, "mesh")
  unknown = sorted(set(mesh_values) - {"data", "fsdp", "tensor", "sequence"})
  if unknown:
    raise ValueError(f"Unknown mesh field(s) {unknown}; expected data, fsdp, tensor, sequence")
  mesh = MeshSettings(**mesh_values)

  optim_values = _section_dict(resolved, "optim")
  if "total_steps" in optim_values:
    raise ValueError("optim.total_steps is set by train.steps; remove it from the optim section")
  optim = optim_lib.OptimizerConfig.from_mapping(optim_values, total_steps=train.steps)
  optim, schedule_notes = _fit_schedule(optim, set(command_line))
  notes += schedule_notes
  optim_lib.schedules(optim)  # the rest of the WSD arithmetic (negative steps) fails here

  train_data, eval_data = _data_configs(resolved, train)
  tokenizer = tokenizers_lib.get_tokenizer(train_data.tokenizer)

  model_values = _none_strings(_section_dict(resolved, "model"))
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(model_values) - known)
  if unknown:
    raise ValueError(f"Unknown model config field(s) {unknown}")
  _check_model_names(model_values)
  data_vocab = tokenizer.vocab_size
  if synthetic_lib.is_mqar_source(train_data.source):  # MQAR tokens are its own vocabulary
    data_vocab = synthetic_lib.mqar_config_from_source(train_data.source, train.seq_len).vocab
  if model_values.get("vocab_size") is None:
    model_values["vocab_size"] = tokenizers_lib.padded_vocab_size(data_vocab)
  if model_values["vocab_size"] < data_vocab:
    raise ValueError(f"model.vocab_size={model_values['vocab_size']} is smaller than the "
                     f"data's vocabulary ({data_vocab}: tokenizer {train_data.tokenizer!r}, "
                     f"source {train_data.source!r})")
  model = ModelConfig(**model_values)

  if device_count is None or process_count is None:
    import jax  # pylint: disable=g-import-not-at-top
    device_count = jax.device_count() if device_count is None else device_count
    process_count = jax.process_count() if process_count is None else process_count
  shape = sharding_lib.resolve_mesh_shape(mesh.data, mesh.fsdp, mesh.tensor, device_count,
                                          sequence=mesh.sequence)
  if train.seq_len % mesh.sequence:
    raise ValueError(f"train.seq_len={train.seq_len} must be a multiple of mesh.sequence="
                     f"{mesh.sequence} (context parallel: each device takes an equal slice of "
                     f"the time axis)")
  batch_shards = shape[0] * shape[1]
  rows = train.global_batch_size // train.grad_accum_steps
  if train.global_batch_size % train.grad_accum_steps or rows % batch_shards:
    raise ValueError(f"train.global_batch_size={train.global_batch_size} does not split over "
                     f"train.grad_accum_steps={train.grad_accum_steps} micro-batches and the "
                     f"batch axes of mesh (data={shape[0]}, fsdp={shape[1]}, tensor={shape[2]}): "
                     f"it must be a multiple of grad_accum_steps*data*fsdp = "
                     f"{train.grad_accum_steps * batch_shards}")
  if train.global_batch_size % process_count:
    raise ValueError(f"train.global_batch_size={train.global_batch_size} is not a multiple of "
                     f"the number of processes ({process_count})")
  if batch_shards % process_count and process_count % batch_shards:
    raise ValueError(f"mesh data*fsdp = {batch_shards} and {process_count} processes: one must "
                     f"divide the other to give each process whole batch shards")

  return Experiment(name=str(resolved.get("name", "")), arm=str(resolved.arm), model=model,
                    train_data=train_data, eval_data=eval_data, optim=optim, train=train,
                    mesh=mesh, mesh_shape=shape, config=resolved, notes=tuple(notes))


def describe(experiment: Experiment) -> str:
  """One line: the model stack, sizes, optimiser, steps and mesh."""
  m = experiment.model
  kinds = ",".join(sorted(set(m.layer_types)))
  stack = "".join("S" if k == "softmax" else "L" for k in m.layer_types)
  return (f"{experiment.run_name}: {kinds} [{stack}] d={m.d_model} L={m.n_layers}"
          f"{' routing=' + m.routing if m.routing else ''}, {experiment.optim.name} "
          f"lr={experiment.optim.learning_rate:g}, {experiment.train.steps} steps x "
          f"{experiment.train.global_batch_size}x{experiment.train.seq_len} tokens, mesh "
          f"{_mesh_desc(experiment)}, "
          f"{math.prod(experiment.mesh_shape) * experiment.mesh.sequence} devices")


def _mesh_desc(experiment: Experiment) -> dict[str, int]:
  sizes = dict(zip(sharding_lib.MESH_AXES, experiment.mesh_shape))
  if experiment.mesh.sequence > 1:
    sizes["sequence"] = experiment.mesh.sequence
  return sizes


__all__ = ["TrainSettings", "MeshSettings", "Experiment", "base_config", "dataclass_section",
           "apply_arm", "arm_names", "resolve", "describe"]
