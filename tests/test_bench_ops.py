"""Tests of the op benchmark (`experiments/bench_ops.py`) and its helpers (`lineax_attn/bench.py`).

The benchmark doubles as a consistency check: every chunk row must match the scan reference
(max relative error < 1e-4 in float32, a loose bound on the 1e-5 rms tolerance of docs/MATH.md §9)
and every attention row its dense reference.
"""

from __future__ import annotations

import json

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_ops
from lineax_attn import bench
from lineax_attn import ops

ERR_TOL = 1e-4


def _table_lines(table):
  lines = table.splitlines()
  assert lines[0].startswith("| mixer | implementation | shape | ms fwd | ms fwd+bwd |")
  assert set(lines[1]) <= set("|-")
  return lines[2:]


def test_every_mixer_and_implementation_matches_scan():
  impls = ("scan", "chunk")  # the kernels have their own tests (and run interpreted on CPU)
  cfg = bench_ops.BenchConfig(batch=1, seq_len=32, heads=1, v_heads=2, head_dim_k=16,
                              head_dim_v=16, chunk_size=16, repeats=1, warmup=0,
                              implementations=impls)
  rows = bench_ops.run_benchmark(cfg)
  expected = [(m, i) for m in ops.MIXERS for i in impls] + [("softmax_attention", "xla")]
  assert [(r["mixer"], r["implementation"]) for r in rows] == expected
  for r in rows:
    assert r["note"] == "", r
    assert r["ms_fwd"] > 0 and r["ms_fwd_bwd"] > 0, r
    if r["implementation"] == "scan":
      assert r["err_vs"] == "(reference)" and r["max_rel_err"] is None
    else:
      assert r["err_vs"] in ("scan", "dense ref"), r
      assert r["max_rel_err"] < ERR_TOL, r
  body = _table_lines(bench_ops.format_table(rows))
  assert len(body) == len(rows)
  for line, r in zip(body, rows):
    assert line.startswith(f"| {r['mixer']} | {r['implementation']} | B1 T32 ")


def test_flags_prefix_check_and_json(tmp_path):
  """T > --scan_max_len: the scan is not timed and the errors use the first scan_max_len steps."""
  fv = flags.FlagValues()
  bench_ops.define_flags(fv)
  out = tmp_path / "rows.json"
  fv(["bench_ops", "--batch=1", "--seq_len=48", "--heads=1", "--v_heads=1", "--head_dim_k=16",
      "--head_dim_v=16", "--chunk_size=16", "--repeats=1", "--warmup=0", "--scan_max_len=32",
      "--mixers=gated_delta_rule,softmax_attention", "--implementations=scan,chunk",
      f"--json_out={out}"])
  table = bench_ops.run_from_flags(fv)
  rows = json.loads(out.read_text())["rows"]
  assert len(_table_lines(table)) == len(rows) == 3
  scan, chunk, attn = rows
  assert scan["implementation"] == "scan" and scan["ms_fwd"] is None and scan["ms_fwd_bwd"] is None
  assert "--scan_max_len=32" in scan["note"]
  assert chunk["err_vs"] == "scan, first 32" and chunk["max_rel_err"] < ERR_TOL
  assert chunk["ms_fwd"] > 0 and chunk["ms_fwd_bwd"] > 0
  assert attn["err_vs"] == "dense ref, first 32" and attn["max_rel_err"] < ERR_TOL


def test_default_implementations():
  """Default: every registered implementation, less kernels that would only be interpreted here."""
  impls, attn = bench_ops.resolve_implementations(bench_ops.BenchConfig())
  backend = jax.default_backend()
  expected = tuple(i for i in ops.available_implementations()
                   if bench_ops.KERNEL_BACKENDS.get(i, backend) == backend)
  assert impls == expected and {"scan", "chunk"} <= set(impls)
  assert attn == (("xla", "cudnn") if jax.default_backend() == "gpu" else ("xla",))


def test_unknown_implementation_is_a_usage_error():
  cfg = bench_ops.BenchConfig(implementations=("no_such_implementation",), mixers=("delta_rule",))
  with pytest.raises(app.UsageError, match="not available"):
    bench_ops.run_benchmark(cfg)


def test_max_rel_err_and_timing_helpers():
  ref = np.array([1.0, -4.0, 2.0])
  assert bench.max_rel_err(ref + np.array([0.0, 0.4, 0.0]), ref) == pytest.approx(0.1)
  assert bench.max_rel_err(np.array([np.nan, 0, 0]), ref) == float("inf")
  timing = bench.measure(lambda x: x * 2, jnp.ones(4), repeats=3, warmup=1)
  assert 0 < timing.p20_ms <= timing.median_ms <= timing.p80_ms


def test_bench_kernels_sweep_writes_table_json_and_plot(tmp_path):
  # experiments/bench_kernels.py on CPU (no peers, no kernels): the T sweep at fixed tokens
  # adds one row per length, the table/JSON/plot are written, and the err column compares the
  # chunk form to itself only when pallas_gpu ran (not here).
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  md, js, png = (str(tmp_path / n) for n in ("b.md", "b.json", "b.png"))
  cmd = [sys.executable, "-m", "experiments.bench_kernels", "--shapes=", "--sweep_tokens=256",
         "--sweep_lengths=64,256", "--sweep_hd=2,32", "--impls=chunk", "--modes=fwd",
         "--mixers=gated_delta_rule", "--iters=2", "--warmup=0", f"--out_md={md}",
         f"--out_json={js}", f"--out_png={png}"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0")
  proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  rows = json.load(open(js))["results"]
  assert sorted(tuple(r["shape"]) for r in rows) == [(1, 256, 2, 32), (4, 64, 2, 32)]
  assert all(r["ms"] > 0 and r["impl"] == "chunk" for r in rows)
  text = open(md).read()
  assert "| 4,64,2,32 | gated_delta_rule | fwd |" in text
  assert "| 1,256,2,32 | gated_delta_rule | fwd |" in text
  assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
