"""Tiling of the Pallas TPU chunk kernels: one frozen, validated dataclass."""

from __future__ import annotations

import dataclasses

# A float32 vreg is 8 sublanes x 128 lanes: the last two dims of every block are multiples of these.
SUBLANES = 8
LANES = 128


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Chunk size and tiling of the chunkwise kernels.

  Attributes:
    chunk_size: rows C per chunk, the step of the sequential state pass (docs/MATH.md §3.1).
    sub_chunk: rows per sub-chunk: the anchored per-channel gate blocks (docs/MATH.md §3.4
      rule 3) and the diagonal blocks of the blocked triangular solve (docs/MATH.md §3.7).
      Divides chunk_size.
    lane_multiple: K and V are zero-padded up to a multiple of this inside the kernels (the
      public shapes never change). 128 = one lane tile.
    save_chunk_states: if True the forward stores the float32 chunk-entry states
      `[B, HV, Nc, K, V]` for the backward; if False (the default, as FLA) the backward recomputes
      them with one extra sequential pass. See docs/KERNELS.md for the memory trade-off.
    vmem_limit_bytes: Mosaic's scoped VMEM limit, or None for the compiler default.
  """

  chunk_size: int = 64
  sub_chunk: int = 16
  lane_multiple: int = LANES
  save_chunk_states: bool = False
  vmem_limit_bytes: int | None = None

  def __post_init__(self):
    for name in ("chunk_size", "sub_chunk", "lane_multiple"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}.")
    if self.sub_chunk % SUBLANES:
      raise ValueError(f"BlockSizes.sub_chunk must be a multiple of {SUBLANES} (sublane tile), "
                       f"got {self.sub_chunk}.")
    if self.chunk_size % self.sub_chunk:
      raise ValueError(f"BlockSizes.chunk_size ({self.chunk_size}) must be a multiple of "
                       f"sub_chunk ({self.sub_chunk}).")
    if self.lane_multiple % LANES:
      raise ValueError(f"BlockSizes.lane_multiple must be a multiple of {LANES} (lane tile), "
                       f"got {self.lane_multiple}.")
    if self.vmem_limit_bytes is not None and (
        not isinstance(self.vmem_limit_bytes, int) or self.vmem_limit_bytes <= 0):
      raise ValueError(f"BlockSizes.vmem_limit_bytes must be a positive int or None, "
                       f"got {self.vmem_limit_bytes!r}.")

  def padded(self, dim: int) -> int:
    """`dim` rounded up to the lane multiple."""
    return -(-dim // self.lane_multiple) * self.lane_multiple
