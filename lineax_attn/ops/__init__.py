"""Public ops of lineax_attn: every token mixer as a pure function with one signature.

    o, final_state = gated_delta_rule(q, k, v, g, beta, implementation="chunk")

The mixers are `MIXERS`, one `specs.MixerSpec` each (lineax_attn/ops/specs.py; a new one is a
spec entry, docs/ADDING_A_MIXER.md).

Implementations: "scan" (the `lax.scan` reference, the truth), "chunk" (chunkwise-parallel
pure JAX, differentiable), "pallas_tpu" (Pallas Mosaic TPU kernels; the TPU interpreter off TPU)
and "pallas_gpu" (Mosaic GPU state-passing kernels on Hopper, the rest in XLA; other shapes fall
back to "chunk" with a log line). `implementation=None` picks the best available for the
backend: "pallas_tpu" on TPU, "pallas_gpu" on Hopper GPUs, "chunk" elsewhere. `tuning=` takes an
implementation's static tuning, e.g. `GpuTuning(intra="xla")` for "pallas_gpu" (None = default).

Values are checked where they are concrete (eager calls); traced values under `jax.jit` only in
checked mode, through `jax.experimental.checkify`: `checked(jax.jit(step))(...)` raises a
ValueError naming the bad argument (docs/OP_CONTRACT.md has the whole contract).
"""

import importlib as _importlib

from lineax_attn.ops import api as _api
from lineax_attn.ops import chunked as _chunked
from lineax_attn.ops import reference as _reference
from lineax_attn.ops import specs
from lineax_attn.ops.attention import softmax_attention

_api.register_implementation("scan", _reference.scan_reference)
_api.register_implementation("chunk", _chunked.chunk_delta_family)
# The kernel implementations import Mosaic GPU / TPU and Pallas (seconds per process): their
# modules load on first use (api.register_deferred_implementation), not here.
_api.register_deferred_implementation("pallas_tpu", "lineax_attn.ops.pallas_tpu", "pallas_tpu_impl")
_api.register_deferred_implementation("pallas_gpu", "lineax_attn.ops.pallas_gpu",
                                      "pallas_gpu_delta_family", tuning_type="GpuTuning",
                                      supports="supports", keeps_input_dtypes=True)
# Triton kernels through jax-triton (the optional `triton` extra; NVIDIA GPUs from sm_80).
_api.register_deferred_implementation("triton", "lineax_attn.ops.triton_gpu",
                                      "triton_delta_family", tuning_type="GpuTuning",
                                      supports="supports", keeps_input_dtypes=True)

available_implementations = _api.available_implementations
checked = _api.checked
debug_checks = _api.debug_checks
set_debug_checks = _api.set_debug_checks
debug_checks_enabled = _api.debug_checks_enabled
MIXERS = specs.names()  # the canonical names of every `specs.MixerSpec`

# Every mixer's public op (linear_attention, delta_rule, gated_delta_rule, kda, gdn2,
# simple_gla, ...) is generated from its spec: signature, gate order and docstring.
for _name in MIXERS:
  globals()[_name] = _api.make_op(specs.SPECS[_name])

__all__ = list(MIXERS) + [
    "softmax_attention", "available_implementations", "MIXERS", "checked", "debug_checks",
    "set_debug_checks", "debug_checks_enabled", "GpuTuning", "specs",
]

# Names served lazily (PEP 562), imported on access: `GpuTuning` (the pallas_gpu module
# re-exports the same class) comes without the kernels.
_LAZY = {"GpuTuning": ("lineax_attn.ops.gpu_tuning", "GpuTuning"),
         "pallas_gpu": ("lineax_attn.ops.pallas_gpu", None),
         "pallas_tpu": ("lineax_attn.ops.pallas_tpu", None),
         "triton_gpu": ("lineax_attn.ops.triton_gpu", None)}


def __getattr__(name):
  if name not in _LAZY:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  module_name, attr = _LAZY[name]
  module = _importlib.import_module(module_name)
  value = module if attr is None else getattr(module, attr)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_LAZY))
