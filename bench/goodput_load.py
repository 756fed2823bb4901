"""The goodput bench's load at one point: requests sent on the plan's schedule (open loop, burst)
or by closed-loop clients, with progress on stderr, and the wait for an idle server between."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import httpx

from bench.goodput_client import RequestRecord, request_body, stream_request
from bench.goodput_workload import RequestSpec

IDLE_GAUGES = ("pd_worker_running", "pd_worker_waiting",  # ours, then vLLM's
               "vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass
class PointPlan:
    name: str                           # "2/s", "c8", "burst 192"
    offered_rate: Optional[float]       # open loop only
    offsets: Optional[list[float]]      # open loop and burst: send times from the start
    concurrency: Optional[int] = None   # closed loop: clients each sending after its last ends
    num_requests: Optional[int] = None  # closed loop limits
    duration_s: Optional[float] = None


class Progress:
    """requests done / total on stderr, redrawn in place at most ten times a second."""

    def __init__(self, name: str, total: Optional[int]):
        self.name, self.total, self.done, self.drawn = name, total, 0, 0.0

    def tick(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.drawn > 0.1 or self.done == self.total:
            self.drawn = now
            if self.total:
                bar = "#" * (30 * self.done // self.total)
                sys.stderr.write(f"\r{self.name} [{bar:<30}] {self.done}/{self.total}")
            else:
                sys.stderr.write(f"\r{self.name} {self.done} done")
            sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\r" + " " * 60 + "\r")
        sys.stderr.flush()


async def run_point(client: httpx.AsyncClient, url: str, model: str, plan: PointPlan,
                    specs: Iterator[RequestSpec], ignore_eos: bool) -> list[RequestRecord]:
    """Every request of one point, sent on schedule (or by the closed-loop clients)."""
    total = len(plan.offsets) if plan.offsets is not None else plan.num_requests
    progress = Progress(plan.name, total)
    records: list[RequestRecord] = []

    async def one(spec: RequestSpec, body: bytes, scheduled: float, t0: float):
        rec = RequestRecord(spec.index, spec.kind, len(spec.prompt), spec.output_len, scheduled,
                            conversation=spec.conversation)
        records.append(await stream_request(client, url, body, rec, t0, ignore_eos))
        progress.tick()

    if plan.offsets is not None:
        batch = [(s, request_body(s, model, ignore_eos)) for _, s in zip(plan.offsets, specs)]
        t0 = time.perf_counter()
        tasks = []
        for offset, (spec, body) in zip(plan.offsets, batch):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec, body, offset, t0)))
        await asyncio.gather(*tasks)
    else:
        t0 = time.perf_counter()
        sent = 0

        async def closed_client():
            nonlocal sent
            while (plan.num_requests is None or sent < plan.num_requests) and \
                    (plan.duration_s is None or time.perf_counter() - t0 < plan.duration_s):
                sent += 1
                spec = next(specs)
                scheduled = time.perf_counter() - t0
                await one(spec, request_body(spec, model, ignore_eos), scheduled, t0)

        await asyncio.gather(*(closed_client() for _ in range(plan.concurrency)))
    progress.close()
    return sorted(records, key=lambda r: r.index)


def busy_requests(metrics_text: str) -> Optional[float]:
    """Running + waiting requests from Prometheus text (ours or vLLM's); None if neither."""
    total = None
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in IDLE_GAUGES:
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


async def wait_idle(client: httpx.AsyncClient, base_url: str, settle_s: float,
                    timeout_s: float) -> None:
    """Until /metrics shows nothing running or waiting (if it says), then settle_s more."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            resp = await client.get(f"{base_url}/metrics")
            busy = busy_requests(resp.text) if resp.status_code == 200 else None
        except httpx.HTTPError:
            busy = None
        if not busy:
            break
        await asyncio.sleep(0.25)
    else:
        print(f"# server still busy after {timeout_s:g}s; starting anyway", file=sys.stderr)
    await asyncio.sleep(settle_s)
