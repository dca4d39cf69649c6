"""Test set-up: CPU with 8 fake devices (sharding tests), float32 references at HIGHEST."""

import os

# tests/test_large_index.py (opt-in, LINEAX_LARGE_TESTS=1) runs compiled on a GPU: then JAX keeps
# its default backend and optimised code, and may take 95% of the GPU's memory (default 75%).
_LARGE = os.environ.get("LINEAX_LARGE_TESTS") == "1"
if _LARGE:
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
else:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Before jax is imported anywhere: 8 host devices so mesh tests have something to shard over.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  _flags += " --xla_force_host_platform_device_count=8"
# The suite's shapes are tiny, so its time is mostly XLA compiling: the CPU backend's
# optimisation level 0 compiles ~1/3 faster (measured on the decode/model/bench tests) and only
# changes how the code is optimised, not what it computes. Subprocesses inherit it.
if "xla_backend_optimization_level" not in _flags and not _LARGE:
  _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
