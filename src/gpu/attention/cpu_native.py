"""The CPU attention backend: decodes read the paged KV cache in place (a C kernel).

`cpu_decode.c` is compiled on first use with the machine's C compiler (`$CC`, else `cc`):
`-O3 -march=native -fopenmp`, in about a second. The shared object is cached under
`RINGSERVE_HOME/kernels/`, named by a hash of the source, the compiler's version, the flags and
the CPU's model and feature flags, so a cache shared between different machines never loads a
build for another CPU. It links the same `libgomp.so.1` torch has loaded, so the kernel runs on
torch's OpenMP threads (`torch.get_num_threads()` of them) instead of a second pool.

When the kernel cannot be built or loaded (no compiler, no OpenMP), `load_kernel` logs why,
once, and returns None; `backend.select_backend` then falls back to the torch reference.

Every step, `plan_decodes` picks the single-token queries (decodes), checks every block id they
will read against the cache (a bad schedule must raise, not read out of bounds), and lays out
their rows, lengths and block tables for the kernel; the backend builds this plan once per step
for all layers. Multi-token queries (prefill chunks) and caches other than float32 go through
the torch reference. A layer's sliding window and logit soft-cap are arguments of each call
(the kernel starts a windowed decode's key loop at its window), so the plan does not depend
on them.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ringserve.gpu.attention import torch_ref
from ringserve.gpu.attention.metadata import AttentionMetadata
from ringserve.gpu.native import build as native_build

logger = logging.getLogger(__name__)

# The C sources of every CPU kernel live together in `ringserve.gpu.native`.
_NATIVE = Path(native_build.__file__).parent
_SOURCE = _NATIVE / "cpu_decode.c"
HEADERS = (_NATIVE / "cpu_decode.h", _NATIVE / "fast_exp.h")
_SYMBOL = "ringserve_paged_decode_f32"

# The kernel's ctypes function: (pointers and sizes as in cpu_decode.c) -> status.
Kernel = Callable[..., int]

_lock = threading.Lock()
_loaded: dict[str, Kernel | None] = {}


@dataclass(frozen=True)
class DecodePlan:
    """The step's decodes, laid out for the kernel (shared by every layer of the step).

    Attributes:
        rows: int64 [n]: the query row of each decode.
        lens: int32 [n]: its sequence length.
        tables: int32 [n, max_blocks]: its block table row (C order).
        max_len: the longest sequence (the kernel's scratch size).
        requests: (request index, its block ids) for the multi-token queries, which the
            torch reference attends one by one.
    """

    rows: np.ndarray
    lens: np.ndarray
    tables: np.ndarray
    max_len: int
    requests: list[tuple[int, torch.Tensor]]


def plan_decodes(meta: AttentionMetadata, kv_cache: torch.Tensor) -> DecodePlan:
    """The decodes of `meta` for caches shaped like `kv_cache`.

    Raises:
        ValueError: a decode would read a block outside the cache, or past its table row.
    """
    _, num_blocks, block_size, _, _ = kv_cache.shape
    qsl = np.asarray(meta.query_start_loc_cpu, dtype=np.int64)
    lens = np.asarray(meta.seq_lens_cpu, dtype=np.int64)
    query_lens = np.diff(qsl)
    decodes = np.flatnonzero(query_lens == 1)
    table = meta.block_table.cpu().numpy()
    requests = torch_ref.request_blocks(table, lens, np.flatnonzero(query_lens > 1).tolist(),
                                        block_size, kv_cache.device)
    dlens = lens[decodes]
    used = -(-dlens // block_size)  # blocks each decode reads
    if decodes.size and (int(dlens.min()) < 1 or int(used.max()) > table.shape[1]):
        raise ValueError("attention: a decode's sequence length does not fit its block table")
    tables = np.ascontiguousarray(table[decodes], dtype=np.int32)
    read = np.arange(tables.shape[1])[None, :] < used[:, None]
    if read.any():
        blocks = tables[read]
        if int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks:
            raise ValueError(f"attention: a block id outside the cache (0..{num_blocks - 1})")
    return DecodePlan(rows=qsl[decodes], lens=dlens.astype(np.int32), tables=tables,
                      max_len=int(dlens.max()) if decodes.size else 0, requests=requests)


def decode_attention(kernel: Kernel, query: torch.Tensor, kv_cache: torch.Tensor,
                     plan: DecodePlan, scale: float, out: torch.Tensor, *,
                     sliding_window: int | None = None,
                     logits_soft_cap: float | None = None) -> None:
    """Write the attention of `plan`'s decode rows of `query` [T, Hq, D] into `out`, with
    `kernel` (what `load_kernel` returned).

    Both `query` and `out` are contiguous float32 and `kv_cache` is this layer's contiguous
    float32 cache (the backend checks; other rows of `out` are left as they are). The window
    and soft-cap are as in `AttentionBackend.attend` (checked by the caller:
    `torch_ref.check_options`).

    Raises:
        ValueError: the shapes disagree (the kernel would read or write out of bounds).
        MemoryError: the kernel could not allocate its scratch buffers.
    """
    n = plan.rows.shape[0]
    if n == 0:
        return
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    rows, q_heads, q_dim = query.shape
    if (q_dim != dim or q_heads % heads or out.shape != query.shape
            or int(plan.rows.max()) >= rows):
        raise ValueError(f"attention: query {tuple(query.shape)} does not fit the cache "
                         f"{tuple(kv_cache.shape)} and the step's decode rows")
    status = kernel(
        query.data_ptr(), out.data_ptr(), kv_cache.data_ptr(), num_blocks * block_size,
        plan.rows.ctypes.data, plan.lens.ctypes.data, plan.tables.ctypes.data,
        plan.tables.shape[1], n, query.shape[1], heads, dim, block_size, scale, plan.max_len,
        sliding_window or 0, logits_soft_cap or 0.0, torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("attention: the CPU kernel could not allocate its scratch buffers")


def load_kernel() -> Kernel | None:
    """The compiled kernel (built and cached on first use), or None when it cannot be had."""
    key = _build_key()
    with _lock:
        if key not in _loaded:
            _loaded[key] = _load(key)
        return _loaded[key]


def _build_key() -> str:
    cc = native_build.compiler() or ""
    return "|".join([cc, *native_build.OPENMP_FLAGS])


def _load(key: str) -> Kernel | None:
    del key  # the build key of the cache in load_kernel (compiler and flags)
    cc = native_build.compiler()
    if cc is None:
        logger.warning("no C compiler (CC or cc): CPU attention uses the torch reference")
        return None
    try:
        library = native_build.build_library(_SOURCE, "cpu_decode", cc,
                                             [*native_build.OPENMP_FLAGS,
                                              f"-I{HEADERS[1].parent}"], ["-lm"],
                                             headers=HEADERS)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("the CPU attention kernel is unavailable (%s): CPU attention uses "
                       "the torch reference", exc)
        return None
    kernel = getattr(library, _SYMBOL)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    kernel.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                       ctypes.c_float, i64, i64, ctypes.c_float, ctypes.c_int]
    kernel.restype = ctypes.c_int
    kernel_fn: Kernel = kernel
    return kernel_fn
