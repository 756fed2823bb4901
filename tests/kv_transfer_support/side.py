"""The in-test end of kv_transfer's two-process tests: an agent on a real transport plus the
allocator that models its engine's free list, with helpers to send, settle and check accounting.
"""

from __future__ import annotations

import time

from pd_runtime.kv_transfer.base import LinkState, SendOutcome
from pd_runtime.kv_transfer.registry import create_agent
from tests.kv_transfer_support.common import (BlockAllocator, collect, fill_random,
                                              transport_and_caches, wait_for)


class Side:
    def __init__(self, backend, overrides, engine_id, peer_timeout_s=2.0):
        cfg, transport, self.big, self.caches = transport_and_caches(backend, overrides)
        # create_agent wraps the transport itself where overrides ask for fault_injection
        self.agent = create_agent(cfg, self.caches, engine_id=engine_id, model_id="m",
                                  transport=transport, heartbeat_interval_s=0.2,
                                  peer_timeout_s=peer_timeout_s)
        self.transport = self.agent.transport
        self.alloc = BlockAllocator(48, seed=5)
        self.leased = {}

    def connect(self, metadata, peer_proc=None):
        """Connect and wait until the link is ready. Where it is not and peer_proc (the peer's
        PeerProcess) is given, the peer then connects back: whether that works tells a sender
        that can no longer receive at all from a hello lost in one direction."""
        peer = self.agent.connect(metadata)
        started = time.monotonic()
        try:
            wait_for(lambda: self.agent.peer_state(peer)[0] is LinkState.READY, 15)
        except TimeoutError:
            links = getattr(self.transport, "_links", [])
            detail = (f"link not ready after {time.monotonic() - started:.1f}s: {self.agent.peer_state(peer)}, "
                      f"transport retired: {getattr(self.transport, 'retired', None)}, "
                      f"open transport links: {sum(not x._closed for x in links)} of {len(links)}, "
                      f"peers: {[(p.peer_id, p.state.value, p.reason) for p in self.agent.peers.all()]}")
            if peer_proc is not None:
                try:
                    detail += f"; reverse connect from the peer: {peer_proc.call('connect', self.agent.metadata())}"
                except (TimeoutError, RuntimeError) as exc:
                    detail += f"; reverse connect from the peer: {exc}"
            raise TimeoutError(detail) from None
        return peer

    def send(self, peer, rid, n, dst_ids, layers=None, seed=0):
        src = self.alloc.take(n)
        fill_random(self.caches, src, seed)
        assert self.agent.send(peer, rid, src, dst_ids, layers) is SendOutcome.ACCEPTED
        self.leased[rid] = src
        return src

    def settle(self, rids, timeout_s=15):
        """Wait for the transfers to finish and free their leased blocks, as the engine does."""
        done = collect(self.agent, rids, timeout_s)
        for rid in rids:
            self.alloc.give_back(self.leased.pop(rid))
        return done

    def at_baseline(self, peer) -> bool:
        """Every block back on the free list, no credit held, nothing queued on the link."""
        credits = self.agent.peers.get(peer).credits
        return (self.alloc.balanced and self.agent.metrics()["in_flight_bytes"] == 0
                and credits.unacked_bytes == 0 and credits.queued_sends == 0)
