"""Per-request routing: colocated or disaggregated, and which workers, from live settings.

Mode `slo` (decide_slo): every option (colocated on each decode worker; each prefill worker
with each decode worker) gets a predicted TTFT (the worker's prefill queue + this prefill, from
the live cost model) and a predicted TPOT (the decode part of the decode worker's measured step
lately, or the model's when it is idle, with one more sequence, plus the wait its steps pay
lately for the prefill workers beside it; plus the prefill routed there, queued and done lately, and this one's,
spread over the request's output horizon, plus the KV transfer spread the same way; what its
running requests will see too). Among the options that meet the request's targets, those of its
usual path (disaggregated when the uncached prompt exceeds max_local_prefill_tokens, else
colocated) come first, the other path only when none of them does; they compete on headroom,
ttft/target + tpot/target + the TPOT they add to the decode worker's running requests (summed
over them)/target, lowest wins. When none meets them the request is refused (or held,
`overload: queue`) with a Retry-After from the predicted excess.

Mode `auto` (decide): uncached = prompt tokens - best expected prefix hit on a decode worker;
disaggregate when uncached > max_local_prefill_tokens and the prefill pool's queued tokens are
under max_prefill_queue_tokens, or always / never by mode. Worker choice: lowest cost (see
DecodeCostWeights / PrefillCostWeights), ties broken at random. Unhealthy or draining workers
are never chosen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

from pd_runtime.config import RoutingConfig, SLOTarget
from pd_runtime.router.cost_model import CostModel
from pd_runtime.router.ledger import Ledgers


@dataclass(slots=True)
class WorkerState:
    worker_id: str
    role: str
    healthy: bool = True
    draining: bool = False
    load: dict = field(default_factory=dict)
    inflight: int = 0  # routed by us since the last load report arrived
    # (load, busy, max_num_seqs, free-block share) of the load report it was read from: a
    # state kept across decisions (the planner's simulator, thousands per report) reads its
    # report once. A new report is a new dict; one changed in place is not seen here.
    shares: Optional[tuple] = None

    @property
    def available(self) -> bool:
        return self.healthy and not self.draining


@dataclass
class Decision:
    path: str                     # colocated | disaggregated
    reason: str                   # why; a metric label
    decode_worker: Optional[str]
    prefill_worker: Optional[str]
    prompt_tokens: int
    expected_hit_tokens: int
    predicted_ttft_s: Optional[float] = None   # slo mode: of the chosen (or best) option
    predicted_tpot_s: Optional[float] = None
    prefill_s: float = 0.0                     # slo mode: predicted compute of this prefill
    retry_after_s: Optional[float] = None      # slo mode, refused: when to try again
    refusal: Optional[str] = None              # slo mode, refused: why, for the client


def _fraction(num: float, den: float) -> float:
    if den <= 0:
        return 0.0
    x = num / den
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


# Per-request, per-worker: the router's hot loop (and the planner's simulator's, which runs it
# for every simulated request over pools of hundreds), written as one loop each with the
# shares clamped inline, so a worker costs well under a microsecond, not calls per field.
def decode_costs(workers: list[WorkerState], hits: dict[str, int], prompt_len: int,
                 cfg: RoutingConfig) -> dict[str, float]:
    """Available decode workers -> cost: busy share, minus free-block share, minus expected
    prefix-hit share, each weighted (DecodeCostWeights); every share clamped to [0, 1]."""
    weights = cfg.decode_cost
    w_running, w_free, w_overlap = (weights.weight_running, weights.weight_free_blocks,
                                    weights.weight_prefix_overlap)
    out = {}
    for w in workers:
        if not w.healthy or w.draining:
            continue
        shares = w.shares
        if shares is None or shares[0] is not w.load:
            shares = w.shares = _decode_shares(w.load)
        _, busy, cap, free = shares
        busy += w.inflight
        running = 0.0 if cap <= 0 or busy <= 0 else 1.0 if busy >= cap else busy / cap
        cost = running * w_running - free * w_free
        if hits:
            cost -= _fraction(hits.get(w.worker_id, 0), prompt_len) * w_overlap
        out[w.worker_id] = cost
    return out


def _decode_shares(load: dict) -> tuple:
    free, total = load.get("free_blocks", 1), load.get("total_blocks", 1)
    return (load, load.get("num_running", 0) + load.get("num_waiting", 0),
            load.get("max_num_seqs", 128), _fraction(free, total))


def prefill_costs(workers: list[WorkerState], hits: dict[str, int], prompt_len: int,
                  cfg: RoutingConfig) -> tuple[dict[str, float], int]:
    """Available prefill workers -> cost (queued prompt tokens share minus expected hit share,
    PrefillCostWeights), and the tokens queued over all of them."""
    weights = cfg.prefill_cost
    w_queued, w_overlap = weights.weight_queued_tokens, weights.weight_prefix_overlap
    limit = max(1, cfg.max_prefill_queue_tokens)
    out, total = {}, 0
    for w in workers:
        if not w.healthy or w.draining:
            continue
        queued = w.load.get("queued_prefill_tokens", 0) + w.inflight * prompt_len
        total += queued
        cost = 0.0 if queued <= 0 else w_queued if queued >= limit else queued / limit * w_queued
        if hits:
            cost -= _fraction(hits.get(w.worker_id, 0), prompt_len) * w_overlap
        out[w.worker_id] = cost
    return out, total


def _cheapest(costs: dict[str, float], rng: random.Random) -> Optional[str]:
    if not costs:
        return None
    best = min(costs.values()) + 1e-9
    ties = [w for w, c in costs.items() if c <= best]
    return ties[0] if len(ties) == 1 else rng.choice(sorted(ties))


def decide(prompt_len: int, decode: list[WorkerState], prefill: list[WorkerState],
           hits: dict[str, int], cfg: RoutingConfig, rng: random.Random) -> Decision:
    """hits: worker id -> expected cached prompt tokens there."""
    d = _cheapest(decode_costs(decode, hits, prompt_len, cfg), rng)
    best_hit = hits.get(d, 0) if d else 0
    p_costs, queued = prefill_costs(prefill, hits, prompt_len, cfg)

    def make(path, reason, p=None):
        return Decision(path, reason, d, p, prompt_len, best_hit)

    if d is None:
        return make("none", "no_decode_worker")
    if cfg.mode == "always_colocated":
        return make("colocated", "mode_always_colocated")
    if not p_costs:
        return make("colocated", "no_prefill_worker")
    p = _cheapest(p_costs, rng)
    if cfg.mode == "always_disaggregated":
        return make("disaggregated", "mode_always_disaggregated", p)
    uncached = prompt_len - best_hit
    if uncached <= cfg.max_local_prefill_tokens:
        reason = "short_prompt" if prompt_len <= cfg.max_local_prefill_tokens else "prefix_cached"
        return make("colocated", reason)
    if queued >= cfg.max_prefill_queue_tokens:
        return make("colocated", "prefill_saturated")
    return make("disaggregated", "long_prompt", p)


# ------------------------------------------------------------------------------ SLO mode
def slo_target(cfg: RoutingConfig, tenant_id: Optional[str], prompt_len: int) -> SLOTarget:
    """The tenant's targets, else the largest prompt-length class the prompt reaches, else the
    deployment's."""
    if tenant_id is not None and tenant_id in cfg.tenant_slos:
        return cfg.tenant_slos[tenant_id]
    reached = [c for c in cfg.slo_classes if prompt_len >= c.min_prompt_tokens]
    if reached:
        c = max(reached, key=lambda c: c.min_prompt_tokens)
        return SLOTarget(ttft_s=c.ttft_s, tpot_s=c.tpot_s)
    return cfg.slo


@dataclass
class Option:
    path: str
    decode_worker: str
    prefill_worker: Optional[str]
    ttft_s: float
    tpot_s: float
    prefill_s: float  # compute of this prefill, on the worker that runs it
    hit_tokens: int
    backlog_s: float = 0.0   # prefill queued ahead of it on the worker that runs its prefill
    queued: int = 0          # prefills pending there (some may be overdue: backlog_s 0)
    idle_meets: bool = True  # whether it would meet the targets with every queue empty
    harm_s: float = 0.0      # TPOT it adds to the decode worker's running requests, summed
    fetch: bool = False      # its prefill worker is another decode worker holding the prefix

    def waits_at_most_its_own(self) -> bool:
        """Queued prefill ahead of it no more than its own (one request's worth)."""
        return self.backlog_s <= self.prefill_s + 1e-3

    def meets(self, target: SLOTarget) -> bool:
        return self.ttft_s <= target.ttft_s and self.tpot_s <= target.tpot_s

    def pressure(self, target: SLOTarget) -> float:
        """Headroom used: its own TTFT and TPOT against the targets, plus the TPOT it adds to
        every request already running on its decode worker (harm_s, summed over them)."""
        return (self.ttft_s / target.ttft_s + self.tpot_s / target.tpot_s
                + self.harm_s / target.tpot_s)


FETCH_MIN_TOKENS = 64  # a peer's longer cached prefix worth fetching rather than computing
_RATE_WINDOW_S = 10.0  # the shortest window a decode worker's prefill rate is measured over


def _horizon(max_tokens: int) -> int:
    """The decode steps over which a request's share of prefill work is spread: its length."""
    return min(512, max(16, max_tokens))


def slo_options(prompt_len: int, max_tokens: int, decode: list[WorkerState],
                prefill: list[WorkerState], hits: dict[str, int], costs: CostModel,
                ledgers: Ledgers, now: float, target: SLOTarget,
                tier_s: Optional[dict[str, float]] = None,
                max_peer_tokens: int = 256) -> list[Option]:
    """Every way to serve the request on the available workers, with its predictions.
    `tier_s`: worker id -> seconds to load the part of its hit that a lower tier holds;
    `max_peer_tokens`: the most a peer decode worker computes for a fetch (its own streams
    wait for it, as for a colocated prompt: routing.max_local_prefill_tokens)."""
    horizon = _horizon(max_tokens)
    tier_s = tier_s or {}
    options = []
    for d in (w for w in decode if w.available):
        cd, ld = costs.costs(d.worker_id), ledgers[d.worker_id]
        batch, context = len(ld.running), ld.context_tokens
        backlog = ld.backlog_s(now)
        one_more = cd.decode_step_s(batch + 1, context + prompt_len) \
            - cd.decode_step_s(batch, context)
        if batch and (cd.decode_s_ewma or cd.step_s_ewma) > 0:
            # Busy: the decode part of its measured step lately, plus what the requests sent
            # since its last report and this one add to it. (Without the requests sent since, a
            # burst was admitted on one stale measurement: at 12 req/s, 30 requests in 1.8 s,
            # whose TPOT then reached 90-130 ms against a 100 ms target.) The decode part only:
            # a recovering worker's steps carry its migrated streams' prompts, computed before
            # a new request's (measured: a step average of 1.24 s after a decode worker's
            # restart refused every request for seconds, where ~50 ms steps followed).
            # Each sequence more costs what the fit says, but no more than the measured step's
            # average a sequence (its fixed share included): on a shared CPU the fit's split
            # between fixed and per-sequence cost drifts (measured: 6-8 ms a sequence fitted,
            # steps of 37 ms for 12; 512-token prompts at 4 req/s refused at 95-110 ms
            # predicted where they saw 52-74 ms).
            measured = max(1, min(batch, int(d.load.get("num_running", batch))))
            decode_s = cd.decode_s_ewma or cd.step_s_ewma
            per_seq = min(cd.decode_seq_s, decode_s / measured)
            step = decode_s + (batch + 1 - measured) * per_seq \
                + (context + prompt_len - context * measured // batch) * cd.decode_context_s
        else:
            step = cd.decode_step_s(batch + 1, context + prompt_len)  # idle: the model
        step += cd.pace_wait_s  # its steps wait for the prefill workers beside it (engine_loop.py)
        # The prompts routed here: what is queued, and as much again as came lately over the
        # request's life (the rate over at least _RATE_WINDOW_S: over the life alone, a burst
        # of short prompts read as the rate to come refused requests that then saw 20-50 ms
        # against 80-107 ms predicted).
        life = horizon * step
        window = max(life, _RATE_WINDOW_S)
        shared = backlog + ld.recent_prefill_s(now, window) * (life / window)
        hit_d = hits.get(d.worker_id, 0)
        own = cd.prefill_s(prompt_len - hit_d, hit_d) * ld.current_slowdown(now) \
            + tier_s.get(d.worker_id, 0.0)
        chunks = -(-(prompt_len - hit_d) // max(1, cd.max_batched_tokens))
        # Colocated: behind the queue, chunks interleaved with the running decodes.
        idle_step = cd.decode_step_s(1, prompt_len)
        options.append(Option("colocated", d.worker_id, None,
                              ttft_s=backlog + own + chunks * (step - cd.step_s) + costs.rpc_s,
                              tpot_s=step + (shared + own) / horizon, prefill_s=own,
                              hit_tokens=hit_d, backlog_s=backlog, queued=len(ld.prefills),
                              idle_meets=own + costs.rpc_s <= target.ttft_s
                              and idle_step + own / horizon <= target.tpot_s,
                              harm_s=batch * (one_more + own / horizon)))
        # A prefill worker, or a fetch: another decode worker holding at least FETCH_MIN_TOKENS
        # more of the prompt computes the rest and ships the KV (bench/kv_fetch.py: faster
        # than recomputing from 64 tokens on, on the 2-core box).
        peers = [w for w in decode if w.available and w is not d
                 and hits.get(w.worker_id, 0) >= hit_d + FETCH_MIN_TOKENS
                 and prompt_len - hits.get(w.worker_id, 0) <= max_peer_tokens]
        for p in [w for w in prefill if w.available] + peers:
            cp, lp = costs.costs(p.worker_id), ledgers[p.worker_id]
            hit_p = hits.get(p.worker_id, 0)
            prefill_s = cp.prefill_s(prompt_len - hit_p, hit_p) * lp.current_slowdown(now) \
                + tier_s.get(p.worker_id, 0.0)
            transfer = costs.transfer_s(p.worker_id, prompt_len - hit_d)
            options.append(Option("disaggregated", d.worker_id, p.worker_id,
                                  ttft_s=lp.backlog_s(now) + prefill_s + 2 * costs.rpc_s,
                                  tpot_s=step + (shared + transfer) / horizon,
                                  prefill_s=prefill_s, hit_tokens=hit_p,
                                  backlog_s=lp.backlog_s(now), queued=len(lp.prefills),
                                  idle_meets=prefill_s + 2 * costs.rpc_s <= target.ttft_s
                                  and idle_step + transfer / horizon <= target.tpot_s,
                                  harm_s=batch * one_more, fetch=p in peers))
    return options


def decide_slo(prompt_len: int, max_tokens: int, decode: list[WorkerState],
               prefill: list[WorkerState], hits: dict[str, int], cfg: RoutingConfig,
               target: SLOTarget, costs: CostModel, ledgers: Ledgers, now: float,
               rng: random.Random, waited_s: float = 0.0,
               tier_s: Optional[dict[str, float]] = None) -> Decision:
    """waited_s: how long the request has been held at the router already (overload: queue);
    it counts against its TTFT target. Options are admitted against the targets times
    cfg.slo_margin (predictions are of the load now; what arrives later slows them too);
    whether a request could be served in time at all is judged against the targets."""
    full = SLOTarget(ttft_s=max(1e-3, target.ttft_s - waited_s), tpot_s=target.tpot_s)
    target = SLOTarget(ttft_s=max(1e-3, target.ttft_s * cfg.slo_margin - waited_s),
                       tpot_s=target.tpot_s * cfg.slo_margin)
    options = slo_options(prompt_len, max_tokens, decode, prefill, hits, costs, ledgers, now,
                          full, tier_s, cfg.max_local_prefill_tokens)
    if not options:
        return Decision("none", "no_decode_worker", None, None, prompt_len, 0)
    met = [o for o in options if o.meets(target)]
    # Each path does what it is for while it can: uncached prompts longer than
    # max_local_prefill_tokens to a prefill worker, shorter ones on the decode worker; the other
    # path when the usual one cannot meet the targets. A long prefill falls back to a decode
    # worker only where no stream runs (or where no prefill worker is up to take it): the stall
    # would land on every one of them and on every request arriving meanwhile (measured: at
    # saturation such fallbacks pushed the decode worker's TPOT p50 from ~40 to ~100 ms and cut
    # goodput by half).
    def long(o: Option) -> bool:
        return prompt_len - o.hit_tokens > cfg.max_local_prefill_tokens

    prefill_up = any(o.path == "disaggregated" and not o.fetch for o in options)

    def spares_streams(o: Option) -> bool:
        return o.path == "disaggregated" or not long(o) or o.harm_s == 0.0 or not prefill_up

    usual = [o for o in met if (o.path == "disaggregated") == long(o)]
    fallback = [o for o in met if spares_streams(o)]
    if usual or fallback:
        best = min(usual or fallback, key=lambda o: (o.pressure(target), rng.random()))
        reason = "slo_" + ("local" if best.path == "colocated" else
                           "fetch" if best.fetch else "remote") \
            + ("" if usual else "_fallback")
        return Decision(best.path, reason, best.decode_worker, best.prefill_worker, prompt_len,
                        hits.get(best.decode_worker, 0), best.ttft_s, best.tpot_s,
                        best.prefill_s)
    # Late, not refused: an option that misses only the TTFT target (less the margin), behind
    # no more queued prefill than its own (one request's worth: the machine has headroom; a
    # saturated worker's queue is longer) or predicted within the target itself, without
    # stalling a decode worker's streams. A client loses less to a first token a little late
    # than to a 429 (measured on the 2-core box at 2 req/s: the long prompts refused there were
    # predicted 2.3-3.0 s against 2.5 s).
    late = [o for o in options if spares_streams(o) and o.tpot_s <= target.tpot_s
            and (o.waits_at_most_its_own() or o.ttft_s <= full.ttft_s) and o.idle_meets]
    if late:
        best = min(late, key=lambda o: (o.ttft_s, rng.random()))
        return Decision(best.path, "slo_late", best.decode_worker, best.prefill_worker,
                        prompt_len, hits.get(best.decode_worker, 0), best.ttft_s, best.tpot_s,
                        best.prefill_s)
    # No worker that may take it could meet these targets even idle (a prompt too long for
    # this TTFT on this hardware; or a long one whose only idle fit is a decode worker with
    # streams): waiting would not help, so refusing would refuse it for ever. Serve it late
    # where the wait is bounded: on a worker whose queued prefill is no more than its own
    # (TTFT at most twice the idle one), and a long one not on a decode worker's streams
    # (measured at 8 req/s: one such 2048-token prefill there pushed every short request's
    # TPOT to 140-190 ms).
    never = not any(o.idle_meets for o in options if spares_streams(o))
    if never:
        free = [o for o in options if o.waits_at_most_its_own() and spares_streams(o)]
        if free:
            best = min(free, key=lambda o: (o.pressure(target), rng.random()))
            return Decision(best.path, "slo_best_effort", best.decode_worker,
                            best.prefill_worker, prompt_len, hits.get(best.decode_worker, 0),
                            best.ttft_s, best.tpot_s, best.prefill_s)
    # None meets the targets: say when one would, from the option closest to meeting them.
    def wait(o: Option) -> float:
        late_ttft = max(0.0, o.ttft_s - target.ttft_s)
        # Over on TPOT: its running requests must thin out; they need about their horizon.
        late_tpot = 0.0 if o.tpot_s <= target.tpot_s else \
            (o.tpot_s / target.tpot_s - 1.0) * _horizon(max_tokens) * target.tpot_s
        return late_ttft + late_tpot

    best = min(options, key=wait)
    reason = "slo_would_stall" if met else \
        "slo_ttft_unmet" if best.ttft_s > target.ttft_s else "slo_tpot_unmet"
    retry = wait(best)
    if met:  # would stall the decode worker's streams: when the prefill worker catches up
        best = min((o for o in options if o.path == "disaggregated"), key=lambda o: o.ttft_s)
        retry = max(0.0, best.ttft_s - target.ttft_s)
    if never:  # served once a worker's queue is down to its own prefill
        retry = min((o.backlog_s - o.prefill_s for o in options if spares_streams(o)),
                    default=1.0)
    return Decision("none", reason, None, None, prompt_len, 0, best.ttft_s, best.tpot_s,
                    best.prefill_s, retry_after_s=min(60.0, max(0.5, retry)),
                    refusal=_refusal(reason, best, prompt_len, target, cfg.slo_margin,
                                     not never))


def _refusal(reason: str, best: Option, prompt_len: int, admit: SLOTarget, margin: float,
             idle_meets: bool) -> str:
    """What a refused client is told: which target the best option misses, by how much, and
    against what limit (the target x slo_margin, less the time it already waited)."""
    ttft = f"TTFT {best.ttft_s:.2f}s predicted (admitted up to {admit.ttft_s:.2f}s"
    tpot = f"TPOT {best.tpot_s * 1000:.0f}ms predicted (admitted up to " \
        f"{admit.tpot_s * 1000:.0f}ms"
    limits = f": the targets x slo_margin {margin:g})"
    if not idle_meets:
        miss = f"{ttft}{limits}" if best.ttft_s > admit.ttft_s else f"{tpot}{limits}"
        return (f"no worker could meet the latency targets for this request even idle: {miss}; "
                "it is served late once a worker has no more than its own prefill queued")
    if reason == "slo_would_stall":  # `best`: the prefill worker's option, which misses
        busy = ttft if best.ttft_s > admit.ttft_s else tpot
        return (f"the prefill workers are busy ({busy}{limits}), and prefilling this "
                f"{prompt_len}-token prompt on a decode worker would stall the streams it is "
                "running")
    if reason == "slo_ttft_unmet":
        return f"no worker can meet the latency targets now: {ttft}{limits}"
    return (f"no worker can meet the latency targets now: {tpot}{limits}; the decode workers' "
            "running streams must thin out first")
