"""`adapter_model.safetensors` read into deltas on the fused layers (issue 42, items 2 and 6):
offsets and scales, and the refusals naming the module or file. The files are written here in
PEFT's layout (test_lora_parity.py checks PEFT's own files against PEFT's outputs)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from ringserve.config import ModelConfig
from ringserve.gpu.lora.adapter_config import read_adapter_config
from ringserve.gpu.lora.weights import LoRAAdapter, load_adapter
from ringserve.gpu.testing import tiny_model

PREFIX = "base_model.model.model.layers"
# tiny llama: hidden 64, 4 heads of 16 (q 64), 2 KV heads (k, v 32 each), intermediate 128
SHAPES = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (64, 32),
          "self_attn.v_proj": (64, 32), "self_attn.o_proj": (64, 64),
          "mlp.gate_proj": (64, 128), "mlp.up_proj": (64, 128), "mlp.down_proj": (128, 64)}
TARGETS = [module.split(".")[1] for module in SHAPES]


@pytest.fixture(scope="module")
def model_config() -> ModelConfig:
    return ModelConfig.from_model_dir(str(tiny_model("llama")))


def tensors(r: int = 4, layers: int = 2, modules: dict[str, tuple[int, int]] = SHAPES
            ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(layers):
        for module, (fan_in, fan_out) in modules.items():
            name = f"{PREFIX}.{layer}.{module}"
            out[f"{name}.lora_A.weight"] = torch.randn(r, fan_in, generator=gen)
            out[f"{name}.lora_B.weight"] = torch.randn(fan_out, r, generator=gen)
    return out


def write(path: Path, weights: dict[str, torch.Tensor], **config: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    targets = sorted({name.split(".")[-3] for name in weights}) or ["q_proj"]
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 6, "target_modules": targets, **config}))
    save_file(weights, str(path / "adapter_model.safetensors"))
    return path


def load(path: Path, model_config: ModelConfig) -> LoRAAdapter:
    return load_adapter(read_adapter_config(path, max_lora_rank=16), model_config)


def test_parts_land_at_their_fused_offsets(tmp_path: Path, model_config: ModelConfig) -> None:
    weights = tensors()
    adapter = load(write(tmp_path / "a", weights, rank_pattern={"layers.1.mlp.up_proj": 4},
                         alpha_pattern={"v_proj": 2}), model_config)
    assert sorted(adapter.deltas) == [(i, t) for i in (0, 1)
                                      for t in ("down_proj", "gate_up_proj", "o_proj", "qkv_proj")]
    qkv = adapter.deltas[(1, "qkv_proj")]
    assert [(d.offset, d.width) for d in qkv] == [(0, 64), (64, 32), (96, 32)]  # q, k, v
    assert [(d.offset, d.width) for d in adapter.deltas[(0, "gate_up_proj")]] == [(0, 128),
                                                                                  (128, 128)]
    q, _, v = qkv
    assert torch.equal(q.a, weights[f"{PREFIX}.1.self_attn.q_proj.lora_A.weight"])
    assert torch.equal(q.b, weights[f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"] * 1.5)
    assert torch.equal(v.b, weights[f"{PREFIX}.1.self_attn.v_proj.lora_B.weight"] * 0.5)
    assert q.a.dtype == q.b.dtype == torch.float32


def test_half_precision_factors_become_float32(tmp_path: Path, model_config: ModelConfig) -> None:
    weights = {k: v.to(torch.bfloat16) for k, v in tensors(layers=1).items()}
    adapter = load(write(tmp_path / "a", weights), model_config)
    assert all(d.a.dtype == d.b.dtype == torch.float32
               for parts in adapter.deltas.values() for d in parts)


def test_another_base_model_is_refused_naming_the_module(tmp_path: Path,
                                                        model_config: ModelConfig) -> None:
    path = write(tmp_path / "a", tensors(r=8), r=8)
    narrow = dataclasses.replace(model_config, hidden_size=32)
    with pytest.raises(ValueError) as info:
        load(path, narrow)
    assert str(info.value) == ("layers.0.self_attn.q_proj.lora_A: shape [8, 64] does not fit "
                               "this model's q_proj input 32 (an adapter for another base "
                               "model?)")
    fewer_heads = dataclasses.replace(model_config, num_kv_heads=1)
    with pytest.raises(ValueError, match=r"^layers\.0\.self_attn\.k_proj\.lora_B: shape \[32, 8\] "
                                         r"does not fit this model's k_proj output 16"):
        load(path, fewer_heads)
    one_layer = dataclasses.replace(model_config, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"^layers\.1\.mlp\.down_proj: this model has 1 layers"):
        load(path, one_layer)


def test_rank_must_match_the_config(tmp_path: Path, model_config: ModelConfig) -> None:
    path = write(tmp_path / "a", tensors(r=4), rank_pattern={"o_proj": 2})
    with pytest.raises(ValueError, match=r"^layers\.0\.self_attn\.o_proj: lora_A \[4, 64\] and "
                                         r"lora_B \[64, 4\] do not have the rank 2"):
        load(path, model_config)


@pytest.mark.parametrize(("extra", "message"), [
    ({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 8000)},
     "tensor 'base_model.model.model.embed_tokens.lora_embedding_A' is not a LoRA factor of a "
     "decoder layer's projection (LoRA on the embedding or the LM head is not supported)"),
    ({f"{PREFIX}.0.mlp.experts.3.down_proj.lora_A.weight": torch.zeros(4, 128)},
     "(LoRA on mixture-of-experts layers is not supported)"),
    ({f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector": torch.zeros(64)},
     "tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector'"),
    ({f"{PREFIX}.0.mlp.q_proj.lora_A.weight": torch.zeros(4, 64)},
     "layers.0.mlp.q_proj: not a supported LoRA module"),
])
def test_foreign_tensors_are_refused(tmp_path: Path, model_config: ModelConfig,
                                     extra: dict[str, torch.Tensor], message: str) -> None:
    path = write(tmp_path / "a", {**tensors(layers=1), **extra},
                 target_modules=TARGETS)
    with pytest.raises(ValueError, match=r"^adapter_model\.safetensors: ") as info:
        load(path, model_config)
    assert message in str(info.value)


def test_file_and_config_must_agree(tmp_path: Path, model_config: ModelConfig) -> None:
    weights = tensors(layers=1)
    path = write(tmp_path / "a", weights, target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"^adapter_model\.safetensors: layers\.0\.mlp\.down_proj: "
                                         "not in adapter_config.json's target_modules"):
        load(path, model_config)
    del weights[f"{PREFIX}.0.self_attn.v_proj.lora_B.weight"]
    with pytest.raises(ValueError, match=r"^adapter_model\.safetensors: layers\.0\.self_attn\."
                                         "v_proj: lora_B is missing"):
        load(write(tmp_path / "b", weights), model_config)
    with pytest.raises(ValueError, match=r"^adapter_model\.safetensors: holds no LoRA weights"):
        load(write(tmp_path / "c", {}), model_config)


def test_truncated_file_is_named(tmp_path: Path, model_config: ModelConfig) -> None:
    path = write(tmp_path / "a", tensors())
    config = read_adapter_config(path, max_lora_rank=16)
    data = (path / "adapter_model.safetensors").read_bytes()
    (path / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"^adapter_model\.safetensors: cannot be read"):
        load_adapter(config, model_config)
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"^adapter_model\.safetensors: not found"):
        load_adapter(config, model_config)
