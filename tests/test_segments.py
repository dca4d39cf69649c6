"""Segments, padding and varlen (docs/MATH.md §1.7; §9 identities 2 and 3), five linear mixers.

The oracle for "each sequence on its own" is one call of the scan reference *without* segment
ids or cu_seqlens: every sequence is a row of a batch, started from its own initial state and
followed by zero rows up to a common length. A zero row (q = k = v = 0, every gate 0) is an
identity step of §2.0 (k = 0 writes nothing, g = 0 decays nothing, r = 0), so each row's
final_state is the state after its last real token, and no segment logic takes part.

All inputs share one shape ([2, 75] tokens, H = 1, HV = 2, K = 8, V = 12, so GVA is on), so
each jitted call compiles once per mixer and implementation. float32: rel <= 1e-5 on o, r and
states, 5e-5 on gradients (docs/MATH.md §9).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import MIXERS, assert_close, make_inputs, run
from lineax_attn.ops import api

TOL = 1e-5        # docs/MATH.md §9: fp32 outputs, states and r
GRAD_TOL = 5e-5   # docs/MATH.md §9: fp32 gradients
IMPLEMENTATIONS = ("scan", "chunk")
CHUNK = 16
SHAPE = dict(b=2, t=75, h=1, hv=2, dk=8, dv=12)

# The scan reference handles initial states, padding, segment resets and varlen start states in
# mixer-independent code (`reference._scan_row` / `scan_reference`: `jnp.where` on the state
# around an opaque per-mixer step, the gates carried as per-token inputs whatever their shape).
# So for "scan" the default run keeps one scalar-gate and one per-channel mixer (GDN, GDN-2:
# gates on the key and the value axis) in the split, packing and varlen tests; the other mixers'
# scan cases run that same code and are `-m slow` (suite time). Every mixer's chunk cases of
# those tests stay in the default run (the varlen-vs-segments cross-check: see there).
_SCAN_DEFAULT = ("gated_delta_rule", "gdn2")


def _cases():
  """(mixer, implementation) params, the scan cases outside `_SCAN_DEFAULT` marked slow."""
  return [pytest.param(m, impl, marks=pytest.mark.slow if impl == "scan" and m not in
                       _SCAN_DEFAULT else ())
          for m in MIXERS for impl in IMPLEMENTATIONS]


@functools.partial(jax.jit, static_argnames=("mixer", "implementation", "chunk_size"))
def forward(args, initial_state, segment_ids, cu_seqlens, *, mixer, implementation,
            chunk_size=CHUNK):
  """(o, final_state, r); jitted so each shape compiles once."""
  return run(mixer, args, initial_state=initial_state, segment_ids=segment_ids,
             cu_seqlens=cu_seqlens, output_final_state=True, return_residual=True,
             implementation=implementation, chunk_size=chunk_size)


@functools.lru_cache(maxsize=None)
def _inputs(mixer):
  args, kwargs = make_inputs(mixer, **SHAPE, seed=0)
  return tuple(np.asarray(x) for x in args), np.asarray(kwargs["initial_state"])


def inputs(mixer):
  """numpy (args, initial_state [2, HV, K, V]) of docs/MATH.md §9's distributions, at SHAPE."""
  return _inputs(mixer)


def to_jnp(xs):
  return tuple(jnp.asarray(x) for x in xs)


def run_separately(mixer, args, pieces, length):
  """Runs each piece as its own sequence with the scan reference (see the module docstring).

  Args:
    args: numpy mixer inputs, each [B, T, ...].
    pieces: list of (row b, real positions, start state [HV, K, V] or None for zeros).
    length: common padded length (>= the longest piece).
  Returns:
    list of (o [len, HV, V], r [len, HV, V], final_state [HV, K, V]) per piece, numpy.
  """
  n = len(pieces)
  batch = []
  for x in args:
    rows = np.zeros((n, length) + x.shape[2:], x.dtype)
    for i, (b, pos, _) in enumerate(pieces):
      rows[i, :len(pos)] = x[b, pos]
    batch.append(rows)
  hv, dk, dv = args[2].shape[2], args[0].shape[3], args[2].shape[3]
  s0 = np.stack([np.zeros((hv, dk, dv), np.float32) if s is None else s for _, _, s in pieces])
  o, final, r = (np.asarray(x) for x in forward(to_jnp(batch), jnp.asarray(s0), None, None,
                                                mixer=mixer, implementation="scan"))
  return [(o[i, :len(pos)], r[i, :len(pos)], final[i]) for i, (_, pos, _) in enumerate(pieces)]


def segments_of(ids):
  """Real positions of each segment of one row, straight from docs/MATH.md §1.7.

  Padding (0) takes the id before it, leading padding the first real id; a segment starts
  wherever that filled id changes (so ids 1, 2, 1 are three segments); padding is dropped.
  """
  real = [x for x in ids if x]
  if not real:
    return []
  filled, last = [], real[0]
  for x in ids:
    last = x or last
    filled.append(last)
  segments = []
  for t, x in enumerate(ids):
    if t == 0 or filled[t] != filled[t - 1]:
      segments.append([])
    if x:
      segments[-1].append(t)
  return segments


def assert_outputs_close(got, ref, tol, label):
  for name, x, y in zip(("o", "final_state", "r"), got, ref):
    assert_close(x, y, tol, f"{label} {name}")


# ------------------------------------------------------------------------------------------
# §9.2 split = one pass.


@pytest.mark.parametrize("mixer,implementation", _cases())
def test_split_equals_one_pass(mixer, implementation):
  """[0, 37) from h0, then [37, 74) from its final_state == one pass over [0, 74): o and r
  concatenated, final state. 37 is not a multiple of the chunk (16)."""
  t, t1 = 74, 37
  args, s0 = inputs(mixer)
  args = tuple(x[:, :t] for x in args)
  kw = dict(mixer=mixer, implementation=implementation)
  o, final, r = forward(to_jnp(args), jnp.asarray(s0), None, None, **kw)
  o1, mid, r1 = forward(to_jnp(x[:, :t1] for x in args), jnp.asarray(s0), None, None, **kw)
  o2, final2, r2 = forward(to_jnp(x[:, t1:] for x in args), mid, None, None, **kw)
  assert_outputs_close((np.concatenate([o1, o2], axis=1), final2, np.concatenate([r1, r2], axis=1)),
                       (o, final, r), TOL, f"{mixer}/{implementation}/split")


# ------------------------------------------------------------------------------------------
# §9.3 packing = separate.

# Chunk boundaries (C = 16) at 16, 32, 48, 64; T = 75.
PACKED_IDS = [
    # Row 0: leading padding, 1 (8), 2 (single token), 1 again (a new segment), 3 starting at a
    # chunk's first row (16) with padding inside it, 4 as a single token at a chunk's last row
    # (31) followed by padding, 5 across a chunk boundary, 1 (single), 2, trailing padding.
    [0] * 2 + [1] * 8 + [2] + [1] * 5 + [3] * 4 + [0] * 3 + [3] * 8 + [4] + [0] * 2 + [5] * 27
    + [1] + [2] * 9 + [0] * 4,
    # Row 1: 7, padding, 8 (single), 7 again across three chunk boundaries, no trailing padding.
    [7] * 20 + [0] * 3 + [8] + [7] * 51,
]


@pytest.mark.parametrize("mixer,implementation", _cases())
def test_packing_equals_separate(mixer, implementation):
  """Segments packed in rows == each segment run alone from zero state (a row's first segment
  from initial_state[b]) at real positions; o = r = 0 exactly at padding; final_state[b] ==
  the state after row b's last segment."""
  assert all(len(ids) == SHAPE["t"] for ids in PACKED_IDS)
  args, s0 = inputs(mixer)
  o, final, r = (np.asarray(x) for x in forward(
      to_jnp(args), jnp.asarray(s0), jnp.asarray(PACKED_IDS, jnp.int32), None, mixer=mixer,
      implementation=implementation))

  pieces, last_piece = [], []
  for b, ids in enumerate(PACKED_IDS):
    segments = segments_of(ids)
    pieces += [(b, pos, s0[b] if i == 0 else None) for i, pos in enumerate(segments)]
    last_piece.append(len(pieces) - 1)
  assert len(pieces) == 11  # 8 segments in row 0 (ids 1, 2, 1, 3, 4, 5, 1, 2), 3 in row 1
  separate = run_separately(mixer, args, pieces, length=max(len(p[1]) for p in pieces))
  want_o, want_r = np.zeros_like(o), np.zeros_like(r)
  for (b, pos, _), (o_i, r_i, _) in zip(pieces, separate):
    want_o[b, pos], want_r[b, pos] = o_i, r_i
  want_final = np.stack([separate[i][2] for i in last_piece])
  assert_outputs_close((o, final, r), (want_o, want_final, want_r), TOL,
                       f"{mixer}/{implementation}/packed")
  padding = np.asarray(PACKED_IDS) == 0
  assert np.all(o[padding] == 0) and np.all(r[padding] == 0), "o and r must be 0 on padding"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("mixer", MIXERS)
def test_all_padding_row(mixer, implementation):
  """A row with no real token is all identity steps: o = 0, r = 0, final_state = initial_state
  (next to a normal row, which must not leak into it)."""
  args, s0 = inputs(mixer)
  ids = np.zeros((2, SHAPE["t"]), np.int32)
  ids[1] = PACKED_IDS[1]
  o, final, r = forward(to_jnp(args), jnp.asarray(s0), jnp.asarray(ids), None, mixer=mixer,
                        implementation=implementation)
  assert np.all(np.asarray(o[0]) == 0) and np.all(np.asarray(r[0]) == 0)
  assert_close(final[0], s0[0], TOL, f"{mixer}/{implementation} final_state of a padding row")


# ------------------------------------------------------------------------------------------
# §9.3 varlen (cu_seqlens).

# Lengths 1, 19, 17, 38: a length-1 sequence, and sequences crossing chunk boundaries 16, 32,
# 48 and 64 (C = 16), with starts at offsets that are not chunk starts.
CU_SEQLENS = [0, 1, 20, 37, 75]


def varlen_inputs(mixer, seed=1):
  """Row 0 of the shared inputs (B = 1) and random per-sequence initial states [N, HV, K, V]."""
  args, _ = inputs(mixer)
  args = tuple(x[:1] for x in args)
  n = len(CU_SEQLENS) - 1
  shape = (n, SHAPE["hv"], SHAPE["dk"], SHAPE["dv"])
  return args, np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("mixer,implementation", _cases())
def test_varlen_equals_separate(mixer, implementation):
  """cu_seqlens with per-sequence initial states == each sequence alone from its own state,
  every final_state[n] included."""
  args, states = varlen_inputs(mixer)
  cu = jnp.asarray(CU_SEQLENS, jnp.int32)
  o, final, r = forward(to_jnp(args), jnp.asarray(states), None, cu, mixer=mixer,
                        implementation=implementation)
  bounds = list(zip(CU_SEQLENS[:-1], CU_SEQLENS[1:]))
  pieces = [(0, list(range(a, b)), states[n]) for n, (a, b) in enumerate(bounds)]
  separate = run_separately(mixer, args, pieces, length=max(b - a for a, b in bounds))
  want_o = np.concatenate([o_i for o_i, _, _ in separate])[None]
  want_r = np.concatenate([r_i for _, r_i, _ in separate])[None]
  want_final = np.stack([f for _, _, f in separate])
  assert_outputs_close((o, final, r), (want_o, want_final, want_r), TOL,
                       f"{mixer}/{implementation}/varlen")


# Both sides of this identity are checked against separate runs in the default run, on the
# same code with the same flags: varlen with per-sequence states by test_varlen_equals_separate,
# segment ids with a row's initial state by test_packing_equals_separate (every mixer's chunk
# form; the scan's mixer-independent handling on `_SCAN_DEFAULT`). The default run keeps this
# cross-check for GDN and GDN-2 (scalar and per-channel gates), both implementations; the other
# mixers' cases are `-m slow` (suite time).
@pytest.mark.parametrize("mixer,implementation", [
    pytest.param(m, impl, marks=() if m in _SCAN_DEFAULT else pytest.mark.slow)
    for m in MIXERS for impl in IMPLEMENTATIONS])
def test_varlen_with_zero_later_states_equals_segments(mixer, implementation):
  """initial_state[n] = 0 for n > 0: varlen == segment mode with one id per sequence (o, r,
  and final_state[N - 1] == the row's final_state)."""
  args, states = varlen_inputs(mixer)
  states[1:] = 0
  kw = dict(mixer=mixer, implementation=implementation)
  o, final, r = forward(to_jnp(args), jnp.asarray(states), None,
                        jnp.asarray(CU_SEQLENS, jnp.int32), **kw)
  lens = np.diff(CU_SEQLENS)
  ids = jnp.asarray(np.repeat(np.arange(1, len(lens) + 1), lens)[None], jnp.int32)
  o_seg, final_seg, r_seg = forward(to_jnp(args), jnp.asarray(states[:1]), ids, None, **kw)
  assert_outputs_close((o, final[-1:], r), (o_seg, final_seg, r_seg), TOL,
                       f"{mixer}/{implementation}/varlen-vs-segments")


def _varlen_loss(args, initial_state, cu_seqlens, cotangents, *, mixer, implementation):
  """<o, dO> + <final_states, dS> + <r, dR>: cotangents on every output (docs/MATH.md §9.5)."""
  outs = forward(args, initial_state, None, cu_seqlens, mixer=mixer, implementation=implementation)
  return sum(jnp.sum(x * c) for x, c in zip(outs, cotangents))


varlen_grads = jax.jit(jax.grad(_varlen_loss, argnums=(0, 1)),
                       static_argnames=("mixer", "implementation"))


@pytest.mark.parametrize("mixer", ["kda", "gdn2"])
def test_varlen_grads_chunk_equal_scan(mixer):
  """d(q, k, v, gates) and d(initial_state[n]) for every n in varlen mode: chunk == scan."""
  args, states = varlen_inputs(mixer)
  rng = np.random.default_rng(2)
  o_shape = args[2].shape
  cot = to_jnp(rng.standard_normal(s).astype(np.float32)
               for s in (o_shape, states.shape, o_shape))
  call = lambda impl: varlen_grads(to_jnp(args), jnp.asarray(states),
                                   jnp.asarray(CU_SEQLENS, jnp.int32), cot, mixer=mixer,
                                   implementation=impl)
  (g_args, g_s0), (r_args, r_s0) = call("chunk"), call("scan")
  names = ("q", "k", "v") + tuple(name for name, _ in api.MIXER_GATES[mixer])
  for name, x, y in zip(names, g_args, r_args, strict=True):
    assert_close(x, y, GRAD_TOL, f"{mixer}/varlen d{name}")
  assert_close(g_s0, r_s0, GRAD_TOL, f"{mixer}/varlen d_initial_state")
