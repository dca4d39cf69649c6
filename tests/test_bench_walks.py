"""experiments/bench_walks.py end to end on the CPU, where the walks run in JAX's Mosaic GPU
interpreter: every walk asked for gets its row, with its CTAs and waves counted as the kernels'
grids make them; bad flags are usage errors."""

from __future__ import annotations

import re

import pytest

from helpers import run_cpu_program

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")


def _run(*args):
  return run_cpu_program("experiments.bench_walks", *args)


def _rows(stdout):
  """{(walk, pieces): (CTAs, waves, chunks)} from the printed table."""
  rows = {}
  for m in re.finditer(r"^\| (\w+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| \d+ \| [\d.]+ \|$",
                       stdout, re.M):
    rows[m[1], int(m[2])] = tuple(int(x) for x in m.group(3, 4, 5))
  return rows


def test_times_every_walk_in_the_interpreter():
  # B1 T256 H1 D64 (one 64-column block a head): whole rows walk 4 chunks; in 2 pieces, 2 rows
  # of 2 chunks, the maps' state [I | S] two blocks wide: 4 chains, 2 CTAs of two.
  proc = _run("--shape=1,256,1,64", "--pieces=1,2", "--iters=1", "--rounds=1")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "walks at B1 T256 H1 D64 (gated)" in proc.stdout
  assert _rows(proc.stdout) == {
      ("walk", 1): (1, 1, 4), ("reverse", 1): (1, 1, 4), ("reverse_states", 1): (1, 1, 4),
      ("walk", 2): (2, 1, 2), ("reverse", 2): (2, 1, 2), ("reverse_states", 2): (2, 1, 2),
      ("maps1", 2): (4, 1, 2), ("maps2", 2): (2, 1, 2)}, proc.stdout


@pytest.mark.parametrize("flag,message", [("--kernels=walk,fast", "--kernels takes"),
                                          ("--pieces=3", "--pieces takes"),
                                          ("--shape=1,256,1,32", "D = 64 or 128")])
def test_bad_flags_are_usage_errors(flag, message):
  proc = _run("--shape=1,256,1,64", flag)
  assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
