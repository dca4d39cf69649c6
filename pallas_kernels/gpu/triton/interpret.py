"""`triton_call` on the CPU: the kernels of this package run in Triton's interpreter.

jax-triton has no CPU lowering, so without a GPU the Triton kernels could only be checked by
hand-made harnesses. With `TRITON_INTERPRET=1` in the environment before this package is
imported, `triton.jit` makes every kernel an interpreted function, and `state_pass._jax_triton()`
returns this module instead of jax_triton: its `triton_call` has jax_triton's signature and
runs the kernel through `jax.pure_callback`, so the JAX wrappers (and the ops above them) work
unchanged, under `jax.jit` and `jax.grad`, on CPU:

    TRITON_INTERPRET=1 pytest tests/test_triton_gpu.py -k channel     # needs triton, no GPU

What the interpreter does not model: timing, shared memory and registers (ptxas's report,
`experiments.triton_ptxas`, covers those), tf32's shortened operands (its products are exact
float32), and races between programs (they run one after the other). Four fixes to triton
3.6's interpreter are applied on import: it multiplies bf16 `tl.dot` operands as their raw
16-bit patterns (read as numbers here), it truncates float32 to bf16 (rounded to nearest even
here, as on the GPU), it wants torch tensors (numpy arrays stand in: `_HostArray`), and it
turns run-time scalars into indices with int() of a 1-element array, which numpy 2.5 refuses.
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import triton.language as tl
from triton.runtime import interpreter as _interp

_BF16 = np.dtype(ml_dtypes.bfloat16)


def enabled() -> bool:
  """Whether the kernels of this package were made interpreted (TRITON_INTERPRET=1 at import)."""
  from pallas_kernels.gpu.triton import state_pass  # noqa: PLC0415 (no cycle at import time)
  return isinstance(state_pass._fwd_kernel, _interp.InterpretedFunction)  # pylint: disable=protected-access


class _HostArray:
  """A numpy array in the shape of the torch tensor Triton's interpreter expects: it reads and
  writes memory by address, and on the CPU host and device memory are the same."""

  def __init__(self, array):
    self.array = np.ascontiguousarray(array)
    self.dtype = self.array.dtype

  def data_ptr(self):
    return self.array.ctypes.data

  def untyped_storage(self):
    return self

  def cpu(self):
    return self

  def storage_offset(self):
    return 0

  def size(self):
    return self.array.shape

  def stride(self):
    return tuple(s // self.array.itemsize for s in self.array.strides)

  def new_empty(self, *args, **kwargs):
    del args, kwargs
    return _HostArray(self.array[:0])

  def set_(self, storage, offset, size, stride):
    del offset, size, stride
    self.array, self.dtype = storage.array, storage.array.dtype
    return self

  def copy_(self, other):
    if other.data_ptr() != self.data_ptr():
      np.copyto(self.array, other.array)
    return self


def _as_float(handle):
  if handle.dtype.scalar == tl.bfloat16:   # stored as uint16 bit patterns
    return (handle.data.astype(np.uint32) << 16).view(np.float32)
  return handle.data


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
  del self, input_precision, max_num_imprecise_acc
  out = np.matmul(_as_float(a), _as_float(b), dtype=d.data.dtype) + d.data
  return _interp.TensorHandle(out, d.dtype.scalar)


_interp.InterpreterBuilder.create_dot = _create_dot
_patch_lang_tensor = _interp._patch_lang_tensor  # pylint: disable=protected-access


def _patch_lang_tensor_numpy2(tensor, scope):
  # Run-time scalars (a loop bound such as the chunk count) are 1-element arrays there, and
  # numpy >= 2.5 refuses int() of an array that is not 0-d: index with the element.
  _patch_lang_tensor(tensor, scope)
  scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_interp._patch_lang_tensor = _patch_lang_tensor_numpy2  # pylint: disable=protected-access
_convert_float = _interp._convert_float  # pylint: disable=protected-access


def _convert_float_rtne(values, input_dtype, output_dtype, rounding_mode):
  # float32 -> bf16 rounds to nearest even, as `.to(tl.bfloat16)` does on the GPU (the
  # interpreter truncates, which biases a state rounded once per chunk).
  if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
    return np.asarray(values, np.float32).astype(_BF16).view(np.uint16)
  return _convert_float(values, input_dtype, output_dtype, rounding_mode)


_interp._convert_float = _convert_float_rtne  # pylint: disable=protected-access


def _run(kernel, grid, constexprs, out_shape, *args):
  """Runs `kernel` in the interpreter on host copies of `args`; returns the outputs."""
  ins = [a if isinstance(a, (int, float)) else _HostArray(np.asarray(a)) for a in args]
  outs = [_HostArray(np.full(s.shape, np.nan, _BF16 if s.dtype == jax.numpy.bfloat16 else s.dtype))
          for s in out_shape]
  kernel[grid](*ins, *outs, **constexprs)
  return tuple(o.array for o in outs)


def triton_call(*args, kernel, out_shape, grid, num_warps=4, num_stages=1, **constexprs):
  """jax_triton.triton_call's signature, run by Triton's interpreter through a host callback.

  Scalars (the kernels' `t`, `nc`, `scale`) pass through as Python numbers; arrays as host
  copies; outputs start as NaN, so an element no program writes shows."""
  del num_warps, num_stages   # launch options: the interpreter runs one program at a time
  arrays = [a for a in args if not isinstance(a, (int, float))]
  slots = [None if isinstance(a, (int, float)) else i for i, a in enumerate(args)]

  def host(*values):
    it = iter(values)
    full = [args[i] if s is None else next(it) for i, s in enumerate(slots)]
    return _run(kernel, grid, constexprs, out_shape, *full)

  return list(jax.pure_callback(host, tuple(out_shape), *arrays))
