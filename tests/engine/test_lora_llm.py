"""LoRA through the offline `LLM` (issue 42, first part): greedy output under each adapter
equals transformers + PEFT, in one batch that mixes three adapters and base rows, with fewer
slots than adapters, and with the prefix cache kept apart per adapter; bad adapters and LoRA
off are refused before anything is queued."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ringserve import LLM, LoRARequest, SamplingParams
from ringserve.gpu.lora.testing import peft_adapter
from ringserve.gpu.testing import tiny_model

pytestmark = pytest.mark.slow

NEW = 12
PROMPTS = [[5, 17, 99, 342, 7, 88, 1000, 23], [9, 8, 7, 6, 5, 4, 3, 2, 1, 400, 401],
           [300, 301, 302]]


@pytest.fixture(scope="module")
def base() -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    return [peft_adapter(base, root / "a", seed=1),
            peft_adapter(base, root / "b", seed=2, r=4, alpha=8, use_rslora=True,
                         targets=("q_proj", "v_proj", "down_proj")),
            peft_adapter(base, root / "c", seed=3, r=8, rank_pattern={"o_proj": 4},
                         alpha_pattern={"gate_proj": 4})]


def _oracle(base: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                             min_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def expected(base: Path, adapters: list[Path]) -> dict[tuple[int, int], list[int]]:
    """(adapter index or -1, prompt index) -> PEFT's greedy tokens."""
    return {(a, p): _oracle(base, adapters[a] if a >= 0 else None, prompt)
            for a in (-1, 0, 1, 2) for p, prompt in enumerate(PROMPTS)}


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW, ignore_eos=True)


def _requests(adapters: list[Path]) -> list[LoRARequest]:
    return [LoRARequest(name, i + 1, str(path)) for i, (name, path) in
            enumerate(zip(("a", "b", "c"), adapters, strict=True))]


@pytest.fixture(scope="module")
def llm(base: Path) -> Iterator[LLM]:
    with LLM(str(base), enable_lora=True, max_loras=3, max_num_seqs=16) as engine:
        yield engine


def test_mixed_batch_of_three_adapters_and_the_base_matches_peft(
        llm: LLM, adapters: list[Path], expected: dict[tuple[int, int], list[int]]) -> None:
    loras = _requests(adapters)
    cases = [(a, p) for a in (-1, 0, 1, 2) for p in range(len(PROMPTS))]
    prompts = [{"prompt_token_ids": PROMPTS[p]} for _, p in cases]
    outs = llm.generate(prompts, _params(), use_tqdm=False,  # type: ignore[arg-type]
                        lora_request=[loras[a] if a >= 0 else None for a, _ in cases])
    for (a, p), out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == expected[(a, p)], (a, p)
    # vLLM's info gauge: the adapters that ran, under its label names.
    info = [m for m in llm.get_metrics() if m.name == "ringserve:lora_requests_info"]
    assert info and all(m.labels["max_lora"] == "3" for m in info)
    assert any(set(m.labels["running_lora_adapters"].split(",")) == {"a", "b", "c"}
               for m in info), [m.labels for m in info]
    # request_success counts each request under its adapter's name (the base's under its own).
    success = {m.labels["model_name"]: m.value for m in llm.get_metrics()
               if m.name == "ringserve:request_success" and m.labels["finished_reason"] == "length"}
    assert all(success.get(name, 0) >= len(PROMPTS) for name in ("a", "b", "c")), success
    assert any(name not in ("a", "b", "c") and value >= len(PROMPTS)
               for name, value in success.items()), success


def test_the_prefix_cache_is_kept_apart_per_adapter(
        llm: LLM, adapters: list[Path], expected: dict[tuple[int, int], list[int]]) -> None:
    # The same prompt under each adapter in turn: a shared prefix cache would hand the
    # second one the first one's KV.
    loras = _requests(adapters)
    for a in (0, 1, -1, 2, 0):
        out = llm.generate({"prompt_token_ids": PROMPTS[0]}, _params(), use_tqdm=False,
                           lora_request=loras[a] if a >= 0 else None)
        assert out[0].outputs[0].token_ids == expected[(a, 0)], a


def test_one_slot_serves_three_adapters_in_turn(
        base: Path, adapters: list[Path], expected: dict[tuple[int, int], list[int]]) -> None:
    loras = _requests(adapters)
    with LLM(str(base), enable_lora=True, max_loras=1, max_cpu_loras=2) as engine:
        cases = [(a, 1) for a in (0, 1, 2, 0, -1)]
        outs = engine.generate([{"prompt_token_ids": PROMPTS[p]} for _, p in cases],  # type: ignore[misc]
                               _params(), use_tqdm=False,
                               lora_request=[loras[a] if a >= 0 else None for a, _ in cases])
        for (a, p), out in zip(cases, outs, strict=True):
            assert out.outputs[0].token_ids == expected[(a, p)], (a, p)


def test_bad_adapters_are_refused_before_anything_is_queued(
        llm: LLM, base: Path, adapters: list[Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        llm.generate("hi", _params(), use_tqdm=False,
                     lora_request=LoRARequest("gone", 9, str(tmp_path / "missing")))
    big = peft_adapter(base, tmp_path / "big", r=32, alpha=32, targets=("q_proj",))
    with pytest.raises(ValueError, match="--max-lora-rank 16"):
        llm.generate("hi", _params(), use_tqdm=False, lora_request=LoRARequest("big", 10, str(big)))
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((adapters[0] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes(
        (adapters[0] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="use_dora"):
        llm.generate("hi", _params(), use_tqdm=False, lora_request=LoRARequest("d", 11, str(dora)))
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate(["a", "b"], _params(), use_tqdm=False, lora_request=[None])
    assert llm.llm_engine.get_num_unfinished_requests() == 0


def test_lora_off_refuses_an_adapter(base: Path, adapters: list[Path]) -> None:
    with LLM(str(base)) as engine, pytest.raises(ValueError, match="enable_lora"):
        engine.generate("hi", _params(), use_tqdm=False,
                        lora_request=LoRARequest("a", 1, str(adapters[0])))
