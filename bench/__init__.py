"""Benchmarks: offline throughput, prefix caching, KV transfer, routing; peers in bench/peers."""
