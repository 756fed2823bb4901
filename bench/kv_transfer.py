"""Benchmark of kv_transfer on the bench model's KV (bf16, 8 layers, 4 KV heads, head_dim 64,
block 16: 8 KiB per token) against the raw transport in the same run and a local memcpy.

Run: .venv/bin/python bench/kv_transfer.py [--tokens 512 2048 8192] [--modes gloo ucx-tcp ucx-shm]
The sender is this process, the receiver a spawned process; both bind 127.0.0.1 only. Each
holds a bare transport (raw) and an agent side by side; raw, whole-request and per-layer
transfers alternate one by one, so a load change on a shared box hits all three alike.
A raw transfer is timed from its first send to its ack on the sending thread; an agent transfer
from send() to on_release, the agent's own moment of knowing the receiver has every byte (the
thread that saw the ack calls it). How long the bench thread then took to wake is printed apart.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from pd_runtime.kv_transfer.base import Activity, LinkState, TransferState  # noqa: E402
from pd_runtime.kv_transfer.registry import create_agent, make_transport  # noqa: E402
from pd_runtime.config import KVTransferConfig  # noqa: E402
from pd_runtime.engine.kv_cache.host_memory import host_zeros  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 16
MODES = {"gloo": ("torch_dist", "auto"), "ucx-tcp": ("ucx", "tcp"), "ucx-shm": ("ucx", "shm")}
TIMEOUT_S = 60


def _config(mode):
    backend, ucx_mode = MODES[mode]
    return KVTransferConfig(backend=backend, ucx_mode=ucx_mode, host="127.0.0.1", port=0,
                            credit_window_bytes=1 << 30, max_queued_sends=64,
                            transfer_timeout_s=TIMEOUT_S, lease_timeout_s=TIMEOUT_S, checksums=False)


def _caches(num_blocks):
    # Allocated as the engine allocates its KV cache (huge pages, aligned); raw buffers too.
    big = host_zeros((LAYERS, 2, num_blocks, KV_HEADS, BLOCK, HEAD_DIM), torch.bfloat16)
    return big, [big[i] for i in range(LAYERS)]


def _raw_op(link, buf, what):
    """A plain send or receive of buf as one message, the figure the agent is held to. (UCX
    links split regions into pieces and stage receives so a given-up one cannot write late;
    the raw figure is a bare tag_send/tag_recv of the whole buffer.)"""
    from pd_runtime.kv_transfer.backends import ucx, ucx_worker
    if not isinstance(link, ucx.UCXLink):
        (link.send_bytes if what == "send" else link.recv_bytes)(buf, TIMEOUT_S)
        return
    ucx_api, _ = ucx_worker.ucx_modules()
    array = ucx_worker.host_array(buf)
    if what == "send":
        request = link._ep.tag_send(array, tag=ucx_api.UCXXTag(link._send_tag))
    else:
        request = link._ep.tag_recv(array, tag=ucx_api.UCXXTag(link._recv_tag))
    ucx_worker.wait([request], time.monotonic() + TIMEOUT_S, f"raw {what}", link.progress, link._active)


def _serve_raw(raw, active, max_bytes):
    """Receiver side of the raw transport, on its own thread: one message in, a one-frame ack
    out, until a zero-size message. It polls as an agent's links do: fast once told that a
    transfer comes (active marked, as expect() marks an agent's), idle in between."""
    link = None
    while link is None:
        link = raw.accept(1.0)
    link.set_activity(active)
    buf = host_zeros((max_bytes,), torch.uint8)
    while True:
        size = int.from_bytes(link.recv_frame(TIMEOUT_S), "little")
        if size:
            _raw_op(link, buf[:size], "recv")
        link.send_frame(b"k", TIMEOUT_S)
        active.clear()
        if not size:
            break
    return link


def _receiver(conn, mode, num_blocks, max_bytes):
    """The receiving process: a bare transport (raw) and an agent side by side, so that raw and
    agent transfers can alternate iteration by iteration."""
    cfg = _config(mode)
    raw = make_transport(cfg, torch.device("cpu"))
    _, caches = _caches(num_blocks)
    agent = create_agent(cfg, caches, engine_id="D", model_id="bench")
    conn.send((raw.address(), agent.metadata()))
    served, raw_active = {}, Activity()
    server = threading.Thread(target=lambda: served.setdefault("link", _serve_raw(raw, raw_active, max_bytes)),
                              daemon=True)
    server.start()
    while (command := conn.recv()) is not None:
        if command == "raw":
            raw_active.mark()
        else:
            agent.expect(*command)
        conn.send(True)
        agent.poll()
    server.join(TIMEOUT_S)
    conn.send("closing")
    conn.recv()  # the sender has closed its ends: nothing is in flight now
    agent.close()
    if "link" in served:
        served["link"].close()
    raw.close()


def _summary(latencies, num_bytes):
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return num_bytes / statistics.median(ordered) / 1e9, statistics.median(ordered) * 1e3, p99 * 1e3


def _sleep_until(moment):
    while (left := moment - time.perf_counter()) > 0:
        time.sleep(left)


class _Sender:
    """The sending side of one mode: a raw link and an agent, to the receiver process."""

    def __init__(self, conn, cfg, caches):
        self.conn = conn
        self.finished, self.events = {}, {}
        self.wakeups = []  # on_release -> the bench thread awake, per agent transfer
        raw_address, metadata = conn.recv()
        self.raw = make_transport(cfg, torch.device("cpu"))
        self.link = self.raw.connect(raw_address, 30)
        self.raw_active = Activity()
        self.link.set_activity(self.raw_active)
        self.agent = create_agent(cfg, caches, engine_id="P", model_id="bench", on_release=self._on_release)
        self.peer = self.agent.connect(metadata)
        while self.agent.peer_state(self.peer)[0] is LinkState.CONNECTING:
            time.sleep(0.01)
        self.count = 0

    def _on_release(self, status):
        # The agent's own moment of completion, taken on the thread that saw the ack, as raw's
        # is taken on the thread that received its ack. Waking the bench thread afterwards is
        # the caller's cost (an engine reads poll() in its loop instead); it is kept apart.
        self.finished[status.request_id] = (time.perf_counter(), status)
        self.events[status.request_id].set()

    def raw_once(self, payload) -> float:
        self.conn.send("raw")  # as agent_once announces its transfer with expect()
        self.conn.recv()
        self.raw_active.mark()
        start = time.perf_counter()
        self.link.send_frame(payload.numel().to_bytes(8, "little"), TIMEOUT_S)
        _raw_op(self.link, payload, "send")
        self.link.recv_frame(TIMEOUT_S)
        elapsed = time.perf_counter() - start
        self.raw_active.clear()
        return elapsed

    def agent_once(self, ids, style, layer_s=0.0) -> float:
        """One transfer; with layer_s, a prefill that finishes a layer every layer_s seconds
        (sleeping, as a GPU prefill leaves the CPU free) is simulated: per-layer sends each
        layer when it is done, whole sends all after the last. Timed from the start, or with
        layer_s from the moment the last layer is done (the transfer time left exposed)."""
        self.count += 1
        rid = f"{style}-{len(ids)}-{self.count}"
        self.events[rid] = threading.Event()
        self.conn.send((rid, ids))
        self.conn.recv()
        start = time.perf_counter()
        if style == "whole":
            _sleep_until(start + LAYERS * layer_s)
            self.agent.send(self.peer, rid, ids, ids)
        else:  # the layers one by one, as a prefill that finished them would
            for layer in range(LAYERS):
                _sleep_until(start + (layer + 1) * layer_s)
                self.agent.send(self.peer, rid, ids, ids, layers=[layer])
        start += LAYERS * layer_s
        if not self.events[rid].wait(TIMEOUT_S) or self.finished[rid][1].state is not TransferState.DONE:
            raise RuntimeError(f"{rid}: {self.finished.get(rid)}")
        seen = time.perf_counter()
        done_at = self.finished[rid][0]
        self.wakeups.append(seen - done_at)
        self.agent.poll()
        return done_at - start

    def close(self):
        self.raw_active.mark()
        self.link.send_frame((0).to_bytes(8, "little"), TIMEOUT_S)
        self.link.recv_frame(TIMEOUT_S)
        self.conn.send(None)
        self.conn.recv()  # "closing"
        self.agent.close()
        self.link.close()
        self.raw.close()
        self.conn.send("closed")


def _memcpy_rate(size):
    src = host_zeros((size,), torch.uint8)
    dst = host_zeros((size,), torch.uint8)
    dst.copy_(src)  # fault the pages in before timing
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return size * 5 / (time.perf_counter() - start) / 1e9


def bench_mode(mode, tokens_list, iters, layer_ms=None):
    """Per tokens count, iters rounds; each round runs raw, whole and per-layer once (and with
    layer_ms both again behind a simulated prefill), in an order that rotates, so a change of
    load on a shared box hits all alike."""
    blocks_needed = max(tokens_list) // BLOCK
    max_bytes = max(tokens_list) * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(child_conn, mode, blocks_needed, max_bytes), daemon=True)
    child.start()
    latencies = {(t, kind): [] for t in tokens_list
                 for kind in ("raw", "whole", "per-layer", "whole+prefill", "per-layer+prefill")}
    big, caches = _caches(blocks_needed)
    big.normal_()
    try:
        sender = _Sender(conn, _config(mode), caches)
        for tokens in tokens_list:
            size = tokens * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
            payload, ids = host_zeros((size,), torch.uint8).fill_(1), list(range(tokens // BLOCK))
            runs = {"raw": lambda: sender.raw_once(payload),
                    "whole": lambda: sender.agent_once(ids, "whole"),
                    "per-layer": lambda: sender.agent_once(ids, "per-layer")}
            if layer_ms is not None:
                runs["whole+prefill"] = lambda: sender.agent_once(ids, "whole", layer_ms / 1e3)
                runs["per-layer+prefill"] = lambda: sender.agent_once(ids, "per-layer", layer_ms / 1e3)
            for kind in runs:  # warm-up
                runs[kind]()
            kinds = list(runs)
            for i in range(iters[tokens]):
                turn = i % len(kinds)
                for kind in kinds[turn:] + kinds[:turn]:
                    latencies[tokens, kind].append(runs[kind]())
        sender.close()
        wakeups = sender.wakeups
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()
    rows = []
    for tokens in tokens_list:
        size = tokens * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
        prefill = None
        if layer_ms is not None:
            prefill = tuple(statistics.median(latencies[tokens, k]) * 1e3
                            for k in ("whole+prefill", "per-layer+prefill"))
        rows.append((mode, tokens, size, _summary(latencies[tokens, "raw"], size),
                     _summary(latencies[tokens, "whole"], size),
                     _summary(latencies[tokens, "per-layer"], size), _memcpy_rate(size), prefill))
    return rows, statistics.median(wakeups)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--iters", type=int, default=60,
                        help="rounds of (raw, whole, per-layer) at 2048 tokens and below; fewer above")
    parser.add_argument("--layer-ms", type=float, default=None,
                        help="also simulate a prefill finishing one layer every this many ms, and "
                             "time how long each style's transfer runs past its last layer")
    args = parser.parse_args()
    iters = {t: max(6, args.iters * 2048 // max(t, 2048)) for t in args.tokens}
    print("| mode | tokens | MiB | raw GB/s | whole GB/s (p50/p99 ms) | per-layer GB/s (p50/p99 ms) "
          "| whole/raw | per-layer/raw | memcpy GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    notes = []
    for mode in args.modes:
        rows, wakeup = bench_mode(mode, args.tokens, iters, args.layer_ms)
        notes.append(f"{mode}: the bench thread woke {wakeup * 1e3:.2f} ms (median) after on_release")
        for mode_, tokens, size, raw, whole, layered, memcpy, prefill in rows:
            if prefill is not None:
                notes.append(f"{mode_} {tokens} tokens behind a {args.layer_ms} ms/layer prefill: transfer "
                             f"left after the last layer (p50) whole {prefill[0]:.2f} ms, "
                             f"per-layer {prefill[1]:.2f} ms")
            print(f"| {mode_} | {tokens} | {size / 2**20:.0f} | {raw[0]:.2f} | {whole[0]:.2f} "
                  f"({whole[1]:.1f}/{whole[2]:.1f}) | {layered[0]:.2f} ({layered[1]:.1f}/{layered[2]:.1f}) "
                  f"| {whole[0] / raw[0]:.0%} | {layered[0] / raw[0]:.0%} | {memcpy:.1f} |", flush=True)
    print()
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
