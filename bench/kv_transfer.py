"""Benchmark of kv_transfer on the bench model's KV (bf16, 8 layers, 4 KV heads, head_dim 64,
block 16: 8 KiB per token) against the raw transport in the same run and a local memcpy.

Run: .venv/bin/python bench/kv_transfer.py [--tokens 512 2048 8192] [--modes gloo ucx-tcp ucx-shm]
The sender is this process, the receiver a spawned process; both bind 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kv_transfer.base import LinkState, TransferState  # noqa: E402
from kv_transfer.registry import create_agent, make_transport  # noqa: E402
from pd_runtime.config import KVTransferConfig  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 16
MODES = {"gloo": ("torch_dist", "auto"), "ucx-tcp": ("ucx", "tcp"), "ucx-shm": ("ucx", "shm")}


def _config(mode):
    backend, ucx_mode = MODES[mode]
    return KVTransferConfig(backend=backend, ucx_mode=ucx_mode, host="127.0.0.1", port=0,
                            credit_window_bytes=1 << 30, max_queued_sends=64,
                            transfer_timeout_s=60, lease_timeout_s=60, checksums=False)


def _caches(num_blocks):
    big = torch.zeros(LAYERS, 2, num_blocks, KV_HEADS, BLOCK, HEAD_DIM, dtype=torch.bfloat16)
    return big, [big[i] for i in range(LAYERS)]


def _receiver(conn, mode, num_blocks, max_bytes):
    cfg = _config(mode)
    raw = make_transport(cfg, torch.device("cpu"))
    conn.send(raw.address())
    link = None
    while link is None:
        link = raw.accept(1.0)
    buf = torch.empty(max_bytes, dtype=torch.uint8)
    while True:  # raw phase: one message in, a one-frame ack out, until a zero-size message
        size = int.from_bytes(link.recv_frame(60), "little")
        if size == 0:
            break
        link.recv_bytes(buf[:size], 60)
        link.send_frame(b"k", 60)
    link.close()
    raw.close()
    _, caches = _caches(num_blocks)
    agent = create_agent(cfg, caches, engine_id="D", model_id="bench")
    conn.send(agent.metadata())
    while True:
        command = conn.recv()
        if command is None:
            break
        agent.expect(*command)
        conn.send(True)
        agent.poll()
    agent.close()


def _wait_done(agent, rid):
    while True:
        for status in agent.poll():
            if status.request_id == rid:
                if status.state is not TransferState.DONE:
                    raise RuntimeError(f"{rid}: {status}")
                return
        time.sleep(0.0001)


def _summary(latencies, num_bytes):
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return num_bytes / statistics.median(ordered) / 1e9, statistics.median(ordered) * 1e3, p99 * 1e3


def bench_mode(mode, tokens_list, iters):
    blocks_needed = max(tokens_list) // BLOCK
    max_bytes = max(tokens_list) * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(child_conn, mode, blocks_needed, max_bytes), daemon=True)
    child.start()
    rows = []
    try:
        cfg = _config(mode)
        raw = make_transport(cfg, torch.device("cpu"))
        link = raw.connect(conn.recv(), 30)
        raw_results = {}
        for tokens in tokens_list:
            size = tokens * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
            payload = torch.ones(size, dtype=torch.uint8)
            latencies = []
            for i in range(iters[tokens] + 1):
                start = time.perf_counter()
                link.send_frame(size.to_bytes(8, "little"), 60)
                link.send_bytes(payload, 60)
                link.recv_frame(60)
                if i:  # first round warms the connection
                    latencies.append(time.perf_counter() - start)
            raw_results[tokens] = _summary(latencies, size)
        link.send_frame((0).to_bytes(8, "little"), 60)
        time.sleep(0.2)
        link.close()
        raw.close()

        big, caches = _caches(blocks_needed)
        big.normal_()
        agent = create_agent(cfg, caches, engine_id="P", model_id="bench")
        peer = agent.connect(conn.recv())
        while agent.peer_state(peer)[0] is LinkState.CONNECTING:
            time.sleep(0.01)
        for tokens in tokens_list:
            ids = list(range(tokens // BLOCK))
            size = agent.layout.bytes_for(len(ids), LAYERS)
            results = {}
            for style in ("whole", "per-layer"):
                latencies = []
                for i in range(iters[tokens] + 1):
                    rid = f"{style}-{tokens}-{i}"
                    conn.send((rid, ids))
                    conn.recv()
                    start = time.perf_counter()
                    if style == "whole":
                        agent.send(peer, rid, ids, ids)
                    else:
                        for layer in range(LAYERS):
                            agent.send(peer, rid, ids, ids, layers=[layer])
                    _wait_done(agent, rid)
                    if i:
                        latencies.append(time.perf_counter() - start)
                results[style] = _summary(latencies, size)
            src = torch.empty(size, dtype=torch.uint8)
            dst = torch.empty_like(src)
            dst.copy_(src)  # fault the pages in before timing
            copy_start = time.perf_counter()
            for _ in range(5):
                dst.copy_(src)
            memcpy = size * 5 / (time.perf_counter() - copy_start) / 1e9
            rows.append((mode, tokens, size, raw_results[tokens], results["whole"], results["per-layer"], memcpy))
        agent.close()
        conn.send(None)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    iters = {t: max(3, args.iters * 2048 // max(t, 2048)) for t in args.tokens}
    print(f"| mode | tokens | MiB | raw GB/s | whole GB/s (p50/p99 ms) | per-layer GB/s (p50/p99 ms) "
          f"| whole/raw | memcpy GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in args.modes:
        for mode_, tokens, size, raw, whole, layered, memcpy in bench_mode(mode, args.tokens, iters):
            print(f"| {mode_} | {tokens} | {size / 2**20:.0f} | {raw[0]:.2f} | {whole[0]:.2f} "
                  f"({whole[1]:.1f}/{whole[2]:.1f}) | {layered[0]:.2f} ({layered[1]:.1f}/{layered[2]:.1f}) "
                  f"| {whole[0] / raw[0]:.0%} | {memcpy:.1f} |", flush=True)


if __name__ == "__main__":
    main()
