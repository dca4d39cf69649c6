r"""Op-level timing: forward and forward+backward of every mixer implementation, plus attention.

    python -m experiments.bench_ops  # small default, fine on a 2-core CPU
    python -m experiments.bench_ops --seq_len=4096 --batch=4 --heads=16 --v_heads=16 \
        --head_dim_k=128 --head_dim_v=128 --dtype=bfloat16 --json_out=/tmp/ops.json

Each linear mixer runs with each implementation on the same random inputs (docs/MATH.md §9); its
output o is checked against the `scan` reference (max |o − o_scan| / max |o_scan|). Above
--scan_max_len the scan is not timed (its backward is slow and memory-hungry) and the check uses
the first --scan_max_len positions, which a causal mixer computes independently of the rest.
`softmax_attention` ("xla", and "cudnn" on GPU) is checked against its dense float32
"reference" in the same way. Kernel implementations are left out by default where they would
only run in an interpreter (pallas_tpu off TPU, pallas_gpu off GPU). Prints one Markdown table;
--json_out also writes the rows.
"""

from __future__ import annotations

import dataclasses
import logging as py_logging
import traceback
from typing import Any, Sequence

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp

from experiments import cli
from lineax_attn import bench
from lineax_attn import ops

ATTENTION = "softmax_attention"
ALL_MIXERS = tuple(ops.MIXERS) + (ATTENTION,)
# Kernel implementations and the only backend they compile for; elsewhere they are interpreted.
KERNEL_BACKENDS = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
COLUMNS = (
    ("mixer", "mixer"), ("implementation", "implementation"), ("shape", "shape"),
    ("ms_fwd", "ms fwd"), ("ms_fwd_bwd", "ms fwd+bwd"), ("err_vs", "err vs"),
    ("max_rel_err", "max rel err"), ("check", "check"), ("note", "note"),
)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """What to run. `implementations=None`: every registered one that runs compiled on this backend;
  `attention_implementations=None`: xla, plus cudnn on GPU."""

  batch: int = 2
  seq_len: int = 256
  heads: int = 2
  v_heads: int = 2
  head_dim_k: int = 32
  head_dim_v: int = 32
  dtype: str = "float32"
  chunk_size: int = 64
  mixers: tuple[str, ...] = ALL_MIXERS
  implementations: tuple[str, ...] | None = None
  attention_implementations: tuple[str, ...] | None = None
  repeats: int = 5
  warmup: int = 2
  scan_max_len: int = 512
  seed: int = 0


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Defines the flags on `flag_values` (kept out of import so tests can use their own)."""
  d = BenchConfig()
  f = dict(flag_values=flag_values)
  flags.DEFINE_integer("batch", d.batch, "B.", **f)
  flags.DEFINE_integer("seq_len", d.seq_len, "T.", **f)
  flags.DEFINE_integer("heads", d.heads, "H: q/k heads (softmax: key/value heads).", **f)
  flags.DEFINE_integer("v_heads", d.v_heads, "HV: value heads, a multiple of H (softmax: query heads).", **f)
  flags.DEFINE_integer("head_dim_k", d.head_dim_k, "K: q/k head dim (softmax: head dim).", **f)
  flags.DEFINE_integer("head_dim_v", d.head_dim_v, "V: value head dim of the linear mixers.", **f)
  flags.DEFINE_enum("dtype", d.dtype, list(DTYPES), "dtype of q, k, v (gates and states are float32).", **f)
  flags.DEFINE_integer("chunk_size", d.chunk_size, "C of the chunked forms (a multiple of 16).", **f)
  flags.DEFINE_list("mixers", list(d.mixers), f"Mixers to run, from {list(ALL_MIXERS)}.", **f)
  flags.DEFINE_list("implementations", None, "Linear-mixer implementations; default: all of "
                    "lineax_attn.ops.available_implementations() except kernels that would run "
                    "in an interpreter on this backend (pallas_tpu off TPU, pallas_gpu off GPU).", **f)
  flags.DEFINE_list("attention_implementations", None, "softmax_attention implementations "
                    "(reference, xla, cudnn); default: xla, plus cudnn on GPU.", **f)
  flags.DEFINE_integer("repeats", d.repeats, "Timed calls per measurement (the median is reported).", **f)
  flags.DEFINE_integer("warmup", d.warmup, "Untimed calls after the compiling call.", **f)
  flags.DEFINE_integer("scan_max_len", d.scan_max_len, "Above this T the scan is not timed and the "
                       "error checks use the first scan_max_len positions (also bounds the dense "
                       "softmax reference).", **f)
  flags.DEFINE_integer("seed", d.seed, "PRNG seed of the inputs.", **f)
  flags.DEFINE_string("json_out", None, "Also write the rows as JSON to this path.", **f)


def config_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> BenchConfig:
  fv = flag_values
  as_tuple = lambda x: None if x is None else tuple(x)
  return BenchConfig(
      batch=fv.batch, seq_len=fv.seq_len, heads=fv.heads, v_heads=fv.v_heads,
      head_dim_k=fv.head_dim_k, head_dim_v=fv.head_dim_v, dtype=fv.dtype, chunk_size=fv.chunk_size,
      mixers=tuple(fv.mixers), implementations=as_tuple(fv.implementations),
      attention_implementations=as_tuple(fv.attention_implementations), repeats=fv.repeats,
      warmup=fv.warmup, scan_max_len=fv.scan_max_len, seed=fv.seed)


def interpreted_here(implementation: str) -> bool:
  """True for a kernel implementation that would run in an interpreter on this backend."""
  native = KERNEL_BACKENDS.get(implementation)
  return native is not None and jax.default_backend() != native


def resolve_implementations(cfg: BenchConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """Checks names and shapes; returns (linear implementations, attention implementations)."""
  unknown = sorted(set(cfg.mixers) - set(ALL_MIXERS))
  if unknown:
    raise app.UsageError(f"unknown --mixers {unknown}; expected names from {list(ALL_MIXERS)}.")
  available = ops.available_implementations()
  if cfg.implementations is None:  # interpreted kernels off their hardware: nothing to time
    impls = tuple(i for i in available if not interpreted_here(i))
  else:
    impls = cfg.implementations
  if set(impls) - set(available):
    raise app.UsageError(f"--implementations {sorted(set(impls) - set(available))} are not "
                         f"available; available: {list(available)}.")
  gpu = jax.default_backend() == "gpu"
  attn = cfg.attention_implementations or (("xla", "cudnn") if gpu else ("xla",))
  if set(attn) - {"reference", "xla", "cudnn"}:
    raise app.UsageError("--attention_implementations must be among reference, xla, cudnn; "
                         f"got {list(attn)}.")
  if cfg.v_heads % cfg.heads:
    raise app.UsageError(f"--v_heads={cfg.v_heads} must be a multiple of --heads={cfg.heads}.")
  if min(cfg.batch, cfg.seq_len, cfg.heads, cfg.head_dim_k, cfg.head_dim_v, cfg.repeats,
         cfg.scan_max_len) < 1 or cfg.warmup < 0:
    raise app.UsageError("sizes, --repeats and --scan_max_len must be >= 1, --warmup >= 0.")
  return tuple(impls), tuple(attn)


def _prefix(args: Sequence[jax.Array], n: int) -> tuple[jax.Array, ...]:
  return tuple(x[:, :n] for x in args)  # every input has time on axis 1


def _attempt(what: str, fn):
  """Runs `fn()`; on failure (e.g. out of memory at a large shape) logs and returns a note."""
  try:
    return fn(), None
  except Exception as e:  # noqa: BLE001 - one failed row must not end a long sweep
    logging.error("%s failed:\n%s", what, traceback.format_exc())
    return None, f"{what} failed: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


def _measure_row(row: dict[str, Any], fwd, fwd_bwd, args, cotangent, check, cfg: BenchConfig):
  """Fills ms_fwd, ms_fwd_bwd and the error of one row; `check(o)` -> max rel err or None."""
  notes = [row["note"]] if row.get("note") else []
  label = f"{row['mixer']}/{row['implementation']}"
  o, note = _attempt(f"{label} forward", lambda: jax.block_until_ready(fwd(*args)))
  if note:
    notes.append(note)
  else:
    row["max_rel_err"] = check(o)
    row["check"] = bench.error_verdict(row["max_rel_err"], row["tolerance"])
    del o
    row["ms_fwd"], note = _attempt(f"{label} fwd timing", lambda: bench.time_fn(
        fwd, *args, repeats=cfg.repeats, warmup=cfg.warmup))
    notes += [note] if note else []
    row["ms_fwd_bwd"], note = _attempt(f"{label} fwd+bwd", lambda: bench.time_fn(
        fwd_bwd, cotangent, *args, repeats=cfg.repeats, warmup=cfg.warmup))
    notes += [note] if note else []
  row["note"] = "; ".join(notes)
  logging.info("%s: fwd %s ms, fwd+bwd %s ms, err %s", label, row.get("ms_fwd"),
               row.get("ms_fwd_bwd"), row.get("max_rel_err"))
  return row


def _fallback_note(implementation: str, cfg: BenchConfig) -> str:
  """Says when the timing is not of the compiled kernel: interpreted, or a fallback to chunk."""
  if interpreted_here(implementation):
    return f"interpreted on {jax.default_backend()}: timing is not the kernel's"
  if implementation != "pallas_gpu":
    return ""
  from lineax_attn.ops import pallas_gpu  # pylint: disable=g-import-not-at-top
  reason_fn = getattr(pallas_gpu, "unsupported_reason", None)
  reason = reason_fn and reason_fn(dk=cfg.head_dim_k, dv=cfg.head_dim_v,
                                   chunk_size=cfg.chunk_size, varlen=False, b=cfg.batch,
                                   t=cfg.seq_len, hv=cfg.v_heads)
  return f"runs 'chunk' here: {reason}" if reason else ""


def _linear_rows(mixer: str, impls: Sequence[str], cfg: BenchConfig) -> list[dict[str, Any]]:
  b, t = cfg.batch, cfg.seq_len
  args = bench.mixer_inputs(mixer, batch=b, seq_len=t, heads=cfg.heads, v_heads=cfg.v_heads,
                            head_dim_k=cfg.head_dim_k, head_dim_v=cfg.head_dim_v,
                            dtype=DTYPES[cfg.dtype], seed=cfg.seed)
  op = getattr(ops, mixer)
  forward = {name: jax.jit(lambda *a, name=name: op(*a, chunk_size=cfg.chunk_size,
                                                     implementation=name)[0])
             for name in set(impls) | {"scan"}}
  # The truth: the scan on the whole sequence, or on its first scan_max_len positions.
  n_ref = min(t, cfg.scan_max_len)
  o_ref, ref_note = _attempt(f"{mixer}/scan reference", lambda: jax.block_until_ready(
      forward["scan"](*_prefix(args, n_ref))))
  err_vs = "n/a" if o_ref is None else ("scan" if n_ref == t else f"scan, first {n_ref}")
  check = lambda o: None if o_ref is None else bench.max_rel_err(o[:, :n_ref], o_ref)
  cotangent = jax.random.normal(jax.random.key(cfg.seed + 1), (b, t, cfg.v_heads, cfg.head_dim_v))
  shape = f"B{b} T{t} H{cfg.heads} HV{cfg.v_heads} K{cfg.head_dim_k} V{cfg.head_dim_v} {cfg.dtype}"
  rows = []
  for name in impls:
    row = dict(mixer=mixer, implementation=name, shape=shape, ms_fwd=None, ms_fwd_bwd=None,
               err_vs=err_vs, max_rel_err=None, check="",
               tolerance=bench.error_tolerance(DTYPES[cfg.dtype], name),
               note="; ".join(n for n in (ref_note, _fallback_note(name, cfg)) if n))
    if name == "scan":
      row["err_vs"] = "(reference)"
      if t > cfg.scan_max_len:
        row["note"] = f"not timed: T={t} > --scan_max_len={cfg.scan_max_len}"
        rows.append(row)
        continue
      check_fn = lambda o: None
    else:
      check_fn = check
    fwd_bwd = jax.jit(bench.forward_backward(forward[name]))
    rows.append(_measure_row(row, forward[name], fwd_bwd, args, cotangent, check_fn, cfg))
  return rows


def _attention_rows(impls: Sequence[str], cfg: BenchConfig) -> list[dict[str, Any]]:
  b, t, hq, hkv, d = cfg.batch, cfg.seq_len, cfg.v_heads, cfg.heads, cfg.head_dim_k
  gpu = jax.default_backend() == "gpu"
  shape = f"B{b} T{t} Hq{hq} Hkv{hkv} D{d} {cfg.dtype}"
  cotangent = jax.random.normal(jax.random.key(cfg.seed + 1), (b, t, hq, d))
  n_ref = min(t, cfg.scan_max_len)
  rows = []
  for name in impls:
    dtype, notes = DTYPES[cfg.dtype], []
    row = dict(mixer=ATTENTION, implementation=name, shape=shape, ms_fwd=None, ms_fwd_bwd=None,
               err_vs="n/a", max_rel_err=None, check="", note="")
    if name == "cudnn" and not gpu:
      row["note"] = f"skipped: cuDNN needs a GPU (backend {jax.default_backend()})"
      rows.append(row)
      continue
    if name == "cudnn" and dtype == jnp.float32:
      dtype = jnp.bfloat16  # cuDNN's fused attention takes fp16/bf16 only
      notes.append("inputs cast to bfloat16 (cuDNN needs fp16/bf16)")
    row["tolerance"] = bench.error_tolerance(dtype, name)
    args = bench.attention_inputs(batch=b, seq_len=t, heads=hq, kv_heads=hkv, head_dim=d,
                                  dtype=dtype, seed=cfg.seed)
    # Reference on the same (possibly bf16-rounded) inputs, upcast to float32, causal prefix.
    ref_args = tuple(x[:, :n_ref].astype(jnp.float32) for x in args)
    o_ref, ref_note = _attempt(f"{ATTENTION}/reference", lambda: jax.block_until_ready(jax.jit(
        lambda *a: ops.softmax_attention(*a, implementation="reference"))(*ref_args)))
    if ref_note:
      notes.append(ref_note)
    elif name != "reference":
      row["err_vs"] = "dense ref" if n_ref == t else f"dense ref, first {n_ref}"
    if name == "reference":
      row["err_vs"] = "(reference)"
    row["note"] = "; ".join(notes)
    fwd = jax.jit(lambda *a, name=name: ops.softmax_attention(*a, implementation=name))
    check = lambda o: (None if o_ref is None or name == "reference"
                       else bench.max_rel_err(o[:, :n_ref], o_ref))
    rows.append(_measure_row(row, fwd, jax.jit(bench.forward_backward(fwd)), args, cotangent,
                             check, cfg))
  return rows


def run_benchmark(cfg: BenchConfig) -> list[dict[str, Any]]:
  """All rows: each linear mixer x implementation, then softmax_attention x implementation."""
  impls, attn_impls = resolve_implementations(cfg)
  rows = []
  for mixer in cfg.mixers:
    if mixer == ATTENTION:
      rows += _attention_rows(attn_impls, cfg)
    else:
      rows += _linear_rows(mixer, impls, cfg)
  return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  return bench.markdown_table(rows, COLUMNS)


def describe_backend() -> str:
  devices = jax.devices()
  return f"{jax.default_backend()} ({len(devices)} x {devices[0].device_kind}), jax {jax.__version__}"


def wrong_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Rows whose output error exceeds their tolerance (NaN and Inf included)."""
  return [r for r in rows if r.get("check", "").startswith("WRONG")]


def run_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> str:
  """The program's body: run, print the table, optionally write JSON. Returns the table.

  Raises SystemExit(1) after printing (and writing the JSON) if any row's output is wrong."""
  cfg = config_from_flags(flag_values)
  rows = run_benchmark(cfg)
  table = format_table(rows)
  impls, _ = resolve_implementations(cfg)
  left_out = [i for i in ops.available_implementations() if i not in impls]
  print(f"Backend: {describe_backend()}; median of {cfg.repeats} after {cfg.warmup} warm-up "
        f"(compile excluded); chunk_size={cfg.chunk_size}.")
  if left_out and cfg.implementations is None:
    print(f"Not run (they would be interpreted on {jax.default_backend()}; name them in "
          f"--implementations to force): {', '.join(left_out)}.")
  print()
  print(table)
  if flag_values.json_out:
    bench.write_json(flag_values.json_out, rows, backend=describe_backend(),
                     config=dataclasses.asdict(cfg))
    print(f"\nWrote {len(rows)} rows to {flag_values.json_out}")
  wrong = wrong_rows(rows)
  if wrong:
    print(f"\nerror: {len(wrong)} row(s) exceed their error tolerance: " + ", ".join(
        f"{r['mixer']}/{r['implementation']} ({r['check']})" for r in wrong))
    raise SystemExit(1)
  return table


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  py_logging.getLogger("jax").setLevel(py_logging.WARNING)
  run_from_flags(flags.FLAGS)


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=cli.parse_flags)
