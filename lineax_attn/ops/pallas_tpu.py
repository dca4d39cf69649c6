"""The `pallas_tpu` implementation: the op contract of `api.run_mixer` on the Pallas TPU kernels.

The kernels (`pallas_kernels.tpu`) take plain arrays; this module only passes the validated
gates, the segment layout (valid / segidx / cu_seqlens) and the chunk size through. On a TPU
backend the kernels are compiled with Mosaic; on any other backend they run in the TPU
interpreter, so `implementation="pallas_tpu"` can be checked on a CPU.

Under a mesh (`jax.set_mesh`) the kernels run inside `jax.shard_map`, with the batch split over
the mesh axes named in `batch_axes` and the heads over `head_axes` (defaults below; override with
`kernel_sharding`). Axes whose size does not divide the dimension are left out (replicated).
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Sequence

import jax
import jax.numpy as jnp

from lineax_attn.ops import specs
from pallas_kernels import tpu

DEFAULT_BATCH_AXES = ("data", "fsdp", "batch")
DEFAULT_HEAD_AXES = ("model", "tensor", "heads")

_local = threading.local()


@contextlib.contextmanager
def kernel_sharding(batch_axes: Sequence[str] = DEFAULT_BATCH_AXES,
                    head_axes: Sequence[str] = DEFAULT_HEAD_AXES):
  """Names the mesh axes that split the batch and the heads inside this context."""
  previous = getattr(_local, "axes", None)
  _local.axes = (tuple(batch_axes), tuple(head_axes))
  try:
    yield
  finally:
    _local.axes = previous


def _pick_axes(mesh, names, dim):
  """The named mesh axes, in order, while their product still divides `dim`. Manual axes (we are
  already inside a shard_map over them) are skipped."""
  kinds = dict(zip(mesh.axis_names, mesh.axis_types))
  chosen = []
  for name in names:
    if name in kinds and kinds[name] != jax.sharding.AxisType.Manual:
      size = mesh.shape[name]
      if dim % (math.prod(mesh.shape[a] for a in chosen) * size) == 0:
        chosen.append(name)
  return tuple(chosen)


def kernel(mixer):
  """The `pallas_kernels.tpu` entry point of `mixer`, with the kernels' signature
  `fn(q, k, v, *gates, scale=None, initial_state=None, ..., block_sizes=None, interpret=None)`.

  The mapping is the spec's (`specs.MixerSpec.tpu_kernel`; the kernels know nothing of the
  specs): a named entry of `tpu.MIXERS`, or else the generic `tpu.delta_template` on the
  spec's template map (k̃ = erase ⊙ k at the value heads, ṽ = write ⊙ v, decay g).
  """
  spec = specs.resolve(mixer)
  if spec.tpu_kernel is not None:
    return tpu.MIXERS[spec.tpu_kernel]

  def template_kernel(q, k, v, *gate_args, scale=None, **kwargs):
    g, erase, write = specs.template_gates(spec, dict(zip(spec.gate_names, gate_args)))
    n_rep = v.shape[2] // k.shape[2]  # GVA: value head j reads key head j // n_rep
    kt = None if erase is None else jnp.repeat(k.astype(jnp.float32), n_rep, axis=2) * erase
    vt = v if write is None else v.astype(jnp.float32) * write
    return tpu.delta_template(q, k, kt, vt, g, scale=q.shape[-1] ** -0.5 if scale is None
                              else float(scale), out_dtype=v.dtype, **kwargs)

  template_kernel.__name__ = spec.name
  return template_kernel


def pallas_tpu_impl(mixer, q, k, v, gates, *, scale, initial_state, layout, chunk_size,
                    output_final_state=False, tuning=None):
  """`implementation="pallas_tpu"` (see `api.run_mixer` for the contract)."""
  del tuning  # no tuning yet (api passes None); the block sizes follow chunk_size
  spec = specs.resolve(mixer)
  fn = kernel(spec)
  gate_args = tuple(gates[name] for name in spec.gate_names)
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    batch_names, head_names = getattr(_local, "axes", None) or (DEFAULT_BATCH_AXES,
                                                                DEFAULT_HEAD_AXES)
    batch_axes = () if layout.is_varlen else _pick_axes(mesh, batch_names, q.shape[0])
    head_axes = _pick_axes(mesh, head_names, q.shape[2])
    if batch_axes or head_axes:
      fn = tpu.shard_mixer(fn, batch_axes=batch_axes, head_axes=head_axes)
  o, final_state, r = fn(
      q, k, v, *gate_args, scale=scale, initial_state=initial_state,
      output_final_state=output_final_state, segidx=layout.segidx, valid=layout.valid,
      cu_seqlens=layout.cu_seqlens, block_sizes=tpu.BlockSizes(chunk_size=chunk_size))
  return o, final_state, r
