"""The training loop: sharded init, a jitted train step with explicit shardings, evaluation,
checkpoints with bit-exact resume, NaN/Inf stop, logs.

    from lineax_attn.train import loop
    result = loop.train(config, workdir)        # config: an ml_collections config (configs/)

Pieces:

* `Trainer(experiment)`: the mesh ("data", "fsdp", "tensor"; with `mesh.sequence > 1` also
  "sequence": the batch's time axis is split over it and the mixers run context parallel,
  docs/CONTEXT_PARALLEL.md), the model built abstractly
  (`nnx.eval_shape`), parameter shardings from the layers' logical axis names
  (`sharding.DEFAULT_RULES`), optimiser-state shardings that follow the parameters, and three
  jitted functions with explicit in/out shardings: `init()` (parameters created sharded, one
  compiled program per block kind: `lineax_attn.models.lm.make_param_init`),
  `step(params, opt_state, batch)` and `eval_step(params, batch)`; the steps are traced under
  `jax.set_mesh`, so Pallas kernels shard themselves with `jax.shard_map`. Parameters are a
  pure dict (`nnx.to_pure_dict`) so the optimiser state and checkpoints are plain pytrees;
  with `model.scan_layers` they hold the stacked layout ("layer_stack": the step compiles one
  period of blocks), and resuming a checkpoint of the other layout is refused.
* Loss: masked token cross-entropy, sum(nll · loss_mask) / sum(loss_mask) over the global batch,
  in float32. With `train.grad_accum_steps` = k the batch is split into k micro-batches whose
  summed gradients are divided by the batch's token count once, so the step equals the
  one-shot step. Segment ids go to the model when the data resets at document boundaries;
  without resets (the paper's setting) the rows are unpadded streams and none are passed.
* `train(config, workdir)`: resumes from the latest checkpoint in `<workdir>/checkpoints`
  (params, optimiser state, step, data iterator), so re-running a command continues it and the
  parameters and losses equal an unbroken run bit for bit. Each step's loss, gradient norm and
  updated-parameter norm are read back; a NaN or Inf in any of them raises `NonFiniteLossError`
  before anything of that step is saved, so the last checkpoint on disk is the last good one.
  Validation runs every `eval_every` steps (and at the start and the end) on a fixed set of
  `eval_batches` batches.
  Logs: a progress line, `<workdir>/metrics.jsonl` and TensorBoard scalars (process 0), with
  tokens/s and the MFU estimate of `metrics.py`. A run killed after its last checkpoint logged
  steps that the resumed run trains again: on resume the records after the restored step are
  dropped (metrics.jsonl rewritten, TensorBoard's events rewritten into one file), so each
  step is logged once. A finished run launched again trains nothing and returns the losses
  metrics.jsonl recorded.

Multi-host: every process runs the same program; each reads its own shard of the documents
(the pipeline shards by `jax.process_index()`), global batches are assembled with
`jax.make_array_from_process_local_data`, orbax saves from all processes, and logs come from
process 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from lineax_attn.data import pipeline as pipeline_lib
from lineax_attn.models import LanguageModel
from lineax_attn.models import lm as lm_lib
from lineax_attn.models import losses as losses_lib
from lineax_attn.train import checkpoint as checkpoint_lib
from lineax_attn.train import experiment as experiment_lib
from lineax_attn.train import metrics as metrics_lib
from lineax_attn.train import optim as optim_lib
from lineax_attn.train import progress as progress_lib
from lineax_attn.train import sharding as sharding_lib

Params = dict
Batch = Mapping[str, jax.Array]


class NonFiniteLossError(FloatingPointError):
  """Training produced a NaN or Inf loss (or gradient norm); nothing of that step was saved."""


# ----------------------------------------------------------------------------------- loss


# The token loss is `lineax_attn.models.losses` (shared with the evals and inspect): the step
# sums `cross_entropy_sums` over micro-batches and divides once.
cross_entropy_sums = losses_lib.cross_entropy_sums
masked_cross_entropy = losses_lib.masked_cross_entropy


# ----------------------------------------------------------------------------------- shardings


def _path_keys(path) -> tuple[str, ...]:
  return tuple(jax.tree_util.keystr((k,)) for k in path)


def follow_param_shardings(abstract_tree, params_shardings, replicated: NamedSharding):
  """Shardings for a tree that holds copies of the params (an optax state): a leaf whose path
  ends with a parameter's path and has its shape gets that parameter's sharding; every other
  leaf (counts, scalars) is replicated. Works through optax's masked (partitioned) states."""
  by_path = {}
  for path, sharded in jax.tree_util.tree_flatten_with_path(params_shardings)[0]:
    by_path[_path_keys(path)] = sharded

  def pick(path, leaf):
    keys = _path_keys(path)
    for start in range(len(keys)):
      hit = by_path.get(keys[start:])
      if hit is not None and tuple(hit.shape) == tuple(leaf.shape):
        return hit.sharding
    return replicated

  return jax.tree_util.tree_map_with_path(pick, abstract_tree)


# ----------------------------------------------------------------------------------- trainer


class Trainer:
  """The model, optimiser and jitted steps of one experiment on one mesh (see module doc)."""

  def __init__(self, experiment: experiment_lib.Experiment, *, mesh=None,
               rules: sharding_lib.LogicalRules = sharding_lib.DEFAULT_RULES,
               compiler_options: Mapping[str, Any] | None = None):
    """Args: the experiment; a mesh (default: the config's over all devices); the logical-axis
    rules; XLA compiler options for the jitted functions (e.g. tests compile CPU code at
    `{"xla_backend_optimization_level": 0}`)."""
    self.experiment = experiment
    self.mesh = mesh if mesh is not None else sharding_lib.make_mesh(
        *experiment.mesh_shape, sequence=experiment.mesh.sequence)
    self.tx = optim_lib.make_optimizer(experiment.optim)
    self.use_segment_ids = experiment.train_data.reset_at_document_boundaries
    self.grad_accum_steps = experiment.train.grad_accum_steps

    model_config, seed = experiment.model, experiment.train.seed
    abstract_model = nnx.eval_shape(lambda: LanguageModel(model_config, rngs=nnx.Rngs(seed)))
    self.graphdef, abstract_params, rest = nnx.split(abstract_model, nnx.Param, ...)
    if jax.tree.leaves(rest):
      raise NotImplementedError("The model has non-parameter state; the trainer keeps only "
                                "nnx.Param variables.")
    self._template = abstract_params
    self.num_params = int(sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params)))
    self.logical_axes = sharding_lib.nnx_logical_axes(abstract_params)
    pure = nnx.to_pure_dict(abstract_params)
    # Checks divisibility of every sharded dimension (ValueError naming the parameter).
    self.abstract_params = sharding_lib.shard_params(pure, self.logical_axes, self.mesh, rules)
    self.param_shardings = jax.tree.map(lambda x: x.sharding, self.abstract_params)
    self.replicated = NamedSharding(self.mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(self.tx.init, pure)
    self.opt_shardings = follow_param_shardings(abstract_opt, self.abstract_params,
                                                self.replicated)
    self.abstract_opt_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_opt,
        self.opt_shardings)
    self.batch_sharding = sharding_lib.batch_sharding(self.mesh)

    options = dict(compiler_options or {})
    self.param_init = lm_lib.make_param_init(model_config, seed,
                                             out_shardings=self.param_shardings,
                                             compiler_options=options)
    self.jitted_opt_init = jax.jit(self.tx.init, out_shardings=self.opt_shardings,
                                   compiler_options=options)
    batch_shardings = self.batch_sharding  # one sharding for every array of the batch dict
    self.jitted_step = jax.jit(
        self._train_step,
        in_shardings=(self.param_shardings, self.opt_shardings, batch_shardings),
        out_shardings=(self.param_shardings, self.opt_shardings, self.replicated),
        donate_argnums=(0, 1), compiler_options=options)
    self.jitted_eval_step = jax.jit(
        self._eval_step, in_shardings=(self.param_shardings, batch_shardings),
        out_shardings=self.replicated, compiler_options=options)

  # -- model ------------------------------------------------------------------------------
  def model(self, params: Params) -> LanguageModel:
    """The NNX model with `params` (a pure dict) as its parameters."""
    state = jax.tree.map(lambda x: x, self._template)  # a fresh State to fill
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(self.graphdef, state)

  def init(self) -> tuple[Params, Any]:
    """Fresh parameters and optimiser state, created directly in their shardings.

    The parameters are those of `LanguageModel(config, rngs=nnx.Rngs(train.seed))`, made by
    `lm.make_param_init`'s programs, one per block kind (not one program of the whole model,
    whose compile grew with the depth). It runs outside `jax.set_mesh`: under a mesh flax would
    shard each new variable by its *logical* names ("vocab" is no mesh axis); out_shardings
    place the results instead.
    """
    params = self.param_init()
    if jax.tree.structure(params) != jax.tree.structure(self.param_shardings):
      raise AssertionError("lm.make_param_init built another parameter tree than "
                           "LanguageModel's (a part added to LanguageModel.__init__ only?)")
    return params, self.jitted_opt_init(params)

  def step(self, params: Params, opt_state, batch: Batch):
    """One training step: (params, opt_state, metrics); params and opt_state are donated.

    Traced under `jax.set_mesh(mesh)` so that kernels without a partitioning rule (the Pallas
    TPU kernels) wrap themselves in `jax.shard_map` over the batch and head axes.
    """
    with jax.set_mesh(self.mesh):
      return self.jitted_step(params, opt_state, batch)

  def eval_step(self, params: Params, batch: Batch):
    """{"nll_sum", "tokens"} of one batch."""
    with jax.set_mesh(self.mesh):
      return self.jitted_eval_step(params, batch)

  def abstract_state(self) -> dict[str, Any]:
    """The checkpoint layout with shardings (the restore target)."""
    return {"params": self.abstract_params, "opt_state": self.abstract_opt_state,
            "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated)}

  # -- steps ------------------------------------------------------------------------------
  def _loss_sums(self, params: Params, batch: Batch):
    segment_ids = batch["segment_ids"] if self.use_segment_ids else None
    logits = self.model(params)(batch["inputs"], segment_ids)
    return cross_entropy_sums(logits, batch["targets"], batch["loss_mask"])

  def _grads(self, params: Params, batch: Batch):
    """(sum of NLL, token count, gradient of the sum) over the batch, by micro-batches."""
    grad_fn = jax.value_and_grad(lambda p, b: self._loss_sums(p, b), has_aux=True)
    k = self.grad_accum_steps
    if k == 1:
      (total, count), grads = grad_fn(params, batch)
      return total, count, grads
    # Row i*k + m goes to micro-batch m: each device's rows stay on the device.
    micro_sharding = NamedSharding(self.mesh, PartitionSpec(None, *self.batch_sharding.spec))
    micro = jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(
            jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1), micro_sharding),
        dict(batch))

    def body(carry, mb):
      (total, count), grads = grad_fn(params, mb)
      return jax.tree.map(jnp.add, carry, (total, count, grads)), None

    zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
             jax.tree.map(jnp.zeros_like, params))
    (total, count, grads), _ = jax.lax.scan(body, zeros, micro)
    return total, count, grads

  def _train_step(self, params: Params, opt_state, batch: Batch):
    total, count, grads = self._grads(params, batch)
    denom = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), grads)
    updates, opt_state = self.tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    # The parameter norm catches a bad update (e.g. a NaN learning rate) before it is saved.
    metrics = {"loss": total / denom, "grad_norm": optax.tree.norm(grads),
               "param_norm": optax.tree.norm(params), "tokens": count}
    return params, opt_state, metrics

  def _eval_step(self, params: Params, batch: Batch):
    total, count = self._loss_sums(params, batch)
    return {"nll_sum": total, "tokens": count}

  # -- data -------------------------------------------------------------------------------
  def global_batch(self, local_batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows -> the global batch sharded over ("data", "fsdp") (and its time
    axis over "sequence" when the mesh has it)."""
    keys = ("inputs", "targets", "loss_mask") + (("segment_ids",) if self.use_segment_ids else ())
    return sharding_lib.shard_batch({k: local_batch[k] for k in keys}, self.mesh)

  def evaluate(self, params: Params, batches) -> float:
    """Mean token NLL over a list of (global) batches."""
    sums = [self.eval_step(params, b) for b in batches]
    total = sum(float(s["nll_sum"]) for s in sums)
    count = sum(float(s["tokens"]) for s in sums)
    return total / max(count, 1.0)

  def flops_per_token(self) -> float:
    return metrics_lib.train_flops_per_token(self.experiment.model, self.num_params,
                                             self.experiment.train.seq_len)


# ----------------------------------------------------------------------------------- driver


@dataclasses.dataclass
class TrainResult:
  """What one call of `train` did. `losses[i]` is the training loss of step `first_step + i`.

  A run found finished (stop_reason "already completed") trained nothing: `losses` is empty,
  and train_loss, eval_loss(es) and tokens_per_second are the ones metrics.jsonl recorded.
  """

  name: str
  first_step: int                    # the step this call started from (0, or a checkpoint's)
  final_step: int
  losses: list[float]
  eval_losses: list[tuple[int, float]]
  train_loss: float | None           # mean loss of the last log interval
  eval_loss: float | None            # the last validation loss
  tokens_per_second: float | None    # steady-state (compile and eval/checkpoint time excluded)
  num_params: int
  wall_seconds: float
  completed: bool                    # reached train.steps
  stop_reason: str = ""


def _config_diff(saved: Mapping[str, Any], current: Mapping[str, Any], prefix="") -> list[str]:
  out = []
  for key in sorted(set(saved) | set(current)):
    a, b = saved.get(key), current.get(key)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
      out += _config_diff(a, b, f"{prefix}{key}.")
    elif a != b:
      out.append(f"{prefix}{key}: {a!r} -> {b!r}")
  return out


def _check_layer_layout(saved: Mapping[str, Any] | None, scan_layers: bool, directory: str,
                        step: int) -> None:
  """A checkpoint's parameter layout follows model.scan_layers (stacked blocks or one entry
  per layer): restoring one layout into the other is refused by name, not left to orbax."""
  saved_model = (saved or {}).get("model") or {}
  was = bool(saved_model.get("scan_layers", False))  # checkpoints older than the option: False
  if was != scan_layers:
    layout = lambda scan: "stacked (scanned)" if scan else "unrolled"  # noqa: E731
    raise ValueError(
        f"the checkpoint at step {step} in {directory} was saved with model.scan_layers={was} "
        f"({layout(was)} blocks) but this run has model.scan_layers={scan_layers} "
        f"({layout(scan_layers)}): set --config.model.scan_layers={was} to resume it, or convert "
        f"its params with lineax_attn.models.lm.stack_params / unstack_params.")


def _fixed_batches(data_config, count: int) -> list[dict[str, np.ndarray]]:
  """The first `count` batches of a pipeline (this process's rows): a fixed validation set."""
  iterator = pipeline_lib.make_iterator(data_config)
  return [next(iterator) for _ in range(count)]


class _StopSignal:
  """Turns SIGTERM (a preemption notice) into a clean stop with a checkpoint."""

  def __init__(self):
    self.received = False
    self._previous = None

  def __enter__(self):
    try:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread: no handler
      self._previous = None
    return self

  def _handle(self, signum, frame):  # pylint: disable=unused-argument
    self.received = True

  def should_stop(self) -> bool:
    """Whether any process got the signal: all processes must stop at the same step, or the
    ones that go on wait forever in the next collective."""
    if jax.process_count() == 1:
      return self.received
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    flags = multihost_utils.process_allgather(np.asarray(self.received, np.int32))
    return bool(np.any(flags))

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def train(config: ml_collections.ConfigDict | experiment_lib.Experiment, workdir: str, *,
          arm: str | None = None, stop_at_step: int | None = None, progress: bool = True,
          log: Callable[[str], None] | None = None, mesh=None,
          compiler_options: Mapping[str, Any] | None = None,
          trainer: Trainer | None = None) -> TrainResult:
  """Trains (or resumes) the experiment of `config` in `workdir` (see the module docstring).

  Args:
    config: a config of `configs/` (its arm applied, or `arm`), or a resolved Experiment.
    workdir: checkpoints (`checkpoints/`), `metrics.jsonl`, `tensorboard/`, `config.json`.
    arm: the arm to train (default `config.arm`).
    stop_at_step: stop after this step with a checkpoint, as a preemption would (a later call
      resumes); None = run to `train.steps`.
    progress: print the progress line (process 0).
    log: where one-line messages go (default: the progress stream).
    mesh: a mesh to use instead of the config's over all devices (e.g. one device in tests).
    compiler_options: XLA options for the jitted steps (see `Trainer`).
    trainer: a Trainer of this experiment built beforehand (mesh and compiler_options are then
      ignored).

  Raises:
    ValueError: a bad config (before any compute).
    NonFiniteLossError: a NaN/Inf loss; the last good checkpoint stays.
  """
  start_time = time.perf_counter()
  exp = (config if isinstance(config, experiment_lib.Experiment)
         else experiment_lib.resolve(config, arm=arm))
  if trainer is None:
    trainer = Trainer(exp, mesh=mesh, compiler_options=compiler_options)
  settings = exp.train
  is_main = jax.process_index() == 0
  bar = progress_lib.Progress(exp.run_name, settings.steps, enabled=progress and is_main,
                              messages=is_main)
  say = log if log is not None else bar.message
  if not is_main:
    say = lambda _: None  # noqa: E731
  for note in exp.notes:  # values resolve() derived (a scaled schedule, the command line's)
    say(f"note: {note}")

  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  config_dict = checkpoint_lib.config_to_dict(exp.config)
  if is_main:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(config_dict, f, indent=2, sort_keys=True)
  interval = settings.checkpoint_every or settings.steps
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                     max_to_keep=settings.keep_checkpoints,
                                     save_interval_steps=interval,
                                     async_save=settings.async_checkpoint)
  writer = None
  try:
    latest = ckpt.latest_step()
    if latest is not None and latest >= settings.steps:
      say(f"already trained: checkpoint at step {latest} >= train.steps={settings.steps}")
      return _finished_result(exp, workdir, latest, trainer.num_params, start_time)
    # Steps after the checkpoint (a killed run logged them) are trained again: drop their
    # records; a fresh start (no checkpoint) drops them all.
    writer = metrics_lib.MetricWriter(workdir, enabled=is_main,
                                      discard_after_step=-1 if latest is None else latest)
    train_iterator = pipeline_lib.make_iterator(exp.train_data)
    if latest is None:
      params, opt_state = trainer.init()
      step = 0
      say(f"{experiment_lib.describe(exp)}; {trainer.num_params:,} parameters")
    else:
      saved = ckpt.restore_config(latest)
      _check_layer_layout(saved, exp.model.scan_layers, ckpt.directory, latest)
      changed = _config_diff(saved, config_dict)
      if changed:
        say(f"warning: the config differs from the checkpoint's: {'; '.join(changed)}")
      state = ckpt.restore(latest, trainer.abstract_state(), data_iterator=train_iterator)
      params, opt_state, step = state["params"], state["opt_state"], int(state["step"])
      say(f"resumed from step {step} ({ckpt.directory})")

    eval_batches = []
    if exp.eval_data is not None and settings.eval_batches > 0:
      eval_batches = [trainer.global_batch(b)
                      for b in _fixed_batches(exp.eval_data, settings.eval_batches)]

    return _TrainingRun(exp=exp, trainer=trainer, ckpt=ckpt, writer=writer, bar=bar, say=say,
                        train_iterator=train_iterator, eval_batches=eval_batches,
                        stop_at_step=stop_at_step, start_time=start_time, params=params,
                        opt_state=opt_state, step=step).run()
  finally:
    if writer is not None:
      writer.close()
    ckpt.close()


def _finished_result(exp, workdir: str, step: int, num_params: int,
                     start_time: float) -> TrainResult:
  """The result of a run found finished: its losses as metrics.jsonl recorded them."""
  records = metrics_lib.read_metrics(workdir)  # sorted by (kind, step)
  numeric = lambda r: isinstance(r.get("loss"), (int, float))  # noqa: E731
  train = [r for r in records if r["kind"] == "train" and r["step"] <= step and numeric(r)]
  evals = [(r["step"], float(r["loss"])) for r in records
           if r["kind"] == "eval" and r["step"] <= step and numeric(r)]
  return TrainResult(
      name=exp.run_name, first_step=step, final_step=step, losses=[], eval_losses=evals,
      train_loss=float(train[-1]["loss"]) if train else None,
      eval_loss=evals[-1][1] if evals else None,
      tokens_per_second=train[-1].get("tokens_per_s") if train else None,
      num_params=num_params, wall_seconds=time.perf_counter() - start_time, completed=True,
      stop_reason="already completed")


@dataclasses.dataclass
class _TrainingRun:
  """One call of `train` from a start state to its last step.

  The fields up to `start_time` are fixed for the run; `params`, `opt_state` and `step` advance
  with each training step, and the logs of the call (losses, evaluations, step times) gather in
  the fields that `__post_init__` sets. `run()` trains and returns the TrainResult.
  """

  exp: experiment_lib.Experiment
  trainer: Trainer
  ckpt: checkpoint_lib.Checkpointer
  writer: metrics_lib.MetricWriter
  bar: progress_lib.Progress
  say: Callable[[str], None]
  train_iterator: Any
  eval_batches: list[dict[str, jax.Array]]
  stop_at_step: int | None
  start_time: float
  params: Params
  opt_state: Any
  step: int

  def __post_init__(self):
    settings = self.exp.train
    self.first_step = self.step
    self.last = (settings.steps if self.stop_at_step is None
                 else min(settings.steps, self.stop_at_step))
    # One compile, not an eager op each log.
    self.lr_at = jax.jit(optim_lib.schedules(self.exp.optim)["lr"])
    self.flops_per_token = self.trainer.flops_per_token()
    self.devices = list(self.trainer.mesh.devices.flat)
    self.tokens_per_step = self.exp.tokens_per_step
    self.losses: list[float] = []
    self.eval_losses: list[tuple[int, float]] = []
    self.step_times: list[float] = []       # seconds per step, this process run
    self.interval_losses: list[float] = []  # the losses since the last logged step
    self.val_loss: float | None = None
    self.train_loss: float | None = None
    self.stop_reason = ""

  def run(self) -> TrainResult:
    settings = self.exp.train
    if self.step == 0 and self.eval_batches:
      self._evaluate()
    with _StopSignal() as stop:
      while self.step < self.last:
        loss, grad_norm, param_norm = self._train_step()
        evaluated = False
        if self.eval_batches and ((settings.eval_every and self.step % settings.eval_every == 0)
                                  or self.step == settings.steps):
          self._evaluate()
          evaluated = True
        self._log(loss, grad_norm, param_norm, evaluated)
        # No directory listing per step.
        if self.step == self.last or self.step % self.ckpt.save_interval_steps == 0:
          self._save(force=self.step == self.last)
        if stop.should_stop() and self.step < self.last:
          self._save(force=True)
          self.stop_reason = "SIGTERM"
          self.say(f"SIGTERM: stopped at step {self.step} with a checkpoint; re-run to resume")
          break
    self.ckpt.wait_until_finished()
    self.writer.flush()
    return self._result()

  def _train_step(self) -> tuple[float, float, float]:
    """Trains one step and records its loss; (loss, gradient norm, parameter norm) of it.
    Raises NonFiniteLossError (nothing of the step saved) on a NaN or Inf."""
    t0 = time.perf_counter()
    batch = self.trainer.global_batch(next(self.train_iterator))
    self.params, self.opt_state, metrics = self.trainer.step(self.params, self.opt_state, batch)
    metrics = jax.device_get(metrics)
    self.step += 1
    self.step_times.append(time.perf_counter() - t0)
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    param_norm = float(metrics["param_norm"])
    if not all(map(math.isfinite, (loss, grad_norm, param_norm))):
      self._stop_non_finite(loss, grad_norm, param_norm)
    self.losses.append(loss)
    self.interval_losses.append(loss)
    return loss, grad_norm, param_norm

  def _stop_non_finite(self, loss: float, grad_norm: float, param_norm: float):
    self.ckpt.wait_until_finished()
    good = self.ckpt.latest_step()
    where = (f"the last good checkpoint is step {good} in {self.ckpt.directory}"
             if good is not None else "no checkpoint was saved yet")
    step = self.step
    message = (f"{self.exp.run_name}: non-finite training loss at step {step} (loss {loss}, "
               f"gradient norm {grad_norm}, parameter norm after the update {param_norm}); "
               f"training stopped and nothing of step {step} was saved; {where}. Lower "
               f"optim.learning_rate or check the data.")
    self.writer.write(step, "error", {"loss": loss, "grad_norm": grad_norm,
                                      "param_norm": param_norm, "last_good_checkpoint": good})
    self.say(message)
    raise NonFiniteLossError(message)

  def _evaluate(self):
    """Validation loss at the current step: logged and recorded."""
    value = self.trainer.evaluate(self.params, self.eval_batches)
    self.writer.write(self.step, "eval",
                      {"loss": value, "tokens": self.step * self.tokens_per_step})
    self.val_loss = value
    self.eval_losses.append((self.step, value))

  def _steady_step_time(self) -> float | None:
    """The median step time, the first steps (compiles) left out; None before there is one."""
    times = self.step_times
    steady = times[2:] if len(times) > 2 else times[1:]
    return float(np.median(steady)) if steady else None

  def _tokens_per_second(self) -> float | None:
    step_time = self._steady_step_time()
    return None if step_time is None else self.tokens_per_step / step_time

  def _log(self, loss: float, grad_norm: float, param_norm: float, evaluated: bool):
    """The progress line of this step; every `log_every` steps (and the last) also a record."""
    step = self.step
    step_time = self._steady_step_time()
    tokens_per_s = None if step_time is None else self.tokens_per_step / step_time
    eta = None if step_time is None else step_time * (self.last - step)
    if step % self.exp.train.log_every == 0 or step == self.last:
      self.train_loss = float(np.mean(self.interval_losses))
      self.interval_losses = []
      mfu = (metrics_lib.mfu(self.flops_per_token, tokens_per_s, self.devices)
             if tokens_per_s else None)
      self.writer.write(step, "train", {
          "loss": self.train_loss, "grad_norm": grad_norm, "param_norm": param_norm,
          "lr": float(self.lr_at(step - 1)),
          "tokens_per_s": tokens_per_s, "mfu": mfu, "step_time_s": self.step_times[-1],
          "tokens": step * self.tokens_per_step})
      self.bar.update(step, self.train_loss, keep=True,
                      val_loss=self.val_loss if evaluated else None,
                      tokens_per_s=tokens_per_s, mfu=mfu, eta_s=eta)
    else:
      self.bar.update(step, loss, tokens_per_s=tokens_per_s, eta_s=eta)

  def _save(self, force: bool = False):
    # The step as a replicated global array: every process holds the same value.
    at_step = self.step
    step_array = jax.make_array_from_callback((), self.trainer.replicated,
                                              lambda _: np.asarray(at_step, np.int32))
    state = {"params": self.params, "opt_state": self.opt_state, "step": step_array}
    return self.ckpt.save(at_step, state, data_iterator=self.train_iterator,
                          config=self.exp.config, force=force)

  def _result(self) -> TrainResult:
    completed = self.step >= self.exp.train.steps
    stop_reason = self.stop_reason
    if not completed and not stop_reason:
      stop_reason = f"stop_at_step={self.stop_at_step}"
    return TrainResult(
        name=self.exp.run_name, first_step=self.first_step, final_step=self.step,
        losses=self.losses, eval_losses=self.eval_losses, train_loss=self.train_loss,
        eval_loss=self.eval_losses[-1][1] if self.eval_losses else None,
        tokens_per_second=self._tokens_per_second(),
        num_params=self.trainer.num_params, wall_seconds=time.perf_counter() - self.start_time,
        completed=completed, stop_reason=stop_reason)
