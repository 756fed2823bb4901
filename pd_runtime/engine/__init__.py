"""The engine: the step loop (engine.py), sequences, the scheduler, the model runner, and in
sub-packages the paged KV cache's bookkeeping (kv_cache/), sampling (sampling/) and speculative
decoding (spec_decode/)."""
