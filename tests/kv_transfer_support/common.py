"""Shared test helpers for kv_transfer: a tiny block allocator that tracks leases, cache
construction with poison, and polling with a deadline.
"""

from __future__ import annotations

import random
import time

import torch

from pd_runtime.config import KVTransferConfig

POISON = -7.0
# float32 blocks of 2 KiB per layer and K/V half: single blocks travel as small messages, runs of
# two or more as large ones (UCX shm receives those in place, the rest through staging).
NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 48, 4, 2, 64


def make_caches(dtype=torch.float32, num_layers=NUM_LAYERS, num_blocks=NUM_BLOCKS, fill=POISON):
    # Per-layer views of one allocation, like the engine does.
    big = torch.full((num_layers, 2, num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM), fill, dtype=dtype)
    return big, [big[i] for i in range(num_layers)]


def fill_random(caches, block_ids, seed):
    gen = torch.Generator().manual_seed(seed)
    for layer in caches:
        for b in block_ids:
            layer[:, b] = torch.randn(layer[:, b].shape, generator=gen).to(layer.dtype)


class BlockAllocator:
    """The engine's free list, reduced to what accounting tests need."""

    def __init__(self, num_blocks, seed=0):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.start = num_blocks

    def take(self, n):
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def take_run(self, n):
        """n consecutive free ids (the allocator must have such a run)."""
        free = set(self.free)
        start = next(b for b in sorted(free) if all(b + i in free for i in range(n)))
        taken = list(range(start, start + n))
        self.free = [b for b in self.free if not start <= b < start + n]
        return taken

    def give_back(self, ids):
        assert not set(ids) & set(self.free), "double free"
        self.free.extend(ids)

    @property
    def balanced(self):
        return len(self.free) == self.start


def config(backend, **overrides):
    base = dict(backend=backend, host="127.0.0.1", port=0, handshake_timeout_s=10.0,
                transfer_timeout_s=5.0, lease_timeout_s=8.0, credit_window_bytes=1 << 20,
                max_queued_sends=8, checksums=True)
    base.update(overrides)
    return KVTransferConfig(**base)


def transport_and_caches(backend, overrides, num_layers=NUM_LAYERS):
    """(config, transport, big, per-layer caches) of one side. overrides["ipc_twin"]: torch_dist
    whose links move the cache's ranges as IPC records (pd_runtime/kv_transfer/backends/ipc.py), the cache
    in shared memory: the CPU twin of two workers on one GPU. overrides["device"]: the cache's
    device ("cuda": both processes on one GPU, torch_dist then moves it by CUDA IPC)."""
    from pd_runtime.kv_transfer.registry import make_transport
    from pd_runtime.kv_transfer.backends.torch_dist import TorchDistTransport

    overrides = dict(overrides)
    twin = overrides.pop("ipc_twin", False)
    device = torch.device(overrides.pop("device", "cpu"))  # "cuda": the GPU tests' cases
    cfg = config(backend, **overrides)
    big, _ = make_caches(num_layers=num_layers)
    if device.type != "cpu":
        big = big.to(device)
        transport = make_transport(cfg, device)
    elif twin:
        big.share_memory_()
        transport = TorchDistTransport(cfg.host, cfg.port, torch.device("cpu"), use_ipc=True,
                                       host_shared=[big])
    else:
        transport = make_transport(cfg, torch.device("cpu"))
    return cfg, transport, big, [big[i] for i in range(num_layers)]


def wait_for(predicate, timeout_s=10.0, interval_s=0.01):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError("condition not met within deadline")


def collect(agent, request_ids, timeout_s=10.0):
    """Poll until every request id has finished; returns {request_id: status}."""
    done = {}
    def step():
        for status in agent.poll():
            done[status.request_id] = status
        return set(request_ids) <= set(done)
    wait_for(step, timeout_s)
    return done


def poison_untouched(big, reserved_ids):
    """True when every block outside reserved_ids still holds only POISON."""
    mask = torch.ones(big.shape[2], dtype=torch.bool)
    mask[list(reserved_ids)] = False
    return bool((big[:, :, mask] == POISON).all())
