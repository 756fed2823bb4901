"""Tiers below the device pool: prefix blocks evicted from the KV cache move down to host
memory, and from there to local disk, instead of being dropped; a later prompt that misses the
device cache but hits a lower tier has those blocks copied back into fresh device blocks in
place of recomputing them.

Policy: each tier is LRU by last use (a store or a hit). The device pool evicts its least
recently used unreferenced block (block_manager.py); that block is copied to the host tier
(unless it is there already: tiers are inclusive, a block loaded back keeps its lower copies);
the host tier's least recently used entry moves to disk; the disk tier drops its oldest file.

Disk files hold one block each: a header (magic, payload checksum, block hash, token ids) and
the block's K/V bytes of every layer. A file whose checksum, length or tokens do not match is a
miss (the prompt is recomputed), counted in `corrupt`; it is deleted.

Copies run on the engine thread when the scheduler evicts or matches a block (before the step's
forward pass, which is what could overwrite a block): on the CPU a memcpy of ~block bytes; on a
GPU a synchronous copy through pinned memory (an asynchronous stream is future work). Disk reads
are the slow part (a file read and its checksum): a waiting request whose next blocks only the
disk holds starts their reads on background threads (`start_reads`) and is passed over until
they are in, while the steps go on; the copy into the device block follows. One rank
only: a tensor-parallel worker's followers hold their own shards, so tiers need
tensor_parallel_size 1 (config.py says so).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import struct
import tempfile
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import xxhash

from pd_runtime.engine.kv_cache.host_memory import host_zeros
from pd_runtime.engine.kv_cache.kv_events import KVEventLog

log = logging.getLogger(__name__)

GIB = 1 << 30
_MAGIC = b"PDKV1\0"
_MAX_READS_AHEAD = 1024  # blocks read ahead and not yet taken, at most (256 MiB of bench KV)
_HEADER = struct.Struct("<6sQQI")  # magic, payload xxh64, block hash, token count


@dataclass
class TierStats:
    stored_blocks: int = 0      # blocks written into this tier
    hit_blocks: int = 0         # blocks loaded back from it into the device pool
    queried_blocks: int = 0     # blocks looked up in it (after a device miss)
    evicted_blocks: int = 0     # dropped from it (moved further down, or gone)
    bytes_in: int = 0
    bytes_out: int = 0
    load_s: float = 0.0         # seconds the engine thread spent copying hits back
    read_s: float = 0.0         # disk: seconds reading and checking files (read threads)
    read_ahead_blocks: int = 0  # disk: hits read in the background before they were needed
    corrupt: int = 0            # hits refused: checksum, length or tokens did not match

    def report(self, used: int, capacity: int) -> dict:
        return {"stored_blocks": self.stored_blocks, "hit_blocks": self.hit_blocks,
                "queried_blocks": self.queried_blocks, "evicted_blocks": self.evicted_blocks,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "load_s": self.load_s, "read_s": self.read_s,
                "read_ahead_blocks": self.read_ahead_blocks, "corrupt": self.corrupt,
                "used_blocks": used, "capacity_blocks": capacity}


@dataclass
class _Entry:
    slot: int
    token_ids: tuple[int, ...]


@dataclass
class KVTiers:
    """Host and disk tiers over one engine's device KV cache (`[layers, 2, blocks, ...]`)."""

    device_cache: torch.Tensor
    host_blocks: int
    disk_dir: Optional[Path] = None
    disk_blocks: int = 0

    def __post_init__(self):
        shape = list(self.device_cache.shape)
        shape[2] = self.host_blocks
        on_gpu = self.device_cache.device.type == "cuda"
        # Pinned on a GPU worker (copies by DMA); huge pages on a CPU one (host_memory.py).
        self._host = torch.zeros(shape, dtype=self.device_cache.dtype, pin_memory=True) \
            if on_gpu else host_zeros(tuple(shape), self.device_cache.dtype)
        self.block_bytes = self._host[:, :, 0].numel() * self._host.element_size()
        self._host_index: OrderedDict[int, _Entry] = OrderedDict()  # hash -> entry, LRU first
        self._free_slots = list(range(self.host_blocks - 1, -1, -1))
        self._disk_index: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self.stats = {"host": TierStats(), "disk": TierStats()}
        self.events = KVEventLog()  # the block manager's, once it owns these tiers
        self._reads: dict[int, Future] = {}  # disk reads started ahead (start_reads)
        self._pool: Optional[ThreadPoolExecutor] = None
        if self.disk_dir is not None and self.disk_blocks:
            self.disk_dir.mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_engine(cls, device_cache: torch.Tensor, host_gib: Optional[float],
                   disk_gib: Optional[float], disk_dir: Optional[str]) -> Optional["KVTiers"]:
        """The tiers an engine's settings ask for (None: neither), sizes checked against what
        the machine has (an error names the field)."""
        block_bytes = device_cache[:, :, 0].numel() * device_cache.element_size()
        host_blocks = int((host_gib or 0.0) * GIB // block_bytes)
        disk_blocks = int((disk_gib or 0.0) * GIB // block_bytes)
        if (host_gib or 0.0) > 0 and host_blocks == 0:
            raise ValueError(f"engine.kv_offloading_size: {host_gib} GiB holds no KV block "
                             f"({block_bytes} bytes each)")
        if not host_blocks and not disk_blocks:
            return None
        if host_blocks:
            available = _available_memory()
            if available is not None and host_blocks * block_bytes > available:
                raise ValueError(
                    f"engine.kv_offloading_size: {host_gib} GiB of host memory for the KV "
                    f"cache's host tier, and this machine has {available / GIB:.1f} GiB "
                    "available: lower it")
        path = None
        if disk_blocks:
            if not host_blocks:
                raise ValueError("engine.kv_offloading_disk_size needs a host tier above it: "
                                 "set engine.kv_offloading_size too")
            root = Path(disk_dir or Path(tempfile.gettempdir()) / "pd-runtime-kv")
            root.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(root).free
            if disk_blocks * block_bytes > free:
                raise ValueError(
                    f"engine.kv_offloading_disk_size: {disk_gib} GiB on "
                    f"{root} (engine.kv_offloading_disk_dir), which has {free / GIB:.1f} GiB "
                    "free: lower it or choose another directory")
            _remove_orphans(root)
            # One directory per engine: host and pid (a shared volume, engines of other
            # machines), and a tag (several engines in one process: `serve --in-process`).
            path = root / f"worker.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        return cls(device_cache, host_blocks, path, disk_blocks)

    # -- queries -----------------------------------------------------------------------------
    def holds(self, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Whether a lower tier holds this block (its tokens checked); no side effects."""
        entry = self._host_index.get(block_hash)
        if entry is not None:
            return entry.token_ids == token_ids
        return self._disk_index.get(block_hash) == token_ids

    def held(self) -> dict:
        """Tier -> the block hashes it holds."""
        return {"host": list(self._host_index), "disk": list(self._disk_index)}

    def used_blocks(self) -> dict:
        return {"host": len(self._host_index), "disk": len(self._disk_index)}

    def report(self) -> dict:
        used = self.used_blocks()
        return {"block_bytes": self.block_bytes,
                "host": self.stats["host"].report(used["host"], self.host_blocks),
                "disk": self.stats["disk"].report(used["disk"], self.disk_blocks)}

    # -- moving blocks -----------------------------------------------------------------------
    def save(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """A device block leaves the pool: keep its K/V in the host tier."""
        entry = self._host_index.get(block_hash)
        if entry is not None and entry.token_ids == token_ids:
            self._host_index.move_to_end(block_hash)  # a copy is there already
            return
        if entry is not None:  # a hash collision: the newer block replaces it
            self._free_slots.append(self._host_index.pop(block_hash).slot)
            self.events.removed(block_hash, "host")
        if not self._free_slots:
            self._evict_host()
        slot = self._free_slots.pop()
        self._host[:, :, slot].copy_(self.device_cache[:, :, block_id])
        self._host_index[block_hash] = _Entry(slot, token_ids)
        self.events.stored(block_hash, "host")
        stats = self.stats["host"]
        stats.stored_blocks += 1
        stats.bytes_in += self.block_bytes

    def load(self, block_hash: int, token_ids: tuple[int, ...], block_id: int) -> Optional[str]:
        """Copy the block's K/V back into device block `block_id`; the tier it came from, or
        None (a miss: not held, or a disk copy that failed its checks)."""
        started = time.perf_counter()
        entry = self._host_index.get(block_hash)
        if entry is not None and entry.token_ids == token_ids:
            self._host_index.move_to_end(block_hash)
            self.device_cache[:, :, block_id].copy_(self._host[:, :, entry.slot])
            tier = "host"
        elif self._disk_index.get(block_hash) == token_ids:
            payload = self._read_disk(block_hash, token_ids)
            if payload is None:
                return None
            view = torch.frombuffer(bytearray(payload), dtype=self._host.dtype)
            self.device_cache[:, :, block_id].copy_(
                view.view(self._host[:, :, 0].shape))
            self._disk_index.move_to_end(block_hash)
            tier = "disk"
        else:
            return None
        stats = self.stats[tier]
        stats.hit_blocks += 1
        stats.bytes_out += self.block_bytes
        stats.load_s += time.perf_counter() - started
        return tier

    def note_queried(self, blocks: int, hits: dict) -> None:
        """Lookups after a device miss: `blocks` asked, `hits` per tier served."""
        self.stats["host"].queried_blocks += blocks
        self.stats["disk"].queried_blocks += max(0, blocks - hits.get("host", 0))

    def clear(self) -> int:
        """Forget every block in every tier (a benchmark's cold start); how many."""
        forgotten = len(self._host_index) + len(self._disk_index)
        self._free_slots = list(range(self.host_blocks - 1, -1, -1))
        self._host_index.clear()
        for block_hash in list(self._disk_index):
            self._drop_disk(block_hash)
        return forgotten

    def close(self) -> None:
        """Remove this engine's disk files."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self.disk_dir is not None:
            shutil.rmtree(self.disk_dir, ignore_errors=True)
            self._disk_index.clear()

    # -- internals ---------------------------------------------------------------------------
    def _evict_host(self) -> None:
        block_hash, entry = self._host_index.popitem(last=False)
        self.events.removed(block_hash, "host")
        self.stats["host"].evicted_blocks += 1
        if self.disk_blocks and block_hash not in self._disk_index:
            self._write_disk(block_hash, entry)
        self._free_slots.append(entry.slot)

    def _path(self, block_hash: int) -> Path:
        return self.disk_dir / f"{block_hash:016x}.kv"

    def _write_disk(self, block_hash: int, entry: _Entry) -> None:
        if len(self._disk_index) >= self.disk_blocks:
            oldest = next(iter(self._disk_index))
            self._drop_disk(oldest)
            self.stats["disk"].evicted_blocks += 1
        block = self._host[:, :, entry.slot].contiguous()
        if block.dtype == torch.bfloat16:  # (numpy has no bfloat16: the same bytes as int16)
            block = block.view(torch.int16)
        payload = block.numpy().tobytes()
        header = _HEADER.pack(_MAGIC, xxhash.xxh64_intdigest(payload), block_hash,
                              len(entry.token_ids))
        tokens = struct.pack(f"<{len(entry.token_ids)}q", *entry.token_ids)
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header + tokens + payload)
            os.replace(tmp, path)
        except OSError as exc:  # a full or failing disk: the block is dropped, not kept
            log.warning("KV disk tier: could not write %s: %s", path, exc)
            tmp.unlink(missing_ok=True)
            return
        self._disk_index[block_hash] = entry.token_ids
        self.events.stored(block_hash, "disk")
        stats = self.stats["disk"]
        stats.stored_blocks += 1
        stats.bytes_in += len(payload)

    def start_reads(self, wanted: list[tuple[int, tuple[int, ...]]]) -> bool:
        """Start reading, in the background, the blocks of `wanted` (hash, tokens) that only
        the disk tier holds; True while any of them is still being read (the request waits a
        step or more instead of blocking the engine thread on the disk)."""
        busy = False
        for block_hash, token_ids in wanted:
            if block_hash in self._host_index or self._disk_index.get(block_hash) != token_ids:
                continue
            read = self._reads.get(block_hash)
            if read is None:
                while len(self._reads) >= _MAX_READS_AHEAD:  # (of requests gone meanwhile)
                    self._reads.pop(next(iter(self._reads)))
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(2, thread_name_prefix="kv-disk-read")
                read = self._reads[block_hash] = self._pool.submit(
                    self._read_file, self._path(block_hash), block_hash, token_ids)
            busy = busy or not read.done()
        return busy

    def _read_disk(self, block_hash: int, token_ids: tuple[int, ...]) -> Optional[bytes]:
        """The block's K/V bytes if its file passes every check (read ahead by start_reads,
        else now); else None (the file dropped, counted corrupt)."""
        read = self._reads.pop(block_hash, None)
        payload, read_s = read.result() if read is not None else \
            self._read_file(self._path(block_hash), block_hash, token_ids)
        if read is not None:  # (a read now is in the caller's load_s already)
            self.stats["disk"].read_s += read_s
            self.stats["disk"].read_ahead_blocks += 1
        if payload is None:
            log.warning("KV disk tier: %s failed its checks; recomputing that block",
                        self._path(block_hash))
            self.stats["disk"].corrupt += 1
            self._drop_disk(block_hash)
        return payload

    def _read_file(self, path: Path, block_hash: int,
                   token_ids: tuple[int, ...]) -> tuple[Optional[bytes], float]:
        """(The K/V bytes, or None if any check fails; seconds taken). Touches no state: it
        runs on the read threads."""
        started = time.perf_counter()
        try:
            data = path.read_bytes()
        except OSError:
            data = b""
        n = len(token_ids)
        start = _HEADER.size + 8 * n
        ok = len(data) == start + self.block_bytes
        if ok:
            magic, checksum, stored_hash, count = _HEADER.unpack_from(data)
            ok = (magic == _MAGIC and stored_hash == block_hash and count == n
                  and struct.unpack_from(f"<{n}q", data, _HEADER.size) == token_ids
                  and xxhash.xxh64_intdigest(data[start:]) == checksum)
        return (data[start:] if ok else None), time.perf_counter() - started

    def _drop_disk(self, block_hash: int) -> None:
        self._reads.pop(block_hash, None)  # (a read in flight finishes unseen)
        if self._disk_index.pop(block_hash, None) is not None:
            self.events.removed(block_hash, "disk")
        self._path(block_hash).unlink(missing_ok=True)


def _remove_orphans(root: Path) -> None:
    """Directories of this machine's engine processes that no longer run (killed before
    close())."""
    host = socket.gethostname()
    for path in root.glob("worker.*"):
        name, _, rest = path.name.removeprefix("worker.").rpartition(".")[0].rpartition(".")
        try:
            if name != host:
                continue  # another machine's, on a shared volume
            os.kill(int(rest), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (ValueError, PermissionError):  # not ours to judge: another user's process
            continue


def _available_memory() -> Optional[int]:
    """MemAvailable from /proc/meminfo, in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
