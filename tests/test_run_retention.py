"""Retention of the run store (pd_runtime/gateway/retention.py) on every store, the embedded SQLite file and
a real PostgreSQL server: outputs and runs past their keep are deleted, runs in flight never, the
usage ledger's totals stay exact (each deleted run's usage added to its tenant's day once, even
with several processes trimming at once), a store of the previous schema keeps its outputs' ages;
and through the router's HTTP API, a run's output and record going at their configured keeps."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pd_runtime.gateway.stores.migrations import MIGRATIONS
from pd_runtime.gateway.open import open_store
from pd_runtime.gateway.retention import Retention
from pd_runtime.gateway.run_state import IN_FLIGHT, Runs, record_item
from pd_runtime.gateway.store import DAY_S
from pd_runtime.config import RouterConfig, TenantConfig
from tests.router_support.serving import assert_error_body, local

NOW = 1_796_000_000.0  # 2026-11-30, 06:13 UTC
HOUR = 3600.0


def _run(store, run_id: str, tenant: str, created_at: float, state: str = "completed",
         tokens=(10, 2, 5), output=None, key=None) -> None:
    row = Runs.new_run(tenant, run_id, idempotency_key=key, digest="body" if key else None,
                       now=created_at)
    row["state"] = state
    if state not in IN_FLIGHT:
        row.update(state=state, updated_at=created_at + 1.5, ended_at=created_at + 1.5)
        row.update(zip(("prompt_tokens", "cached_tokens", "output_tokens"), tokens))
    item = record_item(run_id, tenant, created_at, row, True, IN_FLIGHT, output)
    assert store.record([item]) == [True]


def _totals(store, tenant: str, since: float = 0.0, until: float = NOW + 1) -> dict:
    return store.usage_totals(tenant, since, until)


def test_outputs_and_runs_past_their_keep_go_and_the_ledger_keeps_their_usage(store_url):
    store = open_store(store_url)
    try:
        old = NOW - 3 * DAY_S
        _run(store, "old-a", "acme", old, output=("json", b"a"), key="k-old", tokens=(7, 3, 4))
        _run(store, "old-b", "acme", old + 5, state="failed")
        _run(store, "old-c", "beta", old + 9, tokens=(100, 0, 20))
        _run(store, "old-in-flight", "acme", old + 1, state="streaming")
        _run(store, "hour", "acme", NOW - 2 * HOUR, output=("sse", b"data: h\n\n"))
        _run(store, "new", "acme", NOW - 10, output=("json", b"n"))
        day = old // DAY_S * DAY_S
        windows = [(0.0, NOW + 1), (day, day + DAY_S), (NOW - DAY_S, NOW + 1)]
        before = {(t, w): _totals(store, t, *w) for t in ("acme", "beta") for w in windows}
        assert before[("acme", windows[0])]["runs"] == 3
        assert before[("acme", windows[1])] == {"runs": 1, "input_tokens": 7, "cached_tokens": 3,
                                                "output_tokens": 4, "duration_s": 1.5}

        for _ in range(2):  # a second pass finds nothing more and adds nothing twice
            Retention(store, keep_outputs_s=HOUR, keep_runs_s=DAY_S, batch=1).run_pass(NOW)
            for run_id in ("old-a", "old-b", "old-c"):
                assert store.get_run(run_id) is None and store.get_output(run_id) is None
            assert store.get_run("old-in-flight")["state"] == "streaming", "never in flight"
            assert store.get_run("hour")["state"] == "completed"
            assert store.get_output("hour") is None, "its output is past keep_outputs_s"
            assert store.get_output("new") == ("json", b"n")
            after = {(t, w): _totals(store, t, *w) for t in ("acme", "beta") for w in windows}
            assert after == before
        # The deleted run's Idempotency-Key is free again: a retry of it is a new run.
        run, created = Runs(store).create("acme", None, "k-old")
        assert created and run["id"] != "old-a"
    finally:
        store.close()


def test_processes_trimming_one_store_at_once_count_each_deleted_run_once(store_url):
    setup = open_store(store_url)
    old = NOW - 2 * DAY_S
    try:
        items = []
        for i in range(240):
            row = Runs.new_run("acme", f"run-{i:03d}", now=old + i)
            row.update(state="completed", updated_at=old + i + 1, ended_at=old + i + 1,
                       prompt_tokens=i, cached_tokens=1, output_tokens=2 * i)
            items.append(record_item(row["id"], "acme", old + i, row, True, IN_FLIGHT,
                                     ("json", b"x")))
        assert setup.record(items) == [True] * 240
        before = _totals(setup, "acme")
        assert before["runs"] == 240
    finally:
        setup.close()

    stores = [open_store(store_url) for _ in range(3)]
    start = threading.Barrier(len(stores))
    errors = []

    def trim(store):
        try:
            start.wait()
            Retention(store, keep_outputs_s=None, keep_runs_s=DAY_S, batch=7).run_pass(NOW)
        except Exception as exc:  # collected: a failure in a thread must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=trim, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    try:
        assert not errors, errors
        assert all(s.get_run(f"run-{i:03d}") is None for s in stores[:1] for i in range(240))
        assert _totals(stores[0], "acme") == before
    finally:
        for store in stores:
            store.close()


def test_a_store_of_schema_6_keeps_its_outputs_ages(store_url, monkeypatch):
    """Migration 7 copies each kept output's run creation time onto it: an old output goes
    at the first pass after the upgrade, a recent one stays."""
    from pd_runtime.gateway.stores import sql_store

    monkeypatch.setattr(sql_store, "MIGRATIONS", MIGRATIONS[:6])
    previous = open_store(store_url)
    with previous._tx() as db:
        for run_id, created_at in (("run-old", NOW - DAY_S), ("run-new", NOW - 60)):
            previous._exec(db, "INSERT INTO runs (id, tenant, state, created_at, updated_at) "
                           "VALUES (?, 'acme', 'completed', ?, ?)", (run_id, created_at,
                                                                     created_at))
            previous._exec(db, "INSERT INTO run_outputs VALUES (?, 'json', ?)",
                           (run_id, run_id.encode()))
    previous.close()
    monkeypatch.undo()
    store = open_store(store_url)
    try:
        assert store.schema_version == MIGRATIONS[-1][0]
        Retention(store, keep_outputs_s=HOUR, keep_runs_s=None).run_pass(NOW)
        assert store.get_output("run-old") is None
        assert store.get_output("run-new") == ("json", b"run-new")
        assert store.get_run("run-old") is not None, "runs are kept for good here"
    finally:
        store.close()


def test_a_keep_pass_every_quarter_of_the_shortest_keep():
    assert Retention(None, 1.0, 2.0).interval_s == 0.5
    assert Retention(None, 86400.0, 30 * 86400.0).interval_s == 60.0
    assert Retention(None, None, None).interval_s is None
    assert Retention(None, None, None).step() is False


TENANTS = [TenantConfig(tenant_id="acme", api_key="sk-acme")]
ACME = {"Authorization": "Bearer sk-acme"}


def _until(check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.2)


def _serve(llama_dir, tmp_path, **runs):
    # keep_finished 0: a retry reads the run from the store, not from this process's memory.
    config = RouterConfig(tenants=TENANTS, routing={"mode": "always_colocated"},
                          runs={"store": str(tmp_path / "runs.sqlite3"), "keep_finished": 0,
                                **runs})
    return local(llama_dir, config)


def test_through_the_router_an_output_then_its_run_go_at_their_keeps(llama_dir, tmp_path):
    with _serve(llama_dir, tmp_path, keep_outputs_s=1.0, keep_runs_s=3600.0) as (backend, port):
        base = f"http://127.0.0.1:{port}"
        body = {"model": backend.model_name, "prompt": "kept for a second", "max_tokens": 6,
                "temperature": 0}
        keyed = {**ACME, "Idempotency-Key": "short-keep"}
        first = httpx.post(f"{base}/v1/completions", json=body, headers=keyed, timeout=60)
        assert first.status_code == 200
        run_id = first.json()["id"]
        replayed = httpx.post(f"{base}/v1/completions", json=body, headers=keyed, timeout=60)
        assert replayed.content == first.content, "replayed from the store while kept"
        gone = _until(lambda: httpx.post(f"{base}/v1/completions", json=body, headers=keyed,
                                         timeout=60).status_code == 409)
        assert gone, "the output was not deleted within 30 s of a 1 s keep"
        error = assert_error_body(httpx.post(f"{base}/v1/completions", json=body,
                                             headers=keyed, timeout=60), 409)
        assert error["code"] == "output_not_kept" and "keep_outputs_s" in error["message"]
        record = httpx.get(f"{base}/v1/runs/{run_id}", headers=ACME).json()
        assert record["state"] == "completed", "the run itself is kept for an hour"

    with _serve(llama_dir, tmp_path / "2", keep_outputs_s=1.0, keep_runs_s=1.0) as (backend,
                                                                                       port):
        base = f"http://127.0.0.1:{port}"
        keyed = {**ACME, "Idempotency-Key": "gone-soon"}
        first = httpx.post(f"{base}/v1/completions", json=body, headers=keyed, timeout=60)
        run_id, tokens = first.json()["id"], first.json()["usage"]
        assert _until(lambda: httpx.get(f"{base}/v1/runs/{run_id}",
                                        headers=ACME).status_code == 404)
        usage = httpx.get(f"{base}/v1/usage", headers=ACME).json()
        assert usage["runs"] == 1 and usage["output_tokens"] == tokens["completion_tokens"]
        assert usage["input_tokens"] == tokens["prompt_tokens"]
        again = httpx.post(f"{base}/v1/completions", json=body, headers=keyed, timeout=60)
        assert again.status_code == 200 and again.json()["id"] != run_id, "the key is free"
        assert again.json()["choices"] == first.json()["choices"]
