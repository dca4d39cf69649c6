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
Optional fields (default None) are typed placeholders, so `--config.model.num_v_heads=8` parses.
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
from lineax_attn.models.config import ModelConfig
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
  """The defaults of every section (a tiny CPU run on the embedded corpus); unlocked."""
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

  Raises a ValueError naming an unknown arm or an unknown field of the arm's overrides.
  """
  arm = config.get("arm", "") if arm is None else arm
  arms = config.arms.to_dict() if "arms" in config else {}
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
    # Validation batches are a fixed, unshuffled-window sample; a different seed from training.
    eval_data = dataclasses.replace(eval_data, shuffle_window=0, seed=eval_data.seed + 1)
  return train_data, eval_data


def resolve(config: ml_collections.ConfigDict, *, arm: str | None = None,
            device_count: int | None = None, process_count: int | None = None) -> Experiment:
  """Applies the arm and validates everything (ValueError naming the field) without compute.

  Args:
    config: a config of `base_config()`'s layout.
    arm: the arm to apply (None: `config.arm`).
    device_count, process_count: for the mesh checks (default: jax's).
  """
  extra = sorted(set(config.keys()) - set(SECTIONS) - set(TOP_LEVEL))
  if extra:
    raise ValueError(f"Unknown top-level config field(s) {extra}; expected {SECTIONS} and "
                     f"{TOP_LEVEL}")
  resolved = apply_arm(config, arm)

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
  optim_lib.schedules(optim)  # the WSD arithmetic (warmup + decay <= steps) fails here

  train_data, eval_data = _data_configs(resolved, train)
  tokenizer = tokenizers_lib.get_tokenizer(train_data.tokenizer)

  model_values = _section_dict(resolved, "model")
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(model_values) - known)
  if unknown:
    raise ValueError(f"Unknown model config field(s) {unknown}")
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
                    mesh=mesh, mesh_shape=shape, config=resolved)


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


def parse_flags(argv: list[str]) -> list[str]:
  """absl `flags_parser` for `app.run`: a bad `--config.*` override (unknown field, wrong type)
  exits with one line naming it instead of a traceback."""
  import sys  # pylint: disable=g-import-not-at-top

  from absl import flags  # pylint: disable=g-import-not-at-top

  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError, TypeError, ValueError, flags.Error) as e:
    message = str(e).strip().strip("'\"").replace("\\n", " ").replace("\\'", "'")
    print(f"error: invalid command line: {message}", file=sys.stderr)
    sys.exit(2)
