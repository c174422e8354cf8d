"""`adapter_config.json` checks (issue 42, items 2 and 6): PEFT's rank / alpha rules, and every
refusal naming its field or file."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from ringserve.gpu.lora.adapter_config import AdapterConfig, read_adapter_config

# adapter_config.json as peft 0.22 writes it (LoraConfig defaults, seven targets).
PEFT_CONFIG: dict[str, Any] = {
    "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None,
    "astra_config": None, "auto_mapping": None, "base_model_name_or_path": "/models/llama",
    "bias": "none", "corda_config": None, "ensure_weight_tying": False, "eva_config": None,
    "exclude_modules": None, "fan_in_fan_out": False, "inference_mode": True,
    "init_lora_weights": True, "kasa_config": None, "layer_replication": None,
    "layers_pattern": None, "layers_to_transform": None, "loftq_config": {}, "lora_alpha": 16,
    "lora_bias": False, "lora_dropout": 0.05, "lora_ga_config": None, "megatron_config": None,
    "megatron_core": "megatron.core", "modules_to_save": None, "monteclora_config": None,
    "peft_type": "LORA", "peft_version": "0.22.0", "qalora_group_size": 16, "r": 8,
    "rank_pattern": {}, "revision": None,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"],
    "target_parameters": None, "task_type": "CAUSAL_LM", "trainable_token_indices": None,
    "use_bdlora": None, "use_dora": False, "use_qalora": False, "use_rslora": False,
    "velora_config": None,
}


def write(path: Path, overrides: dict[str, Any] | None = None, *, weights: bool = True,
          drop: tuple[str, ...] = ()) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in {**PEFT_CONFIG, **(overrides or {})}.items() if k not in drop}
    (path / "adapter_config.json").write_text(json.dumps(config))
    if weights:
        (path / "adapter_model.safetensors").write_bytes(b"")  # only its presence is read here
    return path


def test_peft_defaults_are_accepted(tmp_path: Path) -> None:
    config = read_adapter_config(write(tmp_path / "a"), max_lora_rank=16)
    assert config == AdapterConfig(
        path=str(tmp_path / "a"), r=8, lora_alpha=16.0, use_rslora=False,
        target_modules=tuple(PEFT_CONFIG["target_modules"]), rank_pattern={}, alpha_pattern={})
    assert config.rank_of("model.layers.0.self_attn.q_proj") == 8
    assert config.scale_of("model.layers.0.self_attn.q_proj") == 2.0
    assert config.max_rank == 8


def test_patterns_follow_peft_rules(tmp_path: Path) -> None:
    """First matching key wins, keys match whole trailing module names (regex), rsLoRA uses
    each module's own rank."""
    config = read_adapter_config(write(tmp_path / "a", {
        "use_rslora": True, "rank_pattern": {"q_proj": 4, r"layers\.1\..*_proj": 2},
        "alpha_pattern": {"model.layers.0.self_attn.o_proj": 5}}), max_lora_rank=16)
    assert config.rank_of("model.layers.0.self_attn.q_proj") == 4
    assert config.rank_of("model.layers.1.self_attn.q_proj") == 4  # "q_proj" comes first
    assert config.rank_of("model.layers.1.mlp.down_proj") == 2
    assert config.rank_of("model.layers.0.mlp.down_proj") == 8
    assert config.rank_of("model.layers.0.self_attn.qq_proj") == 8  # no partial-name match
    assert config.scale_of("model.layers.0.self_attn.o_proj") == 5 / math.sqrt(8)
    assert config.scale_of("model.layers.1.mlp.up_proj") == 16 / math.sqrt(2)
    assert config.max_rank == 8


def test_unknown_fields_at_their_off_value_are_accepted(tmp_path: Path) -> None:
    path = write(tmp_path / "a", {"some_future_option": None, "velora_config": None},
                 drop=("eva_config", "kasa_config"))
    assert read_adapter_config(path, max_lora_rank=8).r == 8


@pytest.mark.parametrize(("overrides", "message"), [
    ({"peft_type": "IA3"}, "adapter_config.json: peft_type: 'IA3'; only LORA"),
    ({"task_type": "SEQ_CLS"}, "task_type: 'SEQ_CLS'"),
    ({"use_dora": True}, "adapter_config.json: use_dora: DoRA adapters are not supported"),
    ({"bias": "all"}, "bias: 'all'; only 'none'"),
    ({"bias": "lora_only"}, "bias: 'lora_only'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save: full replacement modules"),
    ({"layers_to_transform": [0]}, "layers_to_transform:"),
    ({"layers_pattern": "layers"}, "layers_pattern:"),
    ({"target_modules": "q_proj|v_proj"}, "target_modules: 'q_proj|v_proj': a regular expression"),
    ({"target_modules": "all-linear"}, "target_modules: 'all-linear'"),
    ({"target_modules": ["q_proj", "lm_head", "embed_tokens"]},
     "target_modules: 'lm_head', 'embed_tokens' not supported"),
    ({"target_modules": []}, "target_modules: [] is not a non-empty list"),
    ({"r": 32}, "adapter_config.json: r: 32 is above --max-lora-rank 16"),
    ({"r": 0}, "r: 0 is not a positive integer"),
    ({"rank_pattern": {"q_proj": 32}}, "rank_pattern['q_proj']: 32 is above --max-lora-rank 16"),
    ({"rank_pattern": {"q_proj[": 4}}, "rank_pattern: key 'q_proj[' is not a valid regular"),
    ({"alpha_pattern": {"q_proj": "big"}}, "alpha_pattern['q_proj']: 'big' is not a finite"),
    ({"lora_alpha": None}, "lora_alpha: None is not a finite number"),
    ({"use_rslora": "yes"}, "use_rslora: 'yes' is not true or false"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out:"),
    ({"lora_bias": True}, "lora_bias: LoRA biases are not supported"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights: 'pissa' rewrites the base weights"),
    ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights: 'pissa_niter_4' rewrites"),
    ({"init_lora_weights": "loftq"}, "init_lora_weights: 'loftq' rewrites"),
    ({"init_lora_weights": "olora"}, "init_lora_weights: 'olora' rewrites"),
    ({"init_lora_weights": "corda"}, "init_lora_weights: 'corda' rewrites"),
    ({"init_lora_weights": "lora_ga"}, "init_lora_weights: 'lora_ga' rewrites"),
    ({"init_lora_weights": "fancy"}, "init_lora_weights: 'fancy' is not a known"),
    ({"trainable_token_indices": [1, 2]}, "trainable_token_indices:"),
    ({"target_parameters": ["mlp.experts.down_proj"]}, "target_parameters:"),
    ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication:"),
    ({"megatron_config": {"tp": 2}}, "megatron_config:"),
    ({"use_qalora": True}, "use_qalora:"),
    ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens:"),
    ({"monteclora_config": {"n": 1}}, "monteclora_config:"),
    ({"use_bdlora": {"block": 2}}, "use_bdlora:"),
    ({"arrow_config": {"top_k": 2}}, "arrow_config:"),
    ({"kasa_config": {"x": 1}}, "kasa_config:"),
    ({"some_future_option": True}, "some_future_option: True: unknown field"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_refusals_name_the_field(tmp_path: Path, overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=r"^adapter_config\.json: ") as info:
        read_adapter_config(write(tmp_path / "a", overrides), max_lora_rank=16)
    assert message in str(info.value)


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"adapter directory .*nowhere.* does not exist"):
        read_adapter_config(tmp_path / "nowhere", max_lora_rank=16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^adapter_config\.json: not found in"):
        read_adapter_config(tmp_path / "empty", max_lora_rank=16)
    with pytest.raises(ValueError, match=r"^adapter_model\.safetensors: not found in"):
        read_adapter_config(write(tmp_path / "no_weights", weights=False), max_lora_rank=16)
    pickled = write(tmp_path / "pickled", weights=False)
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError) as info:
        read_adapter_config(pickled, max_lora_rank=16)
    assert str(info.value) == (
        "adapter_model.bin: pickle files are not loaded; save the adapter with "
        "safe_serialization (adapter_model.safetensors)")
    broken = write(tmp_path / "broken")
    (broken / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"^adapter_config\.json: cannot be read"):
        read_adapter_config(broken, max_lora_rank=16)
