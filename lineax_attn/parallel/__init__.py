"""Parallelism over the sequence axis (context parallelism).

* `context.context_parallel` / `context.sharded_mixer`: the five linear mixers with the time axis
  sharded over a mesh axis (per-shard affine pass, all_gather of the shard transitions, prefix
  composition, output correction).
* `pieces.row_split`: the same maths inside one device, each row cut into pieces that run
  as rows of the batch (for small B·H and long T).
* `attention.context_parallel_attention` / `attention.sharded_attention`: softmax attention with
  the queries sharded and K/V all-gathered (causal mask offset by the shard's position).

See docs/CONTEXT_PARALLEL.md.
"""

from lineax_attn.parallel.attention import context_parallel_attention, sharded_attention
from lineax_attn.parallel.context import (SEQUENCE_AXIS, active_axis_size, context_parallel,
                                          sharded_mixer)
from lineax_attn.parallel.pieces import row_split

__all__ = ["SEQUENCE_AXIS", "active_axis_size", "context_parallel", "row_split", "sharded_mixer",
           "context_parallel_attention", "sharded_attention"]
