"""experiments/walk_mlir.py on the CPU: every walk kernel lowered for CUDA, a table row and an
MLIR text each; the text is the same for the same kernel and tells `overlap`'s apart."""

from __future__ import annotations

import re

import pytest

from helpers import run_cpu_program

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

NAMES = ["forward, gated", "forward, ungated", "forward, saving states",
         "forward, linear attention", "reverse, gated", "reverse, ungated",
         "reverse, states only", "reverse, linear attention", "maps, 1 chain", "maps, 2 chains"]


def test_lowers_every_walk_and_writes_its_text(tmp_path):
  out = tmp_path / "walks.mlir"
  proc = run_cpu_program("experiments.walk_mlir", "--head_dims=64", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = re.findall(r"^\| ([a-z0-9 ,]+) \| 64 \| (\d+) \| (\d+) \| ([0-9a-f]{12}) \|$",
                    proc.stdout, re.M)
  assert [r[0] for r in rows] == NAMES, proc.stdout
  # wgmma ops: the forward and reverse walks six (linear attention four), the maps' walk three
  # a chain.
  assert [int(r[1]) for r in rows] == [6, 6, 6, 4, 6, 6, 6, 4, 3, 6]
  texts = out.read_text().split("\n//----\n")
  assert [t.splitlines()[0] for t in texts] == [f"// {n}, K 64" for n in NAMES]
  assert all("mosaic_gpu.wgmma" in t and "loc(" not in t for t in texts)


def test_same_kernel_same_text_and_overlap_changes_only_the_walks():
  from experiments import walk_mlir  # pylint: disable=g-import-not-at-top
  serial = {name: (fn, args) for name, fn, args in walk_mlir._kernels(64, False)}
  overlapped = {name: (fn, args) for name, fn, args in walk_mlir._kernels(64, True)}
  text = lambda kernels, name: walk_mlir.lower(*kernels[name])[0]
  forward = text(serial, "forward, gated")
  assert text(serial, "forward, gated") == forward          # lowered twice: the same text
  assert text(overlapped, "forward, gated") != forward
  assert text(overlapped, "maps, 1 chain") == text(serial, "maps, 1 chain")   # no such option


def test_bad_head_dims_are_a_usage_error():
  proc = run_cpu_program("experiments.walk_mlir", "--head_dims=96")
  assert proc.returncode != 0 and "--head_dims takes 64" in proc.stderr, proc.stderr[-2000:]
