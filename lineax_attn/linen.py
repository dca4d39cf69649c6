"""Linen versions of every layer (and the model), through `flax.nnx.bridge.to_linen`.

Each factory takes the NNX constructor's keyword arguments (minus `rngs`, which Linen supplies)
and behaves as a Linen module: `init`/`apply`, usable inside `nn.compact`. Parameters keep their
logical axis names (`nn.get_partition_spec` reads them).

    import flax.linen as nn
    from lineax_attn import linen as lxl

    class Block(nn.Module):
      @nn.compact
      def __call__(self, x):
        return x + lxl.LinearMixer(kind="gdn", d_model=64, num_heads=2, num_v_heads=4)(x)

Call another NNX method with `nnx_method=`, e.g. `layer(x, nnx_method="forward")`.
"""

from __future__ import annotations

import flax.linen as nn
from flax.nnx import bridge

from lineax_attn.layers.attention import SoftmaxAttention as _SoftmaxAttention
from lineax_attn.layers.conv import ShortConv as _ShortConv
from lineax_attn.layers.linear_mixer import LinearMixer as _LinearMixer
from lineax_attn.layers.mlp import SwiGLU as _SwiGLU
from lineax_attn.layers.norm import GatedHeadNorm as _GatedHeadNorm
from lineax_attn.layers.norm import RMSNorm as _RMSNorm
from lineax_attn.models.lm import LanguageModel as _LanguageModel



def _linen(nnx_class):
  """A Linen-module factory for `nnx_class`: same arguments, minus `rngs`, plus `name`."""

  def make(*args, name: str | None = None, **kwargs) -> nn.Module:
    return bridge.to_linen(nnx_class, *args, name=name, **kwargs)

  make.__name__ = make.__qualname__ = nnx_class.__name__
  make.__doc__ = f"Linen version of `{nnx_class.__module__}.{nnx_class.__name__}`.\n\n" + (
      nnx_class.__doc__ or "")
  return make


LinearMixer = _linen(_LinearMixer)
SoftmaxAttention = _linen(_SoftmaxAttention)
ShortConv = _linen(_ShortConv)
SwiGLU = _linen(_SwiGLU)
RMSNorm = _linen(_RMSNorm)
GatedHeadNorm = _linen(_GatedHeadNorm)
LanguageModel = _linen(_LanguageModel)

__all__ = ["LinearMixer", "SoftmaxAttention", "ShortConv", "SwiGLU", "RMSNorm", "GatedHeadNorm",
           "LanguageModel"]
