"""Bounded CPU swap space for preempted requests' KV blocks: block-id accounting only.

The scheduler decides which blocks move; the model runner copies the bytes.
"""

from __future__ import annotations


class SwapSpace:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n swap block ids, or None (nothing taken) when the space cannot hold them."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))
