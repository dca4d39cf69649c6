"""Triton kernels of the chunk form, called from JAX through jax-triton (any NVIDIA GPU, sm_80+).

`blocks` (no triton import): which sizes the kernels take and their fixed block sizes.
`state_pass` (imports triton and jax_triton): the sequential chunk-to-chunk state pass.
`intra_chunk`, `channel_intra`: the intra-chunk parts (delta rule; per-channel gates).
`interpret` (with TRITON_INTERPRET=1, no GPU): the kernels in Triton's interpreter behind
jax-triton's `triton_call`, for tests on the CPU.
"""
