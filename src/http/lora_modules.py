"""`--lora-modules`: the LoRA adapters a server serves by name (vLLM's flag and forms).

Each value is `name=path` or a JSON object `{"name": ..., "path": ..., "base_model_name":
...}`. The adapters are numbered in order (their `lora_int_id`), and each one's
`adapter_config.json` is read and checked at start-up (`ringserve.gpu.lora.adapter_config`),
so a missing file, an unsupported field or a rank above `--max-lora-rank` is one line and
exit 1 before anything starts. A request selects an adapter with its `model` field
(`AppContext.lora_for`); `/v1/models` lists them under the base model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from ringserve.config import LoRAConfig
from ringserve.errors import ModelDirectoryError
from ringserve.lora_request import LoRARequest

__all__ = ["parse_lora_modules"]


def parse_lora_modules(values: Sequence[str] | None, lora: LoRAConfig | None,
                       served_names: Sequence[str]) -> tuple[LoRARequest, ...]:
    """The adapters of `--lora-modules`, checked.

    Raises:
        ValueError: a malformed value, a repeated name, a name that is a served model name,
            or adapters without `--enable-lora` (naming `--lora-modules`).
        ModelDirectoryError: an adapter's files are missing or cannot be served (naming the
            file or field).
    """
    if not values:
        return ()
    if lora is None:
        raise ValueError("--lora-modules: adapters need --enable-lora")
    adapters: list[LoRARequest] = []
    for index, value in enumerate(values, start=1):
        name, path, base = _one(value)
        if name in served_names:
            raise ValueError(f"--lora-modules: {name!r} is the base model's served name; give "
                             "the adapter another name")
        if any(a.lora_name == name for a in adapters):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        from ringserve.gpu.lora.adapter_config import read_adapter_config

        try:
            read_adapter_config(path, max_lora_rank=lora.max_lora_rank)
        except ValueError as exc:
            raise ModelDirectoryError(f"--lora-modules {name}: {exc}") from None
        adapters.append(LoRARequest(name, index, path, base))
    return tuple(adapters)


def _one(value: str) -> tuple[str, str, str | None]:
    """(name, path, base model name) of one `--lora-modules` value."""
    text = value.strip()
    if text.startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules: {value!r} is not JSON ({exc.msg}); allowed: "
                             'name=path or {"name": ..., "path": ...}') from None
        if not isinstance(item, dict):
            raise ValueError(f"--lora-modules: {value!r}: expected a JSON object")
        unknown = set(item) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"--lora-modules: unknown keys {sorted(unknown)} (allowed: name, "
                             "path, base_model_name)")
        name, path, base = item.get("name"), item.get("path"), item.get("base_model_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules: {value!r} needs a non-empty name and path")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules: {value!r}: base_model_name must be a string")
        return name, path, base
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {value!r}: allowed: name=path or a JSON object "
                         '{"name": ..., "path": ..., "base_model_name": ...}')
    return name, path, None
