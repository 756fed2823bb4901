"""The router's estimate of which worker caches which prompt prefixes.

Built from the same chained block hashes the engine uses (pd_runtime.engine.kv_cache.block_hash): every
prompt routed to a worker records its full-block hashes there, newest last; each worker's
record is capped at its KV block count, the most it can hold, oldest forgotten first. An
estimate, not a mirror: a worker may have evicted what the router remembers.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from pd_runtime.engine.kv_cache.block_hash import block_hashes, root_hash


class PrefixIndex:
    def __init__(self, model_identity: str, block_size: int):
        self.model_identity = model_identity
        self.block_size = block_size
        self._by_worker: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    def hashes(self, token_ids: list[int], cache_salt: Optional[str]) -> list[int]:
        return block_hashes(token_ids, self.block_size,
                            root_hash(self.model_identity, None, cache_salt))

    def set_capacity(self, worker_id: str, num_blocks: int) -> None:
        self._capacity[worker_id] = max(1, num_blocks)

    def expected_hit_tokens(self, worker_id: str, hashes: list[int], prompt_len: int) -> int:
        """Leading prompt tokens the worker likely has cached (whole blocks, as the engine
        counts them: at least one prompt token is always computed)."""
        known = self._by_worker.get(worker_id)
        if not known:
            return 0
        max_blocks = (prompt_len - 1) // self.block_size
        hit = 0
        for h in hashes[:max_blocks]:
            if h not in known:
                break
            hit += 1
        return hit * self.block_size

    def record(self, worker_id: str, hashes: list[int]) -> None:
        known = self._by_worker.setdefault(worker_id, OrderedDict())
        for h in hashes:
            known[h] = None
            known.move_to_end(h)
        cap = self._capacity.get(worker_id, 1 << 30)
        while len(known) > cap:
            known.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        """A restarted worker starts with an empty cache."""
        self._by_worker.pop(worker_id, None)
