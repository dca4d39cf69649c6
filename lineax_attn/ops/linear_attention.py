"""`linear_attention`: vanilla (unnormalised) linear attention, S_t = S_{t-1} + k_t v_tᵀ."""

from __future__ import annotations

from lineax_attn.ops import api


@api.with_common_doc
def linear_attention(q, k, v, *, scale=None, initial_state=None, output_final_state=False,
                     segment_ids=None, cu_seqlens=None, chunk_size=64, return_residual=False,
                     implementation=None, tuning=None):
  """Causal linear attention without a normaliser: o_t = S_tᵀ(scale·q_t), S_t = S_{t−1} + k_t v_tᵀ.

  Args:
    q, k: `[B, T, H, K]` queries and keys (L2-normalised by the layer; scaled here by `scale`).
    v: `[B, T, HV, V]` values; HV must be a multiple of H (value head j reads key head j // (HV/H)).
    {common}
  """
  return api.run_mixer("linear_attention", q, k, v, {}, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, segment_ids=segment_ids,
                       cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                       return_residual=return_residual, implementation=implementation,
                       tuning=tuning)
