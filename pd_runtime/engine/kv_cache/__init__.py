"""The paged KV cache's bookkeeping: block hashes for the prefix cache, the block manager, host
memory and swap space, and the memory plan that sizes the pool from a model's config."""
