"""A model's generation_config.json as request defaults (`--generation-config`), as vLLM does.

`ModelConfig.from_model_dir` reads the model's file (or that of `--generation-config DIR`;
`vllm` reads none) and keeps the sampling fields it sets as `ModelConfig.generation_defaults`,
with `--override-generation-config` over them. The HTTP layer and `LLM` start every request
from these defaults; a field the request sets wins. Only the fields the file sets count:
transformers' own class defaults (top_k 50, ...) are not the model author's choice.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ringserve.errors import ModelDirectoryError

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
SAMPLING_KEYS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
_OVERRIDE_KEYS = (*SAMPLING_KEYS, "max_tokens")
_logged: set[str] = set()


def read_generation_config(directory: Path) -> dict[str, Any]:
    """The JSON object of `directory/generation_config.json` ({} when there is none).

    Raises:
        ModelDirectoryError: the file exists but is not a JSON object.
    """
    path = directory / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelDirectoryError(f"{path}: unreadable: {exc}") from None
    if not isinstance(data, dict):
        raise ModelDirectoryError(f"{path}: not a JSON object")
    return data


def sampling_defaults(gen_dir: Path | None, override: str | dict[str, Any] | None
                      ) -> dict[str, Any]:
    """SamplingParams field -> default, from `gen_dir`'s file with `override` over it.

    Raises:
        ValueError: `override` is not a JSON object of known keys with numeric values.
        ModelDirectoryError: the generation config is unreadable.
    """
    defaults: dict[str, Any] = {}
    if gen_dir is not None:
        for key, value in read_generation_config(gen_dir).items():
            if key in SAMPLING_KEYS and isinstance(value, (int, float)) and not isinstance(
                    value, bool):
                defaults[SAMPLING_KEYS[key]] = value
    for key, value in _parse_override(override).items():
        defaults[SAMPLING_KEYS.get(key, key)] = value
    if defaults:
        text = json.dumps(defaults, sort_keys=True)
        if text not in _logged:  # once per process, however many configs are built
            _logged.add(text)
            logger.info("request defaults from the generation config: %s (a request's own "
                        "values win; --generation-config vllm turns this off)", text)
    return defaults


def _parse_override(override: str | dict[str, Any] | None) -> dict[str, Any]:
    if override is None:
        return {}
    if isinstance(override, str):
        try:
            override = json.loads(override)
        except ValueError as exc:
            raise ValueError(f"override_generation_config: not JSON ({exc})") from None
    if not isinstance(override, dict):
        raise ValueError("override_generation_config: expected a JSON object")
    unknown = sorted(set(override) - set(_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config: unknown keys {unknown}; allowed: "
                         f"{', '.join(_OVERRIDE_KEYS)}")
    for key, value in override.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"override_generation_config.{key}: expected a number, got "
                             f"{value!r}")
    return dict(override)
