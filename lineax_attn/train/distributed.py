"""Multi-process start-up: `jax.distributed.initialize` behind a switch, detected on clusters.

`initialize(mode)` must run before anything touches a JAX backend (before `jax.devices()`):

* "auto" (default): initialize when the environment says this is one process of several:
  SLURM with more than one task (`SLURM_NTASKS`/`SLURM_NPROCS` > 1), a multi-host TPU slice
  (`TPU_WORKER_HOSTNAMES` with more than one host, or `MEGASCALE_NUM_SLICES` > 1), Open MPI
  (`OMPI_COMM_WORLD_SIZE` > 1) or an explicit coordinator (`JAX_COORDINATOR_ADDRESS`). JAX's
  own cluster detection then fills in the coordinator, the process count and the process id.
* "on": always initialize (with any arguments given, else JAX's auto-detection).
* "off": a single process.

Locally (tests, two processes on one machine) pass the coordinator explicitly:
`initialize("on", coordinator_address="localhost:12345", num_processes=2, process_id=i)`.
"""

from __future__ import annotations

import os

MODES = ("auto", "on", "off")


def _int_env(name: str) -> int:
  try:
    return int(os.environ.get(name, "0"))
  except ValueError:
    return 0


def detect_cluster() -> str | None:
  """The name of the multi-process environment this process runs in, or None."""
  if max(_int_env("SLURM_NTASKS"), _int_env("SLURM_NPROCS")) > 1:
    return "slurm"
  hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
  if len(hosts) > 1 or _int_env("MEGASCALE_NUM_SLICES") > 1:
    return "tpu_pod"
  if _int_env("OMPI_COMM_WORLD_SIZE") > 1:
    return "mpi"
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    return "coordinator"
  return None


def initialize(mode: str = "auto", *, coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None,
               local_device_ids=None) -> bool:
  """Starts the multi-process runtime if `mode` asks for it; returns whether it did."""
  if mode not in MODES:
    raise ValueError(f"distributed mode {mode!r}; expected one of {MODES}")
  explicit = coordinator_address is not None
  if mode == "off" or (mode == "auto" and not explicit and detect_cluster() is None):
    return False
  import jax  # pylint: disable=g-import-not-at-top

  kwargs = {}
  if coordinator_address is not None:
    kwargs["coordinator_address"] = coordinator_address
  if num_processes is not None:
    kwargs["num_processes"] = num_processes
  if process_id is not None:
    kwargs["process_id"] = process_id
  if local_device_ids is not None:
    kwargs["local_device_ids"] = local_device_ids
  jax.distributed.initialize(**kwargs)
  return True
