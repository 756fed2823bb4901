"""The KV cache's host allocation (pd_runtime/engine/kv_cache/host_memory.py)."""

import gc
import mmap
import os

import torch

from pd_runtime.engine.kv_cache.host_memory import HUGE_PAGE_BYTES, host_zeros

_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _vma_flags(address: int) -> list[str]:
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_host_zeros_is_zeroed_aligned_and_outlives_its_base():
    shape = (3, 2, 37, 4, 16, 8)
    cache = host_zeros(shape, torch.bfloat16)
    assert cache.shape == shape and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert cache.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not cache.any()
    layers = list(cache.unbind(0))
    del cache
    gc.collect()
    layers[2].fill_(1.5)  # the mapping lives as long as any view of it
    assert float(layers[2].sum()) == 1.5 * layers[2].numel() and not layers[1].any()
    assert host_zeros((0, 4), torch.float32).shape == (0, 4)


def _kernel_takes_hugepage_advice() -> bool:
    scratch = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        scratch.madvise(mmap.MADV_HUGEPAGE)
        return True
    except (OSError, AttributeError):  # no THP in this kernel (or a sandbox refusing it)
        return False
    finally:
        scratch.close()


def test_host_zeros_asks_for_huge_pages_where_the_kernel_has_them():
    cache = host_zeros((4 << 20,), torch.uint8)
    flags = _vma_flags(cache.data_ptr())
    if os.path.exists(_THP) and _kernel_takes_hugepage_advice():
        assert "hg" in flags  # MADV_HUGEPAGE marked the mapping: 2 MiB pages where available
    cache[::4096] = 7
    assert int(cache.sum()) == 7 * (cache.numel() // 4096)
