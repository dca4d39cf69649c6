"""`lineax_attn.parallel.row_split` (parallel/pieces.py): each row cut into pieces passed at once equals the op on the
whole row (oracle: the `scan` reference), forward, final state, residual and every gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import MIXERS, assert_close, make_inputs, run
from lineax_attn.parallel import row_split

TOL = 1e-4   # float32 chunk form against the float32 scan


def _split(mixer, args, pieces, **kw):
  return jax.jit(lambda *a: row_split(mixer, *a[:-1], pieces=pieces,
                                                initial_state=a[-1], chunk_size=16,
                                                implementation="chunk", **kw))


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_pieces_match_the_whole_row(mixer):
  # T = 75 in 4 pieces (padded to 76), GVA, an initial state: outputs, final state, residual.
  args, kw = make_inputs(mixer, b=2, t=75, h=1, hv=2, seed=1)
  s0 = kw["initial_state"]
  want = run(mixer, args, initial_state=s0, output_final_state=True, return_residual=True,
             implementation="scan")
  got = _split(mixer, args, 4, output_final_state=True, return_residual=True)(*args, s0)
  for name, g, w in zip(("o", "final state", "residual"), got, want):
    assert_close(g, w, TOL, f"{mixer} {name}")


@pytest.mark.parametrize("mixer", ["gated_delta_rule", "kda", "linear_attention"])
def test_segments_across_and_at_piece_boundaries(mixer):
  # T = 64 in 4 pieces of 16: one segment crosses two boundaries, one starts exactly at the
  # boundary 32, a padding run (id 0) fills the second row's end.
  args, kw = make_inputs(mixer, b=2, t=64, h=2, seed=2)
  ids = np.stack([np.repeat([1, 2, 3], [10, 22, 32]), np.repeat([4, 5, 0], [40, 14, 10])])
  seg = jnp.asarray(ids)
  want = run(mixer, args, initial_state=kw["initial_state"], output_final_state=True,
             segment_ids=seg, implementation="scan")
  got = _split(mixer, args, 4, output_final_state=True, segment_ids=seg)(
      *args, kw["initial_state"])
  for name, g, w in zip(("o", "final state"), got, want):
    assert_close(g, w, TOL, f"{mixer} {name} with segments")


@pytest.mark.parametrize("mixer", ["gated_delta_rule", "kda", "gdn2"])
def test_gradients_match_the_whole_row(mixer):
  args, kw = make_inputs(mixer, b=1, t=40, h=1, hv=2, seed=3)
  s0 = kw["initial_state"]
  w_o = jax.random.normal(jax.random.key(0), args[2].shape)
  w_s = jax.random.normal(jax.random.key(1), s0.shape)

  def loss(fn):
    def f(*a):
      o, s = fn(*a)
      return jnp.sum(o * w_o) + jnp.sum(s * w_s)
    return jax.jit(jax.grad(f, argnums=tuple(range(len(args) + 1))))(*args, s0)

  want = loss(lambda *a: run(mixer, a[:-1], initial_state=a[-1], output_final_state=True,
                             implementation="scan"))
  got = loss(lambda *a: row_split(mixer, *a[:-1], pieces=3, initial_state=a[-1],
                                            output_final_state=True, chunk_size=16,
                                            implementation="chunk"))
  for i, (g, w) in enumerate(zip(got, want)):
    assert_close(g, w, TOL, f"{mixer} grad {i}")


@pytest.mark.parametrize("t,pieces", [(1, 1), (1, 3), (5, 8), (16, 2)])
def test_edges_of_t_and_pieces(t, pieces):
  # T = 1, more pieces than tokens (pieces of padding only), pieces = 1 (the plain op).
  args, kw = make_inputs("gated_delta_rule", b=2, t=t, h=2, seed=4)
  want = run("gated_delta_rule", args, **kw, output_final_state=True, implementation="scan")
  got = _split("gated_delta_rule", args, pieces, output_final_state=True)(
      *args, kw["initial_state"])
  for name, g, w in zip(("o", "final state"), got, want):
    assert_close(g, w, TOL, f"T={t} pieces={pieces} {name}")


def test_bad_arguments_are_refused():
  args, _ = make_inputs("gated_delta_rule", b=1, t=8, h=1, seed=5, with_state=False)
  for bad in (0, -2, 1.5, True):
    with pytest.raises(ValueError, match="`pieces` must be an int"):
      row_split("gated_delta_rule", *args, pieces=bad)
  with pytest.raises(ValueError, match="cu_seqlens"):
    row_split("gated_delta_rule", *args, pieces=2,
                        cu_seqlens=jnp.asarray([0, 8], jnp.int32))
  with pytest.raises(ValueError, match="unknown `mixer`"):
    row_split("mamba", *args, pieces=2)
  with pytest.raises(ValueError, match="gate array"):
    row_split("gated_delta_rule", *args[:3], pieces=2)
