"""UCX shared memory receives KV in place; if a given-up receive could not be driven to its end,
the transport retires its worker. A retired worker is never progressed again, so a message sent
afterwards is never written into a receive that was posted before, and its links fail at once."""

import threading
import time

import pytest
import torch

from pd_runtime.kv_transfer.base import LinkError
from pd_runtime.kv_transfer.registry import make_transport
from tests.kv_transfer_support.common import config
from tests.kv_transfer_support.peer_proc import RawSenderProcess

pytestmark = pytest.mark.timeout(60)


def test_retired_worker_never_writes_a_posted_receive():
    num_bytes = 1 << 20
    proc = RawSenderProcess("ucx", num_bytes, ucx_mode="shm")
    transport = make_transport(config("ucx", ucx_mode="shm"), torch.device("cpu"))
    try:
        link = transport.connect(proc.address, 15)
        dst = torch.zeros(num_bytes, dtype=torch.uint8)
        errors = []

        def receive():
            try:
                link.recv_bytes(dst, 10.0)
            except LinkError as exc:
                errors.append(exc)

        reader = threading.Thread(target=receive)
        reader.start()
        time.sleep(0.2)  # the receive is posted and polling
        transport._ucx_worker.retire("test")
        reader.join(5)
        assert not reader.is_alive() and errors and "retired" in str(errors[0])
        assert transport.retired == "test"
        proc.conn.send("go")  # the sender's message now arrives at a worker nobody progresses
        proc.conn.poll(0.5)
        assert int(dst.count_nonzero()) == 0
        with pytest.raises(LinkError):
            link.send_bytes(torch.ones(8, dtype=torch.uint8), 1.0)
        assert transport.accept(0.05) is None
    finally:
        proc.close()
        transport.close()
