"""The router overhead bench's clients, run in a child process so the server thread has the
interpreter to itself: sequential latency on one connection, or many connections' load."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# The child runs `router_overhead.py --client-role ROLE`, which lands in client_main.
ROUTER_OVERHEAD = Path(__file__).resolve().with_name("router_overhead.py")


def percentiles(samples: list[float], qs=(50, 90, 99)) -> list[float]:
    ordered = sorted(samples)
    return [ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))] for q in qs]


# Run as `--client-role latency|load` in a child process; they print one JSON line.
def latency_client(port: int, cases: list[dict], samples: int, warmup: int) -> dict:
    """Sequential requests on one keep-alive connection per server, the cases interleaved (in
    turn forwards and backwards) so that noise from other jobs on the box falls on all of them
    alike."""
    import httpx

    times: dict[str, list[float]] = {c["name"]: [] for c in cases}
    clients = {p: httpx.Client(base_url=f"http://127.0.0.1:{p}", timeout=30)
               for p in {case.get("port", port) for case in cases}}  # a case may name its own
    with contextlib.ExitStack() as stack:
        for client in clients.values():
            stack.enter_context(client)
        for i in range(warmup + samples):
            for case in (cases if i % 2 == 0 else cases[::-1]):
                client = clients[case.get("port", port)]
                start = time.perf_counter()
                r = client.request(case["method"], case["path"], content=case.get("body"),
                                   headers={"content-type": "application/json"})
                elapsed = time.perf_counter() - start
                if r.status_code != 200 or (case.get("stream") and
                                            not r.content.endswith(b"data: [DONE]\n\n")):
                    raise RuntimeError(f"{case['name']}: {r.status_code} {r.content[:300]!r}")
                if i >= warmup:
                    times[case["name"]].append(elapsed * 1e6)
    return {name: percentiles(t) for name, t in times.items()}


async def _raw_connection(port: int, request: bytes, start_at: float, stop_at: float,
                          latencies: list[float], counts: list[int]) -> None:
    """HTTP/1.1 keep-alive by hand: a load generator cheap enough that the server saturates
    before it does."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while (begin := time.perf_counter()) < stop_at:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            lower = head.lower()
            at = lower.index(b"content-length:") + len(b"content-length:")
            await reader.readexactly(int(lower[at:lower.index(b"\r\n", at)]))
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(head.decode(errors="replace"))
            counts[0] += 1
            if begin >= start_at:
                latencies.append((time.perf_counter() - begin) * 1e6)
    finally:
        writer.close()


async def _httpx_connection(client, path: str, body: bytes, start_at: float, stop_at: float,
                            latencies: list[float], counts: list[int]) -> None:
    while (begin := time.perf_counter()) < stop_at:
        r = await client.post(path, content=body,
                              headers={"content-type": "application/json"})
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code} {r.text[:300]}")
        counts[0] += 1
        if begin >= start_at:
            latencies.append((time.perf_counter() - begin) * 1e6)


async def load_client(port: int, path: str, body: bytes, clients: int, seconds: float,
                      warmup_s: float, kind: str) -> dict:
    latencies: list[float] = []
    counts = [0]
    cpu0 = os.times()
    start_at = time.perf_counter() + warmup_s
    stop_at = start_at + seconds
    if kind == "raw":
        request = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
                   f"application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
        await asyncio.gather(*(_raw_connection(port, request, start_at, stop_at, latencies,
                                               counts) for _ in range(clients)))
    else:
        import httpx

        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits,
                                     timeout=30) as client:
            await asyncio.gather(*(_httpx_connection(client, path, body, start_at, stop_at,
                                                     latencies, counts) for _ in range(clients)))
    cpu1 = os.times()
    return {"requests": len(latencies), "total_requests": counts[0], "seconds": seconds,
            "latency_us": percentiles(latencies),
            "client_cpu_s": cpu1.user + cpu1.system - cpu0.user - cpu0.system,
            "client_wall_s": warmup_s + seconds}


def run_client(role: str, args: list[str], payload: dict) -> dict:
    proc = subprocess.run([sys.executable, str(ROUTER_OVERHEAD), "--client-role", role, *args],
                          input=json.dumps(payload), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{role} client failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def client_main(role: str) -> None:
    payload = json.loads(sys.stdin.read())
    for case in payload.get("cases", []):
        case["body"] = case["body"].encode() if case.get("body") else None
    if role == "latency":
        out = latency_client(payload["port"], payload["cases"], payload["samples"],
                             payload["warmup"])
    else:
        out = asyncio.run(load_client(payload["port"], payload["path"], payload["body"].encode(),
                                      payload["clients"], payload["seconds"],
                                      payload["warmup_s"], payload["kind"]))
    print(json.dumps(out))
