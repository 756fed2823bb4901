"""Linear layers whose every output row is the same whatever the number of rows in the call:
the batch-invariant mode's matmuls (decode batches, prefill chunks and sampled rows vary M).

A GEMM library picks its kernel by shape: measured on an AVX2 CPU, torch's float32 `F.linear`
gives different bits for a row when called with 1-3 rows, and for the last rows of calls with
5-11, than with 12 or more; its bfloat16 path differs only for single-row calls, and only on
about one element in 8000 (seen on a 1408 -> 512 projection: a one-token decode and the same
token inside a speculative verification chunk then disagreed on a near tie). Rather
than trusting one machine's library, each weight shape is probed once (per process) for the
smallest row count from which every row is stable, and calls with fewer rows are padded with
zero rows up to it. Rows never mix in a matmul, so padding changes nothing but the kernel
choice.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)

# Row counts probed: every count up to 17 (where libraries switch small-M kernels and row
# remainders), counts around powers of two, and one larger reference call.
_PROBE_ROWS = (*range(1, 18), 31, 33, 64, 65, 129, 257)
_REFERENCE_ROWS = 264
_SMALL_SPAN = 136  # rows the small counts are probed over, slice by slice
# Row counts calls may be padded to; a shape stable from none of them is left as is, with a
# warning (its rows may then depend on the batch).
_PAD_TO = (1, 2, 4, 8, 16, 32, 64, 128)

_probed: dict[tuple, Optional[int]] = {}


def stable_min_rows(fn: Callable[[torch.Tensor], torch.Tensor], in_features: int,
                    dtype: torch.dtype, device: str | torch.device, key: tuple,
                    warn: bool = True) -> Optional[int]:
    """The smallest row count from which `fn`'s rows do not depend on the call's row count or
    a row's place in it, as probed; None when no count in _PAD_TO is (logged, with `warn`:
    a caller with another path to try says so itself). `key` names the shape and path (the
    same key is probed once per process)."""
    if key in _probed:
        return _probed[key]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_REFERENCE_ROWS, in_features, generator=gen).to(device=device, dtype=dtype)
    reference = fn(x)
    unstable = 0  # largest row count seen to differ
    for rows in _PROBE_ROWS:
        # Every slice, not a sample of them: a kernel path that rounds differently does so on
        # a few elements per hundred thousand (bf16 GEMV against GEMM on AVX2: ~1 in 8000),
        # which a couple of rows would miss.
        span = _SMALL_SPAN if rows <= 17 else _REFERENCE_ROWS
        for start in range(0, span - rows + 1, rows):
            if not torch.equal(fn(x[start:start + rows]), reference[start:start + rows]):
                unstable = max(unstable, rows)
                break
    found = next((n for n in _PAD_TO if n > unstable), None)
    if found is None and warn:
        log.warning("batch invariance: linear %s gives rows that depend on the row count up to "
                    "%d rows; its outputs may depend on the batch", key, unstable)
    _probed[key] = found
    return found


def pad_rows(x: torch.Tensor, min_rows: int) -> torch.Tensor:
    """x with zero rows appended up to `min_rows` rows."""
    full = x.new_zeros(min_rows, *x.shape[1:])
    full[:x.shape[0]] = x
    return full
