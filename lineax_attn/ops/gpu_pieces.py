"""Rows cut into pieces on the `pallas_gpu` kernels (`GpuTuning(row_pieces=P)`): how many
pieces a row gets, and the two short serial steps that join them.

A walk or state pass runs one CTA per (batch row, value head, 64 value columns) through all
of a row's chunks, so small B·HV leave most of the GPU idle however long T is (B1 H16 V128:
32 CTAs on the H200's 132 SMs). Every chunkwise state pass is affine in the state entering a
stretch of chunks,

    S_out = Φ S_in + Ψ        (Φ [K, K] from the decays and erases, Ψ [K, V] from the writes),

each value column on its own. So a row cut into P pieces walks all of them at once: first
every piece from [I | 0], its first K state columns walking with v = 0 (K more columns, states
only), gives [Φ | Ψ]; `entry_states` composes the true entry states from the initial state;
then every piece walks from its own. The backward mirrors it: every piece walked back from a
zero exit cotangent gives its own entry cotangent D (dS_in = Φᵀ dS_out + D), `exit_cotangents`
carries the final state's cotangent back to every piece's end, then every piece walks back
from its own. (Linear attention, without decay or erase: Φ = I, and Ψ and D are sums over the
piece, plain products instead of walks.)

Users: `gpu_walks.walk_pieces_core` (linear attention, DeltaNet, GDN on the walks) and
`gpu_vjps.state_pass` (the state pass of KDA, GDN-2 and the split path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lineax_attn.ops.gpu_tuning import GpuTuning

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST

# `row_pieces=0` ("auto", the default): the count that a model of the passes' time says is
# fastest, among 1 and the powers of two up to MAX_ROW_PIECES that leave every piece at least
# MIN_PIECE_CHUNKS chunks (ties: fewer pieces). The model (`predicted_steps`): every pass is
# latency-bound, its CTAs one per SM, so a pass of n CTAs over m chunks takes ⌈n / SMs⌉ waves
# of m steps, a main pass's step (forward or reverse) the unit. A maps' pass's one-chain step
# costs MAPS_STEP_COST of it, a CTA carrying two chains (`pallas_kernels.gpu.maps_walk`, up to
# WALK_MAPS_CHAINS) TWO_CHAIN_STEP_COST one-chain steps, and cutting rows at all costs
# PIECES_STEPS more (composing the entry states and exit cotangents, more launches). Measured
# on the H200 at B1 T65536 H16 D128 in 4 pieces (2026-12-05; docs/BENCHMARKS.md "twenty-first
# stage"): `experiments/bench_walks.py` timed the main walk at 2.16 µs a step and the maps'
# walk at 1.28 on one chain a CTA and 2.12 on two; GDN's fwd+bwd fell 2.00 ms where the walks
# alone fell 2.13, ~60 steps of fixed cost. The state pass's maps' pass (KDA, GDN-2) is
# counted the same, untimed.
MAX_ROW_PIECES = 8
MIN_PIECE_CHUNKS = 8
MAPS_STEP_COST = 0.6
TWO_CHAIN_STEP_COST = 1.65
PIECES_STEPS = 64
WALK_MAPS_CHAINS = 2
BLOCK = 64   # state columns a chain carries (the kernels' BLOCK_V)


def device_sms() -> int:
  """Streaming multiprocessors of the default device; 132 (an H100 / H200) where JAX does not
  say (CPU, the interpreter)."""
  try:
    return int(getattr(jax.devices()[0], "core_count", 0) or 0) or 132
  except RuntimeError:
    return 132


def _waves(ctas: int, sms: int) -> int:
  return -(-int(ctas) // sms)


def _maps_waves(head_pieces: int, blocks: int, sms: int, chains: int) -> float:
  """The maps' pass in one-chain steps: its waves of CTAs, each step as long as its chains'."""
  cost = TWO_CHAIN_STEP_COST if chains == 2 else 1.0
  return cost * _waves(head_pieces * -(-blocks // chains), sms)


def maps_chains(head_pieces: int, k_blocks: int, v_blocks: int, sms: int,
                max_chains: int = WALK_MAPS_CHAINS) -> int:
  """Chains per CTA of the maps' walk over `head_pieces` (pieces · B · HV) states of
  `k_blocks + v_blocks` 64-column blocks: 2 (up to `max_chains`) where that takes fewer steps
  (it saves a wave), else 1 (one chain a CTA has an SM's tensor cores to itself)."""
  blocks = k_blocks + v_blocks
  if max_chains >= 2 and (_maps_waves(head_pieces, blocks, sms, 2)
                          < _maps_waves(head_pieces, blocks, sms, 1)):
    return 2
  return 1


def predicted_steps(pieces: int, heads: int, k_blocks: int, v_blocks: int, chunks: int,
                    sms: int, max_chains: int = 1) -> float:
  """Chunk steps, in sequence on the busiest SM, of a forward and backward pass over rows cut
  into `pieces` (1: whole rows). heads: B·HV; a whole row's pass runs `v_blocks` CTAs per head
  (V / 64), the maps' pass `k_blocks + v_blocks` chains per piece and head ((K + V) / 64, up
  to `max_chains` per CTA: `maps_chains`). Whole rows: one pass each way. Pieces: the maps'
  pass and the main pass forward, the entry cotangents' and the main reverse pass backward;
  with k_blocks 0 (linear attention, whose maps and entry cotangents are plain products) the
  main passes alone; either way PIECES_STEPS more."""
  steps = -(-chunks // pieces)
  main = _waves(pieces * heads * v_blocks, sms)
  if pieces == 1:
    return 2 * main * steps
  if not k_blocks:
    return 2 * main * steps + PIECES_STEPS
  chains = maps_chains(pieces * heads, k_blocks, v_blocks, sms, max_chains)
  maps = MAPS_STEP_COST * _maps_waves(pieces * heads, k_blocks + v_blocks, sms, chains)
  return (maps + 3 * main) * steps + PIECES_STEPS


def auto_row_pieces(heads: int, k_blocks: int, v_blocks: int, chunks: int, sms: int,
                    max_chains: int = 1) -> int:
  """Pieces per row for passes over `chunks` chunks on `sms` SMs (the other arguments:
  `predicted_steps`'): the fastest count by `predicted_steps` (ties: fewer pieces)."""
  cost = lambda p: predicted_steps(p, heads, k_blocks, v_blocks, chunks, sms, max_chains)
  best = 1
  p = 2
  while p <= MAX_ROW_PIECES and chunks // p >= MIN_PIECE_CHUNKS:
    if cost(p) < cost(best):
      best = p
    p *= 2
  return best


def walk_maps_chains(tuning: GpuTuning, pieces: int, b: int, hv: int, dk: int, dv: int) -> int:
  """Chains per CTA of the walks' maps' pass over B rows in `pieces` pieces:
  `tuning.maps_chains`, or `maps_chains`' for 0."""
  return tuning.maps_chains or maps_chains(pieces * b * hv, -(-dk // BLOCK), -(-dv // BLOCK),
                                           device_sms())


def row_pieces(tuning: GpuTuning, b: int, hv: int, dk: int, dv: int, t: int, c: int, *,
               maps: bool = True, max_chains: int = 1) -> int:
  """The pieces a row of T tokens is cut into: `tuning.row_pieces`, or the auto rule's for 0
  (maps False: no maps' pass, linear attention's walks; max_chains: the maps' pass's chains
  per CTA, WALK_MAPS_CHAINS on the walks, 1 on the state pass)."""
  if tuning.row_pieces:
    return tuning.row_pieces
  return auto_row_pieces(b * hv, -(-dk // BLOCK) if maps else 0, -(-dv // BLOCK),
                         -(-t // c), device_sms(), max_chains)


def map_start(rows: int, hv: int, dk: int, dv: int):
  """[I | 0] `[rows, HV, K, K + V]` float32: the state every piece's maps' pass starts from."""
  return jnp.concatenate([jnp.broadcast_to(jnp.eye(dk, dtype=_F32), (rows, hv, dk, dk)),
                          jnp.zeros((rows, hv, dk, dv), _F32)], axis=-1)


def by_piece(x, b: int):
  """`[B·P, ...]` (piece j of row b at b·P + j) -> `[P, B, ...]`; back with `from_pieces`."""
  return jnp.moveaxis(x.reshape((b, -1) + x.shape[1:]), 1, 0)


def from_pieces(x):
  return jnp.moveaxis(x, 0, 1).reshape((-1,) + x.shape[2:])


def entry_states(phi, psi, s0):
  """The state entering every piece, `[P, B, HV, K, V]` float32: S_0 = s0, S_{j+1} = Φ_j S_j +
  Ψ_j. phi `[P, B, HV, K, K]`, psi `[P, B, HV, K, V]`, s0 `[B, HV, K, V]` (the last piece's map
  is not read)."""
  starts, s = [], s0.astype(_F32)
  for j in range(phi.shape[0]):
    starts.append(s)
    if j + 1 < phi.shape[0]:
      s = jnp.einsum("bhij,bhjv->bhiv", phi[j], s, precision=_HIGHEST) + psi[j]
  return jnp.stack(starts)


def exit_cotangents(phi, local, ds_final):
  """The cotangent of the state leaving every piece, `[P, B, HV, K, V]` float32: the final
  state's for the last, then dS_out(j − 1) = dS_in(j) = Φ_jᵀ dS_out(j) + D_j. local: D, every
  piece's entry cotangent from its own outputs (`[P, B, HV, K, V]`); ds_final `[B, HV, K, V]`
  or None (zero). The first piece's D is not read."""
  g = jnp.zeros(local.shape[1:], _F32) if ds_final is None else ds_final.astype(_F32)
  ends = [g]
  for j in range(phi.shape[0] - 1, 0, -1):
    g = jnp.einsum("bhji,bhjv->bhiv", phi[j], g, precision=_HIGHEST) + local[j]
    ends.append(g)
  return jnp.stack(ends[::-1])
