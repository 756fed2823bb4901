"""torch_dist's IPC links (pd_runtime/kv_transfer/backends/ipc.py), the path of two workers on one GPU,
checked on their CPU twin: host caches in shared memory moved by the same records and copies.
Two transports of one process on 127.0.0.1 (real gloo groups, real shared-memory mappings); the
two-process transfer and fault suites run the twin too (ipc-twin in
tests/test_kv_transfer_two_process.py and tests/test_kv_transfer_faults.py)."""

import threading

import numpy
import pytest
import torch

from pd_runtime.kv_transfer.backends import ipc
from pd_runtime.kv_transfer.base import LinkError, frame_buffers
from pd_runtime.kv_transfer.backends.torch_dist import TorchDistTransport

pytestmark = pytest.mark.timeout(60)
CPU = torch.device("cpu")


def _shared(values):
    tensor = torch.tensor(values, dtype=torch.float32)
    tensor.share_memory_()
    return tensor


def _pair(a_kwargs, b_kwargs):
    """(connecting transport, accepting transport, its link, the other's link)."""
    a = TorchDistTransport("127.0.0.1", 0, CPU, **a_kwargs)
    b = TorchDistTransport("127.0.0.1", 0, CPU, **b_kwargs)
    accepted = {}
    thread = threading.Thread(target=lambda: accepted.setdefault("link", b.accept(15)))
    thread.start()
    link_a = a.connect(b.address(), 15)
    thread.join()
    return a, b, link_a, accepted["link"]


def _post(link, messages):
    """Send raw messages (records) from another thread: a gloo send waits for its receive (the
    receiver may close the link first: then the send fails, as it should)."""
    def send():
        try:
            link._post_all(messages, 10, "send")
        except LinkError:
            pass

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _close(*things):
    for thing in things:
        thing.close()


def test_ranges_of_a_registered_storage_are_copied_and_frames_travel_inline():
    src = _shared([float(i) for i in range(4096)])
    dst = _shared([0.0] * 4096)
    a, b, link_a, link_b = _pair(dict(use_ipc=True, host_shared=[src]),
                                 dict(use_ipc=True, host_shared=[dst]))
    try:
        assert link_a._exports is not None and link_b._mappings is not None
        unregistered = torch.arange(64, dtype=torch.float32)  # not shared: goes inline
        sent = frame_buffers(b"header") + [src[100:200].view(torch.uint8),
                                           src.numpy()[3000:3010].view(numpy.uint8),
                                           unregistered.view(torch.uint8)]
        sender = threading.Thread(target=link_a.send_many, args=(sent, 10))
        sender.start()
        assert link_b.recv_frame(10) == b"header"
        other = torch.zeros(64, dtype=torch.float32)
        link_b.recv_many([dst[0:100].view(torch.uint8), dst.numpy()[500:510].view(numpy.uint8),
                          other.view(torch.uint8)], 10)
        sender.join()
        assert torch.equal(dst[0:100], src[100:200])
        assert torch.equal(dst[500:510], src[3000:3010])
        assert torch.equal(other, unregistered)
        # the storage was exported once, for both ranges; the receiver mapped it once
        assert len(link_a._exports._kept) == 1 and list(link_b._mappings._mapped) == [0]
    finally:
        _close(link_a, link_b, a, b)


def test_a_send_lasts_until_the_receiver_has_copied_its_ranges():
    """Until the peer has copied a range it may still read it: the send (and with it the
    transfer's lease on those blocks) is not over before the peer acknowledges the copy."""
    src = _shared([float(i) for i in range(1024)])
    dst = _shared([0.0] * 1024)
    a, b, link_a, link_b = _pair(dict(use_ipc=True, host_shared=[src]),
                                 dict(use_ipc=True, host_shared=[dst]))
    try:
        sender = threading.Thread(target=link_a.send_many,
                                  args=([src[0:512].view(torch.uint8)], 10), daemon=True)
        sender.start()
        sender.join(0.5)
        assert sender.is_alive()  # the records went out; the copy is not made yet
        link_b.recv_bytes(dst[0:512].view(torch.uint8), 10)
        sender.join(10)
        assert not sender.is_alive()
        assert torch.equal(dst[0:512], src[0:512])
        assert link_a._copies_acked == link_a._exports.copies == 1
    finally:
        _close(link_a, link_b, a, b)


def test_a_chunks_copy_records_go_as_one_batch_taken_by_later_receives_in_turn():
    """A chunk's regions go as one batch message after the header's inline frames; the
    receiver takes its records one by one, also across receives (a discarded chunk is read
    region by region), and copies each range as if its record had come alone."""
    src = _shared([float(i) for i in range(4096)])
    dst = _shared([0.0] * 4096)
    a, b, link_a, link_b = _pair(dict(use_ipc=True, host_shared=[src]),
                                 dict(use_ipc=True, host_shared=[dst]))
    try:
        regions = [src[i * 100:(i + 1) * 100].view(torch.uint8) for i in range(5)]
        exports = ipc.Exports([src])  # (the messages a link would post, posted nowhere)
        kinds = [ipc.read_record(m)[0] for m in exports.messages(regions[:1])
                 if m.size == ipc.RECORD_BYTES]  # (the map payload is longer)
        assert kinds == [ipc.MAP, ipc.COPY]  # one region: a plain copy record
        messages = exports.messages(regions)  # the storage is mapped by now
        assert len(messages) == 2 and ipc.read_record(messages[0])[:2] == (ipc.BATCH, 5)
        sender = threading.Thread(target=link_a.send_many,
                                  args=(frame_buffers(b"kv") + regions, 10))
        sender.start()
        assert link_b.recv_frame(10) == b"kv"
        link_b.recv_many([dst[0:100].view(torch.uint8), dst[100:200].view(torch.uint8)], 10)
        for i in range(2, 5):
            link_b.recv_bytes(dst[i * 100:(i + 1) * 100].view(torch.uint8), 10)
        sender.join(10)
        assert not sender.is_alive() and link_a._copies_acked == 5
        assert torch.equal(dst[:500], src[:500])
    finally:
        _close(link_a, link_b, a, b)


def _bad_records(src):
    """(records a sender posts, the error the receiver raises): a range past the end of the
    mapped storage; a message of another length than the buffer posted for it."""
    payload = numpy.frombuffer(bytearray(ipc._export(src.untyped_storage())), dtype=numpy.uint8)
    yield ([ipc.record(ipc.MAP, 0, 0, payload.size), payload, ipc.record(ipc.COPY, 0, 1000, 64)],
           "out of range")
    yield ([ipc.record(ipc.INLINE, 0, 0, 32), numpy.zeros(32, dtype=numpy.uint8)],
           "32 bytes for a 64-byte buffer")
    # a batch whose count does not match its length, or that holds other than copy records
    yield ([ipc.record(ipc.BATCH, 3, 0, 2 * ipc.RECORD_BYTES),
            numpy.concatenate([ipc.record(ipc.COPY, 0, 0, 64)] * 2)], "64 bytes for 3 records")
    yield ([ipc.record(ipc.BATCH, 2, 0, 2 * ipc.RECORD_BYTES),
            numpy.concatenate([ipc.record(ipc.COPY, 0, 0, 64), ipc.record(ipc.INLINE, 0, 0, 64)])],
           "copy records only")


def test_a_record_out_of_range_or_of_another_length_fails_the_link():
    src = _shared([1.0] * 256)
    for records, error in _bad_records(src):
        a, b, link_a, link_b = _pair(dict(use_ipc=True, host_shared=[src]), dict(use_ipc=True))
        try:
            _post(link_a, records)
            with pytest.raises(LinkError, match=error):
                link_b.recv_bytes(torch.zeros(64, dtype=torch.uint8), 10)
            with pytest.raises(LinkError, match="closed"):  # and the link is gone
                link_b.recv_bytes(torch.zeros(64, dtype=torch.uint8), 10)
        finally:
            _close(link_a, link_b, a, b)


@pytest.mark.parametrize("same_gpu", [True, False])
def test_the_connecting_side_picks_ipc_by_gpu_and_the_acceptor_follows(same_gpu):
    """Auto: IPC only where both transports report the same GPU (by UUID); the accepting side
    reads the decision from the store. Host caches report none, so they keep gloo."""
    a, b, link_a, link_b = _pair({}, {})
    assert a.address()["gpu"] is None
    assert link_a._exports is None and link_b._mappings is None
    _close(link_a, link_b, a, b)
    a = TorchDistTransport("127.0.0.1", 0, CPU)
    b = TorchDistTransport("127.0.0.1", 0, CPU)
    a._gpu, b._gpu = "GPU-aaaa", "GPU-aaaa" if same_gpu else "GPU-bbbb"  # as CUDA devices report
    accepted = {}
    thread = threading.Thread(target=lambda: accepted.setdefault("link", b.accept(15)))
    thread.start()
    link_a = a.connect(b.address(), 15)
    thread.join()
    link_b = accepted["link"]
    try:
        assert (link_a._exports is not None) is same_gpu
        assert (link_b._mappings is not None) is same_gpu
        # either way the link carries bytes (with IPC, host bytes go inline)
        sender = threading.Thread(target=link_a.send_bytes,
                                  args=(torch.arange(16, dtype=torch.uint8), 10))
        sender.start()
        got = torch.zeros(16, dtype=torch.uint8)
        link_b.recv_bytes(got, 10)
        sender.join()
        assert torch.equal(got, torch.arange(16, dtype=torch.uint8))
    finally:
        _close(link_a, link_b, a, b)


def test_host_memory_for_ipc_must_be_shared():
    with pytest.raises(LinkError, match="share_memory_"):
        TorchDistTransport("127.0.0.1", 0, CPU, use_ipc=True, host_shared=[torch.zeros(8)])


def test_the_ipc_link_bench_moves_its_chunks_intact():
    """bench/ipc_link.py's plumbing: it checks the bytes itself (raises if they differ)."""
    from bench.ipc_link import run

    result = run(regions=4, region_bytes=64, iters=3)
    assert result["regions"] == 4 and result["iters"] == 3
    assert 0 < result["chunk_us_median"] <= result["chunk_us_p90"]
