"""What one chaos phase does, as data: the requests and when they arrive, the fault (what, on
which role, at which point of a request's life) and the probes that time the recovery.

Every random choice (fault point, target request, timing) is drawn here from a seeded rng, so a
phase replays identically from its seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

from tests.chaos_support.workload import RequestSpec, SpecFactory

POINTS = ("before_first_token", "mid_transfer", "mid_stream")


@dataclass
class Arrival:
    at_s: float                                  # after the phase starts
    spec: RequestSpec
    cancel_after_tokens: Optional[int] = None    # the client hangs up after this many tokens


@dataclass
class FaultPlan:
    action: str = "none"          # none | kill | stop | link
    role: Optional[str] = None    # prefill | decode
    point: str = "none"           # before_first_token | mid_transfer | mid_stream | at_time
    stop_s: float = 0.0           # stop: how long the worker stays stopped
    delay_kv_send_s: float = 0.0  # mid_transfer: the prefill worker holds each KV send this long
    target: Optional[str] = None  # label of the request whose progress fires the fault
    trigger_tokens: int = 1       # fire once the target has streamed this many tokens
    wait_s: float = 0.0           # then wait this long (the seeded point inside the window)
    at_s: float = 0.0             # at_time: seconds after the phase starts
    link: dict = field(default_factory=dict)  # link: {kind: value} on the prefill worker

    def describe(self) -> str:
        if self.action == "none":
            return "none"
        if self.action == "link":
            return "link " + ", ".join(f"{k}={v}" for k, v in self.link.items())
        what = f"{self.action} {self.role}"
        if self.action == "stop":
            what += f" {self.stop_s:g}s"
        return f"{what} @ {self.point}"


@dataclass
class PhasePlan:
    name: str
    arrivals: list[Arrival]
    fault: FaultPlan = field(default_factory=FaultPlan)
    probes: list[RequestSpec] = field(default_factory=list)
    probe_first_gap_s: float = 0.5   # probe k goes out gap * growth^k after the previous one
    probe_growth: float = 1.35
    refusals_need_retry_after: bool = False  # burst: every 429/503 must say when to retry

    def specs(self) -> list[RequestSpec]:
        return [a.spec for a in self.arrivals] + list(self.probes)


def wave(factory: SpecFactory, prefix: str, n_short: int, n_long: int, spacing_s: float,
         rng: random.Random, max_tokens: Optional[int] = None) -> list[Arrival]:
    kinds = ["short"] * n_short + ["long"] * n_long
    rng.shuffle(kinds)
    return [Arrival(i * spacing_s, factory.make(f"{prefix}/{k}-{i}", k, max_tokens))
            for i, k in enumerate(kinds)]


def open_loop(factory: SpecFactory, prefix: str, rate_per_s: float, duration_s: float,
              rng: random.Random, long_fraction: float = 0.5) -> list[Arrival]:
    """Poisson arrivals at `rate_per_s`; each long with probability `long_fraction`."""
    out, t, i = [], rng.expovariate(rate_per_s), 0
    while t < duration_s:
        kind = "long" if rng.random() < long_fraction else "short"
        out.append(Arrival(t, factory.make(f"{prefix}/{kind}-{i}", kind)))
        t += rng.expovariate(rate_per_s)
        i += 1
    return out


def probes(factory: SpecFactory, prefix: str, n: int) -> list[RequestSpec]:
    return [factory.make(f"{prefix}/probe-{i}", "long" if i % 2 == 0 else "short")
            for i in range(n)]


def worker_fault(factory: SpecFactory, rng: random.Random, action: str, role: str, point: str,
                 arrivals: list[Arrival], *, at_s: float = 0.0,
                 window_s: Optional[float] = None, stop_s: float = 3.0,
                 delay_kv_send_s: float = 1.5, num_probes: int = 10,
                 name: Optional[str] = None) -> PhasePlan:
    """A kill or stop of one worker at a seeded point of a seeded target request's life.

    The fault lands from `at_s` into the load on: before_first_token freezes the worker then
    (requests arriving in the next `window_s` reach it frozen, then it dies or resumes); the
    other points pick their target among the requests arriving in [at_s, at_s + window_s]."""
    name = name or f"{action}-{role}-{point}"
    end = at_s + window_s if window_s is not None else float("inf")
    window = [a for a in arrivals if at_s <= a.at_s <= end] or arrivals
    fault = FaultPlan(action=action, role=role, point=point, stop_s=stop_s, at_s=at_s)
    if point == "before_first_token":
        # Frozen until the window's requests are out, plus a seeded moment; then killed.
        fault.wait_s = max(a.at_s for a in window) - at_s + rng.uniform(0.1, 0.6)
    elif point == "mid_transfer":
        fault.delay_kv_send_s = delay_kv_send_s
        longs = [a.spec.label for a in window if a.spec.kind == "long"] or \
            [a.spec.label for a in arrivals if a.spec.kind == "long"]
        fault.target = rng.choice(longs)
        fault.wait_s = rng.uniform(0.1, 0.9) * delay_kv_send_s
    elif point == "mid_stream":
        target = rng.choice(window).spec
        fault.target = target.label
        fault.trigger_tokens = rng.randint(2, max(2, dict(target.params)["max_tokens"] // 2))
    else:
        raise ValueError(f"point must be one of {POINTS}, got {point!r}")
    return PhasePlan(name, arrivals, fault, probes(factory, name, num_probes))


def timed_fault(factory: SpecFactory, action: str, role: str, at_s: float,
                arrivals: list[Arrival], *, stop_s: float = 10.0, num_probes: int = 0,
                name: Optional[str] = None) -> PhasePlan:
    """A kill or stop at a fixed time into open-loop load (the load itself shows recovery)."""
    name = name or (f"{action}-{role}-{stop_s:g}s" if action == "stop" else f"{action}-{role}")
    fault = FaultPlan(action=action, role=role, point="at_time", at_s=at_s, stop_s=stop_s)
    return PhasePlan(name, arrivals, fault, probes(factory, name, num_probes))


def disconnect_storm(factory: SpecFactory, rng: random.Random, n: int, max_tokens: int,
                     name: str = "disconnect-storm") -> PhasePlan:
    """Many clients hang up mid-stream (some before their first token); a few stay."""
    arrivals = wave(factory, name, n // 2, n - n // 2, 0.02, rng, max_tokens=max_tokens)
    for a in arrivals:
        if rng.random() < 0.85:
            a.cancel_after_tokens = rng.choice([0, 1, 2, 3, 5, 8, 13])
    return PhasePlan(name, arrivals)


def burst(factory: SpecFactory, rng: random.Random, n: int, name: str = "burst") -> PhasePlan:
    """Far more requests at once than the workers admit: each completes or is refused fast."""
    arrivals = wave(factory, name, n // 2, n - n // 2, 0.0, rng)
    return PhasePlan(name, arrivals, refusals_need_retry_after=True)


def link_fault(factory: SpecFactory, rng: random.Random, kind: str, value: float, n: int,
               name: Optional[str] = None) -> PhasePlan:
    """Faults on the prefill worker's links while long prompts go disaggregated."""
    name = name or f"link-{kind}"
    arrivals = wave(factory, name, n // 4, n - n // 4, 0.1, rng)
    return PhasePlan(name, arrivals, FaultPlan(action="link", role="prefill",
                                               link={kind: value, "seed": rng.randrange(1000)}))
