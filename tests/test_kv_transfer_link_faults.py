"""Link faults injected at run time (pd_runtime/kv_transfer/faults.py) on the local backend and between two
real processes over gloo: every fault ends in a clean failure with its reason on both sides or
in exact bytes, within the deadline, with block and credit accounting back at its start."""

import time

import pytest
import torch

from pd_runtime.kv_transfer.base import FailureReason, LinkState, TransferState
from pd_runtime.kv_transfer.faults import FaultInjectingTransport, FaultSettingsError, LinkFaults
from pd_runtime.kv_transfer.backends.local import LocalTransport
from pd_runtime.kv_transfer.registry import create_agent
from tests.kv_transfer_support.common import POISON, collect, config, make_caches, poison_untouched
from tests.kv_transfer_support.peer_proc import PeerProcess
from tests.kv_transfer_support.side import Side

pytestmark = pytest.mark.timeout(90)
DEADLINE_S = 1.5
FAULTY = {"fault_injection": True, "transfer_timeout_s": DEADLINE_S, "lease_timeout_s": 3.0}


class LocalReceiver:
    """A receiving agent in this process, driven like a PeerProcess."""

    def __init__(self, **overrides):
        self.big, caches = make_caches()
        self.agent = create_agent(config("local", **overrides), caches, engine_id="D", model_id="m",
                                  heartbeat_interval_s=0.2, peer_timeout_s=2.0)
        self.metadata = self.agent.metadata()

    def call(self, command, *args):
        if command == "expect":
            return self.agent.expect(*args)
        if command == "cache":
            return self.big.clone()
        if command == "pending":
            return len(self.agent._receiving) + len(self.agent._reserved)
        raise ValueError(command)

    def collect(self, rids):
        return {rid: (s.state.value, s.reason.value if s.reason else None)
                for rid, s in collect(self.agent, rids, 15).items()}

    def close(self):
        self.agent.close()


def _transfer(side, peer, receiver, rid, dst, layers=None, seed=0):
    """Send a request's blocks to dst; returns (sender status, receiver outcome, seconds, src)."""
    receiver.call("expect", rid, dst)
    started = time.monotonic()
    src = side.send(peer, rid, len(dst), dst, layers=layers, seed=seed)
    status = side.settle([rid])[rid]
    elapsed = time.monotonic() - started
    return status, receiver.collect([rid])[rid], elapsed, src


def _each_fault(side, peer, receiver):
    """One link, faults changed at run time, one transfer per fault, then a clean one."""
    agent = side.agent
    # drop: the chunk never arrives; both sides time out, no byte lands, the link stays up
    agent.set_link_faults(drop=1.0, max_faults=1)
    dst = [0, 1, 2, 3, 4]
    status, theirs, elapsed, _ = _transfer(side, peer, receiver, "drop", dst)
    assert status.reason is FailureReason.TIMEOUT and theirs == ("failed", "timeout")
    assert elapsed < DEADLINE_S + 1.0
    assert bool((receiver.call("cache")[:, :, dst] == POISON).all())
    assert agent.peer_state(peer)[0] is LinkState.READY
    # corrupt: one flipped byte, caught by the receiver's checksum
    agent.set_link_faults(corrupt=1.0, max_faults=1, seed=3)
    status, theirs, _, _ = _transfer(side, peer, receiver, "corrupt", [5, 6, 7, 8, 9])
    assert status.reason is FailureReason.CHECKSUM_MISMATCH and theirs == ("failed", "checksum_mismatch")
    # duplicate of a whole transfer: the copy is drained, the transfer is done and exact
    agent.set_link_faults(duplicate=1.0, max_faults=1)
    dst = [10, 11, 12, 13]
    status, theirs, _, src = _transfer(side, peer, receiver, "dup", dst, seed=1)
    assert status.state is TransferState.DONE and theirs == ("done", None)
    assert torch.equal(receiver.call("cache")[:, :, dst], side.big[:, :, src])
    # duplicate of a first layer while the others are due: no layer is written twice; rejected
    agent.set_link_faults(duplicate=1.0, max_faults=1)
    status, theirs, _, _ = _transfer(side, peer, receiver, "dup-layer", [14, 15, 16], layers=[0])
    assert status.reason is FailureReason.REJECTED and theirs == ("failed", "rejected")
    # delay: the chunk leaves late and lands whole
    agent.set_link_faults(delay_s=0.3, max_faults=1)
    dst = [17, 18, 19]
    status, theirs, elapsed, src = _transfer(side, peer, receiver, "delay", dst, seed=2)
    assert status.state is TransferState.DONE and theirs == ("done", None) and elapsed >= 0.3
    assert torch.equal(receiver.call("cache")[:, :, dst], side.big[:, :, src])
    # every fault used up: a plain transfer on the same link
    dst = [20, 21]
    status, theirs, _, src = _transfer(side, peer, receiver, "clean", dst, seed=4)
    assert status.state is TransferState.DONE and theirs == ("done", None)
    assert torch.equal(receiver.call("cache")[:, :, dst], side.big[:, :, src])
    assert agent.metrics()["link_faults"] == {"chunks": 6, "drop": 1, "corrupt": 1, "duplicate": 2, "delay": 1}
    assert side.at_baseline(peer) and receiver.call("pending") == 0
    assert poison_untouched(receiver.call("cache"), range(22))


def test_each_link_fault_on_the_local_backend():
    side, receiver = Side("local", FAULTY, "P"), LocalReceiver(transfer_timeout_s=DEADLINE_S)
    try:
        assert isinstance(side.agent.transport, FaultInjectingTransport)
        _each_fault(side, side.connect(receiver.metadata), receiver)
    finally:
        side.agent.close()
        receiver.close()


def test_each_link_fault_between_two_processes_over_gloo():
    side = Side("torch_dist", FAULTY, "P")
    proc = PeerProcess("torch_dist", "D", transfer_timeout_s=DEADLINE_S)
    try:
        _each_fault(side, side.connect(proc.metadata), proc)
    finally:
        side.agent.close()
        proc.close()


def test_chunk_held_past_its_deadline_fails_both_sides_and_the_link_is_rebuilt():
    side, receiver = Side("local", FAULTY, "P"), LocalReceiver(transfer_timeout_s=DEADLINE_S)
    try:
        peer = side.connect(receiver.metadata)
        side.agent.set_link_faults(delay_s=30.0)
        status, theirs, elapsed, _ = _transfer(side, peer, receiver, "late", [0, 1, 2])
        assert status.reason is FailureReason.TIMEOUT and theirs[0] == "failed"
        assert theirs[1] in ("timeout", "peer_lost") and elapsed < DEADLINE_S + 1.0
        # a send that passed its deadline gives the link up (as any such send does)
        assert side.agent.peer_state(peer)[0] is LinkState.FAILED
        assert side.alloc.balanced and side.agent.metrics()["in_flight_bytes"] == 0
        side.agent.set_link_faults()
        peer = side.connect(receiver.metadata)
        status, theirs, _, src = _transfer(side, peer, receiver, "again", [3, 4], seed=5)
        assert status.state is TransferState.DONE and theirs == ("done", None)
        assert torch.equal(receiver.call("cache")[:, :, [3, 4]], side.big[:, :, src])
        assert side.at_baseline(peer) and receiver.call("pending") == 0
    finally:
        side.agent.close()
        receiver.close()


def test_random_faults_never_hang_nor_land_wrong_bytes():
    side = Side("local", {**FAULTY, "max_queued_sends": 64}, "P")
    receiver = LocalReceiver(transfer_timeout_s=DEADLINE_S)
    try:
        peer = side.connect(receiver.metadata)
        side.agent.set_link_faults(drop=0.15, corrupt=0.15, duplicate=0.15, delay=0.3, delay_s=0.05, seed=11)
        rids = [f"r{i}" for i in range(12)]
        dsts = {rid: [2 * i, 2 * i + 1] for i, rid in enumerate(rids)}
        sources = {}
        started = time.monotonic()
        for i, rid in enumerate(rids):
            receiver.call("expect", rid, dsts[rid])
            sources[rid] = side.send(peer, rid, 2, dsts[rid], seed=i)
        ours = side.settle(rids, timeout_s=3 * DEADLINE_S)
        theirs = receiver.collect(rids)
        assert time.monotonic() - started < DEADLINE_S + 1.0
        cache = receiver.call("cache")
        for rid in rids:
            if ours[rid].state is TransferState.DONE:  # only on the receiver's ack
                assert theirs[rid] == ("done", None)
            if theirs[rid][0] == "done":
                assert torch.equal(cache[:, :, dsts[rid]], side.big[:, :, sources[rid]])
            else:
                assert theirs[rid][1] in ("timeout", "checksum_mismatch")
        counts = side.agent.metrics()["link_faults"]
        assert counts["chunks"] == len(rids) and min(counts.values()) > 0  # every kind happened
        assert side.at_baseline(peer) and receiver.call("pending") == 0
        assert poison_untouched(cache, range(2 * len(rids)))
    finally:
        side.agent.close()
        receiver.close()


def test_fault_settings_are_checked():
    with pytest.raises(FaultSettingsError, match="drop"):
        LinkFaults(drop=1.5)
    with pytest.raises(FaultSettingsError, match="exceed 1"):
        LinkFaults(drop=0.6, corrupt=0.6)
    with pytest.raises(FaultSettingsError, match="delay_s"):
        LinkFaults(delay_s=-1)
    _, caches = make_caches()
    plain = create_agent(config("local"), caches, engine_id="A", model_id="m")
    unchecked = create_agent(config("local", fault_injection=True, checksums=False), caches,
                             engine_id="B", model_id="m")
    try:
        with pytest.raises(FaultSettingsError, match="fault_injection"):
            plain.set_link_faults(drop=0.5)
        with pytest.raises(FaultSettingsError, match="checksums"):
            unchecked.set_link_faults(corrupt=0.5)
        unchecked.set_link_faults(drop=0.5)  # what needs no checksum is fine
        assert "link_faults" not in plain.metrics()
    finally:
        plain.close()
        unchecked.close()


def test_draws_follow_the_seed():
    transport = FaultInjectingTransport(LocalTransport())
    try:
        def pattern():
            transport.set_faults(LinkFaults(drop=0.3, corrupt=0.2, duplicate=0.2, delay=0.5, delay_s=0.1, seed=7))
            return [transport.draw() for _ in range(40)]
        first = pattern()
        assert pattern() == first
        kinds = {("drop" if p.drop else "corrupt" if p.corrupt_at else "dup" if p.duplicate else "none") for p in first}
        assert kinds == {"drop", "corrupt", "dup", "none"}
        transport.set_faults(LinkFaults(drop=1.0, max_faults=2))
        assert [transport.draw().drop for _ in range(4)] == [True, True, False, False]
    finally:
        transport.close()


def test_discarded_bytes_are_read_into_a_buffer_on_the_cache_device():
    """A chunk no longer wanted is still read off the ordered stream, into scratch on the KV
    cache's device, as the sender posted it from the cache: a link picks its group by the
    buffer's device (NCCL for CUDA, gloo for host memory), so the read waits on the group the
    chunk was sent on. `meta` stands in for a device other than the host."""
    from pd_runtime.kv_transfer.layout import KVLayout
    from pd_runtime.kv_transfer.wire import ScratchBuffer

    layout = KVLayout([torch.empty(2, 4, 2, 16, 8, device="meta") for _ in range(2)])
    scratch = ScratchBuffer(layout).region(3 * layout.block_bytes)
    region = layout.region(0, 0, 1, 3)
    assert scratch.device == region.device
    assert scratch.dtype == region.dtype and scratch.numel() == region.numel()


def test_discarded_bytes_are_read_on_the_group_they_were_sent_on():
    """The torch_dist link's group choice: the sender posts a chunk from the cache's blocks,
    so for a device cache on its data group (NCCL for CUDA); the receiver that no longer
    wants it reads it into scratch, which must pick the same group. A host scratch (the old
    discard path) picks gloo and would wait there for ever. `meta` stands in for the device."""
    from types import SimpleNamespace

    from pd_runtime.kv_transfer.layout import KVLayout
    from pd_runtime.kv_transfer.backends.torch_dist import TorchDistLink
    from pd_runtime.kv_transfer.wire import ScratchBuffer

    link = SimpleNamespace(_data="nccl group", _control="gloo group")
    layout = KVLayout([torch.empty(2, 4, 2, 16, 8, device="meta") for _ in range(2)])
    sent = layout.region(1, 0, 2, 2)  # what the sender posts: bytes of the cache's blocks
    scratch = ScratchBuffer(layout).region(sent.numel())
    assert TorchDistLink._group_for(link, sent) == "nccl group"
    assert TorchDistLink._group_for(link, scratch) == "nccl group"
    host = torch.empty(sent.numel(), dtype=torch.uint8)  # the old scratch
    assert TorchDistLink._group_for(link, host) == "gloo group"
