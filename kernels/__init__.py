"""Attention over paged KV: the torch reference path (CPU) and Triton kernels (GPU)."""
