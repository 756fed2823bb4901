"""Chained block hashes for the prefix cache: pure Python + xxhash, identical in every process.

The router imports this module to estimate prefix hits without torch; the engine uses it to key
cached KV blocks. The root of a chain mixes in everything besides tokens that changes the KV.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Optional, Sequence

import msgpack
import xxhash

HASH_SEED = 0x5EED_BA5E


@lru_cache(maxsize=4096)  # one per (model, adapter, tenant): every request asks again
def root_hash(model_identity: str, adapter_id: Optional[str] = None,
              cache_salt: Optional[str] = None) -> int:
    """The parent of a request's first block: model, adapter (reserved) and isolation salt."""
    payload = msgpack.packb(["pd-runtime/v1", model_identity, adapter_id or "", cache_salt or ""])
    return xxhash.xxh64_intdigest(payload, seed=HASH_SEED)


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    payload = msgpack.packb([parent, list(token_ids)])
    return xxhash.xxh64_intdigest(payload, seed=HASH_SEED)


def block_hashes(token_ids: Sequence[int], block_size: int, root: int,
                 start: Iterable[int] = ()) -> list[int]:
    """Hashes of every full block of `token_ids`, continuing after the already known `start`."""
    hashes = list(start)
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[i:i + block_size])
        hashes.append(parent)
    return hashes
