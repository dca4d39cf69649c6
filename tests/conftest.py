"""Test set-up: CPU with 8 fake devices (sharding tests), float32 references at HIGHEST."""

import os

# Before jax is imported anywhere: 8 host devices so mesh tests have something to shard over.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  _flags += " --xla_force_host_platform_device_count=8"
# The suite's shapes are tiny, so its time is mostly XLA compiling: the CPU backend's
# optimisation level 0 compiles ~1/3 faster (measured on the decode/model/bench tests) and only
# changes how the code is optimised, not what it computes. Subprocesses inherit it.
if "xla_backend_optimization_level" not in _flags:
  _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
