"""Attention over paged KV and the decoder's row ops: the torch reference path (any device),
and native CPU kernels for bf16 built on first use (`native.py`), with the torch path as their
fallback and their reference in tests."""
