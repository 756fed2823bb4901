"""bench/goodput.py: arrival statistics, the summary arithmetic, workloads, and the real generator
against a stub OpenAI SSE server on loopback with known delays, refusals and broken streams."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import statistics
import threading
import time
from argparse import Namespace

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench import goodput, goodput_plot, goodput_summary

STUB_TTFT_S = 0.2
STUB_ITL_S = 0.02


# ------------------------------------------------------------------------------------ arrivals
@pytest.mark.parametrize("shape", [1.0, 4.0, 0.25])
def test_arrival_gaps_have_the_asked_mean_and_cv(shape):
    offsets = goodput.arrival_offsets(4.0, random.Random(7), num_requests=20000, burstiness=shape)
    gaps = [b - a for a, b in zip([0.0] + offsets, offsets)]
    mean = statistics.fmean(gaps)
    cv = statistics.pstdev(gaps) / mean
    assert mean == pytest.approx(0.25, rel=0.04)
    assert cv == pytest.approx(1 / shape ** 0.5, rel=0.06)


def test_arrivals_are_seeded_and_bounded_by_duration():
    a = goodput.arrival_offsets(2.0, random.Random("s"), duration_s=30.0)
    assert a == goodput.arrival_offsets(2.0, random.Random("s"), duration_s=30.0)
    assert a != goodput.arrival_offsets(2.0, random.Random("t"), duration_s=30.0)
    assert max(a) <= 30.0 and 40 < len(a) < 85
    assert len(goodput.arrival_offsets(2.0, random.Random(0), 10, duration_s=1e6)) == 10


# ------------------------------------------------------------------------------------- summary
def _record(i, outcome="completed", ttft=0.5, tpot=0.05, tokens=11, end=10.0, sent=None):
    rec = goodput.RequestRecord(i, "fixed", 16, tokens, scheduled_s=float(i),
                                sent_s=float(i) + 0.001 * i if sent is None else sent,
                                end_s=end, outcome=outcome)
    if outcome == "completed":
        rec.ttft_s, rec.tpot_s, rec.output_tokens = ttft, tpot, tokens
        rec.e2e_s = ttft + tpot * (tokens - 1)
        rec.itl_s = [tpot] * (tokens - 1)
    else:
        rec.e2e_s = 0.01 * (i + 1)
    return rec


def test_percentile_interpolates_between_ranks():
    values = list(range(1, 101))
    assert goodput_summary.percentile(values, 50) == pytest.approx(50.5)
    assert goodput_summary.percentile(values, 99) == pytest.approx(99.01)
    assert goodput_summary.percentile(values, 90) == pytest.approx(90.1)
    assert goodput_summary.percentile([3.0], 99) == 3.0
    assert goodput_summary.percentile([], 50) is None


def test_goodput_counts_requests_within_both_slos_over_the_duration():
    records = [_record(0), _record(1, ttft=3.0),           # TTFT over the SLO
               _record(2, tpot=0.2),                        # TPOT over it
               _record(3, ttft=2.5, tpot=0.1),              # exactly at both: good
               _record(4, outcome="refused", end=4.05), _record(5, outcome="failed", end=20.0),
               _record(6), _record(7)]
    plan = goodput.PointPlan("1/s", 1.0, [float(i) for i in range(8)])
    s = goodput_summary.summarize(plan, records, slo_ttft=2.5, slo_tpot=0.1)
    assert (s["sent"], s["completed"], s["refused"], s["failed"]) == (8, 6, 1, 1)
    assert s["duration_s"] == pytest.approx(20.0)            # first scheduled 0 -> last end 20
    assert s["good"] == 4 and s["goodput_rps"] == pytest.approx(4 / 20)
    assert s["throughput_rps"] == pytest.approx(6 / 20)
    assert s["output_tok_s"] == pytest.approx(66 / 20)
    assert s["ttft_s"]["p50"] == pytest.approx(0.5)
    assert s["tpot_s"]["p99"] == pytest.approx(goodput_summary.percentile([0.05] * 4 + [0.2, 0.1], 99))
    assert s["refusal_s"]["max"] == pytest.approx(0.05)
    assert s["lag_s"]["max"] == pytest.approx(0.007)
    assert "by_kind" not in s


def test_busy_requests_reads_ours_and_vllms_gauges():
    ours = ('# HELP pd_worker_running Running sequences\n'
            'pd_worker_running{worker="decode-0"} 2.0\npd_worker_waiting{worker="decode-0"} 1.0\n'
            'pd_worker_running{worker="prefill-0"} 0.0\npd_ttft_seconds_count{path="x"} 9.0\n')
    assert goodput.busy_requests(ours) == 3.0
    assert goodput.busy_requests('vllm:num_requests_running{model_name="m"} 0.0\n'
                                 'vllm:num_requests_waiting{model_name="m"} 0.0\n') == 0.0
    assert goodput.busy_requests("process_cpu_seconds_total 3.0\n") is None


def test_knee_and_peak():
    summaries = [{"offered_rate": r, "goodput_rps": g}
                 for r, g in [(1, 1.0), (2, 1.9), (4, 3.5), (8, 3.9), (16, 2.0)]]
    assert goodput_plot.knee_and_peak(summaries) == {
        "knee_rate": 2, "peak_goodput_rps": 3.9, "peak_at_rate": 8}
    assert goodput_plot.knee_and_peak([{"offered_rate": 1, "goodput_rps": 0.5}])["knee_rate"] \
        is None


# ------------------------------------------------------------------------------------ workload
def _workload(**overrides):
    args = dict(workload="fixed", input_len=64, output_len=8, short_len=16, long_len=128,
                long_fraction=0.25, conversations=3, turns=3, user_len=4, lengths_file=None)
    return Namespace(**{**args, **overrides})


def _take(args, n, vocab=1000, seed=0):
    specs = goodput.requests(args, vocab, random.Random(seed))
    return [next(specs) for _ in range(n)]


def test_prompts_are_unique_token_ids_in_the_vocabulary():
    specs = _take(_workload(), 50)
    assert all(len(s.prompt) == 64 and min(s.prompt) >= 5 and max(s.prompt) < 1000
               for s in specs)
    assert len({tuple(s.prompt[:16]) for s in specs}) == 50
    assert [s.prompt for s in specs] == [s.prompt for s in _take(_workload(), 50)]


def test_bimodal_mixes_short_and_long():
    specs = _take(_workload(workload="bimodal"), 400)
    longs = [s for s in specs if s.kind == "long"]
    assert 0.18 < len(longs) / 400 < 0.32
    assert {len(s.prompt) for s in specs} == {16, 128}


def test_multiturn_turns_extend_their_conversation():
    specs = _take(_workload(workload="multiturn"), 18)
    by_conversation: dict[int, list] = {}
    for s in specs:
        by_conversation.setdefault(s.conversation, []).append(s)
    assert len(by_conversation) == 6    # 3 open at a time, 3 turns each
    for turns in by_conversation.values():
        assert [s.kind for s in turns] == ["turn0", "turn1", "turn2"]
        for before, after in zip(turns, turns[1:]):
            assert after.prompt[:len(before.prompt)] == before.prompt
            assert len(after.prompt) == len(before.prompt) + 8 + 4
    firsts = {tuple(turns[0].prompt[:16]) for turns in by_conversation.values()}
    assert len(firsts) == 6


def test_lengths_file_jsonl_and_csv(tmp_path):
    jsonl = tmp_path / "l.jsonl"
    jsonl.write_text('{"input_len": 10, "output_len": 3}\n\n{"input_len": 20, "output_len": 5}\n')
    csv = tmp_path / "l.csv"
    csv.write_text("input_len,output_len\n10,3\n20,5\n")
    assert goodput.read_lengths(str(jsonl)) == goodput.read_lengths(str(csv)) == [(10, 3), (20, 5)]
    specs = _take(_workload(workload="file", lengths_file=str(csv)), 3)
    assert [(len(s.prompt), s.output_len) for s in specs] == [(10, 3), (20, 5), (10, 3)]
    bad = tmp_path / "bad.csv"
    bad.write_text("1,2\nx,y\n")
    with pytest.raises(ValueError, match="bad.csv:2"):
        goodput.read_lengths(str(bad))


# --------------------------------------------------------------------------------- stub server
def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def stub_app(seen: list, in_flight: list) -> FastAPI:
    """/{mode}/v1/...: ok streams an empty chunk, then max_tokens one-token chunks after
    STUB_TTFT_S, STUB_ITL_S apart; pairs sends two tokens a chunk (with token_ids); short stops at half; error sends an
    error event mid-stream; refuse answers 429 with Retry-After."""
    app = FastAPI()

    @app.get("/{mode}/v1/models")
    async def models(mode: str):
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    @app.post("/{mode}/v1/completions")
    async def completions(mode: str, request: Request):
        body = await request.json()
        seen.append(body)
        if mode == "refuse":
            return JSONResponse({"error": {"message": "queue full", "type": "rate_limit"}},
                                status_code=429, headers={"Retry-After": "7"})
        n = body["max_tokens"] // 2 if mode == "short" else body["max_tokens"]
        step = 2 if mode == "pairs" else 1

        async def events():
            in_flight[0] += 1
            in_flight[1] = max(in_flight[1], in_flight[0])
            try:  # a chunk without text first, as some servers send: it is no token
                yield _sse({"id": "x", "object": "text_completion", "usage": None,
                            "choices": [{"index": 0, "text": "", "finish_reason": None}]})
                await asyncio.sleep(STUB_TTFT_S)
                for i in range(0, n, step):
                    if i:
                        await asyncio.sleep(STUB_ITL_S)
                    if mode == "error" and i == 3:
                        yield _sse({"error": {"message": "worker lost", "type": "server_error"}})
                        break
                    choice = {"index": 0, "text": " tok" * step, "finish_reason": None}
                    if step > 1:
                        choice["token_ids"] = [7] * step
                    yield _sse({"id": "x", "object": "text_completion", "choices": [choice],
                                "usage": None})
                else:
                    yield _sse({"id": "x", "object": "text_completion", "choices": [],
                                "usage": {"prompt_tokens": len(body["prompt"]),
                                          "completion_tokens": n}})
                yield "data: [DONE]\n\n"
            finally:
                in_flight[0] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def stub():
    seen: list = []
    in_flight = [0, 0]   # now, peak
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(stub_app(seen, in_flight), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen, in_flight
    server.should_exit = True
    thread.join(5)


def _run(base: str, mode: str, tmp_path, *load: str, output_len: int = 8) -> dict:
    out = tmp_path / f"{mode}.json"
    goodput.main(["--base-url", f"{base}/{mode}", *load, "--workload", "fixed",
                  "--input-len", "16", "--output-len", str(output_len), "--vocab-size", "100",
                  "--settle-s", "0", "--label", f"stub {mode}", "--json", str(out)])
    return json.loads(out.read_text())


def test_stub_latencies_are_recovered(stub, tmp_path, capsys):
    base, seen, _ = stub
    seen.clear()
    doc = _run(base, "ok", tmp_path, "--rates", "20", "--num-requests", "8")
    s = doc["points"][0]["summary"]
    assert doc["label"] == "stub ok" and doc["model"] == "stub-model" and doc["machine"]
    assert (s["sent"], s["completed"], s["refused"], s["failed"]) == (8, 8, 0, 0)
    assert STUB_TTFT_S <= s["ttft_s"]["p50"] < STUB_TTFT_S + 0.15
    # a chunk read late makes the next gap short: the client's clock jitters both ways
    assert 0.8 * STUB_ITL_S < s["tpot_s"]["p50"] < STUB_ITL_S + 0.02
    assert 0.8 * STUB_ITL_S < s["itl_s"]["p50"] < STUB_ITL_S + 0.02
    assert s["good"] == 8 and s["goodput_rps"] == pytest.approx(8 / s["duration_s"])
    for rec in doc["points"][0]["requests"]:
        assert rec["output_tokens"] == 8 and len(rec["itl_s"]) == 7
        assert rec["tpot_s"] == pytest.approx((rec["e2e_s"] - rec["ttft_s"]) / 7)
    assert len(seen) == 8
    for body in seen:
        assert body["model"] == "stub-model" and body["stream"] is True
        assert body["ignore_eos"] is True and body["max_tokens"] == 8
        assert body["stream_options"] == {"include_usage": True}
        assert len(body["prompt"]) == 16 and all(5 <= t < 100 for t in body["prompt"])
    table = capsys.readouterr().out.splitlines()
    assert table[1] == goodput_summary.TABLE_HEADER and table[2].split()[:5] == ["20/s", "8", "8", "0",
                                                                        "0"]


def test_stub_multi_token_chunks_count_one_interval_each(stub, tmp_path):
    doc = _run(stub[0], "pairs", tmp_path, "--rates", "20", "--num-requests", "3")
    for rec in doc["points"][0]["requests"]:
        assert rec["outcome"] == "completed" and rec["output_tokens"] == 8
        assert rec["chunk_tokens"] == [2, 2, 2, 2] and len(rec["itl_s"]) == 3
        assert 1.5 * STUB_ITL_S < sum(rec["itl_s"]) < 1.0
        assert rec["tpot_s"] == pytest.approx((rec["e2e_s"] - rec["ttft_s"]) / 7)


def test_stub_refusals_are_counted_with_retry_after(stub, tmp_path):
    doc = _run(stub[0], "refuse", tmp_path, "--burst", "6")
    s = doc["points"][0]["summary"]
    assert (s["name"], s["refused"], s["completed"], s["failed"]) == ("burst 6", 6, 0, 0)
    assert s["goodput_rps"] == 0 and 0 < s["refusal_s"]["max"] < 2
    assert {(r["status"], r["retry_after"]) for r in doc["points"][0]["requests"]} == {(429, "7")}


@pytest.mark.parametrize("mode, error", [("short", "4 of 8 tokens"), ("error", "worker lost")])
def test_stub_broken_streams_are_failed(stub, tmp_path, mode, error):
    doc = _run(stub[0], mode, tmp_path, "--rates", "50", "--num-requests", "3")
    s = doc["points"][0]["summary"]
    assert (s["failed"], s["completed"], s["good"]) == (3, 0, 0)
    assert error in s["first_error"]


def test_stub_closed_loop_keeps_concurrency_clients(stub, tmp_path):
    _, seen, in_flight = stub
    seen.clear()
    in_flight[1] = 0
    doc = _run(stub[0], "ok", tmp_path, "--concurrency", "2", "--num-requests", "6",
               output_len=2)
    s = doc["points"][0]["summary"]
    assert (s["name"], s["completed"], len(seen), in_flight[1]) == ("c2", 6, 6, 2)
    assert s["lag_s"]["max"] < 0.1


def test_plots_of_a_rate_run(stub, tmp_path, capsys):
    doc = _run(stub[0], "ok", tmp_path, "--rates", "10", "20", "--num-requests", "4")
    assert [p["summary"]["offered_rate"] for p in doc["points"]] == [10, 20]
    plot_png, cdf_png = tmp_path / "g.png", tmp_path / "c.png"
    goodput_plot.main([str(tmp_path / "ok.json"), "--out", str(plot_png),
                       "--cdf-out", str(cdf_png), "--cdf-rate", "20"])
    assert plot_png.read_bytes()[:4] == cdf_png.read_bytes()[:4] == b"\x89PNG"
    assert "stub ok: knee " in capsys.readouterr().out


# ------------------------------------------------------------------------------ goodput search
def test_search_finds_the_highest_rate_that_passes():
    """Passing below 5.3 req/s: doubling 1, 2, 4 pass, 8 fails, then three bisections."""
    async def measure(rate):
        return rate <= 5.3

    best, tried = asyncio.run(goodput.search_rates(measure, 1, 32, 3))
    assert tried == [(1, True), (2, True), (4, True), (8, False), (6, False), (5, True),
                     (5.5, False)]
    assert best == 5


def test_search_stops_at_high_and_reports_zero_when_low_fails():
    async def always(rate):
        return True

    async def never(rate):
        return False

    assert asyncio.run(goodput.search_rates(always, 1, 3, 3)) == (3, [(1, True), (2, True),
                                                                      (3, True)])
    assert asyncio.run(goodput.search_rates(never, 1, 3, 3)) == (0.0, [(1, False)])


def test_stub_search_counts_refusals_as_misses(stub, tmp_path):
    ok = _run(stub[0], "ok", tmp_path, "--search", "10", "20", "--num-requests", "4",
              "--slo-ttft", "5", "--slo-tpot", "1")
    assert ok["goodput"]["rate"] == 20 and [r for r, _ in ok["goodput"]["tried"]] == [10, 20]
    assert all(p["summary"]["attainment"] == 1.0 for p in ok["points"])
    refused = _run(stub[0], "refuse", tmp_path, "--search", "10", "20", "--num-requests", "4")
    assert refused["goodput"]["rate"] == 0.0 and refused["points"][0]["summary"]["attainment"] == 0
    bound = refused["bound"]  # the box's bound for 16 in / 8 out on the bench model
    assert bound["rps"] > 0 and bound["flops_per_request"] > 0 and bound["dtype"]


def test_per_class_attainment_counts_refusals():
    from bench.goodput_client import RequestRecord
    from bench.goodput_load import PointPlan

    def rec(kind, outcome, ttft):
        done = outcome == "completed"
        return RequestRecord(index=0, kind=kind, input_len=1, output_len=2, scheduled_s=0.0,
                             sent_s=0.0, outcome=outcome, ttft_s=ttft,
                             tpot_s=0.01 if done else None, e2e_s=(ttft or 0) + 0.1,
                             end_s=(ttft or 0) + 0.1, output_tokens=2 if done else 0)

    records = [rec("short", "completed", 0.1), rec("short", "completed", 0.2),
               rec("long", "completed", 0.3), rec("long", "refused", None),
               rec("long", "completed", 9.0)]
    s = goodput_summary.summarize(PointPlan("1/s", 1.0, [0.0] * 5), records, 2.5, 0.1)
    assert s["attainment"] == pytest.approx(3 / 5)
    assert s["by_kind"]["short"]["attainment"] == 1.0 and s["by_kind"]["short"]["refused"] == 0
    assert s["by_kind"]["long"]["attainment"] == pytest.approx(1 / 3)
    assert (s["by_kind"]["long"]["refused"], s["by_kind"]["long"]["sent"]) == (1, 3)


def test_the_bound_counts_a_requests_linears_and_attention():
    """On a tiny config: the FLOPs of one request by hand."""
    from types import SimpleNamespace

    from bench.goodput_bound import request_cost

    cfg = SimpleNamespace(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2,
                          num_heads=2, num_kv_heads=1, head_dim=4, sparse_layers=())
    per_layer = 2 * 8 * (8 + 2 * 4) + 2 * 8 * 8 + 2 * 8 * 32 + 2 * 16 * 8
    head = 2 * 8 * 100
    flops, kv = request_cost(cfg, prompt_len=3, output_len=2, kv_elem_bytes=4)
    attention = 4 * 8 * 2 * (1 + 2 + 3 + 4)  # q width 8, 2 layers, positions 1..4
    assert flops == 3 * 2 * per_layer + head + 1 * (2 * per_layer + head) + attention
    assert kv == 2 * 2 * 1 * 4 * 4 * (3 + 1)  # one decode step reads 4 positions
