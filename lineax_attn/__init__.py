"""lineax_attn: linear-attention token mixers for JAX/Flax.

`lineax_attn.ops` holds the mixers as pure functions (scan reference, chunked form, kernels).
"""

__version__ = "0.1.0"
