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


# Under pytest-xdist the suite's wall time is that of the busier worker: a slow test that starts
# last leaves the other worker idle until it ends. So the modules that hold the slow tests run
# first (heaviest first) and the many quick ones fill in behind them. A module's tests stay
# together and in their order (module fixtures are built once per worker). Seconds: each
# module's CPU time (its own process plus its subprocesses) in a -n 0 run on the 2-core
# machine, 2026-12-01 (approximate; only the order matters). Unlisted modules follow, as
# collected. Without xdist the order is the same, which keeps -n 0 runs comparable.
_HEAVY_MODULES_S = {
    "test_scan_layers.py": 213, "test_pallas_tpu.py": 206, "test_chunk_vs_scan.py": 130,
    "test_segments.py": 130, "test_train_sharded.py": 118, "test_notebooks.py": 114,
    "test_channel_pair_kernel.py": 104, "test_jit_edges.py": 105, "test_models.py": 103,
    "test_pallas_gpu_intra.py": 96, "test_context_parallel.py": 93, "test_validation.py": 88,
    "test_pallas_gpu.py": 88, "test_identities.py": 85, "test_resume.py": 81,
    "test_layers.py": 80, "test_fla_compat.py": 78, "test_decode.py": 76,
    "test_eval_recall.py": 72, "test_bench_ops.py": 49, "test_train_loop.py": 48,
    "test_multiprocess.py": 46, "test_compare.py": 45, "test_properties.py": 42,
    "test_bench_parallel.py": 41, "test_inspect.py": 38, "test_linen.py": 36,
    "test_check_mqar_grads.py": 35, "test_cli.py": 35, "test_intra_chunk_parts.py": 33,
    "test_bench_startup.py": 32, "test_attention.py": 30, "test_readme.py": 26,
    "test_row_split.py": 30, "test_configs.py": 24, "test_index_width.py": 23,
    "test_optim.py": 20, "test_chunk_walk.py": 125, "test_chunk_grads.py": 25,
    "test_bench_chunk_grads.py": 15, "test_bench_walks.py": 16, "test_walk_mlir.py": 25,
}


def pytest_collection_modifyitems(session, config, items):
  del session, config
  weight = lambda item: _HEAVY_MODULES_S.get(item.path.name, 0)
  items[:] = sorted(items, key=weight, reverse=True)  # stable: in-module order is kept
