"""Benchmark of kv_transfer on the bench model's KV (bf16, 8 layers, 4 KV heads, head_dim 64,
block 16: 8 KiB per token) against the raw transport in the same run and a local memcpy.

Run: .venv/bin/python bench/kv_transfer.py [--tokens 512 2048 8192] [--modes gloo ucx-tcp ucx-shm]
The sender is this process, the receiver a spawned process; both bind 127.0.0.1 only. Raw and
agent phases alternate for --rounds rounds, so a load change on a shared box hits both alike.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kv_transfer.base import LinkState, TransferState  # noqa: E402
from kv_transfer.registry import create_agent, make_transport  # noqa: E402
from pd_runtime.config import KVTransferConfig  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 16
MODES = {"gloo": ("torch_dist", "auto"), "ucx-tcp": ("ucx", "tcp"), "ucx-shm": ("ucx", "shm")}
TIMEOUT_S = 60


def _config(mode):
    backend, ucx_mode = MODES[mode]
    return KVTransferConfig(backend=backend, ucx_mode=ucx_mode, host="127.0.0.1", port=0,
                            credit_window_bytes=1 << 30, max_queued_sends=64,
                            transfer_timeout_s=TIMEOUT_S, lease_timeout_s=TIMEOUT_S, checksums=False)


def _caches(num_blocks):
    big = torch.zeros(LAYERS, 2, num_blocks, KV_HEADS, BLOCK, HEAD_DIM, dtype=torch.bfloat16)
    return big, [big[i] for i in range(LAYERS)]


def _raw_op(link, buf, what):
    """A plain send or receive of buf as one message, the figure the agent is held to. (UCX
    links split regions into pieces and stage receives so a given-up one cannot write late;
    the raw figure is a bare tag_send/tag_recv of the whole buffer.)"""
    from kv_transfer import ucx
    if not isinstance(link, ucx.UCXLink):
        (link.send_bytes if what == "send" else link.recv_bytes)(buf, TIMEOUT_S)
        return
    ucx_api, _ = ucx._ucx()
    array = ucx._host_array(buf)
    if what == "send":
        request = link._ep.tag_send(array, tag=ucx_api.UCXXTag(link._send_tag))
    else:
        request = link._ep.tag_recv(array, tag=ucx_api.UCXXTag(link._recv_tag))
    ucx._wait([request], time.monotonic() + TIMEOUT_S, f"raw {what}", link.progress)


def _serve_raw(conn, cfg, max_bytes):
    raw = make_transport(cfg, torch.device("cpu"))
    conn.send(raw.address())
    link = None
    while link is None:
        link = raw.accept(1.0)
    buf = torch.empty(max_bytes, dtype=torch.uint8)
    while True:  # one message in, a one-frame ack out, until a zero-size message
        size = int.from_bytes(link.recv_frame(TIMEOUT_S), "little")
        if size:
            _raw_op(link, buf[:size], "recv")
        link.send_frame(b"k", TIMEOUT_S)
        if not size:
            break
    # Both ends know nothing is in flight now; closing then leaves gloo no half-done work.
    conn.recv()
    link.close()
    raw.close()


def _serve_agent(conn, cfg, num_blocks):
    _, caches = _caches(num_blocks)
    agent = create_agent(cfg, caches, engine_id="D", model_id="bench")
    conn.send(agent.metadata())
    while (command := conn.recv()) is not None:
        agent.expect(*command)
        conn.send(True)
        agent.poll()
    agent.close()


def _receiver(conn, mode, num_blocks, max_bytes):
    cfg = _config(mode)
    while (phase := conn.recv()) is not None:
        if phase == "raw":
            _serve_raw(conn, cfg, max_bytes)
        else:
            _serve_agent(conn, cfg, num_blocks)
        gc.collect()  # drop the phase's process groups / workers before the next one starts


def _summary(latencies, num_bytes):
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return num_bytes / statistics.median(ordered) / 1e9, statistics.median(ordered) * 1e3, p99 * 1e3


def _raw_phase(conn, cfg, tokens_list, iters, latencies):
    conn.send("raw")
    raw = make_transport(cfg, torch.device("cpu"))
    link = raw.connect(conn.recv(), 30)
    for tokens in tokens_list:
        size = tokens * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
        payload = torch.ones(size, dtype=torch.uint8)
        for i in range(iters[tokens] + 1):
            start = time.perf_counter()
            link.send_frame(size.to_bytes(8, "little"), TIMEOUT_S)
            _raw_op(link, payload, "send")
            link.recv_frame(TIMEOUT_S)
            if i:  # first round warms the connection
                latencies[tokens].append(time.perf_counter() - start)
    link.send_frame((0).to_bytes(8, "little"), TIMEOUT_S)
    link.recv_frame(TIMEOUT_S)
    conn.send("close")
    link.close()
    raw.close()
    del link, raw
    gc.collect()


def _agent_phase(conn, cfg, tokens_list, iters, big, caches, latencies):
    finished = {}
    events: dict[str, threading.Event] = {}

    def on_release(status):  # wakes the bench thread; no polling loop competing for the CPU
        finished[status.request_id] = status
        events[status.request_id].set()

    conn.send("agent")
    agent = create_agent(cfg, caches, engine_id="P", model_id="bench", on_release=on_release)
    peer = agent.connect(conn.recv())
    while agent.peer_state(peer)[0] is LinkState.CONNECTING:
        time.sleep(0.01)
    for tokens in tokens_list:
        ids = list(range(tokens // BLOCK))
        for style in ("whole", "per-layer"):
            for i in range(iters[tokens] + 1):
                rid = f"{style}-{tokens}-{i}-{time.monotonic()}"
                events[rid] = threading.Event()
                conn.send((rid, ids))
                conn.recv()
                start = time.perf_counter()
                if style == "whole":
                    agent.send(peer, rid, ids, ids)
                else:
                    for layer in range(LAYERS):
                        agent.send(peer, rid, ids, ids, layers=[layer])
                if not events[rid].wait(TIMEOUT_S) or finished[rid].state is not TransferState.DONE:
                    raise RuntimeError(f"{rid}: {finished.get(rid)}")
                if i:
                    latencies[tokens, style].append(time.perf_counter() - start)
                agent.poll()
    conn.send(None)
    agent.close()


def _memcpy_rate(size):
    src = torch.empty(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return size * 5 / (time.perf_counter() - start) / 1e9


def bench_mode(mode, tokens_list, iters, rounds):
    blocks_needed = max(tokens_list) // BLOCK
    max_bytes = max(tokens_list) * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(child_conn, mode, blocks_needed, max_bytes), daemon=True)
    child.start()
    cfg = _config(mode)
    raw_latencies = {t: [] for t in tokens_list}
    agent_latencies = {(t, s): [] for t in tokens_list for s in ("whole", "per-layer")}
    big, caches = _caches(blocks_needed)
    big.normal_()
    try:
        for _ in range(rounds):
            _raw_phase(conn, cfg, tokens_list, iters, raw_latencies)
            _agent_phase(conn, cfg, tokens_list, iters, big, caches, agent_latencies)
        conn.send(None)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()
    rows = []
    for tokens in tokens_list:
        size = tokens * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
        rows.append((mode, tokens, size, _summary(raw_latencies[tokens], size),
                     _summary(agent_latencies[tokens, "whole"], size),
                     _summary(agent_latencies[tokens, "per-layer"], size), _memcpy_rate(size)))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--iters", type=int, default=20, help="per round, at 2048 tokens and below")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    iters = {t: max(3, args.iters * 2048 // max(t, 2048)) for t in args.tokens}
    print(f"| mode | tokens | MiB | raw GB/s | whole GB/s (p50/p99 ms) | per-layer GB/s (p50/p99 ms) "
          f"| whole/raw | per-layer/raw | memcpy GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes:
        for mode_, tokens, size, raw, whole, layered, memcpy in bench_mode(mode, args.tokens, iters, args.rounds):
            print(f"| {mode_} | {tokens} | {size / 2**20:.0f} | {raw[0]:.2f} | {whole[0]:.2f} "
                  f"({whole[1]:.1f}/{whole[2]:.1f}) | {layered[0]:.2f} ({layered[1]:.1f}/{layered[2]:.1f}) "
                  f"| {whole[0] / raw[0]:.0%} | {layered[0] / raw[0]:.0%} | {memcpy:.1f} |", flush=True)


if __name__ == "__main__":
    main()
