"""Applying a grammar bitmask to the logits (worker side; imports nothing of the engine).

The bitmask is int32 `[rows, ceil(vocab / 32)]`, bit `t % 32` of word `t // 32` set when token
`t` is allowed; row `j` masks logits row `rows[j]`. Disallowed tokens become -inf in place.
xgrammar's CPU kernel does it when xgrammar imports; a torch fallback otherwise.
"""

from __future__ import annotations

import torch

__all__ = ["apply_bitmask"]

_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: torch.Tensor | None = None) -> None:
    """Set the logits of tokens the bitmask forbids to -inf, in place.

    Args:
        logits: float [num_rows, vocab].
        bitmask: int32 [k, words]; words * 32 may be more or less than vocab (tokens past the
            bitmask are forbidden, bits past the logits ignored).
        rows: int64 [k], the logits row each bitmask row applies to (None: rows 0..k-1).
    """
    if rows is None:
        rows = torch.arange(bitmask.shape[0], device=logits.device)
    if bitmask.shape[0] == 0:
        return
    vocab = logits.shape[1]
    shifts = _SHIFTS.to(bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1).bool()
    allowed = torch.zeros((bitmask.shape[0], vocab), dtype=torch.bool, device=logits.device)
    width = min(vocab, bits.shape[1])
    allowed[:, :width] = bits[:, :width].to(logits.device)
    sub = logits[rows]
    sub.masked_fill_(~allowed, float("-inf"))
    logits[rows] = sub
