"""The group agent's contract with the worker, on real agents over the local backend: a send
refused with nothing started keeps no record (at one rank too); a send some of whose pieces
wait for room is accepted and completes as room comes; a refused expect leaves nothing; every
request ends once in on_release, and the tables are empty after."""

from __future__ import annotations

import threading

import pytest
import torch

from pd_runtime.kv_transfer.base import LinkState, SendOutcome, TransferState
from pd_runtime.kv_transfer.group import GroupAgent, released_by
from pd_runtime.kv_transfer.registry import create_agent
from tests.kv_transfer_support.common import config, wait_for

pytestmark = pytest.mark.timeout(60)

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_DIM, HEADS = 2, 16, 4, 8, 2


class Releases:
    def __init__(self):
        self.seen, self.lock = [], threading.Lock()

    def __call__(self, status):
        with self.lock:
            self.seen.append(status)


def _group(name: str, degree: int, releases, fill: float, **overrides):
    group = GroupAgent([], HEADS, on_release=releases)
    ranks, caches = [], []
    for rank in range(degree):
        big = torch.full((LAYERS, 2, BLOCKS, HEADS // degree, BLOCK_SIZE, HEAD_DIM), fill)
        ranks.append(create_agent(config("local", **overrides), [big[i] for i in range(LAYERS)],
                                  engine_id=f"{name}{rank}", model_id="m",
                                  on_release=released_by(group, rank),
                                  extra={"model_kv_heads": HEADS}))
        caches.append(big)
    group.ranks, group.degree = ranks, degree
    return group, caches


def _pair(p: int, d: int, **overrides):
    sent, got = Releases(), Releases()
    sender, src = _group("P", p, sent, 1.0, **overrides)
    receiver, dst = _group("D", d, got, -1.0, **overrides)
    peer = sender.connect(receiver.metadata())
    wait_for(lambda: sender.peer_state(peer)[0] is LinkState.READY)
    return sender, receiver, peer, sent, got, src, dst


@pytest.mark.parametrize("p, d", [(1, 1), (2, 1), (1, 2)])
def test_a_refused_first_send_keeps_nothing(p, d):
    sender, receiver, peer, sent, _, _, _ = _pair(p, d)
    try:  # the receiving worker gone: every rank's link fails, every piece is refused
        receiver.close()
        links = sender._peers[peer].links  # every rank's link seen down, not only the first
        wait_for(lambda: all(sender.ranks[rank].peer_state(link)[0] is LinkState.FAILED
                             for (rank, _), link in links.items()))
        assert sender.send(peer, "r", [1, 2], [3, 4]) is SendOutcome.PEER_UNAVAILABLE
        assert sender.table_sizes()["group_requests"] == 0 and not sent.seen
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("p, d", [(1, 1), (2, 1), (1, 2)])
def test_each_request_ends_once_and_the_tables_empty(p, d):
    sender, receiver, peer, sent, got, src, dst = _pair(p, d)
    try:
        for i in range(3):
            receiver.expect(f"r{i}", [3 + i, 8 + i], peer_degree=p)
            assert sender.send(peer, f"r{i}", [1 + i, 5 + i], [3 + i, 8 + i]) \
                is SendOutcome.ACCEPTED
        wait_for(lambda: len(sent.seen) == 3 and len(got.seen) == 3)
        assert sorted(s.request_id for s in got.seen) == ["r0", "r1", "r2"]
        assert all(s.state is TransferState.DONE for s in sent.seen + got.seen)
        whole_src = torch.cat(src, dim=3)
        whole_dst = torch.cat(dst, dim=3)
        assert torch.equal(whole_dst[:, :, [3, 8, 4, 9, 5, 10]],
                           whole_src[:, :, [1, 5, 2, 6, 3, 7]])
        wait_for(lambda: sender.table_sizes()["group_requests"] == 0
                 and receiver.table_sizes()["group_requests"] == 0)
    finally:
        sender.close()
        receiver.close()


def test_a_refused_expect_leaves_nothing_expected():
    _, receiver, _, _, got, _, _ = _pair(1, 2)
    try:
        receiver.expect("r", [1, 2], peer_degree=1)
        with pytest.raises(Exception):
            receiver.expect("r", [3, 4], peer_degree=1)  # a duplicate: refused by rank 0
        assert receiver.table_sizes()["group_requests"] == 1  # the first one only
        with pytest.raises(Exception, match="outside"):
            receiver.expect("bad", [1, BLOCKS + 3], peer_degree=1)
        assert receiver.table_sizes()["group_requests"] == 1
        receiver.cancel("r")
        wait_for(lambda: len(got.seen) == 1)
        assert got.seen[0].state is TransferState.FAILED
        assert receiver.table_sizes()["group_requests"] == 0
    finally:
        receiver.close()


def test_a_cancelled_send_ends_once_failed():
    sender, receiver, peer, sent, got, _, _ = _pair(2, 1)
    try:
        receiver.expect("r", [3, 4], peer_degree=2)
        receiver.cancel("r")
        wait_for(lambda: len(got.seen) == 1)
        outcome = sender.send(peer, "r", [1, 2], [3, 4])
        if outcome is SendOutcome.ACCEPTED:  # refused by the receiver: ends failed, once
            wait_for(lambda: len(sent.seen) == 1)
            assert sent.seen[0].state is TransferState.FAILED
        wait_for(lambda: sender.table_sizes()["group_requests"] == 0)
    finally:
        sender.close()
        receiver.close()
