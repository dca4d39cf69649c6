"""Experiment configs (configs/*.py, lineax_attn.train.experiment): every comparison file at
every size resolves every arm into valid Model/Data/Optimizer configs; the paper size carries
docs/MATH.md §6 numbers; bad configs (unknown field, unknown arm, impossible mesh, a batch
that does not split over the mesh) fail before any compute with a message naming the culprit, in the
library and through the `experiments/train.py` command line. A command-line field wins over the
arm's; a WSD schedule longer than train.steps is scaled to fit (or, set on the command line,
fails naming the flags)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from configs import base
from configs import hybrids, mixers, optimizers, routing
from helpers import fast_cpu_xla, REPO_ROOT as ROOT, run_cpu_python
from lineax_attn import ops
from lineax_attn.models import abstract_model, count_params, get_config
from lineax_attn.models.config import MIXERS
from lineax_attn.train import experiment, optim

FILES = {"mixers": mixers, "hybrids": hybrids, "routing": routing, "optimizers": optimizers}
SIZES = ("tiny", "small", "paper")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", sorted(FILES))
def test_every_arm_resolves(name, size):
  config = FILES[name].get_config(size)
  arms = experiment.arm_names(config)
  assert len(arms) >= 2
  layer_sets = set()
  for arm in arms:
    exp = experiment.resolve(config, arm=arm, device_count=8, process_count=1)
    assert exp.arm == arm and exp.run_name == f"{name}_{size}/{arm}"
    assert exp.optim.total_steps == exp.train.steps
    assert exp.train_data.seq_len == exp.train.seq_len
    assert exp.eval_data is not None and exp.eval_data.split == "validation"
    layer_sets.add((exp.model.layer_types, exp.model.routing, exp.optim.name))
  assert len(layer_sets) == len(arms)  # the arms really differ


def test_arms_change_what_they_name():
  config = mixers.get_config("tiny")
  assert experiment.arm_names(config) == ["softmax", "deltanet", "gdn", "kda", "gdn2"]
  kinds = {arm: experiment.resolve(config, arm=arm, device_count=1, process_count=1
                                   ).model.layer_types for arm in experiment.arm_names(config)}
  assert kinds["kda"] == ("kda", "kda") and kinds["softmax"] == ("softmax", "softmax")
  # Hybrids follow the repo's rule (i + 1) mod N == 0 on the same depth.
  config = hybrids.get_config("tiny")
  stack = lambda arm: "".join(  # noqa: E731
      "S" if k == "softmax" else "L"
      for k in experiment.resolve(config, arm=arm, device_count=1, process_count=1
                                  ).model.layer_types)
  assert (stack("pure"), stack("hybrid_2to1"), stack("hybrid_3to1")) == (
      "LLLLLL", "LLSLLS", "LLLSLL")
  # The Muon arm carries the size's Muon learning rates.
  paper = optimizers.get_config("paper")
  muon = experiment.resolve(paper, arm="gdn_muon", device_count=8, process_count=1).optim
  assert (muon.name, muon.learning_rate, muon.adam_learning_rate) == ("muon", 3.6e-4, 1.5e-3)
  assert routing.get_config("paper").paper.gdn_clvr == pytest.approx(2.335839)


def test_paper_size_matches_spec():
  exp = experiment.resolve(routing.get_config("paper"), arm="gdn", device_count=8,
                           process_count=1)
  t, o, d = exp.train, exp.optim, exp.train_data
  assert (t.seq_len, t.global_batch_size, t.steps) == (4096, 128, 28_610)  # docs/MATH.md §6.4: 15B
  assert t.steps * t.global_batch_size * t.seq_len == pytest.approx(15.0e9, rel=1e-3)
  assert (o.warmup_steps, o.decay_fraction, o.decay_shape) == (200, 0.2, "minus_sqrt")
  assert (o.clip_norm, o.weight_decay, o.b1, o.b2) == (1.0, 0.1, 0.9, 0.95)
  assert (t.eval_every, t.eval_batches) == (500, 10)                      # docs/MATH.md §6.6
  assert not d.reset_at_document_boundaries and d.seed == 42
  adamw = experiment.resolve(mixers.get_config("paper"), arm="gdn", device_count=8,
                             process_count=1).optim
  assert (adamw.name, adamw.learning_rate, adamw.min_learning_rate) == ("adamw", 3e-4, 3e-5)
  # The GDN arm is the gdn_350m preset: its parameter count is the preset's (docs/MATH.md §4.5).
  preset = get_config("gdn_350m", dtype="bfloat16")
  assert exp.model.layer_types == preset.layer_types
  assert count_params(abstract_model(exp.model)) == count_params(abstract_model(preset))
  softmax = experiment.resolve(mixers.get_config("paper"), arm="softmax", device_count=8,
                               process_count=1).model
  assert softmax.layer_types == get_config("softmax_350m").layer_types
  assert softmax.mlp_dim == 2560 and not softmax.attention_output_gate


def test_small_size_is_20_to_60m_parameters():
  for arm in ("gdn", "softmax", "kda", "gdn2", "deltanet"):
    exp = experiment.resolve(mixers.get_config("small"), arm=arm, device_count=1,
                             process_count=1)
    n = count_params(abstract_model(exp.model))
    assert 20e6 <= n <= 60e6, (arm, n)


def _parse(argv, with_overrides=False):
  """Parses argv as experiments/train.py does (overrides are read from sys_argv); with
  `with_overrides` also the command line's fields, as train.py passes them to resolve."""
  values = flags.FlagValues()
  argv = ["prog"] + argv
  config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True,
                                  sys_argv=argv)
  values(argv)
  if with_overrides:
    return values.config, config_flags.get_override_values(values["config"])
  return values.config


def test_command_line_overrides_and_unknown_fields():
  path = os.path.join(ROOT, "configs", "mixers.py")
  config = _parse([f"--config={path}:tiny", "--config.model.num_v_heads=4",
                   "--config.train.steps=60", "--config.arm=kda", "--config.optim.name=muon"])
  exp = experiment.resolve(config, device_count=1, process_count=1)
  assert exp.model.mixer == "kda" and exp.model.v_heads == 4 and exp.train.steps == 60
  assert exp.optim.name == "muon"
  with pytest.raises(Exception, match="not_a_field"):
    _parse([f"--config={path}:tiny", "--config.model.not_a_field=1"])
  with pytest.raises(Exception, match="d_model"):
    _parse([f"--config={path}:tiny", "--config.model.d_model=wide"])


MIXERS_FILE = os.path.join(ROOT, "configs", "mixers.py")


def test_config_mixer_tuples_use_the_spec_vocabulary():
  # configs/ are data and cannot import the specs, so their MIXERS tuples are literal
  # selections (the comparison of configs/mixers.py leaves linear attention out on purpose);
  # every name must be a canonical layer name of `lineax_attn.ops.specs` (or softmax), never
  # an alias, so configs, tables and checkpoints speak one vocabulary.
  from configs import mqar  # pylint: disable=g-import-not-at-top
  from lineax_attn.ops import specs  # pylint: disable=g-import-not-at-top
  known = set(specs.layer_names()) | {"softmax"}
  assert set(MIXERS) == known
  for tuple_ in (mixers.MIXERS, mqar.MIXERS):
    assert len(set(tuple_)) == len(tuple_) and set(tuple_) <= known, tuple_
  assert set(mqar.MIXERS) >= set(mixers.MIXERS)


def test_command_line_field_wins_over_the_arm():
  config, command_line = _parse([f"--config={MIXERS_FILE}:tiny", "--config.arm=gdn",
                                 "--config.model.mixer=kda", "--config.model.chunk_size=16"],
                                with_overrides=True)
  exp = experiment.resolve(config, command_line=command_line, device_count=1, process_count=1)
  assert exp.model.layer_types == ("kda", "kda") and exp.model.chunk_size == 16
  assert exp.config.model.mixer == "kda"  # what config.json and the checkpoint record
  # That config resolves again as it is (inspect and eval_recall --checkpoint read it back).
  saved = ml_collections.ConfigDict(json.loads(json.dumps(exp.config.to_dict())))
  again = experiment.resolve(saved, device_count=1, process_count=1)
  assert (again.model, again.run_name, again.notes) == (exp.model, exp.run_name, ())
  assert exp.notes == ("--config.model.mixer='kda' replaces model.mixer='gdn' of arm 'gdn'",)
  # Without the command line (compare.py: one override for every arm) the arm's field wins.
  assert experiment.resolve(config, device_count=1, process_count=1).model.layer_types == (
      "gdn", "gdn")
  # A field the arm does not set: no note; the arm's other fields stay.
  config, command_line = _parse([f"--config={MIXERS_FILE}:paper", "--config.arm=deltanet",
                                 "--config.model.num_heads=8"], with_overrides=True)
  exp = experiment.resolve(config, command_line=command_line, device_count=8, process_count=1)
  assert exp.notes == () and exp.model.num_heads == 8 and exp.model.dv == 128


@pytest.mark.parametrize("field, value, match", [
    ("mixer", "kdaa", re.escape(f"model.mixer: unknown mixer 'kdaa'; expected one of {MIXERS}")),
    ("implementation", "fused", r"model\.implementation='fused' is not an implementation.*"
     r"\['chunk', 'pallas_gpu', 'pallas_tpu', 'scan', 'triton'\] or None"),
    ("attn_implementation", "flash", r"model\.attn_implementation='flash'.*\['reference', "
     r"'xla', 'cudnn'\] or None"),
])
def test_command_line_names_are_checked_over_the_arm(field, value, match):
  config, command_line = _parse([f"--config={MIXERS_FILE}:tiny", "--config.arm=gdn",
                                 f"--config.model.{field}={value}"], with_overrides=True)
  with pytest.raises(ValueError, match=match):
    experiment.resolve(config, command_line=command_line, device_count=1, process_count=1)


def test_implementation_none_on_the_command_line():
  assert set(ops.available_implementations()) == {"scan", "chunk", "pallas_tpu", "pallas_gpu", "triton"}
  for text in ("None", "none"):
    config, command_line = _parse([f"--config={MIXERS_FILE}:tiny", "--config.arm=gdn",
                                   f"--config.model.implementation={text}"], with_overrides=True)
    exp = experiment.resolve(config, command_line=command_line, device_count=1, process_count=1)
    assert exp.model.implementation is None


def test_schedule_scaled_to_fit_the_steps():
  config, command_line = _parse([f"--config={MIXERS_FILE}:tiny", "--config.arm=gdn",
                                 "--config.train.steps=30"], with_overrides=True)
  exp = experiment.resolve(config, command_line=command_line, device_count=1, process_count=1)
  # tiny: warmup 25 and decay 0.2 * 30 = 6 > 30: x 30/31 -> warmup 25*30//31 = 24, decay 6.
  assert (exp.optim.warmup_steps, exp.optim.decay_steps, exp.optim.total_steps) == (24, 6, 30)
  assert exp.notes == ("optim.warmup_steps=25 + 6 decay steps (optim.decay_fraction=0.2 of 30) "
                       "do not fit in train.steps=30: scaled both by 30/31 to warmup_steps=24, "
                       "decay_steps=6 (set --config.optim.warmup_steps and "
                       "--config.optim.decay_steps to choose)",)
  lr = optim.schedules(exp.optim)["lr"]
  peak, floor = exp.optim.learning_rate, exp.optim.min_learning_rate
  assert float(lr(12)) == pytest.approx(peak / 2) and float(lr(24)) == pytest.approx(peak)
  assert float(lr(30)) == pytest.approx(floor)
  # Steps that fit are left as they are (decay_steps stays the fraction's).
  exp = experiment.resolve(mixers.get_config("tiny"), arm="gdn", device_count=1,
                           process_count=1)
  assert (exp.optim.warmup_steps, exp.optim.decay_steps, exp.notes) == (25, None, ())
  # One step: warmup 25 -> 1, decay round(0.2) = 0.
  config.train.steps = 1
  exp = experiment.resolve(config, device_count=1, process_count=1)
  assert (exp.optim.warmup_steps, exp.optim.decay_steps) == (1, 0)


@pytest.mark.parametrize("flag", ["--config.optim.warmup_steps=25",
                                  "--config.optim.decay_steps=10"])
def test_schedule_set_on_the_command_line_must_fit(flag):
  config, command_line = _parse([f"--config={MIXERS_FILE}:tiny", "--config.train.steps=30",
                                 flag], with_overrides=True)
  with pytest.raises(ValueError, match=re.escape(
      f"came from the command line: set --config.optim.warmup_steps and "
      f"--config.optim.decay_steps (or --config.optim.decay_fraction) so that warmup + decay <= "
      f"train.steps")):
    experiment.resolve(config, command_line=command_line, device_count=1, process_count=1)


def _add_arm(config, name, overrides):
  config.arms[name] = overrides
  config.arm = name


@pytest.mark.parametrize("mutate, match", [
    (lambda c: setattr(c, "arm", "mamba"), r"Unknown arm 'mamba'.*arms: \["),
    (lambda c: _add_arm(c, "bad", {"model": {"moe_experts": 4}}),
     r"Unknown config field 'model.moe_experts'"),
    (lambda c: c.mesh.update(data=3), r"Impossible mesh \(data=3, fsdp=1, tensor=1\)"),
    (lambda c: c.mesh.update(data=-1, fsdp=-1), r"at most one may be -1"),
    (lambda c: c.train.update(global_batch_size=6), r"global_batch_size=6 does not split"),
    (lambda c: c.model.update(vocab_size=100), r"vocab_size=100 is smaller"),
    (lambda c: c.optim.update(warmup_steps=-1), r"warmup_steps \(-1\)"),  # too long: scaled
    (lambda c: c.data.update(format="parquet"), r"data.format='parquet'"),
    (lambda c: c.model.update(mixer="mamba"), r"unknown mixer 'mamba'"),
])
def test_bad_configs_fail_naming_the_field(mutate, match):
  config = mixers.get_config("tiny")
  with config.unlocked():
    mutate(config)
  with pytest.raises(ValueError, match=match):
    experiment.resolve(config, device_count=8, process_count=1)


def _train_cli(args, workdir, devices=1):
  return run_cpu_python(["-m", "experiments.train", f"--workdir={workdir}", *args],
                        xla_flags=fast_cpu_xla(devices), timeout=120)


@pytest.mark.parametrize("override, devices, match", [
    ("--config.model.n_layrs=4", 1, "'n_layrs' Did you mean \"n_layers\""),
    ("--config.mesh.tensor=2", 1, "Impossible mesh (data=-1, fsdp=1, tensor=2)"),
    # 8 devices, tensor=8: GDN's fused in-projection (width 260) does not split 8 ways.
    ("--config.mesh.tensor=8", 8, "['in_proj']['kernel'] of shape (64, 260): dimension 1"),
    # The arm (gdn) sets model.mixer; the command line's value is checked, not replaced.
    ("--config.model.mixer=kdaa", 1, "model.mixer: unknown mixer 'kdaa'; expected one of"),
    ("--config.model.implementation=fused", 1,
     "model.implementation='fused' is not an implementation of the linear mixers"),
])
def test_train_cli_fails_before_compute(tmp_path, override, devices, match):
  workdir = tmp_path / "run"
  proc = _train_cli(["--config=configs/mixers.py:tiny", "--config.arm=gdn", "--config.mesh.data=-1",
                     override], workdir, devices)
  assert proc.returncode != 0
  assert match in proc.stderr, proc.stderr[-2000:]
  assert not workdir.exists()  # nothing was written: it failed before any training set-up


def test_base_sizes_and_unknown_size():
  assert base.get_config("tiny").train.steps == 250
  with pytest.raises(ValueError, match="Unknown config size 'huge'"):
    base.get_config("huge")
  assert jax.device_count() == 8  # the conftest's fake devices; resolve() defaults to them
  exp = experiment.resolve(base.get_config("tiny"))
  assert exp.mesh_shape == (8, 1, 1)


def _fields(config: ml_collections.ConfigDict) -> dict:
  """section.field -> (value, the placeholder's type for a None value): what a config file and
  the command line see of each field."""
  out = {}
  for section in config.keys():
    if not isinstance(config[section], ml_collections.ConfigDict):
      out[section] = (config[section], None)
      continue
    for key in config[section].keys():
      value = config[section][key]
      kind = config[section].get_ref(key).get_type() if value is None else type(value)
      out[f"{section}.{key}"] = (value, kind)
  return out


def test_config_defaults_are_the_dataclass_defaults():
  # configs/base.py spells its defaults out as data; experiment.base_config() derives them from
  # the dataclasses (ModelConfig, DataConfig, OptimizerConfig, TrainSettings, MeshSettings).
  # A field added to, removed from or re-defaulted in a dataclass must be mirrored there.
  written, derived = _fields(base.defaults()), _fields(experiment.base_config())
  assert sorted(written) == sorted(derived)
  for name, (value, kind) in derived.items():
    assert written[name] == (value, kind), name
  assert "model.implementation" in derived and derived["model.num_v_heads"] == (None, int)


def test_configs_import_no_training_code():
  # Configs are data: importing every configs/*.py and building each of its sizes loads
  # neither the training stack nor any other part of lineax_attn, nor jax or flax.
  names = sorted(n[:-3] for n in os.listdir(os.path.join(ROOT, "configs"))
                 if n.endswith(".py") and n != "__init__.py")
  assert {"base", "mixers", "mqar"} <= set(names)
  script = (
      "import importlib, sys\n"
      "import configs.base\n"
      f"for name in {names!r}:\n"
      "  module = importlib.import_module('configs.' + name)\n"
      "  for size in getattr(module, 'SIZES', None) or sys.modules['configs.base'].SIZES:\n"
      "    module.get_config(size)\n"
      "print(sorted({'.'.join(m.split('.')[:2]) for m in sys.modules if m.split('.')[0] in"
      " ('lineax_attn', 'jax', 'flax', 'pallas_kernels', 'experiments')}))\n")
  proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                        timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == "[]", proc.stdout
