"""The router's run record writer (pd_runtime/gateway/record_writer.py) against a real store: the
replica's keep-alive and lease from its writer process, the rounds' hand-over between the
serving loop and the writer thread (a run's end before its start, a run caught between its
final state and its hand-over), and a round that could not be written (retried, backing off,
given up at shutdown, bounded while the store fails), and a PostgreSQL outage under a serving
router: no request lost, every record written once the database is back."""

from __future__ import annotations

import time

import pytest

from pd_runtime.gateway.live_run import LiveRun
from pd_runtime.gateway.open import open_store
from pd_runtime.gateway.record_writer import RunWriter
from pd_runtime.gateway.run_state import Runs


def test_the_record_writer_process_keeps_its_replica_alive_and_fails_lapsed_runs(store_url):
    store = open_store(store_url)
    runs = Runs(store)
    try:
        runs.create("acme", run_id="run-ghost", owner="gone:8000/1")
        store.owner_seen("gone:8000/1", time.time() - 60)
        writer = RunWriter(store_url, "here:8000/0", owner_lease_s=0.6)
        try:
            deadline = time.monotonic() + 20
            while runs.get("run-ghost")["state"] != "failed" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert runs.get("run-ghost")["state"] == "failed"
            seen = store._exec(store._db(), "SELECT seen_at FROM run_owners WHERE name = ?",
                               ("here:8000/0",)).fetchone()
            assert seen is not None and time.time() - seen[0] < 5
        finally:
            writer.close()
    finally:
        store.close()


def test_a_run_whose_end_is_written_before_its_start_is_not_held_open(tmp_path):
    """The serving loop may run between the writer's two swaps: a run's end then lands in a
    round before its start. Its final row is written once and the writer holds nothing open
    (a run held open would keep the writer thread cycling and the run in memory)."""
    url = f"sqlite://{tmp_path / 'runs.sqlite3'}"
    writer = RunWriter(url, "here:8000/0")
    try:
        live = LiveRun("run-raced", "acme", False)
        live.info.update(prefilling_at=live.created_at, streaming_at=live.created_at,
                         ended_at=live.created_at, prompt_tokens=3, output_tokens=2)
        live.state, live.done = "completed", True
        first = writer._items([], [live])  # its end, this round
        second = writer._items([live], [])  # its start, the next
        assert [item["row"]["state"] for _, _, item in first] == ["completed"]
        assert second == []
        assert not writer._open
    finally:
        writer.close()


def _live_run(run_id: str, state: str, done: bool):
    live = LiveRun(run_id, "acme", False)
    live.info.update(prefilling_at=live.created_at, streaming_at=live.created_at,
                     prompt_tokens=3, output_tokens=2)
    if state == "completed":
        live.info["ended_at"] = live.created_at
        live.kept_output = ("json", b'{"id": "' + run_id.encode() + b'"}')
    live.state, live.done = state, done
    return live


def test_a_run_caught_between_its_final_state_and_its_hand_over_is_written_by_its_end(
        tmp_path):
    """finish() sets the final state before it hands the run over as ended: a round reading
    the run in that gap leaves it to the ended round, which writes the final row with its
    output (written by the in-flight pass, the output was lost and the end refused)."""
    url = f"sqlite://{tmp_path / 'runs.sqlite3'}"
    writer = RunWriter(url, "here:8000/0")
    try:
        live = _live_run("run-gap", "streaming", False)
        assert [i["row"]["state"] for _, _, i in writer._items([live], [])] == ["streaming"]
        live.kept_output = ("json", b'{"id": "run-gap"}')
        live.info["ended_at"] = live.created_at
        live.state = "completed"  # finish() is between advance() and ended()
        assert writer._items([], []) == []
        live.done = True
        [(_, _, item)] = writer._items([], [live])
        assert item["row"]["state"] == "completed" and item["output"] is not None
    finally:
        writer.close()


def _fail_first_round(writer: RunWriter) -> list[int]:
    """The writer's first round fails as if its process died; the rows each round held."""
    real, rounds = writer._record, []

    def failing_once(items, *rest):
        rounds.append(len(items))
        if len(rounds) == 1:
            raise OSError("the writer process is gone")
        return real(items, *rest)

    writer._record = failing_once
    return rounds


def test_a_round_that_could_not_be_written_goes_again_with_the_next(tmp_path):
    url = f"sqlite://{tmp_path / 'runs.sqlite3'}"
    writer = RunWriter(url, "here:8000/0")
    calls = _fail_first_round(writer)
    store = open_store(url)
    try:
        live = _live_run("run-retried", "completed", True)
        writer.ended(live)
        writer.flush()
        writer.flush()
        assert calls[:2] == [1, 1] and writer.failures == 1
        assert store.get_run("run-retried")["state"] == "completed"
        assert store.get_output("run-retried") == live.kept_output
        assert Runs(store).usage("acme")["runs"] == 1
    finally:
        writer.close()
        store.close()


def test_a_store_that_keeps_failing_is_retried_less_and_less_often_and_shutdown_ends(tmp_path):
    writer = RunWriter(f"sqlite://{tmp_path / 'runs.sqlite3'}", "here:8000/0")
    calls = []

    def failing(items, *rest):
        calls.append(time.monotonic())
        raise OSError("the store is unreachable")

    writer._record = failing
    writer.ended(_live_run("run-stuck", "completed", True))
    time.sleep(1.2)
    # Rounds 50, 100, 200, 400, 800 ms apart: 4-5 tries in 1.2 s (every 50 ms: 24).
    assert 2 <= len(calls) <= 6, len(calls)
    started = time.monotonic()
    writer.close(timeout_s=10)
    assert time.monotonic() - started < 8 and not writer._thread.is_alive()


def test_rows_waiting_for_a_failing_store_are_bounded_and_written_when_it_returns(
        tmp_path, monkeypatch):
    """While the store fails, ended runs wait as their rows (not their whole LiveRun), the
    oldest outputs let go past the byte bound and the oldest rows past the run bound, each
    counted; when the store returns, the backlog is written a bounded number of rows a round."""
    import pd_runtime.gateway.record_writer as record_writer

    output_bytes = len(_live_run("run-00", "completed", True).kept_output[1])
    monkeypatch.setattr(record_writer, "WAITING_RUNS", 8)
    monkeypatch.setattr(record_writer, "WAITING_OUTPUT_BYTES", 5 * output_bytes)
    monkeypatch.setattr(record_writer, "ROUND_MAX", 3)
    monkeypatch.setattr(record_writer, "BACKOFF_MAX_S", 0.05)
    url = f"sqlite://{tmp_path / 'runs.sqlite3'}"
    writer = RunWriter(url, "here:8000/0", linger_s=0.01)
    real, sizes, down = writer._record, [], [True]

    def until_back(items, *rest):
        sizes.append(len(items))
        if down[0]:
            raise OSError("the store is unreachable")
        return real(items, *rest)

    writer._record = until_back
    store = open_store(url)
    try:
        for i in range(12):
            writer.ended(_live_run(f"run-{i:02d}", "completed", True))
            writer.flush()
        assert writer.runs_dropped == 4 and len(writer._waiting) == 8
        assert writer.outputs_dropped == 7, "runs 0-6 lost their outputs (0-3 then went whole)"
        assert not writer._ended, "what waits is rows, not the runs"
        down[0] = False
        deadline = time.monotonic() + 20
        while writer._waiting and time.monotonic() < deadline:
            writer.flush()
        assert not writer._waiting
        assert max(sizes[-3:]) <= 3, "a backlog goes a bounded number of rows a round"
        for i in range(12):
            record, output = store.get_run(f"run-{i:02d}"), store.get_output(f"run-{i:02d}")
            if i < 4:
                assert record is None, "let go unrecorded"
            else:
                assert record["state"] == "completed"
                assert (output is not None) == (i >= 7), i
        assert Runs(store).usage("acme")["runs"] == 8
    finally:
        writer.close()
        store.close()


def test_a_database_outage_costs_no_request_and_no_record(llama_dir):
    """PostgreSQL stopped under a serving router: every request without an Idempotency-Key is
    answered; one with a key (its claim must be written first), a run's record and the usage
    ledger get 503 store_unavailable with Retry-After, not a 500; the ended runs' rows wait in
    the router (seen in /metrics). Once the database is back, the first read is answered (the
    dropped connection replaced) and the writer's process writes every waiting row."""
    import httpx

    from pd_runtime.config import RouterConfig
    from pd_runtime.tokenizer import Tokenizer
    from tests.postgres_server import running_server
    from tests.router_support.scripted_backend import ScriptedBackend, token_chunk
    from tests.router_support.serving import APPS, assert_error_body, serving

    with running_server() as server:
        url = server.create_database()
        backend = ScriptedBackend(Tokenizer(llama_dir), [token_chunk("a"),
                                                         token_chunk("b", finished=True)])
        with serving(backend, RouterConfig(runs={"store": url})) as (_, port):
            writer = APPS[port].state.recorder.writer
            base = f"http://127.0.0.1:{port}"

            def ask() -> str:
                answer = httpx.post(f"{base}/v1/completions", timeout=30,
                                    json={"model": "scripted", "prompt": "x", "max_tokens": 2})
                assert answer.status_code == 200, answer.text
                return answer.json()["id"]

            ids = [ask()]
            writer.flush()
            server.pause()
            ids += [ask() for _ in range(20)]
            keyed = httpx.post(f"{base}/v1/completions", timeout=30,
                               headers={"Idempotency-Key": "during-the-outage"},
                               json={"model": "scripted", "prompt": "x", "max_tokens": 2})
            for answer in (keyed, httpx.get(f"{base}/v1/runs/{ids[0]}"),
                           httpx.get(f"{base}/v1/usage")):
                error = assert_error_body(answer, 503)
                assert error["code"] == "store_unavailable" and answer.headers["retry-after"]
            writer.flush()
            assert writer.failures >= 1 and writer.waiting >= 1
            assert f"pd_run_records_waiting {float(writer.waiting)}" in \
                httpx.get(f"{base}/metrics").text
            server.resume()
            assert httpx.get(f"{base}/v1/runs/{ids[0]}").json()["state"] == "completed"
            deadline = time.monotonic() + 30
            while writer.waiting and time.monotonic() < deadline:
                time.sleep(0.1)
            assert writer.waiting == 0 and writer.runs_dropped == 0
            store = open_store(url)
            try:
                assert all(store.get_run(run_id)["state"] == "completed" for run_id in ids)
                assert Runs(store).usage("anonymous")["runs"] == 21
            finally:
                store.close()


def test_a_round_committed_whose_answer_was_lost_is_written_right_again(tmp_path):
    """The writer process committed a round and died before answering (or a COMMIT's reply was
    lost): the writer sends the round's rows again, a run in flight then as new; its row is
    there, so it is moved on, and the run's end is recorded and billed once."""
    url = f"sqlite://{tmp_path / 'runs.sqlite3'}"
    writer = RunWriter(url, "here:8000/0", linger_s=0.01)
    real, lose_answer = writer._record, [True]

    def answer_lost_once(*args):
        answer = real(*args)  # committed
        if lose_answer[0]:
            lose_answer[0] = False
            raise EOFError("the writer process died after its COMMIT")
        return answer

    writer._record = answer_lost_once
    store = open_store(url)
    try:
        live = LiveRun("run-1", "acme", False)
        live.state = "prefilling"
        live.info["prefilling_at"] = time.time()
        writer.begun(live)
        writer.flush()
        assert store.get_run("run-1")["state"] == "prefilling" and live.stored is None
        live.info.update(streaming_at=time.time(), ended_at=time.time(), prompt_tokens=5,
                         output_tokens=3)
        live.kept_output = ("json", b"{}")
        live.state, live.done = "completed", True
        writer.ended(live)
        writer.flush()
        writer.flush()
        assert store.get_run("run-1")["state"] == "completed"
        assert store.get_output("run-1") == ("json", b"{}")
        assert Runs(store).usage("acme") == {**Runs(store).usage("acme"), "runs": 1,
                                             "input_tokens": 5, "output_tokens": 3}
        assert writer.failures == 1, "the lost answer only; no row refused after it"
    finally:
        writer.close()
        store.close()


def test_after_a_database_outage_no_replica_is_judged_lapsed_until_it_could_renew(tmp_path):
    """Through an outage no replica can renew its lease. When the database is back, a replica
    whose own beats failed judges the others only after it has been seen for a whole lease
    itself (they renew meanwhile), not at its first beat back, which failed the runs of every
    replica slower to reconnect and lost their records and usage."""
    from tests.postgres_server import running_server

    lease_s = 3.0
    with running_server() as server:
        url = server.create_database()
        store = open_store(url)
        runs = Runs(store)
        other, _ = runs.create("acme", owner="slow:8000/0")  # a run of a replica still alive
        store.owner_seen("slow:8000/0", time.time())
        store.close()
        writer = RunWriter(url, "here:8000/0", owner_lease_s=lease_s)
        try:
            time.sleep(lease_s / 3)  # a beat of ours before the outage
            server.pause()
            time.sleep(lease_s + 1.0)
            server.resume()
            back = time.monotonic()
            store = open_store(url)
            runs = Runs(store)
            while time.monotonic() - back < lease_s - 0.5:
                assert runs.get(other["id"])["state"] == "queued", \
                    f"failed {time.monotonic() - back:.1f} s after the database came back"
                time.sleep(0.2)
            # The other replica never renews: a lease after our own renewal, its run is failed.
            deadline = time.monotonic() + 3 * lease_s
            while runs.get(other["id"])["state"] != "failed" and time.monotonic() < deadline:
                time.sleep(0.2)
            assert runs.get(other["id"])["state"] == "failed"
            store.close()
        finally:
            writer.close()


@pytest.mark.parametrize("signal_name, lives, failures", [("SIGINT", True, 0),
                                                          ("SIGTERM", False, 1)])
def test_the_last_round_goes_through_after_a_signal_to_the_process_group(
        tmp_path, signal_name, lives, failures):
    """Ctrl-C signals the terminal's whole process group: the writer's process ignores it and
    writes the router's last round. A service manager's SIGTERM to the group ends it at once:
    the last round finds it gone and goes once more through a new one."""
    import os
    import signal

    url = f"sqlite://{tmp_path / 'runs.sqlite3'}"
    writer = RunWriter(url, "here:8000/0")
    store = open_store(url)
    try:
        writer.ended(_live_run("run-first", "completed", True))
        writer.flush()  # answered: the process is serving, its handlers set
        os.kill(writer._process.pid, getattr(signal, signal_name))
        writer._process.join(0.5)
        assert writer._process.is_alive() == lives
        writer.ended(_live_run("run-last", "completed", True))
        writer.close()
        assert store.get_run("run-last")["state"] == "completed"
        assert writer.failures == failures
    finally:
        writer.close()
        store.close()

def test_a_background_runs_opening_is_written_by_the_round_after_a_failed_one(tmp_path):
    """The opening event rides on a run's first rows; a round that could not be written
    carries it again in the next (it was marked written when the round was made)."""
    url = f"sqlite://{tmp_path / 'runs.sqlite3'}"
    writer = RunWriter(url, "here:8000/0", linger_s=0.01)
    rounds = _fail_first_round(writer)
    store = open_store(url)
    try:
        live = LiveRun("resp_bg", "acme", True)
        live.background = True
        live.events.append(b'event: response.created\ndata: {"response": {}}\n\n')
        writer.begun(live)
        writer.flush()
        writer.flush()
        assert rounds[0] == 1 and writer.failures == 1
        assert store.get_run("resp_bg")["state"] == "queued"
        assert store.get_opening("resp_bg") == live.events[0]
    finally:
        writer.close()
        store.close()
