"""The LoRA slots as the captured decode step reads them (`decode_step.c`'s `rs_lora`): for
every layer's qkv / o / gate_up / down projection, one table of `max_loras` entries, each
the slot's shrink matrix A and its parts' scaled Bᵀ (the same tensors the eager wrappers
multiply, `ringserve.gpu.lora.layers`), or empty where the slot's adapter leaves the
projection alone. The step adds each decode's own slot's delta after the base product, so a
decode step with LoRA rows stays captured; base rows are untouched.

`CaptureTables.point` rebuilds the tables when the slots changed (`LoRASlots.version`) and
hands them to a capture that does not have them yet (`DecodeCapture.set_lora`); the LoRA
manager calls it for each captured step that has LoRA rows (`LoRAManager.capture_rows`).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from ringserve.gpu.lora.layers import LoRASlots
from ringserve.gpu.lora.weights import TARGETS

if TYPE_CHECKING:
    from ringserve.gpu.runner.decode_capture import DecodeCapture

_i64 = ctypes.c_int64


class _RsLoraSeg(ctypes.Structure):
    _fields_ = [("c0", _i64), ("c1", _i64), ("offset", _i64), ("width", _i64),
                ("b", ctypes.c_void_p)]


class _RsLora(ctypes.Structure):
    _fields_ = [("a", ctypes.c_void_p), ("rank", _i64), ("nsegs", _i64),
                ("segs", _RsLoraSeg * 3)]


def lora_tables(slots: LoRASlots, num_layers: int) -> tuple[list[list[int | None]], object]:
    """Per layer, per projection (TARGETS' order: qkv, o, gate_up, down), the address of its
    `rs_lora` table (None: no held slot touches it); and what keeps the tables alive."""
    keep: list[object] = []
    tables: list[list[int | None]] = []
    for layer in range(num_layers):
        row: list[int | None] = []
        for name in TARGETS:
            entries = (_RsLora * slots.max_loras)()
            used = False
            for slot in range(slots.max_loras):
                delta = slots.held_delta(slot, (layer, name))
                if delta is None:
                    continue
                if len(delta.segs) > 3:
                    raise ValueError(f"LoRA: layers.{layer}.{name} has {len(delta.segs)} parts")
                segs = (_RsLoraSeg * 3)(*(
                    _RsLoraSeg(seg.c0, seg.c1, seg.offset, seg.width, seg.b.data_ptr())
                    for seg in delta.segs))
                entries[slot] = _RsLora(delta.a.data_ptr(), delta.a.shape[0], len(delta.segs),
                                        segs)
                keep.append(delta)
                used = True
            row.append(ctypes.addressof(entries) if used else None)
            if used:
                keep.append(entries)
        tables.append(row)
    return tables, keep


class CaptureTables:
    """The tables for the slots' current contents, rebuilt only when they changed."""

    def __init__(self) -> None:
        self._version = -1
        self._tables: tuple[list[list[int | None]], object] | None = None

    def point(self, capture: DecodeCapture, slots: LoRASlots) -> None:
        """Give `capture` the tables of the slots as they are now (nothing to do when it has
        them: same slots' version; a capture rebuilt after a weight update has none)."""
        if capture.lora_version == slots.version:
            return
        if self._tables is None or self._version != slots.version:
            self._tables = lora_tables(slots, capture.num_layers)
            self._version = slots.version
        capture.set_lora(*self._tables, slots.version)
