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

# One persistent XLA compilation cache for the run, shared by pytest-xdist's workers and by the
# subprocesses tests start (they inherit the environment): a program several tests compile
# alike (the scan references, a kernel at a shape, a model's step) is compiled once. It starts
# empty (a new temporary directory, made by the process that spawns the workers and removed by
# it at the end), so every run still compiles everything once. Tests whose subject is a fresh
# compile take the `fresh_compiles` fixture, which turns the cache off around them.
_CACHE_OWNER = "LINEAX_TEST_XLA_CACHE_OWNER"
if not _LARGE and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import tempfile  # noqa: E402
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="lineax_attn_xla_cache_")
  os.environ[_CACHE_OWNER] = str(os.getpid())
  # (jax's default, 1 s, leaves out most of the suite's small programs.)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.25")

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_unconfigure(config):
  del config
  if os.environ.get(_CACHE_OWNER) == str(os.getpid()):
    import shutil  # pylint: disable=g-import-not-at-top
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def fresh_compiles():
  """The persistent compilation cache off for one test: every jit in it is an XLA backend
  compile of its own (what tests of compile-dependent behaviour and compile counts need)."""
  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()   # (jax decides whether to use the cache once, at first use)
  yield
  jax.config.update("jax_enable_compilation_cache", before)
  compilation_cache.reset_cache()


# Under pytest-xdist the suite's wall time is that of the busier worker: a slow test that starts
# last leaves the other worker idle until it ends. So the modules that hold the slow tests run
# first (heaviest first) and the many quick ones fill in behind them. A module's tests stay
# together and in their order (module fixtures are built once per worker). Seconds: each
# module's summed test durations in a `make test` run (2 workers) on the 2-core machine,
# 2026-12-06 (approximate; only the order matters; modules under 10 s are left out). Unlisted
# modules follow, as collected. Without xdist the order is the same, which keeps -n 0 runs
# comparable. A new module with slow tests belongs here: unlisted, it runs last.
_HEAVY_MODULES_S = {
    "test_chunk_walk.py": 253, "test_walk_pieces.py": 144, "test_pallas_tpu.py": 112,
    "test_eval_recall.py": 110, "test_notebooks.py": 102, "test_pallas_gpu_intra.py": 92,
    "test_state_pass_pieces.py": 82, "test_models.py": 82, "test_jit_edges.py": 76,
    "test_context_parallel.py": 75, "test_chunk_vs_scan.py": 73,
    "test_state_pass_out_dtype.py": 71, "test_pallas_gpu.py": 70, "test_layers.py": 68,
    "test_chunk_grads.py": 68, "test_channel_pair_kernel.py": 67, "test_scan_layers.py": 63,
    "test_decode.py": 59, "test_state_pass_products.py": 57, "test_segments.py": 57,
    "test_bench_walks.py": 57, "test_train_sharded.py": 56, "test_resume.py": 54,
    "test_validation.py": 52, "test_triton_path.py": 48, "test_fla_compat.py": 47,
    "test_identities.py": 46, "test_bench_ops.py": 41, "test_row_split.py": 38,
    "test_bench_chunk_grads.py": 38, "test_linen.py": 34, "test_train_loop.py": 32,
    "test_remat_conv_norm.py": 30, "test_bench_parallel.py": 29, "test_walk_mlir.py": 27,
    "test_index_width.py": 27, "test_bench_startup.py": 27, "test_compare.py": 25,
    "test_inspect.py": 24, "test_cli.py": 22, "test_multiprocess.py": 21,
    "test_intra_chunk_parts.py": 21, "test_readme.py": 19, "test_configs.py": 18,
    "test_attention.py": 18, "test_state_pass_o_rows.py": 15, "test_properties.py": 15,
    "test_optim.py": 13, "test_xla_cpu_workarounds.py": 12, "test_synthetic.py": 10,
}


def pytest_collection_modifyitems(session, config, items):
  del session, config
  weight = lambda item: _HEAVY_MODULES_S.get(item.path.name, 0)
  items[:] = sorted(items, key=weight, reverse=True)  # stable: in-module order is kept
