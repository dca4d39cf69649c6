"""KDA (docs/MATH.md §2.5): S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} + β_t k_t v_tᵀ.

α has one value per key channel.
"""

from __future__ import annotations

from pallas_kernels.tpu import _common
from pallas_kernels.tpu.template import beta_weighted_delta


@_common.with_doc
def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        segidx=None, valid=None, cu_seqlens=None, block_sizes=None, interpret=None):
  """Chunkwise KDA on TPU (per-channel gate: anchored 16-row sub-chunks, docs/MATH.md §3.4).

  Args:
    q, k: `[B, T, H, K]`; v: `[B, T, HV, V]`; g: `[B, T, HV, K]` log decay ≤ 0;
    beta: `[B, T, HV]`.
    {common}
  """
  return beta_weighted_delta(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, segidx=segidx, valid=valid,
                             cu_seqlens=cu_seqlens, block_sizes=block_sizes, interpret=interpret)
