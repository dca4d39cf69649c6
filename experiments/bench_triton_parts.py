"""Where `implementation="triton"` GDN spends its time: each Triton kernel alone, beside the XLA
and Mosaic GPU pieces it can replace, and the whole op with each intra-chunk choice.

The Triton path is two parts (docs/KERNELS_GPU.md, "The Triton path"): the intra-chunk part (for
DeltaNet / GDN the Triton kernels of `pallas_kernels.gpu.triton.intra_chunk` by default, else
XLA's; `GpuTuning.triton_intra`) and the Triton state pass. This times, at one shape:

* the intra-chunk forward kernel at each inverse precision (`blocks.INTRA_PRECISIONS`) and warp
  count, with its error against the exact float32 reference (`intra_chunk_reference`), and the
  backward kernel at each warp count; both at each `--slice_stages`;
* the XLA intra-chunk part (`prepare_chunks`) and, on Hopper, the Mosaic GPU intra kernels;
* the Triton and (Hopper) Mosaic GPU state passes, forward and backward, and the Triton one at
  other block sizes (`--state_launches`: BLOCK_V, warps, pipeline stages);
* the whole GDN op, forward and forward+backward, with the XLA intra part and with the kernel at
  each precision;
* for KDA / GDN-2 (`--mixers`): the per-channel forward kernel (`channel_intra`) with its error
  against the exact float32 `_intra_chunk`, its backward kernel half (at each warp count and
  `--band_stages`), the backward's rest as XLA's glue or fused into the kernel
  (`channel_intra_grads`, with its error against the glue), the XLA part they replace, and
  the whole op with each;
* `--mixers=products`: the state pass's products kernel (KDA / GDN-2's backward at D 128) at
  each of `--products_launches` (warps, K rows a slice, stages), with GB/s.

    python -m experiments.bench_triton_parts --shape=4,4096,16,128 --out_json=/tmp/parts.json
"""

from __future__ import annotations

import functools
import itertools

from absl import app, flags
import jax
import jax.numpy as jnp

from experiments import cli
from lineax_attn import bench, ops
from lineax_attn.ops import pallas_gpu, specs, triton_gpu
from pallas_kernels.gpu.triton import blocks   # plain Python: no triton import

_SHAPE = flags.DEFINE_string("shape", "4,4096,16,128", "B,T,H,D (K = V = D, HV = H).")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed calls per row (median reported).")
_WARPS = flags.DEFINE_list("warps", "4,8", "Warp counts of the intra-chunk kernels to time.")
_PRECISIONS = flags.DEFINE_list("precisions", ",".join(blocks.INTRA_PRECISIONS),
                                "Inverse product precisions of the delta-rule intra forward.")
_INVERSES = flags.DEFINE_list("inverses", ",".join(blocks.INTRA_INVERSES),
                              "How that forward builds its inverse (blocks.INTRA_INVERSES).")
_STATE_LAUNCHES = flags.DEFINE_list(
    "state_launches", "64:4:2,32:4:2,64:8:2,64:4:3,128:8:2",
    "Triton state-pass launches to time besides `blocks`' own, as BLOCK_V:warps:stages.")
_BAND_STAGES = flags.DEFINE_list("band_stages", "1,2", "Pipelining depths of the channel "
                                  "kernels' diagonal-band loops to time (blocks."
                                  "CHANNEL_BAND_STAGES).")
_SLICE_STAGES = flags.DEFINE_list("slice_stages", "1,2", "Pipelining depths of the delta-rule "
                                   "intra kernels' slice loops to time, at the default "
                                   "precision and warps (blocks.INTRA_SLICE_STAGES).")
_MIXERS = flags.DEFINE_list("mixers", "gated_delta_rule", "gated_delta_rule (the delta-rule "
                            "kernels and state passes) and/or kda, gdn2 (the per-channel "
                            "forward kernel and the whole op), products (the state pass's "
                            "products kernel at each of --products_launches).")
_GRADS_BK = flags.DEFINE_list("grads_bk", "16,64", "Columns a step of the delta-rule intra "
                              "backward's dq / dk loop to time (blocks.grads_bk).")
_CHANNEL_SOLVE_BK = flags.DEFINE_list("channel_solve_bk", "16,32", "Columns a step of the fused "
                                      "channel backward's solve loops to time "
                                      "(blocks.channel_bwd_solve_bk).")
_PHASE_COSTS = flags.DEFINE_bool("phase_costs", False, "KDA / GDN-2: also time the channel "
                                  "kernels with one phase left out at a time (solve loops, "
                                  "anchored products, diagonal bands; `skip_phases`, wrong "
                                  "results): what a phase costs is the time it takes off.")
_CHANNEL_SLICE_STAGES = flags.DEFINE_list(
    "channel_slice_stages", "1,2", "KDA / GDN-2: pipelining depths of the channel forward's "
    "slice loop to time (`channel_intra_fwd(slice_stages=)`, blocks.CHANNEL_SLICE_STAGES), "
    "with its inputs as the bench makes them and with the gates on chip as the op calls it.")
_CHANNEL_PARTS = flags.DEFINE_list(
    "channel_parts", "fwd,bwd,op", "KDA / GDN-2: which rows to time: fwd (the forward kernel), "
    "bwd (its backward kernels and the glue), op (the XLA part and the whole op).")
_PRODUCTS_LAUNCHES = flags.DEFINE_list(
    "products_launches", "8:64:1,4:64:1,8:128:1,8:32:1,4:32:1,16:64:1,8:64:2",
    "--mixers=products: launches of the state pass's products kernel to time, as "
    "warps:BK:stages (`state_pass.state_pass_products(launch=)`; 8:64:1 is the default).")
_OUT_JSON = flags.DEFINE_string("out_json", "", "Rows as JSON.")
_OUT_MD = flags.DEFINE_string("out_md", "", "Rows as a markdown table.")

C = 64
# The channel kernels' phases `--phase_costs` leaves out one at a time (`skip_phases`).
_PHASES = (("solve loops", blocks.PHASE_SOLVE), ("anchored products", blocks.PHASE_ANCHORED),
           ("diagonal bands", blocks.PHASE_BANDS))


def log(*a):
  print(*a, flush=True)


def _rel_rms(got, want):
  got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
  return float(jnp.sqrt(jnp.mean((got - want) ** 2) / jnp.mean(want ** 2)))


def _kernel_inputs(q, k, v, g, beta):
  """The intra-chunk kernels' inputs: q, k, v bf16 [B, T, H, D]; β, G, Gx [B, H, T] float32."""
  b, t, h, _ = q.shape
  G = jnp.cumsum(jnp.moveaxis(g, 1, 2).reshape(b, h, t // C, C), axis=-1)
  return (q, k, v, jnp.moveaxis(beta, 1, 2), G.reshape(b, h, t),
          (G[..., -1:] - G).reshape(b, h, t))


def _timer(rows, iters):
  """row(name, fn, *args, err=None): times jit(fn)(*args) into `rows` and logs it."""
  def row(name, fn, *args, err=None):
    try:
      ms = bench.time_fn(jax.jit(fn), *args, repeats=iters)
    except Exception as e:  # noqa: BLE001 - one failing variant must not stop the others
      log(f"[error] {name}: {type(e).__name__}: {str(e)[:300]}")
      ms = None
    rows.append({"part": name, "ms": ms, "err": err})
    log(f"[part] {name}: {ms if ms is None else f'{ms:.3f}'} ms"
        + ("" if err is None else f"  err {err:.2e}"))
  return row


def _whole_op(row, mixer, args, label, tuning):
  op = lambda *a: getattr(ops, mixer)(*a, implementation="triton", tuning=tuning)[0]
  cot = jax.random.normal(jax.random.key(1), args[2].shape, jnp.float32)
  jax.clear_caches()
  row(f"{mixer} whole op ({label}) fwd", op, *args)
  row(f"{mixer} whole op ({label}) fwd+bwd", bench.forward_backward(op), cot, *args)


def channel_rows(mixer, b, t, h, d, iters, warps):
  """KDA / GDN-2: the per-channel forward kernel, the XLA part, the whole op with either."""
  from lineax_attn.ops import chunked, gpu_chunks
  from pallas_kernels.gpu.triton import channel_intra
  args = bench.mixer_inputs(mixer, batch=b, seq_len=t, heads=h, v_heads=h, head_dim_k=d,
                            head_dim_v=d, dtype=jnp.bfloat16)
  q, k, v, *gates = args
  g, erase, write = chunked.canonical_gates(
      mixer, v, dict(zip(specs.resolve(mixer).gate_names, gates)))
  f32 = jnp.float32
  qs, kf = q.astype(f32) * d ** -0.5, k.astype(f32)
  kt = kf * erase
  vt = v.astype(f32) * (1.0 if write is None else write)
  G = jnp.cumsum(g.reshape(b, t // C, C, h, d), axis=2).reshape(b, t, h, d)
  rows = []
  row = _timer(rows, iters)
  fwd = functools.partial(channel_intra.channel_intra_fwd, chunk=C)
  ch = lambda x: gpu_chunks.to_chunks(x, C)
  exact = jax.jit(lambda *a: chunked._intra_chunk(*map(ch, a), "channel", None, None, None,
                                                  matmul="highest", solve="trsm"))
  _, _, Y, U, _, _ = exact(qs, kf, kt, vt, G)
  try:
    got = fwd(qs, kf, kt, vt, G)
    err = max(_rel_rms(got[0], -Y), _rel_rms(got[3], U))
  except Exception as e:  # noqa: BLE001
    log(f"[error] {mixer} channel intra fwd: {type(e).__name__}: {str(e)[:300]}")
    err = None
  stages = [int(x) for x in _BAND_STAGES.value]
  parts = set(_CHANNEL_PARTS.value)
  if "fwd" in parts:
    for w, st in itertools.product(warps, stages):
      row(f"{mixer} triton channel intra fwd, {w} warps, band stages {st}",
          functools.partial(fwd, num_warps=w, band_stages=st), qs, kf, kt, vt, G, err=err)
    # The slice loop's pipelining, also with k̃ = k ⊙ erase and ṽ = v ⊙ write made on chip
    # from bf16 k, v and q scaled there, as the op calls the kernel.
    on_chip = functools.partial(fwd, erase=erase, write=write, q_scale=d ** -0.5)
    for st in (int(x) for x in _CHANNEL_SLICE_STAGES.value):
      row(f"{mixer} triton channel intra fwd, slice stages {st}",
          functools.partial(fwd, slice_stages=st), qs, kf, kt, vt, G)
      row(f"{mixer} triton channel intra fwd, gates on chip, slice stages {st}",
          functools.partial(on_chip, slice_stages=st), q, k, k, v, G)
    # NY and U made by a kernel of their own from the stored M (GpuTuning.channel_solve)
    row(f"{mixer} triton channel intra fwd, gates on chip, solve kernel",
        functools.partial(on_chip, solve="kernel"), q, k, k, v, G)
    for name, phase in _PHASES if _PHASE_COSTS.value else ():
      row(f"{mixer} channel fwd without the {name}",
          functools.partial(fwd, skip_phases=phase), qs, kf, kt, vt, G)
  if "bwd" in parts:
    m = fwd(qs, kf, kt, vt, G, with_inverse=True)[-1]
    nc = t // C
    cts = [jnp.ones((b, h, nc, C, d), jnp.bfloat16), jnp.ones((b, h, nc, C, C), jnp.bfloat16),
           jnp.ones((b, h, nc, C, d), jnp.float32)]
    for w, st in itertools.product(warps, stages):
      row(f"{mixer} triton channel intra bwd (kernel half), {w} warps, band stages {st}",
          lambda *a, w=w, st=st: channel_intra.channel_intra_bwd(*a[:5], None, *a[5:], chunk=C,
                                                                 num_warps=w, band_stages=st),
          qs, kf, kt, vt, G, m, *cts)
    # The rest of the backward: XLA's glue after the kernel half, or fused into the kernel
    # (GpuTuning.channel_grads), with the fused kernel's largest error against the glue's.
    from lineax_attn.ops import gpu_prepare
    d_ny, d_p, d_u = cts
    d_qg, d_kg = jnp.ones_like(d_ny), jnp.ones_like(d_ny)
    d_gc = jnp.ones((b, h, nc, d), jnp.float32)
    bwd_args = (qs, kf, kt, vt, G, m, g, d_ny, d_qg, d_p, d_u, d_kg, d_gc)

    @jax.jit
    def half_then_glue(qs, kf, kt, vt, G, m, g, *cts6):
      half = channel_intra.channel_intra_bwd(qs, kf, kt, vt, G, None, m, cts6[0], cts6[2],
                                             cts6[3], chunk=C)
      return gpu_prepare.channel_grads(qs, kf, kt, vt, g, None, half, cts6, c=C)

    # The fused backward on bwd_args (g is the glue's only), at launch settings `kw`.
    fused_with = lambda **kw: jax.jit(lambda qs, kf, kt, vt, G, m, g, *cts6: channel_intra.
                                      channel_intra_grads(qs, kf, kt, vt, G, None, m, *cts6,
                                                          chunk=C, **kw))
    try:
      err = max(_rel_rms(x, y) for x, y in zip(fused_with(band_stages=stages[0])(*bwd_args),
                                               half_then_glue(*bwd_args)))
    except Exception as e:  # noqa: BLE001
      log(f"[error] {mixer} fused channel grads: {type(e).__name__}: {str(e)[:300]}")
      err = None
    row(f"{mixer} channel bwd: kernel half + XLA glue", half_then_glue, *bwd_args)
    for st in stages:
      row(f"{mixer} channel bwd: fused (channel_grads=kernel), band stages {st}",
          fused_with(band_stages=st), *bwd_args, err=err)
    for sbk in (int(x) for x in _CHANNEL_SOLVE_BK.value):
      row(f"{mixer} channel bwd fused, solve loops {sbk} columns a step",
          fused_with(solve_bk=sbk), *bwd_args)
    for name, phase in _PHASES if _PHASE_COSTS.value else ():
      row(f"{mixer} channel bwd fused without the {name}", fused_with(skip_phases=phase),
          *bwd_args)
  if "op" not in parts:
    return rows
  row(f"{mixer} XLA intra fwd (prepare_chunks)",
      lambda *a: pallas_gpu.prepare_chunks(*a, None, c=C), qs, kf, kt, vt, g)
  _whole_op(row, mixer, args, "xla intra", pallas_gpu.GpuTuning(triton_intra="xla"))
  for grads in ("xla", "kernel"):
    _whole_op(row, mixer, args, f"kernel intra, channel_grads={grads}",
              pallas_gpu.GpuTuning(triton_intra="kernel", channel_grads=grads))
  return rows


def rows_for(b, t, h, d, iters, warps):
  from pallas_kernels.gpu import intra_chunk as mosaic_intra
  from pallas_kernels.gpu import state_passing as mosaic_state
  from pallas_kernels.gpu.triton import intra_chunk as tic
  from pallas_kernels.gpu.triton import state_pass as tsp

  q, k, v, g, beta = bench.mixer_inputs("gated_delta_rule", batch=b, seq_len=t, heads=h,
                                        v_heads=h, head_dim_k=d, head_dim_v=d,
                                        dtype=jnp.bfloat16)
  scale = d ** -0.5
  rows = []
  row = _timer(rows, iters)

  kin = jax.block_until_ready(_kernel_inputs(q, k, v, g, beta))
  want = jax.jit(functools.partial(mosaic_intra.intra_chunk_reference, scale=scale))(*kin)
  for prec, w, inv in itertools.product(_PRECISIONS.value, warps, _INVERSES.value):
    fwd = functools.partial(tic.intra_chunk_fwd, scale=scale, precision=prec, num_warps=w,
                            inverse=inv)
    try:
      got = fwd(*kin)
      err = max(_rel_rms(got[i], want[i]) for i in (0, 3))   # NY and U: the ones M reaches
    except Exception as e:  # noqa: BLE001
      log(f"[error] triton intra fwd {prec} w{w} {inv}: {type(e).__name__}: {str(e)[:300]}")
      continue
    row(f"triton intra fwd, inverse {prec} {inv}, {w} warps", fwd, *kin, err=err)
  m = tic.intra_chunk_fwd(*kin, scale=scale, with_inverse=True)[-1]
  nc = t // C
  cts = [jnp.ones((b, h, nc, C, d), jnp.bfloat16), jnp.ones((b, h, nc, C, C), jnp.bfloat16),
         jnp.ones((b, h, nc, C, d), jnp.bfloat16)]
  for w in warps:
    bwd = lambda *a, w=w: tic.intra_chunk_bwd(*a[:6], None, *a[6:], scale=scale, num_warps=w)
    row(f"triton intra bwd, {w} warps", bwd, *kin, m, *cts)
  for st in (int(x) for x in _SLICE_STAGES.value):
    fwd = functools.partial(tic.intra_chunk_fwd, scale=scale, slice_stages=st)
    try:
      got = fwd(*kin)
      err = max(_rel_rms(got[i], want[i]) for i in (0, 3))
    except Exception as e:  # noqa: BLE001
      log(f"[error] triton intra fwd, slice stages {st}: {type(e).__name__}: {str(e)[:300]}")
      err = None
    row(f"triton intra fwd, slice stages {st}", fwd, *kin, err=err)
    row(f"triton intra bwd, slice stages {st}",
        lambda *a, st=st: tic.intra_chunk_bwd(*a[:6], None, *a[6:], scale=scale,
                                              slice_stages=st), *kin, m, *cts)

  for gbk in (int(x) for x in _GRADS_BK.value):
    row(f"triton intra bwd, dq/dk loop {gbk} columns a step",
        lambda *a, gbk=gbk: tic.intra_chunk_bwd(*a[:6], None, *a[6:], scale=scale,
                                                grads_bk=gbk), *kin, m, *cts)

  def prep(q, k, v, g, beta):
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    return pallas_gpu.prepare_chunks(q.astype(jnp.float32) * scale, kf, kf * beta[..., None],
                                     vf * beta[..., None], g, None, c=C)
  row("XLA intra fwd (prepare_chunks)", prep, q, k, v, g, beta)
  hopper = pallas_gpu.is_hopper()
  if hopper:
    row("Mosaic GPU intra fwd", functools.partial(mosaic_intra.intra_chunk_fwd, scale=scale), *kin)
    row("Mosaic GPU intra bwd",
        lambda *a: mosaic_intra.intra_chunk_bwd(*a[:6], None, *a[6:], scale=scale),
        *kin, m, *cts)

  inputs = jax.block_until_ready(jax.jit(prep)(q, k, v, g, beta))
  ny, qg, p, u, kg, gc = inputs
  s0 = jnp.zeros((b, h, d, d), jnp.float32)
  do = jnp.ones(u.shape, jnp.bfloat16)
  for name, mod in (("triton", tsp),) + ((("Mosaic GPU", mosaic_state),) if hopper else ()):
    row(f"{name} state pass fwd", mod.state_passing_fwd, *inputs, s0)
    row(f"{name} state pass bwd", mod.state_passing_bwd, ny, qg, p, kg, gc, do, u, s0)
  for spec in _STATE_LAUNCHES.value:   # the block-size table's alternatives
    launch = tuple(int(x) for x in spec.split(":"))
    row(f"triton state pass fwd, BV:warps:stages {spec}",
        functools.partial(tsp.state_passing_fwd, launch=launch), *inputs, s0)
    row(f"triton state pass bwd, BV:warps:stages {spec}",
        functools.partial(tsp.state_passing_bwd, launch=launch), ny, qg, p, kg, gc, do, u, s0)

  original = tic.intra_chunk_fwd
  for intra, prec in [("xla", None)] + [("kernel", p_) for p_ in blocks.INTRA_PRECISIONS]:
    label = "XLA intra" if prec is None else f"intra kernel, inverse {prec}"
    if prec is not None:   # the op takes the module's function at trace time
      tic.intra_chunk_fwd = functools.partial(original, precision=prec)
    try:
      _whole_op(row, "gated_delta_rule", (q, k, v, g, beta), label,
                pallas_gpu.GpuTuning(triton_intra=intra))
    finally:
      tic.intra_chunk_fwd = original
  for name in ("gated_delta_rule", "delta_rule"):   # the fused backward (GpuTuning.intra_grads)
    args = bench.mixer_inputs(name, batch=b, seq_len=t, heads=h, v_heads=h, head_dim_k=d,
                              head_dim_v=d, dtype=jnp.bfloat16)
    for grads in ("xla", "kernel"):
      _whole_op(row, name, args, f"intra kernel, intra_grads={grads}",
                pallas_gpu.GpuTuning(triton_intra="kernel", intra_grads=grads))
    for inv in set(_INVERSES.value) - {blocks.INTRA_INVERSE}:   # the row above has the default
      tic.intra_chunk_fwd = functools.partial(original, inverse=inv)
      try:
        _whole_op(row, name, args, f"intra kernel, intra_grads=kernel, inverse {inv}",
                  pallas_gpu.GpuTuning(triton_intra="kernel", intra_grads="kernel"))
      finally:
        tic.intra_chunk_fwd = original
  return rows


def products_rows(b, t, h, d, iters):
  """The state pass's products kernel (KDA / GDN-2's backward at D 128) at each launch, dO in
  the op's layout as the states path passes it; `err` is the largest relative error of the
  five outputs against the default launch's. It streams ~168 KB a chunk at K = V = 128
  (dE, dO, E, h, dh in; dNY, dQG, dKG, dP, dgc out), so GB/s is logged beside each time."""
  from pallas_kernels.gpu.triton import state_pass as tsp
  rows = []
  row = _timer(rows, iters)
  nc = t // C
  ks = jax.random.split(jax.random.key(0), 5)
  bf = jnp.bfloat16
  de, e = (jax.random.normal(k, (b, h, nc, C, d)).astype(bf) for k in ks[:2])
  do = jax.random.normal(ks[2], (b, t, h, d)).astype(bf)
  hs, dh = (jax.random.normal(k, (b, h, nc, d, d)).astype(bf) for k in ks[3:])
  args = (de, do, e, hs, dh)
  want = tsp.state_pass_products(*args, o_rows=True)
  moved = sum(x.size * x.dtype.itemsize for x in args + tuple(want))
  for spec in _PRODUCTS_LAUNCHES.value:
    launch = tuple(int(x) for x in spec.split(":"))
    fn = functools.partial(tsp.state_pass_products, o_rows=True, launch=launch)
    try:
      got = fn(*args)
      err = max(_rel_rms(g, w) for g, w in zip(got, want))
    except Exception as e_:  # noqa: BLE001 - one failing launch must not stop the others
      log(f"[error] products {spec}: {type(e_).__name__}: {str(e_)[:300]}")
      err = None
    row(f"products kernel, warps:BK:stages {spec}", fn, *args, err=err)
    if rows[-1]["ms"]:
      log(f"  {moved / rows[-1]['ms'] / 1e6:.0f} GB/s")
  return rows


def main(argv):
  del argv
  b, t, h, d = (int(x) for x in _SHAPE.value.split(","))
  reason = triton_gpu.unsupported_reason(dk=d, dv=d, chunk_size=C, varlen=False)
  if reason:
    raise app.UsageError(f"the Triton path does not run here: {reason}")
  rows = []
  for mixer in _MIXERS.value:
    if mixer == "gated_delta_rule":
      rows += rows_for(b, t, h, d, _ITERS.value, [int(w) for w in _WARPS.value])
    elif mixer in ("kda", "gdn2"):
      rows += channel_rows(mixer, b, t, h, d, _ITERS.value, [int(w) for w in _WARPS.value])
    elif mixer == "products":
      rows += products_rows(b, t, h, d, _ITERS.value)
    else:
      raise app.UsageError(f"--mixers: {mixer!r} is not one of gated_delta_rule, kda, gdn2, "
                           f"products")
  meta = {"shape": [b, t, h, d], "mixers": _MIXERS.value,
          "device": jax.devices()[0].device_kind, "jax": jax.__version__}
  if _OUT_JSON.value:
    bench.write_json(_OUT_JSON.value, rows, **meta)
  table = bench.markdown_table(rows, [("part", "part"), ("ms", "ms"), ("err", "err vs exact")])
  print(table)
  if _OUT_MD.value:
    with open(_OUT_MD.value, "w") as f:
      f.write(table + "\n")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
