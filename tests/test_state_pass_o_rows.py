"""The Mosaic state pass writes o, and reads its cotangent dO, in the op's own `[B, T, HV, V]`
layout (`state_passing_fwd(o_rows=True)`, `state_passing_bwd(o_rows=True)`; the Triton
products kernel likewise, tests/test_triton_gpu.py): KDA / GDN-2's states path then hands o to
the caller and takes dO from it without XLA relaying either out between chunk-major and rows
(a pass over dO of ~70 µs at B4 T4096 H16 D128 on an H100).

Oracle: the same pass in the chunk-major layout, relaid out by `gpu_chunks`: o must be its o
to the bit, and from the relaid dO the reverse pass must give the same de, dh and ds0 to the
bit (the same tiles in the same order); rows in pieces, with E's cotangent. Shapes that do
not match the layout asked for are refused by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import mosaic_gpu_or_skip

ON_GPU, INTERPRET = mosaic_gpu_or_skip()

import kernel_cases  # noqa: E402
from lineax_attn.ops import gpu_chunks  # noqa: E402
from pallas_kernels.gpu import state_passing as sp  # noqa: E402

BF16 = jnp.bfloat16


def _same_bits(got, want, name):
  assert got.dtype == want.dtype and got.shape == want.shape, (name, got.shape, want.shape)
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                np.asarray(want.astype(jnp.float32)), err_msg=name)


def test_rows_layout_is_the_chunk_major_pass_relaid_out():
  # Two rows in two pieces each, so that tiles land at a row offset and a chunk offset (the
  # second piece's); whole rows run the same code with both offsets at zero (and are checked
  # through the op by tests/test_triton_path.py's wiring test and the compiled GPU tests).
  pieces = 2
  x = kernel_cases.state_pass_inputs(7, b=2, hv=2, nc=4)
  x["s0"] = jnp.concatenate([x["s0"], 0.5 * x["s0"]], 0)   # every piece from its own state
  fwd = lambda rows: jax.jit(lambda x: sp.state_passing_fwd(
      **x, save_states=True, pieces=pieces, out_dtype=BF16, o_rows=rows,
      interpret=INTERPRET))(x)
  chunked, rows = fwd(False), fwd(True)
  _same_bits(rows[0], gpu_chunks.from_chunks(chunked[0]), "o")
  for name, a, b in zip(("e", "s_final", "h"), rows[1:], chunked[1:]):
    _same_bits(a, b, name)

  ks = jax.random.split(jax.random.key(8), 3)
  do = jax.random.normal(ks[0], chunked[0].shape).astype(BF16)            # chunk-major
  de_ext = jax.random.normal(ks[1], x["u"].shape)
  ds_final = jax.random.normal(ks[2], x["s0"].shape)
  head = (x["ny"], x["qg"], x["p"], x["kg"], x["gc"])
  bwd = lambda do, rows: jax.jit(lambda do: sp.state_passing_bwd(
      *head, do, de_ext, ds_final, pieces=pieces, de_dtype=BF16, o_rows=rows,
      interpret=INTERPRET))(do)
  for name, a, b in zip(("de", "dh", "ds0"), bwd(gpu_chunks.from_chunks(do), True),
                        bwd(do, False)):
    _same_bits(a, b, name)


def test_do_in_the_wrong_layout_is_refused():
  x = kernel_cases.state_pass_inputs(0, nc=2)
  head = (x["ny"], x["qg"], x["p"], x["kg"], x["gc"])
  chunk_major = x["u"].astype(BF16)
  with pytest.raises(ValueError, match="do"):
    sp.state_passing_bwd(*head, chunk_major, None, x["s0"], o_rows=True, interpret=INTERPRET)
  with pytest.raises(ValueError, match="do"):
    sp.state_passing_bwd(*head, gpu_chunks.from_chunks(chunk_major), None, x["s0"],
                         interpret=INTERPRET)
