"""Pallas TPU (Mosaic) chunkwise kernels for the five linear-attention mixers.

    from pallas_kernels import tpu
    o, final_state, r = tpu.gated_delta_rule(q, k, v, g, beta, output_final_state=True)

Plain arrays in, plain arrays out; nothing here imports lineax_attn. On a non-TPU backend the
same kernels run in Mosaic's TPU interpreter (`interpret=None` picks this automatically).
See docs/KERNELS.md for the tiling, memory and limits.
"""

from pallas_kernels.tpu.block_sizes import BlockSizes
from pallas_kernels.tpu.delta_rule import delta_rule
from pallas_kernels.tpu.gated_delta_rule import gated_delta_rule
from pallas_kernels.tpu.gdn2 import gdn2
from pallas_kernels.tpu.kda import kda
from pallas_kernels.tpu.linear_attention import linear_attention
from pallas_kernels.tpu.sharding import shard_mixer
from pallas_kernels.tpu.template import default_interpret, delta_template

MIXERS = {
    "linear_attention": linear_attention,
    "delta_rule": delta_rule,
    "gated_delta_rule": gated_delta_rule,
    "kda": kda,
    "gdn2": gdn2,
}

__all__ = ["BlockSizes", "MIXERS", "delta_rule", "default_interpret", "delta_template",
           "gated_delta_rule", "gdn2", "kda", "linear_attention", "shard_mixer"]
