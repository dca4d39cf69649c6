"""experiments/bench_chunk_grads.py end to end on the CPU, where the kernel runs in JAX's Mosaic
GPU interpreter: both variants are timed and reported; the profiler, which needs a GPU, is
refused with a usage error rather than run wrong."""

from __future__ import annotations

import re

import pytest

from helpers import run_cpu_program

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")


def _run(*args):
  return run_cpu_program("experiments.bench_chunk_grads", *args)


def test_times_every_variant_in_the_interpreter():
  proc = _run("--shape=1,64,1,64", "--iters=1", "--rounds=1", "--approx_math=false,true",
              "--join_exit=false,true")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "chunk_grads at B1 T64 H1 D64" in proc.stdout
  names = [f"{kind}{approx}{join}" for approx in ("", ", approx_math")
           for kind, joins in (("gated (GDN)", ("", ", join_exit")), ("ungated (DeltaNet)", ("",)))
           for join in joins]
  assert len(names) == 6
  for name in names:
    assert re.search(rf"^{re.escape(name)}: median \d+ µs a call, min \d+ µs, over 1 rounds "
                     rf"of 1 queued calls$", proc.stdout, re.M), proc.stdout
  bad = _run("--shape=1,64,1,64", "--join_exit=maybe")
  assert bad.returncode != 0 and "--join_exit takes false and/or true" in bad.stderr


def test_times_the_two_warpgroup_kernel():
  proc = _run("--shape=1,64,1,64", "--iters=1", "--rounds=1", "--warpgroups=2")
  assert proc.returncode == 0, proc.stderr[-2000:]
  for kind in ("gated (GDN)", "ungated (DeltaNet)"):
    assert re.search(rf"^{re.escape(kind)}, join_exit, 2 warpgroups: median \d+ µs a call",
                     proc.stdout, re.M), proc.stdout
  assert not re.search(r"^gated \(GDN\): median", proc.stdout, re.M)   # 1 was not asked for
  bad = _run("--shape=1,64,1,64", "--warpgroups=3")
  assert bad.returncode != 0 and "--warpgroups takes 1 and/or 2" in bad.stderr


def test_profiling_off_gpu_is_a_usage_error():
  proc = _run("--shape=1,64,1,64", "--profile_dir=/tmp/nowhere")
  assert proc.returncode != 0
  assert "--profile_dir needs a GPU" in proc.stderr
