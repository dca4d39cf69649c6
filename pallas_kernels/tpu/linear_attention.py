"""Linear attention (docs/MATH.md §2.2): S_t = S_{t−1} + k_t v_tᵀ, o_t = S_tᵀ (scale q_t)."""

from __future__ import annotations

from pallas_kernels.tpu import _common
from pallas_kernels.tpu.template import delta_template


@_common.with_doc
def linear_attention(q, k, v, *, scale=None, initial_state=None, output_final_state=False,
                     segidx=None, valid=None, cu_seqlens=None, block_sizes=None, interpret=None):
  """Chunkwise linear attention on TPU (no erase, no decay: E = V, no solve).

  Args:
    q, k: `[B, T, H, K]`; v: `[B, T, HV, V]` (HV a multiple of H).
    {common}
  """
  return delta_template(q, k, None, v, None, scale=_common.default_scale(scale, q),
                        initial_state=initial_state, output_final_state=output_final_state,
                        segidx=segidx, valid=valid, cu_seqlens=cu_seqlens,
                        block_sizes=block_sizes, interpret=interpret)
