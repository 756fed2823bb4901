"""Agent memory is flat: thousands of transfers through one sender/receiver pair (local backend),
completed, rejected, cancelled by either side and timed out, leave every per-request table on
both sides empty (the remembered statuses stay within their cap), each transfer ends exactly
once per side, and the credit window is back at zero. poll() still reports for agents built
without on_release, and holds nothing for those built with it."""

import random
import threading
import time

import pytest

from pd_runtime.kv_transfer import transfers
from pd_runtime.kv_transfer.base import (FailureReason, LinkError, LinkState, SendOutcome,
                                         TransferState)
from pd_runtime.kv_transfer.registry import create_agent
from tests.kv_transfer_support.common import config, fill_random, make_caches, wait_for

pytestmark = pytest.mark.timeout(120)

BLOCKS, BATCH, BATCHES = 256, 32, 100
KINDS = ("done", "done", "done", "layers", "rejected", "receiver_cancels_first",
         "receiver_cancels", "sender_cancels")
TIMEOUT_S = 2.0  # also the bound on a completed transfer: room for a loaded box
RECENT_CAP = 512  # below the number of transfers, so the cap is reached and shown to hold


class Ends:
    """on_release of one agent: every status it was given, in order."""

    def __init__(self):
        self.statuses, self.count = [], 0
        self._lock = threading.Lock()

    def __call__(self, status):
        with self._lock:
            self.statuses.append(status)
            self.count += 1


def _pair(on_release):
    cfg = config("local", transfer_timeout_s=TIMEOUT_S, lease_timeout_s=2 * TIMEOUT_S,
                 max_queued_sends=64, fault_injection=True)
    src_big, src = make_caches(num_blocks=BLOCKS)
    _, dst = make_caches(num_blocks=BLOCKS)
    fill_random(list(src_big), range(BLOCKS), seed=1)
    kwargs = {"peer_timeout_s": 5.0}
    sender = create_agent(cfg, src, engine_id="P", model_id="m",
                          on_release=on_release[0], **kwargs)
    receiver = create_agent(cfg, dst, engine_id="D", model_id="m",
                            on_release=on_release[1], **kwargs)
    peer = sender.connect(receiver.metadata())
    wait_for(lambda: sender.peer_state(peer)[0] is LinkState.READY)
    return sender, receiver, peer


def _send(sender, peer, rid, src_ids, dst_ids, layers=None):
    deadline = time.monotonic() + 20
    while (outcome := sender.send(peer, rid, src_ids, dst_ids, layers=layers)) is SendOutcome.WOULD_BLOCK:
        assert time.monotonic() < deadline, f"{rid}: the window never reopened"
        time.sleep(0.0005)
    assert outcome is SendOutcome.ACCEPTED, (rid, outcome)


def _batch(sender, receiver, peer, rng, number):
    """One batch of transfers of every kind at once; returns {rid: kind} and how many of them
    start a transfer on each side."""
    src_pool, dst_pool = rng.sample(range(BLOCKS), BLOCKS), rng.sample(range(BLOCKS), BLOCKS)
    plans = {}
    for k in range(BATCH):
        kind = KINDS[(number + k) % len(KINDS)]
        count = rng.randint(1, 4)
        plans[f"b{number}-{k}"] = (kind, src_pool[k * 8:k * 8 + count], dst_pool[k * 8:k * 8 + count])
    for rid, (kind, _, dst_ids) in plans.items():
        if kind != "rejected":
            receiver.expect(rid, dst_ids)
        if kind == "receiver_cancels_first":
            receiver.cancel(rid)
    for rid, (kind, src_ids, dst_ids) in plans.items():
        if kind == "layers":
            for layer in (2, 0, 1):
                _send(sender, peer, rid, src_ids, dst_ids, layers=[layer])
        elif kind == "sender_cancels":  # a prefill that stops after its first layer
            _send(sender, peer, rid, src_ids, dst_ids, layers=[0])
            sender.cancel(rid)
        else:
            _send(sender, peer, rid, src_ids, dst_ids)
        if kind == "receiver_cancels":
            receiver.cancel(rid)
    expected = sum(kind != "rejected" for kind, _, _ in plans.values())
    return {rid: kind for rid, (kind, _, _) in plans.items()}, len(plans), expected


def _assert_empty(agent):
    """Every per-request table of the agent is empty (a last control frame may still be on
    its way out), and the remembered statuses are within their cap."""
    deadline = time.monotonic() + 10
    while True:
        sizes = agent.table_sizes()
        left = {name: size for name, size in sizes.items() if name != "recent" and size}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert not left, f"{agent.engine_id} still holds {left}"
    assert 0 < sizes["recent"] <= transfers.RECENT_STATUSES, sizes


def test_thousands_of_transfers_leave_no_per_request_state(monkeypatch):
    monkeypatch.setattr(transfers, "RECENT_STATUSES", RECENT_CAP)
    sent_ends, got_ends = Ends(), Ends()
    sender, receiver, peer = _pair((sent_ends, got_ends))
    rng = random.Random(7)
    kinds, sent_total, got_total = {}, 0, 0
    try:
        for number in range(BATCHES):
            batch, sent, got = _batch(sender, receiver, peer, rng, number)
            kinds.update(batch)
            sent_total, got_total = sent_total + sent, got_total + got
            # the next batch reuses the blocks: both sides must be done with this one
            wait_for(lambda: sent_ends.count >= sent_total and got_ends.count >= got_total, timeout_s=20)
            assert sender.poll() == [] and receiver.poll() == []  # on_release took them all

        # Timeouts: reservations nothing is sent for, and sends whose chunks are lost.
        sender.set_link_faults(drop=1.0)
        for n in range(100):
            receiver.expect(f"lonely-{n}", [n])
            kinds[f"lonely-{n}"] = "receiver_times_out"
        for n in range(100):
            rid = f"lost-{n}"
            receiver.expect(rid, [100 + n])
            _send(sender, peer, rid, [n], [100 + n])
            kinds[rid] = "both_time_out"
        sent_total, got_total = sent_total + 100, got_total + 200
        wait_for(lambda: sent_ends.count >= sent_total and got_ends.count >= got_total, timeout_s=20)
        sender.set_link_faults()

        time.sleep(0.2)  # anything ending twice would show now
        assert len(kinds) > 2000
        sent = {s.request_id: s for s in sent_ends.statuses}
        got = {s.request_id: s for s in got_ends.statuses}
        assert len(sent) == len(sent_ends.statuses) == sent_total  # exactly one end per side
        assert len(got) == len(got_ends.statuses) == got_total
        for rid, kind in kinds.items():
            if kind in ("done", "layers"):
                assert sent[rid].state is got[rid].state is TransferState.DONE, (rid, sent[rid], got[rid])
            elif kind == "rejected":
                assert rid not in got and sent[rid].reason is FailureReason.REJECTED, (rid, sent[rid])
            elif kind == "receiver_cancels_first":  # the sender learns the reason from the nack
                assert got[rid].reason is sent[rid].reason is FailureReason.CANCELLED, (rid, sent[rid])
            elif kind == "receiver_times_out":
                assert rid not in sent and got[rid].reason is FailureReason.TIMEOUT, (rid, got[rid])
            elif kind == "both_time_out":
                assert sent[rid].reason is got[rid].reason is FailureReason.TIMEOUT, (rid, sent[rid], got[rid])
            elif kind == "sender_cancels":  # the abort follows the first layer's chunk
                assert sent[rid].reason is got[rid].reason is FailureReason.CANCELLED, (rid, sent[rid], got[rid])
            else:  # receiver_cancels: done on both sides (all read before the cancel) or on neither
                assert got[rid].reason in (FailureReason.CANCELLED, None), (rid, got[rid])
                assert (sent[rid].state is TransferState.DONE) == (got[rid].state is TransferState.DONE), \
                    (rid, sent[rid], got[rid])
        cut_short = sum(1 for rid, kind in kinds.items() if kind == "receiver_cancels"
                        and got[rid].state is TransferState.FAILED)
        assert cut_short, "no receiver cancel came before its transfer landed"

        for agent in (sender, receiver):
            _assert_empty(agent)
            assert agent.table_sizes()["recent"] == RECENT_CAP
        window = sender.peers.get("D").credits
        assert (window.queued_sends, window.unacked_bytes) == (0, 0)
        assert sender.metrics()["in_flight_bytes"] == 0
    finally:
        sender.close()
        receiver.close()


def test_poll_reports_each_transfer_once_without_on_release():
    sender, receiver, peer = _pair((None, None))
    try:
        batch, sent_total, got_total = _batch(sender, receiver, peer, random.Random(3), 0)
        got, sent = {}, {}

        def drained():
            for agent, into in ((sender, sent), (receiver, got)):
                for status in agent.poll():
                    assert status.request_id not in into, status  # reported once
                    into[status.request_id] = status
            return len(sent) == sent_total and len(got) == got_total
        wait_for(drained, timeout_s=20)
        assert {rid for rid, kind in batch.items() if kind != "rejected"} == set(got)
        assert all(got[rid].state is TransferState.DONE for rid, kind in batch.items() if kind == "done")
        time.sleep(0.2)
        assert sender.poll() == [] and receiver.poll() == []
        for agent in (sender, receiver):
            _assert_empty(agent)
        # poll() drains: statuses wait for it, and only until it runs
        receiver.expect("late", [0])
        receiver.cancel("late")
        assert receiver.table_sizes()["finished"] == 1
        assert [s.request_id for s in receiver.poll()] == ["late"]
        assert receiver.table_sizes()["finished"] == 0
    finally:
        sender.close()
        receiver.close()


def test_a_send_that_never_starts_ends_the_receive_at_once():
    """cancel_at_peer: the sender refused or gave up a send before any byte (nothing of it is
    in its tables); the receiver's expected transfer fails with CANCELLED right away, well
    before its deadline, and both sides' tables are empty."""
    ends = (Ends(), Ends())
    sender, receiver, peer = _pair(ends)
    try:
        receiver.expect("never-sent", [3, 4, 5])
        started = time.monotonic()
        assert sender.cancel_at_peer(peer, "never-sent")
        wait_for(lambda: ends[1].count == 1, timeout_s=TIMEOUT_S / 2)
        status = ends[1].statuses[0]
        assert (status.request_id, status.state, status.reason) == \
            ("never-sent", TransferState.FAILED, FailureReason.CANCELLED)
        assert time.monotonic() - started < TIMEOUT_S / 2
        assert not any(v for k, v in receiver.table_sizes().items() if k != "recent")
        assert ends[0].count == 0  # the sender had nothing to end
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("seen_first_by", ["writer", "reader"])
def test_a_peer_lost_mid_transfer_leaves_its_link_queue_empty(seen_first_by):
    """The peer dies with a receive pending: the receive fails peer_lost, and the failed link
    (kept in the table, so a send to it answers PEER_UNAVAILABLE) holds nothing for its writer,
    whichever of the link's threads saw the death first, nor takes a frame sent after it (a
    reader's late ack, an abort). A writer whose own heartbeat failed used to exit leaving its
    stop signal queued: the decode worker of a killed prefill worker kept one for good."""
    ends = (Ends(), Ends())
    sender, receiver, peer = _pair(ends)
    try:
        receiver.expect("orphan", [3, 4, 5], peer_id="P")
        link = receiver.peers.get("P")
        if seen_first_by == "writer":  # its next heartbeat fails; the reader learns from the close
            def gone(*_args, **_kwargs):
                raise LinkError("peer gone")
            link.link.send_frame = gone
        else:  # the reader reads the peer's goodbye while the writer waits for work
            sender.close()
        wait_for(lambda: ends[1].count == 1)
        assert ends[1].statuses[0].reason is FailureReason.PEER_LOST
        assert receiver.peer_state("P")[0] is LinkState.FAILED
        link.send_control({"t": "ack", "rid": "orphan", "layers": [0], "done": False})
        assert not receiver.cancel_at_peer("P", "orphan")
        _assert_empty(receiver)
    finally:
        sender.close()
        receiver.close()


def test_a_link_that_never_came_up_leaves_nothing_queued():
    """A connect to a peer that is gone fails in the handshake, before the link has a writer:
    nothing is left queued for one."""
    sender, receiver, peer = _pair((None, None))
    metadata = receiver.metadata()
    receiver.close()
    try:
        wait_for(lambda: sender.peer_state(peer)[0] is LinkState.FAILED)
        again = sender.connect(metadata)  # the listener is gone: the handshake fails
        wait_for(lambda: "no local agent" in (sender.peer_state(again)[1] or ""))
        assert sender.table_sizes()["link_queues"] == 0
    finally:
        sender.close()
