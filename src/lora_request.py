"""`LoRARequest`: which LoRA adapter a generation request runs under (vLLM's
`vllm.lora.request.LoRARequest`).

Built by the caller (`LLM.generate(..., lora_request=...)`, `AsyncLLM.generate`) or by the HTTP
layer from a request's `model` field (`--lora-modules`); it travels inside `EngineCoreRequest`
to the scheduler (which keeps at most `--max-loras` adapters in a step and keys the prefix
cache by the adapter's identity) and to the workers, which read the adapter from `lora_path`
(`ringserve.gpu.lora`). Validated on construction and whenever decoded from the wire.
"""

from __future__ import annotations

import msgspec

__all__ = ["LoRARequest"]


class LoRARequest(msgspec.Struct, omit_defaults=True, gc=False):
    """An adapter, named and numbered by the caller (vLLM's fields and order).

    Attributes:
        lora_name: the adapter's name (the HTTP `model` that selects it).
        lora_int_id: a number >= 1 unique to this adapter's load: two requests with the same
            id share the adapter's slot and prefix-cache entries; a reload takes a new id.
        lora_path: the PEFT adapter directory (`adapter_config.json`,
            `adapter_model.safetensors`).
        base_model_name: the base model it was trained for (informational, `/v1/models`).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name: got an empty name, allowed: a non-empty "
                             "string")
        if isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id: got {self.lora_int_id!r}, allowed: an "
                             "integer >= 1")
        if not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path: adapter {self.lora_name!r} has no path")

    @property
    def identity(self) -> str:
        """What keys the adapter's prefix-cache entries and its worker slot: its id and path
        (a reload under a new id never reuses the old load's blocks)."""
        return f"{self.lora_int_id}:{self.lora_path}"
