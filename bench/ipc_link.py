"""The torch_dist IPC link's cost per chunk (pd_runtime/kv_transfer/backends/ipc.py), on its CPU twin:
host caches in shared memory, moved by the same records, copies and acknowledgement as device
KV on one GPU. One chunk is what the agent posts for a request sent whole: a header frame and
the K and V regions of every layer (64 at 32 layers), each a run of blocks; the receiver reads
it with recv_frame and recv_many, as kv_transfer/wire.py does. Small regions, so what is timed
is the link's own work per message, not the copy.

Run: .venv/bin/python bench/ipc_link.py [--regions 64] [--region-bytes 16384] [--iters 200]
Prints the median and p90 microseconds per chunk, and per region, and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from pd_runtime.kv_transfer.base import frame_buffers  # noqa: E402
from pd_runtime.kv_transfer.backends.torch_dist import TorchDistTransport  # noqa: E402

CPU = torch.device("cpu")


def _shared(nbytes: int) -> torch.Tensor:
    tensor = torch.zeros(nbytes, dtype=torch.uint8)
    tensor.share_memory_()
    return tensor


def run(regions: int, region_bytes: int, iters: int) -> dict:
    src, dst = _shared(regions * region_bytes), _shared(regions * region_bytes)
    src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8))
    sender_t = TorchDistTransport("127.0.0.1", 0, CPU, use_ipc=True, host_shared=[src])
    receiver_t = TorchDistTransport("127.0.0.1", 0, CPU, use_ipc=True, host_shared=[dst])
    accepted = {}
    acceptor = threading.Thread(target=lambda: accepted.setdefault("link", receiver_t.accept(15)))
    acceptor.start()
    send_link = sender_t.connect(receiver_t.address(), 15)
    acceptor.join()
    recv_link = accepted["link"]
    src_regions = [src[i * region_bytes:(i + 1) * region_bytes] for i in range(regions)]
    dst_regions = [dst[i * region_bytes:(i + 1) * region_bytes] for i in range(regions)]
    header = frame_buffers(b'{"t": "kv", "rid": "bench"}')

    def receive(n: int) -> None:
        for _ in range(n):
            recv_link.recv_frame(30)
            recv_link.recv_many(dst_regions, 30)

    times = []
    try:
        for i in range(iters + 5):  # 5 untimed: the storage's export and mapping, warm-up
            receiver = threading.Thread(target=receive, args=(1,))
            receiver.start()
            start = time.perf_counter()
            send_link.send_many(header + src_regions, 30)  # over when the copies are acked
            elapsed = time.perf_counter() - start
            receiver.join()
            if i >= 5:
                times.append(elapsed)
        if not torch.equal(src, dst):
            raise RuntimeError("the received regions differ from the sent ones")
    finally:
        for thing in (send_link, recv_link, sender_t, receiver_t):
            thing.close()
    times.sort()
    median = statistics.median(times)
    return {"regions": regions, "region_bytes": region_bytes, "iters": iters,
            "chunk_us_median": median * 1e6, "chunk_us_p90": times[int(0.9 * len(times))] * 1e6,
            "region_us_median": median * 1e6 / regions}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regions", type=int, default=64)
    parser.add_argument("--region-bytes", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    result = run(args.regions, args.region_bytes, args.iters)
    print(f"{result['regions']} regions of {result['region_bytes']} B: "
          f"{result['chunk_us_median']:.0f} us per chunk (p90 {result['chunk_us_p90']:.0f}), "
          f"{result['region_us_median']:.1f} us per region")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # (gloo's teardown at interpreter exit may abort: bench/gpu_transfer.py)
