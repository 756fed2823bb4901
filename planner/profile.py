"""`pd-runtime profile`: a short calibration sweep through a deployment's pools, then the cost
model the workers fitted meanwhile, written for the planner (planner/costs.py).

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
import sys
import time
from pathlib import Path
from typing import Optional

from pd_runtime.api import SamplingParams
from planner.costs import ClusterCosts

# The router's added latency when none is measured: its p50 on the 2-core box
# (docs/BENCHMARKS.md, "Router overhead").
ROUTER_OVERHEAD_S = 0.0005


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, label: str = "profile", stream=sys.stderr):
        self.total, self.done, self.label, self.stream = total, 0, label, stream
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
    return stages


async def _run_stage(client, stage_no: int, path: str, prompt_len: int, max_tokens: int,
                     concurrent: int, vocab: int, rng: random.Random) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> None:
        prompt = [rng.randrange(5, vocab) for _ in range(prompt_len)]  # unique: no cache hits
        async for chunk in client.generate(f"profile-{stage_no}-{i}", prompt, params,
                                           disaggregate=path == "disaggregated"):
            if "error" in chunk:
                raise RuntimeError(f"calibration request failed: {chunk['error']['message']}")

    await asyncio.gather(*(one(i) for i in range(concurrent)))


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
                    progress: Optional[Progress] = None, seed: int = 0) -> ClusterCosts:
    """Drive the pools through the sweep and return the cost model their workers fitted."""
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
    for number, (path, prompt_len, max_tokens, concurrent) in enumerate(stages):
        await _run_stage(client, number, path, prompt_len, max_tokens, concurrent, vocab, rng)
        progress.step(f"{path} {prompt_len} tok x{concurrent}")
    rpc_s = await _rpc_s(client)
    await client.refresh()
    progress.step("load reports")
    p, d = client.prefill[0], client.decode[0]
    pools = cfg.pools()
    return ClusterCosts.from_loads(
        p.load, d.load, prefill_engine=pools["prefill"].engine.model_dump(),
        decode_engine=pools["decode"].engine.model_dump(), num_layers=num_layers,
        stream_layers=cfg.kv_transfer.stream_layers, rpc_s=rpc_s,
        router_overhead_s=ROUTER_OVERHEAD_S, max_model_len=card.max_model_len if card else 4096,
        note=f"pd-runtime profile{' --quick' if quick else ''}: {len(stages)} stages, "
             f"{cfg.kv_transfer.backend} transfers, model {Path(model_dir).name}")
