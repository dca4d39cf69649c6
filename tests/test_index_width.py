"""Index arithmetic past 2^31 elements, checked at lowering on the CPU (abstract inputs: no memory,
no device). FLA shipped silent corruption once B·T·H·K passed 2^31 (int32 element offsets in its
Triton kernels, FLA issue #1080); docs/KERNELS_GPU.md ("Indexing past 2^31 elements") has the
audit this file checks. The compiled check on an H200 is tests/test_large_index.py.

Shapes: BIG = B1 T(2^20 + 8192) H16 K=V=128, 2^31 + 2^24 elements per q/k/v (a whole 8192-token
slice lies past element 2^31); STRESS = B2 T4M H32 (2^35 elements, 65536 chunks of 64, and B > 1,
which makes Mosaic GPU collapse the batch and head dims of a TMA view into one).

* Mosaic GPU kernels (the module each `plgpu.kernel` lowers to, captured before serialisation):
  every global access is a TMA copy (no load or store of a global memref), each TMA view
  (the array as the descriptor sees it, after tiling and collapsing) has every dimension below
  2^31 (its coordinates are signed 32-bit, one per dimension) and byte strides below 2^40 (the
  descriptor's limit), every dynamic address offset on a global pointer is i64, and the launch
  grid fits CUDA (x < 2^31, y and z <= 65535). Before the 1-D grid of the intra-chunk kernels
  STRESS failed the last check (the chunk axis was grid z: 65536 > 65535).
* Pallas TPU kernels: the BlockSpec index maps (the `transform_*` functions of the Mosaic module)
  only add, subtract or divide block indices (never multiply them out into element offsets), and
  block index × block size stays below 2^31 along every dimension.
* The chunk form (XLA): every gather, scatter and dynamic slice with 32-bit indices indexes an
  array whose every dimension is below 2^31, forward and backward, with segment ids and varlen.
* The guards: `pallas_gpu` falls back to `chunk` (with its log line) and the kernels raise a
  ValueError above B·T·HV = 2^31 − 1 rows; the op rejects T or a varlen re-layout past 2^31
  tokens; the intra-chunk kernel's segment ids stay exact past 2^24 segments.
"""

from __future__ import annotations

import logging
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lineax_attn import ops

I32_MAX = 2**31 - 1
SDS = jax.ShapeDtypeStruct
BF, F32 = jnp.bfloat16, jnp.float32
BIG = dict(b=1, t=2**20 + 8192, h=16, d=128)
STRESS = dict(b=2, t=2**22, h=32, d=128)
_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i8": 1}


def _dims(text):
  """'2x16x128xbf16' -> ((2, 16, 128), 'bf16')."""
  *dims, dtype = text.split("x")
  return tuple(int(d) for d in dims), dtype


# ------------------------------------------------------------------ Mosaic GPU kernels


def _gpu_kernel_cases(b, t, h, d):
  from pallas_kernels.gpu import chunk_grads as cg  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gpu import chunk_walk as cw  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gpu import chunk_walk_reverse as cwr  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gpu import intra_chunk as ic  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gpu import maps_walk as mw  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gpu import state_passing as sp  # pylint: disable=g-import-not-at-top
  c = 64
  nc = t // c
  rows = [SDS((b, h, t), F32)] * 3
  inputs = [SDS((b, t, h, d), BF)] * 3 + rows
  segments = [SDS((b, t), F32)] * 3
  cc, ck = SDS((b, h, nc, c, c), BF), SDS((b, h, nc, c, d), BF)
  state = [ck, ck, cc, SDS((b, h, nc, c, d), F32), ck, SDS((b, h, nc, d), F32),
           SDS((b, h, d, d), F32)]
  state_bwd = state[:3] + state[4:6] + [SDS((b, h, nc, c, d), BF), SDS((b, h, nc, c, d), F32),
                                        SDS((b, h, d, d), F32)]
  return {
      "state fwd": (lambda *a: sp._state_passing_fwd(*a, save_states=True, interpret=None),
                    state),
      "state bwd": (lambda *a: sp._state_passing_bwd(*a, interpret=None), state_bwd),
      "intra fwd packed, with M": (lambda *a: ic._intra_chunk_fwd(
          *a[:6], a[6:], scale=0.1, with_inverse=True, interpret=None), inputs + segments),
      "chunk walk, saving states": (lambda *a: cw._chunk_walk(
          *a, scale=0.1, gated=True, save_states=True, interpret=None),
          inputs[:3] + [cc] + rows[:2] + [SDS((b, h, d, d), F32)]),
      "maps' walk, two chains": (lambda *a: mw._maps_walk(
          *a, gated=True, chains=2, interpret=None),
          inputs[1:3] + [cc] + rows[:2] + [SDS((b, h, 2 * d, d), F32)]),
      "reverse chunk walk": (lambda *a: cwr._chunk_walk_reverse(
          *a, scale=0.1, gated=True, states_only=False, interpret=None),
          inputs[:2] + [cc] + rows[:2] + inputs[2:3] * 2 + [SDS((b, h, d, d), F32)]),
      "chunk grads": (lambda *a: cg._chunk_grads(*a, scale=0.1, gated=True, interpret=None),
                      inputs[:3] + inputs[2:3] * 2 + [cc] + rows[:2]
                      + [SDS((b, h, nc, d, d), BF)] * 2 + [SDS((b, h, nc, d, c), BF)]),
      "intra bwd packed": (lambda *a: ic._intra_chunk_bwd(
          *a[:6], a[10:], *a[6:10], scale=0.1, interpret=None),
          inputs + [cc, ck, cc, ck] + segments),
  }


def _lower_mosaic_gpu(fn, args, monkeypatch):
  """The Mosaic GPU module(s) `fn` lowers to for CUDA, as text (before serialisation)."""
  from jax.experimental.mosaic.gpu import core as mgpu_core  # pylint: disable=g-import-not-at-top
  modules = []
  serde = mgpu_core._run_serde_pass

  def capture(module, **kw):
    modules.append(str(module))
    return serde(module, **kw)

  monkeypatch.setattr(mgpu_core, "_run_serde_pass", capture)
  jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  monkeypatch.setattr(mgpu_core, "_run_serde_pass", serde)
  assert modules, "nothing was lowered (a cached lowering?)"
  return modules


def _index_constants(text):
  return {m[1]: int(m[2]) for m in re.finditer(r"(%c\w*) = arith\.constant (\d+) : index", text)}


def _check_mosaic_gpu_module(text, name):
  """The module's index widths (see the module docstring); returns the TMA views' dims."""
  # The launch grid.
  launches = re.findall(r"gpu\.launch async \[[^\]]*\] blocks\([^)]*\) in "
                        r"\(%\w+ = (%\w+), %\w+ = (%\w+), %\w+ = (%\w+)\)", text)
  assert len(launches) == 1, name
  consts = _index_constants(text)
  gx, gy, gz = (consts[v] for v in launches[0])
  assert gx <= I32_MAX and gy <= 65535 and gz <= 65535, (name, "grid", gx, gy, gz)
  # TMA views: the memref each descriptor is built from (host side) or sliced (bulk copies).
  views = re.findall(r"memref\.extract_strided_metadata %\S+ : memref<([0-9]+(?:x[0-9]+)*x\w+)"
                     r"(?:, strided<\[([0-9, ]+)\](?:, offset: \d+)?>)?>", text)
  assert views, name
  shapes = []
  for dims_text, strides_text in views:
    dims, dtype = _dims(dims_text)
    assert max(dims) <= I32_MAX, (name, "TMA view dimension past int32", dims)
    if strides_text:
      strides = [int(s) for s in strides_text.split(",")]
      assert max(strides) * _ITEMSIZE[dtype] < 2**40, (name, "TMA stride", strides)
    shapes.append(dims)
  # Dynamic address offsets on global (not shared, <3>) pointers are 64-bit.
  widths = re.findall(r"llvm\.getelementptr[^:]*: \(!llvm\.ptr(?:<1>)?, (i\d+)\)", text)
  assert widths and set(widths) == {"i64"}, (name, "global address offsets", set(widths))
  # No direct load or store of a global array: only shared memory and scalar allocas.
  # (The rest of the line holds the whole type: a lazy match would stop inside a nested
  # `strided<[], ...>` before the address space, as a scalar read of shared memory has.)
  for ty in re.findall(r"(?:memref|vector)\.(?:load|store) [^:\n]*: (memref<[^\n]*)$",
                       text, flags=re.M):
    scalar_alloca = re.match(r"memref<(?:[if]\d+|bf16|index)>(?:,|$)", ty)
    assert "workgroup" in ty or scalar_alloca, (name, "global access", ty)
  return shapes


@pytest.mark.parametrize("shape", [BIG, STRESS], ids=["B1_T1M+8K_H16", "B2_T4M_H32"])
def test_gpu_kernels_index_in_32_bits_past_2_31_elements(shape, monkeypatch):
  pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
  cases = _gpu_kernel_cases(**shape)
  if shape is STRESS:   # the intra-chunk grid past 65535 chunks, and B > 1 (collapsed views)
    cases = {"intra fwd packed, with M": cases["intra fwd packed, with M"]}
  elements = math.prod(shape.values())
  assert elements > 2**31
  for name, (fn, args) in cases.items():
    views = []
    for module in _lower_mosaic_gpu(fn, args, monkeypatch):
      views += _check_mosaic_gpu_module(module, name)
    # The views do cover arrays past 2^31 elements (what the per-dimension coordinates protect).
    assert max(math.prod(v) for v in views) >= elements, (name, views)


# ------------------------------------------------------------------ Pallas TPU kernels


# Each mixer's gates: "s" scalar [B, T, H], "k" / "v" per key / value channel.
_GATE_AXES = {
    "linear_attention": (), "delta_rule": ("s",), "gated_delta_rule": ("s", "s"),
    "kda": ("k", "s"), "gdn2": ("k", "k", "v"),
}
_INDEX_MAP_OPS = {"arith.constant", "arith.addi", "arith.subi", "arith.divsi",
                  "arith.index_cast", "memref.load", "return"}


# One mixer per kernel variant: no gate and no erase, scalar gate with erase, channel gates.
@pytest.mark.parametrize("mixer", ["linear_attention", "gated_delta_rule", "gdn2"])
def test_tpu_index_maps_are_per_dimension_block_indices(mixer, monkeypatch):
  from jax import export  # pylint: disable=g-import-not-at-top
  from jax._src import tpu_custom_call  # pylint: disable=g-import-not-at-top
  from lineax_attn.ops import segments as seg_lib  # pylint: disable=g-import-not-at-top
  from pallas_kernels import tpu  # pylint: disable=g-import-not-at-top
  b, t, h, d = BIG.values()
  gate = {"s": (b, t, h), "k": (b, t, h, d), "v": (b, t, h, d)}
  args = [SDS((b, t, h, d), BF)] * 3 + [SDS(gate[g], F32) for g in _GATE_AXES[mixer]]
  modules = []
  to_asm = tpu_custom_call._lower_mosaic_module_to_asm

  def capture(module, **kw):
    modules.append(str(module))
    return to_asm(module, **kw)

  monkeypatch.setattr(tpu_custom_call, "_lower_mosaic_module_to_asm", capture)

  def loss(args, ids):
    layout = seg_lib.layout_from_segment_ids(ids)
    o, _, r = tpu.MIXERS[mixer](*args, segidx=layout.segidx, valid=layout.valid,
                                interpret=False)
    return jnp.sum(o.astype(F32)) + jnp.sum(r.astype(F32))

  export.export(jax.jit(jax.value_and_grad(loss)), platforms=["tpu"])(args, SDS((b, t),
                                                                               jnp.int32))
  assert len(modules) >= 2, "forward and backward kernels"
  for text in modules:
    kernel = re.search(r"iteration_bounds = array<i64: ([0-9, ]+)>.*?window_params = \[(.*?)\]\}",
                       text)
    grid = [int(x) for x in kernel[1].split(",")]
    windows = [[int(x) for x in w.split(",")]
               for w in re.findall(r"window_bounds = array<i64: ([0-9, ]+)>", kernel[2])]
    maps = re.findall(r"func\.func @transform_\d+\([^)]*\) -> \([^)]*\) \{(.*?)\n  \}", text,
                      flags=re.S)
    assert len(maps) == len(windows) > 0
    for body in maps:
      used = set(re.findall(r"(?:= |^\s*)([a-z_]+\.[a-z_]+|return)\b", body, flags=re.M))
      assert used <= _INDEX_MAP_OPS, ("an index map computes more than a block index",
                                      used - _INDEX_MAP_OPS)
    # A returned block index is a grid index, n − 1 − one, one divided, or b + a sequence
    # index (< 2 max(grid)); times the largest block dimension it stays an int32.
    assert 2 * max(grid) * max(max(w) for w in windows) <= I32_MAX, (grid, windows)


# ------------------------------------------------------------------ chunk form (XLA)


def _gathers_index_within_int32(text):
  """Checks each gather/scatter/dynamic slice with 32-bit indices; returns the largest indexed
  array's element count."""
  largest = 0
  for m in re.finditer(r'"stablehlo\.(?:gather|scatter)"\([^)]*\).*?: \(tensor<([^>]*)>, '
                       r'tensor<([^>]*)>', text):
    dims, _ = _dims(m[1])
    _, index_type = _dims(m[2])
    if index_type.endswith("32"):
      assert max(dims) <= I32_MAX, ("32-bit gather/scatter index", m[1], m[2])
    largest = max(largest, math.prod(dims))
  for m in re.finditer(r"stablehlo\.dynamic_(?:update_)?slice [^\n]*: \(tensor<([^>]*)>"
                       r"[^\n]*?tensor<(i\d+|ui\d+)>", text):
    dims, _ = _dims(m[1])
    if m[2].endswith("32"):
      assert max(dims) <= I32_MAX, ("32-bit dynamic slice index", m[1])
    largest = max(largest, math.prod(dims))
  return largest


@pytest.mark.parametrize("mixer,mode", [("gated_delta_rule", "segment_ids"),
                                        ("gdn2", "segment_ids"), ("kda", "cu_seqlens")])
def test_chunk_form_indexes_per_dimension_past_2_31_elements(mixer, mode):
  b, t, h, d = BIG.values()
  gate = {"s": (b, t, h), "k": (b, t, h, d), "v": (b, t, h, d)}
  args = [SDS((b, t, h, d), BF)] * 3 + [SDS(gate[g], F32) for g in _GATE_AXES[mixer]]
  extra = SDS((b, t), jnp.int32) if mode == "segment_ids" else SDS((129,), jnp.int32)

  def loss(*a):
    o, _ = getattr(ops, mixer)(*a[:-1], **{mode: a[-1]}, implementation="chunk")
    return jnp.sum(o.astype(F32))

  argnums = tuple(range(len(args)))
  text = jax.jit(jax.grad(loss, argnums=argnums)).lower(*args, extra).as_text()
  largest = _gathers_index_within_int32(text)
  assert largest > 2**31, largest   # the arrays indexed do pass 2^31 elements


# ------------------------------------------------------------------ guards


def test_pallas_gpu_falls_back_past_2_31_rows_and_kernels_raise(caplog):
  from lineax_attn.ops import pallas_gpu  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gpu import state_passing as sp  # pylint: disable=g-import-not-at-top
  # B·T·HV rows of [B, T, HV, D]: the largest TMA view dimension.
  assert sp.index_range_reason(1, 2**27, 15, 128) is None
  reason = pallas_gpu.unsupported_reason(dk=128, dv=128, chunk_size=64, varlen=False, b=1,
                                         t=2**27, hv=16)
  assert reason and "B·T·HV = 2147483648 rows" in reason
  assert "grid" in sp.index_range_reason(1, 64, 70000, 128)
  with pytest.raises(ValueError, match="B·T·HV"):
    sp.check_index_range(2, 2**30, 1, 64)
  # Through the op (abstract inputs: nothing is allocated): the chunk form takes over, logged.
  b, t, h, d = 1, 2**27, 16, 128
  q = SDS((b, t, h, d), BF)
  with caplog.at_level(logging.WARNING, logger=pallas_gpu.__name__):
    pallas_gpu._warned.clear()
    out = jax.eval_shape(lambda q, k, v: ops.linear_attention(
        q, k, v, scale=0.1, chunk_size=64, implementation="pallas_gpu")[0], q, q, q)
  assert out.shape == (b, t, h, d)
  assert "falls back to implementation='chunk'" in caplog.text and "2147483648" in caplog.text


def test_op_rejects_token_positions_past_int32():
  q = SDS((1, 2**31, 1, 16), BF)
  with pytest.raises(ValueError, match="T = 2147483648"):
    jax.eval_shape(lambda q: ops.linear_attention(q, q, q, implementation="chunk"), q)
  # Varlen re-lays each sequence on its own chunks: (ceil(T/C) + N)·C positions.
  t, n = 2**31 - 2**20, 2**14
  q = SDS((1, t, 1, 16), BF)
  cu = SDS((n + 1,), jnp.int32)
  with pytest.raises(ValueError, match="cu_seqlens"):
    jax.eval_shape(lambda q, cu: ops.linear_attention(q, q, q, cu_seqlens=cu,
                                                      implementation="chunk"), q, cu)


def test_intra_kernel_segment_ids_stay_exact_past_2_24_segments():
  # float32 holds integers exactly only up to 2^24: ids 2^24 and 2^24 + 1 would compare equal.
  # The kernel gets ids relative to each chunk's first row; within a chunk, "same segment" must
  # be exactly what the integer ids say (every token its own segment here, the worst case).
  from lineax_attn.ops import gpu_chunks  # pylint: disable=g-import-not-at-top
  segidx = (2**24 + jnp.arange(256, dtype=jnp.int32))[None]
  seg, cont, keep = gpu_chunks.kernel_segments(segidx, 64)
  got = np.asarray(seg).reshape(4, 64)
  want = np.asarray(segidx).reshape(4, 64)
  assert np.array_equal(got[:, :, None] == got[:, None, :], want[:, :, None] == want[:, None, :])
  assert float(jnp.max(seg)) == 63.0
  assert np.array_equal(np.asarray(cont).reshape(4, 64)[:, 1:], np.zeros((4, 63)))
  assert np.array_equal(np.asarray(keep).reshape(4, 64)[:, -1], np.ones(4))
