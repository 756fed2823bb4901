"""Block ids -> memory regions of the paged KV cache: validation, run merging, region views
and per-region checksums. Pure tensor bookkeeping, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy
import torch
import xxhash

from pd_runtime.kv_transfer.base import KV_LAYOUT, BlockIdError, LayoutError


@dataclass(frozen=True)
class BlockRun:
    """`length` consecutive blocks starting at src_start on the sender, dst_start on the receiver."""

    src_start: int
    dst_start: int
    length: int


def merge_runs(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[BlockRun]:
    """Pair source and destination ids and merge pairs that are consecutive on both sides, so
    a run of blocks moves as one region per layer and K/V half."""
    if len(src_block_ids) != len(dst_block_ids):
        raise BlockIdError(f"{len(src_block_ids)} source blocks but {len(dst_block_ids)} destination blocks")
    runs: list[BlockRun] = []
    src_start = dst_start = length = 0  # the run being extended (plain ints: ~5x faster)
    for src, dst in zip(src_block_ids, dst_block_ids):
        src, dst = int(src), int(dst)
        if length and src == src_start + length and dst == dst_start + length:
            length += 1
            continue
        if length:
            runs.append(BlockRun(src_start, dst_start, length))
        src_start, dst_start, length = src, dst, 1
    if length:
        runs.append(BlockRun(src_start, dst_start, length))
    return runs


def runs_to_wire(runs: Sequence[BlockRun]) -> list[list[int]]:
    return [[r.src_start, r.dst_start, r.length] for r in runs]


def runs_from_wire(raw) -> list[BlockRun]:
    return [BlockRun(int(a), int(b), int(n)) for a, b, n in raw]


class KVLayout:
    """The registered KV cache of one worker: one tensor per layer shaped
    [2, num_blocks, num_kv_heads, block_size, head_dim], contiguous (views of one big
    allocation are fine). A run of consecutive blocks is contiguous within K and within V."""

    def __init__(self, kv_caches: Sequence[torch.Tensor]):
        if not kv_caches:
            raise LayoutError("kv_caches is empty")
        first = kv_caches[0]
        for i, t in enumerate(kv_caches):
            if t.dim() != 5 or t.shape[0] != 2:
                raise LayoutError(f"layer {i}: expected [2, blocks, kv_heads, block_size, head_dim], got {tuple(t.shape)}")
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise LayoutError(f"layer {i}: shape/dtype/device differ from layer 0")
            if not t.is_contiguous():
                raise LayoutError(f"layer {i}: KV tensor must be contiguous")
        self.kv_caches = list(kv_caches)
        _, self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim = first.shape
        self.num_layers = len(kv_caches)
        self.dtype = first.dtype
        self.device = first.device
        self.layout = KV_LAYOUT
        self.block_bytes = first[0, 0].numel() * first.element_size()
        self.head_bytes = self.block_bytes // self.num_kv_heads  # one head's tokens in a block
        # Host caches: numpy byte views [2, num_blocks, block_bytes] per layer, so a region is
        # a numpy slice (sub-microsecond) rather than a chain of torch views (~10 us).
        self._host = ([t.view(torch.uint8).numpy().reshape(2, self.num_blocks, self.block_bytes)
                       for t in kv_caches] if self.device.type == "cpu" else None)

    def check_block_ids(self, block_ids: Sequence[int], what: str) -> None:
        ids = [int(b) for b in block_ids]
        if len(set(ids)) != len(ids):
            raise BlockIdError(f"{what} block ids repeat")
        for b in (min(ids), max(ids)) if ids else ():
            if not 0 <= b < self.num_blocks:
                raise BlockIdError(f"{what} block id {b} outside [0, {self.num_blocks})")

    def check_layers(self, layers: Sequence[int]) -> None:
        for layer in layers:
            if not 0 <= layer < self.num_layers:
                raise BlockIdError(f"layer {layer} outside [0, {self.num_layers})")

    def region(self, layer: int, kv: int, start: int, length: int):
        """Flat byte view of `length` blocks from `start` in K (kv=0) or V (kv=1) of a layer:
        a numpy uint8 array for a host cache, a uint8 tensor for a device one."""
        if self._host is not None:
            return self._host[layer][kv, start:start + length].reshape(-1)
        return self.kv_caches[layer][kv, start:start + length].reshape(-1).view(torch.uint8)

    def check_heads(self, heads: Optional[range]) -> None:
        if heads is not None and not (0 <= heads.start < heads.stop <= self.num_kv_heads):
            raise BlockIdError(f"KV heads {heads.start}..{heads.stop} outside the "
                               f"{self.num_kv_heads} this cache holds")

    def regions(self, runs: Sequence[BlockRun], layers: Sequence[int], side: str,
                heads: Optional[range] = None) -> Iterator:
        """Regions of the given layers in wire order (layer, K then V, run); side is src or dst.
        `heads`: a range of this cache's KV heads only (tensor-parallel resharding,
        kv_transfer/reshard.py): one region per block then (both sides cut alike, whatever
        the other cache's width), the range being contiguous inside a block only."""
        starts = [(run.src_start if side == "src" else run.dst_start, run.length) for run in runs]
        for layer in layers:
            for kv in (0, 1):
                for start, length in starts:
                    if heads is None:
                        yield self.region(layer, kv, start, length)
                    else:
                        for block in range(start, start + length):
                            yield self.head_region(layer, kv, block, heads)

    def head_region(self, layer: int, kv: int, block: int, heads: range):
        """Flat byte view of `heads` of one block in K or V of a layer."""
        if self._host is not None:
            return self._host[layer][kv, block,
                                     heads.start * self.head_bytes:heads.stop * self.head_bytes]
        return self.kv_caches[layer][kv, block, heads.start:heads.stop].reshape(-1).view(
            torch.uint8)

    def region_sizes(self, runs: Sequence[BlockRun], num_heads: Optional[int] = None) -> list[int]:
        """Bytes of each region of one layer's K or V half, in wire order (`num_heads`: a head
        range's width; None: whole blocks)."""
        if num_heads is None:
            return [run.length * self.block_bytes for run in runs]
        return [num_heads * self.head_bytes for run in runs for _ in range(run.length)]

    def bytes_for(self, num_blocks: int, num_layers: int, num_heads: Optional[int] = None) -> int:
        per_block = self.block_bytes if num_heads is None else num_heads * self.head_bytes
        return 2 * num_blocks * num_layers * per_block


def region_checksum(region) -> int:
    """xxh3-64 of a region's bytes (device tensors are copied to host first)."""
    if isinstance(region, numpy.ndarray):
        return xxhash.xxh3_64_intdigest(memoryview(region))
    return xxhash.xxh3_64_intdigest(memoryview(region.cpu().numpy()))
