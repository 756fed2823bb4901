"""Many transfers at once over one link, from several threads, some cancelled on either side,
through a small credit window: every transfer ends exactly once on each side, the data of
every finished one is exact, and the link's accounting returns to zero. Local backend (its
links post asynchronously, so sends posted by the caller, by the reader on an ack, and by the
writer all occur)."""

import random
import threading
import time

import pytest
import torch

from pd_runtime.kv_transfer.base import FailureReason, LinkState, SendOutcome, TransferState
from pd_runtime.kv_transfer.registry import create_agent
from tests.kv_transfer_support.common import config, fill_random, make_caches, wait_for

pytestmark = pytest.mark.timeout(120)

LAYERS, BLOCKS, REQUESTS, THREADS = 4, 240, 40, 4


def _plans(rng):
    """(request, src ids, dst ids, layer groups, who cancels, before which group). Per-layer
    requests are cancelled only by their sender, which then stops (as a prefill would);
    whole ones by either side."""
    src_pool, dst_pool = list(range(BLOCKS)), list(range(BLOCKS))
    rng.shuffle(src_pool)
    rng.shuffle(dst_pool)
    plans = []
    for n in range(REQUESTS):
        count = rng.randint(1, 5)
        src_ids, dst_ids = src_pool[n * 6:n * 6 + count], dst_pool[n * 6:n * 6 + count]
        if rng.random() < 0.4:
            groups, cancel = [None], rng.choice([None, None, "sender", "receiver"])
        else:
            layers = rng.sample(range(LAYERS), LAYERS)
            groups, cancel = [[layer] for layer in layers], rng.choice([None, None, "sender"])
        # before which send the cancel comes (len(groups): after the last); a sender cancels
        # only once it has sent something (before that there is nothing of it to cancel)
        at = rng.randrange(1 if cancel == "sender" else 0, len(groups) + 1)
        plans.append((f"r{n}", src_ids, dst_ids, groups, cancel, at))
    return plans


def test_concurrent_transfers_with_cancels_end_once_and_keep_accounting():
    src_big, src = make_caches(num_layers=LAYERS, num_blocks=BLOCKS)
    dst_big, dst = make_caches(num_layers=LAYERS, num_blocks=BLOCKS)
    fill_random(list(src_big), list(range(BLOCKS)), seed=11)
    released = {"P": [], "D": []}
    # A window of a few layers of one request: sends meet WOULD_BLOCK and retry.
    cfg = config("local", credit_window_bytes=3 * 2 * 2 * 2048, max_queued_sends=3, checksums=True)
    sender = create_agent(cfg, src, engine_id="P", model_id="m", on_release=released["P"].append)
    receiver = create_agent(cfg, dst, engine_id="D", model_id="m", on_release=released["D"].append)
    accepted, lock = set(), threading.Lock()
    try:
        peer = sender.connect(receiver.metadata())
        wait_for(lambda: sender.peer_state(peer)[0] is LinkState.READY)
        plans = _plans(random.Random(5))
        for rid, _, dst_ids, *_ in plans:
            receiver.expect(rid, dst_ids)

        def run(share, seed):
            pause = random.Random(seed)
            for rid, src_ids, dst_ids, groups, cancel, at in share:
                for i, group in enumerate(groups):
                    if cancel and i == at:
                        (sender if cancel == "sender" else receiver).cancel(rid)
                        if cancel == "sender":
                            break
                    deadline = time.monotonic() + 20
                    while (outcome := sender.send(peer, rid, src_ids, dst_ids, layers=group)) \
                            is SendOutcome.WOULD_BLOCK:
                        assert time.monotonic() < deadline, f"{rid}: the window never reopened"
                        time.sleep(0.0005)
                    assert outcome is SendOutcome.ACCEPTED, (rid, outcome)
                    with lock:
                        accepted.add(rid)
                    time.sleep(pause.random() * 0.001)
                if cancel and at == len(groups):  # after everything was sent
                    (sender if cancel == "sender" else receiver).cancel(rid)

        threads = [threading.Thread(target=run, args=(plans[k::THREADS], k)) for k in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads)

        wait_for(lambda: len(released["P"]) >= len(accepted) and len(released["D"]) >= REQUESTS, timeout_s=30)
        time.sleep(0.2)  # anything ending twice would show now
        sent = {s.request_id: s for s in released["P"]}
        got = {s.request_id: s for s in released["D"]}
        assert len(sent) == len(released["P"]) == len(accepted)  # one end per sender transfer
        assert len(got) == len(released["D"]) == REQUESTS  # one end per reservation
        done = 0
        for rid, src_ids, dst_ids, groups, cancel, at in plans:
            if got[rid].state is TransferState.DONE:
                done += 1
                # (a sender's cancel may beat the ack of a transfer that arrived whole)
                assert sent[rid].state is TransferState.DONE or (
                    cancel == "sender" and sent[rid].reason is FailureReason.CANCELLED), (rid, sent[rid])
                assert torch.equal(dst_big[:, :, dst_ids], src_big[:, :, src_ids]), rid
            else:
                assert cancel is not None and got[rid].reason is FailureReason.CANCELLED, (rid, cancel, got[rid])
                # the receiver acks only what it holds: no sender is done without it
                assert rid not in sent or sent[rid].state is not TransferState.DONE, (rid, sent[rid])
        assert done >= REQUESTS // 2
        # Nothing left on the link or in the agents.
        wait_for(lambda: not sender._sending and not receiver._receiving, timeout_s=10)
        window = sender.peers.get("D").credits
        assert (window.queued_sends, window.unacked_bytes) == (0, 0)
        assert sender.metrics()["in_flight_bytes"] == 0
    finally:
        sender.close()
        receiver.close()
