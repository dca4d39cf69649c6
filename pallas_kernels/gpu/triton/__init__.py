"""Triton kernels of the chunk form, called from JAX through jax-triton (any NVIDIA GPU, sm_80+).

`blocks` (no triton import): which sizes the kernels take and their fixed block sizes.
`state_pass` (imports triton and jax_triton): the sequential chunk-to-chunk state pass.
"""
