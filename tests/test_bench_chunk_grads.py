"""experiments/bench_chunk_grads.py end to end on the CPU, where the kernel runs in JAX's Mosaic
GPU interpreter: both variants are timed and reported; the profiler, which needs a GPU, is
refused with a usage error rather than run wrong."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def _run(*args):
  return subprocess.run([sys.executable, "-m", "experiments.bench_chunk_grads", *args], cwd=ROOT,
                        env=ENV, capture_output=True, text=True, timeout=600)


def test_times_both_variants_in_the_interpreter():
  proc = _run("--shape=1,64,1,64", "--iters=1", "--approx_math=false,true")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "chunk_grads at B1 T64 H1 D64" in proc.stdout
  for name in ("gated (GDN)", "ungated (DeltaNet)", "gated (GDN), approx_math",
               "ungated (DeltaNet), approx_math"):
    assert re.search(rf"^{re.escape(name)}: median \d+ µs, min \d+ µs over 1 calls$",
                     proc.stdout, re.M), proc.stdout


def test_profiling_off_gpu_is_a_usage_error():
  proc = _run("--shape=1,64,1,64", "--profile_dir=/tmp/nowhere")
  assert proc.returncode != 0
  assert "--profile_dir needs a GPU" in proc.stderr
