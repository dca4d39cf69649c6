"""What the op benchmarks share (`bench_kernels`, `bench_ab`): their inputs, the fwd+bwd
function they time, and the peers' spellings of our ops (jax-linear-attention's kinds, FLA's
functions). No flags, so any benchmark can import it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lineax_attn.ops import specs

# jax-linear-attention 0.1.0's name (`jla.ops.linear_attention(kind, ...)`) of each of our ops.
JLA_KIND = {"delta_rule": "deltanet", "gated_delta_rule": "gated_deltanet", "kda": "kda",
            "gdn2": "gdn2"}


def make_inputs(mixer, b, t, h, d, seed=0):
  """Inputs of docs/MATH.md §9 (`specs.random_inputs`: unit q/k, σ gates, logsigmoid decays) as
  numpy float32, gates by name."""
  q, k, v, gates, _ = specs.random_inputs(mixer, b=b, t=t, h=h, dk=d, dv=d, seed=seed,
                                          with_state=False)
  return q, k, v, dict(zip(specs.resolve(mixer).gate_names, gates))


# Modes of the op benchmarks. "fwdbwd": the loss <o, do> on a fixed cotangent and its gradients,
# the loss returned so that o is made, as in training (where o feeds the layer above).
# "fwdbwd_dep": the same with a cotangent that depends on the output, dO = do + DEP_WEIGHT · o
# (the loss <o, do> + DEP_WEIGHT |o|² / 2), as dO comes back through the layers above in
# training: the backward then waits for the forward's outputs. "fwdbwd_grads": the gradients
# alone (the loss dropped; what "fwdbwd" timed before 2026-12-07): XLA then removes every kernel
# that only makes o, so an op whose VJP saves no o times without its forward's output pass
# (jla's GDN and DeltaNet: their forward kernel and the loss's reduction are dropped, 0.16 ms
# of a 0.89 ms call on an H100, docs/BENCHMARKS.md "forty-second stage"). No training step
# gets that saving.
MODES = ("fwd", "fwdbwd", "fwdbwd_dep", "fwdbwd_grads")
DEP_WEIGHT = 1e-3


def grad_fn(fwd, n_args, dependent: bool = False, with_loss: bool = True):
  """jit-able fwd+bwd: (loss, gradients) of <o, do> (dependent: + DEP_WEIGHT |o|² / 2) with
  respect to every input; with_loss=False: the gradients alone (`MODES`' "fwdbwd_grads")."""
  def loss(do, *a):
    o = fwd(*a).astype(jnp.float32)
    return jnp.sum(o * do) + (0.5 * DEP_WEIGHT * jnp.sum(o * o) if dependent else 0.0)

  differentiate = jax.value_and_grad if with_loss else jax.grad

  def f(do, *args):
    return differentiate(lambda *a: loss(do, *a), argnums=tuple(range(n_args)))(*args)
  return f


def jax_call(fwd, np_in, mode):
  """(function, arguments) to time for `mode` (`MODES`): "fwd" is fwd(q, k, v, *gates) on bf16
  q, k, v and float32 gates; "fwdbwd" is `grad_fn(fwd)` (loss and gradients) on a fixed bf16
  cotangent and the same; "fwdbwd_dep" the same with the cotangent depending on the output;
  "fwdbwd_grads" the fixed cotangent's gradients alone."""
  if mode not in MODES:
    raise ValueError(f"mode {mode!r} is not one of {MODES}")
  q, k, v, gates = np_in
  args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  args += [jnp.asarray(x, jnp.float32) for x in gates.values()]
  if mode == "fwd":
    return fwd, args
  do = jnp.asarray(np.random.default_rng(1).standard_normal(v.shape, dtype=np.float32),
                   jnp.bfloat16)
  return grad_fn(fwd, len(args), dependent=mode == "fwdbwd_dep",
                 with_loss=mode != "fwdbwd_grads"), [do] + args


def ours_op(mixer, impl, tuning=None, pieces=None):
  """f(q, k, v, *gates) -> o of our op `mixer` with `implementation=impl` (and `tuning`); with
  `pieces`, every row cut into that many pieces (`lineax_attn.parallel.pieces.row_split`)."""
  from lineax_attn import ops  # pylint: disable=g-import-not-at-top
  if pieces:
    from lineax_attn.parallel import pieces as row_pieces  # pylint: disable=g-import-not-at-top
    return lambda *a: row_pieces.row_split(mixer, *a, pieces=pieces, implementation=impl,
                                          tuning=tuning)[0]
  op = getattr(ops, mixer)
  return lambda *a: op(*a, implementation=impl, tuning=tuning)[0]


def jla_op(mixer, gate_names):
  """f(q, k, v, *gates in `gate_names` order) -> o of jax-linear-attention's Mosaic GPU kernels
  for `mixer`; imports jla."""
  from jla.ops import linear_attention as jla_la  # pylint: disable=g-import-not-at-top
  names = list(gate_names)
  return lambda *a: jla_la(JLA_KIND[mixer], *a[:3], impl="mosaic_gpu",
                           **dict(zip(names, a[3:])))[0]


def fla_op(mixer):
  """FLA's (fla-core) chunk function of `mixer` as f(q, k, v, gates by name) -> o, torch
  tensors [B, T, H, D]; imports FLA."""
  # pylint: disable=g-import-not-at-top
  if mixer == "gated_delta_rule":
    import fla.ops.common.chunk_o as chunk_o
    chunk_o.TRITON_ABOVE_3_7_1 = True  # lets its Hopper backward run on triton 3.6 (timing only)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return lambda q, k, v, g: chunk_gated_delta_rule(q, k, v, g["g"], g["beta"])[0]
  if mixer == "delta_rule":
    from fla.ops.delta_rule import chunk_delta_rule
    return lambda q, k, v, g: chunk_delta_rule(q, k, v, g["beta"])[0]
  if mixer == "kda":
    from fla.ops.kda import chunk_kda
    return lambda q, k, v, g: chunk_kda(q, k, v, g["g"], g["beta"])[0]
  if mixer == "gdn2":
    from fla.ops.gdn2 import chunk_gdn2
    return lambda q, k, v, g: chunk_gdn2(q, k, v, g["g"], g["b"], g["w"])[0]
  from fla.ops.linear_attn import chunk_linear_attn
  return lambda q, k, v, g: chunk_linear_attn(q, k, v, normalize=False)[0]
