"""Inputs and checks shared by the GPU kernel tests (Mosaic GPU: test_pallas_gpu*.py; Triton:
test_triton_gpu.py), so both kernel families are held to the same cases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from helpers import assert_close, make_inputs, run_jit
from lineax_attn.ops import gpu_chunks
from pallas_kernels.gpu import intra_chunk as ic

BF = jnp.bfloat16


def state_pass_inputs(seed, b=1, hv=2, nc=3, c=64, dk=64, dv=64):
  """Random state-pass inputs (ny, qg, p, u, kg, gc, s0) in the kernels' dtypes."""
  ks = jax.random.split(jax.random.key(seed), 7)
  n = lambda i, s, sc=1.0: sc * jax.random.normal(ks[i], s, jnp.float32)
  return dict(
      ny=n(0, (b, hv, nc, c, dk), 0.1).astype(BF), qg=n(1, (b, hv, nc, c, dk), 0.1).astype(BF),
      p=n(2, (b, hv, nc, c, c), 0.1).astype(BF), u=n(3, (b, hv, nc, c, dv)),
      kg=n(4, (b, hv, nc, c, dk), 0.1).astype(BF),
      gc=jax.nn.sigmoid(n(5, (b, hv, nc, dk))), s0=n(6, (b, hv, dk, dv)))


def op_segment_ids(b, t):
  """Segments of 30 and 50 rows (the second crossing the chunk boundary), then padding (0)."""
  ids = jnp.concatenate([jnp.full((b, 30), 1), jnp.full((b, 50), 2), jnp.full((b, t - 80), 0)], 1)
  return ids.astype(jnp.int32)


def intra_inputs(seed, *, correlated, b=1, t=128, h=1, hv=2, dk=64, dv=64):
  """The intra-chunk kernels' inputs (q, k, v bf16; β, G, Gx [B, HV, T] float32).

  correlated: every key within ~0.2 of one direction, β in (0.5, 1), no decay (the inverse's
  hard case)."""
  ks = jax.random.split(jax.random.key(seed), 6)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (b, t, h, dk))).astype(BF)
  noise = jax.random.normal(ks[1], (b, t, h, dk))
  if correlated:
    k = unit(jax.random.normal(ks[5], (1, 1, 1, dk)) + 0.2 * noise)
    beta = 0.5 + 0.5 * jax.nn.sigmoid(jax.random.normal(ks[3], (b, hv, t)))
    log_g = jnp.zeros((b, hv, t))
  else:
    k = unit(noise)
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (b, hv, t)))
    log_g = -0.5 * jax.nn.softplus(jax.random.normal(ks[4], (b, hv, t)))
  v = jax.random.normal(ks[2], (b, t, hv, dv)).astype(BF)
  G = jnp.cumsum(log_g.reshape(b, hv, t // 64, 64), axis=-1)
  g, gx = G.reshape(b, hv, t), (G[..., -1:] - G).reshape(b, hv, t)
  return q, k.astype(BF), v, beta, g, gx


def packed_segments(t=128):
  """(ids, cont, keep) [1, T] float32 for segments 1 | 2 | 3 with boundaries at 40 (inside
  chunk 0) and 64 (a chunk boundary)."""
  ids = np.concatenate([np.full(40, 1), np.full(24, 2), np.full(t - 64, 3)])[None]
  c = 64
  chunks = ids.reshape(1, -1, c)
  entry = np.concatenate([ids[:, :1], ids[:, c - 1:-1:c]], axis=1)[..., None]
  cont = (chunks == entry).reshape(1, t)
  keep = (chunks == chunks[..., -1:]).reshape(1, t)
  return tuple(jnp.asarray(x, jnp.float32) for x in (ids, cont, keep))


def intra_backward_pairs(kernel, case, hv=2, zero_gates=False):
  """(name, got, want) of dq, dk, dv, dβ, dG: `kernel(q, k, v, beta_t, G, segidx, scale)` (the
  kernels as one differentiable function, `gpu_vjps.intra_kernel`) against autodiff of the
  exact float32 reference, for cotangents of every output; one q/k head, `hv` value heads.
  zero_gates: G = 0 (DeltaNet)."""
  q, k, v, beta, g, _ = intra_inputs(3, correlated=False, hv=hv)
  b, t, h, dk = q.shape
  hv = v.shape[2]
  G = g.reshape(b, hv, t // 64, 64)
  if zero_gates:
    G = jnp.zeros_like(G)
  beta_t = jnp.moveaxis(beta, 1, 2)            # the op's [B, T, HV] layout
  segidx = jnp.asarray(packed_segments()[0], jnp.int32) if case == "packed" else None
  scale = 64 ** -0.5

  def exact(q, k, v, beta_t, G):
    segments = None if segidx is None else gpu_chunks.kernel_segments(segidx, 64)
    return ic.intra_chunk_reference(q, k, v, jnp.moveaxis(beta_t, 1, 2), G.reshape(b, hv, t),
                                    (G[..., -1:] - G).reshape(b, hv, t), segments, scale=scale)

  fn = lambda q, k, v, beta_t, G: kernel(q, k, v, beta_t, G, segidx, scale)
  primals = (q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), beta_t, G)
  # Each side one jitted program (eager dispatch compiles every primitive on its own).
  outs = jax.jit(exact)(*primals)
  keys = jax.random.split(jax.random.key(9), len(outs))
  cts = tuple(jax.random.normal(kk, o.shape).astype(BF).astype(jnp.float32)
              for kk, o in zip(keys, outs))
  want = jax.jit(lambda p, c: jax.vjp(exact, *p)[1](c))(primals, cts)

  @jax.jit
  def kernel_vjp(p, c):
    outs, vjp = jax.vjp(fn, *p)
    return vjp(tuple(ct.astype(o.dtype) for ct, o in zip(c, outs)))
  got = kernel_vjp(primals, cts)
  return list(zip(("q", "k", "v", "beta", "G"), got, want))


def op_forward_pairs(mixer, implementation, b=1):
  """(name, got, want) of o, final_state and r: the op with `implementation` against the scan.

  T = 100: two chunks, the second padded; GVA (1 q/k head, 2 value heads); a reset at 30, a
  segment crossing the chunk boundary, trailing padding (segment id 0); an initial state. The
  oracle is the scan alone: chunk == scan on these features is tests/test_chunk_vs_scan.py's
  and tests/test_segments.py's."""
  args, kw = make_inputs(mixer, b=b, t=100, h=1, hv=2, dk=64, dv=64, seed=3)
  kw.update(segment_ids=op_segment_ids(b, 100), output_final_state=True, return_residual=True)
  got = run_jit(mixer, args, **kw, implementation=implementation)
  want = run_jit(mixer, args, **kw, implementation="scan")
  return list(zip(("o", "final_state", "r"), got, want))


def state_pass_backward_pairs(bwd, x, seed=2, residual=True):
  """(name, got, want, tol) for a reverse state-pass kernel `bwd(ny, qg, p, kg, gc, do, de_ext,
  ds_final) -> (de, dh, ds0)` on inputs x (`state_pass_inputs`): dE and d initial_state against
  autodiff of the unrounded float32 recurrence (bf16 operands: 2e-2), and the state cotangent
  leaving the last chunk, which is the final-state cotangent itself (bf16: 1e-2). residual
  False: E is not an output the loss reads, so the kernel gets de_ext None and the recurrence
  a zero cotangent for it."""
  from pallas_kernels.gpu import state_passing as sp  # pylint: disable=g-import-not-at-top
  ks = jax.random.split(jax.random.key(seed), 3)
  do = jax.random.normal(ks[0], x["u"].shape).astype(BF)
  de_ext = jax.random.normal(ks[1], x["u"].shape)
  ds_final = jax.random.normal(ks[2], x["s0"].shape)
  de, dh, ds0 = jax.jit(lambda x, *cts: bwd(x["ny"], x["qg"], x["p"], x["kg"], x["gc"], *cts))(
      x, do, de_ext if residual else None, ds_final)
  f = lambda u, s0: sp.state_passing_reference(
      x["ny"], x["qg"], x["p"], u, x["kg"], x["gc"], s0)[:3]
  du, d_s0 = jax.jit(lambda u, s0, cts: jax.vjp(f, u, s0)[1](cts))(
      x["u"], x["s0"], (do.astype(jnp.float32), de_ext if residual else 0 * de_ext, ds_final))
  return [("dE (= dU)", de, du, 2e-2), ("d initial_state", ds0, d_s0, 2e-2),
          ("dh of the last chunk", dh[:, :, -1].astype(jnp.float32), ds_final, 1e-2)]


def walk_inputs(b, t, h, hv, dk, dv, seed, gate_scale=1.0, floor_gates=False):
  """The Mosaic walks' kernel arguments (`chunk_walk`) as numpy-built arrays: unit q, k;
  β = σ(N); log gates logsigmoid(N) · gate_scale (with `floor_gates` every 7th token −1e4),
  cumulated per chunk; the exact gate-free inverse in float64; a small initial state
  (transposed)."""
  r = np.random.default_rng(seed)
  n = lambda *s: r.standard_normal(s)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q, k, v = unit(n(b, t, h, dk)), unit(n(b, t, h, dk)), n(b, t, hv, dv)
  beta = 1 / (1 + np.exp(-n(b, hv, t)))
  g = -np.log1p(np.exp(-n(b, hv, t))) * gate_scale
  if floor_gates:
    g[..., ::7] = -1e4
  c = 64   # the walks' chunk
  cum = np.cumsum(g.reshape(b, hv, t // c, c), -1).reshape(b, hv, t)
  kc = np.repeat(k, hv // h, axis=2).reshape(b, t // c, c, hv, dk).transpose(0, 3, 1, 2, 4)
  lower = np.tril(np.einsum("bhnik,bhnjk->bhnij", kc, kc) * beta.reshape(b, hv, t // c, c, 1), -1)
  t0 = np.linalg.inv(np.eye(c) + lower)
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return (bf(q), bf(k), bf(v), bf(t0), f32(cum), f32(beta), f32(0.1 * n(b, hv, dv, dk)))


# The positional inputs of the mixers, then the initial state: the names of
# `residual_training_grads`' gradients.
GRAD_NAMES = {"gated_delta_rule": ["q", "k", "v", "g", "beta", "s0"],
              "delta_rule": ["q", "k", "v", "beta", "s0"],
              "linear_attention": ["q", "k", "v", "s0"],
              "kda": ["q", "k", "v", "g", "beta", "s0"],
              "gdn2": ["q", "k", "v", "g", "b", "w", "s0"]}


def residual_training_grads(mixer, args, s0, implementation, tuning):
  """Gradients of Σ o² + Σ S_T² + <r, W_r> (r the write residual, W_r fixed random) with respect
  to every positional input and the initial state s0: a loss that reads every output."""
  w_r = jax.random.normal(jax.random.key(7), args[2].shape)

  def f(*a):
    *xs, s_init = a
    o, s, r = run_jit(mixer, xs, initial_state=s_init, output_final_state=True,
                      return_residual=True, implementation=implementation, tuning=tuning)
    return jnp.sum(o * o) + jnp.sum(s * s) + jnp.sum(r * w_r)
  return jax.jit(jax.grad(f, argnums=tuple(range(len(args) + 1))))(*args, s0)


def assert_training_grads_match_scan(mixer, args, s0, tuning, tol, label):
  """`residual_training_grads` of `pallas_gpu` with `tuning` against the scan's, every
  gradient (named by GRAD_NAMES) within the relative tolerance `tol`."""
  grads = [residual_training_grads(mixer, args, s0, impl, tun)
           for impl, tun in (("pallas_gpu", tuning), ("scan", None))]
  names = GRAD_NAMES[mixer]
  assert len(names) == len(args) + 1
  for name, g, w in zip(names, *grads):
    assert_close(g, w, tol, f"{label}: d{name}")


def answer_auto_rule(monkeypatch, pieces):
  """Replaces `gpu_pieces.auto_row_pieces` by a rule answering `pieces`; returns the list of
  the (heads, k_blocks, v_blocks, chunks, sms, max_chains) it is asked."""
  from lineax_attn.ops import gpu_pieces  # pylint: disable=g-import-not-at-top
  asked = []

  def rule(*args):
    asked.append(args)
    return pieces
  monkeypatch.setattr(gpu_pieces, "auto_row_pieces", rule)
  return asked


def late_output_grads(mixer, args, kw, last, implementation, tuning):
  """Gradients with respect to the positional inputs of <o, W> with W fixed random on the
  tokens from `last` on and zero before: a loss on a row's last piece alone, whose earlier
  inputs get gradients only through the state carried across. kw: the op's other arrays."""
  t = args[2].shape[1]
  w = jax.random.normal(jax.random.key(4), args[2].shape) * (jnp.arange(t) >= last)[
      None, :, None, None]

  def f(*a):
    o, _ = run_jit(mixer, a, **kw, implementation=implementation, tuning=tuning)
    return jnp.sum(o * w)
  return jax.jit(jax.grad(f, argnums=tuple(range(len(args)))))(*args)
