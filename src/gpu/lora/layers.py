"""The LoRA math around the model's linear layers: each step's rows grouped by adapter slot,
one shrink (x Aᵀ) and one expand (· Bᵀ, B already scaled) per slot and layer, added to the base
layer's output on that slot's rows only (the segmented SGMV idea of Punica / S-LoRA, in torch).

`install_lora` wraps the `forward` of every decoder layer's `qkv_proj`, `o_proj`,
`gate_up_proj` and `down_proj` (`ringserve.gpu.models.llama`, and the families built on it:
Mistral, Qwen2 / Qwen3, Phi-3, Gemma; a mixture-of-experts layer's feed-forward block has no
dense projections and is left alone) on the model instance: `ringserve.gpu.layers.linear` and
the model files are not touched, and the base computation is the same call as before, so a
base row (slot -1) is bit-identical to the model without LoRA. `LoRASlots` holds up to
`max_loras` adapters, each packed per layer into one A ([sum of ranks, in]) and one B
([columns, sum of ranks], block-diagonal over q / k / v or gate / up) on the model's device;
`LoRABatch` says which rows of the current step use which slot. The worker's LoRA manager
(`ringserve.gpu.lora.manager`) owns both, loads slots and sets the batch before each forward.

With no LoRA row in the step (`LoRABatch.set(None)`) a wrapper costs one Python call and an
attribute read. The captured decode step (`ringserve.gpu.runner.decode_capture`) reads the
layers' panels directly and does not see these wrappers: a step with LoRA rows must run
eagerly (`LoRABatch.active`). Tensor-parallel size 1 only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ringserve.gpu.layers.linear import ColumnParallelLinear, RowParallelLinear
from ringserve.gpu.lora.weights import TARGETS, LoRAAdapter, LoRADelta

# (layer index, ringserve layer name) of a wrapped linear layer
Key = tuple[int, str]
Rows = slice | torch.Tensor  # a slot's rows: a contiguous range, or their indices


@dataclass(frozen=True, slots=True)
class _Packed:
    """One slot's delta on one layer: `y[:, lo:hi] += (x Aᵀ) Bᵀ`."""

    a: torch.Tensor  # [R, in] float32
    b: torch.Tensor  # [hi - lo, R] float32, scaled; zero outside each part's own block
    lo: int
    hi: int


class LoRABatch:
    """Which rows of the current step use which slot (set by the runner before each
    forward, read by every wrapped layer)."""

    def __init__(self) -> None:
        self._groups: list[tuple[int, Rows]] | None = None
        self.num_tokens = 0
        self.device = torch.device("cpu")  # where row indices go (`install_lora` sets it)

    @property
    def active(self) -> bool:
        """Whether the step has a LoRA row (then it must run eagerly)."""
        return self._groups is not None

    @property
    def groups(self) -> list[tuple[int, Rows]] | None:
        """(slot, its rows) for each slot with rows in the step; None: no LoRA row."""
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
        self._groups = None
        if token_slots is None:
            return
        if token_slots.dim() != 1 or token_slots.dtype.is_floating_point:
            raise ValueError(f"token_slots: expected int64 [T], got {token_slots.dtype} "
                             f"{list(token_slots.shape)}")
        slots = token_slots.to("cpu", torch.int64)
        self.num_tokens = int(slots.shape[0])
        groups: list[tuple[int, Rows]] = []
        for slot in torch.unique(slots[slots >= 0]).tolist():
            rows = torch.nonzero(slots == slot).squeeze(1)
            first, last = int(rows[0]), int(rows[-1])
            if last - first + 1 == rows.shape[0]:
                groups.append((int(slot), slice(first, last + 1)))
            else:
                groups.append((int(slot), rows.to(self.device)))
        self._groups = groups or None


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
        self.device = torch.device("cpu")
        self._wrapped: set[Key] | None = None  # the layers `install_lora` wrapped

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

    def clear(self, slot: int) -> None:
        """Empty `slot`."""
        self._check(slot)
        self._held[slot] = None
        self._adapters[slot] = None

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

    def _attach(self, device: torch.device, wrapped: set[Key]) -> None:
        """Follow the installed model: its device and wrapped layers (what is held moves)."""
        self.device, self._wrapped = device, wrapped
        for slot, adapter in enumerate(self._adapters):
            if adapter is not None:
                self.load(slot, adapter)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} is out of range (--max-loras {self.max_loras})")


def _pack(parts: list[LoRADelta], device: torch.device) -> _Packed:
    """The parts of one layer's delta as one shrink and one expand matrix."""
    lo = min(p.offset for p in parts)
    hi = max(p.offset + p.width for p in parts)
    a = torch.cat([p.a for p in parts])
    b = torch.zeros(hi - lo, a.shape[0], dtype=torch.float32)
    col = 0
    for p in parts:
        r = p.a.shape[0]
        b[p.offset - lo:p.offset - lo + p.width, col:col + r] = p.b
        col += r
    return _Packed(a.to(device), b.to(device), lo, hi)


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
        groups = batch.groups
        if groups is None:
            return y
        return _add_deltas(x, y, key, groups, slots, batch.num_tokens)

    setattr(linear, "forward", forward)  # noqa: B010 (mypy refuses assigning to a method)


def _add_deltas(x: torch.Tensor, y: torch.Tensor, key: Key, groups: list[tuple[int, Rows]],
                slots: LoRASlots, num_tokens: int) -> torch.Tensor:
    """Add each slot's delta to its rows of `y` in place (other rows are left as they are)."""
    if x.shape[0] != num_tokens:
        raise RuntimeError(f"LoRA: the step's batch has {num_tokens} rows but layers.{key[0]}."
                           f"{key[1]} got {x.shape[0]} (LoRABatch.set was not called for it)")
    for slot, rows in groups:
        d = slots.delta(slot, key)
        if d is None:
            continue
        if isinstance(rows, slice):
            h = x[rows].float() @ d.a.t()
            y[rows, d.lo:d.hi].add_((h @ d.b.t()).to(y.dtype))
        else:
            h = x.index_select(0, rows).float() @ d.a.t()
            y[:, d.lo:d.hi].index_add_(0, rows, (h @ d.b.t()).to(y.dtype))
    return y
