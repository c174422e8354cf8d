"""A PEFT LoRA adapter's `adapter_config.json`, read and checked (no torch: the frontend reads
it to refuse a bad adapter before any worker sees it).

`read_adapter_config` checks the directory's files and every field of PEFT's `LoraConfig`
(peft 0.22) against what ringserve applies: plain LoRA (`y += scale * B A x`) on the q / k / v
/ o / gate / up / down projections of the decoder layers, including Phi-3's fused `qkv_proj`
and `gate_up_proj`, with PEFT's per-module `rank_pattern` / `alpha_pattern` and rsLoRA. A
field whose value would change outputs in a way ringserve does not apply is refused naming
the field, never ignored; fields that only matter for training or bookkeeping are accepted.
The weights are read by `ringserve.gpu.lora.weights.load_adapter`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

# The PEFT module names ringserve applies LoRA to (Phi-3's fused projections included).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "qkv_proj", "gate_up_proj")

# Fields that do not change a loaded adapter's outputs: bookkeeping, training-only settings,
# and the configs of initialisations that are only read with their `init_lora_weights` value
# (checked on its own). VeLoRA only changes the backward pass; EVA and the other accepted
# initialisations leave a plain adapter over the unchanged base weights; `exclude_modules`
# leaves the excluded modules out of the weights file, which is what is applied;
# `ensure_weight_tying` only concerns tied `modules_to_save` / embedding targets, refused below.
_INERT_FIELDS = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path",
    "revision", "inference_mode", "lora_dropout", "megatron_core", "runtime_config",
    "qalora_group_size", "loftq_config", "eva_config", "corda_config", "astra_config",
    "lora_ga_config", "velora_config", "exclude_modules", "ensure_weight_tying",
    "r", "lora_alpha", "use_rslora", "target_modules", "rank_pattern", "alpha_pattern",
})

# Initialisations that leave a plain adapter over the base weights as they were.
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "nora", "mica")
# Initialisations that also rewrite the base weights (the adapter only fits the rewritten
# base, unless saved with `path_initial_model_for_weight_conversion`, which saves
# `init_lora_weights: true`).
_BASE_REWRITING_INITS = ("pissa", "corda", "astra", "olora", "loftq", "lora_ga")

# Fields refused when set (truthy), with why.
_REFUSED_WHEN_SET: dict[str, str] = {
    "use_dora": "DoRA adapters are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not supported",
    "lora_bias": "LoRA biases are not supported",
    "modules_to_save": "full replacement modules are not supported yet",
    "layers_to_transform": "adapters on a subset of the layers are not supported",
    "layers_pattern": "adapters on a subset of the layers are not supported",
    "trainable_token_indices": "trainable token embeddings are not supported",
    "target_parameters": "LoRA on parameters (e.g. MoE experts) is not supported",
    "layer_replication": "layer replication is not supported",
    "megatron_config": "Megatron parallel layers are not supported",
    "use_qalora": "QA-LoRA adapters are not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) adapters are not supported",
    "monteclora_config": "MonteCLoRA adapters are not supported",
    "use_bdlora": "block-diagonal LoRA (BD-LoRA) adapters are not supported",
    "arrow_config": "Arrow routing is not supported",
    "kasa_config": "KaSA adapters are not supported",
}


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """A checked PEFT LoRA config.

    Attributes:
        path: the adapter directory.
        r: the default rank.
        lora_alpha: the default alpha.
        use_rslora: scale by alpha / sqrt(r) instead of alpha / r.
        target_modules: the PEFT module names, as the file gives them (a subset of
            `TARGET_MODULES`).
        rank_pattern: per-module ranks, keyed by PEFT's patterns (see `rank_of`).
        alpha_pattern: per-module alphas, keyed likewise.
    """

    path: str
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    def rank_of(self, module_path: str) -> int:
        """The rank of the module at `module_path`, PEFT's key for it (the module's name in
        the transformers model, e.g. "model.layers.3.self_attn.q_proj")."""
        return self.rank_pattern.get(_pattern_key(self.rank_pattern, module_path), self.r)

    def scale_of(self, module_path: str) -> float:
        """The factor B A is multiplied by for the module at `module_path`: alpha / r, or
        alpha / sqrt(r) with rsLoRA, from that module's rank and alpha."""
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module_path),
                                       self.lora_alpha)
        r = self.rank_of(module_path)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    @property
    def max_rank(self) -> int:
        """The largest rank of any module."""
        return max([self.r, *self.rank_pattern.values()])


def _pattern_key(patterns: Iterable[str], module_path: str) -> str:
    """PEFT's `get_pattern_key`: the first key (in the file's order) that, read as a regular
    expression, matches the end of `module_path` at a dot boundary; else `module_path`."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_path):
            return key
    return module_path


def read_adapter_config(path: str | Path, *, max_lora_rank: int) -> AdapterConfig:
    """Read and check the adapter directory `path`.

    Args:
        path: a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`).
        max_lora_rank: the largest rank allowed (`--max-lora-rank`).

    Raises:
        ValueError: a missing file or directory, a pickle-only adapter, or a field ringserve
            does not apply, naming the file or the field.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"adapter directory {str(path)!r} does not exist")
    config_file = directory / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"{CONFIG_FILE}: not found in {str(path)!r}")
    if not (directory / WEIGHTS_FILE).is_file():
        if (directory / PICKLE_FILE).is_file():
            raise ValueError(f"{PICKLE_FILE}: pickle files are not loaded; save the adapter with "
                             f"safe_serialization ({WEIGHTS_FILE})")
        raise ValueError(f"{WEIGHTS_FILE}: not found in {str(path)!r}")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{CONFIG_FILE}: cannot be read ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{CONFIG_FILE}: expected a JSON object")
    return _checked(str(path), raw, max_lora_rank)


def _checked(path: str, raw: Mapping[str, Any], max_lora_rank: int) -> AdapterConfig:
    peft_type = raw.get("peft_type")
    if peft_type != "LORA":
        _refuse("peft_type", f"{peft_type!r}; only LORA adapters are supported")
    task_type = raw.get("task_type")
    if task_type not in (None, "CAUSAL_LM"):
        _refuse("task_type", f"{task_type!r}; only CAUSAL_LM adapters are served")
    if raw.get("bias", "none") != "none":
        _refuse("bias", f"{raw['bias']!r}; only 'none' is supported")
    for name, why in _REFUSED_WHEN_SET.items():
        if _is_set(raw.get(name)):
            _refuse(name, why)
    _check_init(raw.get("init_lora_weights", True))
    for name, value in raw.items():  # fields of another PEFT version
        if name not in _INERT_FIELDS and name not in _REFUSED_WHEN_SET and name not in (
                "bias", "init_lora_weights") and _is_set(value):
            _refuse(name, f"{value!r}: unknown field (ringserve does not know what it changes)")
    r = _rank("r", raw.get("r", 8), max_lora_rank)
    alpha = _number("lora_alpha", raw.get("lora_alpha", 8))
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        _refuse("use_rslora", f"{use_rslora!r} is not true or false")
    rank_pattern = {key: _rank(f"rank_pattern[{key!r}]", value, max_lora_rank)
                    for key, value in _patterns("rank_pattern", raw.get("rank_pattern")).items()}
    alpha_pattern = {key: _number(f"alpha_pattern[{key!r}]", value)
                     for key, value in _patterns("alpha_pattern", raw.get("alpha_pattern")).items()}
    return AdapterConfig(path=path, r=r, lora_alpha=alpha, use_rslora=use_rslora,
                         target_modules=_targets(raw.get("target_modules")),
                         rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)


def _refuse(field: str, why: str) -> NoReturn:
    raise ValueError(f"{CONFIG_FILE}: {field}: {why}")


def _is_set(value: object) -> bool:
    """Whether a field holds something other than its off value (None, false, empty)."""
    return value is not None and value is not False and value != "" and not (
        isinstance(value, (list, dict, tuple)) and not value)


def _check_init(init: object) -> None:
    if isinstance(init, bool):
        return
    if isinstance(init, str):
        name = init.lower()
        if name in _PLAIN_INITS:
            return
        if name.startswith(_BASE_REWRITING_INITS):
            _refuse("init_lora_weights", f"{init!r} rewrites the base weights, which this "
                    "adapter then needs; save it with path_initial_model_for_weight_conversion "
                    "to get a plain LoRA adapter")
    _refuse("init_lora_weights", f"{init!r} is not a known initialisation")


def _rank(field: str, value: object, max_lora_rank: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _refuse(field, f"{value!r} is not a positive integer")
    if value > max_lora_rank:
        _refuse(field, f"{value} is above --max-lora-rank {max_lora_rank}")
    return value


def _number(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _refuse(field, f"{value!r} is not a finite number")
    return float(value)


def _patterns(field: str, value: object) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        _refuse(field, f"{value!r} is not an object")
    for key in value:
        try:
            re.compile(rf"(.*\.)?({key})$")
        except re.error as e:
            _refuse(field, f"key {key!r} is not a valid regular expression ({e})")
    return value


def _targets(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        _refuse("target_modules", f"{value!r}: a regular expression (or 'all-linear') is not "
                f"supported; list the module names ({', '.join(TARGET_MODULES)})")
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        _refuse("target_modules", f"{value!r} is not a non-empty list of module names")
    unknown = [v for v in value if v not in TARGET_MODULES]
    if unknown:
        _refuse("target_modules", f"{', '.join(map(repr, unknown))} not supported; supported: "
                f"{', '.join(TARGET_MODULES)}")
    return tuple(value)
