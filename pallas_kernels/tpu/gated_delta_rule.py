"""Gated DeltaNet (docs/MATH.md §2.4): S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ.

α is one scalar per value head.
"""

from __future__ import annotations

from pallas_kernels.tpu import _common
from pallas_kernels.tpu.template import beta_weighted_delta


@_common.with_doc
def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                     output_final_state=False, segidx=None, valid=None, cu_seqlens=None,
                     block_sizes=None, interpret=None):
  """Chunkwise GDN on TPU (scalar gate per value head: one C×C decay matrix per chunk).

  Args:
    q, k: `[B, T, H, K]`; v: `[B, T, HV, V]`; g: `[B, T, HV]` log decay ≤ 0; beta: `[B, T, HV]`.
    {common}
  """
  return beta_weighted_delta(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, segidx=segidx, valid=valid,
                             cu_seqlens=cu_seqlens, block_sizes=block_sizes, interpret=interpret)
