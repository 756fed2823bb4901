"""Linear layers whose every output row is the same whatever the number of rows in the call:
the batch-invariant mode's matmuls (decode batches, prefill chunks and sampled rows vary M).

A GEMM library picks its kernel by shape: measured on an AVX2 CPU, torch's float32 `F.linear`
gives different bits for a row when called with 1-3 rows, and for the last rows of calls with
5-11, than with 12 or more; its bfloat16 path gave the same bits at every row count. Rather
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
# Row counts calls may be padded to; a shape stable from none of them is left as is, with a
# warning (its rows may then depend on the batch).
_PAD_TO = (1, 2, 4, 8, 16, 32, 64, 128)

_probed: dict[tuple, Optional[int]] = {}


def stable_min_rows(fn: Callable[[torch.Tensor], torch.Tensor], in_features: int,
                    dtype: torch.dtype, device: str | torch.device, key: tuple) -> Optional[int]:
    """The smallest row count from which `fn`'s rows do not depend on the call's row count or
    a row's place in it, as probed; None when no count in _PAD_TO is. `key` names the shape and
    path (the same key is probed once per process)."""
    if key in _probed:
        return _probed[key]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_REFERENCE_ROWS, in_features, generator=gen).to(device=device, dtype=dtype)
    reference = fn(x)
    unstable = 0  # largest row count seen to differ
    for rows in _PROBE_ROWS:
        for offset in (0, 5) if rows <= 17 else (0,):  # also a row's place in the call
            if not torch.equal(fn(x[offset:offset + rows]), reference[offset:offset + rows]):
                unstable = max(unstable, rows)
    found = next((n for n in _PAD_TO if n > unstable), None)
    if found is None:
        log.warning("batch invariance: linear %s gives rows that depend on the row count up to "
                    "%d rows; its outputs may depend on the batch", key, unstable)
    _probed[key] = found
    return found


def pad_rows(x: torch.Tensor, min_rows: int) -> torch.Tensor:
    """x with zero rows appended up to `min_rows` rows."""
    full = x.new_zeros(min_rows, *x.shape[1:])
    full[:x.shape[0]] = x
    return full
