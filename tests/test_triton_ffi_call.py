"""`pallas_kernels.gpu.triton.ffi_call` on the CPU: the fallback where jaxlib has no typed-FFI
Triton handler, and the lowering redirection itself, checked on the custom-call op it emits
(lowered, never compiled). The compiled check (the ops under the FFI target against the scan)
is tests/test_triton_gpu.py's."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import pytest
from jax._src.interpreters import mlir

from pallas_kernels.gpu.triton import blocks, ffi_call


def test_call_targets_and_their_fallback_off_gpu():
  assert blocks.CALL_TARGET in blocks.CALL_TARGETS == ("legacy", "ffi")
  assert ffi_call.triton_call_kwargs("legacy") == {}
  if not ffi_call.ffi_target_available():   # a CPU jaxlib: "ffi" falls back to the legacy call
    assert ffi_call.triton_call_kwargs("ffi") == {}
  with pytest.raises(ValueError, match="call_target"):
    ffi_call.triton_call_kwargs("cuda_graph")


def _lowered_text(target, backend_config):
  """A toy primitive lowered (on CPU) by the redirecting stand-in of `jax.ffi.ffi_lowering`,
  called as jax-triton 0.3.1 calls it (api_version 2, the proto as backend_config)."""
  prim = jax.extend.core.Primitive(f"toy_{target}")
  prim.def_abstract_eval(lambda x: x)
  lowering = ffi_call.redirecting_ffi_lowering(jax.ffi.ffi_lowering)
  mlir.register_lowering(prim, lambda ctx, x: lowering(
      target, api_version=2, backend_config=backend_config, operand_output_aliases={})(ctx, x))
  return jax.jit(prim.bind).lower(jnp.ones((4,), jnp.float32)).as_text()


def test_the_redirection_emits_the_typed_ffi_call_with_the_proto_as_opaque():
  text = _lowered_text(ffi_call.FFI_TARGET, b"kernel-call-proto")
  line = next(x for x in text.splitlines() if "custom_call" in x)
  assert f"@{ffi_call.FFI_TARGET}" in line
  # Typed FFI (api_version 4) prints its attributes as the mhlo.backend_config dictionary.
  assert 'mhlo.backend_config = {opaque = "kernel-call-proto"}' in line
  assert "api_version = 2" not in line
  # Any other target is lowered as asked: the legacy api_version and backend_config.
  text = _lowered_text("triton_kernel_call", b"kernel-call-proto")
  line = next(x for x in text.splitlines() if "custom_call" in x)
  assert "@triton_kernel_call" in line and ffi_call.FFI_TARGET not in line
  assert "api_version = 2" in line and 'backend_config = "kernel-call-proto"' in line
  with pytest.raises(TypeError, match="bytes"):
    _lowered_text(ffi_call.FFI_TARGET, "not bytes")
