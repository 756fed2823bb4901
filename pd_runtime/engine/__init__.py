"""The engine: sequences, paged KV block manager, scheduler, model runner, sampler, step loop."""
