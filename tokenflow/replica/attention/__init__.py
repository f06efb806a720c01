"""Attention over the paged KV cache: the metadata a step builds once, and the backends
(`backends`: the torch reference on CPU, FlashAttention's paged kernel on CUDA)."""
