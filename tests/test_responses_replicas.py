"""Stored and background responses across router replicas on one run store (two routers, each
over a scripted backend, sharing a SQLite file): a delete on one reaches what the other keeps
in memory, store: false stays unreadable everywhere, a cancel (asked of the owner through the
store) or a retry on the other replica answers as on the owner, and a background poll there reads the response as it runs."""

from __future__ import annotations

import contextlib
import json
import time

import httpx

from pd_runtime.config import RouterConfig
from pd_runtime.tokenizer import Tokenizer
from tests.router_support.scripted_backend import ScriptedBackend, token_chunk
from tests.router_support.serving import APPS, serving


def _words(n: int) -> list[dict]:
    return [token_chunk(f" w{i}", i + 1) for i in range(n)] + \
        [token_chunk(" end", n + 1, finished=True)]


@contextlib.contextmanager
def _two(llama_dir, tmp_path, words: int = 3, step_s: float = 0.0, **runs):
    """Replicas A and B: (A's base URL, B's, A's port)."""
    config = RouterConfig(routing={"mode": "always_colocated"},
                          runs={"store": str(tmp_path / "runs.sqlite3"), **runs})
    tokenizer = Tokenizer(llama_dir)
    with serving(ScriptedBackend(tokenizer, _words(words), step_s=step_s), config) as (_, a), \
            serving(ScriptedBackend(tokenizer, _words(words), step_s=step_s), config) as (_, b):
        yield f"http://127.0.0.1:{a}/v1", f"http://127.0.0.1:{b}/v1", a


def _flush(port: int) -> None:
    APPS[port].state.recorder.writer.flush()


def _error(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"].get("code")


def test_a_delete_on_one_replica_reaches_what_the_other_keeps(llama_dir, tmp_path):
    with _two(llama_dir, tmp_path) as (a, b, _):
        kept = httpx.post(f"{a}/responses", json={"input": "x"}).json()["id"]
        # Right after the response (its end may not be written yet): waited for, deleted.
        assert httpx.delete(f"{b}/responses/{kept}").status_code == 200
        for url in (f"{a}/responses/{kept}", f"{a}/responses/{kept}/input_items",
                    f"{b}/responses/{kept}"):
            assert _error(httpx.get(url)) == (404, "response_not_found"), url
        follow_up = httpx.post(f"{a}/responses", json={"input": "y",
                                                       "previous_response_id": kept})
        assert follow_up.status_code == 404
        assert httpx.delete(f"{a}/responses/{kept}").status_code == 404


def test_store_false_is_unreadable_on_every_replica(llama_dir, tmp_path):
    with _two(llama_dir, tmp_path) as (a, b, a_port):
        keyed = httpx.post(f"{a}/responses", json={"input": "secret", "store": False},
                           headers={"Idempotency-Key": "k1"}).json()["id"]
        streamed = httpx.post(f"{a}/responses", headers={"Accept": "text/event-stream"},
                              json={"input": "secret", "store": False, "stream": True})
        sse_id = json.loads(streamed.text.split("data: ", 1)[1].split("\n")[0])["response"]["id"]
        _flush(a_port)  # their outputs are kept (a retry, a resume): in the store too
        for response_id in (keyed, sse_id):
            for base in (a, b):
                for params in ({}, {"stream": "true"}):
                    got = httpx.get(f"{base}/responses/{response_id}", params=params)
                    assert got.status_code == 404, (base, params, got.text[:200])
            assert httpx.delete(f"{b}/responses/{response_id}").status_code == 404


def test_cancel_and_retry_on_the_other_replica(llama_dir, tmp_path):
    with _two(llama_dir, tmp_path, words=40, step_s=0.05) as (a, b, _):
        body = {"input": "x", "background": True}
        running = httpx.post(f"{a}/responses", json=body,
                             headers={"Idempotency-Key": "bg-1"}).json()
        assert running["status"] == "queued"
        # A retry with its key on B: the response as it stands, as JSON, at once.
        retry = httpx.post(f"{b}/responses", json=body, headers={"Idempotency-Key": "bg-1"})
        assert retry.headers["content-type"].startswith("application/json")
        assert retry.json()["id"] == running["id"]
        assert retry.json()["status"] in ("queued", "in_progress")
        # Polled on B while it runs on A: its snapshot.
        polled = httpx.get(f"{b}/responses/{running['id']}").json()
        assert polled["status"] in ("queued", "in_progress") and polled["background"] is True
        # Cancelled on B: asked of A through the store; A stops it, B answers once it ended.
        cancelled = httpx.post(f"{b}/responses/{running['id']}/cancel", timeout=30)
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled" and cancelled.json()["background"]
        record = httpx.get(f"{a}/runs/{running['id']}").json()
        assert record["state"] == "cancelled" and record["cancel_asked_at"] is not None
        assert record["output_tokens"] < 40  # stopped before its last word
        on_a = httpx.get(f"{a}/responses/{running['id']}").json()
        assert on_a["status"] == "cancelled" and on_a["output"] == cancelled.json()["output"]
        again = httpx.post(f"{b}/responses/{running['id']}/cancel")
        assert again.status_code == 200 and again.json()["status"] == "cancelled"
        finished = httpx.post(f"{a}/responses", json={"input": "y", "background": True}).json()
        deadline = time.monotonic() + 30
        while httpx.get(f"{a}/responses/{finished['id']}").json()["status"] in (
                "queued", "in_progress"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        ended = httpx.post(f"{b}/responses/{finished['id']}/cancel")
        assert _error(ended) == (409, "response_already_ended")
        foreground = httpx.post(f"{a}/responses", json={"input": "x"}).json()["id"]
        # Once B reads it ended (A writes its end in its next round: until then, B sees it
        # running there, and a cancel is response_elsewhere), a cancel is a 400.
        assert httpx.get(f"{b}/responses/{foreground}").json()["status"] == "incomplete"
        assert httpx.post(f"{b}/responses/{foreground}/cancel").status_code == 400


def test_a_cancel_on_the_other_replica_right_after_the_create(llama_dir, tmp_path):
    """Before the owner's first round has written the run (clients behind one port land on
    either replica): its row and opening are waited for, and it is cancelled."""
    with _two(llama_dir, tmp_path, words=200, step_s=0.1) as (a, b, _):
        for _ in range(3):
            made = httpx.post(f"{a}/responses", json={"input": "x", "background": True}).json()
            cancelled = httpx.post(f"{b}/responses/{made['id']}/cancel", timeout=30)
            assert cancelled.status_code == 200, cancelled.text
            assert cancelled.json()["status"] == "cancelled"
            assert httpx.get(f"{a}/responses/{made['id']}").json()["status"] == "cancelled"


def test_a_background_response_reads_queued_then_cancelled_and_deletes(llama_dir, tmp_path):
    """Before its first token it reads `queued`; cancelled, it reads `cancelled` on both
    replicas and can be deleted (it stores no conversation)."""
    with _two(llama_dir, tmp_path, words=200, step_s=1.0) as (a, b, a_port):
        response_id = httpx.post(f"{a}/responses", json={"input": "x", "background": True}
                                 ).json()["id"]
        assert httpx.get(f"{a}/responses/{response_id}").json()["status"] == "queued"
        assert httpx.post(f"{a}/responses/{response_id}/cancel").json()["status"] == "cancelled"
        _flush(a_port)
        for base in (a, b):
            assert httpx.get(f"{base}/responses/{response_id}").json()["status"] == "cancelled"
        assert httpx.delete(f"{b}/responses/{response_id}").status_code == 200
        assert httpx.get(f"{a}/responses/{response_id}").status_code == 404
