"""Recall evaluations: MQAR training sweeps (docs/MATH.md §7.1) and NIAH scoring of a trained LM
(§7.2).

    model, history = train_mqar(ModelConfig(mixer="gdn", vocab_size=256), MQARConfig(256, 64, 4),
                                lr=3e-3, steps=300, batch_size=64)
    acc = mqar_accuracy(model, [(inputs, labels)])            # argmax over labelled positions
    rows = sweep_mqar(mixers=("gdn", "softmax"), d_models=(64,), seq_lens=(64,),
                      num_pairs=(4, 8), lrs=(1e-3, 3e-3), vocab=256, steps=300, batch_size=64)
    scores = niah_score(model, tokenizer, niah_tasks("s_niah_1", [1024]), max_new_tokens=16)

Training (`train_mqar_lrs`) is a compact AdamW loop, not the `Trainer`: all learning rates of a
cell train at once (`jax.vmap` over stacked parameters; the same init and the same batches), and
`steps_per_call` steps run in one `lax.scan` per dispatch, with the training set on the device.
The peak learning rate is an argument of the compiled function, so one compile serves every
(num_pairs, learning rate) of a (mixer, d_model, seq_len) shape. Loss: cross-entropy at the
labelled (query) positions only. Schedule: linear warmup then cosine decay to 0.

The state size reported per row is d_k · d_v · H_v per linear layer (the recurrent state); for
softmax attention it is the KV cache at the task's length, 2 · T · H_kv · d_h per layer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lineax_attn.data import synthetic
from lineax_attn.layers import gates as gates_lib
from lineax_attn.models import losses as losses_lib
from lineax_attn.models.config import SOFTMAX, ModelConfig
from lineax_attn.models.lm import LanguageModel
from lineax_attn.train import optim


# ------------------------------------------------------------------------------- accuracy


@jax.jit
def _correct_counts(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
  mask = labels != synthetic.IGNORE
  hit = (jnp.argmax(logits, axis=-1) == labels) & mask
  return jnp.sum(hit), jnp.sum(mask)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, inputs):
  return nnx.merge(graphdef, state)(inputs)


def _as_inputs_labels(batch) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, labels) from a tuple, a {"inputs", "labels"} dict or a pipeline batch
  ({"inputs", "targets", "loss_mask"})."""
  if isinstance(batch, (tuple, list)) and len(batch) == 2:
    inputs, labels = batch
  elif isinstance(batch, dict) and "labels" in batch:
    inputs, labels = batch["inputs"], batch["labels"]
  elif isinstance(batch, dict) and {"inputs", "targets", "loss_mask"} <= set(batch):
    labels = np.where(np.asarray(batch["loss_mask"]) > 0, np.asarray(batch["targets"]),
                      synthetic.IGNORE)
    inputs = batch["inputs"]
  else:
    raise ValueError("each batch must be (inputs, labels), a dict with 'inputs' and 'labels', or "
                     "a pipeline batch with 'inputs', 'targets' and 'loss_mask'.")
  inputs, labels = np.asarray(inputs), np.asarray(labels)
  if inputs.ndim != 2 or inputs.shape != labels.shape:
    raise ValueError(f"inputs and labels must both be [B, T] int arrays, got {inputs.shape} "
                     f"and {labels.shape}.")
  return inputs.astype(np.int32), labels.astype(np.int32)


def mqar_accuracy(model: LanguageModel, batches: Iterable[Any]) -> float:
  """Argmax accuracy over the labelled positions (labels != -100) of all batches.

  Every MQAR example has N labelled positions, so this equals the mean over examples.
  Returns NaN when nothing is labelled.
  """
  graphdef, state = nnx.split(model)
  hits = total = 0
  for batch in batches:
    inputs, labels = _as_inputs_labels(batch)
    logits = _forward(graphdef, state, jnp.asarray(inputs))
    h, n = _correct_counts(logits, jnp.asarray(labels))
    hits, total = hits + int(h), total + int(n)
  return hits / total if total else float("nan")


# ------------------------------------------------------------------------------- training


@dataclasses.dataclass(frozen=True)
class TrainSettings:
  """The MQAR training loop's settings (shared by every cell of a sweep)."""

  steps: int = 300
  batch_size: int = 64
  warmup_fraction: float = 0.1
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  b1: float = 0.9
  b2: float = 0.98
  steps_per_call: int = 25          # steps per compiled lax.scan (dispatch overhead)
  vmap_lrs: bool = True             # train the learning rates of a cell at once
  # Stop a run once every LR's mean training loss over one compiled call is below this (None:
  # train every step). MQAR's loss falls to ~0 once a model solves the task and stays there, so
  # the steps after only cost time; the run's `converged` and `steps` say where it stopped.
  stop_loss: float | None = None

  def __post_init__(self):
    for name in ("steps", "batch_size", "steps_per_call"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
    if self.stop_loss is not None and not (math.isfinite(self.stop_loss)
                                           and self.stop_loss > 0):
      raise ValueError(f"stop_loss must be None or a positive finite float, got "
                       f"{self.stop_loss}.")
    if not 0.0 <= self.warmup_fraction < 1.0:
      raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}.")

  @property
  def chunk(self) -> int:
    return min(self.steps_per_call, self.steps)

  @property
  def total_steps(self) -> int:
    """steps rounded up to a whole number of compiled calls."""
    return -(-self.steps // self.chunk) * self.chunk


def _lr_at(step, peak, total, warmup):
  step = step.astype(jnp.float32)
  warm = peak * (step + 1) / max(warmup, 1)
  frac = jnp.clip((step - warmup) / max(total - warmup, 1), 0.0, 1.0)
  cos = peak * 0.5 * (1 + jnp.cos(jnp.pi * frac))
  return jnp.where(step < warmup, warm, cos)


def _decay_mask(params):
  # Weight decay on every parameter but the decay gates' A_log and dt_bias (Zoology's MQAR
  # decays everything; decaying A_log and dt_bias would pull every decay toward
  # exp(-softplus(0)) = 0.5 per token, the opposite of what recall needs).
  def decayed(path, _):
    parts = optim.path_name(path).split("/")
    return not ({"A_log", "dt_bias"} & set(parts))
  return jax.tree_util.tree_map_with_path(decayed, params)


def _make_tx(s: TrainSettings):
  return optax.chain(
      optax.clip_by_global_norm(s.clip_norm),
      # static "mask": inject_hyperparams would otherwise call it as a schedule of the step.
      optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
          learning_rate=0.0, b1=s.b1, b2=s.b2, weight_decay=s.weight_decay, mask=_decay_mask))


_RUNNERS: dict = {}


def _runner(model_config: ModelConfig, settings: TrainSettings, n_lrs: int):
  """Jitted (init, train chunk, correct counts) for one model config, cached; shapes (T, B)
  are traced per call, so the cache holds one compile per shape."""
  settings = dataclasses.replace(settings, stop_loss=None)   # the host's test, not compiled
  key = (model_config, settings, n_lrs)
  if key in _RUNNERS:
    return _RUNNERS[key]
  tx = _make_tx(settings)
  total, warmup = settings.total_steps, int(settings.warmup_fraction * settings.total_steps)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: LanguageModel(model_config, rngs=nnx.Rngs(0))))
  vmap = settings.vmap_lrs and n_lrs > 1

  def init_one(seed, _):
    state = nnx.state(LanguageModel(model_config, rngs=nnx.Rngs(seed)))
    return state, tx.init(state)

  def loss_fn(state, inputs, labels):
    logits = nnx.merge(graphdef, state)(inputs)
    return losses_lib.masked_cross_entropy(logits, labels, labels != synthetic.IGNORE)

  def step_one(state, opt_state, peak, step, inputs, labels):
    loss, grads = jax.value_and_grad(loss_fn)(state, inputs, labels)
    opt_state[1].hyperparams["learning_rate"] = _lr_at(step, peak, total, warmup)
    updates, opt_state = tx.update(grads, opt_state, state)
    return optax.apply_updates(state, updates), opt_state, loss

  def chunk_fn(states, opt_states, peaks, start, data_inputs, data_labels, order):
    """settings.chunk steps from `start`; batch i = rows order[i*B:(i+1)*B] of the data."""
    b = settings.batch_size

    def body(carry, i):
      states, opt_states = carry
      step = start + i
      rows = jax.lax.dynamic_slice_in_dim(order, (step * b) % order.shape[0], b)
      inputs, labels = data_inputs[rows], data_labels[rows]
      if vmap:
        fn = jax.vmap(step_one, in_axes=(0, 0, 0, None, None, None))
        states, opt_states, loss = fn(states, opt_states, peaks, step, inputs, labels)
      else:
        outs = [step_one(jax.tree.map(lambda x, j=j: x[j], states),
                         jax.tree.map(lambda x, j=j: x[j], opt_states), peaks[j], step, inputs,
                         labels) for j in range(n_lrs)]
        states = jax.tree.map(lambda *xs: jnp.stack(xs), *[o[0] for o in outs])
        opt_states = jax.tree.map(lambda *xs: jnp.stack(xs), *[o[1] for o in outs])
        loss = jnp.stack([o[2] for o in outs])
      return (states, opt_states), loss

    (states, opt_states), losses = jax.lax.scan(body, (states, opt_states),
                                                jnp.arange(settings.chunk))
    return states, opt_states, losses  # losses [chunk, n_lrs]

  def init(seed):
    # The same initial parameters for every learning rate: the LRs differ only in the LR.
    state, opt_state = init_one(seed, None)
    stack = lambda x: jnp.broadcast_to(x, (n_lrs,) + x.shape)  # noqa: E731
    return jax.tree.map(stack, state), jax.tree.map(stack, opt_state)

  runner = (graphdef, jax.jit(init, static_argnums=0), jax.jit(chunk_fn, donate_argnums=(0, 1)))
  _RUNNERS[key] = runner
  return runner


@dataclasses.dataclass
class MQARRun:
  """What `train_mqar_lrs` returns: one model per learning rate, their losses, timings."""

  lrs: tuple[float, ...]
  models: list[LanguageModel]
  losses: np.ndarray          # [steps, n_lrs]
  steps: int                  # steps trained (fewer than asked when `partial`)
  seconds: float              # wall time of the training (compile included)
  first_call_seconds: float   # the first compiled call (compile + chunk steps)
  examples_per_s: float       # steady state, all learning rates together
  partial: bool = False       # stopped by the deadline before its steps
  converged: bool = False     # stopped early: its loss fell below `TrainSettings.stop_loss`

  def loss_curve(self, points: int = 24) -> list[list[float]]:
    """[[last step of the window, mean loss per LR...], ...] over `points` equal windows: the
    shape of training (when a run leaves the chance plateau) in a few numbers per row."""
    bounds = np.unique(np.linspace(0, len(self.losses), points + 1).round().astype(int))
    return [[int(hi)] + [float(x) for x in self.losses[lo:hi].mean(axis=0)]
            for lo, hi in zip(bounds[:-1], bounds[1:])]

  def accuracies(self, inputs: np.ndarray, labels: np.ndarray, batch_size: int | None = None
                 ) -> list[float]:
    """Test accuracy per LR. batch_size None: 32,768 tokens a batch (at most 256 rows): the
    float32 logits of a batch are batch·T·V, 1 GiB at V 8192, so cells sharing a GPU each fit
    (256 rows at T 512 were 4 GiB, more than a twentieth of an H200 left after training)."""
    if batch_size is None:
      batch_size = max(1, min(256, 32768 // inputs.shape[1]))
    return [mqar_accuracy(m, _batches(inputs, labels, batch_size)) for m in self.models]


def _batches(inputs, labels, batch_size):
  """Fixed-size batches (the last padded with unlabelled rows): one compile per shape."""
  for i in range(0, len(inputs), batch_size):
    x, y = inputs[i:i + batch_size], labels[i:i + batch_size]
    if len(x) < batch_size and len(inputs) > batch_size:
      pad = batch_size - len(x)
      x = np.concatenate([x, np.zeros((pad, x.shape[1]), x.dtype)])
      y = np.concatenate([y, np.full((pad, y.shape[1]), synthetic.IGNORE, y.dtype)])
    yield x, y


def _check_task(model_config: ModelConfig, task: synthetic.MQARConfig):
  if not isinstance(model_config, ModelConfig):
    raise ValueError(f"model_config must be a ModelConfig, got {type(model_config).__name__}.")
  if not isinstance(task, synthetic.MQARConfig):
    raise ValueError(f"task must be a synthetic.MQARConfig, got {type(task).__name__}.")
  if model_config.vocab_size < task.vocab:
    raise ValueError(f"model_config.vocab_size={model_config.vocab_size} is smaller than the "
                     f"task's vocab={task.vocab}.")


def train_mqar_lrs(model_config: ModelConfig, task: synthetic.MQARConfig, lrs: Sequence[float],
                   settings: TrainSettings = TrainSettings(), *, seed: int = 0,
                   train_data: tuple[np.ndarray, np.ndarray] | None = None,
                   train_examples: int = 100_000, deadline: float | None = None) -> MQARRun:
  """Trains one model per learning rate on `task`, all at once (see the module docstring).

  Args:
    model_config: the model (vocab_size >= task.vocab).
    task: the MQAR task.
    lrs: peak learning rates.
    settings: the loop's settings.
    seed: parameter init and the data order (the training examples use seed too when not
      given: pass test data drawn with another seed).
    train_data: (inputs, labels) `[n, T]`; default: min(train_examples, steps x batch)
      examples drawn with `seed`.
    deadline: a `time.perf_counter()` value; past it the run stops between compiled calls and
      returns what it trained (`partial`; its first call always runs, so a run started is
      never wasted).
  """
  _check_task(model_config, task)
  lrs = tuple(float(x) for x in lrs)
  if not lrs or any(not (x > 0 and math.isfinite(x)) for x in lrs):
    raise ValueError(f"lrs must be positive finite floats, got {lrs}.")
  s = settings
  if train_data is None:
    count = min(train_examples, s.total_steps * s.batch_size)
    train_data = synthetic.mqar(task.vocab, task.seq_len, task.num_pairs, count=count,
                                seed=seed, power=task.power)
  inputs, labels = (np.asarray(x, np.int32) for x in train_data)
  if inputs.shape != labels.shape or inputs.ndim != 2 or inputs.shape[1] != task.seq_len:
    raise ValueError(f"train_data must be (inputs, labels) of shape [n, {task.seq_len}], got "
                     f"{inputs.shape} and {labels.shape}.")
  n = (len(inputs) // s.batch_size) * s.batch_size
  if n == 0:
    raise ValueError(f"train_data has {len(inputs)} examples, fewer than one batch "
                     f"({s.batch_size}).")
  graphdef, init, chunk_fn = _runner(model_config, s, len(lrs))
  t0 = time.perf_counter()
  states, opt_states = init(seed)
  data_inputs, data_labels = jnp.asarray(inputs[:n]), jnp.asarray(labels[:n])
  peaks = jnp.asarray(lrs, jnp.float32)
  losses, call_times = [], []
  order, order_epoch = None, -1
  partial = converged = False
  for start in range(0, s.total_steps, s.chunk):
    if start and deadline is not None and time.perf_counter() > deadline:
      partial = True
      break
    epoch = (start * s.batch_size) // n
    if epoch != order_epoch:  # a new order per epoch (a chunk that crosses one wraps around)
      order = jnp.asarray(np.random.default_rng((seed, epoch)).permutation(n), jnp.int32)
      order_epoch = epoch
    tc = time.perf_counter()
    states, opt_states, chunk_losses = chunk_fn(states, opt_states, peaks, jnp.int32(start),
                                                data_inputs, data_labels, order)
    losses.append(np.asarray(chunk_losses))  # also waits for the chunk
    call_times.append(time.perf_counter() - tc)
    if s.stop_loss is not None and np.all(losses[-1].mean(axis=0) < s.stop_loss):
      converged = True
      break
  seconds = time.perf_counter() - t0
  steady = call_times[1:] or call_times
  examples_per_s = s.chunk * s.batch_size * len(lrs) / float(np.median(steady))
  models = [nnx.merge(graphdef, jax.tree.map(lambda x, j=j: x[j], states))
            for j in range(len(lrs))]
  losses = np.concatenate(losses)
  return MQARRun(lrs=lrs, models=models, losses=losses, steps=len(losses), seconds=seconds,
                 first_call_seconds=call_times[0], examples_per_s=examples_per_s,
                 partial=partial, converged=converged)


def train_mqar(model_config: ModelConfig, task: synthetic.MQARConfig, *, lr: float,
               steps: int = 300, batch_size: int = 64, seed: int = 0, **settings
               ) -> tuple[LanguageModel, dict[str, Any]]:
  """One model at one learning rate: (model, history {"loss": [steps], "seconds", ...})."""
  s = TrainSettings(steps=steps, batch_size=batch_size, **settings)
  run = train_mqar_lrs(model_config, task, [lr], s, seed=seed)
  return run.models[0], {"loss": run.losses[:, 0], "steps": run.steps, "seconds": run.seconds,
                         "examples_per_s": run.examples_per_s}


# ---------------------------------------------------------------------------------- sweep


def state_size(model_config: ModelConfig, seq_len: int) -> int:
  """Per-layer memory of the mixer (elements): d_k · d_v · H_v for a linear layer, the KV cache
  2 · T · H_kv · d_h for softmax attention (the largest over the stack's layers)."""
  sizes = []
  for kind in model_config.layer_types:
    if kind == SOFTMAX:
      heads_kv = model_config.attn_kv_heads or model_config.attn_heads
      head_dim = model_config.attn_head_dim or model_config.d_model // model_config.attn_heads
      sizes.append(2 * seq_len * heads_kv * head_dim)
    else:
      sizes.append(model_config.dk * model_config.dv * model_config.v_heads)
  return max(sizes)


def sweep_model_config(mixer: str, d_model: int, vocab: int, **overrides) -> ModelConfig:
  """The sweep's model: 2 layers of `mixer` + SwiGLU, 2 heads, vocab rounded up to 128."""
  values = dict(vocab_size=-(-vocab // 128) * 128, d_model=d_model, n_layers=2, mixer=mixer,
                num_heads=2, attn_heads=2)
  values.update(overrides)
  return ModelConfig(**values)


def gate_horizons(model: nnx.Module) -> np.ndarray:
  """The memory horizon at zero gate input, −1 / g with g = log_decay(0, A_log, dt_bias), of
  every head / channel of every gated mixer layer of `model`, flat (empty without a decay):
  the tokens over which a key keeps 1/e of itself when the input does not move the gate."""
  horizons = []
  for _, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module) and hasattr(node, "A_log") and hasattr(node, "dt_bias"):
      a_log, dt_bias = node.A_log[...], node.dt_bias[...]
      a_log = a_log if dt_bias.ndim == a_log.ndim else a_log[..., None]
      g = gates_lib.log_decay(jnp.zeros(()), a_log, dt_bias,
                              getattr(node, "gate_lower_bound", None))
      horizons.append(np.ravel(-1.0 / np.minimum(np.asarray(g), -1e-30)))
  return np.concatenate(horizons) if horizons else np.zeros((0,))


def decay_horizons(model: nnx.Module) -> dict[str, float] | None:
  """Percentiles (10, 50, 90) of `gate_horizons(model)`; None without a decay. Read after
  training it says whether the gates kept a long memory or learnt to forget (the
  data-dependent part of g is left out: a summary of the parameters, not of a sequence)."""
  horizons = gate_horizons(model)
  if not horizons.size:
    return None
  p10, p50, p90 = np.percentile(horizons, [10, 50, 90])
  return {"horizon_p10": float(p10), "horizon_median": float(p50), "horizon_p90": float(p90)}


def _fmt_time(seconds: float) -> str:
  seconds = max(0, int(round(seconds)))
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def sweep_mqar(*, mixers: Sequence[str], d_models: Sequence[int], seq_lens: Sequence[int],
               num_pairs: Sequence[int], lrs: Sequence[float], vocab: int,
               settings: TrainSettings = TrainSettings(), train_examples: int = 100_000,
               test_examples: int = 3_000, power: float = 0.01, seed: int = 0,
               model_overrides: dict | None = None, max_minutes: float | None = None,
               log: Callable[[str], None] | None = None,
               on_row: Callable[[dict], None] | None = None) -> tuple[list[dict], dict]:
  """Trains every (T, N, d_model, mixer) cell at every LR and tests it on held-out examples.

  Cells with 4N > T are skipped. Loop order: T, N (the data of a (T, N) is drawn once, training
  with `seed`, test with `seed + 1`), d_model, mixer; all LRs of a cell train together.

  Returns:
    (rows, info). rows: one per (cell, lr): mixer, d_model, seq_len, num_pairs, vocab, lr,
    accuracy, best (whether this LR is the cell's best), state_size, params, final_loss,
    train_seconds, steps (trained), partial (the budget stopped it first), converged (its
    loss fell below `settings.stop_loss` first), gate_init and implementation (the model's),
    loss_curve
    ([[step, mean loss], ...] over 24 windows), decay_horizons (`decay_horizons` of the trained
    model, None ungated).
    info: {"complete": bool, "skipped_cells": [...], "partial_cells": [...], "elapsed_s": float,
    "cells": int}.
    With `max_minutes` no cell starts past the budget, and the cell running when it passes
    stops there and is tested as trained (its rows marked partial); the rest are skipped.
  """
  say = log or (lambda m: print(m, file=sys.stderr, flush=True))
  overrides = dict(model_overrides or {})
  cells = [(t, n, d, m) for t in seq_lens for n in num_pairs if 4 * n <= t
           for d in d_models for m in mixers]
  if not cells:
    raise ValueError(f"no cell with 4 * num_pairs <= seq_len in seq_lens={tuple(seq_lens)}, "
                     f"num_pairs={tuple(num_pairs)}.")
  for t in seq_lens:  # validate every task before any compute
    synthetic.MQARConfig(vocab=vocab, seq_len=t, num_pairs=min(num_pairs), power=power)
  for m in mixers:
    sweep_model_config(m, min(d_models), vocab, **overrides)
  tokens_per_cell = settings.total_steps * settings.batch_size * len(lrs)
  total_tokens = sum(tokens_per_cell * t for t, *_ in cells)
  start = time.perf_counter()
  deadline = None if max_minutes is None else start + 60.0 * max_minutes
  rows: list[dict] = []
  done_tokens = 0
  skipped: list[tuple] = []
  data_key, train_data, test_data = None, None, None
  for i, (t, n, d, mixer) in enumerate(cells):
    if deadline is not None and time.perf_counter() > deadline:
      skipped = cells[i:]
      say(f"[mqar] time budget of {max_minutes} min reached: {len(skipped)} of {len(cells)} "
          f"cells not run")
      break
    task = synthetic.MQARConfig(vocab=vocab, seq_len=t, num_pairs=n, power=power)
    if data_key != (t, n):
      count = min(train_examples, settings.total_steps * settings.batch_size)
      train_data = synthetic.mqar(vocab, t, n, count=count, seed=seed, power=power)
      test_data = synthetic.mqar(vocab, t, n, count=test_examples, seed=seed + 1, power=power)
      data_key = (t, n)
    cfg = sweep_model_config(mixer, d, vocab, **overrides)
    run = train_mqar_lrs(cfg, task, lrs, settings, seed=seed, train_data=train_data,
                         deadline=deadline)
    accs = run.accuracies(*test_data)
    finite = [a if math.isfinite(run.losses[-1, j]) else -1.0 for j, a in enumerate(accs)]
    best = int(np.argmax(finite))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(run.models[0])))
    curve = run.loss_curve()
    for j, lr in enumerate(run.lrs):
      row = dict(mixer=mixer, d_model=d, seq_len=t, num_pairs=n, vocab=vocab, lr=lr,
                 accuracy=accs[j],
                 best=j == best, state_size=state_size(cfg, t), params=int(params),
                 final_loss=float(np.mean(run.losses[-max(1, settings.chunk):, j])),
                 train_seconds=run.seconds, steps=run.steps, partial=run.partial,
                 converged=run.converged, gate_init=cfg.gate_init,
                 implementation=cfg.implementation,
                 loss_curve=[[pt[0], pt[1 + j]] for pt in curve],
                 decay_horizons=decay_horizons(run.models[j]))
      rows.append(row)
      if on_row is not None:
        on_row(row)
    done_tokens += tokens_per_cell * t
    elapsed = time.perf_counter() - start
    rate = done_tokens / elapsed
    say(f"[mqar] {i + 1}/{len(cells)} {mixer:>16} d={d:<4} T={t:<4} N={n:<3} best acc "
        f"{accs[best]:.3f} (lr {run.lrs[best]:g}), {run.seconds:.1f}s (first call "
        f"{run.first_call_seconds:.1f}s), {run.examples_per_s:,.0f} ex/s; elapsed "
        f"{_fmt_time(elapsed)}, eta {_fmt_time((total_tokens - done_tokens) / max(rate, 1e-9))}")
    if run.partial:
      skipped = cells[i + 1:]
      say(f"[mqar] time budget of {max_minutes} min reached at step {run.steps}/"
          f"{settings.total_steps} of this cell (its rows say partial); {len(skipped)} of "
          f"{len(cells)} cells not run")
      break
  partial_cells = sorted({(r["seq_len"], r["num_pairs"], r["d_model"], r["mixer"])
                          for r in rows if r["partial"]})
  info = {"complete": not skipped and not partial_cells,
          "skipped_cells": [list(c) for c in skipped],
          "partial_cells": [list(c) for c in partial_cells],
          "elapsed_s": time.perf_counter() - start, "cells": len(cells)}
  return rows, info


def best_rows(rows: Sequence[dict]) -> list[dict]:
  """The best-LR row of each (mixer, d_model, seq_len, num_pairs) cell."""
  return [r for r in rows if r.get("best")]


# ------------------------------------------------------------------------------------ NIAH


def niah_score(model: LanguageModel, tokenizer, tasks: Sequence[synthetic.NiahExample], *,
               max_new_tokens: int = 16, batch_size: int = 8, add_bos: bool = False
               ) -> tuple[list[dict], dict[tuple[str, int], float]]:
  """Greedy decoding with the recurrent cache (`models.decode.generate`) and RULER scoring.

  Prompts of one length budget are right-padded to that budget and decoded `batch_size` at a
  time (a partial last batch is padded with copies), so each length compiles once.

  Returns:
    (per-example rows {task, length, depth, prediction, answers, score}, mean score per
    (task, length)).
  """
  from lineax_attn.models import decode  # pylint: disable=g-import-not-at-top

  if max_new_tokens < 1 or batch_size < 1:
    raise ValueError(f"max_new_tokens ({max_new_tokens}) and batch_size ({batch_size}) must be "
                     f">= 1.")
  if any(not isinstance(x, synthetic.NiahExample) for x in tasks):
    raise ValueError("tasks must be synthetic.NiahExample objects (see synthetic.niah_tasks).")
  eos = getattr(tokenizer, "eos_id", None)
  rows: list[dict] = []
  by_length: dict[int, list[synthetic.NiahExample]] = {}
  for ex in tasks:
    by_length.setdefault(ex.length, []).append(ex)
  for length, group in sorted(by_length.items()):
    width = length + (1 if add_bos else 0)
    for i in range(0, len(group), batch_size):
      part = group[i:i + batch_size]
      ids = []
      for ex in part:
        x = np.asarray(tokenizer.encode(ex.prompt), np.int32)
        if add_bos:
          x = np.concatenate([[tokenizer.bos_id], x]).astype(np.int32)
        if len(x) > width:
          raise ValueError(f"a {ex.task} prompt has {len(x)} tokens, more than its length "
                           f"{length} (was it made with another tokenizer?).")
        ids.append(x)
      ids += [ids[-1]] * (batch_size - len(ids))
      prompt = np.zeros((batch_size, width), np.int32)
      for r, x in enumerate(ids):
        prompt[r, :len(x)] = x
      lengths = np.asarray([len(x) for x in ids], np.int32)
      out = np.asarray(decode.generate(model, jnp.asarray(prompt), max_new_tokens=max_new_tokens,
                                       prompt_lengths=jnp.asarray(lengths)))
      for r, ex in enumerate(part):
        tokens = out[r].tolist()
        if eos is not None and eos in tokens:
          tokens = tokens[:tokens.index(eos)]
        text = tokenizer.decode(tokens)
        rows.append(dict(task=ex.task, length=ex.length, depth=ex.depth, prediction=text,
                         answers=list(ex.answers),
                         score=synthetic.string_match_all(text, ex.answers)))
  means: dict[tuple[str, int], float] = {}
  for key in dict.fromkeys((r["task"], r["length"]) for r in rows):
    means[key] = float(np.mean([r["score"] for r in rows if (r["task"], r["length"]) == key]))
  return rows, means
