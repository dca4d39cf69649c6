"""DeltaNet (docs/MATH.md §2.3): S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ."""

from __future__ import annotations

from pallas_kernels.tpu import _common
from pallas_kernels.tpu.template import beta_weighted_delta


@_common.with_doc
def delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
               segidx=None, valid=None, cu_seqlens=None, block_sizes=None, interpret=None):
  """Chunkwise DeltaNet on TPU (k̃ = β k, ṽ = β v, no decay).

  Args:
    q, k: `[B, T, H, K]`; v: `[B, T, HV, V]`; beta: `[B, T, HV]` in (0, 2).
    {common}
  """
  return beta_weighted_delta(q, k, v, None, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, segidx=segidx, valid=valid,
                             cu_seqlens=cu_seqlens, block_sizes=block_sizes, interpret=interpret)
