"""The chunkwise-parallel form (docs/MATH.md §3) in pure JAX, for all five linear mixers.

All five mixers are the one template of docs/MATH.md §2.0 with a decay α = exp(g), an erase key
k̃ (`k_erase` = k ⊙ erase in the code) and a write value ṽ (`v_write` = v ⊙ write). Per chunk
of C tokens (rows i = 1..C, G = in-chunk cumsum of g):

    L_ij = Σ_c k̃_ic k_jc e^{G_ic − G_jc}   (j < i)        P_ij = Σ_c q_ic k_jc e^{G_ic − G_jc}   (j ≤ i)
    Z = (I + L)^{-1};   Y = Z (K̃ ⊙ e^G);   U = Z Ṽ                       # intra-chunk, parallel
    E = U − Y S_0;   O = (Q ⊙ e^G) S_0 + P E;   S_C = e^{G_C} S_0 + (K ⊙ e^{G_C − G})ᵀ E   # sequential

Everything intra-chunk is computed for all chunks at once (and recomputed in the backward
pass, `jax.checkpoint`); only the last line runs as a `lax.scan` over chunks. E is the write
residual r that cross-layer routing exports.

Three gate kinds share the code: none (linear attention, DeltaNet), scalar (GDN, a C×C decay
matrix) and per key channel (KDA, GDN-2). For per-channel gates e^{G_i − G_j} cannot be split
into e^{G_i}·e^{−G_j} (e^{−G} overflows once −G > 88), so L and P are built from 16-row
sub-chunks (docs/MATH.md §3.4 rule 3): pairs of different sub-chunks are anchored at the first row
of the later sub-chunk, which keeps every exponent ≤ 0, and the 16×16 diagonal blocks use the
exact elementwise form. Log gates down to −1e4 per step stay finite, forward and backward.

Segments (docs/MATH.md §3.5) are handled exactly inside chunks with a same-segment mask on L and P,
a continuation flag c_i on the S_0 terms and a keep flag on the state update; G is never
restarted. Varlen (`cu_seqlens`) re-lays each sequence on its own chunk grid (as FLA does), so
a sequence start always falls on a chunk start and takes its own initial state there.

Inside: float32; matmuls at `Precision.HIGHEST` (`matmul="highest"`, the default and what the
`chunk` implementation uses) or with bf16 operands and float32 accumulation (`matmul="bf16"`,
the `pallas_gpu` XLA path, docs/MATH.md §3.7). The unit-lower-triangular systems are solved by
`triangular_solve` (`solve="trsm"`) or by the blocked inverse of `ops.triangular`
(`solve="inverse"`, matmuls only: fast on GPUs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lineax_attn.ops import segments as seg_lib
from lineax_attn.ops import specs
from lineax_attn.ops import triangular

_HI = jax.lax.Precision.HIGHEST
SUB_CHUNK = 16  # rows per sub-chunk of the overflow-free per-channel path
MATMULS = ("highest", "bf16")
SOLVES = ("trsm", "inverse")


def _einsum(spec, *xs):
  return jnp.einsum(spec, *xs, precision=_HI)


def _dot(spec, a, b, matmul):
  """A two-operand einsum: float32 at HIGHEST, or bf16 operands with float32 accumulation."""
  if matmul == "highest":
    return _einsum(spec, a, b)
  return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                    preferred_element_type=jnp.float32)


def canonical_gates(mixer, v, gates):
  """Maps a mixer's gates to the shared template: (g, erase, write), read from its spec
  (`specs.MixerSpec.template`; v is unused, kept for the callers).

  g: None (no decay), [B,T,HV] scalar or [B,T,HV,K] per channel log decay.
  erase: None (no delta edit: k̃ = 0) or the factor multiplying k ([B,T,HV,1] or [B,T,HV,K]).
  write: the factor multiplying v ([B,T,HV,1] or [B,T,HV,V]), or None for 1.
  """
  del v
  return specs.template_gates(mixer, gates)


def _masked_exp(x, mask):
  """exp(x) where mask else 0, never evaluating exp of a masked (possibly huge) argument.

  The inner `where` also keeps the backward pass NaN-free (no inf·0 in the cotangent).
  """
  return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def _pair_matrices_no_gate(Q, K, K_erase, matmul):
  P = _dot("...ic,...jc->...ij", Q, K, matmul)
  L = None if K_erase is None else _dot("...ic,...jc->...ij", K_erase, K, matmul)
  return P, L


def _pair_matrices_scalar(Q, K, K_erase, G, matmul):
  """G [..., C] scalar cumulative gate: one C×C decay matrix e^{G_i − G_j}."""
  c = G.shape[-1]
  lower = jnp.tril(jnp.ones((c, c), bool))
  decay = _masked_exp(G[..., :, None] - G[..., None, :], lower)
  P = _dot("...ic,...jc->...ij", Q, K, matmul) * decay
  L = None if K_erase is None else _dot("...ic,...jc->...ij", K_erase, K, matmul) * decay
  return P, L


def _channel_factors(G):
  """The decay factors of the anchored sub-chunk form, from G [..., C, K] (docs/MATH.md §3.4).

  Pairs of different sub-chunks (q < p) are anchored at n = the first row of sub-chunk p:
  e^{G_i − G_j} = e^{G_i − G_n} · e^{G_n − G_j}, both exponents <= 0 since j < n <= i.
  Returns (row [..., p, i, K], col [..., p, q, j, K], zero unless q < p, and the exact
  diagonal blocks diag [..., p, i, j, K] = e^{G_i − G_j} for j <= i within sub-chunk p).
  """
  *lead, c, dk = G.shape
  cs = min(SUB_CHUNK, c)
  ns = c // cs
  Gr = G.reshape(*lead, ns, cs, dk)
  anchor = Gr[..., :, :1, :]                                       # [..., ns, 1, K]
  row = jnp.exp(Gr - anchor)
  earlier = jnp.tril(jnp.ones((ns, ns), bool), k=-1)[:, :, None, None]   # q < p
  col = _masked_exp(anchor[..., :, None, :, :] - Gr[..., None, :, :, :], earlier)
  within = jnp.tril(jnp.ones((cs, cs), bool))[:, :, None]          # j <= i
  diag = _masked_exp(Gr[..., :, :, None, :] - Gr[..., :, None, :, :], within)
  return row, col, diag


def _subchunks(x):
  *lead, c, d = x.shape
  cs = min(SUB_CHUNK, c)
  return x.reshape(*lead, c // cs, cs, d)


def _channel_pair_fwd_math(A, K, G, matmul):
  Ar, Kr = _subchunks(A), _subchunks(K)
  row, col, diag = _channel_factors(G)
  ns, c = Ar.shape[-3], A.shape[-2]
  off = _dot("...pic,...pqjc->...piqj", Ar * row, Kr[..., None, :, :, :] * col, matmul)
  # The exact diagonal blocks stay elementwise float32 (no matmul to round).
  if matmul == "bf16" and jax.default_backend() != "cpu":
    # The exact diagonal blocks stay elementwise float32 (no matmul to round), one fused reduce.
    on = jnp.sum(Ar[..., :, :, None, :] * Kr[..., :, None, :, :] * diag, axis=-1)
  else:
    # (XLA CPU's YNNPACK fusion crashes compiling the reduce form above when the pair is a
    # program of its own: tests/test_xla_cpu_workarounds.py.)
    on = _einsum("...pic,...pjc,...pijc->...pij", Ar, Kr, diag)
  full = off + on[..., :, :, None, :] * jnp.eye(ns, dtype=off.dtype)[:, None, :, None]
  return full.reshape(*A.shape[:-2], c, c)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _channel_pair(A, K, G, matmul):
  """M_ij = Σ_c A_ic K_jc e^{G_ic − G_jc} for j <= i (else 0), G [..., C, K] per channel.

  A custom VJP: autodiff of the anchored form would build (and keep) the sub-chunk pair
  tensors of its exponentials; the hand-written backward reuses the forward's two products.
  M depends on G only through A ⊙ e^G and K ⊙ e^{−G}, so dG = A ⊙ dA − K ⊙ dK.
  """
  return _channel_pair_fwd_math(A, K, G, matmul)


def _channel_pair_fwd(A, K, G, matmul):
  return _channel_pair_fwd_math(A, K, G, matmul), (A, K, G)


def _channel_pair_bwd(matmul, res, dM):
  A, K, G = res
  Ar, Kr = _subchunks(A), _subchunks(K)
  row, col, diag = _channel_factors(G)
  *lead, ns, cs, _ = Ar.shape
  W = dM.reshape(*lead, ns, cs, ns, cs)                            # [..., p, i, q, j]
  Wd = jnp.moveaxis(jnp.diagonal(W, axis1=-4, axis2=-2), -1, -3)   # [..., p, i, j]
  # dA_i = Σ_{j<=i} dM_ij K_j ⊙ e^{G_i − G_j};  dK_j = Σ_{i>=j} dM_ij A_i ⊙ e^{G_i − G_j}.
  dA = row * _dot("...piqj,...pqjc->...pic", W, Kr[..., None, :, :, :] * col, matmul)
  dA = dA + jnp.sum(Wd[..., None] * Kr[..., :, None, :, :] * diag, axis=-2)
  dK = jnp.sum(col * _dot("...piqj,...pic->...pqjc", W, Ar * row, matmul), axis=-4)
  dK = dK + jnp.sum(Wd[..., None] * Ar[..., :, :, None, :] * diag, axis=-3)
  dA, dK = dA.reshape(A.shape), dK.reshape(K.shape)
  return dA, dK, A * dA - K * dK


_channel_pair.defvjp(_channel_pair_fwd, _channel_pair_bwd)


def _pair_matrices_channel(Q, K, K_erase, G, matmul, pairs=None):
  """G [..., C, K] per-channel cumulative gate: anchored sub-chunks, exact diagonal blocks.

  pairs: None (`_channel_pair` in XLA, one call per matrix) or a differentiable
  (Q, K, K_erase, G) -> (P, L) computing both matrices at once (the pallas_gpu path passes
  its kernel; used only when there is a K_erase). One XLA call on the stacked [Q; K̃] (decay
  factors built once) was measured slower on an H200 (docs/BENCHMARKS.md run 6)."""
  if pairs is not None and K_erase is not None:
    return pairs(Q, K, K_erase, G)
  pair = lambda A, K, G: _channel_pair(A, K, G, matmul)
  return pair(Q, K, G), (None if K_erase is None else pair(K_erase, K, G))


def _intra_chunk(Q, K, K_erase, V_write, G, gate_kind, same, cont, keep, *, matmul="highest",
                 solve="trsm", channel_pairs=None):
  """Everything that does not depend on the chunk-entry state, for all chunks at once.

  Args (leading dims [..., C], any batch layout): Q, K, K_erase (the erase keys k̃, or None: no
    delta edit), V_write (the write values ṽ), G ([..., C, K] / [..., C] / None); same
    [..., C, C] same-segment mask or None; cont [..., C] continuation flag c_i or None; keep
    [..., C] rows that reach the chunk's last row or None;
    matmul: "highest" or "bf16" (`MATMULS`); solve: "trsm" or "inverse" (`SOLVES`);
    channel_pairs: see `_pair_matrices_channel` (per-channel gates only).
  Returns: QG, P, Y, U, KG, decay_chunk. The decay names, here and in the TPU kernels:
    decay_in = e^{G} (decay of S_0 up to row i), decay_out = e^{G_C − G} (decay of row j's
    write up to the chunk end), decay_chunk = e^{G_C} (decay of S_0 across the chunk, [..., K]);
    QG = Q ⊙ decay_in, KG = K ⊙ decay_out (docs/MATH.md §3.2: Γ, e^{G_C − G}, Γ_C).
  """
  if matmul not in MATMULS or solve not in SOLVES:
    raise ValueError(f"_intra_chunk: matmul must be one of {MATMULS} and solve one of "
                     f"{SOLVES}, got {matmul!r}, {solve!r}.")
  c = Q.shape[-2]
  if gate_kind == "channel":
    P, L = _pair_matrices_channel(Q, K, K_erase, G, matmul, channel_pairs)
    decay_in, decay_out = jnp.exp(G), jnp.exp(G[..., -1:, :] - G)
    decay_chunk = jnp.exp(G[..., -1, :])
  elif gate_kind == "scalar":
    P, L = _pair_matrices_scalar(Q, K, K_erase, G, matmul)
    decay_in, decay_out = jnp.exp(G)[..., None], jnp.exp(G[..., -1:] - G)[..., None]
    decay_chunk = jnp.exp(G[..., -1:])
  else:
    P, L = _pair_matrices_no_gate(Q, K, K_erase, matmul)
    decay_in = decay_out = decay_chunk = None

  P = P * jnp.tril(jnp.ones((c, c), bool))
  if L is not None:
    L = L * jnp.tril(jnp.ones((c, c), bool), k=-1)
  if same is not None:
    P = P * same
    L = None if L is None else L * same
  scale_rows = lambda x, f: x if f is None else x * f
  # Rows of a segment that started inside this chunk do not see S_0 (c_i = 0).
  entry = (decay_in if cont is None else
           cont[..., None] if decay_in is None else decay_in * cont[..., None])
  QG = scale_rows(Q, entry)
  KG = scale_rows(scale_rows(K, decay_out), None if keep is None else keep[..., None])
  if cont is not None:
    last_cont = cont[..., -1:]
    decay_chunk = last_cont if decay_chunk is None else decay_chunk * last_cont

  if L is None:  # linear attention: no delta edit, E = Ṽ
    Y, U = None, V_write
  else:
    rhs = jnp.concatenate([scale_rows(K_erase, entry), V_write], axis=-1)
    if solve == "inverse":
      # The inverse itself is float32; only its application follows `matmul`.
      sol = _dot("...ij,...jd->...id", triangular.unit_lower_inverse(L), rhs, matmul)
    else:
      eye = jnp.eye(c, dtype=L.dtype)
      with jax.default_matmul_precision("highest"):
        sol = jax.lax.linalg.triangular_solve(
            eye + L, rhs, left_side=True, lower=True, unit_diagonal=True)
    dk = K_erase.shape[-1]
    Y, U = sol[..., :dk], sol[..., dk:]
  return QG, P, Y, U, KG, decay_chunk


def _state_passing(QG, P, Y, U, KG, decay_chunk, S0, starts=None, keep_states=False):
  """The sequential part: a `lax.scan` over chunks carrying the float32 state.

  Inputs have layout [Nc, B, HV, ...]. `starts = (flags [Nc], states fn)` replaces the carry by
  a sequence's initial state at chunks where a varlen sequence begins.
  """

  def step(S, xs):
    qg, p, y, u, kg, decay, idx = xs
    if starts is not None:
      flags, start_state = starts
      S = jnp.where(flags[idx], start_state(idx), S)
    E = u if y is None else u - _einsum("...ck,...kv->...cv", y, S)
    O = _einsum("...ij,...jv->...iv", p, E)
    O = O + (_einsum("...ck,...kv->...cv", qg, S) if qg is not None else 0.0)
    decayed = S if decay is None else decay[..., None] * S
    S_next = decayed + _einsum("...ck,...cv->...kv", kg, E)
    return S_next, (O, E, S_next if keep_states else None)

  n_chunks = P.shape[0]
  # XLA CPU's YNNPACK fusion miscompiles (garbage, differing between compiles) a fusion holding
  # the dots of a one-iteration scan once a zero S0 is folded in as a broadcast constant; the
  # barrier keeps S0 opaque. Reproduction: tests/test_xla_cpu_workarounds.py.
  S0 = jax.lax.optimization_barrier(S0)
  xs = (QG, P, Y, U, KG, decay_chunk, jnp.arange(n_chunks))
  S, (O, E, states) = jax.lax.scan(step, S0, xs)
  return O, E, S, states


def pad_time(x, t_pad, mode="constant"):
  """Pads axis 1 (time) of x to t_pad; None passes through. Shared with the kernel glue."""
  if x is None or x.shape[1] == t_pad:
    return x
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, t_pad - x.shape[1])
  return jnp.pad(x, pad, mode=mode)


def _to_chunks(x, c):
  """[B, T, HV, ...] -> [Nc, B, HV, C, ...]."""
  if x is None:
    return None
  b, t, hv = x.shape[:3]
  x = x.reshape(b, t // c, c, hv, *x.shape[3:])
  return jnp.moveaxis(jnp.moveaxis(x, 3, 2), 1, 0)


def _from_chunks(x):
  """[Nc, B, HV, C, D] -> [B, T, HV, D]."""
  nc, b, hv, c, d = x.shape
  return jnp.moveaxis(x, 0, 1).transpose(0, 1, 3, 2, 4).reshape(b, nc * c, hv, d)


def chunk_cumulative_gates(g, to_chunks):
  """(G, gate_kind): the in-chunk cumulative sum of the log gates and "scalar" / "channel" /
  None. g `[B, T, HV]` or `[B, T, HV, K]` or None; `to_chunks` splits the time axis of a
  `[B, T, HV, D]` array into chunks (whatever chunk layout the caller uses)."""
  if g is None:
    return None, None
  gate_kind = "channel" if g.ndim == 4 else "scalar"
  G = jnp.cumsum(to_chunks(g[..., None] if gate_kind == "scalar" else g), axis=-2)
  return (G[..., 0] if gate_kind == "scalar" else G), gate_kind


def _chunk_core(q, k, k_erase, v_write, g, S0, *, chunk_size, segidx=None, starts=None,
                keep_states=False):
  """Chunked recurrence on [B, T, HV, ...] inputs with T a multiple of chunk_size."""
  c = chunk_size
  G, gate_kind = chunk_cumulative_gates(g, functools.partial(_to_chunks, c=c))
  same = cont = keep = None
  if segidx is not None:
    # [B, T] -> [Nc, B, 1, C]; the entry segment is the one of the token before the chunk.
    sc = _to_chunks(segidx[:, :, None, None], c)[..., 0]                  # [Nc, B, 1, C]
    prev = jnp.concatenate([segidx[:, :1], segidx[:, c - 1:-1:c]], axis=1)  # [B, Nc]
    entry = jnp.moveaxis(prev, 1, 0)[:, :, None, None]                     # [Nc, B, 1, 1]
    same = sc[..., :, None] == sc[..., None, :]
    cont = (sc == entry).astype(jnp.float32)
    keep = (sc == sc[..., -1:]).astype(jnp.float32)
  intra = jax.checkpoint(functools.partial(_intra_chunk, gate_kind=gate_kind))
  QG, P, Y, U, KG, decay_chunk = intra(_to_chunks(q, c), _to_chunks(k, c), _to_chunks(k_erase, c),
                              _to_chunks(v_write, c), G, same=same, cont=cont, keep=keep)
  O, E, S, states = _state_passing(QG, P, Y, U, KG, decay_chunk, S0, starts=starts,
                                   keep_states=keep_states)
  return _from_chunks(O), _from_chunks(E), S, states


def _varlen_relayout(cu_seqlens, t, c):
  """Places sequence n at chunk `chunk_off[n]` so every sequence starts on a chunk start.

  Returns (dest [T] new position of each token, total padded length, chunk_off [N],
  last_chunk [N]). The padded length is the static bound ceil(T/C) + N chunks.
  """
  n = cu_seqlens.shape[0] - 1
  lens = cu_seqlens[1:] - cu_seqlens[:-1]
  n_chunks = (lens + c - 1) // c
  chunk_off = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(n_chunks)[:-1]])
  seq = seg_lib.sequence_index(cu_seqlens, t)
  dest = chunk_off[seq] * c + (jnp.arange(t, dtype=jnp.int32) - cu_seqlens[seq])
  total = (-(-t // c) + n) * c
  return dest, total, chunk_off, chunk_off + n_chunks - 1


def chunk_delta_family(mixer, q, k, v, gates, *, scale, initial_state, layout, chunk_size,
                       output_final_state=False, tuning=None):
  """The `chunk` implementation (see `api.run_mixer` for the contract)."""
  del tuning  # no tuning (api passes None)
  g, erase, write = canonical_gates(mixer, v, gates)
  b, t, h, dk = q.shape
  hv, dv = v.shape[2], v.shape[3]
  n_rep = hv // h
  q = jnp.repeat(q, n_rep, axis=2) * scale
  k = jnp.repeat(k, n_rep, axis=2)
  k_erase = None if erase is None else k * erase
  v_write = v if write is None else v * write
  c = chunk_size

  if layout.is_varlen:
    dest, total, chunk_off, last_chunk = _varlen_relayout(layout.cu_seqlens, t, c)
    place = lambda x: None if x is None else (
        jnp.zeros((1, total) + x.shape[2:], x.dtype).at[:, dest].set(x))
    n_chunks = total // c
    flags = jnp.zeros((n_chunks,), bool).at[chunk_off].set(True)
    seq_of_chunk = jnp.zeros((n_chunks,), jnp.int32).at[chunk_off].set(
        jnp.arange(chunk_off.shape[0], dtype=jnp.int32))
    table = (jnp.zeros((chunk_off.shape[0], hv, dk, dv), jnp.float32) if initial_state is None
             else initial_state)
    S0 = jnp.zeros((1, hv, dk, dv), jnp.float32)
    start_state = lambda i: table[seq_of_chunk[i]][None]
    O, E, _, states = _chunk_core(place(q), place(k), place(k_erase), place(v_write), place(g),
                                  S0, chunk_size=c, starts=(flags, start_state),
                                  keep_states=output_final_state)
    final = states[last_chunk, 0] if output_final_state else None
    return O[:, dest], final, E[:, dest]

  if layout.valid is not None:
    # Padding rows are identity steps: no decay, no erase, no write, zero output.
    m = layout.valid[:, :, None, None].astype(jnp.float32)
    q, k, v_write = q * m, k * m, v_write * m
    k_erase = None if k_erase is None else k_erase * m
    g = None if g is None else g * (m if g.ndim == 4 else m[..., 0])
  t_pad = -(-t // c) * c
  pad = functools.partial(pad_time, t_pad=t_pad)
  segidx = None if layout.segidx is None else pad_time(layout.segidx, t_pad, mode="edge")
  S0 = jnp.zeros((b, hv, dk, dv), jnp.float32) if initial_state is None else initial_state
  O, E, S, _ = _chunk_core(pad(q), pad(k), pad(k_erase), pad(v_write), pad(g), S0, chunk_size=c,
                           segidx=segidx)
  return O[:, :t], (S if output_final_state else None), E[:, :t]
