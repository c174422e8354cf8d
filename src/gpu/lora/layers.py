"""The LoRA math around the model's linear layers: a shrink (x Aᵀ) and an expand (· Bᵀ, B
already scaled, one per output part: q / k / v, gate / up) added to the base layer's output on
each LoRA row, with that row's slot's adapter. A step with one slot, or with many rows per slot
(prefill chunks), runs each slot on its rows (the segmented SGMV idea of Punica / S-LoRA, in
torch); a step with several slots on few rows (decode) runs all held slots at once, whatever
their number: one stacked shrink, a per-row mask keeping only the row's own slot's columns
(built once per step), one stacked expand per part, one add into the LoRA rows.

`install_lora` wraps the `forward` of every decoder layer's `qkv_proj`, `o_proj`,
`gate_up_proj` and `down_proj` (`ringserve.gpu.models.llama`, and the families built on it:
Mistral, Qwen2 / Qwen3, Phi-3, Gemma; a mixture-of-experts layer's feed-forward block has no
dense projections and is left alone) on the model instance: `ringserve.gpu.layers.linear` and
the model files are not touched, and the base computation is the same call as before, so a
base row (slot -1) is bit-identical to the model without LoRA. `LoRASlots` holds up to
`max_loras` adapters, each packed per layer into one A ([sum of ranks, in]) and one Bᵀ per
part on the model's device, plus (built on first use after a load or clear) the held slots'
stacked the same way; `LoRABatch` says which rows of the current step use which slot. The worker's LoRA manager
(`ringserve.gpu.lora.manager`) owns both, loads slots and sets the batch before each forward.

With no LoRA row in the step (`LoRABatch.set(None)`) a wrapper costs one Python call and an
attribute read. The captured decode step (`ringserve.gpu.runner.decode_capture`) reads the
layers' panels directly and does not see these wrappers: it adds the same deltas itself from
the slots' tensors (`ringserve.gpu.lora.capture`). Tensor-parallel size 1 only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from ringserve.gpu.layers.linear import ColumnParallelLinear, RowParallelLinear
from ringserve.gpu.lora.weights import TARGETS, LoRAAdapter, LoRADelta

# (layer index, ringserve layer name) of a wrapped linear layer
Key = tuple[int, str]
Rows = slice | torch.Tensor  # a slot's rows: a contiguous range, or their indices

# A step with several slots takes the stacked, masked path on a layer while its LoRA rows times
# the layer's stacked slots stay within this: every row multiplies every slot's A and B, so the
# cost grows with rows x slots, and above it the per-slot loop's smaller products win over its
# per-op overhead. The loop is cheaper when each slot's rows are contiguous (prefill chunks: a
# slice, updated in place) than when scattered (decode rows: a gather and a scatter per slot).
# Measured on 2 CPU threads, SmolLM2-135M shapes, rank 16.
_MASKED_MAX_WORK = 1536  # some slot's rows scattered
_MASKED_MAX_WORK_CONTIGUOUS = 256  # every slot's rows contiguous


class _Seg(NamedTuple):
    """One output part of a delta: `y[:, offset:offset + width] += h[:, c0:c1] b`."""

    c0: int
    c1: int
    b: torch.Tensor  # [c1 - c0, width] float32: Bᵀ, scaled
    offset: int
    width: int


@dataclass(frozen=True, slots=True)
class _Packed:
    """One slot's delta on one layer: `h = x Aᵀ`, then each part's expand (q / k / v or gate /
    up apart, so no zero block of a block-diagonal B is multiplied)."""

    a: torch.Tensor  # [R, in] float32
    segs: tuple[_Seg, ...]
    lo: int  # the output columns the parts cover, lo:hi
    hi: int


@dataclass(frozen=True, slots=True)
class _Stacked:
    """The held slots' deltas on one layer, stacked along the rank: `h = x Aᵀ` for every slot
    at once, each row's columns outside its own slot's blocks zeroed, then one expand per
    output part (each part's slots stacked)."""

    a: torch.Tensor  # [sum of the slots' ranks, in] float32, grouped by part, then slot
    segs: tuple[_Seg, ...]
    lo: int
    hi: int
    cols: torch.Tensor  # int64 [sum of ranks], the slot of each column of h
    layout: tuple[int, ...]  # the slot of each column (keys the step's masks)
    num_slots: int


class LoRABatch:
    """Which rows of the current step use which slot (set by the runner before each
    forward, read by every wrapped layer)."""

    def __init__(self) -> None:
        self.rows: Rows | None = None  # the step's LoRA rows (slot >= 0); None: none
        self.row_slots = torch.empty(0, dtype=torch.int64)  # [len(rows)], on `device`
        self.slot_ids: tuple[int, ...] = ()  # the distinct slots of the step, ascending
        self.num_tokens = 0
        self.device = torch.device("cpu")  # where row indices go (`install_lora` sets it)
        self._slots = torch.empty(0, dtype=torch.int64)  # [T] on the host
        self._groups: list[tuple[int, Rows]] | None = None
        # layout of a `_Stacked` -> [len(rows), its columns] float 0 / 1: each row's own slot
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        self._masked_max_work = 0  # see `_MASKED_MAX_WORK`

    @property
    def active(self) -> bool:
        """Whether the step has a LoRA row (then it must run eagerly)."""
        return self.rows is not None

    def token_slots(self) -> np.ndarray | None:
        """The slot of every token row of the step (int64, -1 for a base row); None: no
        LoRA row."""
        if self.rows is None:
            return None
        return np.ascontiguousarray(self._slots.numpy(), dtype=np.int64)

    @property
    def groups(self) -> list[tuple[int, Rows]] | None:
        """(slot, its rows) for each slot with rows in the step; None: no LoRA row."""
        if self.rows is None:
            return None
        if self._groups is None:
            if len(self.slot_ids) == 1:
                self._groups = [(self.slot_ids[0], self.rows)]
            else:
                self._groups = [(slot, _as_rows(torch.nonzero(self._slots == slot).squeeze(1),
                                                 self.device)) for slot in self.slot_ids]
        return self._groups

    def set(self, token_slots: torch.Tensor | None) -> None:
        """Set the step's rows.

        Args:
            token_slots: int64 [T], the slot of each token row of the step's flat batch (in
                the order of the model's input ids), -1 for a base row; None (or no row >= 0):
                no LoRA row in the step.

        Raises:
            ValueError: `token_slots` is not a 1-D integer tensor.
        """
        self.rows, self._groups, self._masks = None, None, {}
        if token_slots is None:
            return
        if token_slots.dim() != 1 or token_slots.dtype.is_floating_point:
            raise ValueError(f"token_slots: expected int64 [T], got {token_slots.dtype} "
                             f"{list(token_slots.shape)}")
        slots = token_slots.to("cpu", torch.int64)
        self.num_tokens = int(slots.shape[0])
        lora = torch.nonzero(slots >= 0).squeeze(1)
        if not lora.shape[0]:
            return
        row_slots = slots[lora]
        self._slots = slots
        self.slot_ids = tuple(torch.unique(row_slots).tolist())
        self.row_slots = row_slots.to(self.device)
        self.rows = _as_rows(lora, self.device)
        if len(self.slot_ids) > 1:
            groups = self.groups or []
            self._masked_max_work = (_MASKED_MAX_WORK_CONTIGUOUS
                                     if all(isinstance(r, slice) for _, r in groups)
                                     else _MASKED_MAX_WORK)


def _as_rows(rows: torch.Tensor, device: torch.device) -> Rows:
    """Ascending row indices as a slice when contiguous, else on `device`."""
    first, last = int(rows[0]), int(rows[-1])
    if last - first + 1 == rows.shape[0]:
        return slice(first, last + 1)
    return rows.to(device)


class LoRASlots:
    """`max_loras` slots, each holding one adapter's deltas (or none), on the model's device.

    Args:
        max_loras: the number of slots (`--max-loras`).
    """

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras: {max_loras} is not a positive integer")
        self.max_loras = max_loras
        self._held: list[dict[Key, _Packed] | None] = [None] * max_loras
        self._adapters: list[LoRAAdapter | None] = [None] * max_loras
        # per layer, the held slots' deltas stacked (None: no held slot touches it); built on
        # first use after a load or clear
        self._stacks: dict[Key, _Stacked | None] = {}
        self.device = torch.device("cpu")
        self._wrapped: set[Key] | None = None  # the layers `install_lora` wrapped
        self.version = 0  # counts changes of what the slots hold (`ringserve.gpu.lora.capture`)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter`'s deltas into `slot` (replacing what it held).

        Raises:
            ValueError: `slot` is out of range, or the adapter has a delta on a layer the
                model does not have as a dense projection (e.g. a mixture of experts).
        """
        self._check(slot)
        if self._wrapped is not None:
            missing = sorted(k for k in adapter.deltas if k not in self._wrapped)
            if missing:
                layer, name = missing[0]
                raise ValueError(f"layers.{layer}.{name}: this model has no dense projection "
                                 "there for a LoRA delta (LoRA on mixture-of-experts layers is "
                                 "not supported)")
        self._held[slot] = {key: _pack(parts, self.device) for key, parts in adapter.deltas.items()}
        self._adapters[slot] = adapter
        self._stacks = {}
        self.version += 1

    def clear(self, slot: int) -> None:
        """Empty `slot`."""
        self._check(slot)
        self._held[slot] = None
        self._adapters[slot] = None
        self._stacks = {}
        self.version += 1

    def adapter(self, slot: int) -> LoRAAdapter | None:
        """The adapter `slot` holds."""
        self._check(slot)
        return self._adapters[slot]

    def delta(self, slot: int, key: Key) -> _Packed | None:
        """`slot`'s delta on layer `key` (None: the adapter does not touch that layer).

        Raises:
            RuntimeError: the slot holds no adapter (a step asked for an empty slot).
        """
        held = self._held[slot] if 0 <= slot < self.max_loras else None
        if held is None:
            raise RuntimeError(f"LoRA slot {slot} holds no adapter but the step has rows on it")
        return held.get(key)

    def held_delta(self, slot: int, key: Key) -> _Packed | None:
        """`slot`'s delta on layer `key`; None when the slot is empty or its adapter leaves
        the layer alone."""
        self._check(slot)
        held = self._held[slot]
        return None if held is None else held.get(key)

    def _stacked(self, key: Key) -> _Stacked | None:
        """The held slots' deltas on layer `key`, stacked (None: no held slot touches it)."""
        if key not in self._stacks:
            held = [(slot, d) for slot, h in enumerate(self._held)
                    if h is not None and (d := h.get(key)) is not None]
            self._stacks[key] = _stack(held, self.device) if held else None
        return self._stacks[key]

    def _require(self, slots: tuple[int, ...]) -> None:
        """Raise if one of `slots` holds no adapter (see `delta`)."""
        for slot in slots:
            if not 0 <= slot < self.max_loras or self._held[slot] is None:
                self.delta(slot, (0, ""))  # raises, with the same message

    def _attach(self, device: torch.device, wrapped: set[Key]) -> None:
        """Follow the installed model: its device and wrapped layers (what is held moves)."""
        self.device, self._wrapped = device, wrapped
        self._stacks = {}
        self.version += 1
        for slot, adapter in enumerate(self._adapters):
            if adapter is not None:
                self.load(slot, adapter)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} is out of range (--max-loras {self.max_loras})")


def _pack(parts: list[LoRADelta], device: torch.device) -> _Packed:
    """The parts of one layer's delta as one shrink matrix and one expand per part."""
    segs, col = [], 0
    for p in parts:
        r = p.a.shape[0]
        segs.append(_Seg(col, col + r, p.b.t().contiguous().to(device), p.offset, p.width))
        col += r
    return _Packed(torch.cat([p.a for p in parts]).to(device), tuple(segs), *_span(segs))


def _stack(held: list[tuple[int, _Packed]], device: torch.device) -> _Stacked:
    """Slots' packed deltas on one layer as one shrink matrix and one expand per part."""
    parts: dict[tuple[int, int], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for slot, d in held:
        for seg in d.segs:
            parts.setdefault((seg.offset, seg.width), []).append(
                (slot, d.a[seg.c0:seg.c1], seg.b))
    a_rows: list[torch.Tensor] = []
    cols: list[int] = []
    segs = []
    for (offset, width), blocks in parts.items():
        c0 = len(cols)
        for slot, a, _ in blocks:
            a_rows.append(a)
            cols += [slot] * a.shape[0]
        segs.append(_Seg(c0, len(cols), torch.cat([b for _, _, b in blocks]), offset, width))
    return _Stacked(torch.cat(a_rows), tuple(segs), *_span(segs),
                    torch.tensor(cols, device=device), tuple(cols), len(held))


def _span(segs: list[_Seg]) -> tuple[int, int]:
    return min(s.offset for s in segs), max(s.offset + s.width for s in segs)


def install_lora(model: nn.Module, slots: LoRASlots, batch: LoRABatch) -> None:
    """Wrap the dense projections of every decoder layer of `model` so that rows on a slot get
    that slot's delta. Installing again (on the same model, e.g. after a weight update in
    place, or on a new one) rewraps the base layers; the slots keep their adapters.

    Raises:
        ValueError: the model is not a Llama-style decoder, or runs tensor-parallel.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"LoRA: {type(model).__name__} has no decoder layers (model.layers)")
    wrapped: set[Key] = set()
    device = torch.device("cpu")
    for index, layer in enumerate(layers):
        for name in TARGETS:
            block = getattr(layer, "self_attn" if name in ("qkv_proj", "o_proj") else "mlp", None)
            linear = getattr(block, name, None)
            if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
                continue  # e.g. a mixture of experts
            if linear.tp.world_size != 1:
                raise ValueError("LoRA: tensor_parallel_size > 1 is not supported yet")
            _wrap(linear, (index, name), slots, batch)
            wrapped.add((index, name))
            if linear.bias is not None:
                device = linear.bias.device
            elif linear.weight.numel():
                device = linear.weight.device
            elif linear.panel is not None:
                device = linear.panel.data.device
    if not wrapped:
        raise ValueError(f"LoRA: {type(model).__name__} has no dense projections to adapt")
    batch.device = device
    slots._attach(device, wrapped)


def _wrap(linear: ColumnParallelLinear | RowParallelLinear, key: Key, slots: LoRASlots,
          batch: LoRABatch) -> None:
    """Replace `linear.forward` on the instance by base + delta (the class's own forward is
    the base, so rewrapping never nests)."""
    base: Callable[[torch.Tensor], torch.Tensor] = type(linear).forward.__get__(linear)

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = base(x)
        if batch.rows is None:
            return y
        return _add_deltas(x, y, key, batch, slots)

    setattr(linear, "forward", forward)  # noqa: B010 (mypy refuses assigning to a method)


def _add_deltas(x: torch.Tensor, y: torch.Tensor, key: Key, batch: LoRABatch,
                slots: LoRASlots) -> torch.Tensor:
    """Add each LoRA row's slot's delta to that row of `y` in place (base rows are left as
    they are). One slot in the step, or many rows: each slot's delta on its rows; several
    slots on few rows (decode): one stacked shrink, a mask keeping each row's own slot's
    columns, one stacked expand per part, whatever the number of slots."""
    if x.shape[0] != batch.num_tokens:
        raise RuntimeError(f"LoRA: the step's batch has {batch.num_tokens} rows but layers."
                           f"{key[0]}.{key[1]} got {x.shape[0]} (LoRABatch.set was not called "
                           "for it)")
    rows = batch.rows
    if rows is None:
        return y
    if len(batch.slot_ids) > 1:
        st = slots._stacked(key)
        if st is None:
            slots._require(batch.slot_ids)
            return y
        if batch.row_slots.shape[0] * st.num_slots <= batch._masked_max_work:
            mask = batch._masks.get(st.layout)
            if mask is None:  # the step's first layer with this layout: check its slots once
                slots._require(batch.slot_ids)
                mask = batch._masks[st.layout] = (batch.row_slots[:, None] == st.cols).float()
            _apply(x, y, rows, st, mask)
            return y
    groups = batch.groups
    assert groups is not None  # rows is not None
    for slot, slot_rows in groups:
        d = slots.delta(slot, key)
        if d is not None:
            _apply(x, y, slot_rows, d, None)
    return y


def _apply(x: torch.Tensor, y: torch.Tensor, rows: Rows, d: _Packed | _Stacked,
           mask: torch.Tensor | None) -> None:
    """`y[rows] += ((x[rows] Aᵀ) * mask) B`, part by part."""
    xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
    h = xs.float() @ d.a.t()
    if mask is not None:
        h.mul_(mask)
    if len(d.segs) == 1:
        c0, c1, b, offset, width = d.segs[0]
        if isinstance(rows, slice) and y.dtype == torch.float32:
            y[rows, offset:offset + width].addmm_(h, b)
        elif isinstance(rows, slice):
            y[rows, offset:offset + width].add_((h @ b).to(y.dtype))
        else:
            y[:, offset:offset + width].index_add_(0, rows, (h @ b).to(y.dtype))
        return
    if isinstance(rows, slice) and y.dtype == torch.float32:
        for c0, c1, b, offset, width in d.segs:
            y[rows, offset:offset + width].addmm_(h[:, c0:c1], b)
        return
    # the parts into one buffer, then one scatter (an index_add per part costs more)
    delta = h.new_zeros(h.shape[0], d.hi - d.lo)
    for c0, c1, b, offset, width in d.segs:
        delta[:, offset - d.lo:offset - d.lo + width].addmm_(h[:, c0:c1], b)
    if isinstance(rows, slice):
        y[rows, d.lo:d.hi].add_(delta.to(y.dtype))
    else:
        y[:, d.lo:d.hi].index_add_(0, rows, delta.to(y.dtype))
