"""Optimisers (AdamW, Muon + AdamW) and the WSD learning-rate schedule (docs/MATH.md §6.5).

Parameter groups (`param_group`), decided from each leaf's path in the parameter tree (the
path's keys joined by "/", lower-cased) and its ndim:

* "embed": the path contains "embed" (token embeddings).
* "head": the path contains "lm_head" (the untied output projection).
* "vector": ndim < 2 (biases, norm scales), and the gate constants A_log, dt_bias and the
  routing γ whatever their rank: KDA's and GDN-2's per-channel dt_bias [HV, K] and a per-channel
  γ are 2-D, yet no weight decay or Muon orthogonalisation belongs on a decay-rate bias (FLA
  marks these `_no_weight_decay`; decaying dt_bias towards 0 shortens the memory).
* "conv": the path contains "conv" (short depthwise convolution kernels: not matmuls).
* "matrix": everything else (ndim >= 2: the projections of the mixers and the MLP).

A scanned model's stacked blocks (the "layer_stack" subtree, `ModelConfig.scan_layers`) carry
a leading layers axis: groups and Muon's matrix axes are decided on the per-layer shape (the
leading axis is a batch axis of the orthogonalisation), so the optimiser does to each layer
what it does in the unrolled model.

`make_optimizer(config)`, an optax `GradientTransformation` = global-norm clipping (`clip_norm`)
followed by:

* **"adamw"**: AdamW(β1 0.9, β2 0.95, eps 1e-8), one LR schedule for all parameters, decoupled
  weight decay `weight_decay` (0.1) on "matrix", "head" and "conv" (ndim >= 2), none on
  "vector" and "embed".
* **"muon"**: `optax.contrib.muon` on "matrix" (Nesterov momentum 0.95, 5 Newton-Schulz steps,
  weight decay `weight_decay` on these matrices, LR `learning_rate` = 3.6e-4 peak), and plain
  Adam (β 0.9/0.95, eps 1e-8, no weight decay, no Nesterov) with its own LR
  `adam_learning_rate` (1.5e-3 peak) for "embed", "head", "vector" and "conv". Both LRs follow
  the same WSD shape; the Adam group's floor is `adam_learning_rate * min_learning_rate /
  learning_rate` unless `adam_min_learning_rate` is set.
  The update scale follows NVIDIA Emerging-Optimizers' default "spectral" mode: the orthogonalised
  update is multiplied by sqrt(max(fan_in, fan_out)) (optax `consistent_rms=1.0`), so its RMS is
  about 1 and the LR is comparable with AdamW's. `muon_scale="shape"` gives optax's default
  sqrt(max(1, fan_out/fan_in)).
  Muon's matrix layout: a 2-D kernel is [in, out] (flax's Linear); an ndim > 2 kernel is taken as
  [in, out_1, out_2, ...] (reduction axis 0, every other axis an output axis). A model with
  another layout passes `muon_dimension_numbers`.

Differences from the paper's Muon (NVIDIA Emerging-Optimizers `adaptive_muon`): NorMuon's
second-moment normalisation is not ported; Newton-Schulz uses optax's coefficients
(3.4445, -4.7750, 2.0315).

`wsd_schedule`: linear warmup 0 -> peak over `warmup_steps`, constant peak, then a decay to
`min_lr` over the last `decay_steps` (default `round(decay_fraction * total_steps)`):
lr = min + (peak - min) * f(x), x = fraction of the decay elapsed, f = 1 - sqrt(x)
("minus_sqrt", Megatron's WSD shape), 1 - x ("linear") or (1 + cos(pi x)) / 2 ("cosine").
lr = min_lr from `total_steps` on.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from lineax_attn.models.lm import LAYER_STACK

DECAY_SHAPES = ("minus_sqrt", "linear", "cosine")
OPTIMIZERS = ("adamw", "muon")
GROUPS = ("matrix", "conv", "head", "embed", "vector")
# Leaf names of the gate parameters that are constants of the recurrence, not projections.
GATE_CONSTANTS = ("A_log", "dt_bias", "gamma")


def wsd_schedule(
    peak: float,
    min_lr: float,
    total_steps: int,
    warmup_steps: int,
    decay_fraction: float = 0.2,
    decay: str = "minus_sqrt",
    decay_steps: int | None = None,
) -> optax.Schedule:
  """Warmup-stable-decay schedule (see the module docstring); a function of the step count."""
  if decay not in DECAY_SHAPES:
    raise ValueError(f"decay={decay!r}; expected one of {DECAY_SHAPES}")
  if decay_steps is None:
    decay_steps = int(round(decay_fraction * total_steps))
  if not 0 <= warmup_steps <= total_steps - decay_steps or decay_steps < 0:
    raise ValueError(f"WSD needs 0 <= warmup_steps ({warmup_steps}) <= total_steps ({total_steps})"
                     f" - decay_steps ({decay_steps})")
  decay_start = total_steps - decay_steps

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warm = peak * step / max(warmup_steps, 1)
    x = jnp.clip((step - decay_start) / max(decay_steps, 1), 0.0, 1.0)
    if decay == "minus_sqrt":
      f = 1.0 - jnp.sqrt(x)
    elif decay == "linear":
      f = 1.0 - x
    else:
      f = 0.5 * (1.0 + jnp.cos(math.pi * x))
    decayed = min_lr + (peak - min_lr) * f
    lr = jnp.where(step < warmup_steps, warm, jnp.where(step < decay_start, peak, decayed))
    return jnp.where(step >= total_steps, min_lr, lr)

  return schedule


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Optimiser and schedule settings; defaults are docs/MATH.md §6.5's (350M runs, 28,610 steps)."""

  name: str = "adamw"                     # "adamw" or "muon"
  learning_rate: float = 3e-4             # peak: AdamW's, or Muon's matrix LR (paper: 3.6e-4)
  min_learning_rate: float = 3e-5
  warmup_steps: int = 200
  total_steps: int = 28_610
  decay_fraction: float = 0.2
  decay_steps: int | None = None          # overrides decay_fraction
  decay_shape: str = "minus_sqrt"
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  clip_norm: float | None = 1.0           # global-norm clipping; None: off
  # Muon only.
  muon_momentum: float = 0.95
  muon_nesterov: bool = True
  muon_ns_steps: int = 5
  muon_scale: str = "spectral"            # "spectral" (sqrt(max(in, out))) or "shape"
  adam_learning_rate: float = 1.5e-3      # peak LR of the non-Muon group
  adam_min_learning_rate: float | None = None

  @classmethod
  def from_mapping(cls, values: Mapping[str, Any] | None = None, **overrides) -> "OptimizerConfig":
    """From a dict / ConfigDict; an unknown field raises a ValueError naming it."""
    values = dict(values or {}, **overrides)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ValueError(f"Unknown optimizer config field(s) {unknown}; known fields: {sorted(known)}")
    return cls(**values)

  def __post_init__(self):
    if self.name not in OPTIMIZERS:
      raise ValueError(f"optimizer.name={self.name!r}; expected one of {OPTIMIZERS}")
    if self.decay_shape not in DECAY_SHAPES:
      raise ValueError(f"optimizer.decay_shape={self.decay_shape!r}; expected one of {DECAY_SHAPES}")
    if self.muon_scale not in ("spectral", "shape"):
      raise ValueError(f"optimizer.muon_scale={self.muon_scale!r}; expected 'spectral' or 'shape'")


def path_name(path) -> str:
  """A tree path as "a/b/0/kernel" (dict keys, attribute names and sequence indices)."""
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)


def is_stacked(path) -> bool:
  """Whether a parameter's path is in a scanned model's stacked blocks (a leading layers axis)."""
  return path_name(path).split("/", 1)[0] == LAYER_STACK


def _layer_ndim(path, leaf) -> int:
  return jnp.ndim(leaf) - (1 if is_stacked(path) else 0)


def param_group(path, leaf) -> str:
  """The group of one parameter (see the module docstring)."""
  name = path_name(path).lower()
  if "embed" in name:
    return "embed"
  if "lm_head" in name:
    return "head"
  if _layer_ndim(path, leaf) < 2 or path_name(path).rsplit("/", 1)[-1] in GATE_CONSTANTS:
    return "vector"
  if "conv" in name:
    return "conv"
  return "matrix"


def param_groups(params) -> Any:
  """A tree like params whose leaves are group names."""
  return jax.tree_util.tree_map_with_path(param_group, params)


def schedules(config: OptimizerConfig) -> dict[str, optax.Schedule]:
  """The LR schedules by name: "lr" (AdamW / Muon matrices) and, for Muon, "adam_lr"."""
  def wsd(peak, floor):
    return wsd_schedule(peak, floor, config.total_steps, config.warmup_steps,
                        config.decay_fraction, config.decay_shape, config.decay_steps)

  out = {"lr": wsd(config.learning_rate, config.min_learning_rate)}
  if config.name == "muon":
    floor = config.adam_min_learning_rate
    if floor is None:
      floor = config.adam_learning_rate * config.min_learning_rate / config.learning_rate
    out["adam_lr"] = wsd(config.adam_learning_rate, floor)
  return out


def _shift_dims(dims, by: int) -> optax.contrib.MuonDimensionNumbers:
  shift = lambda axes: (axes + by if isinstance(axes, int)  # noqa: E731
                        else tuple(a + by for a in axes))
  return optax.contrib.MuonDimensionNumbers(reduction_axis=shift(dims.reduction_axis),
                                            output_axis=shift(dims.output_axis))


def _default_muon_dims(leaf) -> optax.contrib.MuonDimensionNumbers:
  ndim = jnp.ndim(leaf)
  if ndim == 2:
    return optax.contrib.MuonDimensionNumbers(reduction_axis=0, output_axis=1)
  return optax.contrib.MuonDimensionNumbers(reduction_axis=0, output_axis=tuple(range(1, ndim)))


def make_optimizer(
    config: OptimizerConfig | Mapping[str, Any],
    *,
    muon_dimension_numbers: Callable[[Any], Any] | None = None,
) -> optax.GradientTransformation:
  """The optimiser of the module docstring.

  Args:
    config: an OptimizerConfig or a mapping of its fields.
    muon_dimension_numbers: optional, leaf -> optax.contrib.MuonDimensionNumbers for the Muon
      group's leaves (default: [in, out] / [in, out_1, ...]); a stacked leaf is passed as one
      layer's `jax.ShapeDtypeStruct` and its axes are shifted past the layers axis.
  """
  if not isinstance(config, OptimizerConfig):
    config = OptimizerConfig.from_mapping(config)
  lrs = schedules(config)
  clip = [optax.clip_by_global_norm(config.clip_norm)] if config.clip_norm else []

  if config.name == "adamw":
    decay_mask = lambda params: jax.tree.map(  # noqa: E731
        lambda g: g in ("matrix", "head", "conv"), param_groups(params))
    return optax.chain(*clip, optax.adamw(
        lrs["lr"], b1=config.b1, b2=config.b2, eps=config.eps,
        weight_decay=config.weight_decay, mask=decay_mask))

  per_layer_dims = muon_dimension_numbers or _default_muon_dims

  def dims_fn(path, leaf):
    if not is_stacked(path):
      return per_layer_dims(leaf)
    one = jax.ShapeDtypeStruct(jnp.shape(leaf)[1:], jnp.result_type(leaf))
    return _shift_dims(per_layer_dims(one), 1)

  muon = optax.contrib.muon(
      lrs["lr"],
      ns_steps=config.muon_ns_steps,
      beta=config.muon_momentum,
      eps=config.eps,
      weight_decay=config.weight_decay,
      nesterov=config.muon_nesterov,
      consistent_rms=1.0 if config.muon_scale == "spectral" else None,
      # Every leaf that reaches this branch is a Muon matrix (the others are masked out).
      muon_weight_dimension_numbers=lambda params: jax.tree_util.tree_map_with_path(
          dims_fn, params),
  )
  adam = optax.adamw(lrs["adam_lr"], b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=0.0)
  labels = lambda params: jax.tree.map(  # noqa: E731
      lambda g: "muon" if g == "matrix" else "adam", param_groups(params))
  return optax.chain(*clip, optax.partition({"muon": muon, "adam": adam}, labels))
