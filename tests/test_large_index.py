"""`implementation="pallas_gpu"` past 2^31 elements, compiled on a Hopper GPU (opt-in).

FLA shipped silent corruption from int32 element offsets once B·T·H·K passed 2^31 (FLA issue
#1080). Our kernels index per dimension (docs/KERNELS_GPU.md, "Indexing past 2^31 elements";
tests/test_index_width.py checks the lowering on CPU); this runs them. Off by default, even on a
GPU: it needs ~100-130 GiB of GPU memory. On an H200, from the repository root:

    LINEAX_LARGE_TESTS=1 python3 -m pytest tests/test_large_index.py -x -q

(tests/conftest.py then leaves JAX on its default backend, with 95% of the GPU's memory.)

Each mixer runs forward and backward, under jit, at one call whose arrays pass 2^31 elements,
with segment ids that restart the state every 8192 tokens, so every 8192-token slice is an
independent sequence. The oracle is `implementation="chunk"` in float32 on single slices (fresh
state): the output and the gradients of Σ o·ō (fixed random ō) with respect to q, k, v and every
gate, on the first, a middle and the last slice. The last slice lies wholly past element 2^31
of the arrays named below, so an int32 element offset would corrupt exactly it.

Shapes (B = 1, H = 16): T = 2^20 + 8192, K = V = 128 for linear attention and DeltaNet (q, k,
v, u, o, e all past 2^31); GDN at K = 128, V = 64 (q, k and the state pass's K-wide operands;
V = 128 of the same intra-chunk kernel is DeltaNet's); KDA and GDN-2 at T = 2^16 + 8192, K = 64,
V = 2048 (v, the gate w, and the state pass's U, O, E and states past 2^31), because their
per-channel intra-chunk part is XLA with [C/16, 16, 16, K] intermediates per chunk, far too big
at K = 128 past 2^31 elements (about 1 TB in XLA CPU's buffer assignment). Memory, by XLA CPU's
buffer assignment with the kernels as opaque calls: 94-107 GiB per mixer (GPU's is no larger).

Tolerances: those of tests/test_pallas_gpu.py for compiled bf16-operand runs (rel 2e-2 forward,
3e-2 gradients).
"""

from __future__ import annotations

import gc
import logging
import os

import pytest

if os.environ.get("LINEAX_LARGE_TESTS") != "1":
  pytest.skip("opt-in: set LINEAX_LARGE_TESTS=1 (needs a Hopper GPU with ~130 GiB free)",
              allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from helpers import assert_close  # noqa: E402
from lineax_attn import ops  # noqa: E402
from lineax_attn.ops import pallas_gpu  # noqa: E402

if jax.default_backend() != "gpu" or not pallas_gpu.is_hopper():
  pytest.skip(f"needs a Hopper GPU, got {jax.devices()[0].device_kind}",
              allow_module_level=True)

FWD_TOL, GRAD_TOL = 2e-2, 3e-2
SEGMENT = 8192
LONG, SHORT = 2**20 + SEGMENT, 2**16 + SEGMENT
SHAPES = {   # T, H, K, V
    "linear_attention": (LONG, 16, 128, 128),
    "delta_rule": (LONG, 16, 128, 128),
    "gated_delta_rule": (LONG, 16, 128, 64),
    "kda": (SHORT, 16, 64, 2048),
    "gdn2": (SHORT, 16, 64, 2048),
}
# Each gate: (name, how it is drawn, trailing axis: None = [B, T, H] float32, "k"/"v" = per key
# / value channel in bf16, like q, k, v).
GATES = {
    "linear_attention": (),
    "delta_rule": (("beta", "sigmoid", None),),
    "gated_delta_rule": (("g", "log_sigmoid", None), ("beta", "sigmoid", None)),
    "kda": (("g", "log_sigmoid", "k"), ("beta", "sigmoid", None)),
    "gdn2": (("g", "log_sigmoid", "k"), ("b", "sigmoid", "k"), ("w", "sigmoid", "v")),
}


def _draw(key, shape, kind, dtype):
  """One random array, drawn on the device (a float32 temporary of its size at most)."""
  @jax.jit
  def draw(key):
    x = jax.random.normal(key, shape, jnp.float32)
    if kind == "unit":   # unit q / k rows, as in tests/helpers.make_inputs
      x = x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)
    elif kind == "sigmoid":
      x = jax.nn.sigmoid(x)
    elif kind == "log_sigmoid":
      x = jax.nn.log_sigmoid(x)
    return x.astype(dtype)
  return draw(key)


def _inputs(mixer, seed=0):
  t, h, dk, dv = SHAPES[mixer]
  keys = jax.random.split(jax.random.key(seed), 8)
  args = [_draw(keys[0], (1, t, h, dk), "unit", jnp.bfloat16),
          _draw(keys[1], (1, t, h, dk), "unit", jnp.bfloat16),
          _draw(keys[2], (1, t, h, dv), "normal", jnp.bfloat16)]
  trailing = {None: (), "k": (dk,), "v": (dv,)}
  for i, (_, kind, axis) in enumerate(GATES[mixer]):
    dtype = jnp.float32 if axis is None else jnp.bfloat16
    args.append(_draw(keys[3 + i], (1, t, h) + trailing[axis], kind, dtype))
  cotangent = _draw(keys[7], (1, t, h, dv), "normal", jnp.bfloat16)
  return args, cotangent


def _output_and_grads(mixer, implementation):
  op = getattr(ops, mixer)

  def run(args, cotangent, *extra):
    segments = {"segment_ids": extra[0]} if extra else {}
    o, vjp = jax.vjp(lambda *a: op(*a, implementation=implementation, **segments)[0], *args)
    return o, vjp(cotangent.astype(o.dtype))
  return jax.jit(run)


@pytest.mark.parametrize("mixer", list(SHAPES))
def test_pallas_gpu_matches_chunk_on_slices_past_2_31_elements(mixer, caplog):
  t, h, dk, dv = SHAPES[mixer]
  widest = max([dk, dv] + [dk if a == "k" else dv for _, _, a in GATES[mixer] if a])
  n_slices = t // SEGMENT
  picks = (0, n_slices // 2, n_slices - 1)
  # The last slice starts at element 2^31 (or later) of the widest arrays.
  assert picks[-1] * SEGMENT * h * widest >= 2**31
  args, cotangent = _inputs(mixer)
  ids = (jnp.arange(t, dtype=jnp.int32) // SEGMENT + 1)[None]
  with caplog.at_level(logging.WARNING, logger=pallas_gpu.__name__):
    pallas_gpu._warned.clear()
    o, grads = _output_and_grads(mixer, "pallas_gpu")(args, cotangent, ids)
    jax.block_until_ready(grads)
  assert "falls back" not in caplog.text, caplog.text    # the kernels ran, not the chunk form
  rows = lambda x, p: x[:, p * SEGMENT:(p + 1) * SEGMENT]
  got = {p: [np.asarray(rows(x, p), np.float32) for x in (o, *grads)] for p in picks}
  inputs = {p: [rows(x, p).astype(jnp.float32) for x in (*args, cotangent)] for p in picks}
  del o, grads, args, cotangent, ids
  gc.collect()

  oracle = _output_and_grads(mixer, "chunk")
  names = ["o", "dq", "dk", "dv"] + [f"d{name}" for name, _, _ in GATES[mixer]]
  for p in picks:
    *slice_args, slice_cot = inputs[p]
    o_ref, grads_ref = oracle(slice_args, slice_cot)
    for name, x, ref in zip(names, got[p], (o_ref, *grads_ref)):
      tol = FWD_TOL if name == "o" else GRAD_TOL
      assert_close(x, ref, tol, f"{mixer} {name}, tokens {p * SEGMENT}..{(p + 1) * SEGMENT}")
