"""Paged KV block accounting with a prefix cache: free list, reference counts, block tables.

Ownership: a request holds one reference to each block in `req.block_ids`; `free()` drops them.
A full block may be shared (prefix cache); only a request's last, partial block is written to,
and it is always private. Blocks with no users stay cached and are evicted LRU on demand; with
tiers (tiers.py), an evicted block's K/V moves down to host memory and disk, and a prompt that
misses the device cache where a lower tier holds the next blocks gets them copied back into
free blocks, which then serve it as device hits.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Optional

from pd_runtime.engine.kv_cache.block_hash import block_hashes, root_hash
from pd_runtime.engine.kv_cache.kv_events import KVEventLog
from pd_runtime.engine.kv_cache.tiers import KVTiers
from pd_runtime.engine.sequence import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: Optional[int] = None
    token_ids: Optional[tuple[int, ...]] = None  # kept so a hash collision can never hit


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    by_salt: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))

    def record(self, salt: Optional[str], queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit
        entry = self.by_salt[salt or ""]
        entry[0] += queried
        entry[1] += hit


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, model_identity: str,
                 enable_prefix_caching: bool = True, tiers: Optional[KVTiers] = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_identity = model_identity
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks, oldest first; cached ones keep their hash until evicted.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}
        self.stats = PrefixCacheStats()
        self.tiers = tiers if enable_prefix_caching else None
        # What the prefix cache holds, as events for the router (kv_events.py).
        self.events = KVEventLog()
        if self.tiers is not None:
            self.tiers.events = self.events

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def request_hashes(self, req: Request) -> list[int]:
        """Extend and return the chained hashes of the request's full blocks."""
        root = root_hash(self.model_identity, None, req.cache_salt)
        req.block_hashes = block_hashes(req.all_token_ids, self.block_size, root,
                                        req.block_hashes)
        return req.block_hashes

    def _tokens(self, token_ids: list[int], i: int) -> tuple[int, ...]:
        return tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _lookup(self, token_ids: list[int], hashes: list[int]) -> list[int]:
        hit = []
        for i, h in enumerate(hashes[:self._max_hit_blocks(token_ids)]):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            if self.blocks[block_id].token_ids != self._tokens(token_ids, i):
                break  # hash collision: never hand back KV of other tokens
            hit.append(block_id)
        return hit

    def _max_hit_blocks(self, token_ids: list[int]) -> int:
        # Leave at least one token to compute: its logits produce the next token.
        return (len(token_ids) - 1) // self.block_size

    def _tier_run(self, token_ids: list[int], hashes: list[int], start: int) -> int:
        """How many blocks after the first `start` the lower tiers hold, in a row."""
        if self.tiers is None:
            return 0
        end = min(len(hashes), self._max_hit_blocks(token_ids))
        i = start
        while i < end and self.tiers.holds(hashes[i], self._tokens(token_ids, i)):
            i += 1
        return i - start

    def cached_prefix_tokens(self, token_ids: list[int], cache_salt: Optional[str] = None) -> int:
        """Tokens of this prompt the cache would serve now (from any tier); no side effects."""
        if not self.enable_prefix_caching:
            return 0
        root = root_hash(self.model_identity, None, cache_salt)
        hashes = block_hashes(token_ids, self.block_size, root)
        hit = len(self._lookup(token_ids, hashes))
        return (hit + self._tier_run(token_ids, hashes, hit)) * self.block_size

    # -- allocation --------------------------------------------------------------------------
    def match_prefix(self, req: Request) -> list[int]:
        """Cached blocks for the start of a request that holds no blocks; not yet referenced.
        Blocks the device misses and a lower tier holds are loaded into free blocks first."""
        if not self.enable_prefix_caching:
            return []
        hashes = self.request_hashes(req)
        hit = self._lookup(req.all_token_ids, hashes)
        run = self._tier_run(req.all_token_ids, hashes, len(hit))
        if run:
            hit += self._load_from_tiers(req.all_token_ids, hashes, hit, run)
        return hit

    def loading(self, req: Request) -> bool:
        """Whether blocks of this fresh request's prefix are still being read from the disk
        tier (their reads started now if not yet): the scheduler passes it over meanwhile."""
        if self.tiers is None or not self.tiers.disk_blocks or not self.enable_prefix_caching:
            return False
        token_ids = req.all_token_ids
        hashes = self.request_hashes(req)
        start = len(self._lookup(token_ids, hashes))
        run = self._tier_run(token_ids, hashes, start)
        return run > 0 and self.tiers.start_reads(
            [(hashes[i], self._tokens(token_ids, i)) for i in range(start, start + run)])

    def _load_from_tiers(self, token_ids: list[int], hashes: list[int], hit: list[int],
                         run: int) -> list[int]:
        """Copy up to `run` blocks after `hit` from the lower tiers into free blocks, published
        as cached and unreferenced (the caller's allocate() takes them); the blocks loaded.
        The device hits are made the most recently used first, so that the free blocks taken
        here are never theirs; one free block stays for the prompt's own tokens."""
        for block_id in hit:
            if self.blocks[block_id].ref_count == 0:
                self._free.move_to_end(block_id)
        idle_hits = sum(1 for b in hit if self.blocks[b].ref_count == 0)
        loaded, served = [], {}
        for i in range(len(hit), len(hit) + run):
            if len(self._free) - idle_hits - len(loaded) <= 1:
                break
            tokens = self._tokens(token_ids, i)
            held = self._cached.get(hashes[i])
            if held is not None and self.blocks[held].token_ids == tokens:
                # Still on the device past a block that was not: no copy needed.
                if self.blocks[held].ref_count == 0:
                    self._free.move_to_end(held)
                loaded.append(held)
                continue
            block_id = self._take_free()
            tier = self.tiers.load(hashes[i], tokens, block_id)
            block = self.blocks[block_id]
            block.ref_count = 0
            if tier is None:  # lost on the way (a file that failed its checks): recompute
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)
                break
            served[tier] = served.get(tier, 0) + 1
            block.block_hash, block.token_ids = hashes[i], tokens
            self._cached[hashes[i]] = block_id
            self.events.stored(hashes[i], "device")
            self._free[block_id] = None
            loaded.append(block_id)
        # Deepest blocks first out, as free() leaves a request's: should this prompt wait, the
        # prefix's first blocks are the last evicted.
        for block_id in reversed(hit + loaded):
            if self.blocks[block_id].ref_count == 0:
                self._free.move_to_end(block_id)
        self.tiers.note_queried(run, served)
        return loaded

    def can_allocate(self, req: Request, num_new_tokens: int, prefix: list[int] = (),
                     keep_free: int = 0) -> bool:
        held = len(req.block_ids) + len(prefix)
        need = self.blocks_needed(req.num_computed_tokens + len(prefix) * self.block_size
                                  + num_new_tokens) - held
        # Prefix blocks with no users sit in the free list; taking them shrinks it.
        idle_prefix = sum(1 for b in prefix if self.blocks[b].ref_count == 0)
        return need <= len(self._free) - idle_prefix - keep_free

    def allocate(self, req: Request, num_new_tokens: int, prefix: list[int] = (),
                 keep_free: int = 0) -> bool:
        """Make the block table cover `num_new_tokens` more tokens; False (no change) if that
        would leave fewer than `keep_free` blocks free."""
        if not self.can_allocate(req, num_new_tokens, prefix, keep_free):
            return False
        if not req.block_ids and req.num_computed_tokens == 0 and self.enable_prefix_caching:
            # Counted once per admission that succeeds, not per attempt that found no room.
            self.stats.record(req.cache_salt, req.num_tokens, len(prefix) * self.block_size)
        for block_id in prefix:
            self._touch(block_id)
        req.block_ids.extend(prefix)
        if prefix:
            req.num_computed_tokens += len(prefix) * self.block_size
            req.num_cached_tokens = len(prefix) * self.block_size
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        for _ in range(need):
            req.block_ids.append(self._take_free())
        return True

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
                self.events.removed(block.block_hash, "device")
                if self.tiers is not None:  # its K/V is intact until the next forward pass
                    self.tiers.save(block_id, block.block_hash, block.token_ids)
            self.stats.evictions += 1
            block.block_hash = block.token_ids = None
        block.ref_count = 1
        return block_id

    def cache_full_blocks(self, req: Request) -> None:
        """Publish the request's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        if num_full <= req.num_published_blocks:  # (every decode step but one in block_size)
            return
        hashes = self.request_hashes(req)
        for i in range(req.num_published_blocks, num_full):
            block = self.blocks[req.block_ids[i]]
            if block.block_hash is not None:
                continue
            h = hashes[i]
            block.block_hash = h
            block.token_ids = tuple(req.all_token_ids[i * self.block_size:
                                                      (i + 1) * self.block_size])
            if self._cached.setdefault(h, block.block_id) == block.block_id:
                self.events.stored(h, "device")
        req.num_published_blocks = num_full

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (a benchmark's cold start); returns how many. Blocks in use
        stay with their requests, unshared from now on: a running request publishes only the
        blocks it fills after this."""
        forgotten = len(self._cached)
        for block in self.blocks:
            block.block_hash = block.token_ids = None
        self._cached.clear()
        if self.tiers is not None:
            forgotten += self.tiers.clear()
        self.events.cleared()
        return forgotten

    def held_blocks(self) -> dict:
        """Block hash -> the tiers holding it (device, host, disk): the events' snapshot."""
        held = {h: {"device"} for h in self._cached}
        if self.tiers is not None:
            for tier, hashes in self.tiers.held().items():
                for h in hashes:
                    held.setdefault(h, set()).add(tier)
        return held

    def free(self, req: Request) -> None:
        """Drop the request's references; tail blocks first so they are evicted first."""
        for block_id in reversed(req.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None or not self.enable_prefix_caching:
                    block.block_hash = block.token_ids = None
                self._free[block_id] = None
        req.block_ids = []
        req.num_published_blocks = 0
