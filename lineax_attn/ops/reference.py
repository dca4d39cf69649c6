"""The `lax.scan` references: one token at a time, exactly the step recurrences of docs/MATH.md §2.

These are the truth every other implementation is tested against, so they are written to be
read, not to be fast. Per value head the state is S ∈ R^{K×V} (FLA orientation, o = Sᵀq), the
decay is applied before the delta edit, and the edit reads the decayed state:

    S̄_t = Diag(α_t) S_{t−1};   r_t = ṽ_t − S̄_tᵀ k̃_t;   S_t = S̄_t + k_t r_tᵀ;   o_t = S_tᵀ (scale·q_t)

Each mixer's step (`specs.MixerSpec.step`, written out per mixer in `specs.py`) is that template
for one mixer, on one (batch, value head) and one token. `scan_reference` runs a step over time, vmapped over batch and value heads, and handles
padding (identity steps, zero outputs), segment resets and varlen start states (docs/MATH.md §1.7).
All arithmetic is float32 with `Precision.HIGHEST` matmuls.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from lineax_attn.ops import segments as seg_lib
from lineax_attn.ops import specs


# mixer name -> its scan step (`specs.MixerSpec.step`, written out per mixer in specs.py).
STEPS: Mapping = specs.SpecView("step")


def _scan_row(step, S0, xs, valid, start, start_state, gate_names, keep_states=False):
  """One (batch, value head): scan `step` over T tokens.

  Args:
    S0: [K, V] state before the first token.
    xs: dict of per-token inputs, leading axis T.
    valid: [T] bool; padding tokens are identity steps with zero outputs.
    start: [T] bool; the state is replaced by `start_state[t]` before token t runs.
    start_state: callable t -> [K, V], the state to restart from at token t.
    keep_states: also return the state after every token ([T, K, V]; varlen final states).
  Returns:
    o [T, V], r [T, V], final S [K, V], and the per-token states or None.
  """

  def body(S, x):
    t, valid_t, start_t = x["t"], x["valid"], x["start"]
    S = jnp.where(start_t, start_state(t), S)
    S_new, o, r = step(S, x["q"], x["k"], x["v"], *[x[n] for n in gate_names])
    S = jnp.where(valid_t, S_new, S)
    zero = jnp.zeros_like(o)
    return S, (jnp.where(valid_t, o, zero), jnp.where(valid_t, r, zero), S if keep_states else None)

  xs = dict(xs, valid=valid, start=start, t=jnp.arange(valid.shape[0]))
  S, (o, r, states) = jax.lax.scan(body, S0, xs)
  return o, r, S, states


def scan_reference(mixer, q, k, v, gates, *, scale, initial_state, layout, chunk_size=None,
                   output_final_state=False, tuning=None):
  """Runs `mixer`'s step recurrence over time. Inputs validated float32; see `api.run_mixer`.

  Returns o [B, T, HV, V], final_state ([B or N, HV, K, V] or None) and r [B, T, HV, V].
  """
  del chunk_size, tuning  # one token at a time; no tuning (api passes None)
  step = specs.resolve(mixer).step
  b, t, h, dk = q.shape
  hv, dv = v.shape[2], v.shape[3]
  n_rep = hv // h
  # GVA: value head j reads key head j // n_rep.
  q = jnp.repeat(q, n_rep, axis=2) * scale
  k = jnp.repeat(k, n_rep, axis=2)
  gate_names = tuple(gates)
  # Per (batch, value head) rows: move heads next to batch -> [B, HV, T, ...].
  to_rows = lambda x: jnp.moveaxis(x, 2, 1)
  xs = {"q": to_rows(q), "k": to_rows(k), "v": to_rows(v)}
  xs.update({n: to_rows(x) for n, x in gates.items()})

  zeros_state = jnp.zeros((dk, dv), jnp.float32)
  if layout.is_varlen:
    cu = layout.cu_seqlens
    n_seq = cu.shape[0] - 1
    seq = seg_lib.sequence_index(cu, t)  # [T]
    pos = jnp.arange(t)
    start = jnp.isin(pos, cu[:-1])
    valid = jnp.ones((t,), bool)
    table = (jnp.zeros((n_seq, hv, dk, dv), jnp.float32) if initial_state is None
             else initial_state)

    def run_head(xs_h, table_h):  # B = 1
      return _scan_row(step, zeros_state, xs_h, valid, start, lambda i: table_h[seq[i]], gate_names,
                       keep_states=output_final_state)

    o, r, _, states = jax.vmap(run_head, in_axes=(0, 1))(
        jax.tree.map(lambda x: x[0], xs), table)
    o, r = o[None], r[None]
    final = None
    if output_final_state:
      ends = cu[1:] - 1
      final = jnp.moveaxis(states[:, ends], 0, 1)  # [N, HV, K, V]
  else:
    valid = jnp.ones((b, t), bool) if layout.valid is None else layout.valid
    if layout.segidx is None:
      start = jnp.zeros((b, t), bool)
    else:
      start = seg_lib.segment_start_flags(layout.segidx)
    S0 = (jnp.zeros((b, hv, dk, dv), jnp.float32) if initial_state is None else initial_state)

    def run_row(xs_b, S0_b, valid_b, start_b):
      run_head = lambda xs_h, S0_h: _scan_row(
          step, S0_h, xs_h, valid_b, start_b, lambda i: zeros_state, gate_names)[:3]
      return jax.vmap(run_head)(xs_b, S0_b)

    o, r, final = jax.vmap(run_row)(xs, S0, valid, start)
    final = final if output_final_state else None
  # [B, HV, T, V] -> [B, T, HV, V]
  return jnp.moveaxis(o, 1, 2), final, jnp.moveaxis(r, 1, 2)
