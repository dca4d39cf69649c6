"""Tests of the op benchmark (`experiments/bench_ops.py`) and its helpers (`lineax_attn/bench.py`).

The benchmark doubles as a consistency check: every chunk row must match the scan reference
(max relative error < 1e-4 in float32, a loose bound on the 1e-5 rms tolerance of docs/MATH.md §9)
and every attention row its dense reference.
"""

from __future__ import annotations

import json
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_ops
from helpers import FAST_CPU_XLA, run_cpu_python
from lineax_attn import bench
from lineax_attn import ops

ERR_TOL = 1e-4


def _table_lines(table):
  lines = table.splitlines()
  assert lines[0].startswith("| mixer | implementation | shape | ms fwd | ms fwd+bwd |")
  assert set(lines[1]) <= set("|-")
  return lines[2:]


# A mixer of each gate layout (none; β and a scalar g; per-channel g with b and w): the
# program's per-mixer code is generic over `specs` (inputs, jit, timing, check), and chunk ==
# scan for every mixer, forward and backward, is tests/test_chunk_vs_scan.py's. Each further
# mixer only compiled four more programs.
BENCH_MIXERS = ("linear_attention", "gated_delta_rule", "gdn2")


def test_mixers_and_implementations_match_scan():
  impls = ("scan", "chunk")  # the kernels have their own tests (and run interpreted on CPU)
  cfg = bench_ops.BenchConfig(batch=1, seq_len=32, heads=1, v_heads=2, head_dim_k=16,
                              head_dim_v=16, chunk_size=16, repeats=1, warmup=0,
                              mixers=BENCH_MIXERS + ("softmax_attention",),
                              implementations=impls,
                              # pinned: the default adds cuDNN on a GPU
                              attention_implementations=("xla",))
  rows = bench_ops.run_benchmark(cfg)
  assert set(BENCH_MIXERS) < set(ops.MIXERS)
  expected = [(m, i) for m in BENCH_MIXERS for i in impls] + [("softmax_attention", "xla")]
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
      "--attention_implementations=xla", f"--json_out={out}"])
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


def test_timing_from_times_output_and_compiled_memory():
  # Percentiles by hand: sorted [1, 2, 3, 4, 10], rank 0.2 * 4 = 0.8 -> 1.8, 0.8 * 4 = 3.2 -> 5.2.
  timing = bench.Timing.from_times([4.0, 1.0, 10.0, 3.0, 2.0])
  assert (timing.median_ms, timing.repeats) == (3.0, 5)
  assert timing.p20_ms == pytest.approx(1.8) and timing.p80_ms == pytest.approx(5.2)
  with pytest.raises(ValueError, match="times_ms"):
    bench.Timing.from_times([])
  x = jnp.arange(8.0).reshape(2, 4)
  compiled = jax.jit(lambda a: a * 2).lower(x).compile()
  timing, out = bench.measure_with_output(compiled, x, repeats=2, warmup=0)
  np.testing.assert_array_equal(np.asarray(out), 2 * np.arange(8.0).reshape(2, 4))
  assert timing.repeats == 2 and timing.median_ms > 0
  # 8 float32 in, 8 out, nothing donated: 64 bytes (temporaries, if any, only add).
  assert bench.compiled_memory_bytes(compiled) >= 64
  with pytest.raises(ValueError, match="repeats"):
    bench.measure_with_output(compiled, x, repeats=0)


def test_bench_kernels_sweep_writes_table_json_and_plot(tmp_path):
  # experiments/bench_kernels.py on CPU (no peers, no kernels): the T sweep at fixed tokens
  # adds one row per length, the table/JSON/plot are written, and the err column compares the
  # chunk form to itself only when pallas_gpu ran (not here).
  md, js, png = (str(tmp_path / n) for n in ("b.md", "b.json", "b.png"))
  proc = run_cpu_python(
      ["-m", "experiments.bench_kernels", "--shapes=", "--sweep_tokens=256",
       "--sweep_lengths=64,256", "--sweep_hd=2,32", "--impls=chunk", "--modes=fwd",
       "--mixers=gated_delta_rule", "--iters=2", "--warmup=0", f"--out_md={md}",
       f"--out_json={js}", f"--out_png={png}"], xla_flags=FAST_CPU_XLA)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  rows = json.load(open(js))["results"]
  assert sorted(tuple(r["shape"]) for r in rows) == [(1, 256, 2, 32), (4, 64, 2, 32)]
  assert all(r["ms"] > 0 and r["impl"] == "chunk" for r in rows)
  text = open(md).read()
  assert "| 4,64,2,32 | gated_delta_rule | fwd |" in text
  assert "| 1,256,2,32 | gated_delta_rule | fwd |" in text
  # the sweep's own table: the time at each T and the rise, slowest over fastest
  ms = {tuple(r["shape"])[1]: r["ms"] for r in rows}
  row = next(line for line in text.splitlines() if line.startswith("| gated_delta_rule | chunk |"))
  assert row == (f"| gated_delta_rule | chunk | fwd | {ms[64]:.3f} | {ms[256]:.3f} | "
                 f"{max(ms.values()) / min(ms.values()):.2f}x |")
  assert "| mixer | impl | mode | B4 T64 | B1 T256 | rise |" in text
  assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_sweep_points_are_timed_ends_first():
  # lineax_attn.bench.sweep_timing_order on the must sweep's five lengths (B, T, H, D): T 65,536
  # and T 1,024 first, then the inner points from long to short; any order in, the same out.
  points = [(65536 // t, t, 16, 128) for t in (1024, 2048, 4096, 16384, 65536)]
  want = [(1, 65536, 16, 128), (64, 1024, 16, 128), (4, 16384, 16, 128), (16, 4096, 16, 128),
          (32, 2048, 16, 128)]
  assert bench.sweep_timing_order(points) == want
  assert bench.sweep_timing_order(points[::-1]) == want
  assert bench.sweep_timing_order(points[:2]) == [points[1], points[0]]
  assert bench.sweep_timing_order([]) == []


def test_sweep_rise_says_when_points_are_missing():
  # The sweep table's rise column (experiments/bench_kernels.py): slowest over fastest of the
  # known points, saying how many of the sweep's it covers when the budget skipped some.
  assert bench.sweep_rise([3.0, 3.3, None]) == "1.10x (2 of 3 points)"
  assert bench.sweep_rise([2.0, 2.0, 3.0]) == "1.50x"
  assert bench.sweep_rise([5.0, None, None]) == "–"
  assert bench.sweep_rise([]) == "–"


def test_bench_kernels_past_its_time_budget_makes_no_inputs(tmp_path):
  # Past --time_budget_s every point is skipped, and a skipped shape's host inputs are never
  # made (on an H100 making KDA's at B1 T65536 H16 overran a device call): the program runs
  # with make_inputs replaced by one that fails.
  js = tmp_path / "b.json"
  code = ("import sys; from absl import app; from experiments import bench_kernels as bk, cli\n"
          "def made(*a): raise AssertionError(f'inputs made for {a}')\n"
          "bk.make_inputs = made\n"
          "app.run(bk.main, argv=sys.argv, flags_parser=cli.parse_flags)\n")
  proc = run_cpu_python(
      ["-c", code, "--shapes=", "--sweep_tokens=256", "--sweep_lengths=64,256",
       "--sweep_hd=2,32", "--impls=chunk", "--modes=fwd", "--mixers=kda,gated_delta_rule",
       "--time_budget_s=0", f"--out_json={js}"])
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  rows = json.load(open(js))["results"]
  assert len(rows) == 4 and all(r["note"] == "skipped (time budget)" for r in rows), rows


def test_error_verdict_marks_nan_inf_and_large_errors():
  tol = bench.error_tolerance(jnp.float32, "chunk")
  assert tol == bench.MAX_REL_ERR_FLOAT32
  assert bench.error_tolerance(jnp.bfloat16, "chunk") == bench.MAX_REL_ERR_LOW_PRECISION
  assert bench.error_tolerance(jnp.float32, "pallas_gpu") == bench.MAX_REL_ERR_LOW_PRECISION
  assert bench.error_verdict(None, tol) == ""
  assert bench.error_verdict(tol / 2, tol) == "ok"
  for bad in (2 * tol, float("nan"), float("inf"), 1.85e34):
    assert bench.error_verdict(bad, tol).startswith("WRONG"), bad


@pytest.fixture
def doubled_implementation():
  """A registered implementation whose output is twice the chunk form's: a wrong kernel."""
  from lineax_attn.ops import api
  from lineax_attn.ops import chunked

  def doubled(*args, **kwargs):
    o, s, r = chunked.chunk_delta_family(*args, **kwargs)
    return 2.0 * o, s, r

  api.register_implementation("doubled", doubled)
  yield "doubled"
  del api._IMPLEMENTATIONS["doubled"]  # pylint: disable=protected-access


def test_wrong_row_is_marked_and_the_program_exits_nonzero(tmp_path, doubled_implementation):
  fv = flags.FlagValues()
  bench_ops.define_flags(fv)
  out = tmp_path / "rows.json"
  fv(["bench_ops", "--batch=1", "--seq_len=32", "--heads=1", "--v_heads=1", "--head_dim_k=16",
      "--head_dim_v=16", "--chunk_size=16", "--repeats=1", "--warmup=0",
      "--mixers=delta_rule", f"--implementations=chunk,{doubled_implementation}",
      f"--json_out={out}"])
  with pytest.raises(SystemExit) as exit_info:
    bench_ops.run_from_flags(fv)
  assert exit_info.value.code == 1
  rows = {r["implementation"]: r for r in json.loads(out.read_text())["rows"]}  # still written
  assert rows["chunk"]["check"] == "ok"
  assert rows["doubled"]["check"].startswith("WRONG") and rows["doubled"]["max_rel_err"] > 0.5


def test_bench_kernels_exits_nonzero_on_a_row_over_its_error_tolerance(tmp_path):
  # Re-tabling a run (--merge_json) whose pallas_gpu forward was off from the chunk form by 2 %:
  # above --err_tol (6e-3) the row is marked WRONG in the table and the program exits 1.
  old = {"meta": {"date": "2026-12-01", "device": "NVIDIA H200", "jax": "0.11.2"},
         "results": [{"shape": [1, 64, 2, 64], "mixer": "kda", "impl": "pallas_gpu",
                      "mode": "fwd", "ms": 1.0, "q20": 1.0, "q80": 1.0, "peak_gib": 0.1,
                      "err_vs_chunk": 0.02, "note": ""}]}
  js, md = tmp_path / "old.json", tmp_path / "b.md"
  js.write_text(json.dumps(old))
  proc = run_cpu_python(
      ["-m", "experiments.bench_kernels", "--shapes=", "--sweep_lengths=", "--impls=chunk",
       "--modes=fwd", "--mixers=kda", f"--merge_json={js}", f"--out_md={md}"],
      xla_flags=FAST_CPU_XLA)
  assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert "2.0e-02 WRONG" in md.read_text()
  assert "over --err_tol=0.006" in proc.stdout


def test_bench_kernels_refuses_a_mode_it_cannot_time(tmp_path):
  # bench_kernels times fwd and fwdbwd only (FLA, cuDNN and SDPA have no other): bench_ab's
  # fwdbwd_dep or fwdbwd_grads is refused with the flag's name, before anything runs.
  proc = run_cpu_python(
      ["-m", "experiments.bench_kernels", "--shapes=", "--sweep_lengths=", "--impls=chunk",
       "--modes=fwd,fwdbwd_grads", "--mixers=kda", f"--out_md={tmp_path / 'b.md'}"])
  assert proc.returncode != 0
  assert "--modes must be fwd and/or fwdbwd" in proc.stderr
  assert not (tmp_path / "b.md").exists()


def test_traffic_floor_counts_each_tensor_once():
  # Hand count at B1 T2 H1 HV1 K=V=2, bf16 io and float32 gates; tb_s=1e-9 makes ms = bytes.
  # GDN: q, k 16 B, v 8, gates g and beta 2 x 8, o 8 -> fwd 48; the backward reads q, k, v,
  # gates, do (48) and writes dq, dk, dv, dgates (40): 136.
  floor = lambda mixer, mode: bench.traffic_floor_ms(
      mixer, mode, batch=1, seq_len=2, heads=1, v_heads=1, head_dim_k=2, head_dim_v=2,
      tb_s=1e-9)
  assert floor("gated_delta_rule", "fwd") == pytest.approx(48)
  assert floor("gated_delta_rule", "fwdbwd") == pytest.approx(136)
  assert floor("kda", "fwd") == pytest.approx(56)          # g per key channel: 16 B, beta 8
  assert floor("linear_attention", "fwd") == pytest.approx(32)
  with pytest.raises(ValueError, match="mode"):
    floor("kda", "bwd")
  # At the shape (B4 T4096 H16 D128): one [B, T, H, D] bf16 tensor is 67.1 MB, the two
  # scalar gates 2.1 MB, so GDN moves 4 x 67.1 + 2.1 forward (q, k, v, o; gates) and
  # 7 x 67.1 + 2 x 2.1 backward (q, k, v, do in, dq, dk, dv out; gates in, their cotangents
  # out) = 744.5 MB: 0.155 ms at 4.8 TB/s.
  assert bench.traffic_floor_ms("gdn", "fwdbwd", batch=4, seq_len=4096, heads=16, v_heads=16,
                                head_dim_k=128, head_dim_v=128) == pytest.approx(0.1551, rel=1e-3)
  # The same bytes at an H100 SXM's 3.35 TB/s (the name its device_kind gives): 0.222 ms.
  tb_s = bench.hbm_tb_s("NVIDIA H100 80GB HBM3")
  assert tb_s == 3.35 and bench.hbm_tb_s("NVIDIA H200") == 4.8 and bench.hbm_tb_s("cpu") == 4.8
  assert bench.traffic_floor_ms("gdn", "fwdbwd", batch=4, seq_len=4096, heads=16, v_heads=16,
                                head_dim_k=128, head_dim_v=128, tb_s=tb_s) == pytest.approx(
                                    0.7445 / 3.35, rel=1e-3)
  with pytest.raises(ValueError, match="device_kind"):
    bench.hbm_tb_s(None)


def test_settle_calls_every_step_until_its_seconds_have_passed():
  # lineax_attn.bench.settle, on stand-in steps that take 10 ms: the oracle is the clock and a
  # count of calls. Rounds of every step in turn until 50 ms have passed, at least one round,
  # each call waited for.
  log = []
  def step(name):
    return bench.Step(lambda: time.sleep(0.01) or name,
                      lambda out: log.append(("wait", out)))
  t0 = time.perf_counter()
  rounds = bench.settle({"a": step("a"), "b": step("b")}, seconds=0.05)
  assert time.perf_counter() - t0 >= 0.05
  assert 1 <= rounds <= 3                     # >= 20 ms a round: the third reaches 50 ms
  assert log == [("wait", n) for _ in range(rounds) for n in ("a", "b")]
  plain = []
  assert bench.settle({"x": lambda: plain.append(1)}, seconds=0.0) == 1 and plain == [1]
  # In the rounds' own mode (as `interleave` settles): queued, each round launches `iters`
  # calls of a step back to back and waits once, for the last.
  events = []
  def queued(name):
    count = iter(range(100))
    return bench.Step(lambda: events.append(("call", name)) or (name, next(count)),
                      lambda out: events.append(("wait", out)))
  assert bench.settle({"a": queued("a"), "b": queued("b")}, seconds=0.0, iters=3,
                      timing="queued") == 1
  assert events == [("call", "a")] * 3 + [("wait", ("a", 2))] + [("call", "b")] * 3 + [
      ("wait", ("b", 2))]
  with pytest.raises(ValueError, match="seconds"):
    bench.settle({"x": lambda: None}, seconds=-1.0)
  # `measure`'s settle (bench_kernels --settle_s): after the first call, 10 ms calls until 50 ms
  # have passed (at most 5 of them: sleeps only overrun), then the warm-up and the timed calls.
  calls = []
  def slow(x):
    calls.append(time.perf_counter())
    time.sleep(0.01)
    return x
  timing = bench.measure(slow, jnp.ones(2), repeats=2, warmup=1, settle_s=0.05)
  assert timing.repeats == 2 and timing.median_ms >= 10
  settled = len(calls) - 1 - 1 - 2
  assert 1 <= settled <= 5 and calls[1 + settled] - calls[1] >= 0.049
  with pytest.raises(ValueError, match="settle_s"):
    bench.measure_with_output(slow, jnp.ones(2), settle_s=-1.0)


def test_bench_ab_rotates_the_order_and_pairs_ratios_within_a_round():
  # experiments/bench_ab.py's logic with stand-in steps (plain Python calls: what is timed is
  # irrelevant here): every variant runs once per round, the first one rotates, and the ratio
  # column is the median over rounds of (variant / baseline) in the same round, which a drift
  # common to both cancels out of.
  from experiments import bench_ab
  order = []
  steps = {n: (lambda n=n: order.append(n)) for n in ("a", "b", "c")}
  medians = bench_ab.interleave(steps, rounds=4, iters=1, warmup=0, settle_s=0.0)
  assert order[:3] == ["a", "b", "c"]                  # settle_s=0: one untimed call each first
  timed = order[3:]
  assert timed[::3] == ["a", "b", "c", "a"]            # round r starts with variant r mod 3
  assert all(len(set(timed[3 * r:3 * r + 3])) == 3 for r in range(4))
  assert {n: len(m) for n, m in medians.items()} == {"a": 4, "b": 4, "c": 4}
  # A baseline that drifts 1 -> 3 ms and a variant at 0.9x of it in every round: a ratio of
  # the overall medians could say anything between 0.3x and 2.7x; the paired one says 0.9x.
  rows = {r["variant"]: r for r in bench_ab.summarise(
      {"base": [1.0, 3.0, 2.0], "fast": [0.9, 2.7, 1.8]}, "base")}
  assert rows["fast"]["ratio_median"] == pytest.approx(0.9)
  assert rows["fast"]["ratio_min"] == pytest.approx(0.9)
  assert rows["fast"]["rounds_faster"] == 3
  assert rows["base"]["median_ms"] == 2.0 and "ratio_median" not in rows["base"]
  text = bench_ab.to_markdown({("delta_rule", "fwd"): list(rows.values())},
                              {"date": "d", "device": "cpu", "shape": [1, 2, 3, 4],
                               "rounds": 3, "iters": 2, "baseline": "base"})
  assert "| fast | 1.800 | 0.900-2.700 | 0.900x (0.900-0.900) | 3/3 |" in text
  # Queued timing: a round launches its calls back to back and waits once, for the last one;
  # waited timing waits for each. Counted on stand-in steps; a real compiled step runs both.
  log = []
  step = bench_ab.Step(lambda: log.append("call") or len(log), lambda x: log.append(("wait", x)))
  bench_ab.time_round(step, iters=3, warmup=1, timing="queued")
  assert log == ["call", ("wait", 1), "call", "call", "call", ("wait", 5)]
  log.clear()
  bench_ab.time_round(step, iters=2, warmup=0, timing="waited")
  assert log == ["call", ("wait", 1), "call", ("wait", 3)]
  with pytest.raises(ValueError, match="timing"):
    bench_ab.interleave({"a": step}, rounds=1, iters=1, warmup=0, timing="cuda_events")
  real = bench_ab.jax_step(lambda x: jnp.sin(x) @ x, (jnp.ones((64, 64)),))
  for timing in bench_ab.TIMINGS:
    assert bench_ab.time_round(real, iters=3, warmup=1, timing=timing) > 0
  with pytest.raises(ValueError, match="unknown implementation"):
    bench_ab.make_step("nope", "delta_rule", "fwd", None)
  with pytest.raises(ValueError, match="only our implementations"):
    bench_ab.make_step("fla:batched", "delta_rule", "fwd", None)
  with pytest.raises(ValueError, match="only our implementations"):
    bench_ab.make_step("jla@state_pass=triton", "delta_rule", "fwd", None)
  assert bench_ab.parse_variant("triton:tiles") == ("triton", "tiles", None, None, {}, None)
  assert bench_ab.parse_variant("pallas_gpu@state_pass=triton;remat_intra=false") == (
      "pallas_gpu", None, ops.GpuTuning(state_pass="triton", remat_intra=False), None, {},
      None)
  assert bench_ab.parse_variant("triton:tiles+ffi") == ("triton", "tiles", None, "ffi", {},
                                                        None)
  assert bench_ab.parse_variant("pallas_gpu@state_pass=triton+legacy") == (
      "pallas_gpu", None, ops.GpuTuning(state_pass="triton"), "legacy", {}, None)
  assert bench_ab.parse_variant("triton@forward=fused#scores=stored;launch=16:4:2/8+ffi") == (
      "triton", None, ops.GpuTuning(forward="fused"), "ffi",
      {"scores": "stored", "launch": (16, 4, 2)}, 8)
  assert bench_ab.parse_variant("chunk/4").pieces == 4
  with pytest.raises(ValueError, match="pieces '0'"):
    bench_ab.parse_variant("pallas_gpu/0")
  with pytest.raises(ValueError, match="only our implementations"):
    bench_ab.parse_variant("jla/4")
  with pytest.raises(ValueError, match="need @forward=fused"):
    bench_ab.parse_variant("triton#scores=stored")
  # The T0 kernel's launch is a knob of the walks too (no @forward=fused needed).
  assert bench_ab.parse_variant("pallas_gpu#t0=8:64:tiles").knobs == {"t0": (8, 64, "tiles")}
  with pytest.raises(ValueError, match="T0 launch"):
    bench_ab.parse_variant("pallas_gpu#t0=3:64:tiles")
  with pytest.raises(ValueError, match="T0 launch"):
    bench_ab.parse_variant("pallas_gpu#t0=4:64:blocked")
  with pytest.raises(ValueError, match="T0 knob"):
    bench_ab.parse_variant("pallas_gpu#t0=a:64:tiles")
  with pytest.raises(ValueError, match="fused knob 'launch=16:4'"):
    bench_ab.parse_variant("triton@forward=fused#launch=16:4")
  with pytest.raises(ValueError, match="fused knob 'scores=cached'"):
    bench_ab.parse_variant("triton@forward=fused#scores=cached")
  with pytest.raises(ValueError, match="call target"):
    bench_ab.parse_variant("triton+cuda_graph")
  with pytest.raises(ValueError, match="only our implementations"):
    bench_ab.parse_variant("jla+ffi")
  with pytest.raises(ValueError, match="state_pass"):
    bench_ab.parse_variant("pallas_gpu@state_pass=cuda")


def test_dependent_cotangent_adds_the_outputs_own_gradient():
  # fwdbwd_dep's loss is <o, do> + w |o|² / 2: for a linear map o = a x its gradient is
  # aᵀ (do + w o) (hand-derived), where fwdbwd's is aᵀ do.
  from experiments import peer_ops
  a = jnp.array([[2.0, 0.0], [1.0, 3.0]])
  x, do = jnp.array([1.0, -1.0]), jnp.array([0.5, 2.0])
  loss, (fixed,) = peer_ops.grad_fn(lambda x_: a @ x_, 1)(do, x)
  dep_loss, (dep,) = peer_ops.grad_fn(lambda x_: a @ x_, 1, dependent=True)(do, x)
  (alone,) = peer_ops.grad_fn(lambda x_: a @ x_, 1, with_loss=False)(do, x)
  o = a @ x
  np.testing.assert_allclose(loss, o @ do, rtol=1e-6)
  np.testing.assert_allclose(dep_loss, o @ do + 0.5 * peer_ops.DEP_WEIGHT * (o @ o), rtol=1e-6)
  np.testing.assert_allclose(fixed, a.T @ do, rtol=1e-6)
  np.testing.assert_allclose(alone, a.T @ do, rtol=1e-6)
  np.testing.assert_allclose(dep, a.T @ (do + peer_ops.DEP_WEIGHT * o), rtol=1e-6)
  with pytest.raises(ValueError, match="mode"):
    peer_ops.jax_call(lambda *a_: a_[0], (x, x, x, {}), "bwd")


def test_fwdbwd_makes_the_output_where_fwdbwd_grads_may_drop_it():
  # An op whose VJP saves no output (as jla's GDN forward): o = sin(x), its backward cos(x) g.
  # With the gradients alone XLA removes sin (nothing reads o); "fwdbwd" returns the loss, so
  # o is made, as a training step makes it. Read from the compiled programs' HLO.
  from experiments import peer_ops

  @jax.custom_vjp
  def op(x, y, z):
    return jnp.sin(x) * y * z

  op.defvjp(lambda x, y, z: (op(x, y, z), (x, y, z)),
            lambda res, g: (jnp.cos(res[0]) * res[1] * res[2] * g,
                            jnp.zeros_like(res[1]), jnp.zeros_like(res[2])))
  np_in = tuple(np.linspace(0.1, 1.0, 8, dtype=np.float32).reshape(1, 8, 1, 1) for _ in range(3))

  def compiled_text(mode):
    fn, args = peer_ops.jax_call(op, np_in + ({},), mode)
    return jax.jit(fn).lower(*args).compile().as_text()

  assert " sine(" in compiled_text("fwdbwd")
  assert " sine(" in compiled_text("fwdbwd_dep")
  assert " sine(" not in compiled_text("fwdbwd_grads")
  assert " cosine(" in compiled_text("fwdbwd_grads")
