"""Native CPU kernels: C sources beside this file, compiled on first use with the machine's C
compiler (`cc`, or $CC) for this very CPU, cached under ~/.cache/pd-runtime/kernels, called
through ctypes (which releases the GIL while the kernel runs on torch's OpenMP threads).

For CPU bfloat16: decode attention (cpu_decode_attention.c), causal attention of fresh
prompts (cpu_prefill_attention.c) and the decoder layer's fused RMSNorm and residual add
(cpu_elementwise.c). For CPU bfloat16 and float32, the batch-invariant mode's fixed-order
attention over the paged cache (cpu_fixed_order_attention.c) and MLP activation
(cpu_silu_mul.c). For CPU float32, the linear layers over prepacked weights (cpu_linear.c).
Where no compiler is found or the build fails, every function here returns
None and callers keep their torch path (pd_runtime/kernels/attention.py, pd_runtime/model/llama.py);
PD_RUNTIME_NATIVE_KERNELS=0 forces that path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name)
            for name in ("cpu_decode_attention.c", "cpu_prefill_attention.c", "cpu_elementwise.c",
                         "cpu_fixed_order_attention.c", "cpu_silu_mul.c", "cpu_linear.c")]
_HEADERS = [Path(__file__).with_name(name) for name in ("cpu_bf16.h", "cpu_vf8.h")]
# -fopenmp: the library's libgomp.so.1 is the one torch loaded (see the C source's header).
_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-fopenmp"]
_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None
_tried = False
# Builds of other sources or CPUs nobody loaded for this long are deleted when one is loaded
# (each load refreshes its build's mtime).
_PRUNE_AFTER_S = 30 * 24 * 3600


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def _build() -> Optional[ctypes.CDLL]:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("native kernels: no C compiler found; using the torch path")
        return None
    source = b"".join(path.read_bytes() for path in [*_SOURCES, *_HEADERS])
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + _cpu_identity().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PD_RUNTIME_KERNEL_CACHE", Path.home() / ".cache" / "pd-runtime" / "kernels"))
    target = cache / f"pd_runtime_cpu-{key}.so"
    if not _mark_used(target):  # (marked first, so no other process prunes it meanwhile)
        cache.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=cache, suffix=".so.partial")
        os.close(fd)
        try:
            subprocess.run([compiler, *_FLAGS, "-o", partial, *map(str, _SOURCES), "-lm"], check=True,
                           capture_output=True, timeout=120)
            os.replace(partial, target)  # atomic: processes building at once agree
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            logger.warning("native kernels: build failed (%s %s); using the torch path", exc,
                           detail.decode(errors="replace")[-500:])
            return None
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    library = ctypes.CDLL(str(target))  # torch is imported above: libgomp.so.1 is its copy
    _prune(cache, target)
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    signatures = {
        "decode_attention_bf16": [ptr] * 5 + [i64] * 4 + [f32] + [i64] * 3,
        "prefill_attention_bf16": [ptr, i64, ptr, i64, ptr, i64, ptr] + [i64] * 5 + [f32, i64],
        "rms_norm_bf16": [ptr] * 3 + [i64] * 2 + [f32, i64],
        "add_rms_norm_bf16": [ptr] * 4 + [i64] * 2 + [f32, i64],
        "fixed_order_attention": [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr] + [i64] * 6
                                 + [f32, i64, i64, i64, i64, f32, ptr],
        "silu_mul": [ptr, i64, ptr] + [i64] * 4,
        "linear_f32": [ptr, i64, ptr, i64, ptr, ptr] + [i64] * 4,
    }
    for name, argtypes in signatures.items():
        fn = getattr(library, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return library


def _mark_used(build: Path) -> bool:
    """Refresh a build's mtime (its last use); False when there is no such build."""
    try:
        os.utime(build)
    except FileNotFoundError:
        return False
    except OSError:  # a read-only cache: the build is there all the same
        return build.exists()
    return True


def _prune(cache: Path, current: Path) -> None:
    """Delete builds other than `current` unused for _PRUNE_AFTER_S, and partial builds that
    old (a process that still has one loaded keeps its mapping; a checkout that needs it again
    rebuilds it). A server that runs longer than that without restarting does not refresh its
    build: another checkout may prune it, and a restart then builds it again."""
    now = time.time()
    _mark_used(current)
    for old in [*cache.glob("pd_runtime_cpu-*.so"), *cache.glob("*.so.partial")]:
        try:
            if old != current and now - old.stat().st_mtime > _PRUNE_AFTER_S:
                old.unlink()
        except OSError as exc:  # gone meanwhile, another user's, a read-only cache
            logger.debug("native kernels: %s not pruned: %s", old.name, exc)


def _load() -> Optional[ctypes.CDLL]:
    global _library, _tried
    if _tried:
        return _library
    with _lock:
        if not _tried:
            if os.environ.get("PD_RUNTIME_NATIVE_KERNELS", "1") != "0":
                try:
                    _library = _build()
                except OSError as exc:  # a cached library that does not load
                    logger.warning("native kernels: %s; using the torch path", exc)
            _tried = True
    return _library


def available() -> bool:
    return _load() is not None


def decode_attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          context_lens: torch.Tensor, scale: float,
                          window: int = 0) -> Optional[torch.Tensor]:
    """q `[B, kv_heads, group, d]`; k, v `[rows >= B, kv_heads, cap, d]` contiguous bf16 CPU
    tensors, row b valid for its first context_lens[b] keys (the last `window` of them, with a
    window) -> `[B, kv_heads, group, d]`, or None when the native kernel cannot take these
    inputs (the caller then runs torch)."""
    library = _load()
    batch, kv_heads, group, dim = q.shape
    if (library is None or q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16
            or v.dtype != torch.bfloat16 or q.device.type != "cpu" or group > 16 or dim > 512
            or dim % 16 or not (k.is_contiguous() and v.is_contiguous())
            or k.shape[0] < batch or k.shape[1] != kv_heads or k.shape[3] != dim or v.shape != k.shape
            or context_lens.numel() < batch):
        return None
    q = q.contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    cap = k.shape[2]
    pairs = batch * kv_heads
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), lens.data_ptr(), out.data_ptr(), kv_heads,
            group, cap, dim, ctypes.c_float(scale), window)
    status = library.decode_attention_bf16(*args, pairs, min(torch.get_num_threads(), pairs))
    return out if status == 0 else None


def _token_rows(x: torch.Tensor) -> bool:
    """[tokens, heads, dim] with each token's heads contiguous (a view into qkv is fine)."""
    return (x.dim() == 3 and x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.stride(2) == 1 and x.stride(1) == x.shape[2])


def prefill_attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int,
                           scale: float) -> Optional[torch.Tensor]:
    """Causal attention of `num_seqs` fresh prompts of equal length back to back:
    q `[T, heads, d]`, k/v `[T, kv_heads, d]` -> `[T, heads, d]`; or None when the kernel
    cannot take them (no AVX512-BF16, head_dim not 64/128, layouts)."""
    library = _load()
    tokens, heads, dim = q.shape
    if (library is None or not (_token_rows(q) and _token_rows(k) and _token_rows(v))
            or k.shape != v.shape or k.shape[0] != tokens or k.shape[2] != dim
            or heads % k.shape[1] or num_seqs < 1 or tokens % num_seqs):
        return None
    out = q.new_empty(tokens, heads, dim)
    status = library.prefill_attention_bf16(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        out.data_ptr(), num_seqs, tokens // num_seqs, heads, k.shape[1], dim, scale,
        torch.get_num_threads())
    return out if status == 0 else None


def _rows_ok(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
    """RMSNorm of the rows of a contiguous bf16 x (see cpu_elementwise.c), or None."""
    library = _load()
    if library is None or not _rows_ok(x, weight) or weight.numel() != x.shape[-1]:
        return None
    out = torch.empty_like(x)
    dim = x.shape[-1]
    library.rms_norm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim,
                          eps, torch.get_num_threads())
    return out


def add_rms_norm_bf16(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> Optional[torch.Tensor]:
    """h += delta (in place, rounded to bf16), then RMSNorm(h); or None (h untouched)."""
    library = _load()
    if library is None or not _rows_ok(h, delta, weight) or delta.shape != h.shape \
            or weight.numel() != h.shape[-1]:
        return None
    out = torch.empty_like(h)
    dim = h.shape[-1]
    library.add_rms_norm_bf16(h.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
                              h.numel() // dim, dim, eps, torch.get_num_threads())
    return out


def _fixed_order_dtype(t: torch.Tensor) -> bool:
    return t.dtype in (torch.bfloat16, torch.float32) and t.device.type == "cpu"


def fixed_order_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                          seq: torch.Tensor, lens: torch.Tensor, scale: float,
                          tile: int = 16, window: int = 0, softcap: float = 0.0,
                          sinks: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Attention of every query token over its own sequence's paged K/V, one fixed reduction
    order per row (cpu_fixed_order_attention.c): q `[T, heads, d]` (each token's heads
    contiguous), kv_layer `[2, blocks, kv_heads, block_size, d]` of q's dtype, or int8 `[...,
    d + 4]` (pd_runtime/kernels/kv_quant.py: d values and a float32 scale per row), block_tables `[S, W]`,
    token t of sequence seq[t] sees keys 0..lens[t]-1 (the last `window` of them, with a window)
    -> `[T, heads, d]`; bf16 or float32 on the CPU. `sinks` `[heads]`: each head's logit that
    joins the softmax without a value (gpt-oss). None when the kernel cannot take these
    inputs."""
    library = _load()
    tokens, heads, dim = q.shape
    kv_int8 = kv_layer.dtype == torch.int8
    row = dim + 4 if kv_int8 else dim
    if (library is None or not _fixed_order_dtype(q) or (kv_layer.dtype != q.dtype and not kv_int8)
            or not kv_layer.is_contiguous() or kv_layer.dim() != 5 or kv_layer.shape[4] != row
            or q.stride(2) != 1 or q.stride(1) != dim or seq.numel() != tokens
            or lens.numel() != tokens or block_tables.dim() != 2
            or (sinks is not None and sinks.numel() != heads)):
        return None
    sinks = None if sinks is None else sinks.to(torch.float32).contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    seq = seq.to(torch.int64).contiguous()
    lens = lens.to(torch.int64).contiguous()
    _, num_blocks, kv_heads, block_size, _ = kv_layer.shape
    out = q.new_empty(tokens, heads, dim)
    status = library.fixed_order_attention(
        q.data_ptr(), q.stride(0), kv_layer.data_ptr(), num_blocks, tables.data_ptr(),
        tables.shape[1], seq.data_ptr(), lens.data_ptr(), out.data_ptr(), tokens, heads, kv_heads,
        dim, block_size, int(q.dtype == torch.bfloat16), scale, tile, torch.get_num_threads(),
        int(kv_int8), window, softcap, None if sinks is None else sinks.data_ptr())
    return out if status == 0 else None


def silu_mul(gate_up: torch.Tensor) -> Optional[torch.Tensor]:
    """silu(gate) * up of a fused `[rows, 2 * inter]` projection (cpu_silu_mul.c), every element
    by the same code; bf16 or float32 rows with contiguous elements. None when not taken."""
    library = _load()
    if library is None or not _fixed_order_dtype(gate_up) or gate_up.dim() != 2 \
            or gate_up.stride(1) != 1 or gate_up.shape[1] % 2:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, inter)
    library.silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, inter,
                     int(gate_up.dtype == torch.bfloat16), torch.get_num_threads())
    return out


# The bf16 panels hold each 16 columns in the order cpu_linear.c's widening unpack yields them.
_WIDEN_ORDER = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])


class PackedLinear:
    """A float32 weight `[n, k]` in cpu_linear.c's panels, in bf16 when every value is a bf16
    (a bf16 checkpoint run in float32: half the bytes, the same products; measured as fast as
    float32 panels at prefill-sized calls too), else in float32."""

    def __init__(self, weight: torch.Tensor):
        n, k = weight.shape
        self.n, self.k = n, k
        self.n_padded = -(-n // 16) * 16
        w = weight.detach().contiguous()
        if self.n_padded != n:
            w = torch.cat([w, w.new_zeros(self.n_padded - n, k)])
        panels = w.view(self.n_padded // 16, 16, k).transpose(1, 2).contiguous()
        # bf16 values: the low 16 bits of every float32 are zero.
        self.is_bf16 = not bool((panels.view(torch.int32) & 0xFFFF).any())
        self.panels = panels.to(torch.bfloat16)[..., _WIDEN_ORDER].contiguous() \
            if self.is_bf16 else panels


def pack_linear(weight: torch.Tensor) -> Optional[PackedLinear]:
    """cpu_linear.c's layout of a float32 CPU weight, or None where the kernel does not run
    (no build, no AVX2 + FMA, another dtype or device)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2 \
            or not _linear_runs():
        return None
    return PackedLinear(weight)


_linear_ran: Optional[bool] = None


def _linear_runs() -> bool:
    """Whether the kernel runs here (built, and the CPU has AVX2 + FMA); asked once."""
    global _linear_ran
    if _linear_ran is None:
        _linear_ran = _load() is not None and \
            linear_f32(torch.zeros(1, 8), PackedLinear(torch.zeros(16, 8))) is not None
    return _linear_ran


def linear_f32(x: torch.Tensor, packed: PackedLinear,
               bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """`x @ weight.T + bias` for float32 rows `[m, k]`; every row by the same fixed order
    (cpu_linear.c). None when the kernel does not run here."""
    library = _load()
    if library is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 \
            or x.shape[1] != packed.k or (bias is not None and (bias.device.type != "cpu"
                                                                or bias.numel() != packed.n)):
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    y = x.new_empty(rows, packed.n_padded)
    if bias is not None:
        bias = bias.to(torch.float32)
        if packed.n_padded != packed.n:
            bias = torch.cat([bias, bias.new_zeros(packed.n_padded - packed.n)])
        bias = bias.contiguous()
    status = library.linear_f32(x.data_ptr(), x.stride(0), packed.panels.data_ptr(),
                                int(packed.is_bf16), bias.data_ptr() if bias is not None else None,
                                y.data_ptr(), rows, packed.n_padded, packed.k,
                                torch.get_num_threads())
    if status != 0:
        return None
    return y if packed.n_padded == packed.n else y[:, :packed.n].contiguous()
