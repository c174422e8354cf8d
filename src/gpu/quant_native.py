"""The project's int8 weight-only matmul (`quant_int8.c`), built on first use; for
`ringserve.gpu.quant`.

torch's `_weight_int8pack_mm` is vectorized for AVX-512 CPUs only; on others (the AVX2
benchmark VM) it runs 4-35x slower than the float32 GEMM (docs/benchmarks.md), so float32
activations go through this kernel when it can be built. As the CPU attention kernel
(`ringserve.gpu.attention.cpu_native`), it is compiled with `$CC` (else `cc`) as
`-O3 -march=native -fopenmp`, cached under `RINGSERVE_HOME/kernels/` by a hash of the source,
the compiler's version and the CPU's model and flags, and runs on torch's OpenMP threads.
When it cannot be built, `load_kernel` logs why once and returns None (torch's kernel stays).
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from ringserve.gpu import native_build

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("quant_int8.c")
_SYMBOL = "ringserve_int8_linear_f32"

Kernel = Callable[..., int]

_lock = threading.Lock()
_loaded: list[Kernel | None] = []


def load_kernel() -> Kernel | None:
    """The compiled kernel (built and cached on first use), or None when it cannot be had."""
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


def int8_linear(kernel: Kernel, x: torch.Tensor, codes: torch.Tensor,
                scales: torch.Tensor) -> torch.Tensor:
    """`x @ (codes * scales[:, None])^T` for contiguous float32 x [M, K], int8 codes [N, K]
    and float32 scales [N].

    Raises:
        ValueError: the shapes or dtypes disagree (the kernel would read out of bounds).
        MemoryError: the kernel could not allocate its per-thread buffer.
    """
    m, k = x.shape
    n = codes.shape[0]
    if (codes.shape[1] != k or scales.shape != (n,) or x.dtype != torch.float32
            or codes.dtype != torch.int8 or scales.dtype != torch.float32
            or not (x.is_contiguous() and codes.is_contiguous() and scales.is_contiguous())):
        raise ValueError(f"int8 linear: x {x.dtype} {list(x.shape)}, codes {codes.dtype} "
                         f"{list(codes.shape)}, scales {scales.dtype} {list(scales.shape)}")
    out = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return out
    status = kernel(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), out.data_ptr(),
                    m, n, k, torch.get_num_threads())
    if status != 0:
        raise MemoryError("int8 linear: the CPU kernel could not allocate its buffer")
    return out


def _load() -> Kernel | None:
    cc = native_build.compiler()
    if cc is None:
        logger.warning("no C compiler (CC or cc): int8 matmuls use torch's kernel")
        return None
    try:
        library = native_build.build_library(_SOURCE, "quant_int8", cc,
                                             native_build.OPENMP_FLAGS)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("the int8 CPU kernel is unavailable (%s): int8 matmuls use torch's "
                       "kernel", exc)
        return None
    kernel = getattr(library, _SYMBOL)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    kernel.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    kernel.restype = ctypes.c_int
    kernel_fn: Kernel = kernel
    return kernel_fn
