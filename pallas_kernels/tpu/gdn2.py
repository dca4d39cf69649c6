"""Gated DeltaNet-2 (docs/MATH.md §2.6).

S_t = (I − k_t (b_t ⊙ k_t)ᵀ) Diag(α_t) S_{t−1} + k_t (w_t ⊙ v_t)ᵀ.
"""

from __future__ import annotations

from pallas_kernels.tpu import _common
from pallas_kernels.tpu.template import delta_template


@_common.with_doc
def gdn2(q, k, v, g, b, w, *, scale=None, initial_state=None, output_final_state=False,
         segidx=None, valid=None, cu_seqlens=None, block_sizes=None, interpret=None):
  """Chunkwise GDN-2 on TPU (channel erase gate b on the key axis, write gate w on the value axis).

  Args:
    q, k: `[B, T, H, K]`; v: `[B, T, HV, V]`; g, b: `[B, T, HV, K]`; w: `[B, T, HV, V]`.
    {common}
  """
  kt = _common.times(_common.value_heads(k, v.shape[2]), b)
  return delta_template(q, k, kt, _common.times(v, w), g,
                        scale=_common.default_scale(scale, q), initial_state=initial_state,
                        output_final_state=output_final_state, segidx=segidx, valid=valid,
                        cu_seqlens=cu_seqlens, block_sizes=block_sizes, interpret=interpret,
                        out_dtype=v.dtype)
