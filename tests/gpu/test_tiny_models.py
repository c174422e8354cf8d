"""The tiny-model factory: loads in transformers, deterministic, non-ASCII tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from ringserve.gpu.testing import TinyModelSpec, build_model_dir, corpus

TEXT = "naïve café — 你好 👋"


def test_demo_model_loads_and_tokenizer_round_trips(demo_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(demo_model_dir))
    ids = tok(TEXT).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    model = AutoModelForCausalLM.from_pretrained(str(demo_model_dir))
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (256, 4, 8000)
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, len(ids) + 4)


def test_chat_template_and_special_tokens(tiny_llama_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|bos|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    gen = json.loads((tiny_llama_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.parametrize(("fixture", "arch", "marker"), [
    ("tiny_qwen2_dir", "Qwen2ForCausalLM", "self_attn.q_proj.bias"),
    ("tiny_qwen3_dir", "Qwen3ForCausalLM", "self_attn.q_norm.weight"),
    ("tiny_mistral_dir", "MistralForCausalLM", "self_attn.q_proj.weight"),
    ("tiny_gemma2_dir", "Gemma2ForCausalLM", "pre_feedforward_layernorm.weight"),
    ("tiny_gemma3_dir", "Gemma3ForCausalLM", "self_attn.k_norm.weight"),
    ("tiny_phi3_dir", "Phi3ForCausalLM", "self_attn.qkv_proj.weight"),
])
def test_families_have_their_features(
    request: pytest.FixtureRequest, fixture: str, arch: str, marker: str
) -> None:
    path: Path = request.getfixturevalue(fixture)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [arch]
    weights = load_file(str(path / "model.safetensors"))
    assert any(name.endswith(marker) for name in weights)


@pytest.mark.slow
def test_build_is_deterministic(tmp_path: Path) -> None:
    spec = TinyModelSpec(hidden_size=32, num_hidden_layers=1, intermediate_size=64, seed=3)
    a = load_file(str(build_model_dir(tmp_path / "a", spec) / "model.safetensors"))
    b = load_file(str(build_model_dir(tmp_path / "b", spec) / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()


def test_corpus_covers_non_ascii() -> None:
    text = "".join(corpus(0, num_lines=200))
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text)
    assert any(ord(ch) >= 0x1F600 for ch in text)
    assert "é" in text and "ß" in text
    assert corpus(1, num_lines=50) == corpus(1, num_lines=50) != corpus(2, num_lines=50)
