"""Runs one chaos phase against the served product: sends its requests on time, fires its fault
at the planned point, probes until a new request completes correctly, then waits for the
workers to be back, their KV blocks at baseline and nothing left in flight.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from tests.chaos_support import faults
from tests.chaos_support.classify import classify, counts
from tests.chaos_support.client import RequestResult, http_client, send
from tests.chaos_support.plans import PhasePlan
from tests.chaos_support.product import ServedProduct
from tests.chaos_support.workload import Expected


@dataclass
class RunSettings:
    hung_bound_s: float = 60.0        # a request with no end by then is hung
    trigger_timeout_s: float = 60.0   # a fault whose trigger never comes fires anyway
    back_timeout_s: float = 120.0     # a killed worker must be serving again by then
    quiesce_timeout_s: float = 60.0   # blocks back to baseline and nothing in flight by then
    logprob_tol: float = 1e-3


@dataclass
class PhaseResult:
    plan: PhasePlan
    results: list[RequestResult] = field(default_factory=list)
    started_at: float = 0.0
    ended_at: float = 0.0
    window_start: Optional[float] = None   # the target stopped serving (frozen or dead)
    fault_at: Optional[float] = None       # the kill, the stop, or the link faults set
    fault_end: Optional[float] = None      # SIGCONT, or the killed worker serving again
    recovered_at: Optional[float] = None   # first correct completion of a later request
    worker_back_at: Optional[float] = None
    quiescent: bool = False
    quiesce_detail: str = ""
    notes: list[str] = field(default_factory=list)
    link_faults_applied: dict = field(default_factory=dict)  # link phases: kind -> chunks

    @property
    def counts(self) -> Counter:
        return counts(self.results)

    @property
    def recovery_s(self) -> Optional[float]:
        if self.recovered_at is None or self.fault_at is None:
            return None
        return self.recovered_at - self.fault_at

    def ttft_p99(self, during_fault: bool = False) -> Optional[float]:
        start = self.window_start if self.window_start is not None else self.fault_at
        end = self.fault_end if self.fault_end is not None else self.ended_at
        values = [r.ttft_s for r in self.results if r.ttft_s is not None and (
            not during_fault or (start is not None and start <= r.sent_at <= end))]
        return percentile(values, 99)

    def listing(self, classes=("failed", "wrong", "hung", "unclear")) -> list[str]:
        """One line per request of these classes: label, server request id, class, detail."""
        return [f"{r.spec.label} [{r.spec.kind}] {r.response_id or '-'}: {r.label_class}: "
                f"{r.detail}" for r in self.results if r.label_class in classes]


def percentile(values: list[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (the max for fewer than 100 values); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


async def _wait_for(predicate, timeout_s: float, poll_s: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(poll_s)
    return True


class _Phase:
    def __init__(self, product: ServedProduct, plan: PhasePlan, refs: dict[str, Expected],
                 ambiguous: set[str], settings: RunSettings):
        self.product, self.plan, self.refs = product, plan, refs
        self.ambiguous, self.settings = ambiguous, settings
        self.res = PhaseResult(plan)
        self.client = None
        self.stopped: set[int] = set()
        self.target_pid: Optional[int] = None
        self.target_id: Optional[str] = None

    # -- requests ----------------------------------------------------------------------------
    async def _send(self, r: RequestResult, at: Optional[float] = None) -> None:
        if at is not None:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
        await send(self.client, self.product.base_url, self.product.model_name, r,
                   self.settings.hung_bound_s)
        cls = classify(r, self.refs[r.spec.label], self.ambiguous, self.settings.logprob_tol)
        res = self.res
        if cls == "correct" and self.plan.fault.action in ("kill", "stop") and \
                res.fault_at is not None and r.sent_at >= res.fault_at and \
                (res.recovered_at is None or r.ended_at < res.recovered_at):
            res.recovered_at = r.ended_at

    async def _probe(self) -> None:
        if not self.plan.probes or self.plan.fault.action not in ("kill", "stop"):
            return
        await _wait_for(lambda: self.res.fault_at is not None, self.settings.trigger_timeout_s
                        + self.settings.hung_bound_s, poll_s=0.01)
        sends, gap = [], self.plan.probe_first_gap_s
        for spec in self.plan.probes:
            if self.res.recovered_at is not None:
                break
            r = RequestResult(spec)
            self.res.results.append(r)
            sends.append(asyncio.ensure_future(self._send(r)))
            await _wait_for(lambda: self.res.recovered_at is not None, gap, poll_s=0.01)
            gap *= self.plan.probe_growth
        await asyncio.gather(*sends)

    # -- the fault ---------------------------------------------------------------------------
    def _act(self) -> None:
        """Kill or stop the target now."""
        fault, now = self.plan.fault, time.monotonic()
        if fault.action == "kill":
            faults.kill(self.target_pid)
        elif self.target_pid not in self.stopped:
            faults.stop(self.target_pid)
            self.stopped.add(self.target_pid)
        self.res.fault_at = now
        if self.res.window_start is None:
            self.res.window_start = now

    async def _fire(self, by_label: dict[str, RequestResult], t0: float) -> None:
        fault, s = self.plan.fault, self.settings
        if fault.action not in ("kill", "stop"):
            return
        if fault.point == "before_first_token":
            # Frozen (at the start, or now) so that requests reach it before it dies.
            if self.res.window_start is None:
                await asyncio.sleep(max(0.0, t0 + fault.at_s - time.monotonic()))
                self._freeze()
            if fault.action == "kill":
                await asyncio.sleep(max(0.0, self.res.window_start + fault.wait_s
                                        - time.monotonic()))
                self._act()
        elif fault.point == "at_time":
            await asyncio.sleep(max(0.0, t0 + fault.at_s - time.monotonic()))
            self._act()
        else:
            target = by_label[fault.target]
            need = 1 if fault.point == "mid_transfer" else fault.trigger_tokens
            hit = await _wait_for(lambda: len(target.tokens) >= need or target.finished,
                                  s.trigger_timeout_s)
            if len(target.tokens) < need:
                self.res.notes.append(
                    f"trigger missed: {fault.target} had {len(target.tokens)} of {need} tokens "
                    f"({'it ended' if hit else 'timeout'}); fault fired anyway")
            await asyncio.sleep(fault.wait_s)
            self._act()
        if fault.action == "stop":
            await asyncio.sleep(max(0.0, self.res.window_start + fault.stop_s
                                    - time.monotonic()))
            faults.cont(self.target_pid)
            self.stopped.discard(self.target_pid)
            self.res.fault_end = time.monotonic()

    async def _worker_back(self) -> None:
        """A killed worker serves again: healthy in /health under a new pid."""
        old = self.target_pid
        deadline = time.monotonic() + self.settings.back_timeout_s
        while time.monotonic() < deadline:
            try:
                pid = await asyncio.to_thread(self.product.pid_of, self.target_id, 2.0)
                if pid != old:
                    self.res.worker_back_at = self.res.fault_end = time.monotonic()
                    self.res.notes.append(f"{self.target_id} back as pid {pid} after "
                                          f"{self.res.worker_back_at - self.res.fault_at:.1f}s")
                    return
            except Exception:
                pass
            await asyncio.sleep(0.25)
        self.res.notes.append(f"{self.target_id} not serving again within "
                              f"{self.settings.back_timeout_s:.0f}s of its kill")

    # -- the phase ---------------------------------------------------------------------------
    async def run(self) -> PhaseResult:
        plan, fault, res = self.plan, self.plan.fault, self.res
        product = self.product
        prefill_id = await asyncio.to_thread(product.worker_of_role, "prefill")
        if fault.action in ("kill", "stop"):
            self.target_id = await asyncio.to_thread(product.worker_of_role, fault.role)
            self.target_pid = await asyncio.to_thread(product.pid_of, self.target_id)
            res.notes.append(f"target {self.target_id} pid {self.target_pid}")
        try:
            if fault.delay_kv_send_s:
                await asyncio.to_thread(faults.set_kv_send_delay, product, prefill_id,
                                        fault.delay_kv_send_s)
            if fault.action == "link":
                before = await asyncio.to_thread(faults.link_fault_counts, product, prefill_id)
                await asyncio.to_thread(faults.set_link_faults, product, prefill_id,
                                        **fault.link)
                res.fault_at = res.window_start = time.monotonic()
            async with http_client() as self.client:
                by_label = {a.spec.label: RequestResult(a.spec, a.cancel_after_tokens)
                            for a in plan.arrivals}
                res.results.extend(by_label.values())
                t0 = res.started_at = time.monotonic()
                if fault.point == "before_first_token" and fault.at_s == 0:
                    # Before the first request leaves, not merely soon after.
                    self._freeze()
                sends = [asyncio.ensure_future(self._send(by_label[a.spec.label], t0 + a.at_s))
                         for a in plan.arrivals]
                fire = asyncio.ensure_future(self._fire(by_label, t0))
                probe = asyncio.ensure_future(self._probe())
                await asyncio.gather(fire, *sends, probe)
            if fault.action == "link":
                after = await asyncio.to_thread(faults.link_fault_counts, product, prefill_id)
                res.link_faults_applied = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                res.notes.append(f"link chunks and faults applied: {res.link_faults_applied}")
        finally:
            for pid in list(self.stopped):
                faults.cont(pid)
            await self._reset(prefill_id)
        res.ended_at = time.monotonic()
        if fault.action == "link":
            res.fault_end = res.ended_at
        if fault.action == "kill":
            await self._worker_back()
        product.track()
        res.quiescent, res.quiesce_detail = await asyncio.to_thread(
            wait_quiescent, product, self.settings.quiesce_timeout_s)
        return res

    def _freeze(self) -> None:
        """before_first_token: SIGSTOP the target; a stop fault starts here, a kill follows."""
        if self.plan.fault.action == "stop":
            self._act()
            return
        faults.stop(self.target_pid)
        self.stopped.add(self.target_pid)
        self.res.window_start = time.monotonic()

    async def _reset(self, prefill_id: str) -> None:
        fault = self.plan.fault
        try:
            if fault.delay_kv_send_s:
                await asyncio.to_thread(self.product.pid_of, prefill_id, 60.0)  # serving again
                await asyncio.to_thread(faults.set_kv_send_delay, self.product, prefill_id, 0.0)
            if fault.action == "link":
                await asyncio.to_thread(faults.set_link_faults, self.product, prefill_id)
        except Exception as exc:
            self.res.notes.append(f"resetting fault settings failed: {exc!r}")


async def run_phase(product: ServedProduct, plan: PhasePlan, refs: dict[str, Expected],
                    ambiguous: set[str], settings: Optional[RunSettings] = None) -> PhaseResult:
    return await _Phase(product, plan, refs, ambiguous, settings or RunSettings()).run()


def wait_quiescent(product: ServedProduct, timeout_s: float) -> tuple[bool, str]:
    """Every worker healthy, its KV usage back to zero (all blocks free) and nothing running or
    waiting, as the router's /metrics reports them."""
    deadline = time.monotonic() + timeout_s
    problems = ["never checked"]
    while time.monotonic() < deadline:
        problems = []
        try:
            views = product.workers()
            metrics = product.metrics()
        except Exception as exc:
            problems = [f"router did not answer: {exc!r}"]
            time.sleep(0.25)
            continue
        for wid, view in sorted(views.items()):
            key = (("worker", wid),)
            if not view.healthy:
                problems.append(f"{wid} unhealthy (state {view.state})")
                continue
            for name, want in (("pd_worker_kv_usage_ratio", 0.0), ("pd_worker_running", 0.0),
                               ("pd_worker_waiting", 0.0), ("pd_worker_healthy", 1.0)):
                got = metrics.get(name, {}).get(key)
                if got != want:
                    problems.append(f"{wid} {name}={got}")
        if not problems:
            return True, ""
        time.sleep(0.25)
    return False, "; ".join(problems)
