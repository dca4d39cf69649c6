"""`delta_rule`: DeltaNet, the delta rule S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ."""

from __future__ import annotations

from lineax_attn.ops import api


@api.with_common_doc
def delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
               segment_ids=None, cu_seqlens=None, chunk_size=64, return_residual=False,
               implementation=None, tuning=None):
  """DeltaNet: one online regression step per token, r_t = β_t(v_t − S_{t−1}ᵀk_t), S_t = S_{t−1} + k_t r_tᵀ.

  Args:
    q, k: `[B, T, H, K]` queries and keys (L2-normalised by the layer; scaled here by `scale`).
    v: `[B, T, HV, V]` values; HV must be a multiple of H (value head j reads key head j // (HV/H)).
    beta: `[B, T, HV]` write strength in [0, 2]: (0, 1) from a sigmoid, up to 2 with negative
      eigenvalues.
    {common}
  """
  return api.run_mixer("delta_rule", q, k, v, {"beta": beta}, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, segment_ids=segment_ids,
                       cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                       return_residual=return_residual, implementation=implementation,
                       tuning=tuning)
