"""A multimodal Gemma 3 checkpoint (`Gemma3ForConditionalGeneration`, the 4B+ published layout)
served as text only: its language model's greedy output equals transformers' multimodal model
on text prompts, token for token; the vision tensors are skipped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from gpu_helpers import make_runner
from runner_driver import ToyScheduler

from ringserve.config import ModelConfig
from ringserve.gpu.testing import tiny_model
from ringserve.sampling_params import SamplingParams

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def multimodal_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma 3 text model wrapped in a Gemma3ForConditionalGeneration with a tiny
    random vision tower, saved as transformers saves one."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        SiglipVisionConfig,
    )

    text_dir = tiny_model("gemma3")
    text_config = AutoConfig.from_pretrained(str(text_dir))
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    # Published Gemma 3 checkpoints tie the LM head to the embedding, at both config levels.
    text_dict = {**text_config.to_dict(), "tie_word_embeddings": True}
    config = Gemma3Config(text_config=text_dict, vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, boi_token_index=3, eoi_token_index=4,
                          image_token_index=5, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    text = AutoModelForCausalLM.from_pretrained(str(text_dir), dtype=torch.float32)
    model.model.language_model.load_state_dict(text.model.state_dict())
    out = tmp_path_factory.mktemp("gemma3mm") / "m"
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (text_dir / name).is_file():
            shutil.copy(text_dir / name, out / name)
    return out


@pytest.mark.slow
def test_multimodal_gemma3_serves_its_language_model(multimodal_dir: Path) -> None:
    from safetensors import safe_open
    from transformers import Gemma3ForConditionalGeneration

    saved = json.loads((multimodal_dir / "config.json").read_text())
    assert saved["architectures"] == ["Gemma3ForConditionalGeneration"]
    with safe_open(str(multimodal_dir / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    # transformers saves the published layout (language_model.model.*, vision_tower.*)
    assert any(n.startswith(("vision_tower.", "model.vision_tower.")) for n in names)  # skipped
    assert any(n.startswith(("language_model.model.layers.", "model.language_model.layers."))
               for n in names)  # renamed
    config = ModelConfig.from_model_dir(str(multimodal_dir))
    assert config.architecture == "Gemma3ForConditionalGeneration"
    hf = Gemma3ForConditionalGeneration.from_pretrained(str(multimodal_dir),
                                                        dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 8000, (n,), generator=gen).tolist() for n in (7, 20)]
    sched = ToyScheduler(make_runner(multimodal_dir), budget=16)
    greedy = SamplingParams(temperature=0.0, min_tokens=NEW_TOKENS, max_tokens=NEW_TOKENS)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, greedy, NEW_TOKENS)
    sched.run()
    for i, prompt in enumerate(prompts):
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS)
        assert sched.done[f"r{i}"].output == out[0, len(prompt):].tolist(), i
