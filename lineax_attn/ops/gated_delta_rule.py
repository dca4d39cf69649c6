"""`gated_delta_rule`: Gated DeltaNet (GDN), a scalar decay per value head before the delta edit."""

from __future__ import annotations

from lineax_attn.ops import api


@api.with_common_doc
def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                     segment_ids=None, cu_seqlens=None, chunk_size=64, return_residual=False,
                     implementation=None, tuning=None):
  """Gated DeltaNet: S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ with α_t = exp(g_t).

  Args:
    q, k: `[B, T, H, K]` queries and keys (L2-normalised by the layer; scaled here by `scale`).
    v: `[B, T, HV, V]` values; HV must be a multiple of H (value head j reads key head j // (HV/H)).
    g: `[B, T, HV]` log decay, <= 0 and finite.
    beta: `[B, T, HV]` write strength in [0, 2]: (0, 1) from a sigmoid, up to 2 with negative
      eigenvalues.
    {common}
  """
  return api.run_mixer("gated_delta_rule", q, k, v, {"g": g, "beta": beta}, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, segment_ids=segment_ids,
                       cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                       return_residual=return_residual, implementation=implementation,
                       tuning=tuning)
