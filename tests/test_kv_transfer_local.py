"""Unit tests of the agent above the wire, over the in-process local backend."""

import pytest
import torch

from pd_runtime.kv_transfer.base import (FailureReason, LinkState, MetadataMismatchError, Role, SendOutcome,
                              TransferState)
from pd_runtime.kv_transfer.layout import BlockRun, merge_runs
from pd_runtime.kv_transfer.registry import create_agent
from tests.kv_transfer_support.common import (BlockAllocator, collect, config, fill_random,
                                              make_caches, poison_untouched, wait_for)

pytestmark = pytest.mark.timeout(60)


def test_merge_runs_joins_only_runs_consecutive_on_both_sides():
    assert merge_runs([4, 5, 6, 9], [10, 11, 13, 14]) == [BlockRun(4, 10, 2), BlockRun(6, 13, 1), BlockRun(9, 14, 1)]
    assert merge_runs([], []) == []


def _pair(num_layers=None, heartbeat_interval_s=None, **overrides):
    layers = {} if num_layers is None else {"num_layers": num_layers}
    live = {"peer_timeout_s": 2.0} if heartbeat_interval_s is None else \
        {"heartbeat_interval_s": heartbeat_interval_s, "peer_timeout_s": 2 * heartbeat_interval_s}
    src_big, src = make_caches(**layers)
    dst_big, dst = make_caches(**layers)
    sender = create_agent(config("local", **overrides), src, engine_id="P", model_id="m", **live)
    receiver = create_agent(config("local", **overrides), dst, engine_id="D", model_id="m", **live)
    peer = sender.connect(receiver.metadata())
    wait_for(lambda: sender.peer_state(peer)[0] is LinkState.READY)
    return sender, receiver, src_big, dst_big


def test_whole_and_per_layer_sends_land_in_reserved_blocks_only():
    sender, receiver, src_big, dst_big = _pair()
    try:
        src_alloc, dst_alloc = BlockAllocator(48, 1), BlockAllocator(48, 2)
        src_ids, dst_ids = src_alloc.take(10), dst_alloc.take(10)
        fill_random(list(src_big), src_ids, seed=3)
        receiver.expect("r1", dst_ids)
        assert sender.send("D", "r1", src_ids, dst_ids) is SendOutcome.ACCEPTED
        src2, dst2 = src_alloc.take(5), dst_alloc.take(5)
        fill_random(list(src_big), src2, seed=4)
        receiver.expect("r2", dst2)
        for layer in range(3):
            assert sender.send("D", "r2", src2, dst2, layers=[layer]) is SendOutcome.ACCEPTED
        got = collect(receiver, ["r1", "r2"])
        sent = collect(sender, ["r1", "r2"])
        assert all(s.state is TransferState.DONE for s in list(got.values()) + list(sent.values()))
        assert torch.equal(dst_big[:, :, dst_ids], src_big[:, :, src_ids])
        assert torch.equal(dst_big[:, :, dst2], src_big[:, :, src2])
        assert poison_untouched(dst_big, dst_ids + dst2)
    finally:
        sender.close()
        receiver.close()


def test_metadata_mismatch_names_field():
    _, a = make_caches()
    _, b = make_caches(num_layers=2)
    left = create_agent(config("local"), a, engine_id="A", model_id="m")
    right = create_agent(config("local"), b, engine_id="B", model_id="m")
    try:
        with pytest.raises(MetadataMismatchError, match="num_layers"):
            left.connect(right.metadata())
    finally:
        left.close()
        right.close()


def test_cancel_on_receiver_fails_sender_and_releases_both():
    sender, receiver, src_big, dst_big = _pair(transfer_timeout_s=3.0)
    try:
        receiver.expect("r", [1, 2])
        receiver.cancel("r")
        assert sender.send("D", "r", [3, 4], [1, 2]) is SendOutcome.ACCEPTED
        assert collect(receiver, ["r"])["r"].reason is FailureReason.CANCELLED
        assert collect(sender, ["r"])["r"].reason in (FailureReason.CANCELLED,)
        assert poison_untouched(dst_big, [])
    finally:
        sender.close()
        receiver.close()


def test_credit_window_reports_would_block_then_drains():
    sender, receiver, src_big, dst_big = _pair(credit_window_bytes=1, max_queued_sends=2)
    try:
        receiver.expect("a", [0])
        receiver.expect("b", [1])
        assert sender.send("D", "a", [0], [0]) is SendOutcome.ACCEPTED
        # Window of one byte: a second transfer must wait until the first is acked.
        outcome = sender.send("D", "b", [1], [1])
        if outcome is SendOutcome.WOULD_BLOCK:
            assert sender.metrics()["would_block"] == 1
            collect(sender, ["a"])
            assert sender.send("D", "b", [1], [1]) is SendOutcome.ACCEPTED
        assert collect(receiver, ["a", "b"])["b"].state is TransferState.DONE
    finally:
        sender.close()
        receiver.close()


def test_sendable_signal_fires_when_a_refused_send_may_go():
    """What a sender waits on instead of polling: the link coming up, credits coming back (the
    ack of a chunk), and the link failing (the refusal is final then)."""
    _, src = make_caches()
    _, dst = make_caches()
    overrides = dict(credit_window_bytes=1, max_queued_sends=2)
    sender = create_agent(config("local", **overrides), src, engine_id="P", model_id="m",
                          peer_timeout_s=1.0)
    receiver = create_agent(config("local", **overrides), dst, engine_id="D", model_id="m",
                            peer_timeout_s=1.0)
    fired = []
    sender.add_sendable_listener(lambda: fired.append(sender.peer_state("D")[0]))
    try:
        sender.connect(receiver.metadata())
        assert wait_for(lambda: LinkState.READY in fired), fired
        before = len(fired)
        receiver.expect("a", [0])
        assert sender.send("D", "a", [0], [0]) is SendOutcome.ACCEPTED
        assert collect(sender, ["a"])["a"].state is TransferState.DONE
        assert wait_for(lambda: len(fired) > before), "no signal when the ack returned credits"
        receiver.close()
        assert wait_for(lambda: LinkState.FAILED in fired, timeout_s=10.0), fired
    finally:
        sender.close()
        receiver.close()


def test_layers_sent_behind_an_unacked_chunk_leave_together():
    """Per-layer streaming: layer 0 goes at once; layers sent while it is unacked wait and leave
    as one chunk, when its ack comes or with the request's last layer. (No heartbeats: one
    holding the send lock at a send() would make it wait for the writer instead.)"""
    sender, receiver, src_big, dst_big = _pair(num_layers=4, heartbeat_interval_s=60.0)
    try:
        src_ids, dst_ids = [3, 4, 5], [7, 8, 20]
        fill_random(list(src_big), src_ids, seed=5)
        for rid in ("flush", "acked"):
            receiver.expect(rid, dst_ids)
        # "flush": the receiver is held (its reader waits on the agent lock), so nothing is
        # acked; layers 1-2 wait and go with layer 3, the last: two chunks in all.
        with receiver._lock:
            for layer in range(4):
                assert sender.send("D", "flush", src_ids, dst_ids, layers=[layer]) is SendOutcome.ACCEPTED
            assert sender.metrics()["chunks_sent"] == 2
        assert collect(sender, ["flush"])["flush"].state is TransferState.DONE
        # "acked": layers 1-2 wait behind layer 0 until the receiver is let go; its ack posts
        # them as one chunk; layer 3 then goes on its own: three chunks.
        with receiver._lock:
            for layer in range(3):
                sender.send("D", "acked", src_ids, dst_ids, layers=[layer])
            assert sender.metrics()["chunks_sent"] == 3
        wait_for(lambda: sender.metrics()["chunks_sent"] == 4)
        sender.send("D", "acked", src_ids, dst_ids, layers=[3])
        statuses = {**collect(sender, ["acked"]), **collect(receiver, ["flush", "acked"])}
        assert all(s.state is TransferState.DONE for s in statuses.values())
        assert sender.metrics()["chunks_sent"] == 5
        assert torch.equal(dst_big[:, :, dst_ids], src_big[:, :, src_ids])
        assert sender.metrics()["in_flight_bytes"] == 0
    finally:
        sender.close()
        receiver.close()


def test_failures_keep_their_reason_and_credits_stay_with_their_link():
    """A chunk that left before its link failed does not turn a shutdown into peer_lost, and
    layers still waiting on a replaced link are not charged to its replacement's window."""
    sender, receiver, src_big, dst_big = _pair(num_layers=4, heartbeat_interval_s=60.0)
    restarted = None
    try:
        receiver.expect("w", [1, 2])
        with receiver._lock:  # nothing is acked: layers 1-2 wait behind layer 0
            for layer in range(3):
                assert sender.send("D", "w", [5, 6], [1, 2], layers=[layer]) is SendOutcome.ACCEPTED
            _, restarted_caches = make_caches(num_layers=4)
            restarted = create_agent(config("local"), restarted_caches, engine_id="D", model_id="m",
                                     heartbeat_interval_s=60.0, peer_timeout_s=120.0)
            peer = sender.connect(restarted.metadata())  # the peer came back: the link is replaced
            wait_for(lambda: sender.peer_state(peer)[0] is LinkState.READY)
            assert collect(sender, ["w"])["w"].reason is FailureReason.PEER_LOST
            window = sender.peers.get("D").credits
            assert (window.queued_sends, window.unacked_bytes) == (0, 0)
        restarted.expect("s", [3])
        with restarted._lock:
            assert sender.send("D", "s", [7], [3]) is SendOutcome.ACCEPTED
            sender.close()
            assert collect(sender, ["s"])["s"].reason is FailureReason.SHUTDOWN
    finally:
        sender.close()
        receiver.close()
        if restarted is not None:
            restarted.close()
