"""Two real processes on 127.0.0.1, for torch_dist (gloo, and IPC's CPU twin) and ucx (tcp and
shm), and on a GPU for both (CUDA IPC, cuda_ipc): random block ids and contents arrive bit-exact
in exactly the reserved blocks; per-layer and whole-request sends; a metadata mismatch is
refused by name."""

import random

import pytest
import torch

from pd_runtime.kv_transfer.base import AgentMetadata, LinkState, MetadataMismatchError, SendOutcome, TransferState
from pd_runtime.kv_transfer.registry import create_agent
from tests.kv_transfer_support.common import (BlockAllocator, collect, fill_random,
                                              poison_untouched, transport_and_caches, wait_for)
from tests.kv_transfer_support.peer_proc import PeerProcess

BACKENDS = [("torch_dist", {}), ("ucx", {"ucx_mode": "tcp"}), ("ucx", {"ucx_mode": "shm"}),
            ("torch_dist", {"ipc_twin": True})]  # (one GPU's IPC path, on shared host memory)
IDS = ["gloo", "ucx-tcp", "ucx-shm", "ipc-twin"]


def _local_agent(backend, overrides, engine_id, num_layers=3):
    cfg, transport, big, caches = transport_and_caches(backend, overrides, num_layers)
    agent = create_agent(cfg, caches, engine_id=engine_id, model_id="m", transport=transport,
                         heartbeat_interval_s=0.2, peer_timeout_s=2.0)
    return agent, big, caches


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Both processes on one GPU (bench/gpu_check.py's tests stage runs these): torch_dist by CUDA
# IPC, UCX by cuda_ipc.
ON_ONE_GPU = [pytest.param("torch_dist", {"device": "cuda"}, marks=requires_cuda),
              pytest.param("ucx", {"device": "cuda"}, marks=requires_cuda)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend,overrides", BACKENDS + ON_ONE_GPU, ids=IDS + ["ipc-cuda", "ucx-cuda"])
def test_random_blocks_arrive_bit_exact_in_reserved_blocks_only(backend, overrides):
    rng = random.Random(11)
    receiver = PeerProcess(backend, "D", **overrides)
    sender, src_big, src_caches = _local_agent(backend, overrides, "P")
    try:
        peer = sender.connect(receiver.metadata)
        wait_for(lambda: sender.peer_state(peer)[0] is LinkState.READY, 15)
        src_alloc, dst_alloc = BlockAllocator(48, rng.random()), BlockAllocator(48, rng.random())
        plans = {}
        # runs (multi-block regions), then scattered ids (mostly one-block regions)
        for index, (per_layer, run) in enumerate([(False, True), (True, True), (False, False),
                                                  (True, False), (False, False), (True, False)]):
            n = rng.randint(1, 9) if not run else rng.randint(2, 5)
            take = "take_run" if run else "take"
            src_ids, dst_ids = getattr(src_alloc, take)(n), getattr(dst_alloc, take)(n)
            fill_random(src_caches, src_ids, seed=index)
            rid = f"r{index}"
            receiver.call("expect", rid, dst_ids)
            plans[rid] = (src_ids, dst_ids)
            # a full queue or credit window says WOULD_BLOCK, with nothing leased: try again
            if per_layer:
                for layer in range(3):
                    wait_for(lambda: sender.send(peer, rid, src_ids, dst_ids, layers=[layer]) is SendOutcome.ACCEPTED)
            else:
                wait_for(lambda: sender.send(peer, rid, src_ids, dst_ids) is SendOutcome.ACCEPTED)
        sent = collect(sender, plans, timeout_s=20)
        got = receiver.collect(plans)
        assert {s.state for s in sent.values()} == {TransferState.DONE}
        assert {state for state, _ in got.values()} == {"done"}
        dst_big = receiver.call("cache")
        for src_ids, dst_ids in plans.values():
            assert torch.equal(dst_big[:, :, dst_ids], src_big.cpu()[:, :, src_ids])
        assert poison_untouched(dst_big, [b for _, d in plans.values() for b in d])
    finally:
        sender.close()
        receiver.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend,overrides", BACKENDS[:2], ids=IDS[:2])
def test_metadata_mismatch_is_refused_on_both_ends(backend, overrides):
    receiver = PeerProcess(backend, "D", num_layers=2, **overrides)
    sender, _, _ = _local_agent(backend, overrides, "P")
    try:
        with pytest.raises(MetadataMismatchError, match="num_layers"):
            sender.connect(receiver.metadata)
        # A peer that lies about its layout gets past our check; the acceptor refuses it.
        forged = AgentMetadata.decode(receiver.metadata)
        forged = AgentMetadata(**{**forged.__dict__, "num_layers": 3})
        peer = sender.connect(forged.encode())
        wait_for(lambda: sender.peer_state(peer)[0] is not LinkState.CONNECTING, 15)
        state, reason = sender.peer_state(peer)
        assert state is LinkState.FAILED and "num_layers" in reason
        assert sender.send(peer, "r", [0], [0]) is SendOutcome.PEER_UNAVAILABLE
    finally:
        sender.close()
        receiver.close()
