"""A linear mixer with each row split into pieces inside one device (issue #17's "row split").

A chunk kernel runs one program per (batch row, head) through the sequence, so at B1 H16 a
GPU of 132 SMs has 16 state walks to run however long T is. Context parallelism
(`context.py`) splits the time axis over devices. The same maths splits it inside one device:
the P pieces of a row become P rows of the batch, `[B, T] -> [B·P, T/P]`, and the state
passes of all of them run at once. Each piece's pass is affine in the state S_in entering
it (`context.affine_pass`: one op call with K extra value columns from [0 | I]):

    S_out = M S_in + B,    o_t = o0_t + S_inᵀ a_t

and a short loop over the P pieces composes the entry states, S_in(p + 1) = M_p S_in(p) + B_p,
from the initial state. A segment starting at a piece boundary cuts the carry there, as in
`context.entry_states`. Then one `[T, K] x [K, V]` product a head corrects the outputs.

The result equals the op on the whole row, forward and every gradient (plain autodiff through
the op and the composition; tests/test_row_split.py against the scan). The price is the K
extra value columns (V + K wide passes: twice the state-pass work at K = V) and the P
`[K, K] x [K, V]` compositions. What it buys is P times the parallelism. Where that pays
(small B·HV, long T) has to be measured on the GPU; it has not been yet.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from lineax_attn import ops
from lineax_attn.parallel import context


def _to_pieces(x, pieces):
  """`[B, T, ...]` -> `[B·P, T/P, ...]` (piece p of row b at row b·P + p)."""
  b, t = x.shape[:2]
  return x.reshape((b * pieces, t // pieces) + x.shape[2:])


def _by_piece(x, b, pieces):
  """`[B·P, ...]` -> `[P, B, ...]`."""
  return jnp.moveaxis(x.reshape((b, pieces) + x.shape[1:]), 1, 0)


def row_split(mixer, q, k, v, *gates, pieces: int, scale=None, initial_state=None,
              output_final_state=False, segment_ids=None, cu_seqlens=None, chunk_size=64,
              return_residual=False, implementation=None, tuning=None):
  """The linear mixer `mixer` with every row cut into `pieces` pieces passed at once.

  Args: as the op (`lineax_attn.ops.<mixer>`), plus pieces, the number of pieces per row (1:
  the plain op). T need not divide: the row is padded at its end with padding tokens (segment
  id 0, identity steps), which change neither the outputs nor the final state.
  implementation: the op implementation of the pieces' pass (None: the default for this
  backend); tuning: its `GpuTuning` (None: the default). cu_seqlens: not supported
  (ValueError); pack sequences with segment_ids.

  Returns: as the op.
  """
  if not isinstance(pieces, int) or isinstance(pieces, bool) or pieces < 1:
    raise ValueError(f"`pieces` must be an int >= 1, got {pieces!r}.")
  name, dims, gates, scale, chunk_size, initial_state = context.checked_call(
      mixer, q, k, v, gates, scale=scale, chunk_size=chunk_size, segment_ids=segment_ids,
      initial_state=initial_state, cu_seqlens=cu_seqlens, where="by row_split")
  kwargs = dict(scale=scale, chunk_size=chunk_size, implementation=implementation,
                tuning=tuning)
  if pieces == 1:
    op = getattr(ops, name)
    return op(q, k, v, *gates, initial_state=initial_state,
              output_final_state=output_final_state, segment_ids=segment_ids,
              return_residual=return_residual, **kwargs)
  b, t, hv, dk, dv = dims.b, dims.t, dims.hv, dims.dk, dims.dv
  t_pad = -(-t // pieces) * pieces
  if t_pad != t or segment_ids is not None:
    # Padding tokens are segment id 0 (identity steps): one id for a row without segments.
    ids = (jnp.ones((b, t), jnp.int32) if segment_ids is None
           else segment_ids.astype(jnp.int32))
    segment_ids = jnp.pad(ids, ((0, 0), (0, t_pad - t)))
  pad = lambda x: jnp.pad(x, ((0, 0), (0, t_pad - t)) + ((0, 0),) * (x.ndim - 2))
  arrays = [_to_pieces(pad(x), pieces) for x in (q, k, v, *gates)]
  seg = None if segment_ids is None else _to_pieces(segment_ids, pieces)
  piece_dims = dataclasses.replace(dims, b=b * pieces, t=t_pad // pieces)
  pairs, apply, correct_o, correct_r = context.affine_pass(
      name, piece_dims, *arrays[:3], arrays[3:], axis_name=None, segment_ids=seg, **kwargs)
  firsts = lasts = None
  if seg is not None:
    firsts, lasts = (_by_piece(x, b, pieces) for x in context.boundary_ids(seg))
  s_init = (jnp.zeros((b, hv, dk, dv), jnp.float32) if initial_state is None
            else initial_state.astype(jnp.float32))
  entries, final = context.entry_states(
      apply, tuple(_by_piece(x, b, pieces) for x in pairs), s_init, firsts, lasts, pieces)
  s_in = jnp.moveaxis(entries, 0, 1).reshape((b * pieces,) + entries.shape[2:])
  unpiece = lambda x: x.reshape((b, t_pad) + x.shape[2:])[:, :t].astype(v.dtype)
  o = unpiece(correct_o(s_in))
  final = final if output_final_state else None
  if return_residual:
    return o, final, unpiece(correct_r(s_in))
  return o, final
