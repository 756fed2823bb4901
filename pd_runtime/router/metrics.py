"""Prometheus metrics of the router: latency by path, routing decisions, worker load, KV
transfer, preemptions, admission refusals by tenant, migrations. One registry per router.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class _EngineSteps:
    """The workers' own step counts, exported as they report them (cumulative since each
    worker started): a histogram of step times, and prompt and decoded tokens computed."""

    def __init__(self):
        self.reports: dict[str, dict] = {}  # worker id -> its latest step_costs report
        self.overlap: dict[str, dict] = {}  # worker id -> its latest kv_overlap report

    def collect(self):
        steps = HistogramMetricFamily("pd_worker_step_duration_seconds",
                                      "Engine step time, as measured by the worker",
                                      labels=["worker"])
        prefill = CounterMetricFamily("pd_worker_prefill_tokens", "Prompt tokens computed",
                                      labels=["worker"])
        decode = CounterMetricFamily("pd_worker_decode_tokens", "Tokens decoded",
                                     labels=["worker"])
        for worker_id, report in sorted(self.reports.items()):
            bounds, counts = report.get("step_buckets_s"), report.get("step_counts")
            if bounds and counts and len(counts) == len(bounds) + 1:
                cumulative, buckets = 0, []
                for bound, count in zip([*map(str, bounds), "+Inf"], counts):
                    cumulative += count
                    buckets.append((bound, cumulative))
                steps.add_metric([worker_id], buckets, report.get("busy_s", 0.0))
            prefill.add_metric([worker_id], report.get("prefill_tokens", 0))
            decode.add_metric([worker_id], report.get("decode_tokens", 0))
        sends = CounterMetricFamily(
            "pd_worker_kv_send_seconds", "KV sends measured for overlap, first byte queued to "
            "the lease's end (prefill workers)", labels=["worker"])
        exposed = CounterMetricFamily(
            "pd_worker_kv_send_exposed_seconds", "The part of those sends after the prompt's "
            "last layer was computed (not hidden under the prefill)", labels=["worker"])
        for worker_id, report in sorted(self.overlap.items()):
            sends.add_metric([worker_id], report.get("whole_s_total", 0.0))
            exposed.add_metric([worker_id], report.get("exposed_s_total", 0.0))
        return [steps, prefill, decode, sends, exposed]


class RouterMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.engine_steps = _EngineSteps()
        r.register(self.engine_steps)
        path = ["path"]
        self.ttft = Histogram("pd_ttft_seconds", "Time to first token", path, registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("pd_inter_token_latency_seconds", "Time between streamed tokens",
                             path, registry=r, buckets=_ITL_BUCKETS)
        self.e2e = Histogram("pd_e2e_latency_seconds", "Request latency, arrival to last token",
                             path, registry=r, buckets=_LATENCY_BUCKETS)
        self.queue = Histogram("pd_queue_time_seconds",
                               "Arrival to first scheduled on a worker", path, registry=r,
                               buckets=_LATENCY_BUCKETS)
        self.requests = Counter("pd_requests_total", "Finished requests", ["path", "status"],
                                registry=r)
        self.decisions = Counter("pd_routing_decisions_total", "Routing decisions",
                                 ["path", "reason"], registry=r)
        self.kv_transfer = Histogram("pd_kv_transfer_seconds",
                                     "First token to KV arrival on the decode worker",
                                     registry=r, buckets=_LATENCY_BUCKETS)
        self.kv_fallbacks = Counter("pd_kv_transfer_fallbacks_total",
                                    "Disaggregated requests prefilled locally after a failure",
                                    registry=r)
        self.refusals = Counter("pd_admission_refusals_total", "Requests refused at admission",
                                ["tenant", "reason"], registry=r)
        self.migrations = Counter("pd_requests_migrated_total",
                                  "Requests moved to another decode worker after a loss",
                                  registry=r)
        self.reloads = Counter("pd_config_reloads_total", "Routing config reloads", ["result"],
                               registry=r)
        self.http_requests = Counter("router_http_requests", "HTTP requests by route and status",
                                     ["path", "status"], registry=r)
        self.http_latency = Histogram("router_http_request_seconds", "HTTP request latency",
                                      path, registry=r, buckets=_LATENCY_BUCKETS)
        worker = ["worker"]
        self.kv_usage = Gauge("pd_worker_kv_usage_ratio", "Used KV blocks / total", worker,
                              registry=r)
        self.running = Gauge("pd_worker_running", "Running sequences", worker, registry=r)
        self.waiting = Gauge("pd_worker_waiting", "Waiting sequences", worker, registry=r)
        self.hit_rate = Gauge("pd_worker_prefix_hit_rate", "Prefix-cache hit tokens / queried",
                              worker, registry=r)
        self.prefix_tokens = Gauge("pd_worker_prefix_tokens", "Prefix-cache tokens since worker "
                                   "start: queried (prompts admitted) and hit (from any tier)",
                                   ["worker", "kind"], registry=r)
        self.preemptions = Gauge("pd_worker_preemptions", "Preemptions since worker start",
                                 worker, registry=r)
        self.healthy = Gauge("pd_worker_healthy", "1 if the worker answered its last check",
                             worker, registry=r)
        self.kv_bytes = Gauge("pd_worker_kv_transfer_bytes", "KV bytes moved by this worker's "
                              "agent since it started", worker, registry=r)
        self.step_s = Gauge("pd_worker_step_seconds", "Engine step time, recent average",
                            worker, registry=r)
        self.batch = Gauge("pd_worker_batch_size", "Sequences per engine step, recent average",
                           worker, registry=r)
        self.tokens_per_step = Gauge("pd_worker_tokens_per_step",
                                     "Tokens computed per engine step, recent average", worker,
                                     registry=r)
        self.steps = Gauge("pd_worker_steps", "Engine steps since worker start", worker,
                           registry=r)
        self.busy = Gauge("pd_worker_busy_seconds", "Seconds spent in engine steps since "
                          "worker start", worker, registry=r)
        self.cost = Gauge("pd_cost_model_seconds", "The live cost model: seconds per step, per "
                          "prompt token, per prompt token x context token, per decoded "
                          "sequence, per context token of a decoded sequence",
                          ["worker", "term"], registry=r)
        self.prefill_rate = Gauge("pd_cost_model_prefill_tokens_per_second",
                                  "Predicted prefill rate of a 1024-token prompt", worker,
                                  registry=r)
        self.transfer_gbps = Gauge("pd_cost_model_transfer_gbps",
                                   "KV sent per second by this worker's transfers, averaged",
                                   worker, registry=r)
        # planner.autoscale (pd_runtime/workers/elastic.py sets them)
        self.autoscale_workers = Gauge("pd_autoscale_workers", "Workers per role: desired by "
                                       "the autoscaler's last decision, and actual (routed to)",
                                       ["role", "kind"], registry=r)
        self.autoscale_decisions = Counter("pd_autoscale_decisions_total", "Autoscaler "
                                           "decisions by reason", ["reason"], registry=r)
        self.autoscale_events = Histogram("pd_autoscale_event_seconds", "A worker's start (to "
                                          "ready), drain (to stopped) or re-role (drained to "
                                          "serving in the other pool), by kind",
                                          ["kind"], registry=r,
                                          buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300))
        self.ttft_error = Histogram("pd_ttft_prediction_error_seconds",
                                    "Measured minus predicted TTFT (slo mode)", path,
                                    registry=r, buckets=(-5, -2, -1, -0.5, -0.25, -0.1, -0.05,
                                                         0, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
        self.kv_hidden = Gauge("pd_worker_kv_transfer_hidden_share",
                               "Share of recent KV sends' time that ran under the prefill's "
                               "compute (prefill workers)", ["worker"], registry=r)
        self.graph_capture = Gauge("pd_worker_cuda_graph_capture_seconds",
                                   "Start-up time capturing the decode CUDA graphs", ["worker"],
                                   registry=r)
        self.kv_failures = Gauge("pd_worker_kv_transfer_failures",
                                 "Failed transfers since worker start", ["worker", "reason"],
                                 registry=r)
        self.spec_tokens = Gauge("pd_worker_speculative_tokens", "Speculative decoding since "
                                 "worker start: tokens drafted and accepted, verifications",
                                 ["worker", "kind"], registry=r)
        self.spec_acceptance = Gauge("pd_worker_speculative_acceptance_rate",
                                     "Accepted / drafted tokens since worker start", worker,
                                     registry=r)
        self.spec_accepted_length = Gauge(
            "pd_worker_speculative_tokens_per_verification", "Tokens a verifying request "
            "gains per step (accepted drafts + 1), since worker start", worker, registry=r)
        self.kv_tier = Gauge("pd_worker_kv_tier", "KV tiers below the device pool, since "
                             "worker start: blocks stored, hit, queried, evicted, corrupt, "
                             "held; bytes in and out; seconds loading hits back",
                             ["worker", "tier", "kind"], registry=r)
        self.kv_tier_hit_rate = Gauge("pd_worker_kv_tier_hit_rate", "Blocks a lower tier "
                                      "served / blocks looked up there after a device miss",
                                      ["worker", "tier"], registry=r)

    def forget_worker(self, worker_id: str) -> None:
        """A worker that left the pools (the autoscaler stopped it): its series end, instead
        of keeping their last values for good."""
        from prometheus_client import Gauge as _Gauge

        for metric in vars(self).values():
            if not isinstance(metric, _Gauge) or "worker" not in metric._labelnames:
                continue
            at = metric._labelnames.index("worker")
            for labels in list(metric._metrics):
                if labels[at] == worker_id:
                    metric.remove(*labels)
        for collector in vars(self).values():
            if isinstance(collector, _EngineSteps):
                collector.reports.pop(worker_id, None)
                collector.overlap.pop(worker_id, None)

    def observe_worker(self, worker_id: str, healthy: bool, load: dict) -> None:
        self.healthy.labels(worker_id).set(1 if healthy else 0)
        if not healthy or not load:
            return
        total = max(1, load.get("total_blocks", 1))
        self.kv_usage.labels(worker_id).set(1 - load.get("free_blocks", total) / total)
        self.running.labels(worker_id).set(load.get("num_running", 0))
        self.waiting.labels(worker_id).set(load.get("num_waiting", 0))
        queried = load.get("prefix_queried_tokens", 0)
        self.prefix_tokens.labels(worker_id, "queried").set(queried)
        self.prefix_tokens.labels(worker_id, "hit").set(load.get("prefix_hit_tokens", 0))
        self.hit_rate.labels(worker_id).set(load.get("prefix_hit_tokens", 0) / queried
                                            if queried else 0)
        self.preemptions.labels(worker_id).set(load.get("num_preemptions", 0))
        overlap = load.get("kv_overlap") or {}
        if overlap.get("transfers"):
            self.engine_steps.overlap[worker_id] = overlap
        if "hidden_share" in overlap:
            self.kv_hidden.labels(worker_id).set(overlap["hidden_share"])
        if load.get("cuda_graph_capture_s") is not None:
            self.graph_capture.labels(worker_id).set(load["cuda_graph_capture_s"])
        costs = load.get("step_costs") or {}
        if costs:
            self.engine_steps.reports[worker_id] = costs
            self.step_s.labels(worker_id).set(costs.get("step_s_ewma", 0))
            self.batch.labels(worker_id).set(costs.get("batch_ewma", 0))
            self.tokens_per_step.labels(worker_id).set(costs.get("tokens_per_step_ewma", 0))
            self.steps.labels(worker_id).set(costs.get("steps", 0))
            self.busy.labels(worker_id).set(costs.get("busy_s", 0))
            for term, value in (costs.get("coefficients") or {}).items():
                self.cost.labels(worker_id, term).set(value)
        spec = load.get("speculation") or {}
        if spec:
            for kind in ("drafted_tokens", "accepted_tokens", "verifications"):
                self.spec_tokens.labels(worker_id, kind).set(spec.get(kind, 0))
            if spec.get("acceptance_rate") is not None:
                self.spec_acceptance.labels(worker_id).set(spec["acceptance_rate"])
                self.spec_accepted_length.labels(worker_id).set(spec["tokens_per_verification"])
        for tier in ("host", "disk"):
            stats = (load.get("kv_tiers") or {}).get(tier)
            if not stats:
                continue
            for kind, value in stats.items():
                self.kv_tier.labels(worker_id, tier, kind).set(value)
            if stats["queried_blocks"]:
                self.kv_tier_hit_rate.labels(worker_id, tier).set(
                    stats["hit_blocks"] / stats["queried_blocks"])
        kv = load.get("kv_transfer") or {}
        self.kv_bytes.labels(worker_id).set(kv.get("bytes_sent", 0) + kv.get("bytes_received", 0))
        for reason, count in (kv.get("failures") or {}).items():
            self.kv_failures.labels(worker_id, reason).set(count)

    def observe_costs(self, worker_id: str, prefill_tokens_per_s: float,
                      transfer_gbps: float) -> None:
        self.prefill_rate.labels(worker_id).set(prefill_tokens_per_s)
        if transfer_gbps:
            self.transfer_gbps.labels(worker_id).set(transfer_gbps)

    def text(self) -> bytes:
        return generate_latest(self.registry)
