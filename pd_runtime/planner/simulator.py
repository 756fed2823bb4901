"""A discrete-event simulator of a PD cluster under a workload: the router's policy as
implemented (pd_runtime/router/policy.py's `decide` / `decide_slo`, with the router's ledgers and live
cost model, imported, not re-written), the prefill and decode engines (pd_runtime/planner/engine_model.py),
the decode side's block reservations (first come first served, as ReservationQueue), the KV
transfer over each prefill -> decode link (one transfer at a time per link; streamed layer by
layer, so only what the prefill workers measured as exposed is left after the prefill's last
step), and the clients' arrivals.

Times as the product measures them: TTFT from the request's arrival at the router to its first
token at the client, TPOT as (last token - first token) / (tokens - 1). A request is good when it
completes within both targets; goodput is good requests per second from the first arrival to
the last end (bench/goodput.py's definition).

What it leaves out (said in docs/BENCHMARKS.md next to its accuracy): prefix-cache hits (the
workloads' prompts are unique), preemption (blocks are taken for the whole output at
admission), worker faults, the hedge, and per-token ledger growth (the router's ledger learns a
request's context at its start and its end).
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import Callable, Optional

from pd_runtime.config import RoutingConfig, SLOTarget
from pd_runtime.planner.costs import ClusterCosts
from pd_runtime.planner.engine_model import Seq, SimEngine
from pd_runtime.planner.host import NodeCores, load_cores
from pd_runtime.planner.stats import percentile
from pd_runtime.planner.tensor_parallel import role_costs
from pd_runtime.planner.workload import SimRequest
from pd_runtime.router.cost_model import CostModel
from pd_runtime.router.ledger import Ledgers
from pd_runtime.router.policy import WorkerState, decide, decide_slo, slo_target

_QUEUE_RETRY_S = 0.02  # pd_runtime/router/core.py: an `overload: queue` request is re-decided this often


@dataclass
class Topology:
    """A deployment to simulate: the pools' sizes, their workers' degrees (engine.
    tensor_parallel_size) and the router's settings."""

    num_prefill: int
    num_decode: int
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    report_interval_s: float = 1.0  # recovery.health_check_interval_s: load reports' age
    # The clients run on the router's node too (a load generator on the machine it measures):
    # their CPU counts against the workers' cores where those share the node.
    clients_on_host: bool = False
    prefill_tp: int = 1
    decode_tp: int = 1

    @property
    def devices(self) -> int:
        """GPUs (or on the CPU, per-rank CPU sets): a worker of degree t takes t."""
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    @property
    def name(self) -> str:
        r = self.routing
        mode = r.mode if r.mode != "auto" else f"auto@{r.max_local_prefill_tokens}"
        prefill_tp = self.prefill_tp if self.num_prefill else 1
        return f"{_pool(self.num_prefill, 'P', prefill_tp)}+" \
               f"{_pool(self.num_decode, 'D', self.decode_tp)} {mode}"


def _pool(workers: int, role: str, t: int) -> str:
    """"3D", or "3D(tp2)" for workers of degree 2."""
    return f"{workers}{role}" + (f"(tp{t})" if t > 1 else "")


@dataclass(slots=True)
class Outcome:
    request: SimRequest
    path: str = "none"
    refused: bool = False
    first_s: Optional[float] = None   # first token at the client, absolute
    end_s: Optional[float] = None

    def ttft_s(self, router_overhead_s: float) -> Optional[float]:
        if self.first_s is None:
            return None
        return self.first_s - self.request.arrival_s + router_overhead_s

    def tpot_s(self) -> Optional[float]:
        if self.end_s is None or self.first_s is None:
            return None
        n = self.request.max_tokens
        return (self.end_s - self.first_s) / (n - 1) if n > 1 else 0.0


class _Event:
    __slots__ = ("fn", "cancelled")

    def __init__(self, fn: Callable[[], None]):
        self.fn, self.cancelled = fn, False


class ClusterSim:
    def __init__(self, costs: ClusterCosts, topology: Topology, seed: int = 0,
                 host_load: Optional[float] = None):
        """`host_load`: the workers share the router's node (costs.host), whose other work
        takes this many cores (pd_runtime/planner/host.py NodeCores); None: each has its own cores."""
        if topology.num_decode < 1:
            raise ValueError("a deployment needs at least one decode worker")
        self.costs, self.topology = costs, topology
        self.now = 0.0
        self._heap: list = []
        self._order = itertools.count()
        self.rng = random.Random(seed)
        self.cores = NodeCores(self, costs.host, host_load) if host_load is not None else None
        prefill_costs = role_costs(costs, "prefill", topology.prefill_tp) \
            if topology.num_prefill else costs.prefill
        decode_costs = role_costs(costs, "decode", topology.decode_tp)
        self.prefill = [SimEngine(self, f"prefill-{i}", "prefill", prefill_costs)
                        for i in range(topology.num_prefill)]
        self.decode = [SimEngine(self, f"decode-{i}", "decode", decode_costs)
                       for i in range(topology.num_decode)]
        self.engines = {e.worker_id: e for e in self.prefill + self.decode}
        self.states = {wid: WorkerState(wid, e.role) for wid, e in self.engines.items()}
        self.decode_states = [self.states[e.worker_id] for e in self.decode]
        self.prefill_states = [self.states[e.worker_id] for e in self.prefill]
        self.cost_model = CostModel()
        self.ledgers = Ledgers()
        self.links: dict[tuple[str, str], float] = {}   # (P, D) -> when it is free
        self.reservations: dict[str, list] = {d.worker_id: [] for d in self.decode}
        self.outcomes: list[Outcome] = []
        self.events = 0
        self._open = 0  # requests not yet ended or refused: load reports go on while any is

    # -- the event loop ----------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> _Event:
        event = _Event(fn)
        heapq.heappush(self._heap, (t, next(self._order), event))
        return event

    def cancel(self, event: _Event) -> None:
        event.cancelled = True

    def run(self, requests: list[SimRequest]) -> list[Outcome]:
        """Every request to its end (or refusal); arrivals are fed one ahead, in time order."""
        arrivals = iter(sorted(requests, key=lambda r: r.arrival_s))
        self._open = len(requests)

        def arrive(req: SimRequest) -> None:
            out = Outcome(req)
            self.outcomes.append(out)
            following = next(arrivals, None)
            if following is not None:
                self.at(following.arrival_s, lambda: arrive(following))
            self._route(out, 0.0)

        first = next(arrivals, None)
        if first is not None:
            self.at(first.arrival_s, lambda: arrive(first))
        self._report()
        while self._heap:
            t, _, event = heapq.heappop(self._heap)
            if event.cancelled:
                continue
            self.now = t
            self.events += 1
            event.fn()
        return self.outcomes

    # -- load reports ------------------------------------------------------------------------
    def _report(self) -> None:
        """Every worker's load report reaches the router (pd_runtime/router/core.py: refresh)."""
        for wid, engine in self.engines.items():
            load = engine.load_report()
            load["kv_bytes_per_token"] = self.costs.kv_bytes_per_token
            if engine.role == "prefill":
                load["kv_transfer"] = {"send_gbps": self.costs.transfer_gbps}
            state = self.states[wid]
            state.load, state.inflight = load, 0
            self.cost_model.update(wid, load)
        if self._open:
            self.at(self.now + self.topology.report_interval_s, self._report)

    # -- routing -----------------------------------------------------------------------------
    def _route(self, out: Outcome, waited_s: float) -> None:
        req, cfg = out.request, self.topology.routing
        decode, prefill = self.decode_states, self.prefill_states
        if cfg.mode != "slo":
            decision = decide(req.prompt_len, decode, prefill, {}, cfg, self.rng)
        else:
            target = slo_target(cfg, None, req.prompt_len)
            decision = decide_slo(req.prompt_len, req.max_tokens, decode, prefill, {}, cfg,
                                  target, self.cost_model, self.ledgers, self.now, self.rng,
                                  waited_s)
        if decision.path == "none":
            if cfg.overload == "queue" and waited_s < cfg.max_queue_s \
                    and decision.retry_after_s is not None:
                self.at(self.now + _QUEUE_RETRY_S,
                        lambda: self._route(out, waited_s + _QUEUE_RETRY_S))
                return
            out.refused, out.end_s = True, self.now
            self._open -= 1
            return
        out.path = decision.path
        runner = decision.prefill_worker or decision.decode_worker
        for wid in {decision.decode_worker, decision.prefill_worker} - {None}:
            self.states[wid].inflight += 1
        self.ledgers[runner].add_prefill(req.index, decision.prefill_s or self.cost_model.costs(
            runner).prefill_s(req.prompt_len), self.now)
        self.ledgers[decision.decode_worker].start(req.index, req.prompt_len)
        if decision.path == "colocated":
            half = self.costs.overhead_s("colocated") / 2
            self.at(self.now + half, lambda: self._colocated(out, decision.decode_worker))
        else:  # four hops: router -> decode -> prefill worker, the token back the same way
            quarter = self.costs.overhead_s("disaggregated") / 4
            self.at(self.now + quarter, lambda: self._reserve(out, decision.decode_worker,
                                                              decision.prefill_worker))

    def _first(self, out: Outcome, runner: str, t: float) -> None:
        out.first_s = t
        self.ledgers[runner].prefill_done(out.request.index, t)

    def _end(self, out: Outcome, runner: str, decode: str, t: float) -> None:
        out.end_s = t
        self._open -= 1
        self.ledgers[runner].finish(out.request.index, t)
        self.ledgers[decode].finish(out.request.index, t)

    # -- colocated ---------------------------------------------------------------------------
    def _colocated(self, out: Outcome, d: str) -> None:
        req, engine, half = out.request, self.engines[d], self.costs.overhead_s("colocated") / 2
        blocks = engine.blocks_for(req.prompt_len + req.max_tokens)
        engine.add(Seq(req.index, req.prompt_len, req.max_tokens, blocks,
                       on_first=lambda t: self._first(out, d, t + half),
                       on_finish=lambda t: self._end(out, d, d, t + half)))

    # -- disaggregated -----------------------------------------------------------------------
    def _reserve(self, out: Outcome, d: str, p: str) -> None:
        engine = self.engines[d]
        blocks = engine.blocks_for(out.request.prompt_len + out.request.max_tokens)
        queue = self.reservations[d]
        if queue or not engine.reserve(blocks):
            queue.append((out, p, blocks))
            return
        self._call_prefill(out, d, p, blocks)

    def blocks_freed(self, engine: SimEngine) -> None:
        queue = self.reservations.get(engine.worker_id)
        while queue:
            out, p, blocks = queue[0]
            if not engine.reserve(blocks):
                return
            queue.pop(0)
            self._call_prefill(out, engine.worker_id, p, blocks)

    def _call_prefill(self, out: Outcome, d: str, p: str, d_blocks: int) -> None:
        req, quarter = out.request, self.costs.overhead_s("disaggregated") / 4
        p_engine = self.engines[p]
        p_blocks = p_engine.blocks_for(req.prompt_len)

        def prefilled(t: float) -> None:  # on P: first token back to D and on to the client
            self._first(out, p, t + 2 * quarter)
            landed = max(t, self.links.get((p, d), 0.0)) + self.costs.exposed_s(req.prompt_len)
            self.links[(p, d)] = landed
            self.at(landed, lambda: self._landed(out, d, p, p_blocks, d_blocks))

        seq = Seq(req.index, req.prompt_len, 1, p_blocks, on_first=prefilled,
                  on_finish=lambda t: None, hold=True)
        self.at(self.now + quarter, lambda: p_engine.add(seq))

    def _landed(self, out: Outcome, d: str, p: str, p_blocks: int, d_blocks: int) -> None:
        req, half = out.request, self.costs.overhead_s("colocated") / 2
        self.engines[p].release(p_blocks)
        engine = self.engines[d]
        if req.max_tokens <= 1:
            engine.remote_waiting -= 1
            self._end(out, p, d, out.first_s)
            engine.release(d_blocks)
            return
        engine.land(Seq(req.index, req.prompt_len, req.max_tokens, d_blocks,
                        on_first=lambda t: None,
                        on_finish=lambda t: self._end(out, p, d, t + half),
                        computed=req.prompt_len, generated=1))


# ---------------------------------------------------------------------------------- results
def summarize(outcomes: list[Outcome], slo: SLOTarget, router_overhead_s: float) -> dict:
    """Goodput and latency percentiles, as bench/goodput.py reports a point."""
    done = [o for o in outcomes if o.end_s is not None and not o.refused]
    ends = [o.end_s for o in outcomes if o.end_s is not None]
    start = min((o.request.arrival_s for o in outcomes), default=0.0)
    duration = max(ends) - start if ends else 0.0
    ttft = [o.ttft_s(router_overhead_s) for o in done]
    tpot = [o.tpot_s() for o in done if o.request.max_tokens > 1]
    good = sum(1 for o in done if o.ttft_s(router_overhead_s) <= slo.ttft_s
               and o.tpot_s() <= slo.tpot_s)
    paths = {}
    for o in done:
        paths[o.path] = paths.get(o.path, 0) + 1
    return {"sent": len(outcomes), "completed": len(done),
            "refused": sum(o.refused for o in outcomes), "good": good,
            "duration_s": duration,
            "goodput_rps": good / duration if duration > 0 else 0.0,
            "throughput_rps": len(done) / duration if duration > 0 else 0.0,
            "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
            "tpot_s": {"p50": percentile(tpot, 50), "p99": percentile(tpot, 99)},
            "paths": paths}


def shares_host(costs: ClusterCosts, topology: Topology) -> bool:
    """The router's node (measured by `profile`) holds the whole deployment's workers: their
    steps compete with the router's CPU. A deployment larger than that node runs elsewhere."""
    host = costs.host
    if host is None or host.cores <= 0:
        return False
    threads = topology.num_decode * role_costs(costs, "decode", topology.decode_tp).threads
    if topology.num_prefill:
        threads += topology.num_prefill * role_costs(costs, "prefill", topology.prefill_tp).threads
    return threads <= host.cores


def simulate(costs: ClusterCosts, topology: Topology, requests: list[SimRequest],
             slo: SLOTarget, seed: int = 0, rounds: int = 3) -> dict:
    """One run; where the workers share the router's node, `rounds` runs, each with the
    node's other load (the traffic's CPU) that the one before it implies (pd_runtime/planner/host.py)."""
    shared = shares_host(costs, topology)
    load = costs.host.idle_cores if shared else None
    for round_no in range(rounds if shared else 1):
        sim = ClusterSim(costs, topology, seed, load)
        if shared:
            for engine in sim.engines.values():
                engine.busy = []
        outcomes = sim.run(requests)
        result = summarize(outcomes, slo, costs.router_overhead_s)
        if shared and round_no < rounds - 1:
            tokens = sum(o.request.max_tokens for o in outcomes
                         if o.end_s is not None and not o.refused)
            cpu = costs.host.cpu_s(len(outcomes), tokens, 0.0, topology.clients_on_host)
            load = load_cores(costs.host, [e.busy for e in sim.engines.values()], cpu)
    result["events"] = sim.events
    if shared:  # each worker's mean stretch: its busy time over the compute in it
        work = sim.cores.work_s
        result["stretch"] = {w: round(e.busy_s / work[e], 3) if work.get(e) else 1.0
                             for w, e in sim.engines.items()}
    return result
