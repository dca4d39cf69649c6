"""jax-triton calls through XLA's typed-FFI Triton target, so that XLA's command buffers take them.

Why. jax-triton 0.3.1 (the release that runs with triton 3.6, the GPU machine's) lowers every
`triton_call` to the legacy custom call "triton_kernel_call" (api_version 2). XLA never puts a
legacy custom call into a command buffer (CUDA graph): `CommandBufferConversionPass` only
converts typed-FFI handlers whose execute stage has the command-buffer trait. So each of our
Triton kernels cuts the op's graph in pieces, and between the pieces every thunk is launched
from the host one by one (the sixth stage of docs/BENCHMARKS.md saw ~0.67 ms of idle GPU in a
2.9 ms GDN forward+backward). jaxlib >= 0.11 registers the same kernel runner as the typed-FFI
handler "triton_kernel_call_ffi" (attribute `opaque`: the same compressed kernel-call proto),
with that trait; jax-triton 0.4 emits it, but needs triton >= 3.7.

What this module does. `install()` registers, once, a CUDA lowering of jax-triton's primitive
that wraps jax-triton's own: for a call whose `custom_call_target_name` is `FFI_TARGET`, it lets
jax-triton build the kernel-call proto as usual and only changes the last step, the custom call
op: the FFI target, api_version 4, the proto as the `opaque` attribute. Calls with any other
target are lowered exactly as before. `triton_call_kwargs()` is what the kernel wrappers add to
their `triton_call`: the FFI target where `blocks.CALL_TARGET == "ffi"` and the running jaxlib
has the handler, else nothing.

The redirection swaps `jax.ffi.ffi_lowering` for the duration of one lowering call (under a
lock), since jax-triton 0.3.1 calls it with api_version 2 hard-coded; the swapped function
passes every other target through untouched.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax

FFI_TARGET = "triton_kernel_call_ffi"

_lock = threading.Lock()
_installed = False


@functools.cache
def ffi_target_available() -> bool:
  """Whether this process's jaxlib registers the typed-FFI Triton handler for CUDA."""
  try:
    from jax._src.lib import gpu_triton  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  plugin = getattr(gpu_triton, "_cuda_triton", None)
  if plugin is None:
    return False
  return FFI_TARGET in dict(plugin.registrations())


def redirecting_ffi_lowering(real):
  """A stand-in for `jax.ffi.ffi_lowering`: a rule for `FFI_TARGET` (whatever api_version and
  backend_config the caller asks) becomes the typed-FFI call with the backend config as the
  `opaque` attribute; any other target is `real`'s."""

  def ffi_lowering(call_target_name, *, api_version=None, backend_config=None, **kwargs):
    if call_target_name != FFI_TARGET:
      if api_version is not None:
        kwargs["api_version"] = api_version
      return real(call_target_name, backend_config=backend_config, **kwargs)
    if not isinstance(backend_config, bytes):
      raise TypeError(f"{FFI_TARGET}: expected the compressed kernel-call proto as bytes, got "
                      f"{type(backend_config).__name__}")
    rule = real(FFI_TARGET, api_version=4, **kwargs)
    return lambda ctx, *args: rule(ctx, *args, opaque=backend_config)

  return ffi_lowering


@contextlib.contextmanager
def _ffi_lowering_redirected():
  with _lock:
    real = jax.ffi.ffi_lowering
    jax.ffi.ffi_lowering = redirecting_ffi_lowering(real)
    try:
      yield
    finally:
      jax.ffi.ffi_lowering = real


def install() -> None:
  """Registers the wrapping CUDA lowering of jax-triton's primitive (once per process)."""
  global _installed
  if _installed:
    return
  from jax._src.interpreters import mlir  # pylint: disable=g-import-not-at-top
  from jax_triton import triton_lib  # pylint: disable=g-import-not-at-top
  legacy = functools.partial(triton_lib.triton_kernel_call_lowering, triton_lib.get_cuda_backend)

  def lowering(ctx, *args, custom_call_target_name, **params):
    if custom_call_target_name != FFI_TARGET:
      return legacy(ctx, *args, custom_call_target_name=custom_call_target_name, **params)
    with _ffi_lowering_redirected():
      return legacy(ctx, *args, custom_call_target_name=FFI_TARGET, **params)

  mlir.register_lowering(triton_lib.triton_kernel_call_p, lowering, platform="cuda")
  _installed = True


def triton_call_kwargs(call_target: str) -> dict:
  """The extra `triton_call` arguments for `call_target` ("ffi" or "legacy", `blocks.CALL_TARGET`):
  the FFI target where this jaxlib has it (else {}: the legacy call, which always works)."""
  if call_target not in ("ffi", "legacy"):
    raise ValueError(f"call_target must be 'ffi' or 'legacy', got {call_target!r}")
  if call_target == "legacy" or not ffi_target_available():
    return {}
  install()
  return {"custom_call_target_name": FFI_TARGET}
