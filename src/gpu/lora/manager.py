"""The worker's LoRA books: which adapter each request runs under, which adapters are read
into memory, which sit in the `--max-loras` slots, and which rows of a step use which slot.

The model runner (`ringserve.gpu.runner.model_runner`) owns one `LoRAManager` when
`--enable-lora` is on and calls it at three points: `install` once the model is loaded (the
adapters' deltas are added around its linear layers, `ringserve.gpu.lora.layers`),
`apply_diff` with each step's new and finished requests, and `prepare` with each step's batch
before the forward. Adapters are read from their files the first time a step needs them and
kept in memory (up to `--max-cpu-loras`, least recently used evicted, read again when needed);
a step's adapters are copied into slots, evicting the least recently used adapter no request
of the step needs. The scheduler never puts more distinct adapters in a step than there are
slots. An adapter that cannot be read fails its requests alone.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ringserve.config import LoRAConfig, ModelConfig
from ringserve.gpu.lora.adapter_config import read_adapter_config
from ringserve.gpu.lora.capture import CaptureTables
from ringserve.gpu.lora.layers import LoRABatch, LoRASlots, install_lora
from ringserve.gpu.lora.weights import LoRAAdapter, load_adapter
from ringserve.gpu.wire import SchedulerOutput
from ringserve.lora_request import LoRARequest

if TYPE_CHECKING:
    from ringserve.gpu.runner.decode_capture import DecodeCapture

__all__ = ["LoRAManager"]

logger = logging.getLogger(__name__)


class LoRAManager:
    """Adapters in memory and in slots, and each step's rows.

    Args:
        config: the engine's LoRA limits.
        model_config: the base model (adapters are checked against its shapes).
        device: where the slots live.
    """

    def __init__(self, config: LoRAConfig, model_config: ModelConfig,
                 device: torch.device) -> None:
        self.config = config
        self.model_config = model_config
        self.device = device
        self.slots = LoRASlots(config.max_loras)
        self.batch = LoRABatch()
        self.capture_tables = CaptureTables()  # the slots as the captured step reads them
        self._requests: dict[str, LoRARequest] = {}  # request id -> its adapter
        self._in_memory: OrderedDict[str, LoRAAdapter] = OrderedDict()  # identity -> adapter
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # identity -> slot, LRU first
        self._removed: set[str] = set()  # unloaded, waiting for their last requests

    def install(self, model: torch.nn.Module) -> None:
        """Add the slots' deltas around `model`'s linear layers (a freshly loaded model, or a
        weight update's: the adapters stay)."""
        install_lora(model, self.slots, self.batch)

    def apply_diff(self, so: SchedulerOutput) -> None:
        """Follow a step's new and finished requests (an unloaded adapter goes once its last
        request has finished)."""
        for req_id in so.finished_req_ids:
            lora = self._requests.pop(req_id, None)
            if lora is not None and lora.identity in self._removed:
                self._drop_if_idle(lora.identity)
        for new in so.scheduled_new_reqs:
            if new.lora_request is not None:
                self._requests[new.req_id] = new.lora_request

    def remove(self, identity: str) -> None:
        """An adapter was unloaded: free its slot and memory now, or when the requests
        running on it have finished."""
        self._removed.add(identity)
        self._drop_if_idle(identity)

    def _drop_if_idle(self, identity: str) -> None:
        if any(r.identity == identity for r in self._requests.values()):
            return
        self._removed.discard(identity)
        self._in_memory.pop(identity, None)
        slot = self._slot_of.pop(identity, None)
        if slot is not None:
            self.slots.clear(slot)

    def prepare(self, req_ids: list[str], num_scheduled: np.ndarray[Any, Any]) -> dict[str, str]:
        """Put the step's adapters in slots and tell the layers which rows use which.

        Returns:
            request id -> why it cannot run (its adapter could not be read); its rows run
            on the base model and its output is discarded by the core.
        """
        errors: dict[str, str] = {}
        slots = np.full(len(req_ids), -1, dtype=np.int64)
        needed = {r.identity for rid in req_ids if (r := self._requests.get(rid)) is not None}
        for i, rid in enumerate(req_ids):
            lora = self._requests.get(rid)
            if lora is None:
                continue
            try:
                slots[i] = self._slot_for(lora, needed)
            except (OSError, ValueError, RuntimeError) as exc:
                errors[rid] = f"LoRA adapter {lora.lora_name!r}: {exc}"
        if (slots < 0).all():
            self.batch.set(None)
        else:
            rows = np.repeat(slots, num_scheduled.astype(np.int64))
            self.batch.set(torch.from_numpy(rows))  # `set` moves what it needs to the device
        return errors

    def capture_rows(self, capture: DecodeCapture) -> np.ndarray | None:
        """The slot of each row of the step `prepare` set (int64, -1 for a base row) for the
        captured decode step, which then has the slots' tables; None: no LoRA row."""
        rows = self.batch.token_slots()
        if rows is not None:
            self.capture_tables.point(capture, self.slots)
        return rows

    def _slot_for(self, lora: LoRARequest, needed: set[str]) -> int:
        identity = lora.identity
        slot = self._slot_of.get(identity)
        if slot is not None:
            self._slot_of.move_to_end(identity)
            return slot
        adapter = self._adapter(lora)
        if len(self._slot_of) < self.config.max_loras:
            used = set(self._slot_of.values())
            slot = next(s for s in range(self.config.max_loras) if s not in used)
        else:
            victim = next((k for k in self._slot_of if k not in needed), None)
            if victim is None:  # the scheduler keeps a step within the slots
                raise RuntimeError(f"more than --max-loras {self.config.max_loras} adapters "
                                   "in one step")
            slot = self._slot_of.pop(victim)
            self.slots.clear(slot)
        self.slots.load(slot, adapter)
        self._slot_of[identity] = slot
        return slot

    def _adapter(self, lora: LoRARequest) -> LoRAAdapter:
        identity = lora.identity
        adapter = self._in_memory.get(identity)
        if adapter is not None:
            self._in_memory.move_to_end(identity)
            return adapter
        config = read_adapter_config(lora.lora_path, max_lora_rank=self.config.max_lora_rank)
        adapter = load_adapter(config, self.model_config)
        logger.info("LoRA adapter %s read from %s", lora.lora_name, lora.lora_path)
        self._in_memory[identity] = adapter
        while len(self._in_memory) > self.config.max_cpu_loras:
            self._in_memory.popitem(last=False)
        return adapter
