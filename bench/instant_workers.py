"""Workers that answer at once: the slice of PoolClient that pd_runtime/router/core.py's PoolBackend uses
(`prefill`, `decode`, `refresh`, `generate`), with no Ray and no engine behind it.

It lets a bench time the router alone: every chunk is ready the moment it is asked for.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from pd_runtime.api import StreamChunk
from pd_runtime.workers.client import WorkerRef


def idle_load(worker_id: str, role: str, total_blocks: int, block_size: int) -> dict:
    """A load report (the keys of the engine's load_report) of a worker with nothing to do."""
    return {"num_running": 0, "num_waiting": 0, "queued_prefill_tokens": 0,
            "free_blocks": total_blocks, "total_blocks": total_blocks, "held_blocks": 0,
            "prefix_queried_tokens": 0, "prefix_hit_tokens": 0, "num_preemptions": 0,
            "max_num_seqs": 128, "block_size": block_size, "worker_id": worker_id,
            "role": role, "engine_id": f"instant-{worker_id}", "kv_transfer": {}}


class InstantPool:
    def __init__(self, num_prefill: int, num_decode: int, token_id: int, token_text: str,
                 model_card, block_size: int = 16, total_blocks: int = 4096):
        def refs(role: str, count: int) -> list[WorkerRef]:
            return [WorkerRef(f"{role}-{i}", role, None,
                              load=idle_load(f"{role}-{i}", role, total_blocks, block_size))
                    for i in range(count)]

        self.prefill = refs("prefill", num_prefill)
        self.decode = refs("decode", num_decode)
        self.token_id = token_id
        self.token_text = token_text
        self.migrations = 0
        self.num_requests = 0
        self.model_card = model_card

    def fetch_model_card(self):
        return self.model_card

    async def refresh(self, timeout_s: float = 2.0) -> None:
        """Every worker is healthy and idle; the reports stay as built."""

    async def generate(self, request_id: str, prompt: Any, params,
                       disaggregate: bool = False, priority: int = 0,
                       cache_salt: Optional[str] = None, decode_worker: Optional[str] = None,
                       prefill_worker: Optional[str] = None,
                       deadline: Optional[float] = None) -> AsyncIterator[StreamChunk]:
        """`max_tokens` chunks of one token each, as a worker streams them, without waiting."""
        self.num_requests += 1
        path = "disaggregated" if disaggregate else "colocated"
        count = max(1, params.max_tokens)
        for i in range(count):
            finished = i == count - 1
            yield StreamChunk(request_id=request_id, token_ids=[self.token_id],
                              text=self.token_text, finished=finished,
                              finish_reason="length" if finished else None,
                              num_prompt_tokens=len(prompt), num_cached_tokens=0, path=path,
                              queue_s=0.0 if finished else None, worker_id=decode_worker)
