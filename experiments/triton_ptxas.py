"""Registers, spills and shared memory of every Triton kernel of `implementation="triton"`,
compiled for a GPU architecture on any machine: no GPU needed, only the `triton` extra.

Triton compiles a kernel to PTX for a named target without a device, and the `ptxas` it ships
reports what the kernel costs a thread. A kernel that spills (stores registers to local memory
inside its loops) runs at a fraction of its speed, so this is the first check of a kernel
change, before a GPU is at hand. Each kernel is compiled as its JAX wrapper launches it (the
block sizes, warps and pipeline stages of `pallas_kernels.gpu.triton.blocks`), at every head
dim asked for, with and without packed segments:

    python -m experiments.triton_ptxas --head_dims=64,128 --arch=90
    python -m experiments.triton_ptxas --arch=80 --kernels=state_pass   # A100

Prints a markdown table (kernel, K, V, packed, warps, stages, registers, spill stores / loads in
bytes, shared memory, and a digest of the PTX without its line info); `--out_md` writes it too.
Exits 1 if any kernel spills with `--fail_on_spill`.

The digest is for refactors of kernels already timed: run the tool before and after, and where
every launch's digest is the same, the GPU runs the same instructions and the timings still hold
(moving code between lines changes only the line info, which is left out).

`--dump_dir=DIR` also writes each launch's TTGIR, PTX and SASS (ptxas, then nvdisasm) there,
for questions ptxas's counts do not answer: e.g. whether a loop-invariant operand is converted
to the product's layout once or once a step. Read the SASS for that, not only the TTGIR: the
channel forward's TTGIR converts M inside each solve step, yet its SASS packs M's operand
registers once before the loops (2026-12-07; docs/KERNELS_GPU.md "The solve loops unrolled").
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import itertools
import inspect
import os
import re
import subprocess
import sys
import tempfile

from absl import app, flags

from experiments import cli

_HEAD_DIMS = flags.DEFINE_list("head_dims", "64,128", "Head dims (K = V) to compile at.")
_ARCH = flags.DEFINE_enum("arch", "90", ["80", "86", "89", "90"],
                          "Compute capability to compile for (90 = Hopper, as sm_90a).")
_KERNELS = flags.DEFINE_list("kernels", "state_pass,intra_chunk,channel_intra,fused_forward",
                             "Modules of pallas_kernels/gpu/triton to compile.")
_OUT_MD = flags.DEFINE_string("out_md", "", "Also write the table here.")
_FUSED_LAUNCHES = flags.DEFINE_list(
    "fused_launches", "", "BLOCK_V:warps:stages of the fused walks to compile at besides "
    "`blocks.fused_walk_launch`'s (e.g. 64:4:1,16:4:2).")
_FAIL_ON_SPILL = flags.DEFINE_bool("fail_on_spill", False, "Exit 1 if any kernel spills.")
_DUMP_DIR = flags.DEFINE_string(
    "dump_dir", "", "Also write each launch's TTGIR, PTX and SASS here (e.g. to see where a "
    "loop's operands are converted to the products' layouts).")


@dataclasses.dataclass(frozen=True)
class Launch:
  """One kernel as its wrapper launches it."""
  module: str
  kernel: str
  constexprs: dict
  bf16_pointers: frozenset   # pointer arguments the wrapper passes as bf16; the rest float32
  num_warps: int
  num_stages: int


def _state_pass():
  from pallas_kernels.gpu.triton import state_pass  # noqa: PLC0415 (the optional extra)
  return state_pass


def launches(dk: int, dv: int, packed: bool, hopper: bool) -> list[Launch]:
  """The launches of the three kernel modules at head dims (dk, dv), as their wrappers make
  them on a Hopper GPU or another (pallas_kernels/gpu/triton/*.py: the `triton_call`s)."""
  from pallas_kernels.gpu.triton import blocks  # noqa: PLC0415 (no triton needed for blocks)
  c = blocks.CHUNK
  fwd_bv, fwd_warps, fwd_stages = blocks.state_launch(dk, dv, reverse=False, hopper=hopper)
  bwd_bv, bwd_warps, bwd_stages = blocks.state_launch(dk, dv, reverse=True, hopper=hopper)
  state = dict(C=c, K=dk, V=dv)
  intra = dict(H=16, HV=16, K=dk, V=dv, C=c, PACKED=packed, WITH_INVERSE=True,
               PREC=blocks.INTRA_PRECISION, BK=blocks.INTRA_BK,
               SLICE_STAGES=blocks.INTRA_SLICE_STAGES, STATES=False, VS=min(dv, 64))
  channel = dict(HV=16, K=dk, V=dv, C=c, SUBC=16, PACKED=packed, WITH_INVERSE=True,
                 PREC=blocks.INTRA_PRECISION, BK=blocks.CHANNEL_BK,
                 BAND_STAGES=blocks.CHANNEL_BAND_STAGES, SPAN=float(blocks.CHANNEL_SPAN),
                 ERASE=0, WRITE=0, QS=1.0)
  channel_fwd = dict(channel, SBK=blocks.solve_bk(dk, dv), SKIP=0,
                     SLICE_STAGES=blocks.CHANNEL_SLICE_STAGES,
                     SOLVE_LOOP=blocks.CHANNEL_SOLVE_LOOPS.get(blocks.CHANNEL_SOLVE, 0))
  channel_bwd = dict(channel, SBK=blocks.channel_bwd_solve_bk(dk, dv, hopper=hopper), SKIP=0,
                     DO_ROWS=False)

  f = frozenset

  def gated_fwd(name, **constexprs):
    """The channel forward as the op launches it with gates on chip (k, v, q's scale; bf16)."""
    return Launch("channel_intra", name, dict(channel_fwd, QS=0.0883883461, **constexprs),
                  f({"q_ptr", "k_ptr", "kt_ptr", "vt_ptr", "ny_ptr", "qg_ptr", "p_ptr", "kg_ptr",
                     "m_ptr"}), blocks.CHANNEL_WARPS, 1)

  return [
      Launch("state_pass", "_fwd_kernel",
             dict(state, BV=fwd_bv, SAVE_STATES=True, STAGES=fwd_stages),
             f({"ny_ptr", "qg_ptr", "p_ptr", "kg_ptr", "h_ptr"}), fwd_warps, fwd_stages),
      Launch("state_pass", "_bwd_kernel", dict(state, BV=bwd_bv, STAGES=bwd_stages, HAS_DX=True),
             f({"ny_ptr", "qg_ptr", "p_ptr", "kg_ptr", "do_ptr", "dh_ptr"}), bwd_warps,
             bwd_stages),
      # As the channel states path calls it: dE and E bf16, dO in the op's [B, T, HV, V].
      Launch("state_pass", "_products_kernel",
             dict(C=blocks.CHUNK, K=dk, V=dv, BK=min(_state_pass().PRODUCTS_BK, dk), HV=16,
                  O_ROWS=True),
             f({"de_ptr", "do_ptr", "e_ptr", "h_ptr", "dh_ptr", "dny_ptr", "dqg_ptr", "dp_ptr",
                "dkg_ptr"}),
             _state_pass().PRODUCTS_WARPS, 1),
      Launch("intra_chunk", "_fwd_kernel",
             dict(intra, SBK=blocks.solve_bk(dk, dv), BATCHED_INVERSE=False),
             f({"q_ptr", "k_ptr", "v_ptr", "ny_ptr", "qg_ptr", "p_ptr", "kg_ptr", "m_ptr"}),
             blocks.INTRA_WARPS, 1),
      Launch("intra_chunk", "_fwd_kernel+batched_inverse",
             dict(intra, SBK=blocks.solve_bk(dk, dv), BATCHED_INVERSE=True),
             f({"q_ptr", "k_ptr", "v_ptr", "ny_ptr", "qg_ptr", "p_ptr", "kg_ptr", "m_ptr"}),
             blocks.INTRA_WARPS, 1),
      Launch("intra_chunk", "_bwd_kernel",
             dict(intra, GBK=blocks.grads_bk(dk, hopper=hopper), GRADS=False,
                  GATED=True),
             f({"q_ptr", "k_ptr", "v_ptr", "m_ptr", "dny_ptr", "dp_ptr", "du_ptr", "dqg_ptr",
                "dkg_ptr"}), blocks.INTRA_WARPS, 1),
      Launch("intra_chunk", "_bwd_kernel+ungated",
             dict(intra, GBK=blocks.grads_bk(dk, hopper=hopper), GRADS=False,
                  GATED=False),
             f({"q_ptr", "k_ptr", "v_ptr", "m_ptr", "dny_ptr", "dp_ptr", "du_ptr", "dqg_ptr",
                "dkg_ptr"}), blocks.INTRA_WARPS, 1),
      Launch("intra_chunk", "_bwd_kernel+grads",
             dict(intra, GBK=blocks.grads_bk(dk, hopper=hopper, fused=True), GRADS=True,
                  GATED=True),
             f({"q_ptr", "k_ptr", "v_ptr", "m_ptr", "dny_ptr", "dp_ptr", "du_ptr", "dqg_ptr",
                "dkg_ptr"}), blocks.INTRA_WARPS, 1),
      Launch("intra_chunk", "_bwd_kernel+grads+ungated",
             dict(intra, GBK=blocks.grads_bk(dk, hopper=hopper, fused=True), GRADS=True,
                  GATED=False),
             f({"q_ptr", "k_ptr", "v_ptr", "m_ptr", "dny_ptr", "dp_ptr", "du_ptr", "dqg_ptr",
                "dkg_ptr"}), blocks.INTRA_WARPS, 1),
      Launch("intra_chunk", "_bwd_kernel+grads+states",   # intra_chunk_bwd_from_states
             dict(intra, GBK=blocks.grads_bk(dk, hopper=hopper, fused=True), GRADS=True,
                  GATED=True, STATES=True, VS=blocks.from_states_vs(dv)),
             f({"q_ptr", "k_ptr", "v_ptr", "m_ptr", "dny_ptr", "dp_ptr", "du_ptr", "dqg_ptr",
                "dkg_ptr", "h_ptr", "dh_ptr", "do_ptr"}), blocks.INTRA_WARPS, 1),
      Launch("channel_intra", "_fwd_kernel", channel_fwd,
             f({"ny_ptr", "qg_ptr", "p_ptr", "kg_ptr", "m_ptr"}), blocks.CHANNEL_WARPS, 1),
      # ... its solve as a kernel of its own (`solve="kernel"`; opt-in), KDA's gates on chip
      Launch("channel_intra", "_solve_kernel@gates",
             dict(HV=16, K=dk, V=dv, C=c, SB=blocks.solve_bk(dk, dv), PACKED=packed, ERASE=1,
                  WRITE=1),
             f({"m_ptr", "kt_ptr", "vt_ptr", "ny_ptr"}), blocks.CHANNEL_WARPS, 1),
      # ... with KDA's gates on chip and its slice loop pipelined (`slice_stages=2`; opt-in)
      gated_fwd("_fwd_kernel@gates+slice_stages2", ERASE=1, WRITE=1, SLICE_STAGES=2),
      Launch("channel_intra", "_bwd_kernel", dict(channel_bwd, GRADS=False, PRODUCTS=False),
             f({"m_ptr", "dny_ptr", "dqg_ptr", "dp_ptr", "dkg_ptr"}), blocks.CHANNEL_WARPS, 1),
      Launch("channel_intra", "_bwd_kernel+grads", dict(channel_bwd, GRADS=True, PRODUCTS=False),
             f({"m_ptr", "dny_ptr", "dqg_ptr", "dp_ptr", "dkg_ptr"}), blocks.CHANNEL_WARPS, 1),
      # channel_intra_grads_from_states as the states path calls it: dE, E bf16, dO in the
      # op's layout (DO_ROWS), the products' bf16 scratches sny, sqg, skg
      Launch("channel_intra", "_bwd_kernel+grads+states",
             dict(channel_bwd, GRADS=True, PRODUCTS=True, DO_ROWS=True),
             f({"m_ptr", "dny_ptr", "dqg_ptr", "dp_ptr", "dkg_ptr", "h_ptr", "dh_ptr", "do_ptr",
                "dps_ptr", "du_ptr", "e_ptr", "sny_ptr", "sqg_ptr", "skg_ptr"}),
             blocks.CHANNEL_WARPS, 1),
      # ... with KDA's β made on chip (k, v and a row gate instead of k̃, ṽ), bf16 inputs
      gated_fwd("_fwd_kernel@gates", ERASE=1, WRITE=1),
      # ... and its solve loops paired (`solve="paired"`, "prefetched"), with KDA's and with
      # GDN-2's gates
      gated_fwd("_fwd_kernel@gates+solve_paired", ERASE=1, WRITE=1, SOLVE_LOOP=1),
      gated_fwd("_fwd_kernel@gates+solve_prefetched", ERASE=1, WRITE=1, SOLVE_LOOP=2),
      gated_fwd("_fwd_kernel@gdn2_gates", ERASE=2, WRITE=2),
      gated_fwd("_fwd_kernel@gdn2_gates+solve_paired", ERASE=2, WRITE=2, SOLVE_LOOP=1),
      gated_fwd("_fwd_kernel@gdn2_gates+solve_prefetched", ERASE=2, WRITE=2, SOLVE_LOOP=2),
      Launch("channel_intra", "_bwd_kernel+grads+states@gates",
             dict(channel_bwd, GRADS=True, PRODUCTS=True, DO_ROWS=True, ERASE=1, WRITE=1,
                  QS=0.0883883461),
             f({"q_ptr", "k_ptr", "kt_ptr", "vt_ptr", "m_ptr", "dny_ptr", "dqg_ptr", "dp_ptr",
                "dkg_ptr", "h_ptr", "dh_ptr", "do_ptr", "dps_ptr", "du_ptr", "e_ptr", "sny_ptr",
                "sqg_ptr", "skg_ptr"}), blocks.CHANNEL_WARPS, 1),
      # ... the state pass's products given (state_products "kernel" / "xla"), gates on chip
      Launch("channel_intra", "_bwd_kernel+grads@gates",
             dict(channel_bwd, GRADS=True, PRODUCTS=False, ERASE=1, WRITE=1, QS=0.0883883461),
             f({"q_ptr", "k_ptr", "kt_ptr", "vt_ptr", "m_ptr", "dny_ptr", "dqg_ptr", "dp_ptr",
                "dkg_ptr"}), blocks.CHANNEL_WARPS, 1),
      # ... and the whole gradients stored in bf16 (the states path's, for bf16 inputs)
      Launch("channel_intra", "_bwd_kernel+grads@gates+bf16_grads",
             dict(channel_bwd, GRADS=True, PRODUCTS=False, ERASE=1, WRITE=1, QS=0.0883883461),
             f({"q_ptr", "k_ptr", "kt_ptr", "vt_ptr", "m_ptr", "dny_ptr", "dqg_ptr", "dp_ptr",
                "dkg_ptr", "dq_ptr", "dk_ptr", "dvt_ptr"}), blocks.CHANNEL_WARPS, 1),
      # ... with GDN-2's gates (erase and write one per channel; `UNROLL` off in the backward)
      Launch("channel_intra", "_bwd_kernel+grads@gdn2_gates+bf16_grads",
             dict(channel_bwd, GRADS=True, PRODUCTS=False, ERASE=2, WRITE=2, QS=0.0883883461),
             f({"q_ptr", "k_ptr", "kt_ptr", "vt_ptr", "m_ptr", "dny_ptr", "dqg_ptr", "dp_ptr",
                "dkg_ptr", "dq_ptr", "dk_ptr", "dvt_ptr"}), blocks.CHANNEL_WARPS, 1),
  ] + (_fused_launches(dk, dv, packed, hopper) if dk <= 128 else [])


def _fused_launches(dk, dv, packed, hopper):
  """`fused_forward`'s three kernels (K <= 128), GDN's gated form."""
  from pallas_kernels.gpu.triton import blocks  # noqa: PLC0415
  f = frozenset
  warps, bk, inverse = blocks.t0_launch(dk)
  t0 = dict(H=16, HV=16, K=dk, C=blocks.CHUNK, PACKED=packed, PREC=blocks.INTRA_PRECISION,
            INVERSE=blocks.T0_INVERSES.index(inverse))
  # The library's launch, and the stored-scores form (BK = INTRA_BK: q kᵀ beside k kᵀ).
  launches = [Launch("fused_forward", f"_t0_kernel{tag}", dict(t0, BK=bk_, STORE_SCORES=stored),
                     f({"q_ptr", "k_ptr", "t0_ptr"} | ({"p0_ptr"} if stored else set())),
                     warps, 1)
              for tag, bk_, stored in (("", bk, False), ("+stored_scores", blocks.INTRA_BK, True))]
  walks = [blocks.fused_walk_launch(dk, dv, hopper=hopper)]
  walks += [tuple(int(x) for x in w.split(":")) for w in _FUSED_LAUNCHES.value]
  for (bv, warps, stages), scores in itertools.product(walks, blocks.FUSED_SCORES_CHOICES):
    if dv % bv:
      continue
    stored = scores == "stored"
    tag = "+stored_scores" if stored else ""
    tag += "" if (bv, warps, stages) == walks[0] else f"@{bv}:{warps}:{stages}"
    p0 = {"p0_ptr"} if stored else set()
    walk = dict(H=16, HV=16, K=dk, V=dv, C=blocks.CHUNK, BV=bv, PACKED=packed, GATED=True,
                STAGES=stages)
    launches += [
        Launch("fused_forward", "_walk_kernel" + tag,
               dict(walk, SAVE_STATES=True, STORE_SCORES=stored),
               f({"q_ptr", "k_ptr", "v_ptr", "t0_ptr", "h_ptr"} | p0), warps, stages),
        Launch("fused_forward", "_reverse_walk_kernel" + tag, dict(walk, STORE_SCORES=stored),
               f({"q_ptr", "k_ptr", "t0_ptr", "do_ptr", "dh_ptr"} | p0), warps, stages),
    ]
  return launches


def _signature(fn, constexprs, bf16_pointers):
  """Triton's signature of `fn` as jax-triton 0.3.1 makes it: constexprs as given, `t`/`nc`
  int32, `scale` float64 (jax-triton types a Python float "fp64"; with "fp32" here the fused
  walks compiled off GPU and failed on it, 2026-12-03), every other argument a pointer (bf16
  or float32)."""
  sig, consts = {}, {}
  for name in inspect.signature(fn).parameters:
    if name in constexprs:
      sig[name], consts[name] = "constexpr", constexprs[name]
    elif name in ("t", "nc"):
      sig[name] = "i32"
    elif name == "scale":
      sig[name] = "fp64"
    else:
      sig[name] = "*bf16" if name in bf16_pointers else "*fp32"
  return sig, consts


def ptx_digest(ptx: str) -> str:
  """sha256 (16 hex digits) of PTX without what depends on where the source lines are: the
  debug sections, `.loc` / `.file` directives, comments and the `$L__tmp` labels they use."""
  body = ptx.split(".section\t.debug", 1)[0]
  code = (line.split("//", 1)[0].strip() for line in body.splitlines())
  kept = [line for line in code if line and not line.startswith((".loc", ".file", "$L__tmp"))]
  return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def compile_report(launch: Launch, arch: int, dump_as: str = "") -> dict:
  """Compiles one launch for `arch` and returns ptxas's registers and spills; with `dump_as`
  (a path without suffix) also writes the launch's TTGIR, PTX and SASS there."""
  import triton  # noqa: PLC0415 (the optional extra)
  from triton.backends.compiler import GPUTarget  # noqa: PLC0415
  module = importlib.import_module(f"pallas_kernels.gpu.triton.{launch.module}")
  kernel = getattr(module, re.split(r"[+@]", launch.kernel)[0])   # "+name", "@launch": variants
  sig, consts = _signature(kernel.fn, launch.constexprs, launch.bf16_pointers)
  # jax-triton tells Triton that every array argument is 16-byte aligned (`tt.divisibility`),
  # which lets it vectorise loads; without it the report is of other code (more registers and
  # spills than what runs, seen on 2026-12-02).
  aligned = {(i,): [["tt.divisibility", 16]]
             for i, kind in enumerate(sig.values()) if kind.startswith("*")}
  source = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=aligned)
  compiled = triton.compile(source,
                            target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=launch.num_warps,
                                         num_stages=launch.num_stages))
  if dump_as:
    for stage in ("ttgir", "ptx"):
      with open(f"{dump_as}.{stage}", "w") as f:
        f.write(compiled.asm[stage])
  tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
  gpu_name = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
  with tempfile.TemporaryDirectory() as tmp:
    ptx = os.path.join(tmp, "kernel.ptx")
    with open(ptx, "w") as f:
      f.write(compiled.asm["ptx"])
    cubin = f"{dump_as}.cubin" if dump_as else os.devnull
    out = subprocess.run([os.path.join(tools, "ptxas"), "-v", "--gpu-name", gpu_name, ptx,
                          "-o", cubin], capture_output=True, text=True, check=True).stderr
  if dump_as:   # the machine code, where the TTGIR's layout conversions may turn out free
    with open(f"{dump_as}.sass", "w") as f:
      subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin], stdout=f, check=True)
    os.remove(cubin)
  regs = re.search(r"Used (\d+) registers", out)
  spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
  return dict(registers=int(regs.group(1)) if regs else None,
              spill_stores=int(spill.group(1)) if spill else None,
              spill_loads=int(spill.group(2)) if spill else None,
              shared=compiled.metadata.shared, ptx=ptx_digest(compiled.asm["ptx"]))


def main(argv):
  del argv
  if importlib.util.find_spec("triton") is None:
    raise app.UsageError("triton is not installed: pip install -e '.[triton]' (no GPU needed)")
  arch = int(_ARCH.value)
  if _DUMP_DIR.value:
    os.makedirs(_DUMP_DIR.value, exist_ok=True)
  rows = []
  for d in (int(x) for x in _HEAD_DIMS.value):
    for packed in (False, True):
      for launch in launches(d, d, packed, hopper=arch == 90):
        if launch.module not in _KERNELS.value:
          continue
        if "PACKED" not in launch.constexprs and packed:
          continue   # the state pass has no segment variant
        name = f"{launch.module}.{launch.kernel}"
        dump_as = ""
        if _DUMP_DIR.value:
          dump_as = os.path.join(_DUMP_DIR.value,
                                 re.sub(r"[^\w.]+", "_", f"{name}_K{d}_V{d}_packed{packed}"))
        r = compile_report(launch, arch, dump_as)
        rows.append((name, d, d, packed, launch.num_warps, launch.num_stages, r))
        print(f"[ptxas] {rows[-1][0]} K{d} V{d} packed={packed}: {r}", flush=True)
  lines = [f"sm_{arch}: registers a thread, spills in bytes (stores / loads), shared in bytes",
           "", "| kernel | K | V | packed | warps | stages | registers | spills | shared | ptx |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for name, dk, dv, packed, warps, stages, r in rows:
    lines.append(f"| {name} | {dk} | {dv} | {packed} | {warps} | {stages} | {r['registers']} | "
                 f"{r['spill_stores']} / {r['spill_loads']} | {r['shared']} | {r['ptx']} |")
  table = "\n".join(lines)
  print(table)
  if _OUT_MD.value:
    with open(_OUT_MD.value, "w") as f:
      f.write(table + "\n")
  if _FAIL_ON_SPILL.value and any(r["spill_stores"] for *_, r in rows):
    sys.exit(1)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
