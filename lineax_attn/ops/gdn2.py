"""`gdn2`: Gated DeltaNet-2, channel-wise decay, erase gate (key axis) and write gate (value axis)."""

from __future__ import annotations

from lineax_attn.ops import api


@api.with_common_doc
def gdn2(q, k, v, g, b, w, *, scale=None, initial_state=None, output_final_state=False,
         segment_ids=None, cu_seqlens=None, chunk_size=64, return_residual=False,
         implementation=None, tuning=None):
  """GDN-2: S_t = (I − k_t (b_t ⊙ k_t)ᵀ) Diag(α_t) S_{t−1} + k_t (w_t ⊙ v_t)ᵀ, α_t = exp(g_t).

  Args:
    q, k: `[B, T, H, K]` queries and keys (L2-normalised by the layer; scaled here by `scale`).
    v: `[B, T, HV, V]` values; HV must be a multiple of H (value head j reads key head j // (HV/H)).
    g: `[B, T, HV, K]` log decay per key channel, <= 0 and finite.
    b: `[B, T, HV, K]` erase gate along key channels, in [0, 2] ((0, 1) from a sigmoid, up to 2
      with negative eigenvalues).
    w: `[B, T, HV, V]` write gate along value channels, in [0, 1].
    {common}
  """
  return api.run_mixer("gdn2", q, k, v, {"g": g, "b": b, "w": w}, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, segment_ids=segment_ids,
                       cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                       return_residual=return_residual, implementation=implementation,
                       tuning=tuning)
