"""Parallelism over the sequence axis (context parallelism).

* `context.context_parallel` / `context.sharded_mixer`: the five linear mixers with the time axis
  sharded over a mesh axis (per-shard affine pass, all_gather of the shard transitions, prefix
  composition, output correction).
* `attention.context_parallel_attention` / `attention.sharded_attention`: softmax attention with
  the queries sharded and K/V all-gathered (causal mask offset by the shard's position).

See docs/CONTEXT_PARALLEL.md.
"""

from lineax_attn.parallel.attention import context_parallel_attention, sharded_attention
from lineax_attn.parallel.context import (SEQUENCE_AXIS, active_axis_size, context_parallel,
                                          sharded_mixer)

__all__ = ["SEQUENCE_AXIS", "active_axis_size", "context_parallel", "sharded_mixer",
           "context_parallel_attention", "sharded_attention"]
