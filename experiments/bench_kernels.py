"""Op-level timing of every linear mixer against its peers (docs/MATH.md §7.3), in one process.

    python3 -m experiments.bench_kernels --shapes=4,4096,16,128 --out_md=/tmp/bench.md

Times, for each shape (B, T, H, D) and mixer, forward and forward+backward (median of
`--iters` runs after `--warmup`, each ending in `block_until_ready` / `cuda.synchronize`):

* ours: `implementation="pallas_gpu"`, `"triton"` (jax-triton; --impls=triton,...), `"chunk"`,
  and `"scan"` (forward only, T <= --scan_max_t);
* jax-linear-attention 0.1.0 (`jla.ops.linear_attention(kind, ..., impl="mosaic_gpu")`);
* FLA (fla-core) through torch, for the mixers in --fla_mixers (it autotunes 90-200 s per op);
* causal softmax attention: cuDNN via `jax.nn.dot_product_attention(implementation="cudnn")`
  and torch SDPA.

Each peer runs only if importable. JAX timing, the 20/80 percentiles and the compiled memory
are `lineax_attn.bench`'s (`measure_with_output`, `compiled_memory_bytes`). Peak memory: for JAX,
arguments + outputs + temporaries of the compiled executable; for torch, `max_memory_allocated` over the call. Writes a Markdown
table with the ratios ours/jla, ours/FLA, ours/chunk, ours/cuDNN (--out_md; a file that holds
the markers below gets only the text between them replaced) and a JSON file of raw numbers.

`--breakdown` also times the parts of pallas_gpu GDN (XLA preparation per solve, each kernel,
the whole op with the XLA or the Mosaic GPU intra-chunk part: `GpuTuning.intra` A/B);
`--skip=mixer:impl[:T]` and `--merge_json=run1.json` split a long run over several device calls;
`--time_budget_s` stops starting new entries after that many seconds (results are written after
every entry, so a killed run still leaves its table); the T sweep's points run ends first
(`bench.sweep_timing_order`), so a budget drops inner points, not an end of the rise.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave memory for torch

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import cli  # noqa: E402
from experiments import peer_ops  # noqa: E402
from experiments.peer_ops import make_inputs  # noqa: E402
from lineax_attn import bench  # noqa: E402
from lineax_attn import ops  # noqa: E402

_SHAPES = flags.DEFINE_string("shapes", "4,4096,16,128;2,16384,16,128",
                              "';'-separated B,T,H,D (H = q/k and value heads, D = K = V).")
_MIXERS = flags.DEFINE_list("mixers", "gated_delta_rule,kda,delta_rule,gdn2,linear_attention",
                            "Mixers in priority order.")
_IMPLS = flags.DEFINE_list("impls", "pallas_gpu,chunk,scan,jla,fla,cudnn,sdpa", "What to time.")
_MODES = flags.DEFINE_list("modes", "fwd,fwdbwd", "fwd and/or fwdbwd (the loss <o, do> and its "
                           "gradients: `peer_ops.MODES`).")
_FLA_MIXERS = flags.DEFINE_list("fla_mixers", "gated_delta_rule",
                                "Mixers FLA runs for (each autotunes 90-200 s on first use).")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed calls after compilation.")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed calls; the median is reported.")
_SETTLE_S = flags.DEFINE_float("settle_s", 1.0, "Seconds of untimed calls after each compile, "
                               "before the warm-up (`bench.settle`: the GPU idled while it "
                               "compiled, and its clocks take a while to rise).")
_SCAN_MAX_T = flags.DEFINE_integer("scan_max_t", 4096, "Time the scan forward only up to this T.")
_BUDGET = flags.DEFINE_float("time_budget_s", 1e9, "Skip what is left after this many seconds.")
_ERR_TOL = flags.DEFINE_float(
    "err_tol", 6e-3, "Largest forward rms(o_pallas_gpu - o_chunk)/rms(o_chunk) a row may have; "
    "rows above it are marked WRONG and the program exits 1 (bf16 kernels measure 3-5e-3).")
_OUT_MD = flags.DEFINE_string("out_md", "", "Markdown output (marker section or whole file).")
_OUT_JSON = flags.DEFINE_string("out_json", "", "Raw results as JSON.")
_SKIP = flags.DEFINE_list("skip", "", "mixer:impl[:T] not to time (impl may be *), e.g. "
                          "what an earlier run measured.")
_MERGE = flags.DEFINE_list("merge_json", "",
                           "Earlier --out_json files whose results fill what this run skips.")
_SWEEP_TOKENS = flags.DEFINE_integer(
    "sweep_tokens", 0, "T sweep at fixed tokens per batch: adds the shapes (tokens / T, T, H, D) "
    "for T in --sweep_lengths (0: no sweep).")
_SWEEP_LENGTHS = flags.DEFINE_list("sweep_lengths", "1024,4096,16384,65536", "T of the sweep.")
_SWEEP_HD = flags.DEFINE_string("sweep_hd", "16,128", "H,D of the sweep shapes.")
_OUT_PNG = flags.DEFINE_string("out_png", "", "Plot of the sweep: time against T per mixer and "
                               "implementation, one panel per mode.")
_REMAT_INTRA = flags.DEFINE_bool("remat_intra", True, "pallas_gpu: recompute the XLA "
                                  "intra-chunk part in the backward (lineax_attn.ops.pallas_gpu."
                                  "GpuTuning.remat_intra).")
_INTRA = flags.DEFINE_enum("intra", "kernel", ["xla", "kernel"], "pallas_gpu: who computes the "
                           "DeltaNet/GDN intra-chunk part (lineax_attn.ops.pallas_gpu.GpuTuning."
                           "intra: the Mosaic GPU kernel, the library's default, or the XLA "
                           "path).")
_TRITON_INTRA = flags.DEFINE_enum("triton_intra", "auto", ["auto", "xla", "kernel"],
                                  "triton: who computes the intra-chunk part "
                                  "(GpuTuning.triton_intra: auto = the kernels wherever they "
                                  "exist; or the Triton kernels / XLA for all).")
_CHANNEL_PAIR = flags.DEFINE_enum("channel_pair", None, ["xla", "kernel_fwd", "kernel"], "pallas_gpu: who "
                                  "computes KDA/GDN-2's per-channel pair matrices (lineax_attn."
                                  "ops.pallas_gpu.GpuTuning.channel_pair; unset: the default).")
_CHANNEL_INTRA = flags.DEFINE_enum("channel_intra", "auto", ["auto", "xla", "triton"],
                                   "pallas_gpu: who computes KDA/GDN-2's intra-chunk part "
                                   "(GpuTuning.channel_intra: auto = the Triton channel kernels "
                                   "where the extra runs, else XLA).")
_INTRA_GRADS = flags.DEFINE_enum("intra_grads", "auto", ["auto", "xla", "kernel"],
                                 "triton DeltaNet / GDN: who finishes the intra backward "
                                 "(GpuTuning.intra_grads: auto = fused in the kernel for "
                                 "both; xla; or kernel).")
_CHANNEL_GRADS = flags.DEFINE_enum("channel_grads", "auto", ["auto", "xla", "kernel", "states"],
                                   "triton / pallas_gpu with the Triton channel kernels: who "
                                   "computes their backward's elementwise rest and dG "
                                   "(GpuTuning.channel_grads: auto = the library's default; "
                                   "XLA; fused in the kernel; or the kernels and the state "
                                   "pass under one VJP).")
_FORWARD = flags.DEFINE_enum("forward", "auto", ["auto", "split", "fused", "walk"],
                             "pallas_gpu / triton DeltaNet / GDN (GpuTuning.forward): auto (the "
                             "library's default: the walks on pallas_gpu where the triton extra "
                             "runs, else the split), the split (intra kernel, state pass), the "
                             "fused Triton kernels (needs the triton extra) or, pallas_gpu only, "
                             "the warp-specialised Mosaic walks.")
_ROW_PIECES = flags.DEFINE_integer("row_pieces", 0, "pallas_gpu's walks and Mosaic state pass "
                                   "(GpuTuning.row_pieces): cut every row into this many pieces "
                                   "(0: the auto rule, the library's default; 1: whole rows).")
_PROFILE_DIR = flags.DEFINE_string(
    "profile_dir", "", "With --breakdown: also run each intra-chunk kernel once under Mosaic GPU's "
    "in-kernel profiler, write its traces here and log the time per named phase "
    "(experiments/kernel_trace.py).")
_BREAKDOWN = flags.DEFINE_enum("breakdown", "none", ["none", "kernels", "all"],
                               "Also time the parts of pallas_gpu GDN at the first shape: each "
                               "Mosaic GPU kernel alone ('kernels'), plus the XLA preparation "
                               "and the whole op with either intra-chunk path ('all').")

BEGIN, END = "<!-- bench_kernels:begin -->", "<!-- bench_kernels:end -->"
ATTN = ("cudnn", "sdpa")  # per shape, not per mixer


@dataclasses.dataclass
class Result:
  shape: tuple
  mixer: str          # "attention" for cudnn / sdpa
  impl: str
  mode: str
  ms: float | None = None
  q20: float | None = None
  q80: float | None = None
  peak_gib: float | None = None
  err_vs_chunk: float | None = None
  note: str = ""


def log(*a):
  print(*a, flush=True)


# ------------------------------------------------------------------------------ inputs


# ------------------------------------------------------------------------------ timing


def time_jax(fn, args):
  """Compiles fn once (AOT) and times it with `bench.measure_with_output`; returns (median, q20,
  q80 in ms, peak GiB of the compiled executable or None, output of the first call)."""
  compiled = jax.jit(fn).lower(*args).compile()
  peak = bench.compiled_memory_bytes(compiled)
  timing, out = bench.measure_with_output(compiled, *args, repeats=_ITERS.value,
                                          warmup=_WARMUP.value, settle_s=_SETTLE_S.value)
  return (timing.median_ms, timing.p20_ms, timing.p80_ms,
          None if peak is None else peak / 2**30, out)


def time_torch(fn):
  """Times a torch call (synchronised); returns (median, q20, q80 in ms, peak GiB)."""
  import torch
  fn()
  torch.cuda.synchronize()
  if _SETTLE_S.value > 0:
    bench.settle({"fn": bench.Step(fn, lambda _: torch.cuda.synchronize())}, _SETTLE_S.value)
  for _ in range(_WARMUP.value):
    fn()
  torch.cuda.synchronize()
  base = torch.cuda.memory_allocated()
  torch.cuda.reset_peak_memory_stats()
  ts = []
  for _ in range(_ITERS.value):
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    ts.append((time.perf_counter() - t0) * 1e3)
  peak = max(torch.cuda.max_memory_allocated(), base) / 2**30
  timing = bench.Timing.from_times(ts)
  return timing.median_ms, timing.p20_ms, timing.p80_ms, peak


# ------------------------------------------------------------------------------ runners


def run_ours(mixer, impl, mode, np_in, tuning=None):
  """Times `ops.<mixer>(implementation=impl, tuning=tuning)` (tuning: pallas_gpu's only)."""
  return time_jax(*peer_ops.jax_call(peer_ops.ours_op(mixer, impl, tuning), np_in, mode))


def run_jla(mixer, mode, np_in):
  return time_jax(*peer_ops.jax_call(peer_ops.jla_op(mixer, np_in[3]), np_in, mode))


def run_fla(mixer, mode, np_in):
  import torch
  q, k, v, gates = np_in
  dev = "cuda"
  need_grad = mode == "fwdbwd"
  tq, tk, tv = (torch.tensor(x, device=dev, dtype=torch.bfloat16, requires_grad=need_grad)
                for x in (q, k, v))
  tg = {n: torch.tensor(x, device=dev, dtype=torch.float32, requires_grad=need_grad)
        for n, x in gates.items()}
  op = peer_ops.fla_op(mixer)
  if mode == "fwd":
    with torch.no_grad():
      return time_torch(lambda: op(tq, tk, tv, tg))
  do = torch.randn_like(tv)

  def step():
    for x in (tq, tk, tv, *tg.values()):
      x.grad = None
    op(tq, tk, tv, tg).backward(do)
  return time_torch(step)


def run_cudnn(mode, b, t, h, d):
  rng = np.random.default_rng(2)
  args = [jnp.asarray(rng.standard_normal((b, t, h, d), dtype=np.float32), jnp.bfloat16)
          for _ in range(3)]
  fwd = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                     implementation="cudnn")
  if mode == "fwd":
    return time_jax(fwd, args)
  return time_jax(peer_ops.grad_fn(fwd, 3), [args[0]] + args)


def run_sdpa(mode, b, t, h, d):
  import torch
  import torch.nn.functional as F
  need_grad = mode == "fwdbwd"
  q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16,
                         requires_grad=need_grad) for _ in range(3))
  if mode == "fwd":
    with torch.no_grad():
      return time_torch(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
  do = torch.randn_like(q)

  def step():
    for x in (q, k, v):
      x.grad = None
    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
  return time_torch(step)


def _importable(name):
  try:
    __import__(name)
    return True
  except Exception as e:  # noqa: BLE001
    log(f"[skip] {name} not importable: {type(e).__name__}: {e}")
    return False


def _breakdown_whole_op(prep, args, tuning):
  """XLA preparation per solve, and the whole GDN op with either intra-chunk path (A/B).

  `tuning` is the run's GpuTuning (--intra, --remat_intra); each row replaces one field.
  """
  rows = []
  for solve in ("inverse", "trsm"):
    solved = dataclasses.replace(tuning, solve=solve)
    rows.append((f"prepare_chunks (XLA intra-chunk, solve={solve}) fwd",
                 time_jax(functools.partial(prep, tuning=solved), args)[0]))
    op = lambda *a, t=solved: ops.gated_delta_rule(*a, implementation="pallas_gpu", tuning=t)[0]
    rows.append((f"whole op, solve={solve}, fwd", time_jax(op, args)[0]))
  for intra in ("xla", "kernel"):
    path = dataclasses.replace(tuning, intra=intra)
    fwd = lambda *a, t=path: ops.gated_delta_rule(*a, implementation="pallas_gpu", tuning=t)[0]
    loss = lambda *a, fwd=fwd: jnp.sum(fwd(*a).astype(jnp.float32))
    fwdbwd = jax.grad(loss, argnums=tuple(range(len(args))))
    for mode, fn in (("fwd", fwd), ("fwd+bwd", fwdbwd)):
      try:
        rows.append((f"whole op, intra={intra}, {mode}", time_jax(fn, args)[0]))
      except Exception as e:  # noqa: BLE001 - the experimental kernel must not stop the rest
        log(f"[breakdown] intra={intra} {mode} failed: {type(e).__name__}: {str(e)[:300]}")
  return rows


def run_breakdown(shape, tuning, whole_op=True):
  """Where pallas_gpu GDN spends its time: each kernel alone and (whole_op) the XLA preparation
  per solve and the whole op with either intra-chunk path; `tuning`: the run's GpuTuning."""
  from lineax_attn.ops import pallas_gpu
  from pallas_kernels.gpu import state_passing as sp
  b, t, h, d = shape
  q, k, v, gates = make_inputs("gated_delta_rule", b, t, h, d)
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  q, k, v, g, beta = bf(q), bf(k), bf(v), f32(gates["g"]), f32(gates["beta"])

  def prep(q, k, v, g, beta, tuning=tuning):
    qs = q.astype(jnp.float32) * d ** -0.5
    kf = k.astype(jnp.float32)
    return pallas_gpu.prepare_chunks(qs, kf, kf * beta[..., None],
                                     v.astype(jnp.float32) * beta[..., None], g, None, c=64,
                                     tuning=tuning)
  rows = []
  if whole_op:
    rows += _breakdown_whole_op(prep, [q, k, v, g, beta], tuning)
  # The Mosaic GPU intra-chunk kernel on the same inputs (its [B, HV, T] gates made by XLA).
  from pallas_kernels.gpu import intra_chunk as ic
  def row_vectors(g, beta):  # the kernels' [B, HV, T] beta, G and Gx
    G = jnp.cumsum(jnp.moveaxis(g, 1, 2).reshape(b, h, t // 64, 64), axis=-1)
    return jnp.moveaxis(beta, 1, 2), G.reshape(b, h, t), (G[..., -1:] - G).reshape(b, h, t)
  def intra_kernel(q, k, v, g, beta):
    return ic.intra_chunk_fwd(q, k, v, *row_vectors(g, beta), scale=d ** -0.5)
  def intra_kernel_bwd(q, k, v, g, beta, m, dny, dp, du):
    return ic.intra_chunk_bwd(q, k, v, *row_vectors(g, beta), None, m, dny, dp, du,
                              scale=d ** -0.5)
  nc = t // 64
  m = ic.intra_chunk_fwd(q, k, v, *row_vectors(g, beta), scale=d ** -0.5, with_inverse=True)[-1]
  cts = [m, jnp.ones((b, h, nc, 64, d), jnp.bfloat16), jnp.ones((b, h, nc, 64, 64), jnp.bfloat16),
         jnp.ones((b, h, nc, 64, d), jnp.bfloat16)]
  for name, fn, args in (("intra_chunk kernel (Mosaic GPU) fwd", intra_kernel, []),
                         ("intra_chunk kernel (Mosaic GPU) bwd", intra_kernel_bwd, cts)):
    try:
      rows.append((name, time_jax(fn, [q, k, v, g, beta] + args)[0]))
    except Exception as e:  # noqa: BLE001 - an experimental kernel must not stop the breakdown
      log(f"[breakdown] {name} failed: {type(e).__name__}: {str(e)[:300]}")
  if _PROFILE_DIR.value:
    profile_intra_kernels(q, k, v, *row_vectors(g, beta), cts, scale=d ** -0.5)
  inputs = jax.block_until_ready(jax.jit(prep)(q, k, v, g, beta))
  s0 = jnp.zeros((b, h, d, d), jnp.float32)
  for save in (False, True):
    fn = lambda *a, save=save: sp.state_passing_fwd(*a, save_states=save)
    rows.append((f"state_passing_fwd kernel (save_states={save})",
                 time_jax(fn, list(inputs) + [s0])[0]))
  ny, qg, p, u, kg, gc = inputs
  do = jnp.ones(u.shape, jnp.bfloat16)
  rows.append(("state_passing_bwd kernel",
               time_jax(sp.state_passing_bwd, [ny, qg, p, kg, gc, do, u, s0])[0]))
  for name, ms in rows:
    log(f"[breakdown] {name}: {ms:.3f} ms")
  return rows


def profile_intra_kernels(q, k, v, beta, g, gx, cts, *, scale):
  """One profiled call of each intra-chunk kernel; logs the time per phase of the kernel."""
  import glob  # pylint: disable=g-import-not-at-top
  from experiments import kernel_trace  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gpu import intra_chunk as ic  # pylint: disable=g-import-not-at-top
  calls = (("fwd", lambda d: ic.intra_chunk_fwd(q, k, v, beta, g, gx, scale=scale,
                                                with_inverse=True, profile_dir=d)),
           ("bwd", lambda d: ic.intra_chunk_bwd(q, k, v, beta, g, gx, None, *cts, scale=scale,
                                                profile_dir=d)))
  for name, call in calls:
    out_dir = os.path.join(_PROFILE_DIR.value, f"intra_chunk_{name}")
    os.makedirs(out_dir, exist_ok=True)
    try:
      jax.block_until_ready(call(out_dir))
      newest = max(glob.glob(os.path.join(out_dir, "*-trace.json")), key=os.path.getmtime)
      with open(newest) as f:
        rows, span = kernel_trace.summarize(json.load(f))
      log(f"[profile] intra_chunk {name} ({newest}):\n"
          + kernel_trace.to_markdown(rows, span))
    except Exception as e:  # noqa: BLE001 - a measurement aid must not stop the breakdown
      log(f"[profile] intra_chunk {name} failed: {type(e).__name__}: {str(e)[:300]}")


# ------------------------------------------------------------------------------ report


def _fmt(x, nd=2):
  return "–" if x is None else f"{x:.{nd}f}"


def _ratio(a, b):
  return "–" if a is None or b is None else f"{a / b:.2f}"


def to_markdown(results, meta):
  by = {(r.shape, r.mixer, r.impl, r.mode): r for r in results}
  shapes = sorted({r.shape for r in results}, key=lambda s: (s[0] * s[1], s))
  mixers = [m for m in _MIXERS.value if any(r.mixer == m for r in results)]
  merged_note = (f" (merged with the earlier run(s) of {', '.join(meta['merged'])} for what "
                 "this run skipped)") if meta.get("merged") else ""
  tb_s = bench.hbm_tb_s(meta["device"])
  lines = [f"Run {meta['date']}{merged_note} on {meta['device']}; jax {meta['jax']}"
           f"{', torch ' + meta['torch'] if meta.get('torch') else ''}"
           f"{', jla ' + meta['jla'] if meta.get('jla') else ''}"
           f"{', fla ' + meta['fla'] if meta.get('fla') else ''}. "
           f"Times in ms (median of {_ITERS.value} after {_WARMUP.value} warm-up calls, "
           "wall clock with block_until_ready / synchronize); bf16 inputs; peak memory in GiB "
           "(JAX: args + outputs + temporaries of the compiled executable; torch: "
           "max_memory_allocated). `err` = rms(o_pallas_gpu − o_chunk)/rms(o_chunk), forward "
           "(`err triton` likewise). "
           "`floor` = the HBM-traffic floor (`lineax_attn.bench.traffic_floor_ms`: bf16 q, k, "
           "v, o, do and their cotangents, float32 gates, each moved once, at "
           f"{tb_s} TB/s, this GPU's peak).",
           "",
           "| B,T,H,D | mixer | mode | pallas_gpu | chunk | scan | jla | FLA | cuDNN attn | "
           "SDPA | ours/jla | ours/FLA | ours/chunk | ours/cuDNN | peak ours | peak chunk | "
           "peak jla | err | floor | ours/floor | triton | triton/FLA | triton/chunk | "
           "err triton |",
           "|" + "---|" * 24]
  for shape in shapes:
    for mixer in mixers:
      for mode in _MODES.value:
        get = lambda impl, m=mixer: by.get((shape, m, impl, mode))
        ms = lambda impl, m=mixer: getattr(get(impl, m), "ms", None)
        ours = ms("pallas_gpu")
        cud = ms("cudnn", "attention")
        if all(ms(i) is None for i in ("pallas_gpu", "triton", "chunk", "jla", "fla")):
          continue
        err = getattr(by.get((shape, mixer, "pallas_gpu", "fwd")), "err_vs_chunk", None)
        err_tr = getattr(by.get((shape, mixer, "triton", "fwd")), "err_vs_chunk", None)
        tr = ms("triton")
        peak = lambda impl: getattr(get(impl), "peak_gib", None)
        b, t, h, d = shape
        floor = bench.traffic_floor_ms(mixer, mode, batch=b, seq_len=t, heads=h, v_heads=h,
                                       head_dim_k=d, head_dim_v=d, tb_s=tb_s)
        lines.append(
            f"| {','.join(map(str, shape))} | {mixer} | {mode} | {_fmt(ours)} | "
            f"{_fmt(ms('chunk'))} | {_fmt(ms('scan'))} | {_fmt(ms('jla'))} | {_fmt(ms('fla'))} | "
            f"{_fmt(cud)} | {_fmt(ms('sdpa', 'attention'))} | {_ratio(ours, ms('jla'))} | "
            f"{_ratio(ours, ms('fla'))} | {_ratio(ours, ms('chunk'))} | {_ratio(ours, cud)} | "
            f"{_fmt(peak('pallas_gpu'))} | {_fmt(peak('chunk'))} | {_fmt(peak('jla'))} | "
            f"{_err_cell(err)} | {floor:.3f} | {_ratio(ours, floor)} | {_fmt(tr)} | "
            f"{_ratio(tr, ms('fla'))} | {_ratio(tr, ms('chunk'))} | {_err_cell(err_tr)} |")
  lines += sweep_lines(results)
  if meta.get("breakdown"):
    bd = meta["breakdown"]
    lines += ["", f"pallas_gpu GDN parts at B,T,H,D = {','.join(map(str, bd['shape']))} "
              "(ms, each compiled and timed on its own):", "", "| part | ms |", "|---|---|"]
    lines += [f"| {name} | {ms:.3f} |" for name, ms in bd["rows"]]
  notes = [r for r in results if r.note]
  if notes:
    lines += ["", "Not measured / errors:", ""]
    lines += [f"- {','.join(map(str, r.shape))} {r.mixer} {r.impl} {r.mode}: {r.note}"
              for r in notes]
  return "\n".join(lines) + "\n"


def _err_cell(err: float | None) -> str:
  if err is None:
    return "–"
  return f"{err:.1e}" if _err_ok(err) else f"**{err:.1e} WRONG**"


def _err_ok(err: float) -> bool:
  return bool(np.isfinite(err)) and err <= _ERR_TOL.value


def sweep_shapes() -> list[tuple]:
  if not _SWEEP_TOKENS.value:
    return []
  h, d = (int(x) for x in _SWEEP_HD.value.split(","))
  lengths = [int(t) for t in _SWEEP_LENGTHS.value]
  bad = [t for t in lengths if _SWEEP_TOKENS.value % t]
  if bad:
    raise ValueError(f"--sweep_lengths {bad} do not divide --sweep_tokens={_SWEEP_TOKENS.value}")
  return [(_SWEEP_TOKENS.value // t, t, h, d) for t in lengths]


def sweep_lines(results) -> list[str]:
  """The T sweep as a table (markdown lines; none without a sweep): per mixer, implementation
  and mode the time at each T and the rise, slowest over fastest, that issue #17 asks to stay
  flat (`bench.sweep_rise`: it says so where points are missing)."""
  shapes = sweep_shapes()
  by = {(r.shape, r.mixer, r.impl, r.mode): r.ms for r in results if r.ms is not None}
  lines = sorted({key[1:] for key in by if key[0] in shapes})
  if not lines:
    return []
  tokens = shapes[0][0] * shapes[0][1]
  out = ["", f"T sweep at {tokens:,} tokens (ms; rise = slowest / fastest):", "",
         "| mixer | impl | mode | " + " | ".join(f"B{b} T{t}" for b, t, _, _ in shapes)
         + " | rise |", "|" + "---|" * (len(shapes) + 4)]
  for mixer, impl, mode in lines:
    times = [by.get((shape, mixer, impl, mode)) for shape in shapes]
    out.append(f"| {mixer} | {impl} | {mode} | " + " | ".join(_fmt(x, 3) for x in times)
               + f" | {bench.sweep_rise(times)} |")
  return out


def plot_sweep(results, path, meta):
  """Time against T at fixed tokens per batch (log-log), one line per mixer x implementation."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  shapes = set(sweep_shapes())
  rows = [r for r in results if r.shape in shapes and r.ms is not None]
  modes = [m for m in _MODES.value if any(r.mode == m for r in rows)]
  if not modes:
    return
  fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.5), squeeze=False)
  for ax, mode in zip(axes[0], modes):
    lines = sorted({(r.mixer, r.impl) for r in rows if r.mode == mode})
    for mixer, impl in lines:
      pts = sorted((r.shape[1], r.ms) for r in rows
                   if (r.mixer, r.impl, r.mode) == (mixer, impl, mode))
      label = "causal softmax (" + impl + ")" if mixer == "attention" else f"{mixer} {impl}"
      style = "--" if mixer == "attention" else ("-" if impl == "pallas_gpu" else ":")
      ax.plot(*zip(*pts), style, marker="o", markersize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"T (B x T = {_SWEEP_TOKENS.value:,} tokens, H,D = {_SWEEP_HD.value})")
    ax.set_ylabel(f"{mode} time (ms)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
  fig.suptitle(f"{meta['device']}, jax {meta['jax']}, {meta['date']}")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_markdown(path, text):
  body = f"{BEGIN}\n{text}{END}\n"
  if os.path.exists(path):
    old = open(path).read()
    if BEGIN in old and END in old:
      body = old[:old.index(BEGIN)] + body + old[old.index(END) + len(END) + 1:]
  with open(path, "w") as f:
    f.write(body)


# ------------------------------------------------------------------------------ main


def main(argv):
  del argv
  if _SETTLE_S.value < 0:
    raise ValueError(f"--settle_s must be >= 0, got {_SETTLE_S.value}")
  if not _MODES.value or set(_MODES.value) - {"fwd", "fwdbwd"}:
    # (the other `peer_ops.MODES` are bench_ab's: FLA, cuDNN and SDPA here time these two)
    raise ValueError(f"--modes must be fwd and/or fwdbwd, got {_MODES.value}")
  start = time.time()
  from lineax_attn.ops import pallas_gpu  # pylint: disable=g-import-not-at-top
  # Passed to every pallas_gpu call (a static value: each setting is its own jit trace).
  tuning = pallas_gpu.GpuTuning(intra=_INTRA.value, remat_intra=_REMAT_INTRA.value,
                                triton_intra=_TRITON_INTRA.value,
                                channel_intra=_CHANNEL_INTRA.value,
                                channel_grads=_CHANNEL_GRADS.value,
                                intra_grads=_INTRA_GRADS.value, forward=_FORWARD.value,
                                row_pieces=_ROW_PIECES.value)
  if _CHANNEL_PAIR.value:
    tuning = dataclasses.replace(tuning, channel_pair=_CHANNEL_PAIR.value)
  dev = jax.devices()[0]
  meta = {"date": time.strftime("%Y-%m-%d"), "device": dev.device_kind, "jax": jax.__version__,
          "remat_intra": _REMAT_INTRA.value, "intra": _INTRA.value,
          "row_pieces": _ROW_PIECES.value,
          "triton_intra": _TRITON_INTRA.value, "channel_intra": _CHANNEL_INTRA.value,
          "channel_grads": _CHANNEL_GRADS.value, "intra_grads": _INTRA_GRADS.value,
          "forward": _FORWARD.value}
  impls = list(_IMPLS.value)
  on_gpu = dev.platform == "gpu"
  have = {}
  have["jla"] = "jla" in impls and on_gpu and _importable("jla.ops")
  have["torch"] = any(i in impls for i in ("fla", "sdpa")) and on_gpu and _importable("torch")
  have["fla"] = "fla" in impls and have["torch"] and _importable("fla.ops")
  if have["torch"]:
    import torch
    meta["torch"] = torch.__version__
  for name, mod in (("jla", "jla"), ("fla", "fla")):
    if have[name]:
      from importlib import metadata
      try:
        meta[name] = metadata.version({"jla": "jax-linear-attention", "fla": "fla-core"}[name])
      except Exception:  # noqa: BLE001
        meta[name] = "?"
  log("meta:", meta)

  results: list[Result] = []
  shapes = [tuple(int(x) for x in s.split(",")) for s in _SHAPES.value.split(";") if s]
  shapes += [s for s in bench.sweep_timing_order(sweep_shapes()) if s not in shapes]

  skip = [x.split(":") for x in _SKIP.value]

  def skipped(res):
    for pat in skip:
      if (pat[0] == res.mixer and pat[1] in ("*", res.impl)
          and (len(pat) < 3 or int(pat[2]) == res.shape[1])):
        return True
    return False

  def attempt(res: Result, fn):
    if skipped(res):
      return None
    if time.time() - start > _BUDGET.value:
      res.note = "skipped (time budget)"
      results.append(res)
      log(f"[skip] {res}")
      return None
    t0 = time.time()
    try:
      out = fn()
      res.ms, res.q20, res.q80, res.peak_gib = out[:4]
      log(f"[ok] {res.shape} {res.mixer:18s} {res.impl:10s} {res.mode:6s} {res.ms:8.3f} ms "
          f"(q20 {res.q20:.3f}, q80 {res.q80:.3f}) peak {_fmt(res.peak_gib)} GiB "
          f"[{time.time() - t0:.0f} s incl. compile]")
      results.append(res)
      return out
    except Exception as e:  # noqa: BLE001
      msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
      res.note = "error: " + msg
      log(f"[error] {res.shape} {res.mixer} {res.impl} {res.mode}: {msg}")
      traceback.print_exc(file=sys.stdout)
      results.append(res)
      return None

  merged: list[Result] = []
  for path in _MERGE.value:
    with open(path) as f:
      old = json.load(f)
    for r in old["results"]:
      r["shape"] = tuple(r["shape"])
      if r.get("ms") is not None:
        merged.append(Result(**r))
    if old["meta"].get("breakdown") and "breakdown" not in meta:
      meta["breakdown"] = old["meta"]["breakdown"]
    meta["merged"] = meta.get("merged", []) + [old["meta"]["date"]]
    if not on_gpu:  # re-plotting / re-tabling a GPU run here: label it with that run's device
      meta.update(device=old["meta"]["device"], date=old["meta"]["date"])

  def flush():
    # This run's numbers override merged ones; merged notes ("skipped") are dropped.
    have_now = {(r.shape, r.mixer, r.impl, r.mode) for r in results if r.ms is not None}
    keep = [r for r in merged if (r.shape, r.mixer, r.impl, r.mode) not in have_now]
    now = [r for r in results if not (r.note and (r.shape, r.mixer, r.impl, r.mode) in
                                      {(m.shape, m.mixer, m.impl, m.mode) for m in keep})]
    text = to_markdown(keep + now, meta)
    if _OUT_MD.value:
      write_markdown(_OUT_MD.value, text)
    if _OUT_JSON.value:
      with open(_OUT_JSON.value, "w") as f:
        json.dump({"meta": meta, "results": [dataclasses.asdict(r) for r in results]}, f,
                  indent=1)
    if _OUT_PNG.value:
      plot_sweep(keep + now, _OUT_PNG.value, meta)
    return text

  for shape in shapes:  # attention first: cheap, and every row's ours/cuDNN needs it
    b, t, h, d = shape
    for mode in _MODES.value:
      if "cudnn" in impls and on_gpu:
        attempt(Result(shape, "attention", "cudnn", mode), lambda: run_cudnn(mode, b, t, h, d))
      if "sdpa" in impls and have["torch"]:
        attempt(Result(shape, "attention", "sdpa", mode), lambda: run_sdpa(mode, b, t, h, d))
  flush()
  if _BREAKDOWN.value != "none" and on_gpu:
    try:
      rows = run_breakdown(shapes[0], tuning, whole_op=_BREAKDOWN.value == "all")
      meta["breakdown"] = {"shape": shapes[0], "rows": rows}
    except Exception as e:  # noqa: BLE001
      log(f"[error] breakdown: {type(e).__name__}: {e}")
      traceback.print_exc(file=sys.stdout)
  for mixer in _MIXERS.value:  # mixer-major, so a time budget cuts the least important last
    for shape in shapes:
      b, t, h, d = shape
      # Made on first use: past the time budget every point is skipped, and making a long
      # shape's host inputs (seconds for KDA at 65,536 x 16 x 128) would overrun the call.
      inputs = functools.cache(functools.partial(make_inputs, mixer, b, t, h, d))
      for mode in _MODES.value:
        outs = {}
        for impl in ("pallas_gpu", "triton", "chunk", "scan"):
          if impl not in impls or (impl == "scan" and (mode != "fwd" or t > _SCAN_MAX_T.value)):
            continue
          out = attempt(Result(shape, mixer, impl, mode),
                        lambda impl=impl: run_ours(
                            mixer, impl, mode, inputs(),
                            tuning=tuning if impl in ("pallas_gpu", "triton") else None))
          if out is not None and mode == "fwd":
            outs[impl] = np.asarray(out[4], np.float32)
        kernel_outs = [i for i in ("pallas_gpu", "triton") if i in outs]
        if kernel_outs and "chunk" not in outs:
          try:  # chunk not timed this run: still compute its output for the err column
            q_, k_, v_, g_ = inputs()
            a_ = [jnp.asarray(x, jnp.bfloat16) for x in (q_, k_, v_)]
            a_ += [jnp.asarray(x, jnp.float32) for x in g_.values()]
            ref = jax.jit(lambda *a: getattr(ops, mixer)(*a, implementation="chunk")[0])(*a_)
            outs["chunk"] = np.asarray(ref, np.float32)
          except Exception as e:  # noqa: BLE001
            log(f"[error] chunk reference output: {type(e).__name__}: {e}")
        for kernel in kernel_outs if "chunk" in outs else ():
          a, r = outs[kernel], outs["chunk"]
          err = float(np.sqrt(np.mean((a - r) ** 2)) / max(np.sqrt(np.mean(r ** 2)), 1e-30))
          for res in results:
            if (res.shape, res.mixer, res.impl, res.mode) == (shape, mixer, kernel, "fwd"):
              res.err_vs_chunk = err
          log(f"    err({kernel} vs chunk) = {err:.2e}")
        outs.clear()
        if have["jla"] and mixer in peer_ops.JLA_KIND:
          attempt(Result(shape, mixer, "jla", mode), lambda: run_jla(mixer, mode, inputs()))
        if have["fla"] and mixer in _FLA_MIXERS.value:
          attempt(Result(shape, mixer, "fla", mode), lambda: run_fla(mixer, mode, inputs()))
        flush()

  log("\n" + flush())
  log(f"total {time.time() - start:.0f} s")
  wrong = [r for r in merged + results
           if r.err_vs_chunk is not None and not _err_ok(r.err_vs_chunk)]
  if wrong:
    log(f"error: {len(wrong)} row(s) over --err_tol={_ERR_TOL.value:g}: " + ", ".join(
        f"{r.mixer} {','.join(map(str, r.shape))} ({r.err_vs_chunk:.2e})" for r in wrong))
    sys.exit(1)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
