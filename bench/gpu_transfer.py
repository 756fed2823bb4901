"""P->D KV transfer between two processes on one device (a prefill and a decode worker sharing
a GPU), next to a device-to-device copy of the same bytes measured in the same run.

Run: .venv/bin/python bench/gpu_transfer.py --device cuda [--backend ucx] [--tokens 2048 8192 32768]
     .venv/bin/python bench/gpu_transfer.py --device cpu --tokens 512 2048   (the CPU twin)
As bench/kv_transfer.py (whose sender it extends to device caches): the sender is this process,
the receiver a spawned one, both bound to 127.0.0.1; each holds an agent (create_agent) and a
bare transport (raw) side by side, and raw and agent transfers alternate. The KV has a model's
shape (default Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 128, bf16, block 16: 128 KiB per
token); a request's blocks are one run.
An agent transfer (the whole request) is timed from send() to on_release, a raw one (one
message of the same bytes) from its first send to the receiver's ack. The copy is
dst.copy_(src) of those bytes on the device, synchronized. The first transfer of each size is
checked byte for byte (xxh3 of the blocks on both ends). On cpu the caches are host memory
(ucx picks shm on loopback, torch_dist gloo); on cuda ucx picks its cuda mode (cuda_ipc) and
torch_dist, both ends on one GPU (where NCCL refuses two ranks), CUDA IPC (kv_transfer/backends/ipc.py);
with --peer-device cuda:1 the receiver holds its cache on that GPU and torch_dist moves the KV
over NCCL (the gpu_check tensor_parallel stage, on a device with two GPUs).
The last line printed is JSON: {"transfer": [{"tokens", "bytes", "gbs", "copy_gbs", "ratio",
"raw_gbs", "p99_ms"}, ...], ...}, with "error" set when a run failed.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import xxhash  # noqa: E402

from bench.kv_transfer import _Sender as HostBenchSender, _summary  # noqa: E402
from pd_runtime.kv_transfer.base import Activity, LinkState  # noqa: E402
from pd_runtime.kv_transfer.registry import create_agent, make_transport  # noqa: E402
from pd_runtime.config import KVTransferConfig  # noqa: E402
from pd_runtime.engine.kv_cache.host_memory import host_zeros  # noqa: E402

TIMEOUT_S = 60.0
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bf16"
    block: int = 16

    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * DTYPES[self.dtype].itemsize


def _config(backend: str) -> KVTransferConfig:
    return KVTransferConfig(backend=backend, host="127.0.0.1", port=0, credit_window_bytes=1 << 40,
                            max_queued_sends=64, transfer_timeout_s=TIMEOUT_S,
                            lease_timeout_s=TIMEOUT_S, checksums=False)


def _zeros(shape, dtype, device: torch.device) -> torch.Tensor:
    # Host caches as the engine allocates them (huge pages); device ones as torch does.
    return host_zeros(shape, dtype) if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)


def _caches(shape: Shape, num_blocks: int, device: torch.device):
    big = _zeros((shape.layers, 2, num_blocks, shape.kv_heads, shape.block, shape.head_dim),
                 DTYPES[shape.dtype], device)
    return big, [big[i] for i in range(shape.layers)]


def _blocks_hash(big: torch.Tensor, num_blocks: int) -> int:
    """xxh3 of blocks [0, num_blocks) of every layer, read a layer at a time."""
    hasher = xxhash.xxh3_64()
    for layer in big:
        hasher.update(memoryview(layer[:, :num_blocks].contiguous().view(torch.uint8).cpu().numpy()))
    return hasher.intdigest()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _serve_raw(raw, active: Activity, buf: torch.Tensor):
    """The receiver's bare link, on its own thread: a size frame, that many bytes as one
    message, an ack frame; until size 0. Polls fast once told a transfer comes (active)."""
    link = None
    while link is None:
        link = raw.accept(1.0)
    link.set_activity(active)
    while True:
        size = int.from_bytes(link.recv_frame(TIMEOUT_S), "little")
        if size:
            link.recv_bytes(buf[:size], TIMEOUT_S)
        link.send_frame(b"k", TIMEOUT_S)
        active.clear()
        if not size:
            return link


def _receiver(conn, backend: str, device: str, shape: Shape, num_blocks: int,
              stacks_after_s: float | None = None) -> None:
    if stacks_after_s:  # a hang shows where each thread waits
        faulthandler.dump_traceback_later(stacks_after_s, exit=False)
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = _config(backend)
    raw = make_transport(cfg, device)
    big, caches = _caches(shape, num_blocks, device)
    agent = create_agent(cfg, caches, engine_id="D", model_id="bench")
    conn.send((raw.address(), agent.metadata()))
    served, raw_active = {}, Activity()
    buf = _zeros((num_blocks * shape.block * shape.bytes_per_token(),), torch.uint8, device)
    server = threading.Thread(target=lambda: served.setdefault("link", _serve_raw(raw, raw_active, buf)),
                              daemon=True)
    server.start()
    # bench/kv_transfer.py's protocol ("raw", or (request_id, block_ids) to expect), and
    # {"hash": num_blocks} for the check
    while (command := conn.recv()) is not None:
        if command == "raw":
            raw_active.mark()
            conn.send(True)
        elif isinstance(command, dict):
            _sync(device)
            conn.send(_blocks_hash(big, command["hash"]))
        else:
            agent.expect(*command)
            conn.send(True)
        agent.poll()
    server.join(TIMEOUT_S)
    conn.send("closing")
    conn.recv()  # the sender closed its ends: nothing is in flight
    agent.close()
    if "link" in served:
        served["link"].close()
    raw.close()


class _Sender(HostBenchSender):
    """bench/kv_transfer.py's sender (agent transfers timed to on_release, close), on a cache of
    any device; its raw transfer goes through the Link API, which takes device tensors too."""

    def __init__(self, conn, backend: str, device: torch.device, caches):
        self.conn, self.finished, self.events, self.wakeups, self.count = conn, {}, {}, [], 0
        raw_address, metadata = conn.recv()
        cfg = _config(backend)
        self.raw = make_transport(cfg, device)
        self.link = self.raw.connect(raw_address, 30)
        self.raw_active = Activity()
        self.link.set_activity(self.raw_active)
        self.agent = create_agent(cfg, caches, engine_id="P", model_id="bench", on_release=self._on_release)
        self.peer = self.agent.connect(metadata)
        deadline = time.monotonic() + 30
        while self.agent.peer_state(self.peer)[0] is LinkState.CONNECTING and time.monotonic() < deadline:
            time.sleep(0.01)
        state, why = self.agent.peer_state(self.peer)
        if state is not LinkState.READY:
            raise RuntimeError(f"link to the receiver is {state.value}: {why}")

    def ask(self, command):
        self.conn.send(command)
        return self.conn.recv()

    def raw_once(self, payload: torch.Tensor) -> float:
        self.ask("raw")
        self.raw_active.mark()
        start = time.perf_counter()
        self.link.send_frame(payload.numel().to_bytes(8, "little"), TIMEOUT_S)
        self.link.send_bytes(payload, TIMEOUT_S)
        self.link.recv_frame(TIMEOUT_S)
        elapsed = time.perf_counter() - start
        self.raw_active.clear()
        return elapsed


def _copy_seconds(src: torch.Tensor, dst: torch.Tensor, device: torch.device, iters: int) -> list:
    dst.copy_(src)  # first touch and any lazy setup, untimed
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _sig(value: float) -> float:
    return float(f"{value:.4g}")


def _progress(message: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(device: str = "cuda", backend: str = "ucx", tokens_list=(2048, 8192, 32768), iters: int = 10,
        shape: Shape = Shape(), deadline_s: float | None = None,
        peer_device: str | None = None) -> dict:
    """The bench: returns {"device", "peer_device", "backend", "mode", "shape", "transfer": [...]}
    (the receiver's cache on `peer_device`, by default `device`) and, when a
    transfer failed, "error" (rows measured before it are kept). With `deadline_s`, no size is
    started and no further repetition run after that many seconds ("stopped" says which sizes
    went unmeasured; a size cut short has "reps" below its plan), and both processes print
    every thread's stack at the deadline plus 5 s if still running (where a hang waits)."""
    began = time.monotonic()
    late = (lambda: time.monotonic() - began > deadline_s) if deadline_s else (lambda: False)
    if deadline_s:
        faulthandler.dump_traceback_later(deadline_s + 5, exit=False)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for tokens in tokens_list:
        if tokens % shape.block:
            raise ValueError(f"--tokens {tokens} is not a multiple of the block size {shape.block}")
    num_blocks = max(tokens_list) // shape.block
    peer_device = peer_device or str(device)
    result = {"device": str(device), "peer_device": peer_device, "backend": backend,
              "shape": asdict(shape), "transfer": []}
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_receiver, daemon=True, args=(
        child_conn, backend, peer_device, shape, num_blocks, deadline_s and deadline_s + 5))
    child.start()
    child_conn.close()  # ours: a receiver that dies then ends our reads with EOFError
    big, caches = _caches(shape, num_blocks, device)
    big.normal_()
    payload = _zeros((big.numel() * big.element_size(),), torch.uint8, device)
    flat = big.view(-1).view(torch.uint8)
    try:
        _progress(f"receiver started; {backend} connecting")
        sender = _Sender(conn, backend, device, caches)
        result["mode"] = getattr(sender.raw, "mode", None) or (
            "ipc" if getattr(sender.link, "_exports", None) is not None
            else "nccl" if device.type == "cuda" else "gloo")
        _progress(f"{backend} ({result['mode']}) connected")
        for tokens in tokens_list:
            if late():
                result["stopped"] = f"deadline ({deadline_s:.0f} s) reached before {tokens} tokens"
                _progress(result["stopped"])
                break
            size, ids = tokens * shape.bytes_per_token(), list(range(tokens // shape.block))
            chunk = payload[:size]
            start = time.perf_counter()
            sender.raw_once(chunk)  # warm-up of both paths; the agent's is checked byte for byte
            _progress(f"{tokens} tokens: first raw transfer in {time.perf_counter() - start:.3f} s")
            start = time.perf_counter()
            sender.agent_once(ids, "whole")
            _progress(f"{tokens} tokens: first agent transfer in {time.perf_counter() - start:.3f} s")
            _sync(device)
            if sender.ask({"hash": len(ids)}) != _blocks_hash(big, len(ids)):
                raise RuntimeError(f"{tokens} tokens: the receiver's blocks differ from the sender's")
            n = max(3, iters * 8192 // max(tokens, 8192))
            agent_s, raw_s = [], []
            for i in range(n):  # alternating, so a load change hits both alike
                if i and late():
                    break
                for kind in (("raw", "agent") if i % 2 else ("agent", "raw")):
                    if kind == "raw":
                        raw_s.append(sender.raw_once(chunk))
                    else:
                        agent_s.append(sender.agent_once(ids, "whole"))
            copy_gbs = size / statistics.median(_copy_seconds(flat[:size], chunk, device, n)) / 1e9
            gbs, _, p99_ms = _summary(agent_s, size)
            result["transfer"].append({
                "tokens": tokens, "bytes": size, "gbs": _sig(gbs), "copy_gbs": _sig(copy_gbs),
                "ratio": _sig(gbs / copy_gbs), "raw_gbs": _sig(_summary(raw_s, size)[0]),
                "p99_ms": _sig(p99_ms), "reps": len(agent_s)})
            _progress(f"{tokens} tokens: {len(agent_s)} agent transfers at {gbs:.2f} GB/s "
                      f"(copy {copy_gbs:.1f} GB/s)")
        sender.close()
    except Exception as exc:  # reported in the JSON line: a checker collects failures too
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        faulthandler.cancel_dump_traceback_later()
        child.join(10 if "error" not in result else 1)
        if child.is_alive():
            child.kill()
            child.join()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda",
                        help="cuda, cuda:N or cpu; both processes use it unless --peer-device "
                             "names another")
    parser.add_argument("--peer-device", default=None,
                        help="the receiver's device instead (cuda:1: a transfer between two GPUs)")
    parser.add_argument("--backend", choices=["ucx", "torch_dist"], default="ucx")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--iters", type=int, default=10, help="transfers per size up to 8192 tokens; fewer above")
    parser.add_argument("--layers", type=int, default=Shape.layers)
    parser.add_argument("--kv-heads", type=int, default=Shape.kv_heads)
    parser.add_argument("--head-dim", type=int, default=Shape.head_dim)
    parser.add_argument("--dtype", choices=list(DTYPES), default=Shape.dtype)
    parser.add_argument("--block", type=int, default=Shape.block)
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start nothing after this many seconds; report what was measured")
    parser.add_argument("--ucx-info", action="store_true",
                        help="UCX prints the protocol and transport it picks for each kind of "
                             "message (UCX_PROTO_INFO=y), in both processes")
    args = parser.parse_args()
    if args.ucx_info:
        os.environ["UCX_PROTO_INFO"] = "y"  # read when UCX starts, here and in the receiver
    shape = Shape(args.layers, args.kv_heads, args.head_dim, args.dtype, args.block)
    result = run(args.device, args.backend, args.tokens, args.iters, shape, args.deadline_s,
                 args.peer_device)
    print(f"{result['backend']} ({result.get('mode')}) on {result['device']} -> "
          f"{result['peer_device']}, {shape.bytes_per_token() // 1024} KiB per token")
    print("| tokens | MiB | transfer GB/s | p99 ms | raw GB/s | copy GB/s | transfer/copy |")
    print("|---|---|---|---|---|---|---|")
    for row in result["transfer"]:
        print(f"| {row['tokens']} | {row['bytes'] / 2**20:.0f} | {row['gbs']:.2f} | {row['p99_ms']:.1f} "
              f"| {row['raw_gbs']:.2f} | {row['copy_gbs']:.2f} | {row['ratio']:.1%} |")
    for key in ("stopped", "error"):
        if key in result:
            print(f"{key}: {result[key]}")
    print(json.dumps(result), flush=True)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    # Everything is reported and both ends are closed; skip the interpreter's teardown, where
    # torch_dist's gloo objects, destroyed in no set order, sometimes abort the process
    # ("terminate called without an active exception", exit 134) after a clean run.
    os._exit(code)
