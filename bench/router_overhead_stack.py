"""The router under the overhead bench: the real PoolBackend + HTTP app over workers that answer
at once, with a bare echo route as the baseline, and the in-process pass that times its pieces."""

from __future__ import annotations

import asyncio
import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from pd_runtime.cpu_time import cpu_s, read_stat

ECHO_PATH = "/bench/echo"


def completion_body(model: str, prompt: str, max_tokens: int, stream: bool) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "stream": stream}).encode()


async def bare_echo(request: Request) -> JSONResponse:
    """The baseline route: reads the body, answers a fixed JSON, same middleware as the rest."""
    await request.body()
    return JSONResponse({"ok": True})


def build_stack(model_dir: str, num_prefill: int, num_decode: int, runs: bool = True):
    """`runs`: run records on (the product's default: SQLite under the user's data directory)
    or off (router.runs.enabled: false)."""
    from bench.instant_workers import InstantPool
    from pd_runtime.api import ModelCard
    from pd_runtime.config import ClusterConfig, PoolConfig
    from pd_runtime.model.model_config import context_limit, load_model_config
    from pd_runtime.tokenizer import Tokenizer, read_tokenizer_files
    from pd_runtime.entrypoints.openai.app import create_app
    from pd_runtime.router.core import PoolBackend

    cfg = ClusterConfig(model=model_dir, prefill=PoolConfig(num_workers=num_prefill),
                        decode=PoolConfig(num_workers=num_decode),
                        router={"runs": {"enabled": runs}})
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
    return cpu_s(read_stat(f"/proc/self/task/{native_id}/stat"))


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
    from pd_runtime.api import StreamChunk
    from pd_runtime.router.policy import decide
    from pd_runtime.entrypoints.openai.request_parsing.protocol import parse_json, prepare_completion
    from pd_runtime.entrypoints.openai.completion_bodies import ResponseBuilder
    from pd_runtime.entrypoints.openai.streaming import until_disconnect

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
        builder.add(0, StreamChunk(token_ids=[7], text=" the", finished=True,
                                   finish_reason="length", num_cached_tokens=0))
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
