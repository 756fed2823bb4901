"""A pool the local Ray cannot place ends the start with an error that says what was asked, what
the cluster has and which settings change it (not Ray's bare GetTimeoutError after 120 s)."""

from __future__ import annotations

import pytest
import ray

from pd_runtime.config import ClusterConfig
from pd_runtime.workers.pool import build_pools


def test_a_pool_the_cluster_cannot_place_is_an_error_naming_the_fix(llama_dir):
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="pd-placement")
    try:
        cfg = ClusterConfig.model_validate({
            "decode": {"num_workers": 2, "engine": {"dtype": "float32", "num_kv_blocks": 16}},
            "prefill": {"engine": {"dtype": "float32", "num_kv_blocks": 16}},
            "placement": {"ready_timeout_s": 2.0}})
        with pytest.raises(RuntimeError) as caught:
            build_pools(cfg, llama_dir, ready_timeout_s=60.0)
        message = str(caught.value)
        assert "the decode pool's 2 workers ({'CPU': 1.0} each, PACK)" in message
        assert "within 2 s" in message and "ray.num_cpus" in message
        assert "'CPU': 2.0" in message  # the cluster's own
        assert not [pg for pg in ray.util.placement_group_table().values()
                    if pg["name"] == "pd-decode" and pg["state"] != "REMOVED"]
    finally:
        ray.shutdown()
