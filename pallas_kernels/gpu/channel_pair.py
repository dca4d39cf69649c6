"""Pallas (Triton backend) kernels for the per-channel pair matrix of KDA / GDN-2, fwd and bwd.

    M_ij = Σ_c A_ic K_jc e^{G_ic − G_jc}   for j <= i, else 0        (one chunk: i, j < C)

with G the within-chunk cumulative log decay per key channel (non-increasing down the chunk).
P (A = Q) and L (A = K̃) of the chunk form are such matrices. In XLA this product builds and
writes the anchored sub-chunk tensors of its exponentials ([.., 16, 16, K] per sub-chunk pair,
~1.4 ms per matrix at B4 T4096 H16 K128 on an H200); here one program per chunk keeps them in
registers and writes only M.

Exactness and range (docs/MATH.md §3.4 rule 3), as the XLA form: rows are split in sub-chunks
of 16; a pair of different sub-chunks (q < p) is anchored at n = the first row of p,
e^{G_i − G_j} = e^{G_i − G_n} e^{G_n − G_j}, both exponents <= 0, and computed as one bf16 dot
(float32 accumulation); the 16×16 diagonal blocks are exact elementwise float32 sums, with the
exponent masked before exp (so log gates down to −1e4 per step stay finite). The channel axis is
walked in slices of 32 to bound the live registers.

Backward (`channel_pair_bwd`), from dM: dA_i = Σ_{j<=i} dM_ij K_j ⊙ e^{G_i − G_j} and
dK_j = Σ_{i>=j} dM_ij A_i ⊙ e^{G_i − G_j}, by the same anchoring (dG = A ⊙ dA − K ⊙ dK is left
to the caller: M depends on G only through A ⊙ e^G and K ⊙ e^{−G}).

Status (H200, 2026-12-01, B4 T4096 H16 D128): opt-in (`GpuTuning(channel_pair="kernel")`)
because, as written, it is slower than the XLA form it replaces: KDA through pallas_gpu
fwd 6.96 ms vs 3.30, fwd+bwd 18.2 vs 11.2. Likely why (not yet profiled): one program per chunk
walks 10 sub-chunk blocks × 4 channel slices serially with 16×16 dots (tensor cores mostly
idle) and [16, 16, 32] elementwise blocks, 4096 programs in ~31 waves. Next: a program per
(chunk, row sub-chunk), wider dots (a whole row block against all earlier columns at once).

Layouts: A, K `[N, C, D]` (any float dtype; bf16 in the pallas_gpu path), G `[N, C, D]` float32,
dM and M `[N, C, C]` float32; C a multiple of 16, D a multiple of 32. Imports nothing of
lineax_attn.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

SUB = 16     # rows per sub-chunk
DBLK = 32    # channels per slice
_F32 = jnp.float32
_BF16 = jnp.bfloat16


def supported(c: int, d: int) -> str | None:
  """None if the kernels handle chunk size c and key dim d, else why not."""
  if c % SUB or c > 256:
    return f"chunk_size={c} (the channel-pair kernel needs a multiple of {SUB}, <= 256)"
  if d % DBLK:
    return f"K={d} (the channel-pair kernel needs a multiple of {DBLK})"
  return None


def _rows(p):
  return pl.ds(p * SUB, SUB)


def _masked_exp(x, mask):
  return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def _lower_mask():
  i = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB, 1), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB, 1), 1)
  return i >= j


def _fwd_kernel(a_ref, k_ref, g_ref, m_ref, *, c, d):
  ns, nd = c // SUB, d // DBLK
  lower = _lower_mask()
  for p in range(ns):
    for q in range(ns):
      if q > p:
        m_ref[_rows(p), _rows(q)] = jnp.zeros((SUB, SUB), _F32)
        continue
      acc = jnp.zeros((SUB, SUB), _F32)
      for s in range(nd):
        ch = pl.ds(s * DBLK, DBLK)
        a = a_ref[_rows(p), ch].astype(_F32)
        gi = g_ref[_rows(p), ch]
        if q < p:
          anchor = g_ref[pl.ds(p * SUB, 1), ch]                        # [1, DBLK]
          k = k_ref[_rows(q), ch].astype(_F32) * jnp.exp(anchor - g_ref[_rows(q), ch])
          arow = a * jnp.exp(gi - anchor)
          acc += pltriton.dot(arow.astype(_BF16), k.astype(_BF16), trans_b=True)
        else:   # diagonal block, exact: Σ_c a_ic k_jc e^{g_ic − g_jc}, j <= i
          k = k_ref[_rows(p), ch].astype(_F32)
          e = _masked_exp(gi[:, None, :] - gi[None, :, :], lower)
          acc += jnp.sum(a[:, None, :] * k[None, :, :] * e, axis=-1)
      m_ref[_rows(p), _rows(q)] = acc


def _bwd_kernel(a_ref, k_ref, g_ref, dm_ref, da_ref, dk_ref, *, c, d):
  ns, nd = c // SUB, d // DBLK
  lower = _lower_mask()
  for s in range(nd):
    ch = pl.ds(s * DBLK, DBLK)
    a = [a_ref[_rows(p), ch].astype(_F32) for p in range(ns)]
    k = [k_ref[_rows(p), ch].astype(_F32) for p in range(ns)]
    g = [g_ref[_rows(p), ch] for p in range(ns)]
    da = [jnp.zeros((SUB, DBLK), _F32) for _ in range(ns)]
    dk = [jnp.zeros((SUB, DBLK), _F32) for _ in range(ns)]
    for p in range(ns):
      anchor = g_ref[pl.ds(p * SUB, 1), ch]
      row = jnp.exp(g[p] - anchor)                                      # [SUB, DBLK] <= 1
      arow = (a[p] * row).astype(_BF16)
      dm_diag = dm_ref[_rows(p), _rows(p)]
      e = _masked_exp(g[p][:, None, :] - g[p][None, :, :], lower)     # [i, j, DBLK]
      w = dm_diag[:, :, None] * e
      da[p] += jnp.sum(w * k[p][None, :, :], axis=1)
      dk[p] += jnp.sum(w * a[p][:, None, :], axis=0)
      off = jnp.zeros((SUB, DBLK), _F32)
      for q in range(p):
        col = jnp.exp(anchor - g[q])                                    # [SUB, DBLK] <= 1
        dm = dm_ref[_rows(p), _rows(q)].astype(_BF16)                   # [i, j]
        off += pltriton.dot(dm, (k[q] * col).astype(_BF16))
        dk[q] += col * pltriton.dot(dm, arow, trans_a=True)
      da[p] += row * off
    for p in range(ns):
      da_ref[_rows(p), ch] = da[p]
      dk_ref[_rows(p), ch] = dk[p]


def _call(kernel, ins, outs, interpret):
  n, c, d = ins[0].shape
  spec = lambda last: pl.BlockSpec((None, c, last), lambda i: (i, 0, 0))
  return pl.pallas_call(
      functools.partial(kernel, c=c, d=d),
      grid=(n,),
      in_specs=[spec(x.shape[-1]) for x in ins],
      out_specs=[spec(o.shape[-1]) for o in outs],
      out_shape=outs,
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
  )(*ins)


def _check(a, k, g):
  if a.ndim != 3 or a.shape != k.shape or a.shape != g.shape:
    raise ValueError(f"channel_pair: A, K, G must share one [N, C, D] shape, got "
                     f"{a.shape}, {k.shape}, {g.shape}.")
  reason = supported(a.shape[1], a.shape[2])
  if reason:
    raise ValueError(f"channel_pair: {reason}.")


def channel_pair_fwd(a, k, g, *, interpret=False):
  """M `[N, C, C]` float32 from A, K `[N, C, D]` and G `[N, C, D]` float32 (module docstring)."""
  _check(a, k, g)
  n, c, _ = a.shape
  (m,) = _call(_fwd_kernel, (a, k, g.astype(_F32)), [jax.ShapeDtypeStruct((n, c, c), _F32)],
               interpret)
  return m


def channel_pair_bwd(a, k, g, dm, *, interpret=False):
  """(dA, dK) `[N, C, D]` float32 for the cotangent dM `[N, C, C]` (module docstring)."""
  _check(a, k, g)
  n, c, d = a.shape
  if dm.shape != (n, c, c):
    raise ValueError(f"channel_pair_bwd: dM must be {(n, c, c)}, got {dm.shape}.")
  outs = [jax.ShapeDtypeStruct((n, c, d), _F32)] * 2
  da, dk = _call(_bwd_kernel, (a, k, g.astype(_F32), dm.astype(_F32)), outs, interpret)
  return da, dk
