"""Every linear mixer, every implementation that runs on a CPU, called as users call it: under
`jax.jit`, forward only, from a fresh compile, at the sequence lengths where chunking has edges
(T = 1, 16, C − 1, C, C + 1, 2C), returning o alone, o + final state, or o + residual.

Why each axis matters: KDA and GDN-2 `chunk` once gave garbage on about half of fresh compiles
for one-chunk sequences, only when o alone was returned (the final state and residual being
dead let XLA CPU fuse the one-iteration scan into a YNNPACK fusion it miscompiled; see
tests/test_xla_cpu_workarounds.py), so the regression needs fresh compiles, forward-only jit,
every output mode and the one-chunk lengths. The oracle is the `scan` reference, eager.

Shapes: K = V = 32 for `chunk` and `pallas_tpu` (K = 32 is where the XLA CPU miscompile showed;
K = 16 hid it), chunk 32; `pallas_gpu` runs in the Mosaic GPU interpreter at K = V = 64, chunk 64
(its supported sizes). Tolerances (rms(x − ref)/rms(ref)): float32 paths 1e-4; pallas_gpu's bf16
matmul operands 2e-2 (as tests/test_pallas_gpu.py).
"""

from __future__ import annotations

import functools

import jax
import pytest

from helpers import MIXERS, assert_close, make_inputs, run

# The miscompile this guards against showed on fresh compiles: none comes from the suite's
# compilation cache.
pytestmark = pytest.mark.usefixtures("fresh_compiles")

EDGE_CASES = {  # implementation -> (chunk size C, K = V, tolerance)
    "chunk": (32, 32, 1e-4),
    "pallas_tpu": (32, 32, 1e-4),
    "pallas_gpu": (64, 64, 2e-2),
}
MODES = ("o", "o+state", "o+residual")


def _lengths(c):
  return (1, 16, c - 1, c, c + 1, 2 * c)


def _in_default_run(implementation, mixer, t, mode, c):
  """The default run keeps the cases that hit distinct code paths; `pytest -m slow` adds the
  rest of the matrix (all 270 cases, ~20 min on 2 busy cores; it passed in full on 2026-12-01).

  chunk: the lengths 1, C − 1, C, C + 1 with o alone (the mode that exposed the miscompile),
  and the one-chunk length with the state or the residual. T = 16 and T = 2C are `-m slow`
  (suite time), their programs being those of the default lengths up to the input length: the
  chunk form pads T = 16 to one chunk as it pads T = 1 and T = C − 1 (one padded chunk, a
  one-iteration scan over chunks); T = 2C is T = C + 1's two chunks (a two-iteration scan)
  without the padding, which T = C covers unpadded. Kernels
  (interpreted, 5-20 s per case on a busy CPU): one chunk with o alone; tests/test_pallas_gpu.py
  and tests/test_pallas_tpu.py cover several chunks, padding, states and residuals."""
  if implementation == "chunk":
    return (mode == "o" and t not in (16, 2 * c)) or t == c
  return (t, mode) == (c, "o")


def _cases(implementation):
  c = EDGE_CASES[implementation][0]
  return [pytest.param(m, t, mode, marks=() if _in_default_run(implementation, m, t, mode, c)
                       else pytest.mark.slow)
          for m in MIXERS for t in _lengths(c) for mode in MODES]


@functools.lru_cache(maxsize=None)
def _inputs_and_reference(mixer, t, d):
  """The inputs and the eager `scan` reference's (o, final state, r), once per case shape."""
  args, _ = make_inputs(mixer, b=2, t=t, h=2, dk=d, dv=d, seed=t, with_state=False)
  return args, run(mixer, args, output_final_state=True, return_residual=True,
                   implementation="scan")


def _jitted_forward(mixer, implementation, mode, c):
  """A new function object each call: jax traces and XLA compiles it afresh."""
  def forward(*args):
    kw = dict(implementation=implementation, chunk_size=c)
    if mode == "o+state":
      return run(mixer, args, output_final_state=True, **kw)
    if mode == "o+residual":
      o, _, r = run(mixer, args, return_residual=True, **kw)
      return o, r
    return run(mixer, args, **kw)[0]
  return jax.jit(forward)


def _check(mixer, implementation, t, mode):
  c, d, tol = EDGE_CASES[implementation]
  args, (o_ref, s_ref, r_ref) = _inputs_and_reference(mixer, t, d)
  got = _jitted_forward(mixer, implementation, mode, c)(*args)
  want = {"o": o_ref, "o+state": (o_ref, s_ref), "o+residual": (o_ref, r_ref)}[mode]
  for name, g, w in zip(mode.split("+"), jax.tree.leaves(got), jax.tree.leaves(want)):
    assert_close(g, w, tol, f"{mixer} {implementation} T={t} {mode}: {name}")


@pytest.mark.parametrize("mixer,t,mode", _cases("chunk"))
def test_chunk_jit_forward_at_chunk_edges(mixer, t, mode):
  _check(mixer, "chunk", t, mode)


@pytest.mark.parametrize("mixer,t,mode", _cases("pallas_tpu"))
def test_pallas_tpu_jit_forward_at_chunk_edges(mixer, t, mode):
  _check(mixer, "pallas_tpu", t, mode)


@pytest.mark.parametrize("mixer,t,mode", _cases("pallas_gpu"))
def test_pallas_gpu_jit_forward_at_chunk_edges(mixer, t, mode):
  pytest.importorskip("jax.experimental.pallas.mosaic_gpu",
                      reason="this jax has no Mosaic GPU Pallas backend")
  _check(mixer, "pallas_gpu", t, mode)


@pytest.mark.parametrize("kind", ["kda"])
def test_layer_under_nnx_jit_one_chunk_matches_scan_layer(kind):
  # The user-facing path of the miscompile: the layer with the chunk form, one chunk, nnx.jit.
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from lineax_attn.layers import LinearMixer  # pylint: disable=g-import-not-at-top
  make = lambda impl: LinearMixer(kind, 64, num_heads=2, head_dim_k=32, head_dim_v=32,
                                  chunk_size=32, implementation=impl, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 32, 64))
  want = make("scan")(x)
  for _ in range(2):  # two fresh compiles
    got = nnx.jit(lambda m, x: m(x))(make("chunk"), x)
    assert_close(got, want, 1e-4, f"{kind} layer, chunk under nnx.jit vs scan")
