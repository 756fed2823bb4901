"""`pd-runtime profile`: a short calibration sweep through a deployment, then the cost model its
workers fitted meanwhile, written for the planner (pd_runtime/planner/costs.py). Either through the pool
client of pools it brings up (`calibrate`), or through a running deployment's OpenAI API
(`calibrate_http`, `--url`): the latter times requests as clients see them, the router, HTTP and
whatever shares the machines included, and reads the fitted figures from the router
(GET /v1/router/workers).

The sweep gives each engine's step-cost fit (pd_runtime/engine/step_costs.py) every kind of
step it must predict: prompts of several lengths alone (prefill per token and attention),
decode batches of several sizes and contexts (per sequence and per context token), both at once,
and disaggregated prompts (the prefill pool's steps, and the link's send rate). The workers
export the same figures continuously in their load reports, so a router's live cost model and
this file agree on what a step costs.
"""

from __future__ import annotations

import asyncio
import json
import random
import resource
import sys
import time
from pathlib import Path
from typing import Optional

from pd_runtime.api import SamplingParams
from pd_runtime.planner.costs import ClusterCosts
from pd_runtime.planner.host import fit_host

# The router's added latency when none is measured: its p50 on the 2-core box
# (docs/BENCHMARKS.md, "Router overhead").
ROUTER_OVERHEAD_S = 0.0005


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, label: str = "profile", stream=None):
        self.total, self.done, self.label = total, 0, label
        self.stream = stream or sys.stderr
        self.started = time.monotonic()

    def step(self, what: str = "") -> None:
        self.done += 1
        width = 30
        filled = int(width * self.done / max(1, self.total))
        elapsed = time.monotonic() - self.started
        self.stream.write(f"\r{self.label}: [{'#' * filled}{'.' * (width - filled)}] "
                          f"{self.done}/{self.total} {elapsed:5.0f}s {what:<32}")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def sweep_plan(max_model_len: int, quick: bool = False) -> list[tuple[str, int, int, int]]:
    """(path, prompt tokens, max_tokens, concurrent requests) stages, in order."""
    top = max(64, min(2048, max_model_len - 80))
    lengths = sorted({min(top, n) for n in ((64, 256, 1024) if quick else
                                            (64, 256, 512, 1024, 2048))})
    batches = (1, 4, 8) if quick else (1, 4, 8, 16, 32)
    stages = [("colocated", n, 1, 1) for n in lengths]                 # prefill alone
    stages += [("colocated", 32, 48 if quick else 96, b) for b in batches]  # decode batches
    stages += [("colocated", min(top, 512), 24, 4)]                     # prefill among decodes
    stages += [("disaggregated", n, 2, 1) for n in lengths]            # prefill pool + link
    stages += [("disaggregated", min(top, 256), 16, 4)]
    # The longest prompts two at once: one waits behind the other's prefill, then both decode
    # at long context (the decode steps above attend to ~100 tokens: too few to tell what
    # each token of context costs a step).
    stages += [("disaggregated", lengths[-1], 48, 2)]
    return stages


async def _run_stage(client, stage_no: int, path: str, prompt_len: int, max_tokens: int,
                     concurrent: int, vocab: int, rng: random.Random) -> list[dict]:
    """The stage's requests at once; each one's TTFT and TPOT as the pool client saw them."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> dict:
        prompt = [rng.randrange(5, vocab) for _ in range(prompt_len)]  # unique: no cache hits
        start, times = time.monotonic(), []
        async for chunk in client.generate(f"profile-{stage_no}-{i}", prompt, params,
                                           disaggregate=path == "disaggregated"):
            if chunk.error is not None:
                raise RuntimeError(f"calibration request failed: {chunk.error.message}")
            times.extend([time.monotonic()] * len(chunk.token_ids))
        return {"path": path, "prompt_len": prompt_len, "concurrent": concurrent,
                "ttft_s": times[0] - start, "tokens": len(times),
                "tpot_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None}

    return await asyncio.gather(*(one(i) for i in range(concurrent)))


def _median(values: list[float]) -> Optional[float]:
    values = sorted(values)
    return values[len(values) // 2] if values else None


def _affine(points: list[tuple[float, float]]) -> tuple[float, float]:
    """measured = overhead + scale x predicted, by least squares over (predicted, measured)
    pairs; scale within [0.5, 2] and overhead >= 0; with one distinct prediction, scale 1."""
    if not points:
        return 0.0, 1.0
    if len({round(p, 6) for p, _ in points}) < 2:
        return max(0.0, _median([m - p for p, m in points]) or 0.0), 1.0
    mean_p = sum(p for p, _ in points) / len(points)
    mean_m = sum(m for _, m in points) / len(points)
    var = sum((p - mean_p) ** 2 for p, _ in points)
    cov = sum((p - mean_p) * (m - mean_m) for p, m in points)
    scale = min(2.0, max(0.5, cov / var))
    return max(0.0, mean_m - scale * mean_p), scale


def overheads(timings: list[dict], costs: ClusterCosts) -> dict:
    """What the fitted step costs do not explain, from requests that ran alone: per path, the
    time to first token as a fixed part plus a scale on the predicted prefill (the fit's error
    at the lengths the path saw), and the decode period at batch 1 besides the step's compute
    (the engine loop's own work per iteration)."""
    def prefill_s(role, n: int) -> float:
        return role.step_s(n, n * (n + 1) // 2, 0, 0)

    alone = [t for t in timings if t["concurrent"] == 1]
    colocated = _affine([(prefill_s(costs.decode, t["prompt_len"]), t["ttft_s"])
                         for t in alone if t["path"] == "colocated" and t["tokens"] == 1])
    remote = _affine([(prefill_s(costs.prefill, t["prompt_len"]), t["ttft_s"])
                      for t in alone if t["path"] == "disaggregated"])
    c = costs.decode.coefficients
    step = [t["tpot_s"] - (c["step_s"] + c["decode_seq_s"] + c["decode_context_s"] *
                           (t["prompt_len"] + t["tokens"] // 2))
            for t in alone if t["path"] == "colocated" and t["tpot_s"] is not None]
    return {"colocated_overhead_s": colocated[0], "colocated_scale": colocated[1],
            "disaggregated_overhead_s": remote[0], "disaggregated_scale": remote[1],
            "step_overhead_s": max(0.0, _median(step) or 0.0)}


def apply_overheads(costs: ClusterCosts, timings: list[dict]) -> None:
    """Fold what the sweep's timings say beyond the fitted step costs into the cost model."""
    measured = overheads(timings, costs)
    costs.colocated_overhead_s = measured["colocated_overhead_s"]
    costs.disaggregated_overhead_s = measured["disaggregated_overhead_s"]
    for role, scale in ((costs.decode, measured["colocated_scale"]),
                        (costs.prefill, measured["disaggregated_scale"])):
        for name in ("prefill_token_s", "prefill_attention_s"):
            role.coefficients[name] *= scale
    costs.prefill.step_overhead_s = costs.decode.step_overhead_s = measured["step_overhead_s"]
    costs.source["ttft_fit"] = {k: round(v, 6) for k, v in measured.items()}


async def _rpc_s(client, samples: int = 20) -> float:
    """A call to a worker and its answer (ping), the median of `samples`."""
    worker = (client.decode + client.prefill)[0]
    times = []
    for _ in range(samples):
        start = time.monotonic()
        await worker.handle.ping.remote()
        times.append(time.monotonic() - start)
    return sorted(times)[len(times) // 2]


async def calibrate(client, cfg, model_dir: str, quick: bool = False,
                    progress: Optional[Progress] = None, seed: int = 0,
                    all_reduce_ranks: tuple[int, ...] = ()) -> ClusterCosts:
    """Drive the pools through the sweep and return the cost model their workers fitted
    (with the model's shape, and the all-reduce over each of `all_reduce_ranks` timed here:
    pd_runtime/planner/profile_tp.py)."""
    if not client.prefill or not client.decode:
        raise ValueError("profile needs a prefill and a decode worker (prefill.num_workers and "
                         "decode.num_workers >= 1 in the config)")
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = int(model_config.get("vocab_size", 1000))
    num_layers = int(model_config.get("num_hidden_layers", 1))
    card = client.model_card
    stages = sweep_plan(card.max_model_len if card else 2048, quick)
    progress = progress or Progress(len(stages) + 1)
    rng = random.Random(seed)
    timings = []
    for number, (path, prompt_len, max_tokens, concurrent) in enumerate(stages):
        timings += await _run_stage(client, number, path, prompt_len, max_tokens, concurrent,
                                    vocab, rng)
        progress.step(f"{path} {prompt_len} tok x{concurrent}")
    rpc_s = await _rpc_s(client)
    await client.refresh()
    progress.step("load reports")
    p, d = client.prefill[0], client.decode[0]
    pools = cfg.pools()
    costs = ClusterCosts.from_loads(
        p.load, d.load, prefill_engine=pools["prefill"].engine.model_dump(),
        decode_engine=pools["decode"].engine.model_dump(), num_layers=num_layers,
        stream_layers=cfg.kv_transfer.stream_layers, rpc_s=rpc_s,
        router_overhead_s=ROUTER_OVERHEAD_S, max_model_len=card.max_model_len if card else 4096,
        note=f"pd-runtime profile{' --quick' if quick else ''}: {len(stages)} stages, "
             f"{cfg.kv_transfer.backend} transfers, model {Path(model_dir).name}")
    apply_overheads(costs, timings)
    engine = pools["decode"].engine
    add_tensor_parallel(costs, model_dir, engine.dtype, engine.device, all_reduce_ranks,
                        engine.max_num_batched_tokens)
    return costs


def add_tensor_parallel(costs: ClusterCosts, model_dir: Optional[str], dtype: str, device: str,
                        all_reduce_ranks, max_tokens: int) -> None:
    """The model's shape and the all-reduce timings, for planning other degrees."""
    if model_dir is None:
        costs.source["model"] = "not recorded (profile --url without --model): the plan " \
                                "derives no other tensor_parallel_size"
        return
    from pd_runtime.planner.profile_tp import measure, model_shape

    costs.model = model_shape(model_dir, dtype, device)
    costs.all_reduce = measure(list(all_reduce_ranks), costs.model, device, max_tokens,
                               costs.source)


# ---------------------------------------------------------------------------------- over HTTP
async def _http_stage(client, base: str, model: str, stage_no: int, path: str, prompt_len: int,
                      max_tokens: int, concurrent: int, rng: random.Random) -> list[dict]:
    async def one(i: int) -> dict:
        # Token ids the smallest vocabulary has (ids 0-4 are special in ours); random, so
        # unique: no prefix-cache hits.
        prompt = [rng.randrange(5, 256) for _ in range(prompt_len)]
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        give_up = time.monotonic() + 120.0
        while True:  # an SLO router may refuse (429) until the batch ahead of it thins out
            start, times = time.monotonic(), []
            async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
                if resp.status_code == 429 and time.monotonic() < give_up:
                    wait = float(resp.headers.get("retry-after") or 1.0)
                    await asyncio.sleep(min(5.0, max(0.2, wait)))
                    continue
                if resp.status_code != 200:
                    raise RuntimeError(f"calibration request failed: HTTP {resp.status_code} "
                                       f"{(await resp.aread())[:300]!r}")
                await _read_stream(resp, times)
                break
        return {"path": path, "prompt_len": prompt_len, "concurrent": concurrent,
                "ttft_s": times[0] - start, "tokens": max_tokens if max_tokens > 1 else 1,
                "tpot_s": (times[-1] - times[0]) / (max_tokens - 1)
                if max_tokens > 1 and len(times) > 1 else None}

    return await asyncio.gather(*(one(i) for i in range(concurrent)))


async def _read_stream(resp, times: list) -> None:
    """The arrival time of each content chunk of an SSE completion stream."""
    async for line in resp.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                times.append(time.monotonic())


def _steadied(snapshots: list[dict]) -> tuple[dict, dict]:
    """Worker reports of several sweeps as one: each step-cost coefficient the median of its
    fits after each sweep (the last report otherwise), and each one's spread (min, max)."""
    last = snapshots[-1]
    merged, spread = {}, {}
    for worker_id, report in last.items():
        fits = [s[worker_id]["load"]["step_costs"]["coefficients"] for s in snapshots
                if worker_id in s and (s[worker_id]["load"].get("step_costs") or {})
                .get("coefficients")]
        load = dict(report["load"])
        if fits:
            medians = {k: _median([f[k] for f in fits]) for k in fits[-1]}
            load["step_costs"] = {**load["step_costs"], "coefficients": medians}
            spread[worker_id] = {k: (min(f[k] for f in fits), max(f[k] for f in fits))
                                 for k in fits[-1]}
        merged[worker_id] = {**report, "load": load}
    return merged, spread


async def calibrate_http(base_url: str, api_key: Optional[str] = None, quick: bool = False,
                         progress: Optional[Progress] = None, seed: int = 0,
                         repeats: int = 1, tensor_parallel_size: int = 1) -> ClusterCosts:
    """The sweep through a running deployment's router (`repeats` times: the cost model takes
    each coefficient's median over the fits after each sweep, and keeps their spread); the
    paths are the router's to choose (long prompts disaggregated in its default modes), so
    each stage is attributed to the path the router's routing settings give it. The load
    reports do not say the workers' degree: `tensor_parallel_size` does."""
    if repeats < 1:
        raise ValueError("--repeats must be >= 1")
    import httpx

    base = base_url.rstrip("/")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(600.0, connect=10.0)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, trust_env=False) as client:
        card = (await client.get(f"{base}/v1/models")).json()["data"][0]
        routing = (await client.get(f"{base}/v1/router/config")).json()["routing"]
        mode, local = routing["mode"], routing["max_local_prefill_tokens"]
        stages = sweep_plan(int(card.get("max_model_len") or 2048), quick)
        progress = progress or Progress(repeats * (len(stages) + 1))
        rng = random.Random(seed)
        timings, snapshots, host_stages = [], [], []
        for repeat in range(repeats):
            for number, (_, prompt_len, max_tokens, concurrent) in enumerate(stages):
                path = "disaggregated" if mode == "always_disaggregated" or \
                    (mode != "always_colocated" and prompt_len > local) else "colocated"
                before = await _cpu_snapshot(client, base)
                timings += await _http_stage(client, base, card["id"],
                                             repeat * len(stages) + number, path, prompt_len,
                                             max_tokens, concurrent, rng)
                host_stages.append(_cpu_spent(before, await _cpu_snapshot(client, base)))
                progress.step(f"{prompt_len} tok x{concurrent} ({path})")
            await asyncio.sleep(2.5)  # the router's load reports are a health interval old
            snapshots.append((await client.get(f"{base}/v1/router/workers")).json()["workers"])
            progress.step("load reports")
    workers, spread = _steadied(snapshots)
    by_role = {}
    for report in workers.values():
        if report["healthy"]:
            by_role.setdefault(report["role"], report["load"])
    decode = by_role.get("decode") or by_role.get("colocated")
    if decode is None:
        raise ValueError(f"{base} serves no healthy decode or colocated worker to calibrate from")
    # Without a prefill pool (all colocated), the prefill role's costs are the decode side's:
    # the same engine.
    prefill = by_role.get("prefill") or decode
    degree = {"tensor_parallel_size": tensor_parallel_size}
    costs = ClusterCosts.from_loads(
        prefill, decode, prefill_engine=degree, decode_engine=degree,
        num_layers=1, stream_layers=True, rpc_s=0.0, router_overhead_s=0.0,
        max_model_len=int(card.get("max_model_len") or 4096),
        note=f"pd-runtime profile --url{' --quick' if quick else ''}: {len(stages)} stages x "
             f"{repeats} through {base}, routing mode {mode}")
    if repeats > 1:
        costs.source["coefficient_spread"] = spread
    if mode != "always_colocated" and "prefill" in by_role:
        # The router sent the decode pool no prompt over max_local_prefill_tokens, so its own
        # prefill fit stops there; both pools run the same engine: the prefill pool's fit,
        # which saw the long ones, stands for both.
        for name in ("prefill_token_s", "prefill_attention_s"):
            costs.decode.coefficients[name] = costs.prefill.coefficients[name]
        costs.source["decode_prefill_costs"] = "the prefill pool's (the decode pool saw no " \
                                               f"prompt over {local} tokens)"
    apply_overheads(costs, timings)  # the router's own time is in these
    costs.host = _shared_host(host_stages)
    return costs


async def _cpu_snapshot(client, base: str) -> dict:
    """The router's CPU and counts, the workers' CPU outside their steps, this process's CPU."""
    reply = (await client.get(f"{base}/v1/router/workers")).json()
    own = resource.getrusage(resource.RUSAGE_SELF)
    runtime = None
    loads = [w["load"] for w in reply["workers"].values() if w["healthy"]]
    if loads and all(load.get("cpu_s") is not None for load in loads):
        # Each worker's CPU besides its engine thread's (or, from a worker that does not say,
        # besides its step time).
        runtime = sum(load["cpu_s"] - (load["engine_thread_cpu_s"]
                                       if load.get("engine_thread_cpu_s") is not None
                                       else (load.get("step_costs") or {}).get("busy_s") or 0.0)
                      for load in loads)
    engines = {wid: ((w["load"].get("step_costs") or {}).get("busy_s"),
                     w["load"].get("engine_thread_cpu_s"))
               for wid, w in reply["workers"].items() if w["healthy"]}
    return {"time": time.monotonic(), "client_cpu_s": own.ru_utime + own.ru_stime,
            "router": reply.get("router"), "runtime_cpu_s": runtime,
            "hosts": {load.get("host") for load in loads}, "engines": engines}


def _engines_beside(before: dict, after: dict, seconds: float,
                    cores: float) -> tuple[float, float]:
    """(the workers' step time over the stage, that time weighted by the other workers'
    engine-thread CPU rate over the stage, in cores): what the steps were fitted beside. From
    the router's copies of the load reports, which are up to a health interval old: a short
    stage can see a second of earlier work, so the rate is held to the node's cores. A worker
    not in both reports (started, stopped, restarted) is left out of the stage. An engine
    thread's CPU is what it got, not what it wanted, and leaves out torch's other threads:
    with more than one thread per worker this reads low."""
    if seconds <= 0:
        return 0.0, 0.0
    deltas = []
    for wid, (busy1, cpu1) in after.items():
        busy0, cpu0 = before.get(wid, (None, None))
        if None in (busy0, busy1, cpu0, cpu1) or busy1 < busy0 or cpu1 < cpu0:
            continue
        deltas.append((busy1 - busy0, cpu1 - cpu0))
    total_cpu = sum(cpu for _, cpu in deltas)
    busy = sum(b for b, _ in deltas)
    beside = sum(b * min(cores, (total_cpu - cpu) / seconds) for b, cpu in deltas)
    return busy, beside


def _cpu_spent(before: dict, after: dict) -> Optional[dict]:
    if not before["router"] or not after["router"] or before["runtime_cpu_s"] is None \
            or after["runtime_cpu_s"] is None:
        return None  # a router or workers that do not report their CPU
    r0, r1 = before["router"], after["router"]
    seconds = after["time"] - before["time"]
    engine_busy, engine_beside = _engines_beside(before["engines"], after["engines"], seconds,
                                                 r1.get("cpus") or 1)
    return {"seconds": seconds, "engine_busy_s": engine_busy, "engine_beside_s": engine_beside,
            "requests": r1["requests"] - r0["requests"],
            "tokens": r1["output_tokens"] - r0["output_tokens"],
            "router_cpu_s": r1["cpu_s"] - r0["cpu_s"],
            "runtime_cpu_s": after["runtime_cpu_s"] - before["runtime_cpu_s"],
            "client_cpu_s": after["client_cpu_s"] - before["client_cpu_s"],
            "cores": r1.get("cpus") or 0, "shared": after["hosts"] == {r1.get("host")}}


def _shared_host(stages: list[Optional[dict]]):
    """The router's node's CPU costs when every worker runs on that node (None otherwise:
    the router and the workers do not compete for cores)."""
    if not stages or any(s is None or not s["shared"] for s in stages):
        return None
    return fit_host(stages, stages[-1]["cores"])
