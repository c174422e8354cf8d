"""Rope variants (ringserve.gpu.layers.rotary) against transformers: inverse frequencies and attention
factors equal `ROPE_INIT_FUNCTIONS` bit for bit, for configs in the old `rope_scaling` form and
in transformers 5's saved `rope_parameters` form; the cos/sin table equals transformers' rotary
embedding, also step by step past the original context for dynamic and longrope; partial rotary
equals Phi-3's; the config readers (su, Phi-3 yarn, Gemma 3 per layer type, errors); and greedy
token parity on a tiny Llama for each type."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_helpers import make_runner
from runner_driver import ToyScheduler

from ringserve.gpu.layers.rotary import RotaryEmbedding, rope_frequencies, rope_parameters
from ringserve.sampling_params import SamplingParams

SHAPE: dict[str, Any] = dict(
    hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
)
SHORT = [1.0 + i / 8 for i in range(8)]
LONG = [2.0 + i for i in range(8)]
CASES: dict[str, dict[str, Any]] = {
    "linear": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 3.0}},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 64}},
    "yarn_no_original": {"rope_theta": 5e5, "rope_scaling": {"type": "yarn", "factor": 4.0}},
    "yarn_mscale": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707,
                                     "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2,
                                     "original_max_position_embeddings": 64}},
    "yarn_attention_factor": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                  "attention_factor": 0.9, "truncate": False,
                                                  "original_max_position_embeddings": 64}},
    "yarn_top_level_original": {"original_max_position_embeddings": 32, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    "longrope": {"rope_scaling": {"rope_type": "longrope", "short_factor": SHORT,
                                  "long_factor": LONG, "original_max_position_embeddings": 64}},
}


def _llama_config(extra: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPE, **json.loads(json.dumps(extra)))  # a copy: HF edits the dicts


def _raw_and_saved(extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The config as a user wrote it, and as transformers 5 saves it (`rope_parameters`)."""
    return {**SHAPE, **extra}, json.loads(_llama_config(extra).to_json_string())


@pytest.mark.parametrize("name", list(CASES))
def test_frequencies_and_attention_factor_equal_transformers(name: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _llama_config(CASES[name])
    hf_type = config.rope_parameters["rope_type"]
    for hf_dict in _raw_and_saved(CASES[name]):
        params = rope_parameters(hf_dict)
        assert params["rope_type"] == hf_type
        for seq_len in (None, 300, 1000):  # longer lengths only matter for dynamic / longrope
            ours, factor = rope_frequencies(params, 16, seq_len=seq_len)
            ref, ref_factor = ROPE_INIT_FUNCTIONS[hf_type](config, None, seq_len=seq_len)
            assert torch.equal(ours, ref), (name, seq_len)
            assert factor == ref_factor, (name, seq_len)


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_phi3_longrope_frequencies_equal_transformers(partial: float) -> None:
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    half = int(16 * partial) // 2
    raw = {**SHAPE, "model_type": "phi3", "max_position_embeddings": 4096,
           "original_max_position_embeddings": 256, "partial_rotary_factor": partial,
           "rope_scaling": {"type": "su", "short_factor": SHORT[:half], "long_factor": LONG[:half],
                            # transformers 5 renames "su" only after its defaults are filled
                            "original_max_position_embeddings": 256}}
    config = Phi3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    assert config.rope_parameters["rope_type"] == "longrope"
    for hf_dict in (raw, json.loads(config.to_json_string())):
        params = rope_parameters(hf_dict)
        for seq_len in (None, 257):
            ours, factor = rope_frequencies(params, 16, seq_len=seq_len)
            ref, ref_factor = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=seq_len)
            assert torch.equal(ours, ref) and factor == ref_factor


@pytest.mark.parametrize("name", ["linear", "dynamic", "llama3", "yarn", "yarn_mscale", "longrope"])
def test_table_equals_llama_rotary_embedding_below_the_original_context(name: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = RotaryEmbedding(16, 256, rope_parameters({**SHAPE, **CASES[name]}))
    cos, sin = LlamaRotaryEmbedding(_llama_config(CASES[name])).forward(
        torch.zeros(1), torch.arange(64)[None])
    assert torch.equal(rotary.cos_sin[0, :64], cos[0]) and torch.equal(rotary.cos_sin[1, :64], sin[0])


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_table_equals_transformers_cached_steps_past_the_original_context(name: str) -> None:
    """transformers' generate: a prefill below the threshold, then one token per step; each
    step's cos/sin (computed for seq_len = position + 1) is the table row of that position."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = RotaryEmbedding(16, 320, rope_parameters({**SHAPE, **CASES[name]}))
    hf = LlamaRotaryEmbedding(_llama_config(CASES[name]))
    cos, _ = hf.forward(torch.zeros(1), torch.arange(40)[None])
    assert torch.equal(rotary.cos_sin[0, :40], cos[0])
    for position in range(40, 320):
        cos, sin = hf.forward(torch.zeros(1), torch.tensor([[position]]))
        assert torch.equal(rotary.cos_sin[0, position], cos[0, 0]), position
        assert torch.equal(rotary.cos_sin[1, position], sin[0, 0]), position


def test_partial_rotary_equals_phi3() -> None:
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    raw = {**SHAPE, "partial_rotary_factor": 0.5, "rope_theta": 5000.0}
    rotary = RotaryEmbedding(16, 64, rope_parameters(raw))
    assert rotary.rotary_dim == 8
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 10, 16, generator=gen), torch.randn(1, 2, 10, 16, generator=gen)
    positions = torch.tensor([0, 3, 9, 17, 31, 32, 40, 50, 62, 63])
    cos, sin = Phi3RotaryEmbedding(Phi3Config(**raw)).forward(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    ours = rotary.rotate(positions, torch.cat((q, k), dim=1)[0].transpose(0, 1))
    assert torch.equal(ours.transpose(0, 1)[None], torch.cat((q_ref, k_ref), dim=1))


def test_gemma3_rope_by_layer_type() -> None:
    from transformers import Gemma3TextConfig

    legacy = {"model_type": "gemma3_text", "max_position_embeddings": 4096, "rope_theta": 1e6,
              "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    hf = Gemma3TextConfig(**{k: v for k, v in legacy.items() if k != "model_type"})
    for raw in (legacy, json.loads(hf.to_json_string())):
        for layer_type, expected in hf.rope_parameters.items():
            ours = rope_parameters(raw, layer_type)
            assert {k: ours[k] for k in expected} == expected, layer_type
        assert rope_parameters(raw) == rope_parameters(raw, "full_attention")
    nested = {"rope_parameters": {"full_attention": {"rope_type": "default"}}}
    with pytest.raises(ValueError, match="no entry for layer type 'sliding_attention'"):
        rope_parameters(nested, "sliding_attention")
    # a flat config has one rope for every layer type (Mistral/Qwen2 sliding layers)
    assert rope_parameters({"rope_theta": 7.0}, "sliding_attention")["rope_theta"] == 7.0


def test_config_readers_and_errors() -> None:
    phi3_yarn = {"model_type": "phi3", "max_position_embeddings": 128,
                 "rope_scaling": {"type": "yarn", "short_factor": SHORT, "long_factor": LONG}}
    assert rope_parameters(phi3_yarn)["rope_type"] == "longrope"
    params = rope_parameters({"rope_parameters": {"rope_type": "default", "rope_theta": 3.0},
                              "rope_theta": 9.0})
    assert params["rope_theta"] == 3.0 and params["partial_rotary_factor"] == 1.0
    with pytest.raises(ValueError, match=r"'mrope' is not supported; supported: default, linear, "
                                         r"dynamic, llama3, yarn, longrope"):
        rope_parameters({"rope_scaling": {"rope_type": "mrope"}})
    with pytest.raises(ValueError, match="'linear' needs factor"):
        rope_parameters({"rope_scaling": {"rope_type": "linear"}})
    with pytest.raises(ValueError, match="short_factor must have 8 entries"):
        RotaryEmbedding(16, 8, rope_parameters({**SHAPE, "rope_scaling": {
            "type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}))


# -- end to end: greedy parity on a tiny Llama -------------------------------------------------

# (config.json changes, prompt length, new tokens): the longrope and dynamic cases cross their
# threshold (32; 16) while generating, so the keys of one sequence switch frequencies mid-way.
E2E: dict[str, tuple[dict[str, Any], int, int]] = {
    "linear": ({"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}, 12, 6),
    "yarn": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                  "original_max_position_embeddings": 64}}, 12, 6),
    "dynamic": ({"max_position_embeddings": 16,
                 "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, 12, 20),
    "longrope": ({"rope_scaling": {"rope_type": "longrope", "short_factor": SHORT,
                                   "long_factor": LONG, "original_max_position_embeddings": 32}},
                 20, 24),
}


def _variant_dir(base: Path, target: Path, changes: dict[str, Any]) -> Path:
    """The tiny Llama with another rope: weights do not depend on it, so only config.json
    changes (much cheaper than building a model and tokenizer per variant)."""
    shutil.copytree(base, target)
    config = json.loads((base / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.slow
@pytest.mark.parametrize("name", list(E2E))
def test_greedy_parity_per_rope_type(name: str, tiny_llama_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    changes, prompt_len, new_tokens = E2E[name]
    model_dir = _variant_dir(tiny_llama_dir, tmp_path / name, changes)
    prompt = torch.randint(3, 8000, (prompt_len,), generator=torch.Generator().manual_seed(1))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == name
    expected = hf.generate(prompt[None], do_sample=False, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens)[0, prompt_len:].tolist()

    sched = ToyScheduler(make_runner(model_dir, num_blocks=16, max_model_len=64), budget=8)
    greedy = SamplingParams(temperature=0.0, min_tokens=new_tokens, max_tokens=new_tokens)
    sched.add("r", prompt.tolist(), greedy, new_tokens)  # budget 8: the prompt is chunked
    assert sched.run()["r"] == expected
