"""The agent moving a range of KV heads only, between caches of different head counts (the
ranks of tensor-parallel workers of different degree, kv_transfer/reshard.py's plan): each
destination rank receives exactly its heads, counted in bytes, over the local and gloo
backends; a receiver expecting other heads refuses the chunk."""

from __future__ import annotations

import pytest
import torch

from pd_runtime.kv_transfer.base import LinkState, MetadataMismatchError, SendOutcome, TransferState
from pd_runtime.kv_transfer.registry import create_agent
from pd_runtime.kv_transfer.reshard import kv_heads_of_rank, plan_reshard
from tests.kv_transfer_support.common import collect, config, wait_for

pytestmark = pytest.mark.timeout(90)

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_DIM, MODEL_HEADS = 3, 24, 4, 8, 4


def _rank_caches(heads: int, fill: float):
    big = torch.full((LAYERS, 2, BLOCKS, heads, BLOCK_SIZE, HEAD_DIM), fill)
    return big, [big[i] for i in range(LAYERS)]


def _group(backend: str, degree: int, name: str, fill: float):
    """One agent per rank of a group of `degree`, each over its own heads' cache."""
    ranks = []
    for rank in range(degree):
        heads = len(kv_heads_of_rank(MODEL_HEADS, degree, rank))
        big, caches = _rank_caches(heads, fill)
        agent = create_agent(config(backend), caches, engine_id=f"{name}{rank}", model_id="m",
                             extra={"model_kv_heads": MODEL_HEADS, "tp_rank": rank,
                                    "tp_size": degree})
        ranks.append((agent, big))
    return ranks


@pytest.mark.parametrize("backend", ["local", "torch_dist"])
@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_each_decode_rank_receives_exactly_its_heads(backend, prefill_tp, decode_tp):
    gen = torch.Generator().manual_seed(prefill_tp * 10 + decode_tp)
    model = torch.randn(LAYERS, 2, BLOCKS, MODEL_HEADS, BLOCK_SIZE, HEAD_DIM, generator=gen)
    senders = _group(backend, prefill_tp, "P", 0.0)
    receivers = _group(backend, decode_tp, "D", -1.0)
    try:
        for rank, (_, big) in enumerate(senders):
            heads = kv_heads_of_rank(MODEL_HEADS, prefill_tp, rank)
            big.copy_(model[:, :, :, heads.start:heads.stop])
        src_ids, dst_ids = [3, 4, 5, 9], [10, 11, 20, 2]
        plan = plan_reshard(MODEL_HEADS, prefill_tp, decode_tp)
        links = {}
        for dst_rank, (receiver, _) in enumerate(receivers):
            for piece in plan.pieces_for(dst_rank):
                sender = senders[piece.src_rank][0]
                key = (piece.src_rank, dst_rank)
                if key not in links:
                    links[key] = sender.connect(receiver.metadata())
                    wait_for(lambda: sender.peer_state(links[key])[0] is LinkState.READY)
                rid = f"r-{piece.src_rank}-{dst_rank}-{piece.dst_heads.start}"
                receiver.expect(rid, dst_ids, heads=piece.dst_heads)
                for layer in range(LAYERS):  # layer by layer, as a prefill streams them
                    assert sender.send(links[key], rid, src_ids, dst_ids, layers=[layer],
                                       heads=(piece.src_heads, piece.dst_heads)) \
                        is SendOutcome.ACCEPTED
        for dst_rank, (receiver, big) in enumerate(receivers):
            rids = [f"r-{p.src_rank}-{dst_rank}-{p.dst_heads.start}"
                    for p in plan.pieces_for(dst_rank)]
            assert all(s.state is TransferState.DONE for s in collect(receiver, rids).values())
            heads = kv_heads_of_rank(MODEL_HEADS, decode_tp, dst_rank)
            assert torch.equal(big[:, :, dst_ids], model[:, :, src_ids, heads.start:heads.stop])
            untouched = [b for b in range(BLOCKS) if b not in dst_ids]
            assert bool((big[:, :, untouched] == -1.0).all())
            # bytes received: exactly this rank's heads of 4 blocks, every layer, K and V
            own = LAYERS * 2 * len(dst_ids) * len(heads) * BLOCK_SIZE * HEAD_DIM * 4
            assert receiver.metrics()["bytes_received"] == own
        for rank, (sender, _) in enumerate(senders):  # (counted once each chunk has left)
            sent = LAYERS * 2 * len(src_ids) * plan.heads_sent(rank) * BLOCK_SIZE * HEAD_DIM * 4
            wait_for(lambda: sender.metrics()["bytes_sent"] == sent)
    finally:
        for agent, _ in senders + receivers:
            agent.close()


def test_a_chunk_of_other_heads_is_refused_and_writes_nothing():
    (sender, src), = _group("local", 1, "P", 1.0)
    receivers = _group("local", 2, "D", -1.0)
    receiver, dst = receivers[1]
    try:
        peer = sender.connect(receiver.metadata())
        wait_for(lambda: sender.peer_state(peer)[0] is LinkState.READY)
        receiver.expect("r", [1, 2], heads=range(0, 2))
        sender.send(peer, "r", [5, 6], [1, 2], heads=(range(0, 1), range(0, 1)))
        assert collect(sender, ["r"])["r"].state is TransferState.FAILED
        assert bool((dst == -1.0).all())
    finally:
        for agent in (sender, receiver, receivers[0][0]):
            agent.close()


def test_ranks_of_different_models_still_refuse_each_other():
    _, a = _rank_caches(2, 0.0)
    _, b = _rank_caches(1, 0.0)
    left = create_agent(config("local"), a, engine_id="A", model_id="m",
                        extra={"model_kv_heads": 4})
    right = create_agent(config("local"), b, engine_id="B", model_id="m",
                         extra={"model_kv_heads": 2})
    try:
        with pytest.raises(MetadataMismatchError, match="model_kv_heads"):
            left.connect(right.metadata())
    finally:
        left.close()
        right.close()
