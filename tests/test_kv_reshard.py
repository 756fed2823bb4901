"""The reshard plan between tensor-parallel groups of different degree, applied to real caches:
every decode rank ends with exactly its heads of the global cache, nothing more is moved, and
the prefill ranks share the sending evenly."""

from __future__ import annotations

import itertools

import pytest
import torch

from pd_runtime.kv_transfer.base import KVTransferError
from pd_runtime.kv_transfer.layout import BlockRun, merge_runs
from pd_runtime.kv_transfer.reshard import (HeadPiece, HeadSplitError, block_extents,
                                            head_chunk_size, kv_heads_of_rank, local_kv_heads,
                                            plan_reshard, run_regions)

DEGREES = (1, 2, 4, 8)
HEAD_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16)
NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM = 2, 8, 4, 8
# Source and destination ids differ and form several runs, some of one block.
SRC_IDS, DST_IDS = [1, 2, 3, 6, 0], [4, 5, 6, 0, 2]


def splits(num_kv_heads: int, tp: int) -> bool:
    return num_kv_heads % tp == 0 or tp % num_kv_heads == 0


VALID = [(h, p, d) for h, p, d in itertools.product(HEAD_COUNTS, DEGREES, DEGREES)
         if splits(h, p) and splits(h, d)]
INVALID = [(h, p, d) for h, p, d in itertools.product(HEAD_COUNTS, DEGREES, DEGREES)
           if not (splits(h, p) and splits(h, d))]


def rank_cache(global_cache: torch.Tensor, num_kv_heads: int, tp: int, rank: int) -> torch.Tensor:
    heads = kv_heads_of_rank(num_kv_heads, tp, rank)
    return global_cache[:, :, heads.start:heads.stop].contiguous()


BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def global_caches(num_kv_heads: int, dtype: torch.dtype) -> list[torch.Tensor]:
    # Every element a distinct bit pattern (compared as integers), so a head copied to the
    # wrong place or from the wrong block shows.
    shape = (2, NUM_BLOCKS, num_kv_heads, BLOCK_SIZE, HEAD_DIM)
    n = 2 * NUM_BLOCKS * num_kv_heads * BLOCK_SIZE * HEAD_DIM
    return [(torch.arange(n) + layer * n + 1).to(BITS[dtype]).view(shape).view(dtype)
            for layer in range(NUM_LAYERS)]


def byte_half(cache: torch.Tensor, kv: int) -> torch.Tensor:
    return cache[kv].reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("num_kv_heads,prefill_tp,decode_tp", VALID)
def test_plan_moves_exactly_each_decode_ranks_heads(num_kv_heads, prefill_tp, decode_tp, dtype):
    plan = plan_reshard(num_kv_heads, prefill_tp, decode_tp)
    global_cache = global_caches(num_kv_heads, dtype)
    prefill = [[rank_cache(g, num_kv_heads, prefill_tp, r) for g in global_cache]
               for r in range(prefill_tp)]
    decode = [[torch.full_like(rank_cache(g, num_kv_heads, decode_tp, r).view(BITS[dtype]), -1)
               .view(dtype) for g in global_cache] for r in range(decode_tp)]
    untouched = [[c.clone() for c in caches] for caches in decode]
    chunk = head_chunk_size(BLOCK_SIZE, HEAD_DIM, global_cache[0].element_size())
    runs = merge_runs(SRC_IDS, DST_IDS)
    received = [0] * decode_tp

    for dst, pieces in enumerate(plan.pieces):
        for piece, layer, kv, run in itertools.product(pieces, range(NUM_LAYERS), (0, 1), runs):
            src_half = byte_half(prefill[piece.src_rank][layer], kv)
            dst_half = byte_half(decode[dst][layer], kv)
            for region in run_regions(plan, piece, run, chunk):
                dst_half[region.dst_offset:region.dst_offset + region.length] = \
                    src_half[region.src_offset:region.src_offset + region.length]
                received[dst] += region.length

    for dst in range(decode_tp):
        heads = kv_heads_of_rank(num_kv_heads, decode_tp, dst)
        for layer in range(NUM_LAYERS):
            want = untouched[dst][layer].clone()
            want[:, DST_IDS] = global_cache[layer][:, SRC_IDS, heads.start:heads.stop]
            assert torch.equal(decode[dst][layer].view(BITS[dtype]), want.view(BITS[dtype]))
        # Exactly this rank's heads, for every block, layer and K/V half: nothing extra.
        assert received[dst] == len(heads) * chunk * len(SRC_IDS) * NUM_LAYERS * 2


@pytest.mark.parametrize("num_kv_heads,prefill_tp,decode_tp", VALID)
def test_plan_covers_each_head_once_from_one_holder_in_merged_pieces(num_kv_heads, prefill_tp,
                                                                    decode_tp):
    plan = plan_reshard(num_kv_heads, prefill_tp, decode_tp)
    assert len(plan.pieces) == decode_tp
    for dst, pieces in enumerate(plan.pieces):
        wanted = kv_heads_of_rank(num_kv_heads, decode_tp, dst)
        got = []
        for piece in pieces:
            src_heads = kv_heads_of_rank(num_kv_heads, prefill_tp, piece.src_rank)
            assert len(piece.src_heads) == len(piece.dst_heads) >= 1
            assert piece.src_heads.start >= 0 and piece.src_heads.stop <= len(src_heads)
            # The source really holds the heads it sends, and they are the ones wanted there.
            assert [src_heads[i] for i in piece.src_heads] == [wanted[i] for i in piece.dst_heads]
            got.extend(piece.dst_heads)
        assert got == list(range(len(wanted))), "each local head once, in order"
        for a, b in zip(pieces, pieces[1:]):
            assert not (a.src_rank == b.src_rank and a.src_heads.stop == b.src_heads.start), \
                f"pieces {a} and {b} should have been one"


@pytest.mark.parametrize("num_kv_heads,prefill_tp,decode_tp", VALID)
def test_prefill_ranks_share_the_sending(num_kv_heads, prefill_tp, decode_tp):
    plan = plan_reshard(num_kv_heads, prefill_tp, decode_tp)
    sent = [plan.heads_sent(r) for r in range(prefill_tp)]
    assert sum(sent) == decode_tp * local_kv_heads(num_kv_heads, decode_tp)
    # The replicas of a head split its receivers evenly; every head has as many receivers, so
    # no rank sends more than one head (per block, layer and half) beyond any other.
    assert max(sent) - min(sent) <= 1
    if num_kv_heads >= prefill_tp:
        assert len(set(sent)) == 1, "no replicas, no choice: each rank sends its heads alike"
    assert plan == plan_reshard.__wrapped__(num_kv_heads, prefill_tp, decode_tp), "deterministic"


@pytest.mark.parametrize("num_kv_heads,tp", [(h, p) for h, p, d in VALID if p == d])
def test_equal_degrees_send_each_rank_its_own_cache(num_kv_heads, tp):
    plan = plan_reshard(num_kv_heads, tp, tp)
    local = range(local_kv_heads(num_kv_heads, tp))
    assert plan.pieces == tuple((HeadPiece(r, local, local),) for r in range(tp))


def test_rank_head_ranges_follow_the_megatron_split():
    assert [kv_heads_of_rank(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [kv_heads_of_rank(8, 8, r) for r in range(8)] == [range(r, r + 1) for r in range(8)]
    assert [kv_heads_of_rank(2, 8, r)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [kv_heads_of_rank(1, 4, r) for r in range(4)] == [range(0, 1)] * 4
    assert local_kv_heads(16, 4) == 4 and local_kv_heads(2, 8) == 1


def test_extents_inside_a_block_and_run_regions():
    plan = plan_reshard(8, 2, 4)  # prefill ranks hold 4 heads, decode ranks 2
    piece = plan.pieces_for(1)[0]
    assert piece == HeadPiece(0, range(2, 4), range(0, 2))
    chunk = head_chunk_size(16, 64, 2)
    assert chunk == 2048
    src, dst = block_extents(piece, chunk)
    assert (src.offset, src.length, dst.offset, dst.length) == (4096, 4096, 0, 4096)
    # Half of each source block: one region per block, strided by the source's block.
    regions = run_regions(plan, piece, BlockRun(3, 7, 2), chunk)
    assert [tuple(r) for r in regions] == [(3 * 8192 + 4096, 7 * 4096, 4096),
                                           (4 * 8192 + 4096, 8 * 4096, 4096)]
    # Whole blocks on both sides: the run is one region.
    same = plan_reshard(8, 2, 2)
    regions = run_regions(same, same.pieces_for(1)[0], BlockRun(3, 7, 2), chunk)
    assert [tuple(r) for r in regions] == [(3 * 8192, 7 * 8192, 2 * 8192)]
    assert plan.sends_from(1) == [(2, plan.pieces_for(2)[0]), (3, plan.pieces_for(3)[0])]


@pytest.mark.parametrize("num_kv_heads,prefill_tp,decode_tp", INVALID)
def test_sizes_that_do_not_split_are_refused_naming_them(num_kv_heads, prefill_tp, decode_tp):
    with pytest.raises(HeadSplitError) as err:
        plan_reshard(num_kv_heads, prefill_tp, decode_tp)
    bad_group, bad_tp = (("prefill", prefill_tp) if not splits(num_kv_heads, prefill_tp)
                         else ("decode", decode_tp))
    message = str(err.value)
    assert f"{bad_group} group" in message
    assert f"num_kv_heads={num_kv_heads}" in message and f"tensor_parallel_size={bad_tp}" in message
    assert isinstance(err.value, KVTransferError) and isinstance(err.value, ValueError)


@pytest.mark.parametrize("args,named", [((6, 4, 0), "tensor_parallel_size=4"),
                                        ((3, 2, 1), "num_kv_heads=3"),
                                        ((8, 4, 4), "rank 4"), ((8, 4, -1), "rank -1"),
                                        ((0, 1, 0), "num_kv_heads=0"),
                                        ((4, 0, 0), "tensor_parallel_size=0")])
def test_kv_heads_of_rank_refuses_bad_sizes(args, named):
    with pytest.raises(HeadSplitError, match=named):
        kv_heads_of_rank(*args)
