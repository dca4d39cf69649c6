"""Where the pallas_gpu XLA intra-chunk path of KDA / GDN-2 spends its time, piece by piece.

KDA and GDN-2 (per-channel decay) take the XLA intra-chunk path of `implementation="pallas_gpu"`
(`chunked._intra_chunk` with bf16 matmuls, then the Mosaic GPU state pass). This times its
pieces alone, forward and forward+backward, at one shape, so the next optimisation goes where
the time is: the per-channel pair matrix (`chunked._channel_pair`, one of P or L; and the Pallas
kernels that compute both, `pallas_kernels.gpu.channel_pair`, alone at two warp counts), the blocked
inverse (`ops.triangular`), the whole preparation (`pallas_gpu.prepare_chunks`) and the whole op
with and without recomputing the intra-chunk part in the backward (`GpuTuning.remat_intra`).

    python -m experiments.bench_intra_xla --shape=4,4096,16,128 --mixer=kda --out_json=/tmp/x.json
"""

from __future__ import annotations

from absl import app, flags
import jax
import jax.numpy as jnp

from experiments import cli
from lineax_attn import bench, ops
from lineax_attn.ops import chunked, gpu_chunks, gpu_vjps, pallas_gpu, triangular
from pallas_kernels.gpu import channel_pair as cp

_SHAPE = flags.DEFINE_string("shape", "4,4096,16,128", "B,T,H,D (K = V = D, HV = H).")
_MIXER = flags.DEFINE_enum("mixer", "kda", ["kda", "gdn2"], "Per-channel-gate mixer.")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed calls per row (median reported).")
_OUT_JSON = flags.DEFINE_string("out_json", "", "Rows as JSON.")
_ONLY = flags.DEFINE_string("only", "", "Time only the pieces whose name contains one of these "
                            "substrings, separated by '|' (the names hold commas).")


def _grad_all(fn):
  """fwd+bwd of fn: the gradient of <fn(*args), 1> (float32) with respect to every array arg."""
  def loss(*args):
    outs = fn(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return sum(jnp.sum(o.astype(jnp.float32)) for o in outs if o is not None)
  return lambda *args: jax.grad(loss, argnums=tuple(range(len(args))))(*args)


def rows_for(mixer, b, t, h, d, iters):
  c = 64
  q, k, v, *gates = bench.mixer_inputs(mixer, batch=b, seq_len=t, heads=h, v_heads=h,
                                       head_dim_k=d, head_dim_v=d, dtype=jnp.bfloat16)
  g = gates[0]
  chunks = lambda x: gpu_chunks.to_chunks(x, c)
  Q, K = chunks(q.astype(jnp.float32)), chunks(k.astype(jnp.float32))
  G = jnp.cumsum(chunks(g), axis=-2)
  rng = jax.random.normal(jax.random.key(1), Q.shape[:-1] + (c,), jnp.float32)
  L = jnp.tril(0.05 * rng, k=-1)
  pair = lambda A, K, G: chunked._channel_pair(A, K, G, "bf16")
  op = getattr(ops, mixer)
  whole = lambda **tune: (lambda *a: op(*a, implementation="pallas_gpu",
                                       tuning=pallas_gpu.GpuTuning(**tune))[0])
  Qb, Kb = Q.astype(jnp.bfloat16), K.astype(jnp.bfloat16)
  dM = jnp.tril(rng)
  kernel_pairs = lambda q, kt, k, g: gpu_vjps.channel_pairs_kernel(q, k, kt, g, False, True)
  flat = lambda x: x.reshape(-1, *x.shape[-2:])
  raw = lambda f, w, ds, dg: (lambda *a: f(*map(flat, a), num_warps=w, slice_k=ds, diag=dg))

  def prep(q, k, v, g, *rest):
    qs = q.astype(jnp.float32) * d ** -0.5
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    erase = rest[0][..., None] if mixer == "kda" else rest[0]
    write = rest[0][..., None] if mixer == "kda" else rest[1]
    return pallas_gpu.prepare_chunks(qs, kf, kf * erase, vf * write, g, None, c=c)

  cases = [
      ("channel pair (one C×C matrix)", pair, (Q, K, G)),
      ("blocked inverse (I + L)^-1", triangular.unit_lower_inverse, (L,)),
      ("prepare_chunks (whole XLA intra part)", prep, (q, k, v, *gates)),
      ("pairs kernel (P and L, bf16 inputs)", kernel_pairs, (Qb, Qb, Kb, G)),
      *[(f"pairs kernel fwd alone, diag={dg}, num_warps={w}, slice_k={ds}",
         raw(cp.channel_pairs_fwd, w, ds, dg), (Qb, Qb, Kb, G), "fwd")
        for dg in cp.DIAG_CHOICES for w in (4, 8) for ds in (32, 64)],
      *[(f"pairs kernel bwd alone, diag={dg}, num_warps={w}, slice_k={ds}",
         raw(cp.channel_pairs_bwd, w, ds, dg), (Qb, Qb, Kb, G, dM, dM), "fwd")
        for dg in cp.DIAG_CHOICES for w in (4, 8) for ds in (32, 64)],
      ("whole op, remat_intra=True", whole(remat_intra=True), (q, k, v, *gates)),
      ("whole op, remat_intra=False", whole(remat_intra=False), (q, k, v, *gates)),
      ("whole op, channel_pair=kernel", whole(channel_pair="kernel"), (q, k, v, *gates)),
      ("whole op, channel_pair=kernel_fwd", whole(channel_pair="kernel_fwd"), (q, k, v, *gates)),
      ("whole op, channel_pair=kernel_fwd, remat_intra=False",
       whole(channel_pair="kernel_fwd", remat_intra=False), (q, k, v, *gates)),
      ("whole op, channel_pair=kernel, remat_intra=False",
       whole(channel_pair="kernel", remat_intra=False), (q, k, v, *gates)),
      ("whole op, channel_pair=kernel, pair_diag=levels, remat_intra=False",
       whole(channel_pair="kernel", pair_diag="levels", remat_intra=False), (q, k, v, *gates)),
      ("whole op, channel_pair=kernel, pair_diag=levels",
       whole(channel_pair="kernel", pair_diag="levels"), (q, k, v, *gates)),
      ("whole op, channel_pair=kernel_fwd, pair_diag=levels, remat_intra=False",
       whole(channel_pair="kernel_fwd", pair_diag="levels", remat_intra=False),
       (q, k, v, *gates)),
  ]
  rows = []
  wanted = [w for w in _ONLY.value.split("|") if w]
  for name, fn, args, *only in cases:
    if wanted and not any(w in name for w in wanted):
      continue
    modes = (("fwd", fn), ("fwd+bwd", _grad_all(fn)))
    for mode, f in modes[:1] if only else modes:
      ms = bench.time_fn(jax.jit(f), *args, repeats=iters)
      print(f"{name:52s} {mode:8s} {ms:8.3f} ms", flush=True)
      rows.append({"piece": name, "mode": mode, "ms": ms})
  return rows


def main(argv):
  del argv
  b, t, h, d = map(int, _SHAPE.value.split(","))
  rows = rows_for(_MIXER.value, b, t, h, d, _ITERS.value)
  print(bench.markdown_table(rows, [("piece", "piece"), ("mode", "mode"), ("ms", "ms")]))
  if _OUT_JSON.value:
    bench.write_json(_OUT_JSON.value, rows, mixer=_MIXER.value, shape=[b, t, h, d],
                     device=jax.devices()[0].device_kind, jax=jax.__version__)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
