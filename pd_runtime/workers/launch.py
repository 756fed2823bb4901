"""Starts (or joins) Ray and the pools from a ClusterConfig; the entry point `serve` uses.

Ray address: "" starts a local Ray unless this process runs inside a Ray job (RAY_ADDRESS set
by `ray job submit`), "auto" joins this node's cluster, "ray://..." connects a client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from pd_runtime.config import ClusterConfig, RayConfig
from pd_runtime.workers.client import PoolClient
from pd_runtime.workers.pool import build_pools

log = logging.getLogger(__name__)


def init_ray(cfg: RayConfig, inside_job: bool) -> None:
    import ray

    if ray.is_initialized():
        return
    common = dict(namespace=cfg.namespace, runtime_env=cfg.runtime_env)
    if cfg.address:
        ray.init(address=cfg.address, **common)
    elif inside_job:
        ray.init(**common)  # connect to the cluster the job was submitted to
    else:
        # "local": a new Ray of our own even if another one runs on this machine.
        ray.init(address="local", num_cpus=cfg.num_cpus,
                 include_dashboard=cfg.include_dashboard, **common)
    log.info("Ray: %s", ray.cluster_resources())


def launch(cfg: ClusterConfig, model_dir: str, inside_job: bool = False) -> PoolClient:
    start = time.monotonic()
    init_ray(cfg.ray, inside_job)
    client = build_pools(cfg, model_dir)
    asyncio.run(client.refresh())
    log.info("pools up in %.1fs: %d prefill, %d decode/colocated workers",
             time.monotonic() - start, len(client.prefill), len(client.decode))
    return client


def run_demo(client: PoolClient, prompts: Optional[list[str]] = None,
             max_tokens: int = 24) -> list[dict]:
    """A few requests down each available path, printed; the smoke test of a deployment."""
    prompts = prompts or ["The prefill worker computes the prompt and",
                          "A decode worker streams tokens back to the router while"]
    paths = [False, True] if client.prefill else [False]
    results = []

    async def one(i: int, prompt: str, disaggregate: bool) -> dict:
        start = time.monotonic()
        text, tokens, first = "", 0, None
        async for chunk in client.generate(f"demo-{i}-{int(disaggregate)}", prompt,
                                           dict(max_tokens=max_tokens, temperature=0.0),
                                           disaggregate=disaggregate):
            if chunk.error is not None:
                raise RuntimeError(chunk.error.message)
            first = first or time.monotonic()
            text += chunk.text
            tokens += len(chunk.token_ids)
        return dict(prompt=prompt, text=text, tokens=tokens,
                    path="disaggregated" if disaggregate else "colocated",
                    ttft_s=first - start, total_s=time.monotonic() - start)

    async def all_():
        return await asyncio.gather(*(one(i, p, d) for d in paths
                                      for i, p in enumerate(prompts)))

    for r in asyncio.run(all_()):
        print(f"[{r['path']}] {r['prompt']!r} -> {r['tokens']} tokens, TTFT "
              f"{r['ttft_s'] * 1e3:.0f} ms, total {r['total_s'] * 1e3:.0f} ms\n    {r['text']!r}")
        results.append(r)
    return results
