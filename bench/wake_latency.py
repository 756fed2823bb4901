"""Wake-up latency of the router's waiters: how long after the thing they wait for happens they
see it.

(a) run-record readers: a run of another router replica followed through the store (a resumed
    stream or retry: RunRecorder.wait_ready on its stub) and a stored response's end waited for
    (GET /v1/responses/{id}: responses_stored.stored). Time from the commit of the run's final
    row to the waiting reader returning, the writer in this process (the router's own record
    writer, a replica in the same process) or in another one (a replica of its own), on SQLite
    and PostgreSQL.
(b) the SLO queue (routing.mode slo, overload: queue): a request held at the router because the
    one before it fills the worker's queue; time from that request's first (and last) token to
    the held request's dispatch to the worker.
(c) a run's producer asked through the store by another replica: time from the commit of a
    cancel ask (POST /v1/responses/{id}/cancel on a replica that does not run it:
    store.ask_cancel) to the producing router's record writer handing it over
    (RunWriter.on_cancel_asked), the asker in this process or another one.

Run it against another tree with PYTHONPATH=<tree> (the `pd_runtime` it imports is printed).

    .venv/bin/python bench/wake_latency.py [--samples 50] [--postgres URL | --no-postgres]
        [--only records|asks|slo] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

# Last: a tree on PYTHONPATH (and its bench/, tests/) comes first; this tree's tests/ starts
# a throwaway PostgreSQL otherwise.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import pd_runtime  # noqa: E402

TENANT = "bench"


# --------------------------------------------------------------------------- (a) run records
def _end_item(run_id: str, created_at: float) -> dict:
    """The final row of a run as the record writer writes it: completed, with its output."""
    from pd_runtime.gateway.run_state import record_item
    from pd_runtime.gateway.store import IN_FLIGHT

    now = time.time()
    row = {"state": "completed", "updated_at": now, "ended_at": now, "output_tokens": 1}
    return record_item(run_id, TENANT, created_at, row, False, IN_FLIGHT, ("json", b"{}"))


class _Writer:
    """Writes runs' rows: a store of this process, or one in a child process of its own."""

    def __init__(self, url: str, other_process: bool):
        self.other_process = other_process
        if other_process:
            context = multiprocessing.get_context("spawn")
            self.conn, theirs = context.Pipe()
            self.process = context.Process(target=_write_elsewhere, args=(theirs, url),
                                           daemon=True)
            self.process.start()
            theirs.close()
            assert self.conn.recv() == "ready"
        else:
            from pd_runtime.gateway.open import open_store
            self.store = open_store(url)

    def call(self, what: str, run_id: str) -> float:
        """`what` ("create", "end" or "cancel": ask its producer to) the run; the monotonic time
        its commit returned."""
        if self.other_process:
            self.conn.send((what, run_id))
            return self.conn.recv()
        return _write(self.store, what, run_id)

    def close(self) -> None:
        if self.other_process:
            self.conn.send(None)
            self.process.join(10)
        else:
            self.store.close()


def _write(store, what: str, run_id: str) -> float:
    from pd_runtime.gateway.run_state import Runs

    if what == "create":
        Runs(store).create(TENANT, None, None, run_id, owner="bench-producer")
    elif what == "cancel":
        assert store.ask_cancel(run_id, time.time())
    else:
        store.record([_end_item(run_id, store.get_run(run_id)["created_at"])])
    return time.monotonic()  # system-wide on Linux: comparable across processes


def _write_elsewhere(conn, url: str) -> None:
    from pd_runtime.gateway.open import open_store

    store = open_store(url)
    conn.send("ready")
    while (message := conn.recv()) is not None:
        conn.send(_write(store, *message))
    store.close()


async def _one_wait(recorder, writer: _Writer, reader: str) -> float:
    """One run created, a reader waiting for its end, its end written after a random pause
    (so the reader is caught at every phase of any poll): seconds from the commit to the
    reader seeing it."""
    from pd_runtime.entrypoints.openai.responses import stored as responses_stored

    run_id = f"resp_{uuid.uuid4().hex}"
    await asyncio.to_thread(writer.call, "create", run_id)
    if reader == "follow":  # a resumed stream / retry on this replica: follows the stub
        live = await recorder.find(run_id, TENANT)
        assert live is not None and live.remote
        recorder.join(live)
        waiting = asyncio.ensure_future(recorder.wait_ready(live))
    else:  # GET of the stored response: its end waited for
        waiting = asyncio.ensure_future(responses_stored.stored(
            recorder, run_id, TENANT, with_output=True, wait_s=10.0))
    await asyncio.sleep(0.05 + random.random() * 0.1)
    assert not waiting.done()
    committed = await asyncio.to_thread(writer.call, "end", run_id)
    await waiting
    seen = time.monotonic()
    if reader == "follow":
        recorder.leave(live)
    return seen - committed


def bench_records(url: str, samples: int, other_process: bool, reader: str) -> dict:
    from pd_runtime.gateway.open import open_store
    from pd_runtime.gateway.recorder import RunRecorder

    recorder = RunRecorder(open_store(url), url, f"bench-reader-{os.getpid()}")
    writer = _Writer(url, other_process)

    async def run() -> list[float]:
        return [await _one_wait(recorder, writer, reader) for _ in range(samples)]

    try:
        latencies = asyncio.run(run())
    finally:
        writer.close()
        recorder.close()
    return _summary(latencies)


# --------------------------------------------------------------------------- (c) asks
def bench_asks(url: str, samples: int, other_process: bool) -> dict:
    """A producing router (RunRecorder) with one run open; another replica asks its cancel
    after a random pause (so the producer is caught at every phase of any poll): seconds from
    the ask's commit to the producer's writer handing the run over."""
    from pd_runtime.gateway.open import open_store
    from pd_runtime.gateway.recorder import RunRecorder

    recorder = RunRecorder(open_store(url), url, f"bench-producer-{os.getpid()}")
    asker = _Writer(url, other_process)
    handed: dict[str, float] = {}
    recorder.writer.on_cancel_asked = lambda live: handed.setdefault(live.id, time.monotonic())

    async def one() -> float:
        live, _ = await recorder.open(f"resp_{uuid.uuid4().hex}", TENANT, False, None, None)
        deadline = time.monotonic() + 10
        while await asyncio.to_thread(recorder.store.get_run, live.id) is None:
            assert time.monotonic() < deadline, "the run was never recorded"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05 + random.random() * 0.5)
        committed = await asyncio.to_thread(asker.call, "cancel", live.id)
        while live.id not in handed:
            assert time.monotonic() < deadline + 10, "the ask never reached the producer"
            await asyncio.sleep(0.0005)
        recorder.writer.ended(live)
        return handed[live.id] - committed

    async def run() -> list[float]:
        return [await one() for _ in range(samples)]

    try:
        latencies = asyncio.run(run())
    finally:
        asker.close()
        recorder.close()
    return _summary(latencies)


# --------------------------------------------------------------------------- (b) the SLO queue
class _HoldingPool:
    """InstantPool (bench/instant_workers.py) whose first request gives its one token only when
    `release` is set; it notes when that token went out and when each request was sent."""

    def __init__(self, pool):
        self.pool = pool
        self.release = asyncio.Event()
        self.freed_at = None
        self.sent_at: dict[str, float] = {}

    def __getattr__(self, name):
        return getattr(self.pool, name)

    async def generate(self, request_id, prompt, params, **kwargs):
        self.sent_at[request_id] = time.monotonic()
        if request_id.startswith("blocking"):
            await self.release.wait()
        async for chunk in self.pool.generate(request_id, prompt, params, **kwargs):
            if request_id.startswith("blocking"):
                self.freed_at = time.monotonic()
            yield chunk


def _slo_backend(model_dir: str):
    from bench.instant_workers import InstantPool
    from pd_runtime.api import ModelCard
    from pd_runtime.config import ClusterConfig, PoolConfig
    from pd_runtime.model.model_config import context_limit, load_model_config
    from pd_runtime.router.core import PoolBackend
    from pd_runtime.tokenizer import Tokenizer, read_tokenizer_files

    # One decode worker, no prefill worker: the blocking prompt's predicted prefill (the cost
    # model's defaults) fills the TTFT target, so the next request is held until it is done.
    cfg = ClusterConfig(model=model_dir, prefill=PoolConfig(num_workers=0),
                        decode=PoolConfig(num_workers=1),
                        router={"runs": {"enabled": False},
                                "routing": {"mode": "slo", "overload": "queue",
                                            "max_queue_s": 30.0,
                                            "slo": {"ttft_s": 0.05, "tpot_s": 10.0}}})
    token_id = Tokenizer(model_dir).encode(" the", add_special_tokens=False)[0]
    model = load_model_config(model_dir)
    card = ModelCard(model.identity, cfg.decode.engine.block_size,
                     context_limit(model, cfg.decode.engine.max_model_len, model_dir),
                     read_tokenizer_files(model_dir))
    pool = _HoldingPool(InstantPool(0, 1, token_id, " the", card,
                                    block_size=cfg.decode.engine.block_size))
    backend = PoolBackend(pool, cfg, model_dir)
    backend.start()
    return backend, pool


async def _one_hold(backend, pool, blocking_tokens: int, held_tokens: int) -> float:
    from pd_runtime.api import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def drain(request_id: str, tokens: int) -> list:
        return [chunk async for chunk in backend.generate(request_id, [7] * tokens, params)]

    blocking = asyncio.ensure_future(drain("blocking", blocking_tokens))
    while "blocking" not in pool.sent_at:
        await asyncio.sleep(0.001)
    held = asyncio.ensure_future(drain("held", held_tokens))
    await asyncio.sleep(0.05 + random.random() * 0.05)
    if "held" in pool.sent_at:
        raise RuntimeError("the second request was not held (the policy served it): raise "
                           "--blocking-tokens")
    pool.release.set()
    await asyncio.gather(blocking, held)
    return pool.sent_at["held"] - pool.freed_at


def bench_slo(model_dir: str, samples: int, blocking_tokens: int, held_tokens: int) -> dict:
    latencies = []
    for _ in range(samples):  # a router of its own each time: its ledgers start empty
        backend, pool = _slo_backend(model_dir)
        try:
            latencies.append(asyncio.run(_one_hold(backend, pool, blocking_tokens,
                                                   held_tokens)))
        finally:
            backend.stop()
    return _summary(latencies)


# --------------------------------------------------------------------------------------- main
def _summary(latencies: list[float]) -> dict:
    ms = sorted(x * 1000 for x in latencies)
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2),
            "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2),
            "max_ms": round(ms[-1], 2)}


def _model_dir(given: str | None) -> str:
    if given:
        return given
    from pd_runtime.model.tiny import make_tiny_model

    return str(make_tiny_model(Path(tempfile.mkdtemp(prefix="wake-latency-")), preset="test"))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--only", choices=("records", "asks", "slo"))
    parser.add_argument("--postgres", help="a PostgreSQL URL (default: a throwaway server)")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--model-dir", help="a model whose tokenizer the router loads "
                        "(default: a tiny one generated)")
    parser.add_argument("--blocking-tokens", type=int, default=2000)
    parser.add_argument("--held-tokens", type=int, default=16)
    parser.add_argument("--quick", action="store_true",
                        help="3 samples, SQLite in this process, the SLO queue")
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args(argv)
    samples = 3 if args.quick else args.samples
    results: dict = {"pd_runtime": pd_runtime.__file__}
    print(f"pd_runtime from {pd_runtime.__file__}", flush=True)
    if args.only in (None, "records"):
        results["records"] = _records(args, samples)
    if args.only in (None, "asks"):
        results["asks"] = _records(args, samples, asks=True)
    if args.only in (None, "slo"):
        model_dir = _model_dir(args.model_dir)
        results["slo_queue"] = bench_slo(model_dir, samples, args.blocking_tokens,
                                         args.held_tokens)
        print(f"slo queue: {results['slo_queue']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


def _records(args, samples: int, asks: bool = False) -> dict:
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp, _postgres(args) as pg_url:
        stores = {"sqlite": lambda: f"sqlite://{Path(tmp) / f'{uuid.uuid4().hex}.sqlite3'}"}
        if pg_url is not None:
            stores["postgresql"] = pg_url
        for store, url in stores.items():
            for writer in (("this_process",) if args.quick else
                           ("this_process", "other_process")):
                for reader in (("cancel",) if asks else ("follow", "stored")):
                    name = f"{store}/{writer}/{reader}"
                    if asks:
                        out[name] = bench_asks(url(), samples, writer == "other_process")
                    else:
                        out[name] = bench_records(url(), samples, writer == "other_process",
                                                  reader)
                    print(f"run records {name}: {out[name]}", flush=True)
    return out


class _postgres:
    """The URL factory of a fresh database per case: --postgres's, a throwaway server's
    (tests/postgres_server.py), or None (--no-postgres, --quick)."""

    def __init__(self, args):
        self.args = args
        self.server = None

    def __enter__(self):
        if self.args.no_postgres or self.args.quick:
            return None
        if self.args.postgres:
            return lambda: self.args.postgres
        from tests.postgres_server import running_server

        self.server = running_server()
        server = self.server.__enter__()
        return server.create_database

    def __exit__(self, *exc):
        if self.server is not None:
            self.server.__exit__(*exc)


if __name__ == "__main__":
    main()
