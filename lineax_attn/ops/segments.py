"""Segment ids, padding and variable-length layouts (docs/MATH.md §1.7).

Two ways to put several sequences in one tensor:

* **segment mode** (`segment_ids [B, T]`): ids > 0 label contiguous segments, 0 marks padding.
  Padding ids are forward-filled (leading padding takes the first real id), a segment starts
  wherever the *filled* id changes, and `segidx` counts segment starts. "Same segment" always
  compares `segidx`, never raw ids, so ids 1 1 2 2 1 1 are three segments.
* **varlen mode** (`cu_seqlens [N + 1]`, B = 1): FLA's layout. Sequence n is
  `[cu_seqlens[n], cu_seqlens[n+1])`, starts from `initial_state[n]` and returns
  `final_state[n]`.

Everything here is plain jnp on int/bool arrays, so it works on traced values under `jit`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SegmentLayout:
  """Where the state resets and which positions are real.

  Attributes:
    valid: `[B, T]` bool, False at padding (identity steps, zero outputs); None = all real.
    segidx: `[B, T]` int32 running segment index (position 0 is segment 1); None = one segment
      per row.
    cu_seqlens: `[N + 1]` int32 for varlen mode (B = 1), else None.
  """

  valid: jax.Array | None = None
  segidx: jax.Array | None = None
  cu_seqlens: jax.Array | None = None

  @property
  def is_varlen(self) -> bool:
    return self.cu_seqlens is not None


def forward_fill_ids(segment_ids: jax.Array) -> jax.Array:
  """Fills padding ids (0) with the id before them; leading padding takes the first real id.

  A row with no real token stays all zeros.
  """
  _, t = segment_ids.shape
  pos = jnp.arange(t, dtype=jnp.int32)
  real = segment_ids != 0
  # Index of the last real position at or before t (-1 if none yet).
  last_real = jax.lax.cummax(jnp.where(real, pos, -1), axis=1)
  # Index of the row's first real position (t if the row is all padding).
  first_real = jnp.min(jnp.where(real, pos, t), axis=1, keepdims=True)
  src = jnp.where(last_real >= 0, last_real, jnp.minimum(first_real, t - 1))
  filled = jnp.take_along_axis(segment_ids, src, axis=1)
  return jnp.where(jnp.any(real, axis=1, keepdims=True), filled, 0)


def layout_from_segment_ids(segment_ids: jax.Array) -> SegmentLayout:
  """Builds the layout of segment mode: validity and running segment index."""
  segment_ids = segment_ids.astype(jnp.int32)
  filled = forward_fill_ids(segment_ids)
  starts = jnp.concatenate(
      [jnp.ones_like(filled[:, :1], dtype=bool), filled[:, 1:] != filled[:, :-1]], axis=1)
  segidx = jnp.cumsum(starts.astype(jnp.int32), axis=1)
  return SegmentLayout(valid=segment_ids != 0, segidx=segidx)


def sequence_index(cu_seqlens: jax.Array, t: int) -> jax.Array:
  """`[T]` int32: which varlen sequence each position belongs to."""
  pos = jnp.arange(t, dtype=jnp.int32)
  return (jnp.searchsorted(cu_seqlens[1:], pos, side="right")).astype(jnp.int32)


def segment_start_flags(segidx: jax.Array) -> jax.Array:
  """`[B, T]` bool: True where a new segment starts at t > 0 (the state resets there)."""
  return jnp.concatenate(
      [jnp.zeros_like(segidx[:, :1], dtype=bool), segidx[:, 1:] != segidx[:, :-1]], axis=1)
