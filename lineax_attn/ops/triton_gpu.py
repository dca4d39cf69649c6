"""The `triton` implementation: Triton kernels through jax-triton, for NVIDIA GPUs from sm_80.

The portable GPU path: the default on NVIDIA GPUs that are not Hopper (A100, L40, RTX: sm_80,
sm_86, sm_89), where the Mosaic GPU kernels of `pallas_gpu` (wgmma, TMA: sm_90) cannot run;
selectable on Hopper too. It is the chunk form split as `pallas_gpu` splits it (docs/MATH.md
§3.2, docs/KERNELS_GPU.md):

* **intra-chunk part**: Triton kernels by default wherever they exist (`intra_choice`): for
  DeltaNet and GDN `pallas_kernels.gpu.triton.intra_chunk` (forward and backward, one program
  per chunk: the C×C products, the blocked inverse of I + L with tf32 products, the
  pseudo-values), as `pallas_gpu` has Mosaic GPU ones; for KDA and GDN-2
  `pallas_kernels.gpu.triton.channel_intra` (anchored sub-chunk pairs, exact diagonal blocks,
  the same inverse; forward and backward, the backward's elementwise rest fused into its
  kernel by default, `GpuTuning.channel_grads`; `gpu_prepare.channel_intra_kernel`). Linear attention and simple GLA take the XLA part
  (`gpu_prepare.prepare_chunks`: bf16 products, float32 accumulation and solve; differentiated
  by autodiff), as does any mixer with `GpuTuning(triton_intra="xla")`;
* **sequential state pass in Triton** (`pallas_kernels.gpu.triton.state_pass`): one program per
  (batch·value head, V-tile) walks the chunks with the float32 state in registers, forward and a
  reverse kernel for the state cotangent, wired as a `jax.custom_vjp` (`gpu_vjps.state_pass`,
  the same glue as the Mosaic kernels).

Same op contract as every implementation: GVA, segment_ids, padding, initial / final state, the
write residual, T not a multiple of the chunk, float32 state, bf16 / fp16 / fp32 inputs. Needs
the `triton` extra (`pip install lineax_attn[triton]`: jax-triton 0.3.1 and triton >= 3.6) and a
CUDA GPU; chunk_size 64; head dims in `pallas_kernels.gpu.triton.blocks`. Anything else
(`cu_seqlens` varlen, no GPU, no extra) falls back to `chunk` with one log line per reason.

tuning: a `pallas_gpu.GpuTuning`: `triton_intra` picks the intra-chunk path ("auto",
"kernel", "xla"; `intra` is pallas_gpu's and not read here); `solve`, `remat_intra` and
`channel_pair` steer the XLA intra-chunk part as for `pallas_gpu`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import jax

from lineax_attn.ops import api, specs
from lineax_attn.ops.gpu_tuning import GpuTuning, check_tuning
from pallas_kernels.gpu.triton import blocks

__all__ = ["GpuTuning", "available", "has_intra_kernels", "interpreted", "intra_choice",
           "supports", "triton_delta_family", "unsupported_reason"]

_warned: set[str] = api.fallback_logged("triton")


def missing_packages() -> tuple[str, ...]:
  """The packages of the `triton` extra that are not installed."""
  return tuple(name for name in ("triton", "jax_triton")
               if importlib.util.find_spec(name) is None)


def interpreted() -> bool:
  """True where the Triton kernels run in Triton's interpreter on the CPU instead:
  TRITON_INTERPRET=1 was set before they were imported (`pallas_kernels.gpu.triton.interpret`;
  triton needed, not jax-triton). A way to check the kernels without a GPU, never to train."""
  if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
    return False
  from pallas_kernels.gpu.triton import interpret  # pylint: disable=g-import-not-at-top
  return interpret.enabled()


def available() -> bool:
  """True where this implementation can run: the extra is installed and JAX runs on CUDA (or
  the kernels are `interpreted`)."""
  return interpreted() or (not missing_packages() and _on_cuda())


def require(asked: str, instead: str) -> None:
  """ValueError naming the GpuTuning choice `asked` (e.g. "state_pass='triton'") and the one to
  use `instead` where the triton extra cannot run: a tuning that asks for the Triton kernels
  is refused by name, never silently replaced."""
  if not available():
    raise ValueError(f"GpuTuning({asked}) needs the triton extra (missing: "
                     f"{', '.join(missing_packages()) or 'none'}) and a CUDA GPU "
                     f"(backend: {jax.default_backend()}); use {instead}.")


def _on_cuda() -> bool:
  """JAX's default device is an NVIDIA GPU (the kernels are untested on ROCm)."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return False
  version = str(getattr(device.client, "platform_version", "")).lower()
  return "rocm" not in version and "hip" not in version


def unsupported_reason(*, dk: int, dv: int, chunk_size: int, varlen: bool) -> str | None:
  """Why `triton` cannot run this call (None if it can)."""
  missing = missing_packages()
  if missing and not interpreted():
    return (f"{', '.join(missing)} not installed (the optional extra: pip install "
            "'lineax_attn[triton]')")
  if not _on_cuda() and not interpreted():
    return (f"device {jax.devices()[0].device_kind!r}: the Triton kernels need an NVIDIA GPU "
            "(jax-triton has no CPU lowering)")
  if varlen:
    return "cu_seqlens (varlen) is not handled by the Triton kernels yet"
  return blocks.supported(chunk_size, dk, dv)


def supports(call) -> str | None:
  """`api.Call` -> None, or why `triton` cannot run it (dispatch then runs "chunk")."""
  d = call.dims
  return unsupported_reason(dk=d.dk, dv=d.dv, chunk_size=call.chunk_size, varlen=call.varlen)


def has_intra_kernels(mixer) -> bool:
  """Whether the Triton path has intra-chunk kernels for `mixer`: the delta-rule ones
  (`intra_chunk`: DeltaNet, GDN) or the per-channel ones (`channel_intra`: a decay per key
  channel with an erase key, KDA and GDN-2)."""
  spec = specs.resolve(mixer)
  t = spec.template
  channel = t.decay is not None and t.erase is not None and spec.gate(t.decay).axis == "k"
  return spec.gpu_intra_kernel or channel


def intra_choice(mixer: str, tuning: GpuTuning) -> str:
  """Who computes `mixer`'s intra-chunk part on this path: "kernel" or "xla".

  `triton_intra="auto"` takes the kernels wherever they exist (`has_intra_kernels`): on the
  H200 they beat XLA's part for every such mixer (docs/BENCHMARKS.md "The Triton path, fifth
  stage": GDN fwd+bwd 2.6 ms against 4.7, KDA 6.0 against 11.1). Linear attention and simple
  GLA have none and take XLA's part."""
  if tuning.triton_intra != "auto":
    return tuning.triton_intra
  return "kernel" if has_intra_kernels(mixer) else "xla"


def triton_delta_family(mixer, q, k, v, gates, *, scale, initial_state, layout, chunk_size,
                        output_final_state=False, tuning=None):
  """The `triton` implementation (see `api.run_mixer` for the contract)."""
  tuning = check_tuning(tuning)
  # `intra` is pallas_gpu's choice; this path reads `triton_intra` (see GpuTuning).
  tuning = dataclasses.replace(tuning, intra=intra_choice(mixer, tuning))
  reason = unsupported_reason(dk=q.shape[-1], dv=v.shape[-1], chunk_size=chunk_size,
                              varlen=layout.is_varlen)
  if reason:  # called directly, past the dispatch: refuse rather than run wrong
    raise ValueError(f"triton cannot run this call: {reason}; call it through the op "
                     f"(implementation='triton' falls back to 'chunk').")
  from lineax_attn.ops import pallas_gpu  # the shared composition (imports no triton)
  return pallas_gpu.delta_family(mixer, q, k, v, gates, scale=scale,
                                 initial_state=initial_state, layout=layout,
                                 chunk_size=chunk_size, output_final_state=output_final_state,
                                 tuning=tuning, kernels="triton")
