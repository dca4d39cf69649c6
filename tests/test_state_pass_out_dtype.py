"""The state pass writes o and e in bf16 for bf16 calls (`state_passing_fwd(out_dtype=)`,
`gpu_vjps.state_pass_out_dtype`): the op returns o (and the write residual e) in the caller's
dtype anyway, and the backward's products read e as a bf16 operand, so the float32 copies were
bytes written and read for nothing (KDA / GDN-2 run this pass at every shape). The reverse pass
likewise writes de in bf16 for the channel states path (`state_passing_bwd(de_dtype=)`), whose
every reader takes dE as a bf16 operand (tests/test_triton_gpu.py checks those readers).

Oracles: the same kernel writing float32 (the pass before 2026-12-06): its o and e rounded to
bf16 must equal the bf16 pass's to the bit (one rounding of the same float32 accumulators), and
the final and chunk states must not change at all; whole rows and rows in pieces. Through the
op: a bf16 call must equal the same values passed as float32, its output, write residual and
final state rounded to bf16 to the bit (forward-only under jit), every gradient to 1e-5 (the
glue's float32 sums may round their last bit otherwise), on the split path (KDA, GDN-2 and GDN
with `forward="split"`), T a whole chunk, padded (100) and T = 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close, make_inputs, mosaic_gpu_or_skip, run

ON_GPU, INTERPRET = mosaic_gpu_or_skip()

import kernel_cases  # noqa: E402
from lineax_attn.ops import gpu_vjps  # noqa: E402
from lineax_attn.ops import pallas_gpu  # noqa: E402
from pallas_kernels.gpu import state_passing as sp  # noqa: E402

BF16 = jnp.bfloat16


def _same_bits(got, want, name):
  assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                np.asarray(want.astype(jnp.float32)), err_msg=name)


@pytest.mark.parametrize("pieces", [1, 2])
def test_bf16_outputs_are_the_float32_pass_rounded_once(pieces):
  x = kernel_cases.state_pass_inputs(3, nc=4)
  if pieces > 1:   # every piece from its own state (the op composes them; any will do here)
    x["s0"] = jnp.concatenate([x["s0"], 0.5 * x["s0"]], 0)
  run_pass = lambda dtype: jax.jit(lambda x: sp.state_passing_fwd(
      **x, save_states=pieces == 1, pieces=pieces, out_dtype=dtype, interpret=INTERPRET))(x)
  wide, narrow = run_pass(jnp.float32), run_pass(BF16)
  assert wide[0].dtype == jnp.float32 and narrow[0].dtype == BF16
  for name, a, b in zip(("o", "e"), narrow[:2], wide[:2]):
    _same_bits(a, b.astype(BF16), name)
  for name, a, b in zip(("s_final", "h"), narrow[2:], wide[2:]):
    _same_bits(a, b, name)


@pytest.mark.parametrize("pieces,with_de_ext", [(1, False), (1, True), (2, False)])
def test_bf16_de_is_the_float32_reverse_pass_rounded_once(pieces, with_de_ext):
  # The reverse pass's de (`state_passing_bwd(de_dtype=)`, the channel states path's) in bf16
  # must equal the float32 pass's rounded to bf16, to the bit (it leaves from the bf16 operand
  # copy the pass makes of the same float32 de), and dh and ds0 must not change at all.
  x = kernel_cases.state_pass_inputs(4, nc=4)
  ks = jax.random.split(jax.random.key(9), 3)
  shape = x["u"].shape
  do = jax.random.normal(ks[0], shape).astype(BF16)
  de_ext = jax.random.normal(ks[1], shape) if with_de_ext else None
  ds_final = jax.random.normal(ks[2], (x["s0"].shape[0] * pieces,) + x["s0"].shape[1:])
  args = (x["ny"], x["qg"], x["p"], x["kg"], x["gc"], do, de_ext, ds_final)
  run_pass = lambda dtype: jax.jit(lambda a: sp.state_passing_bwd(
      *a, pieces=pieces, de_dtype=dtype, interpret=INTERPRET))(args)
  wide, narrow = run_pass(jnp.float32), run_pass(BF16)
  assert wide[0].dtype == jnp.float32 and narrow[0].dtype == BF16
  _same_bits(narrow[0], wide[0].astype(BF16), "de")
  _same_bits(narrow[1], wide[1], "dh")
  _same_bits(narrow[2], wide[2], "ds0")


def test_out_dtype_is_checked():
  x = kernel_cases.state_pass_inputs(0, nc=1)
  with pytest.raises(ValueError, match="out_dtype"):
    sp.state_passing_fwd(**x, out_dtype=jnp.float16, interpret=INTERPRET)
  with pytest.raises(ValueError, match="de_dtype"):
    sp.state_passing_bwd(x["ny"], x["qg"], x["p"], x["kg"], x["gc"], x["u"].astype(BF16), None,
                         x["s0"], de_dtype=jnp.float16, interpret=INTERPRET)
  assert gpu_vjps.state_pass_out_dtype(BF16) == jnp.dtype(BF16)
  for dtype in (jnp.float32, jnp.float16):
    assert gpu_vjps.state_pass_out_dtype(dtype) == jnp.dtype(jnp.float32)


# (mixer, T): one whole chunk, a padded second chunk, one token. GDN with forward="split" takes
# the intra-chunk kernel and this pass (its default, the walks, does not use it). KDA at 64 is
# `-m slow` (suite time): KDA at T = 1 is one chunk and the same program past the padding
# (chunked.pad_time, which off GPU pads the float32 copies, so a bf16 call and a float32 one
# pad alike); the unpadded whole chunk differs from it only in skipping that pad.
CASES = [pytest.param("kda", 64, marks=pytest.mark.slow), ("gdn2", 100), ("kda", 1),
         ("gated_delta_rule", 100)]


@pytest.mark.parametrize("mixer,t", CASES)
def test_bf16_calls_equal_float32_calls_rounded(mixer, t, monkeypatch):
  seen = []   # out_dtype of every forward state pass traced: bf16 calls must reach it
  real = sp.state_passing_fwd
  monkeypatch.setattr(sp, "state_passing_fwd", lambda *a, out_dtype=jnp.float32, **kw: (
      seen.append(jnp.dtype(out_dtype)), real(*a, out_dtype=out_dtype, **kw))[1])
  tuning = pallas_gpu.GpuTuning(forward="split", row_pieces=1)
  args32, kw = make_inputs(mixer, b=1, t=t, h=1, hv=1, dk=64, dv=64, seed=t)
  s0 = kw["initial_state"]
  args16 = tuple(x.astype(BF16) for x in args32[:3]) + args32[3:]
  args_wide = tuple(x.astype(jnp.float32) for x in args16[:3]) + args16[3:]

  def call(*a):
    o, s, r = run(mixer, a[:-1], initial_state=a[-1], output_final_state=True,
                  return_residual=True, implementation="pallas_gpu", tuning=tuning)
    return o, s, r

  (o16, s16, r16) = jax.jit(call)(*args16, s0)
  assert seen == [jnp.dtype(BF16)], seen
  (o32, s32, r32) = jax.jit(call)(*args_wide, s0)
  assert seen[1:] == [jnp.dtype(jnp.float32)], seen
  _same_bits(o16, o32.astype(BF16), "o (forward only)")
  _same_bits(r16, r32.astype(BF16), "write residual (forward only)")
  _same_bits(s16, s32, "final state (forward only)")

  # Weights bf16 can hold, so both calls' output cotangents are the same values.
  w_o = jax.random.normal(jax.random.key(5), o16.shape).astype(BF16).astype(jnp.float32)
  w_s = jax.random.normal(jax.random.key(6), s0.shape)

  def loss(*a):
    o, s, _ = call(*a)
    return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(s * w_s)

  n = len(args16) + 1
  grad = jax.jit(jax.grad(loss, argnums=tuple(range(n))))
  for i, (g16, g32) in enumerate(zip(grad(*args16, s0), grad(*args_wide, s0))):
    assert g16.dtype == args16[i].dtype if i < len(args16) else g16.dtype == s0.dtype
    # The two programs differ in their dtypes, so XLA may fuse the glue around the kernels
    # differently and round a float32 sum's last bit otherwise (seen compiled for GDN's dβ on
    # an H100: 3 of 100 entries, 1e-6 apart). A float32 o or e would be ~1e-3 off.
    assert_close(g16.astype(jnp.float32), g32.astype(g16.dtype).astype(jnp.float32), 1e-5,
                 f"gradient of argument {i}")
