"""Router overhead: the latency the router adds per request and the rate it sustains alone, with
the real PoolBackend + HTTP app under uvicorn in front of workers that answer at once.

    python bench/router_overhead.py [--model DIR] [--samples 1000] [--clients 32] [--seconds 8]
                                    [--profile] [--log-level INFO]

Added latency = POST /v1/completions (max_tokens=1) minus a bare POST echo route mounted on the
same app, server and client; the clients run in a separate process so the server thread has the
interpreter to itself. An in-process pass (no sockets) shows where the router's time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ECHO_PATH = "/bench/echo"
TARGET_ADDED_P50_US = 1000.0


def percentiles(samples: list[float], qs=(50, 90, 99)) -> list[float]:
    ordered = sorted(samples)
    return [ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))] for q in qs]


def completion_body(model: str, prompt: str, max_tokens: int, stream: bool) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "stream": stream}).encode()


# ---------------------------------------------------------------------------------- clients
# Run as `--client-role latency|load` in a child process; they print one JSON line.
def latency_client(port: int, cases: list[dict], samples: int, warmup: int) -> dict:
    """Sequential requests on one keep-alive connection, the cases interleaved so that noise from
    other jobs on the box falls on all of them alike."""
    import httpx

    times: dict[str, list[float]] = {c["name"]: [] for c in cases}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        for i in range(warmup + samples):
            for case in cases:
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
    proc = subprocess.run([sys.executable, __file__, "--client-role", role, *args],
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


# ---------------------------------------------------------------------------------- the stack
async def bare_echo(request: Request) -> JSONResponse:
    """The baseline route: reads the body, answers a fixed JSON, same middleware as the rest."""
    await request.body()
    return JSONResponse({"ok": True})


def build_stack(model_dir: str, num_prefill: int, num_decode: int):
    from bench.instant_workers import InstantPool
    from pd_runtime.api import ModelCard
    from pd_runtime.config import ClusterConfig, PoolConfig
    from pd_runtime.model.model_config import context_limit, load_model_config
    from pd_runtime.tokenizer import Tokenizer, read_tokenizer_files
    from router.app import create_app
    from router.core import PoolBackend

    cfg = ClusterConfig(model=model_dir, prefill=PoolConfig(num_workers=num_prefill),
                        decode=PoolConfig(num_workers=num_decode))
    token_id = Tokenizer(model_dir).encode(" the", add_special_tokens=False)[0]
    model = load_model_config(model_dir)
    card = ModelCard(model.identity, cfg.decode.engine.block_size,  # as a worker reports it
                     context_limit(model, cfg.decode.engine.max_model_len, model_dir),
                     read_tokenizer_files(model_dir))
    pool = InstantPool(num_prefill, num_decode, token_id, " the", card,
                       block_size=cfg.decode.engine.block_size)
    backend = PoolBackend(pool, cfg, model_dir)
    backend.start()
    app = create_app(backend, cfg.router)
    app.add_api_route(ECHO_PATH, bare_echo, methods=["POST"])
    return backend, app, cfg


def thread_cpu_s(native_id: int) -> float:
    """utime + stime of one thread of this process (Linux)."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------- in process
async def asgi_call(app, method: str, path: str, body: bytes = b"") -> bytes:
    """One request straight into the ASGI app: the framework and the router, no socket."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80),
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    delivered = False
    out = bytearray()
    status = []

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.get_running_loop().create_future()  # the client never leaves

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])
        else:
            out.extend(message.get("body", b""))

    await app(scope, receive, send)
    if status != [200]:
        raise RuntimeError(f"{path}: {status} {bytes(out[:300])!r}")
    return bytes(out)


async def stage_timings(backend, app, prompt: str, iterations: int) -> list[tuple[str, list]]:
    """(stage, per-call µs samples) for each piece of a completion request, then the whole."""
    from router.policy import decide
    from router.protocol import parse_json, prepare_completion
    from router.responses import ResponseBuilder
    from router.streaming import until_disconnect

    tok, name, limit = backend.tokenizer, backend.model_name, backend.max_model_len
    raw = completion_body(name, prompt, 1, False)
    data = parse_json(raw)
    prepared = prepare_completion(data, tok, name, limit)
    ids, params = prepared.prompts[0], prepared.choices[0].params
    long_ids = (ids * (1024 // len(ids) + 1))[:1024]
    metrics = backend.metrics

    async def drain():
        async for _ in backend.generate("bench-0", ids, params):
            pass

    def build_response():
        builder = ResponseBuilder(prepared, "cmpl-bench", tok)
        builder.add(0, {"token_ids": [7], "text": " the", "finished": True,
                        "finish_reason": "length", "logprobs": None, "num_cached_tokens": 0})
        return JSONResponse(builder.final_body()).body

    def metric_updates():  # what PoolBackend.generate records for one finished request
        metrics.decisions.labels("colocated", "short_prompt").inc()
        metrics.ttft.labels("colocated").observe(1e-4)
        metrics.queue.labels("colocated").observe(0.0)
        metrics.requests.labels("colocated", "ok").inc()
        metrics.e2e.labels("colocated").observe(1e-4)

    async def never_leaves():
        await asyncio.get_running_loop().create_future()

    async def noop():
        pass

    states = (backend._states(backend.client.decode), backend._states(backend.client.prefill))
    sync_stages = [
        ("parse_json (body -> dict)", lambda: parse_json(raw)),
        (f"tokenize prompt ({len(ids)} tokens)", lambda: tok.encode(prompt)),
        ("prepare_completion (validate+tokenize)",
         lambda: prepare_completion(data, tok, name, limit)),
        ("prefix hashes, this prompt", lambda: backend.index.hashes(ids, None)),
        ("prefix hashes, 1024-token prompt", lambda: backend.index.hashes(long_ids, None)),
        ("routing policy (decide)",
         lambda: decide(len(ids), states[0], states[1], {}, backend.reloader.current,
                        backend._rng)),
        ("metric updates (5 per request)", metric_updates),
        ("response: builder + JSON body", build_response),
    ]
    async_stages = [
        ("PoolBackend.generate, drained", drain),
        ("until_disconnect around no-op work", lambda: until_disconnect(never_leaves, noop())),
        ("ASGI in-process: POST echo", lambda: asgi_call(app, "POST", ECHO_PATH, raw)),
        ("ASGI in-process: completion",
         lambda: asgi_call(app, "POST", "/v1/completions", raw)),
        ("ASGI in-process: completion, stream",
         lambda: asgi_call(app, "POST", "/v1/completions",
                           completion_body(name, prompt, 1, True))),
    ]
    results = []
    for label, fn in sync_stages:
        samples = []
        for _ in range(iterations + iterations // 10):  # the first tenth warms caches
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e6)
        results.append((label, samples[iterations // 10:]))
    for label, fn in async_stages:
        samples = []
        for _ in range(iterations + iterations // 10):
            start = time.perf_counter()
            await fn()
            samples.append((time.perf_counter() - start) * 1e6)
        results.append((label, samples[iterations // 10:]))
    return results


def profile_completions(app, body: bytes, requests: int, top: int = 25) -> None:
    import cProfile
    import io
    import pstats

    async def loop():
        for _ in range(requests):
            await asgi_call(app, "POST", "/v1/completions", body)

    profiler = cProfile.Profile()
    profiler.enable()
    asyncio.run(loop())
    profiler.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(top)
        body_lines = text.getvalue().splitlines()
        start = next(i for i, line in enumerate(body_lines) if "ncalls" in line)
        print(f"\n## cProfile, {requests} in-process completions, top {top} by {order}")
        print("\n".join(line for line in body_lines[start:] if line.strip()))


def sustained(port: int, tid: int, path: str, body: str, args) -> dict:
    """Load from a child process; the server thread's CPU per request is the robust figure on a
    shared box, where the rate moves with other jobs."""
    payload = {"port": port, "path": path, "body": body, "clients": args.clients,
               "seconds": args.seconds, "warmup_s": 1.0, "kind": args.load_client}
    cpu0 = thread_cpu_s(tid)
    out = run_client("load", [], payload)
    server_cpu = thread_cpu_s(tid) - cpu0
    wall = out["client_wall_s"]
    return {**out, "rate": out["requests"] / out["seconds"],
            "server_cpu_share": server_cpu / wall,
            "cpu_us_per_request": server_cpu / out["total_requests"] * 1e6,
            "client_cpu_share": out["client_cpu_s"] / wall}


# ---------------------------------------------------------------------------------- main
def http_stack_line() -> str:
    import importlib.util

    import uvicorn

    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return f"uvicorn {uvicorn.__version__} ({http}, {loop} loop)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded bench model")
    ap.add_argument("--prompt", default="The capital of France is a city called")
    ap.add_argument("--prefill-workers", type=int, default=1)
    ap.add_argument("--decode-workers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=1000, help="sequential requests per case")
    ap.add_argument("--stages", type=int, default=2000, help="in-process calls per stage")
    ap.add_argument("--clients", type=int, default=32, help="concurrent load connections")
    ap.add_argument("--seconds", type=float, default=8.0, help="load duration per route")
    ap.add_argument("--load-client", choices=["raw", "httpx"], default="raw",
                    help="raw: hand-written HTTP/1.1 (cheap); httpx: httpx.AsyncClient")
    ap.add_argument("--profile", action="store_true", help="cProfile in-process completions")
    ap.add_argument("--log-level", default="WARNING",
                    help="router logging level; INFO (what `pd-runtime serve` uses) logs one "
                         "line per request, written here to /dev/null")
    ap.add_argument("--client-role", choices=["latency", "load"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client_role:
        return client_main(args.client_role)

    from bench.common import bench_model, machine_line
    from router.server import start_in_thread

    logging.basicConfig(level=args.log_level.upper(), stream=open(os.devnull, "w"))
    model = bench_model(args.model)
    backend, app, cfg = build_stack(model, args.prefill_workers, args.decode_workers)
    name = backend.model_name
    print(f"# {machine_line()}, {os.cpu_count()} CPUs")
    print(f"# {http_stack_line()}, {args.prefill_workers} prefill + {args.decode_workers} "
          f"decode instant workers, model {name}, log level {args.log_level.upper()}")

    # 1. In process: where the time goes, no sockets.
    stages = asyncio.run(stage_timings(backend, app, args.prompt, args.stages))
    print(f"\n## In process (no HTTP), µs per call over {args.stages} calls")
    print(f"{'stage':<42} {'p50':>8} {'p99':>8}")
    for label, samples in stages:
        p50, p99 = percentiles(samples, (50, 99))
        print(f"{label:<42} {p50:>8.1f} {p99:>8.1f}")
    in_proc = {label: percentiles(s, (50,))[0] for label, s in stages}
    router_in_proc = in_proc["ASGI in-process: completion"] - in_proc["ASGI in-process: POST echo"]
    print(f"{'router work (completion - echo, ASGI)':<42} {router_in_proc:>8.1f}")

    server, port = start_in_thread(app)
    tid = server.thread.native_id
    try:
        # 2. Sequential latency over HTTP.
        body = completion_body(name, args.prompt, 1, False).decode()
        cases = [
            {"name": "GET /health", "method": "GET", "path": "/health"},
            {"name": f"POST {ECHO_PATH} (bare route)", "method": "POST", "path": ECHO_PATH,
             "body": body},
            {"name": "POST /v1/completions, 1 token", "method": "POST",
             "path": "/v1/completions", "body": body},
            {"name": "  same, stream", "method": "POST", "path": "/v1/completions",
             "body": completion_body(name, args.prompt, 1, True).decode(), "stream": True},
            {"name": "  stream, 16 tokens", "method": "POST", "path": "/v1/completions",
             "body": completion_body(name, args.prompt, 16, True).decode(), "stream": True},
        ]
        lat = run_client("latency", [], {"port": port, "cases": cases, "samples": args.samples,
                                         "warmup": max(20, args.samples // 10)})
        print(f"\n## Sequential latency over HTTP, µs (httpx.Client keep-alive in another "
              f"process, {args.samples} of each, interleaved)")
        print(f"{'request':<42} {'p50':>8} {'p90':>8} {'p99':>8}")
        for case in cases:
            p50, p90, p99 = lat[case["name"]]
            print(f"{case['name']:<42} {p50:>8.0f} {p90:>8.0f} {p99:>8.0f}")
        bare = lat[cases[1]["name"]]
        added = {c["name"].strip(): [x - y for x, y in zip(lat[c["name"]], bare)]
                 for c in cases[2:]}
        print(f"{'router added = row - bare route':<42} {'p50':>8} {'':>8} {'p99':>8}")
        for label, (a50, _, a99) in added.items():
            print(f"{'  ' + label:<42} {a50:>8.0f} {'':>8} {a99:>8.0f}")

        # 3. Sustained rate: the bare route first gives the HTTP stack's own share.
        print(f"\n## Sustained: {args.clients} concurrent {args.load_client} clients, "
              f"{args.seconds:g} s each (+1 s warm-up), max_tokens=1")
        print(f"{'route':<32} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'server CPU':>11} "
              f"{'CPU µs/req':>11} {'client CPU':>11}")
        loads = {path: sustained(port, tid, path, body, args)
                 for path in (ECHO_PATH, "/v1/completions")}
        for path, r in loads.items():
            print(f"{path:<32} {r['rate']:>7.0f} {r['latency_us'][0] / 1e3:>7.2f} "
                  f"{r['latency_us'][2] / 1e3:>7.2f} {r['server_cpu_share']:>11.0%} "
                  f"{r['cpu_us_per_request']:>11.0f} {r['client_cpu_share']:>11.0%}")
        completion = loads["/v1/completions"]
        router_cpu = completion["cpu_us_per_request"] - loads[ECHO_PATH]["cpu_us_per_request"]
        print(f"router CPU per request (completions - bare route): {router_cpu:.0f} µs; one "
              f"free core would sustain ~{1e6 / completion['cpu_us_per_request']:.0f} "
              f"completions/s (server CPU share is of one core over the client's run)")
    finally:
        server.stop()
        backend.stop()

    added_p50 = added["POST /v1/completions, 1 token"][0]
    verdict = "meets" if added_p50 < TARGET_ADDED_P50_US else "MISSES"
    print(f"\nverdict: the router adds {added_p50:.0f} µs at p50 over a bare route on the same "
          f"server (in process, no sockets: {router_in_proc:.0f} µs; CPU under load: "
          f"{router_cpu:.0f} µs/request); {verdict} the < {TARGET_ADDED_P50_US:.0f} µs p50 "
          "target")
    if args.profile:
        profile_completions(app, completion_body(name, args.prompt, 1, False), 3000)


if __name__ == "__main__":
    main()
