"""Applying a grammar bitmask to the logits (worker side; imports nothing of the engine).

The bitmask is int32 `[rows, ceil(vocab / 32)]`, bit `t % 32` of word `t // 32` set when token
`t` is allowed; row `j` masks logits row `rows[j]`. Disallowed tokens become -inf in place.
Tokens past the bitmask's width (logits padded wider) are forbidden; bits past the logits'
width are ignored. xgrammar's kernel does it when xgrammar imports (its CPU kernel for CPU
logits, its Triton kernel on CUDA); a pure-torch fallback (bits unpacked with shifts)
otherwise, and for dtypes the kernel does not take.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["apply_bitmask", "apply_bitmask_torch"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _load_kernel() -> Callable[..., None] | None:
    try:
        import xgrammar
    except ImportError:
        return None
    kernel: Callable[..., None] = xgrammar.apply_token_bitmask_inplace
    return kernel


_kernel: Callable[..., None] | None = None
_kernel_loaded = False


def _xgrammar_kernel() -> Callable[..., None] | None:
    global _kernel, _kernel_loaded
    if not _kernel_loaded:
        _kernel = _load_kernel()
        _kernel_loaded = True
    return _kernel


def _apply_native(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: torch.Tensor | None) -> bool:
    """The C kernel (`ringserve.gpu.native`, grammar_mask.c) for float32 CPU logits; False
    where it does not apply (another dtype or device, no compiler)."""
    if (logits.dtype != torch.float32 or logits.device.type != "cpu"
            or logits.dim() != 2 or logits.stride(1) != 1):
        return False
    from ringserve.gpu.native import panel as panel_native

    library = panel_native.load_library()
    if library is None:
        return False
    k = bitmask.shape[0]
    mask = bitmask.to(dtype=torch.int32).contiguous()
    index = (torch.arange(k, dtype=torch.int64) if rows is None
             else rows.to(dtype=torch.int64).contiguous())
    library.rs_apply_bitmask(logits.data_ptr(), logits.stride(0), logits.shape[1],
                             mask.data_ptr(), mask.shape[1], index.data_ptr(), k,
                             torch.get_num_threads())
    return True


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: torch.Tensor | None = None) -> None:
    """`apply_bitmask` in plain torch (the reference, and the path without xgrammar)."""
    k = bitmask.shape[0]
    if k == 0:
        return
    vocab = logits.shape[1]
    width = min(vocab, bitmask.shape[1] * 32)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(k, -1)[:, :width]
    forbidden = torch.ones((k, vocab), dtype=torch.bool, device=logits.device)
    forbidden[:, :width] = bits.to(logits.device) == 0
    index = (torch.arange(k, device=logits.device) if rows is None
             else rows.to(device=logits.device, dtype=torch.int64))
    sub = logits.index_select(0, index)
    sub.masked_fill_(forbidden, float("-inf"))
    logits.index_copy_(0, index, sub)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: torch.Tensor | None = None) -> None:
    """Set the logits of tokens the bitmask forbids to -inf, in place.

    Args:
        logits: float [num_rows, vocab].
        bitmask: int32 [k, words], on the logits' device; words * 32 may be more or less than
            vocab (tokens past the bitmask are forbidden, bits past the logits ignored).
        rows: int64 [k], the distinct logits row each bitmask row applies to (None: rows
            0..k-1).
    """
    k = bitmask.shape[0]
    if k == 0:
        return
    if _apply_native(logits, bitmask, rows):
        return
    kernel = _xgrammar_kernel()
    if (kernel is None or logits.dtype not in _KERNEL_DTYPES or not logits.is_contiguous()
            or logits.device.type not in ("cpu", "cuda")):
        apply_bitmask_torch(logits, bitmask, rows)
        return
    vocab = logits.shape[1]
    width = min(vocab, bitmask.shape[1] * 32)
    bitmask = bitmask.to(device=logits.device, dtype=torch.int32)
    indices: list[int] | None = None
    if rows is None:
        target, full = logits[:k], bitmask
    else:
        # The kernel indexes logits and bitmask by the same row: scatter the bitmask rows to
        # their logits rows (the others are never read).
        indices = rows.tolist()
        target = logits
        full = torch.empty((logits.shape[0], bitmask.shape[1]), dtype=torch.int32,
                           device=logits.device)
        full[rows.to(device=logits.device, dtype=torch.int64)] = bitmask
    kwargs: dict[str, Any] = {"vocab_size": width}
    if indices is not None:
        kwargs["indices"] = indices
    kernel(target, full, **kwargs)
    if width < vocab:
        index = (torch.arange(k, device=logits.device) if rows is None
                 else rows.to(device=logits.device, dtype=torch.int64))
        logits[index, width:] = float("-inf")
