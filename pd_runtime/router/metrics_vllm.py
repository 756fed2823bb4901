"""vLLM's metric names beside the router's own (pd_runtime/router/metrics.py), for the dashboards,
autoscalers and inference gateways written against a vLLM server: the deployment seen as one
server labelled with its served model name, its healthy workers' load summed. Read from the
router's metrics when scraped; nothing is counted twice.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


class VllmNames:
    """A collector for RouterMetrics' registry."""

    def __init__(self, metrics, model_name: str, served: dict):
        self.metrics = metrics
        self.model_name = model_name
        self.served = served  # PoolBackend.served: the tokens of the requests it answered

    def collect(self):
        m, label = self.metrics, [self.model_name]
        healthy = {worker for worker, value in _by_worker(m.healthy) if value == 1}

        def family(kind, name: str, doc: str, value: float):
            out = kind(name, doc, labels=["model_name"])
            out.add_metric(label, value)
            return out

        def summed(gauge) -> float:
            return sum(value for worker, value in _by_worker(gauge) if worker in healthy)

        usage = [value for worker, value in _by_worker(m.kv_usage) if worker in healthy]
        kv = sum(usage) / len(usage) if usage else 0.0
        yield family(GaugeMetricFamily, "vllm:num_requests_running",
                     "Requests in the workers' running batches", summed(m.running))
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting",
                     "Requests waiting in the workers' queues", summed(m.waiting))
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc",
                     "KV cache usage, 1 = full (the healthy workers' mean)", kv)
        yield family(GaugeMetricFamily, "vllm:gpu_cache_usage_perc",
                     "vllm:kv_cache_usage_perc under its older name", kv)
        yield family(CounterMetricFamily, "vllm:prompt_tokens",
                     "Prompt tokens of the requests that got a first token",
                     self.served.get("prompt_tokens", 0))
        yield family(CounterMetricFamily, "vllm:generation_tokens", "Tokens generated",
                     self.served.get("output_tokens", 0))
        yield family(CounterMetricFamily, "vllm:num_preemptions", "Preemptions",
                     sum(value for _, value in _by_worker(m.preemptions)))
        tokens = {"queried": 0.0, "hit": 0.0}
        for family_ in m.prefix_tokens.collect():
            for sample in family_.samples:
                if sample.labels["worker"] in healthy:
                    tokens[sample.labels["kind"]] += sample.value
        yield family(CounterMetricFamily, "vllm:prefix_cache_queries",
                     "Prompt tokens looked up in the prefix cache (every worker's, summed: a "
                     "disaggregated prompt is looked up on both its workers)", tokens["queried"])
        yield family(CounterMetricFamily, "vllm:prefix_cache_hits",
                     "Of those, tokens served from the cache (any tier)", tokens["hit"])
        for source, name, doc in (
                (m.ttft, "vllm:time_to_first_token_seconds", "Time to first token"),
                (m.itl, "vllm:inter_token_latency_seconds", "Time between streamed tokens"),
                (m.e2e, "vllm:e2e_request_latency_seconds", "Request latency")):
            yield _merged(source, name, doc, label)


def _by_worker(gauge) -> list[tuple[str, float]]:
    """A gauge labelled by worker: (worker, value) of each series."""
    return [(sample.labels.get("worker"), sample.value)
            for family in gauge.collect() for sample in family.samples]


def _merged(histogram, name: str, doc: str, label: list) -> HistogramMetricFamily:
    """One histogram of all of `histogram`'s series (its paths), bucket by bucket."""
    buckets: dict[str, float] = {}
    total = 0.0
    for family in histogram.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = sample.labels["le"]
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
    out = HistogramMetricFamily(name, doc, labels=["model_name"])
    if buckets:
        out.add_metric(label, sorted(buckets.items(), key=lambda b: float(b[0])), total)
    return out
