"""experiments/bench_walks.py end to end on the CPU, where the walks run in JAX's Mosaic GPU
interpreter: every walk asked for gets its row, with its CTAs and waves counted as the kernels'
grids make them; bad flags are usage errors."""

from __future__ import annotations

import json
import re

import pytest

from helpers import run_cpu_program

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")


def _run(*args):
  return run_cpu_program("experiments.bench_walks", *args)


def _rows(stdout):
  """{(walk, overlap, pieces): (CTAs, waves, chunks)} from the printed table."""
  rows = {}
  for m in re.finditer(r"^\| (\w+) \| (–|[a-z_+]+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| "
                       r"\d+ \| [\d.]+ \|$", stdout, re.M):
    rows[m[1], m[2], int(m[3])] = tuple(int(x) for x in m.group(4, 5, 6))
  return rows


def test_times_every_walk_in_the_interpreter():
  # B1 T128 H1 D64 (one 64-column block a head): whole rows walk 2 chunks; in 2 pieces, 2 rows
  # of 1 chunk, the maps' state [I | S] two blocks wide: 4 chains, 2 CTAs of two.
  proc = _run("--shape=1,128,1,64", "--pieces=1,2", "--iters=1", "--rounds=1")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "walks at B1 T128 H1 D64 (gated)" in proc.stdout
  assert _rows(proc.stdout) == {
      ("walk", "false", 1): (1, 1, 2), ("reverse", "false", 1): (1, 1, 2),
      ("reverse_states", "false", 1): (1, 1, 2), ("walk", "false", 2): (2, 1, 1),
      ("reverse", "false", 2): (2, 1, 1), ("reverse_states", "false", 2): (2, 1, 1),
      ("maps1", "–", 2): (4, 1, 1), ("maps2", "–", 2): (2, 1, 1)}, proc.stdout


def test_times_the_overlap_values_of_the_walks(tmp_path):
  # --overlap=false,publish+group,true: a row for each value of the forward walk, whose parts
  # the reverse walks read as true (one row each for false and true), and --made_m one more
  # forward row; --approx_math reaches every walk; the JSON holds the rows.
  out = tmp_path / "walks.json"
  proc = _run("--shape=1,128,1,64", "--pieces=1", "--kernels=walk,reverse",
              "--overlap=false,publish+group,true", "--made_m", "--approx_math", "--iters=1",
              "--rounds=1", f"--out_json={out}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  want = {("walk", o, 1): (1, 1, 2) for o in ("false", "publish+group", "true", "made_m")}
  want.update({("reverse", o, 1): (1, 1, 2) for o in ("false", "true")})
  assert _rows(proc.stdout) == want, proc.stdout
  saved = json.loads(out.read_text())
  assert saved["shape"] == [1, 128, 1, 64] and saved["gated"] is True
  assert saved["approx_math"] is True
  assert {(r["walk"], r["overlap"]) for r in saved["rows"]} == {(w, o) for w, o, _ in want}
  assert all(len(r["rounds_ms"]) == 1 and r["us_call"] > 0 for r in saved["rows"])


@pytest.mark.parametrize("flag,message", [("--kernels=walk,fast", "--kernels takes"),
                                          ("--pieces=3", "--pieces takes"),
                                          ("--overlap=maybe", "--overlap takes"),
                                          ("--overlap=publish+late", "--overlap takes"),
                                          ("--shape=1,256,1,32", "D = 64 or 128")])
def test_bad_flags_are_usage_errors(flag, message):
  proc = _run("--shape=1,256,1,64", flag)
  assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
