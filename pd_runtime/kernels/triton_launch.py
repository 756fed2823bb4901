"""The launch shapes of the Triton paged-attention kernels (pd_runtime/kernels/triton_paged.py):
tile sizes, warps and decode's split-K count, chosen from static shapes only. Kept apart from
the kernels (no triton import) so the GPU memory plan (pd_runtime/engine/kv_cache/memory_plan.py) reads
the same numbers.
"""

from __future__ import annotations

MIN_BLOCK_SIZE = 16          # tl.dot needs every tile dimension >= 16
# tl.dot's smallest M: a decode program pads its GQA group of query heads up to this.
MIN_GROUP_ROWS = 16
PREFILL_BLOCK_M = 64         # query rows (tokens x heads of a group) per prefill program
PREFILL_BLOCK_M_WIDE = 32    # ... at head_dim 256 (the float32 accumulator's rows are 2x wider)
# Keys per loop step of the prefill kernel, gathered through the block table row by row (any
# number of cache blocks per step): one 16-key block per step left it at 23-31% of the H200's
# matmul rate. The most that compile for sm_90 without spilling, as the engine launches them
# (tests/sm90_compile.py, Triton 3.7): 64 at head_dim 64/128 (138/203 registers; 128 keys
# spill at head_dim 128), 32 at 256 (64 keys spill). Decode reads one cache block per step.
# Both loops' loads are pipelined: the next tile is copied while one is computed (decode
# compiled with a deeper pipeline than Triton's default 3 stages is the same code).
PREFILL_KEYS_PER_TILE = 64
PREFILL_KEYS_PER_TILE_WIDE = 32  # head_dim 256
# Split-K for decode: at most PROGRAMS_PER_SM programs per SM (one wave at head_dim <= 128: a
# one-warp program holds 79-202 registers there, so 9 or more are resident per SM and a few
# past a full wave would cost a second wave as long as the first; at head_dim 256, 4 warps of
# 82-113 registers, 4-7 fit and 8 per SM is about two waves), each split reading at least
# MIN_BLOCKS_PER_SPLIT cache blocks, at most MAX_SPLITS splits. On the H200 at context >= 16k
# (docs/BENCHMARKS.md, the first device run) the share of copy bandwidth followed the program
# count: 320 programs 36-49%, 512 60-69%, 1024 82-87%.
PROGRAMS_PER_SM = 8
MIN_BLOCKS_PER_SPLIT = 4
MAX_SPLITS = 64
DEFAULT_SM_COUNT = 132       # an H100/H200; used where the device is not CUDA (interpreter)
NUM_WARPS = 4                # prefill, decode at head_dim 256, the split reduction
# Decode at head_dim <= 128: one warp per program. On the H200 at context >= 16k (the second
# device run, docs/BENCHMARKS.md) it read 104-112% of copy bandwidth where 4 warps read 88-94%
# and 2 warps 102-109% (no cross-warp reductions in the softmax; 168 registers at head_dim
# 128, 202 with 32-token blocks, no spill). At head_dim 256 one warp spills (255 registers).
DECODE_NUM_WARPS = 1


def decode_num_warps(head_dim: int) -> int:
    return DECODE_NUM_WARPS if head_dim <= 128 else NUM_WARPS


def tile_keys(requested: int | None, default: int) -> int:
    """Keys per loop step: `requested` (a power of two >= 16; the benchmarks compare), else
    the kernel's default."""
    if requested is None:
        return default
    if requested < MIN_BLOCK_SIZE or requested & (requested - 1):
        raise ValueError(f"keys_per_tile {requested}: a power of two >= {MIN_BLOCK_SIZE}")
    return requested


def prefill_keys_per_tile(head_dim: int) -> int:
    return PREFILL_KEYS_PER_TILE if head_dim <= 128 else PREFILL_KEYS_PER_TILE_WIDE


def default_num_splits(batch: int, num_kv_heads: int, max_blocks: int,
                       sm_count: int = DEFAULT_SM_COUNT) -> int:
    """Splits per (sequence, kv head) from static shapes only (a CUDA graph replays with other
    lengths): as many as keep the programs within PROGRAMS_PER_SM per SM, each split at
    least MIN_BLOCKS_PER_SPLIT blocks of the block table's width, at most MAX_SPLITS."""
    programs = max(1, batch * num_kv_heads)
    wanted = PROGRAMS_PER_SM * sm_count // programs
    by_width = max(1, max_blocks // MIN_BLOCKS_PER_SPLIT)
    return max(1, min(wanted, by_width, MAX_SPLITS))
