"""Which KV heads go from which prefill rank to which decode rank when the two workers are
tensor-parallel groups of different degree, and where those heads lie inside a block.

Pure arithmetic on ints (no tensors, no I/O): both sides compute the same plan from
(num_kv_heads, prefill degree, decode degree), so it never needs to travel. Head split, the
Megatron / vLLM convention: with H KV heads over t ranks, H >= t gives rank r the heads
[r*H/t, (r+1)*H/t); H < t replicates each head over t/H ranks, rank r holding head r*H // t.
Inside one block of one layer's K or V half a rank's local heads lie one after another, each a
chunk of block_size * head_dim elements, so a contiguous head range is one contiguous extent.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple

from pd_runtime.kv_transfer.base import LayoutError
from pd_runtime.model import tensor_parallel

if TYPE_CHECKING:
    from pd_runtime.kv_transfer.layout import BlockRun


class HeadSplitError(LayoutError, ValueError):
    """KV heads that cannot be split over a tensor-parallel degree (neither divides the other),
    or a rank outside its group."""


def _check_split(num_kv_heads: int, tp: int, group: str = "") -> None:
    where = f"{group}: " if group else ""
    if num_kv_heads < 1 or tp < 1:
        raise HeadSplitError(f"{where}num_kv_heads={num_kv_heads} and tensor_parallel_size={tp} "
                             "must both be at least 1")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise HeadSplitError(
            f"{where}num_kv_heads={num_kv_heads} cannot be split over tensor_parallel_size={tp}: "
            "the KV heads must be a multiple of the degree (each rank holds heads/degree) or the "
            "degree a multiple of the KV heads (each head replicated on degree/heads ranks)")


def local_kv_heads(num_kv_heads: int, tp: int) -> int:
    """How many KV heads each rank of a group of degree tp holds (its cache's head dimension)."""
    _check_split(num_kv_heads, tp)
    return max(1, num_kv_heads // tp)


def kv_heads_of_rank(num_kv_heads: int, tp: int, rank: int) -> range:
    """The global KV head ids that `rank` of a group of degree `tp` holds, in cache order."""
    _check_split(num_kv_heads, tp)
    if not 0 <= rank < tp:
        raise HeadSplitError(f"rank {rank} outside a group of tensor_parallel_size={tp}")
    return tensor_parallel.kv_heads_of_rank(num_kv_heads, tp, rank)  # the model's own split


@dataclass(frozen=True)
class HeadPiece:
    """Heads one decode rank receives from one prefill rank: src_heads of the source's local
    heads land as dst_heads of the destination's (same length, both contiguous)."""

    src_rank: int
    src_heads: range
    dst_heads: range

    @property
    def num_heads(self) -> int:
        return len(self.dst_heads)


@dataclass(frozen=True)
class ReshardPlan:
    """pieces[d] lists what decode rank d receives, in its local head order; together they
    cover its heads exactly once. Block ids are shared by the ranks of a worker, so one block
    run applies to every piece."""

    num_kv_heads: int
    prefill_tp: int
    decode_tp: int
    pieces: tuple[tuple[HeadPiece, ...], ...]

    @property
    def prefill_local_heads(self) -> int:
        return max(1, self.num_kv_heads // self.prefill_tp)

    @property
    def decode_local_heads(self) -> int:
        return max(1, self.num_kv_heads // self.decode_tp)

    def pieces_for(self, decode_rank: int) -> tuple[HeadPiece, ...]:
        return self.pieces[decode_rank]

    def sends_from(self, prefill_rank: int) -> list[tuple[int, HeadPiece]]:
        """(decode rank, piece) for every piece this prefill rank sends, by decode rank."""
        return [(dst, piece) for dst, pieces in enumerate(self.pieces)
                for piece in pieces if piece.src_rank == prefill_rank]

    def heads_sent(self, prefill_rank: int) -> int:
        """The rank's send volume, in heads per block, layer and K/V half."""
        return sum(piece.num_heads for _, piece in self.sends_from(prefill_rank))


@lru_cache(maxsize=64)
def plan_reshard(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> ReshardPlan:
    """The plan for shipping a prompt's KV from a prefill group of degree prefill_tp to a
    decode group of degree decode_tp. A head held by several prefill ranks (num_kv_heads <
    prefill_tp) is sent by whichever of them has sent the fewest heads so far (lowest rank on
    a tie), so the prefill ranks' send volumes differ by at most one head; with equal degrees
    every rank sends its whole cache to the rank of the same index."""
    _check_split(num_kv_heads, prefill_tp, "prefill group")
    _check_split(num_kv_heads, decode_tp, "decode group")
    holders: dict[int, list[int]] = {}
    for src in range(prefill_tp):
        for head in kv_heads_of_rank(num_kv_heads, prefill_tp, src):
            holders.setdefault(head, []).append(src)
    sent = [0] * prefill_tp
    plan = []
    for dst in range(decode_tp):
        wanted = kv_heads_of_rank(num_kv_heads, decode_tp, dst)
        pieces: list[HeadPiece] = []
        for dst_local, head in enumerate(wanted):
            src = min(holders[head], key=lambda rank: (sent[rank], rank))
            sent[src] += 1
            src_local = head - kv_heads_of_rank(num_kv_heads, prefill_tp, src).start
            last = pieces[-1] if pieces else None
            # Heads are visited in destination order, so a piece that continues on the
            # source side continues on the destination side too.
            if last and last.src_rank == src and last.src_heads.stop == src_local:
                pieces[-1] = HeadPiece(src, range(last.src_heads.start, src_local + 1),
                                       range(last.dst_heads.start, dst_local + 1))
            else:
                pieces.append(HeadPiece(src, range(src_local, src_local + 1),
                                        range(dst_local, dst_local + 1)))
        plan.append(tuple(pieces))
    return ReshardPlan(num_kv_heads, prefill_tp, decode_tp, tuple(plan))


class Extent(NamedTuple):
    offset: int
    length: int


class Region(NamedTuple):
    """A copy: length units from src_offset of the prefill rank's layer K (or V) half to
    dst_offset of the decode rank's, both counted from that half's block 0."""

    src_offset: int
    dst_offset: int
    length: int


def head_chunk_size(block_size: int, head_dim: int, element_size: int = 1) -> int:
    """One KV head's tokens in one block of a K or V half: bytes, or elements with
    element_size=1. Every extent and region below is in this unit."""
    return block_size * head_dim * element_size


def block_extents(piece: HeadPiece, head_chunk: int) -> tuple[Extent, Extent]:
    """Where the piece lies inside one block of one layer's K or V half: (source, destination)."""
    length = piece.num_heads * head_chunk
    return (Extent(piece.src_heads.start * head_chunk, length),
            Extent(piece.dst_heads.start * head_chunk, length))


def run_regions(plan: ReshardPlan, piece: HeadPiece, run: "BlockRun",
                head_chunk: int) -> list[Region]:
    """The regions that move a piece over a run of blocks, for one layer's K or V half: one per
    block, or one for the whole run where the piece is the whole block on both sides (the
    run's blocks are then back to back on both sides)."""
    src_block = plan.prefill_local_heads * head_chunk
    dst_block = plan.decode_local_heads * head_chunk
    src, dst = block_extents(piece, head_chunk)
    if src.length == src_block == dst_block:
        return [Region(run.src_start * src_block, run.dst_start * dst_block,
                       run.length * src_block)]
    return [Region((run.src_start + i) * src_block + src.offset,
                   (run.dst_start + i) * dst_block + dst.offset, src.length)
            for i in range(run.length)]
