"""Mixture-of-experts models through the whole engine: a trainer's weights (transformers 5
holds the experts stacked, `mlp.experts.gate_up_proj` / `down_proj`) pushed into a Qwen3-MoE
engine give transformers' tokens with the new weights, the expert panels rewritten in place;
weight-only int8 / int4 experts; and the loader's errors for a broken MoE checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_weight_sync import ENGINE, _check_matches, _train_step
from transformers import AutoModelForCausalLM

from ringserve import SamplingParams
from ringserve.config import ModelConfig
from ringserve.engine.frontend.llm import LLM
from ringserve.errors import ModelDirectoryError
from ringserve.gpu.attention.backend import TorchAttentionBackend
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.testing import tiny_model
from ringserve.gpu.weights.loader import load_model
from ringserve.weight_transfer import ModuleWeightSource, TrainerWeightTransferEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
PROMPTS = [{"prompt_token_ids": [5, 17, 42, 99, 7]}, {"prompt_token_ids": [300, 301, 302]}]


@pytest.mark.slow
def test_trainer_pushes_stacked_expert_weights() -> None:
    model_dir = tiny_model("qwen3moe")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with LLM(str(model_dir), weight_transfer_config={"backend": "shm"}, **ENGINE) as llm, \
            TrainerWeightTransferEngine({"backend": "shm"}, llm) as trainer:
        _check_matches(llm, model, None)
        before = llm.collective_rpc("get_weight_checksum")
        trainer.trainer_init(ModuleWeightSource(model))
        _train_step(model, opt)
        model.eval()
        trainer.send_weights("1")
        assert llm.collective_rpc("get_weight_checksum") != before
        _check_matches(llm, model, "1")


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_experts_stay_close_to_float(quantization: str) -> None:
    model_dir = tiny_model("qwen3moe")
    runs = {}
    for q in (None, quantization):
        with LLM(str(model_dir), quantization=q, **ENGINE) as llm:
            runs[q] = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for ref, got in zip(runs[None], runs[quantization], strict=True):
        want, ours = ref.outputs[0], got.outputs[0]
        assert ours.token_ids[0] == want.token_ids[0]
        # The first token's logprob, same position and token on both sides.
        first = want.token_ids[0]
        diff = abs(ours.logprobs[0][first].logprob - want.logprobs[0][first].logprob)
        assert diff < (0.05 if quantization == "int8" else 0.3), diff


def _broken_copy(tmp_path: Path, edit: str) -> Path:
    target = tmp_path / "model"
    shutil.copytree(tiny_model("qwen3moe"), target)
    tensors = load_file(str(target / "model.safetensors"))
    if edit == "missing":
        del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    elif edit == "shape":
        name = "model.layers.0.mlp.experts.1.down_proj.weight"
        tensors[name] = tensors[name][:, :-1].contiguous()
    elif edit == "unknown":
        tensors["model.layers.1.mlp.experts.0.gate_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, str(target / "model.safetensors"))
    return target


@pytest.mark.parametrize(("edit", "message"), [
    ("missing", r"lacks 1 expert tensors, e\.g\. \['model\.layers\.2\.mlp\.experts\.5\.up_proj'\]"),
    ("shape", r"experts\.1\.down_proj\.weight"),
    ("unknown", r"layers\.1\.mlp\.experts\.0\.gate_proj\.weight.*matches no parameter"),
])
def test_broken_moe_checkpoint_names_the_tensor(tmp_path: Path, edit: str, message: str) -> None:
    config = ModelConfig.from_model_dir(str(_broken_copy(tmp_path, edit)))
    with pytest.raises(ModelDirectoryError, match=message):
        load_model(config, tp=TPGroup(), device=torch.device("cpu"),
                   backend=TorchAttentionBackend())


def test_bad_expert_config_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "model"
    shutil.copytree(tiny_model("qwen3moe"), target)
    hf = json.loads((target / "config.json").read_text())
    hf["num_experts_per_tok"] = 9  # more than the 8 experts
    (target / "config.json").write_text(json.dumps(hf))
    config = ModelConfig.from_model_dir(str(target))
    with pytest.raises(ValueError, match="num_experts_per_tok <= num_experts"):
        load_model(config, tp=TPGroup(), device=torch.device("cpu"),
                   backend=TorchAttentionBackend())
