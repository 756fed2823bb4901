"""In-process worker pools for tests (LocalPool: the workers as on Ray, without Ray)."""

from __future__ import annotations

from pd_runtime.config import ClusterConfig


def pair_config(model_dir: str, engine: dict, **sections) -> ClusterConfig:
    """One prefill and one decode worker running `engine`, KV over the in-process link;
    `sections` adds or replaces top-level config sections (router, recovery, ...)."""
    return ClusterConfig.model_validate({
        "model": model_dir, "kv_transfer": {"backend": "local"},
        "prefill": {"num_workers": 1, "engine": engine},
        "decode": {"num_workers": 1, "engine": engine}, **sections})
