"""Pools the cluster cannot place end the start with an error that says what was asked, what the
cluster has and which settings change it: at once on a local Ray (the machine will not grow),
after placement.ready_timeout_s on a cluster that might (not Ray's bare GetTimeoutError)."""

from __future__ import annotations

import time

import pytest
import ray

from pd_runtime.config import ClusterConfig
from pd_runtime.workers.pool import build_pools, check_local_fit

TWO_DECODE = {"decode": {"num_workers": 2, "engine": {"dtype": "float32", "num_kv_blocks": 16}},
              "prefill": {"engine": {"dtype": "float32", "num_kv_blocks": 16}},
              "placement": {"ready_timeout_s": 2.0}}


def test_a_local_ray_too_small_for_the_pools_is_refused_before_any_worker_starts():
    cfg = ClusterConfig.model_validate(TWO_DECODE)
    with pytest.raises(RuntimeError) as caught:
        check_local_fit(cfg, {"CPU": 2.0, "memory": 1e10})
    message = str(caught.value)
    assert message.startswith("the pools need {'CPU': 3.0} of this local Ray's {'CPU': 2.0}")
    assert "decode: 2 x {'CPU': 1.0}" in message and "ray.num_cpus" in message
    check_local_fit(cfg, {"CPU": 3.0})  # fits
    tp = ClusterConfig.model_validate({"decode": {"engine": {"tensor_parallel_size": 2}}})
    with pytest.raises(RuntimeError, match="x 2 ranks"):
        check_local_fit(tp, {"CPU": 2.0})  # 1 prefill + 2 ranks
    remote = ClusterConfig.model_validate({**TWO_DECODE, "ray": {"address": "auto"}})
    check_local_fit(remote, {"CPU": 2.0})  # a cluster may grow: placement decides


def test_a_pool_a_cluster_cannot_place_in_time_is_an_error_naming_the_fix(llama_dir):
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="pd-placement")
    try:
        # As on a cluster that could grow (ray.address set): placement is waited for, then fails.
        cfg = ClusterConfig.model_validate({**TWO_DECODE, "ray": {"address": "auto"}})
        started = time.monotonic()
        with pytest.raises(RuntimeError) as caught:
            build_pools(cfg, llama_dir, ready_timeout_s=60.0)
        message = str(caught.value)
        assert "the decode pool's 2 workers ({'CPU': 1.0} each, PACK)" in message
        assert "within 2 s" in message and "ray.num_cpus" in message
        assert "'CPU': 2.0" in message  # the cluster's own
        assert time.monotonic() - started < 50
        assert not [pg for pg in ray.util.placement_group_table().values()
                    if pg["name"] == "pd-decode" and pg["state"] != "REMOVED"]
        # On a local Ray, at once.
        local = ClusterConfig.model_validate(TWO_DECODE)
        with pytest.raises(RuntimeError, match="of this local Ray's"):
            build_pools(local, llama_dir, ready_timeout_s=60.0)
    finally:
        ray.shutdown()
