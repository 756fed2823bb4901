"""The SLO-aware policy and its live cost model, with a fake clock and scripted load reports
(no Ray): it picks the option the cost model predicts, refuses with a Retry-After when nothing
meets the targets, keeps its queues honest as first tokens arrive, and reloads targets live."""

from __future__ import annotations

import random

import pytest

from pd_runtime.config import RoutingConfig, SLOClass, SLOTarget
from pd_runtime.config_loading import ConfigError, load_routing_config
from pd_runtime.engine.step_costs import StepCostModel, StepWork
from pd_runtime.router.cost_model import CostModel
from pd_runtime.router.ledger import Ledgers
from pd_runtime.router.policy import WorkerState, decide_slo, slo_options, slo_target
from pd_runtime.router.reload import RoutingReloader

# A worker that prefills 5,000 tokens/s and decodes a sequence for 1 ms a step over 5 ms.
FAST = dict(step_s=0.005, prefill_token_s=2e-4, prefill_attention_s=0.0, decode_seq_s=1e-3,
            decode_context_s=0.0)


def report(coefficients=None, step_s_ewma=0.0, decode_s_ewma=0.0, **load):
    """A load report as a worker sends it (engine load_report + worker fields)."""
    return {"num_running": 0, "num_waiting": 0, "max_num_batched_tokens": 2048,
            "kv_bytes_per_token": 8192, "kv_transfer": {"send_gbps": 2.0},
            "step_costs": {"coefficients": coefficients or FAST, "step_s_ewma": step_s_ewma,
                           "decode_s_ewma": decode_s_ewma, "steps": 100}, **load}


class Cluster:
    """Scripted workers: their reports feed the cost model; the ledger is the router's."""

    def __init__(self, decode=("d0",), prefill=("p0",), **coefficients):
        self.costs, self.ledgers, self.now = CostModel(), Ledgers(), 1000.0
        self.decode = [WorkerState(w, "decode") for w in decode]
        self.prefill = [WorkerState(w, "prefill") for w in prefill]
        for w in self.decode + self.prefill:
            self.costs.update(w.worker_id, report(coefficients.get(w.worker_id)))

    def report(self, worker_id, **fields):
        """A new load report from a worker: the router's cost model and worker state take it."""
        load = report(**fields)
        self.costs.update(worker_id, load)
        next(w for w in self.decode + self.prefill if w.worker_id == worker_id).load = load

    def decide(self, prompt_len, target=SLOTarget(), max_tokens=64, hits=None, cfg=None):
        return decide_slo(prompt_len, max_tokens, self.decode, self.prefill, hits or {},
                          cfg or RoutingConfig(), target, self.costs, self.ledgers, self.now,
                          random.Random(0))

    def run(self, decision, request_id):
        """Book a decision as the router does when it sends the request."""
        runner = decision.prefill_worker or decision.decode_worker
        self.ledgers[runner].add_prefill(request_id, decision.prefill_s, self.now)
        self.ledgers[decision.decode_worker].start(request_id, decision.prompt_tokens)


def test_predictions_follow_the_cost_model():
    c = Cluster()
    options = {o.path: o for o in slo_options(1000, 64, c.decode, c.prefill, {}, c.costs,
                                              c.ledgers, c.now, SLOTarget())}
    # 1000 tokens at 0.2 ms + one chunk's 5 ms step.
    assert options["colocated"].prefill_s == pytest.approx(0.205)
    assert options["disaggregated"].prefill_s == pytest.approx(0.205)
    assert options["disaggregated"].ttft_s == pytest.approx(0.205 + 2 * c.costs.rpc_s)
    # Decode step with one sequence: 5 + 1 ms; the colocated prefill is spread over 64 steps.
    assert options["colocated"].tpot_s == pytest.approx(0.006 + 0.205 / 64)
    transfer = 1000 * 8192 / 2e9 + c.costs.rpc_s
    assert options["disaggregated"].tpot_s == pytest.approx(0.006 + transfer / 64)


def test_long_prompt_goes_to_the_idle_prefill_worker_and_short_stays_when_it_is_busy():
    c = Cluster()
    long = c.decide(2048)
    assert (long.path, long.prefill_worker, long.reason) == ("disaggregated", "p0", "slo_remote")
    c.run(long, "long-1")
    # The prefill worker now has ~0.42 s queued: a short prompt is better off on the decode
    # worker (its own prefill is 26 ms; waiting for p0 would cost far more TTFT headroom).
    short = c.decide(128)
    assert (short.path, short.reason) == ("colocated", "slo_local")
    assert short.predicted_ttft_s < 0.1


def test_each_path_does_its_job_while_it_can_meet_the_targets():
    c = Cluster()
    c.ledgers["p0"].add_prefill("queued", 0.8, c.now)  # the prefill worker is 0.8 s behind
    # A long prompt goes to the prefill worker while it still meets the TTFT target...
    d = c.decide(2048)
    assert (d.path, d.reason) == ("disaggregated", "slo_remote")
    # ...and only when it cannot, falls back to the decode worker.
    c.ledgers["p0"].add_prefill("queued-2", 2.0, c.now)
    d = c.decide(2048)
    assert (d.path, d.reason) == ("colocated", "slo_local_fallback")
    # With streams running there, a colocated prefill also costs each of them: among decode
    # workers the one with fewer streams is chosen.
    c2 = Cluster(decode=("d0", "d1"))
    c2.ledgers["p0"].add_prefill("queued", 3.0, c2.now)
    for i in range(8):
        c2.ledgers["d0"].start(f"r{i}", 300)
    assert c2.decide(2048).decode_worker == "d1"
    # With streams on every decode worker, it waits for the prefill worker (told when).
    c2.ledgers["d1"].start("r-d1", 300)
    refused = c2.decide(2048)
    assert (refused.path, refused.reason) == ("none", "slo_would_stall")
    assert 0.5 <= refused.retry_after_s < 2.0  # 3 s queued + 0.4 s against 2.5 s
    # The client is told why: the prefill worker's TTFT (not a colocated option that meets the
    # targets, which would read as a contradiction) and the stall.
    assert refused.refusal.startswith("the prefill workers are busy (TTFT 3.4")
    assert "admitted up to 2.25s" in refused.refusal
    assert "2048-token prompt on a decode worker would stall" in refused.refusal


def test_picks_the_decode_worker_the_model_says_is_faster():
    slow = dict(FAST, decode_seq_s=4e-3, step_s=0.02)
    c = Cluster(decode=("d0", "d1"), prefill=(), d0=slow)
    d = c.decide(100)
    assert d.decode_worker == "d1" and d.path == "colocated"
    # Load d1 until its predicted TPOT is worse than d0's: the choice follows.
    for i in range(40):
        c.ledgers["d1"].start(f"r{i}", 500)
    assert c.decide(100).decode_worker == "d0"


def test_refuses_with_retry_after_when_no_option_meets_the_ttft_target():
    c = Cluster()
    for i in range(20):  # 20 long prompts queued on each worker: ~4 s of prefill on both
        c.ledgers["p0"].add_prefill(f"p{i}", 0.2, c.now)
        c.ledgers["d0"].add_prefill(f"d{i}", 0.2, c.now)
    refused = c.decide(2048, target=SLOTarget(ttft_s=2.5, tpot_s=10.0))
    assert refused.path == "none" and refused.reason == "slo_ttft_unmet"
    assert refused.refusal == ("no worker can meet the latency targets now: TTFT "
                               f"{refused.predicted_ttft_s:.2f}s predicted (admitted up to "
                               "2.25s: the targets x slo_margin 0.9)")
    # The best option would start in 4 s and take 0.42 s: 2.2 s over the 2.5 s target less
    # the 10% margin (slo_margin).
    assert refused.retry_after_s == pytest.approx(4.0 + 0.415 + 2 * c.costs.rpc_s - 2.25,
                                                  abs=0.01)
    # Time passes and the queues drain: the same request is served.
    c.now += 3.0
    assert c.decide(2048, target=SLOTarget(ttft_s=2.5, tpot_s=10.0)).path != "none"


def test_refuses_when_the_decode_worker_would_miss_tpot():
    c = Cluster()
    for i in range(120):  # 120 sequences at 1 ms each: a 125 ms step
        c.ledgers["d0"].start(f"r{i}", 100)
    refused = c.decide(128)
    assert (refused.path, refused.reason) == ("none", "slo_tpot_unmet")
    assert refused.retry_after_s >= 0.5
    assert refused.refusal.startswith("no worker can meet the latency targets now: TPOT 12")
    assert "admitted up to 90ms" in refused.refusal and "thin out" in refused.refusal
    # A looser TPOT target for this tenant admits it.
    cfg = RoutingConfig(tenant_slos={"batch": SLOTarget(ttft_s=10, tpot_s=0.5)})
    assert c.decide(128, target=slo_target(cfg, "batch", 128), cfg=cfg).path != "none"


def test_a_prompt_no_idle_worker_could_serve_in_time_is_served_late_with_a_bounded_wait():
    # 10,000 tokens at 5,000/s: 2 s of prefill, over a 1 s TTFT target even on idle workers.
    # Refusing would refuse it for ever; it is served where no more than its own prefill is
    # queued (TTFT at most twice the idle one), never on a decode worker whose streams its
    # prefill would stall.
    c = Cluster()
    target = SLOTarget(ttft_s=1.0, tpot_s=0.1)
    first = c.decide(10_000, target=target)
    assert (first.path, first.reason) == ("disaggregated", "slo_best_effort")
    c.run(first, "huge-1")
    # p0 has 2 s queued, its own 2 s: the second waits behind it (d0 carries huge-1's stream).
    second = c.decide(10_000, target=target)
    assert (second.path, second.reason) == ("disaggregated", "slo_best_effort")
    assert second.predicted_ttft_s == pytest.approx(4.0, abs=0.1)
    c.run(second, "huge-2")
    # 4 s queued now: come back when it is down to 2 s.
    third = c.decide(10_000, target=target)
    assert third.path == "none" and third.retry_after_s == pytest.approx(2.0, abs=0.1)
    assert third.refusal.startswith("no worker could meet the latency targets for this "
                                    "request even idle: TTFT")
    assert "served late once a worker has no more than its own prefill queued" in \
        third.refusal
    # Both queues' work is now ahead of a short prompt on p0, but d0 can take it at once.
    assert c.decide(128, target=target).path == "colocated"

    # A decode worker with no stream takes one itself while the prefill worker is busy.
    c = Cluster()
    c.ledgers["p0"].add_prefill("other", 2.5, c.now)
    alone = c.decide(10_000, target=target)
    assert (alone.path, alone.reason) == ("colocated", "slo_best_effort")
    c.run(alone, "huge-2")
    third = c.decide(10_000, target=target)
    assert third.path == "none" and third.retry_after_s >= 0.5  # both busy
    assert c.decide(128, target=target).path == "none"  # 2 s queued on each: over 1 s


def test_a_prompt_late_only_by_one_request_ahead_is_served_late_not_refused():
    """The prefill worker meets the TTFT target idle (2.05 s of 2.5) but has one such prompt
    queued: the next is served late (slo_late, ~4.1 s), as a client would rather have it; with
    two queued it is refused (the worker is saturated), and never moved onto the decode
    worker's streams."""
    slow = dict(FAST, prefill_token_s=1e-3)
    c = Cluster(p0=slow)
    c.ledgers["d0"].start("stream", 300)
    first = c.decide(2048)
    assert (first.path, first.reason) == ("disaggregated", "slo_remote")
    c.run(first, "long-1")
    second = c.decide(2048)
    assert (second.path, second.reason) == ("disaggregated", "slo_late")
    assert second.predicted_ttft_s == pytest.approx(4.1, abs=0.05)
    c.run(second, "long-2")
    third = c.decide(2048)
    assert third.path == "none" and third.retry_after_s >= 0.5
    # A short prompt still goes to the decode worker at once.
    assert c.decide(128).reason == "slo_local"


def test_a_prompt_predicted_within_the_target_but_not_its_margin_is_served_late():
    """Behind more than its own prefill, but predicted to start within the TTFT target (not the
    target x slo_margin): served late (slo_late), not refused; predicted past the target: refused,
    and never moved onto the decode worker's stream."""
    slow = dict(FAST, prefill_token_s=4e-4)  # 2048 tokens: 0.824 s
    c = Cluster(p0=slow)
    c.ledgers["d0"].start("stream", 300)
    c.ledgers["p0"].add_prefill("ahead", 1.5, c.now)
    d = c.decide(2048)
    assert (d.path, d.reason) == ("disaggregated", "slo_late")
    assert 2.25 < d.predicted_ttft_s <= 2.5
    c.ledgers["p0"].add_prefill("more", 0.3, c.now)
    refused = c.decide(2048)
    assert refused.path == "none" and refused.predicted_ttft_s > 2.5


def test_a_long_prompt_only_a_streaming_decode_worker_could_serve_in_time_is_not_refused():
    """The prefill worker is too slow for this prompt even idle, the decode worker fast enough
    but running streams it would stall: the prefill worker serves it late, not 'busy'."""
    slow = dict(FAST, prefill_token_s=1.3e-3)  # 2048 tokens: 2.67 s, over the 2.5 s target
    c = Cluster(p0=slow)
    c.ledgers["d0"].start("stream", 300)
    d = c.decide(2048)
    assert (d.path, d.reason) == ("disaggregated", "slo_best_effort")
    c.run(d, "long-1")
    c.run(c.decide(2048), "long-2")  # 2.67 s queued: its own, it waits
    refused = c.decide(2048)
    assert refused.path == "none" and "busy" not in refused.refusal
    assert refused.refusal.startswith("no worker could meet the latency targets for this "
                                      "request even idle")
    assert refused.retry_after_s == pytest.approx(2.67, abs=0.1)


def test_time_held_at_the_router_counts_against_the_ttft_target():
    c = Cluster()
    c.ledgers["p0"].add_prefill("queued", 1.5, c.now)
    c.ledgers["d0"].add_prefill("queued-too", 1.5, c.now)
    target = SLOTarget(ttft_s=2.5, tpot_s=0.1)
    assert c.decide(2048, target=target).path != "none"  # ~1.9 s: meets 2.5 s less 10%
    held = decide_slo(2048, 64, c.decode, c.prefill, {}, RoutingConfig(), target, c.costs,
                      c.ledgers, c.now, random.Random(0), waited_s=1.0)
    assert held.path == "none"  # 1 s already spent: 1.9 s more would miss it


def test_tenant_budget_is_given_back_for_a_refusal():
    from pd_runtime.config import TenantConfig
    from pd_runtime.router.tenants import Tenants

    tenant = TenantConfig(tenant_id="a", api_key="k", requests_per_minute=2)
    tenants = Tenants([tenant])
    for _ in range(5):  # refused each time (an overload 429): the budget is not spent
        assert tenants.admit(tenant, 10)[0] is None
        tenants.refund(tenant, 10)
    assert tenants.admit(tenant, 10)[0] is None and tenants.admit(tenant, 10)[0] is None
    assert tenants.admit(tenant, 10)[0] == "requests_per_minute"


def test_a_busy_decode_worker_is_judged_by_its_measured_step():
    c = Cluster()
    for i in range(120):  # the model says 125 ms a step with these...
        c.ledgers["d0"].start(f"r{i}", 100)
    assert c.decide(128).path == "none"
    c.report("d0", step_s_ewma=0.03, num_running=120)  # ...it measures 30 ms:
    assert c.decide(128).path != "none"                                # room for more
    c.report("d0", step_s_ewma=0.2, num_running=120)   # 200 ms: no room
    assert c.decide(128).reason == "slo_tpot_unmet"


def test_a_recovering_worker_is_judged_by_the_decode_part_of_its_steps():
    """A decode worker recomputing the prompts of streams migrated to it (not in the router's
    ledger: they were routed elsewhere) runs 1.2 s steps for a while, almost all prompt: a new
    request's prompt is computed after them and its TPOT is the decode part, ~20 ms. Read from
    the whole step, every request was refused for seconds after a decode worker's restart."""
    c = Cluster()
    for i in range(8):
        c.ledgers["d0"].start(f"r{i}", 700)
    c.report("d0", step_s_ewma=1.24, num_running=8)  # a worker that reports no decode part
    assert c.decide(128).reason == "slo_tpot_unmet"
    c.report("d0", step_s_ewma=1.24, decode_s_ewma=0.02, num_running=8)
    d = c.decide(128)
    assert d.path != "none" and d.predicted_tpot_s < 0.05
    # The prompts the router did send there still count: queued work spread over the horizon.
    for i in range(12):
        c.ledgers["d0"].add_prefill(f"q{i}", 0.5, c.now)
    assert c.decide(128).reason == "slo_tpot_unmet"


def test_a_decode_workers_recent_prefill_counts_at_its_rate_over_ten_seconds():
    """The prefill a decode worker did lately stands for what will come over a new request's
    life: its rate over the last 10 s (not over the life alone, which read a burst of short
    prompts as the rate to come), times the life (64 steps)."""
    c = Cluster()
    idle = c.decide(128).predicted_tpot_s
    ledger = c.ledgers["d0"]
    for i in range(8):  # 2 s of prompts computed here, 5 to 3 s ago
        ledger.add_prefill(f"p{i}", 0.25, c.now - 5.0 + i * 0.25)
        ledger.prefill_done(f"p{i}", c.now - 5.0 + (i + 1) * 0.25, measured=False)
    step = c.costs.costs("d0").decode_step_s(1, 128)
    life = 64 * step
    assert c.decide(128).predicted_tpot_s == pytest.approx(idle + 2.0 * life / 10.0 / 64)
    c.now += 10.0  # out of the window
    assert c.decide(128).predicted_tpot_s == pytest.approx(idle)


def test_requests_sent_since_the_last_report_count_on_top_of_the_measured_step():
    """A burst is not admitted on one stale measurement: the step measured with 4 running,
    plus the model's cost of every sequence sent since."""
    c = Cluster()
    c.report("d0", step_s_ewma=0.03, num_running=4)
    for i in range(4):
        c.ledgers["d0"].start(f"r{i}", 128)
    assert c.decide(128).predicted_tpot_s == pytest.approx(0.03 + 1e-3, abs=2e-3)
    admitted = 0
    while c.decide(128).path != "none" and admitted < 200:
        d = c.decide(128)
        c.run(d, f"burst-{admitted}")
        admitted += 1
    # 30 ms + 1 ms per sequence sent since (and the prefills queued, spread over 64 steps)
    # reaches 90 ms (the 100 ms target less the margin) well before 60 more.
    assert 20 <= admitted < 60


def test_ledger_queue_shifts_with_measured_first_tokens():
    c = Cluster()
    lp = c.ledgers["p0"]
    lp.add_prefill("a", 1.0, c.now)
    lp.add_prefill("b", 1.0, c.now)
    assert lp.backlog_s(c.now) == pytest.approx(2.0)
    # "a" took 1.5 s, not 1: "b" is now predicted to end 0.5 s later too.
    c.now += 1.5
    lp.prefill_done("a", c.now)
    assert lp.backlog_s(c.now) == pytest.approx(1.0)
    # "b" is cancelled before it ran: the queue is empty again.
    lp.finish("b", c.now)
    assert lp.backlog_s(c.now) == 0.0 and not lp.prefills
    # Prefill work done lately still counts against a decode worker's TPOT.
    assert lp.recent_prefill_s(c.now, 10.0) == pytest.approx(1.0)
    assert lp.recent_prefill_s(c.now + 20, 10.0) == 0.0


def test_recent_prefill_seconds_match_the_plain_sum_over_minutes_of_traffic():
    """The window sum is a lookup over running totals that are trimmed and rebased as entries
    age past a minute: over 5 simulated minutes at ~200 prefills a second it equals the sum
    over every prefill done in the window, for short and long windows."""
    from pd_runtime.router.ledger import _RECENT_S, WorkerLedger

    rng = random.Random(3)
    ledger, done, now = WorkerLedger(), [], 1000.0
    for i in range(60000):
        now += rng.expovariate(200.0)
        seconds = rng.uniform(0.001, 0.05)
        ledger.add_prefill(str(i), seconds, now)
        ledger.prefill_done(str(i), now)
        done.append((now, seconds))
        if i % 997 == 0:
            for window in (0.01, 0.5, 7.0, 45.0, 300.0):
                expected = sum(s for t, s in done if t >= now - min(window, _RECENT_S)
                               and t >= now - _RECENT_S)
                assert ledger.recent_prefill_s(now, window) == pytest.approx(expected, rel=1e-9)
    assert len(ledger.done_at) < 2 * 200 * _RECENT_S  # what is older is dropped


def test_predictions_learn_what_the_cost_model_misses():
    # The prefill worker runs 2x slower than its cost model says (a busy neighbour): its
    # measured first tokens raise its predictions until they match.
    c = Cluster()
    before = c.decide(2048).predicted_ttft_s
    true_s = 2 * c.costs.costs("p0").prefill_s(2048)  # what each prefill really takes
    for i in range(40):
        d = c.decide(2048, target=SLOTarget(ttft_s=100, tpot_s=1))
        lp = c.ledgers[d.prefill_worker or d.decode_worker]
        lp.add_prefill(f"r{i}", d.prefill_s, c.now)
        c.now += true_s
        lp.prefill_done(f"r{i}", c.now)
    assert c.ledgers["p0"].current_slowdown(c.now) == pytest.approx(2.0, rel=0.1)
    options = {o.path: o for o in slo_options(2048, 64, c.decode, c.prefill, {}, c.costs,
                                              c.ledgers, c.now, SLOTarget())}
    assert options["disaggregated"].ttft_s == pytest.approx(2 * before, rel=0.1)
    # Unmeasured for a while (chosen less because predicted slow), it drifts back toward 1.
    assert c.ledgers["p0"].current_slowdown(c.now + 60) == pytest.approx(1.25, rel=0.1)


def test_slo_targets_tenant_then_class_then_default():
    cfg = RoutingConfig(slo=SLOTarget(ttft_s=2.5, tpot_s=0.1),
                        slo_classes=[SLOClass(name="long", min_prompt_tokens=1024, ttft_s=6,
                                              tpot_s=0.1),
                                     SLOClass(name="huge", min_prompt_tokens=8192, ttft_s=20,
                                              tpot_s=0.2)],
                        tenant_slos={"gold": SLOTarget(ttft_s=1.0, tpot_s=0.05)})
    assert slo_target(cfg, None, 100).ttft_s == 2.5
    assert slo_target(cfg, None, 2000).ttft_s == 6
    assert slo_target(cfg, None, 9000).ttft_s == 20
    assert slo_target(cfg, "gold", 9000).ttft_s == 1.0


def test_targets_reload_live_and_bad_edits_name_the_field(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("router:\n  routing:\n    slo: {ttft_s: 2.5, tpot_s: 0.1}\n")
    reloader = RoutingReloader(str(path), load_routing_config(str(path)), interval_s=0.05)
    c = Cluster()
    for i in range(8):  # ~1.7 s queued on each worker
        c.ledgers["p0"].add_prefill(f"p{i}", 0.21, c.now)
        c.ledgers["d0"].add_prefill(f"d{i}", 0.21, c.now)
    assert c.decide(2048, target=slo_target(reloader.current, None, 2048)).path != "none"
    path.write_text("router:\n  routing:\n    slo: {ttft_s: 1.0, tpot_s: 0.1}\n"
                    "    overload: queue\n")
    assert reloader.check(force=True)
    assert reloader.current.overload == "queue"
    assert c.decide(2048, target=slo_target(reloader.current, None, 2048)).path == "none"
    path.write_text("router:\n  routing:\n    slo: {ttft_s: -1, tpot_s: 0.1}\n")
    assert not reloader.check(force=True)
    assert "router.routing.slo.ttft_s" in reloader.last_error
    assert reloader.current.slo.ttft_s == 1.0
    path.write_text("router:\n  routing:\n    overload: wait\n")
    with pytest.raises(ConfigError, match="router.routing.overload"):
        load_routing_config(str(path))


def test_step_cost_model_recovers_coefficients_and_follows_a_slowdown():
    rng = random.Random(0)
    truth = dict(step_s=0.004, prefill_token_s=1.5e-4, prefill_attention_s=2e-9,
                 decode_seq_s=8e-4, decode_context_s=1e-7)

    def seconds(w, scale=1.0):
        return scale * (truth["step_s"] + w.prefill_tokens * truth["prefill_token_s"]
                        + w.prefill_attention * truth["prefill_attention_s"]
                        + w.decode_seqs * truth["decode_seq_s"]
                        + w.decode_context * truth["decode_context_s"])

    def random_step():
        n, start = rng.choice([0, 0, 64, 512, 2048]), rng.randrange(0, 1024)
        seqs = rng.randrange(0 if n else 1, 48)
        return StepWork(n, n * start + n * (n + 1) // 2, seqs,
                        sum(rng.randrange(100, 2500) for _ in range(seqs)))

    model = StepCostModel()
    for _ in range(600):
        w = random_step()
        model.observe(w, seconds(w) * rng.uniform(0.97, 1.03))
    fitted = model.coefficients()
    # Context and sequences of a decode batch move together (their sum is what is identified),
    # and the attention term is a few ms under 3% noise: predictions are checked for those.
    for name in ("step_s", "prefill_token_s"):
        assert fitted[name] == pytest.approx(truth[name], rel=0.25), name
    probes = [StepWork(2048, 2048 * 2049 // 2, 16, 16 * 1500), StepWork(0, 0, 32, 32 * 1300),
              StepWork(128, 128 * 129 // 2, 1, 700), StepWork(0, 0, 4, 4 * 2000)]
    for probe in probes:
        assert model.predict(probe) == pytest.approx(seconds(probe), rel=0.05)
    probe = probes[0]
    # The machine gets 2x slower (a noisy neighbour): within a few hundred steps, so does the model.
    for _ in range(1000):
        w = random_step()
        model.observe(w, seconds(w, 2.0))
    assert model.predict(probe) == pytest.approx(seconds(probe, 2.0), rel=0.1)
    report = model.report()
    assert report["steps"] == 1600 and sum(report["step_counts"]) == 1600


def test_step_cost_model_shrugs_off_a_lone_outlier():
    model = StepCostModel()
    work = [StepWork(512, 512 * 513 // 2, 4, 4000), StepWork(0, 0, 8, 8000)]
    for i in range(400):
        w = work[i % 2]
        model.observe(w, 0.002 + 2e-4 * w.prefill_tokens + 1e-3 * w.decode_seqs)
    before = model.predict(work[0])
    model.observe(work[0], 30.0)  # one step stalled for 30 s (a stopped process, a swap storm)
    assert model.predict(work[0]) == pytest.approx(before, rel=0.25)


def test_step_cost_model_stays_sane_on_a_worker_that_only_decodes():
    model = StepCostModel()
    for i in range(20000):  # never a prefill: that direction must not wind up
        model.observe(StepWork(0, 0, 8 + i % 8, 8000), 0.01 + 0.001 * (i % 8))
    c = model.coefficients()
    assert 0 < c["prefill_token_s"] < 1e-3 and c["decode_seq_s"] == pytest.approx(1e-3, rel=0.2)


def test_without_a_prefill_worker_long_prompts_still_run_on_a_busy_decode_worker():
    """The rule that keeps long prefills off a decode worker's streams needs somewhere else to
    send them: with no prefill worker up they run there (never refused for ever)."""
    c = Cluster(prefill=())
    c.ledgers["d0"].start("running", 300)
    d = c.decide(2048)
    assert (d.path, d.decode_worker) == ("colocated", "d0")
    huge = c.decide(10_000, target=SLOTarget(ttft_s=1.0, tpot_s=0.1))
    assert (huge.path, huge.reason) == ("colocated", "slo_best_effort")


def test_a_first_token_delayed_by_a_lost_decode_worker_does_not_teach_the_prefill_worker():
    """A disaggregated request whose decode worker died before its first token comes back
    late (migrated, or prefilled by the decode worker after all): the prefill worker was not
    slow, so its queue and its learned slowdown stay as they were; a measured late one
    teaches both."""
    c = Cluster()
    c.ledgers["p0"].add_prefill("a", 0.4, c.now)
    c.ledgers["p0"].add_prefill("b", 0.4, c.now)
    c.ledgers["p0"].prefill_done("a", c.now + 10.0, measured=False)
    ledger = c.ledgers["p0"]
    assert ledger.current_slowdown(c.now + 10.0) == 1.0
    assert ledger.prefills["b"].finish_at == pytest.approx(c.now + 0.8)
    c.ledgers["p0"].add_prefill("c", 0.4, c.now)
    c.ledgers["p0"].prefill_done("c", c.now + 10.0)  # measured: 10 s against ~1.2 s
    assert ledger.current_slowdown(c.now + 10.0) > 1.4


def test_the_wait_a_paced_decode_worker_pays_per_step_is_added_to_its_steps():
    """A worker whose steps wait for the prefill workers beside it (pace_wait_s in its load
    report: the wait per step lately, workers/engine_loop.py) is predicted that much slower a
    step, on both paths, idle or busy; the interval it may pace to is not a floor (while the
    prefill workers are idle its steps run back to back)."""
    c = Cluster()
    base = {o.path: o.tpot_s for o in slo_options(100, 64, c.decode, c.prefill, {}, c.costs,
                                                  c.ledgers, c.now, SLOTarget())}
    assert base["colocated"] < 0.01
    c.report("d0", min_step_interval_s=0.08, pace_wait_s=0.03)
    paced = {o.path: o.tpot_s for o in slo_options(100, 64, c.decode, c.prefill, {}, c.costs,
                                                   c.ledgers, c.now, SLOTarget())}
    for path in ("colocated", "disaggregated"):
        assert paced[path] == pytest.approx(base[path] + 0.03)
    for i in range(4):
        c.ledgers["d0"].start(f"r{i}", 128)
    c.report("d0", step_s_ewma=0.02, decode_s_ewma=0.02, num_running=4,
             min_step_interval_s=0.08, pace_wait_s=0.03)
    assert c.decide(128).predicted_tpot_s == pytest.approx(0.02 + 1e-3 + 0.03, abs=2e-3)


def test_a_sequence_more_costs_no_more_than_the_measured_steps_average_a_sequence():
    """A busy worker's next request is predicted from its measured step plus, for each
    sequence the router sent since its report and this one, the fit's cost a sequence, but no
    more than the measured step's average a sequence: on a shared CPU the fit's split between
    fixed and per-sequence cost drifts (7 ms a sequence fitted where 12 sequences took 36 ms
    a step)."""
    c = Cluster(d0=dict(FAST, decode_seq_s=0.007))
    for i in range(16):
        c.ledgers["d0"].start(f"r{i}", 128)
    c.report("d0", coefficients=dict(FAST, decode_seq_s=0.007), step_s_ewma=0.036,
             decode_s_ewma=0.036, num_running=12)
    tpot = {o.path: o.tpot_s for o in slo_options(100, 64, c.decode, c.prefill, {}, c.costs,
                                                  c.ledgers, c.now, SLOTarget())}
    # 36 ms + 5 sequences at 3 ms (36 / 12), not at 7 ms; plus the transfer's share.
    assert tpot["disaggregated"] == pytest.approx(0.036 + 5 * 0.003, abs=1e-3)
    # A fit below the average is taken as it is.
    c.report("d0", coefficients=dict(FAST, decode_seq_s=0.001), step_s_ewma=0.036,
             decode_s_ewma=0.036, num_running=12)
    tpot = {o.path: o.tpot_s for o in slo_options(100, 64, c.decode, c.prefill, {}, c.costs,
                                                  c.ledgers, c.now, SLOTarget())}
    assert tpot["disaggregated"] == pytest.approx(0.036 + 5 * 0.001, abs=1e-3)


def test_a_prefix_another_decode_worker_holds_is_fetched_when_recomputing_misses():
    """Two decode workers, no prefill pool: d0 holds 1,984 of a 2,000-token prompt, but its
    40 streams' steps take 120 ms (a stream more there misses the TPOT target); recomputing
    on the idle d1 takes ~3 s (misses TTFT). So d1 fetches: d0 computes the last 16 tokens
    and ships the KV. Without the prefix on d0, no fetch."""
    c = Cluster(decode=("d0", "d1"), prefill=(),
                d1=dict(FAST, prefill_token_s=1.5e-3))  # d1: ~3 s for 2,000 tokens
    for i in range(40):
        c.ledgers["d0"].start(f"running-{i}", 500)
    c.report("d0", decode_s_ewma=0.12, step_s_ewma=0.12, num_running=40)
    d = c.decide(2000, hits={"d0": 1984})
    assert (d.path, d.decode_worker, d.prefill_worker) == ("disaggregated", "d1", "d0")
    assert d.reason == "slo_fetch_fallback" and d.prefill_s == pytest.approx(0.005 + 16 * 2e-4,
                                                                           rel=0.3)
    options = slo_options(2000, 64, c.decode, c.prefill, {"d0": 1984}, c.costs, c.ledgers,
                          c.now, SLOTarget())
    assert [(o.decode_worker, o.prefill_worker) for o in options if o.fetch] == [("d1", "d0")]
    # A peer that would compute more than max_local_prefill_tokens (its streams would wait
    # for it, as for a long colocated prompt) is no fetch source; nor one with no more of the
    # prompt than the worker itself.
    assert not any(o.fetch for o in slo_options(2000, 64, c.decode, c.prefill, {"d0": 1000},
                                                c.costs, c.ledgers, c.now, SLOTarget()))
    assert not any(o.fetch for o in slo_options(2000, 64, c.decode, c.prefill,
                                                {"d0": 32, "d1": 0}, c.costs, c.ledgers, c.now,
                                                SLOTarget()))


def test_a_hit_a_lower_tier_holds_costs_its_load_time():
    """Blocks that only host memory or disk holds count as hits, at the per-block time the
    worker measured loading them back (the router's exact index says which tier)."""
    from pd_runtime.router.prefix_index import PrefixIndex

    c = Cluster()
    c.costs.update("d0", report(kv_tiers={"host": {"hit_blocks": 100, "load_s": 0.01},
                                          "disk": {"hit_blocks": 10, "load_s": 0.001,
                                                   "read_s": 0.009}}))
    assert c.costs.costs("d0").tier_block_s == pytest.approx({"host": 1e-4, "disk": 1e-3})
    index = PrefixIndex("m", 16)
    prompt = list(range(5, 5 + 130))
    hashes = index.hashes(prompt, None)
    # d0 holds blocks 0-3 on the device, 4-5 in host memory only, 6-7 on disk only.
    tiers = [["device"]] * 4 + [["host"]] * 2 + [["disk", "host"]] + [["disk"]]
    index.apply("d0", {"epoch": "e", "seq": 1, "snapshot": list(zip(hashes[:8], tiers))})
    hits = {"d0": index.expected_hit_tokens("d0", hashes, len(prompt))}
    assert hits == {"d0": 128}
    load = index.tier_load_s(hashes, hits, lambda w: c.costs.costs(w).tier_block_s)
    assert load == {"d0": pytest.approx(3 * 1e-4 + 1e-3)}
    plain = {o.path: o for o in slo_options(130, 64, c.decode, c.prefill, hits, c.costs,
                                            c.ledgers, c.now, SLOTarget())}
    tiered = {o.path: o for o in slo_options(130, 64, c.decode, c.prefill, hits, c.costs,
                                             c.ledgers, c.now, SLOTarget(), load)}
    assert tiered["colocated"].prefill_s == pytest.approx(plain["colocated"].prefill_s
                                                          + load["d0"])
