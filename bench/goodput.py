"""Goodput under open-loop load: seeded Poisson or gamma arrivals (or closed-loop clients, or one
burst) of token-id prompts streamed from any OpenAI-compatible /v1/completions endpoint.

    .venv/bin/python bench/goodput.py --rates 1 2 4 8 | --sweep 1 8 1 | --concurrency 4 16 |
        --burst 192  [--base-url http://127.0.0.1:8000] [--workload bimodal|fixed|multiturn|file]
        [--num-requests 96] [--duration S] [--burstiness 1] [--slo-ttft 2.5] [--slo-tpot 0.1]
        [--label NAME] [--json OUT] [--seed 0]

A request is good when it completes with TTFT <= --slo-ttft and TPOT <= --slo-tpot; goodput is
good requests per second from the point's first scheduled send to its last end. Times are
taken from the actual send; the client's own lag (actual - scheduled send) is reported apart.
Prompts are unique per point and seed, so the same seed twice against a running server hits its
prefix cache: restart it or change --seed. Plots: bench/goodput_plot.py.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.goodput_summary import TABLE_HEADER, summarize, table_row  # noqa: E402

REFUSAL_STATUSES = (429, 503)
IDLE_GAUGES = ("pd_worker_running", "pd_worker_waiting",  # ours, then vLLM's
               "vllm:num_requests_running", "vllm:num_requests_waiting")


# ------------------------------------------------------------------------------------ arrivals
def arrival_offsets(rate: float, rng: random.Random, num_requests: Optional[int] = None,
                    duration_s: Optional[float] = None, burstiness: float = 1.0) -> list[float]:
    """Send times from the point's start: gamma gaps of mean 1/rate and CV 1/sqrt(burstiness)
    (1 is Poisson), until num_requests or duration_s, whichever comes first."""
    if num_requests is None and duration_s is None:
        raise ValueError("arrival_offsets needs num_requests or duration_s")
    offsets, now = [], 0.0
    while num_requests is None or len(offsets) < num_requests:
        now += rng.gammavariate(burstiness, 1.0 / (burstiness * rate))
        if duration_s is not None and now > duration_s:
            break
        offsets.append(now)
    return offsets


# ------------------------------------------------------------------------------------ workload
@dataclass
class RequestSpec:
    index: int
    kind: str            # fixed | short | long | turn<k> | file
    prompt: list[int]
    output_len: int
    conversation: Optional[int] = None  # multiturn
    turn: int = 0


def read_lengths(path: str) -> list[tuple[int, int]]:
    """(input_len, output_len) rows from JSON lines or CSV (a header line is skipped)."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            item = json.loads(line)
            rows.append((int(item["input_len"]), int(item["output_len"])))
            continue
        cells = [c.strip() for c in line.split(",")]
        if not all(c.isdigit() for c in cells[:2]):
            if rows:
                raise ValueError(f"{path}:{number}: expected input_len,output_len, got {line!r}")
            continue
        rows.append((int(cells[0]), int(cells[1])))
    if not rows:
        raise ValueError(f"{path}: no input_len,output_len rows")
    return rows


def requests(args, vocab: int, rng: random.Random) -> Iterator[RequestSpec]:
    """The point's requests in send order; ids in 5..vocab-1 (0-4 are the special tokens)."""
    ids = range(5, vocab)

    def tokens(n: int) -> list[int]:
        return rng.choices(ids, k=n)

    rows = read_lengths(args.lengths_file) if args.workload == "file" else None
    last_turns: list[Optional[RequestSpec]] = [None] * args.conversations
    next_conversation = 0
    for i in itertools.count():
        if args.workload == "fixed":
            yield RequestSpec(i, "fixed", tokens(args.input_len), args.output_len)
        elif args.workload == "bimodal":
            long = rng.random() < args.long_fraction
            yield RequestSpec(i, "long" if long else "short",
                              tokens(args.long_len if long else args.short_len), args.output_len)
        elif args.workload == "file":
            input_len, output_len = rows[i % len(rows)]
            yield RequestSpec(i, "file", tokens(input_len), output_len)
        else:  # multiturn: turn k = turn k-1's prompt + a stand-in reply + a new user message
            prev = last_turns[i % args.conversations]
            if prev is None or prev.turn + 1 >= args.turns:
                spec = RequestSpec(i, "turn0", tokens(args.input_len), args.output_len,
                                   next_conversation)
                next_conversation += 1
            else:
                spec = RequestSpec(i, f"turn{prev.turn + 1}", prev.prompt +
                                   tokens(args.output_len) + tokens(args.user_len),
                                   args.output_len, prev.conversation, prev.turn + 1)
            last_turns[i % args.conversations] = spec
            yield spec


# -------------------------------------------------------------------------------------- client
@dataclass
class RequestRecord:
    index: int
    kind: str
    input_len: int
    output_len: int                  # asked for (max_tokens)
    scheduled_s: float               # times from the point's start
    sent_s: Optional[float] = None
    end_s: Optional[float] = None
    ttft_s: Optional[float] = None   # from sent_s
    e2e_s: Optional[float] = None    # for a refusal, the time to its status and body
    tpot_s: Optional[float] = None
    itl_s: list[float] = field(default_factory=list)   # one per content chunk after the first
    chunk_tokens: list[Optional[int]] = field(default_factory=list)  # when the chunk says
    output_tokens: int = 0
    status: Optional[int] = None
    outcome: str = "failed"          # completed | refused | failed
    retry_after: Optional[str] = None
    error: Optional[str] = None
    conversation: Optional[int] = None

    @property
    def lag_s(self) -> float:
        return self.sent_s - self.scheduled_s


def request_body(spec: RequestSpec, model: str, ignore_eos: bool) -> bytes:
    return json.dumps({"model": model, "prompt": spec.prompt, "max_tokens": spec.output_len,
                       "temperature": 0.0, "ignore_eos": ignore_eos, "stream": True,
                       "stream_options": {"include_usage": True}},
                      separators=(",", ":")).encode()


def _chunk_tokens(choice: dict) -> Optional[int]:
    if choice.get("token_ids"):
        return len(choice["token_ids"])
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and logprobs.get("tokens"):
        return len(logprobs["tokens"])
    return None


async def _read_events(resp: httpx.Response, rec: RequestRecord, clock) -> tuple:
    """(time of the first content chunk, usage's completion_tokens), each None if unseen; the
    ITL and tokens of every content chunk go into `rec`, an error event into rec.error."""
    first = last = usage_tokens = None
    async for line in resp.aiter_lines():
        now = clock()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if event.get("error"):
            rec.error = f"error event: {json.dumps(event['error'])[:300]}"
            break
        if event.get("usage"):
            usage_tokens = event["usage"].get("completion_tokens")
        for choice in event.get("choices") or ():
            tokens = _chunk_tokens(choice)
            if not (choice.get("text") or tokens):
                continue
            if first is None:
                first = now
            else:
                rec.itl_s.append(now - last)
            last = now
            rec.chunk_tokens.append(tokens)
    return first, usage_tokens


async def stream_request(client: httpx.AsyncClient, url: str, body: bytes, rec: RequestRecord,
                         t0: float, ignore_eos: bool) -> RequestRecord:
    """Send one request and time its stream into `rec`; never raises for a server's answer."""
    clock = time.perf_counter
    sent = clock()
    rec.sent_s = sent - t0
    first = usage_tokens = None
    try:
        async with client.stream("POST", url, content=body) as resp:
            rec.status = resp.status_code
            if resp.status_code == 200:
                first, usage_tokens = await _read_events(resp, rec, clock)
            else:
                raw = await resp.aread()
                rec.retry_after = resp.headers.get("retry-after")
                rec.error = f"HTTP {resp.status_code}: {raw[:300].decode(errors='replace')}"
    except (httpx.HTTPError, OSError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    end = clock()
    rec.end_s, rec.e2e_s = end - t0, end - sent
    if rec.status in REFUSAL_STATUSES:
        rec.outcome = "refused"
        return rec
    rec.output_tokens = usage_tokens if usage_tokens is not None else \
        sum(n or 1 for n in rec.chunk_tokens)
    if first is not None:
        rec.ttft_s = first - sent
        if rec.output_tokens > 1:
            rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)
    if rec.error is None and first is None:
        rec.error = "no tokens"
    elif rec.error is None and ignore_eos and rec.output_tokens < rec.output_len:
        rec.error = f"{rec.output_tokens} of {rec.output_len} tokens with ignore_eos"
    rec.outcome = "completed" if rec.error is None else "failed"
    return rec


# ---------------------------------------------------------------------------------------- load
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


# ----------------------------------------------------------------------------------------- cli
def plans(args) -> list[PointPlan]:
    if args.burst:
        return [PointPlan(f"burst {args.burst}", None, [0.0] * args.burst)]
    num = args.num_requests if args.num_requests or args.duration else 96
    if args.concurrency:
        return [PointPlan(f"c{n}", None, None, n, num, args.duration) for n in args.concurrency]
    rates = args.rates
    if args.sweep:
        start, stop, step = args.sweep
        rates = [start + i * step for i in range(int((stop - start) / step + 1e-9) + 1)]
    return [PointPlan(f"{rate:g}/s", rate, arrival_offsets(
        rate, random.Random(f"{args.seed}:arrivals:{i}"), num, args.duration, args.burstiness))
        for i, rate in enumerate(rates)]


def vocab_size(args) -> int:
    if args.vocab_size:
        return args.vocab_size
    from bench.common import bench_model

    return json.loads((Path(bench_model(args.model_dir)) / "config.json").read_text())[
        "vocab_size"]


async def run(args) -> dict:
    headers = {"content-type": "application/json"}
    if args.api_key:
        headers["authorization"] = f"Bearer {args.api_key}"
    base = args.base_url.rstrip("/")
    timeout = httpx.Timeout(args.request_timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    vocab = vocab_size(args)
    from bench.common import machine_line

    doc = {"label": args.label or base, "machine": machine_line(), "config": vars(args),
           "points": []}
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits,
                                 trust_env=False) as client:
        model = args.model or (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        doc["model"] = model
        print(f"# {doc['label']}: {model} at {base}, {args.workload}, SLO TTFT "
              f"{args.slo_ttft:g}s TPOT {args.slo_tpot * 1e3:g}ms, seed {args.seed}")
        print(TABLE_HEADER, flush=True)
        for i, plan in enumerate(plans(args)):
            await wait_idle(client, base, args.settle_s, args.idle_timeout_s)
            specs = requests(args, vocab, random.Random(f"{args.seed}:prompts:{i}"))
            records = await run_point(client, f"{base}/v1/completions", model, plan, specs,
                                      not args.no_ignore_eos)
            summary = summarize(plan, records, args.slo_ttft, args.slo_tpot)
            print(table_row(summary), flush=True)
            if summary["first_error"]:
                print(f"#   {summary['failed']} failed, first: {summary['first_error']}",
                      file=sys.stderr)
            doc["points"].append({"summary": summary,
                                  "requests": [asdict(r) for r in records]})
            if args.json:
                Path(args.json).write_text(json.dumps(doc))
    return doc


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    load = ap.add_mutually_exclusive_group(required=True)
    load.add_argument("--rates", type=float, nargs="+", help="open-loop requests per second")
    load.add_argument("--sweep", type=float, nargs=3, metavar=("START", "STOP", "STEP"))
    load.add_argument("--concurrency", type=int, nargs="+", help="closed-loop clients")
    load.add_argument("--burst", type=int, help="this many requests all at once")
    ap.add_argument("--num-requests", type=int, help="per point (default 96 without --duration)")
    ap.add_argument("--duration", type=float, help="per point, seconds of arrivals")
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the gaps: CV = 1/sqrt(shape); 1 is Poisson")
    ap.add_argument("--workload", choices=["bimodal", "fixed", "multiturn", "file"],
                    default="bimodal")
    ap.add_argument("--input-len", type=int, default=256, help="fixed; multiturn's first turn")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--short-len", type=int, default=128, help="bimodal")
    ap.add_argument("--long-len", type=int, default=2048, help="bimodal")
    ap.add_argument("--long-fraction", type=float, default=0.2, help="bimodal")
    ap.add_argument("--conversations", type=int, default=8, help="multiturn: open at a time")
    ap.add_argument("--turns", type=int, default=4, help="multiturn: then a new conversation")
    ap.add_argument("--user-len", type=int, default=64, help="multiturn: new tokens per turn")
    ap.add_argument("--lengths-file", help="file: JSON lines or CSV of input_len,output_len")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", help="served model name (default: the first of /v1/models)")
    ap.add_argument("--api-key")
    ap.add_argument("--model-dir", help="for the vocabulary (default: the embedded model)")
    ap.add_argument("--vocab-size", type=int)
    ap.add_argument("--no-ignore-eos", action="store_true")
    ap.add_argument("--slo-ttft", type=float, default=2.5)
    ap.add_argument("--slo-tpot", type=float, default=0.1)
    ap.add_argument("--settle-s", type=float, default=2.0, help="after the server is idle")
    ap.add_argument("--idle-timeout-s", type=float, default=300.0)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--label", help="the system's name in the JSON and plots")
    ap.add_argument("--json", help="config, machine, summaries and every request's record")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workload == "file" and not args.lengths_file:
        build_parser().error("--workload file needs --lengths-file")
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
