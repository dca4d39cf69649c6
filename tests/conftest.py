"""Test set-up: CPU with 8 fake devices (sharding tests), float32 references at HIGHEST."""

import os

# Before jax is imported anywhere: 8 host devices so mesh tests have something to shard over.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
