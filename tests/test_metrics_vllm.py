"""vLLM's metric names on the router's /metrics (pd_runtime/router/metrics_vllm.py): what dashboards,
autoscalers and inference gateways written for a vLLM server read, derived from the router's
own metrics: healthy workers summed, a dead worker's last load left out, the latency histograms
of every path merged."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pd_runtime.router.metrics import RouterMetrics
from pd_runtime.router.metrics_vllm import VllmNames


def scraped(metrics: RouterMetrics) -> dict:
    out = {}
    for family in text_string_to_metric_families(metrics.text().decode()):
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                key = (sample.name, sample.labels.get("le"))
                assert sample.labels["model_name"] == "tiny"
                out[key] = sample.value
    return out


def test_the_deployment_reads_as_one_vllm_server():
    m = RouterMetrics()
    m.registry.register(VllmNames(m, "tiny", {"prompt_tokens": 2000, "output_tokens": 100}))
    for worker, running, waiting, free in (("p0", 1, 4, 60), ("d0", 7, 2, 20)):
        m.observe_worker(worker, True, {
            "total_blocks": 100, "free_blocks": free, "num_running": running,
            "num_waiting": waiting, "num_preemptions": 3, "prefix_queried_tokens": 500,
            "prefix_hit_tokens": 200})
    m.observe_worker("d1", True, {"total_blocks": 100, "free_blocks": 0, "num_running": 40,
                                  "num_waiting": 40, "prefix_queried_tokens": 9000,
                                  "prefix_hit_tokens": 9000})
    m.observe_worker("d1", False, {})  # died: its last report no longer counts as load
    for path, seconds in (("colocated", 0.02), ("disaggregated", 0.3), ("disaggregated", 3.0)):
        m.ttft.labels(path).observe(seconds)
    got = scraped(m)
    assert got[("vllm:num_requests_running", None)] == 8
    assert got[("vllm:num_requests_waiting", None)] == 6
    assert abs(got[("vllm:kv_cache_usage_perc", None)] - 0.6) < 1e-9  # (0.4 + 0.8) / 2
    assert got[("vllm:gpu_cache_usage_perc", None)] == got[("vllm:kv_cache_usage_perc", None)]
    assert got[("vllm:prompt_tokens_total", None)] == 2000
    assert got[("vllm:generation_tokens_total", None)] == 100
    assert got[("vllm:num_preemptions_total", None)] == 6
    assert got[("vllm:prefix_cache_queries_total", None)] == 1000  # d1 is dead
    assert got[("vllm:prefix_cache_hits_total", None)] == 400
    assert got[("vllm:time_to_first_token_seconds_count", None)] == 3
    assert abs(got[("vllm:time_to_first_token_seconds_sum", None)] - 3.32) < 1e-9
    assert got[("vllm:time_to_first_token_seconds_bucket", "0.025")] == 1
    assert got[("vllm:time_to_first_token_seconds_bucket", "0.5")] == 2
    assert got[("vllm:time_to_first_token_seconds_bucket", "+Inf")] == 3
    assert ("vllm:e2e_request_latency_seconds_count", None) not in got  # none observed yet
