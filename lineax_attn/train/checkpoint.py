"""Checkpoints: a thin wrapper over orbax's CheckpointManager.

One checkpoint (a step directory under `directory`) holds three items:

* "state": a pytree of arrays, e.g. `{"params": ..., "opt_state": ..., "step": ...}` with the
  params as a pure dict (`nnx.to_pure_dict`), saved with `ocp.args.StandardSave` and restored
  into an abstract target (`jax.ShapeDtypeStruct`s, optionally with shardings) with
  `StandardRestore`, so it can be restored onto a different mesh.
* "data": the grain iterator state, through grain's own orbax handler
  (`grain.checkpoint.CheckpointSave`), one JSON file per process
  (`process_{i}-of-{n}.json`), since each process reads its own shard.
* "config": the run's config as JSON (`ocp.args.JsonSave`): a dict, an ml_collections
  ConfigDict or a dataclass.

Policy: `save_interval_steps` N (`save(step, ...)` writes when step % N == 0;
`save(..., force=True)` writes off the interval, e.g. at the end of training) and `max_to_keep` (older checkpoints are deleted). Saves are
asynchronous for the arrays; the data iterator's state is captured when `save` is called, so the
iterator may advance while the write finishes. Call `wait_until_finished()` before reading the
files and `close()` at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


STATE, DATA, CONFIG = "state", "data", "config"


def _ocp():
  """orbax.checkpoint, with grain (whose orbax handler saves the data iterator) imported too.

  Imported here on first use, not at module import: together they cost about a second per
  process, which a program that imports this module but never checkpoints should not pay."""
  import grain  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp


def _grain_checkpoint():
  import grain  # pylint: disable=g-import-not-at-top
  return grain.checkpoint


class _IteratorSnapshot:
  """The state of a grain iterator at save time, in the form grain's handler writes.

  grain's handler json-dumps `get_state()` of a `DatasetIterator` but calls
  `get_state().decode()` on anything else, so returning the JSON bytes gives the same file.
  """

  def __init__(self, iterator):
    self._state = json.dumps(iterator.get_state(), indent=4).encode()

  def get_state(self) -> bytes:
    return self._state


def config_to_dict(config) -> dict[str, Any] | None:
  """A dict, a ConfigDict (`to_dict`) or a dataclass (`asdict`) as a JSON-able dict."""
  if config is None:
    return None
  if dataclasses.is_dataclass(config) and not isinstance(config, type):
    config = dataclasses.asdict(config)
  elif hasattr(config, "to_dict"):
    config = config.to_dict()
  # Round trip through JSON: tuples become lists, and anything unserialisable fails here.
  return json.loads(json.dumps(dict(config)))


class Checkpointer:
  """Saves and restores (state, data iterator, config) under one directory."""

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
               save_interval_steps: int = 1, async_save: bool = True):
    self.directory = os.path.abspath(os.fspath(directory))
    if save_interval_steps < 1:
      raise ValueError(f"save_interval_steps={save_interval_steps} must be >= 1")
    self.save_interval_steps = save_interval_steps
    ocp = _ocp()
    # The interval is applied here (orbax would also save the first step it is offered).
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=1, create=True,
        enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def should_save(self, step: int) -> bool:
    """Whether `save(step, ...)` writes: step is a multiple of the interval, not yet saved."""
    return step % self.save_interval_steps == 0 and step not in self._manager.all_steps()

  def save(self, step: int, state, *, data_iterator=None, config=None, force: bool = False
           ) -> bool:
    """Saves at `step` if `should_save(step)` (or `force`); returns whether it saved."""
    if not (force or self.should_save(step)):
      return False
    ocp = _ocp()
    args = {STATE: ocp.args.StandardSave(state)}
    if data_iterator is not None:
      args[DATA] = _grain_checkpoint().CheckpointSave(_IteratorSnapshot(data_iterator))
    if config is not None:
      args[CONFIG] = ocp.args.JsonSave(config_to_dict(config))
    return self._manager.save(step, args=ocp.args.Composite(**args), force=True)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def restore(self, step: int | None, abstract_state, *, data_iterator=None):
    """Restores the state (into abstract_state's structure, dtypes and shardings).

    Args:
      step: the step to restore; None = the latest.
      abstract_state: a pytree like the saved state, of `jax.ShapeDtypeStruct` (or arrays).
      data_iterator: if given, a grain iterator of the same pipeline; its state is set in place
        so that it continues with the batch after the saved one.

    Returns:
      The restored state.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint in {self.directory}")
    ocp = _ocp()
    args = {STATE: ocp.args.StandardRestore(abstract_state)}
    if data_iterator is not None:
      args[DATA] = _grain_checkpoint().CheckpointRestore(data_iterator)
    restored = self._manager.restore(step, args=ocp.args.Composite(**args))
    return restored[STATE]

  def restore_config(self, step: int | None = None) -> dict[str, Any]:
    """The config saved with `step` (None = the latest) as a dict."""
    step = self.latest_step() if step is None else step
    ocp = _ocp()
    restored = self._manager.restore(step, args=ocp.args.Composite(**{CONFIG: ocp.args.JsonRestore()}))
    return restored[CONFIG]

  def wait_until_finished(self):
    self._manager.wait_until_finished()

  def close(self):
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
