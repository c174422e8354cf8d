"""EAGLE heads (issue 41, items 1, 7, 8): the head's configuration checked against the
target; the drafts the runner proposes equal a plain-torch EAGLE head's over transformers'
hidden states (through a chunked prefill, an accepted run and a rejection); greedy output
with an EAGLE-3 / EAGLE-1 head equals greedy output without speculation."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ringserve import SamplingParams
from ringserve.config import ModelConfig
from ringserve.engine.arg_utils import EngineArgs
from ringserve.errors import ModelDirectoryError
from ringserve.gpu.runner.model_runner import ModelRunner
from ringserve.gpu.spec_decode.config import resolve_speculative_config
from ringserve.gpu.spec_decode.testing import tiny_eagle_head
from ringserve.gpu.testing import tiny_model
from ringserve.gpu.wire import CachedRequestData, NewRequestData, SchedulerOutput

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eagle_reference import ReferenceHead

K = 3
AUX = [0, 1, 1]  # the tiny targets have 2 layers: vLLM's default (2, L // 2, L - 3) is not there


@pytest.fixture(scope="module")
def target_dir() -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def target(target_dir: Path) -> ModelConfig:
    return ModelConfig.from_model_dir(str(target_dir), device="cpu")


def _spec(method: str, head: Path, **extra: Any) -> dict[str, Any]:
    return {"method": method, "model": str(head), "num_speculative_tokens": K, **extra}


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_head_resolves(method: str, target: ModelConfig, target_dir: Path,
                       tmp_path: Path) -> None:
    head = tiny_eagle_head(target_dir, tmp_path / "h", method=method, aux_layer_ids=AUX)
    spec = resolve_speculative_config(_spec(method, head), target=target,
                                      tensor_parallel_size=1)
    assert spec is not None and spec.method == method and spec.uses_draft_model
    assert spec.draft_head_dir == str(head) and spec.draft_model_config is None


def test_missing_head_is_a_model_directory_error(target: ModelConfig, tmp_path: Path) -> None:
    with pytest.raises(ModelDirectoryError, match=r"^speculative_config\.model: .*not a dir"):
        resolve_speculative_config(_spec("eagle3", tmp_path / "nope"), target=target,
                                   tensor_parallel_size=1)


def test_pickled_head_is_refused_naming_the_file(target: ModelConfig, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelDirectoryError, match=r"pytorch_model\.bin"):
        resolve_speculative_config(_spec("eagle3", tmp_path), target=target,
                                   tensor_parallel_size=1)


def _edit(head: Path, **changes: Any) -> None:
    config = json.loads((head / "config.json").read_text())
    config.update(changes)
    (head / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("changes", "needle"), [
    ({"hidden_size": 128}, "hidden_size is 128"),
    ({"target_hidden_size": 32}, "target_hidden_size is 32"),
    ({"vocab_size": 100}, "vocab_size is 100"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}}, "target layers"),
    ({"eagle_config": {}}, r"default layers \(2, L // 2, L - 3\)"),
    ({"architectures": ["LlamaForCausalLM"]}, "EAGLE-3 head names an Eagle3"),
    ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state: false"),
])
def test_head_that_does_not_fit_names_the_reason(changes: dict[str, Any], needle: str,
                                                 target: ModelConfig, target_dir: Path,
                                                 tmp_path: Path) -> None:
    head = tiny_eagle_head(target_dir, tmp_path / "h", aux_layer_ids=AUX)
    _edit(head, **changes)
    with pytest.raises(ValueError, match=needle) as info:
        resolve_speculative_config(_spec("eagle3", head), target=target, tensor_parallel_size=1)
    assert str(info.value).startswith("speculative_config.")


def test_eagle3_head_under_method_eagle_is_refused(target: ModelConfig, target_dir: Path,
                                                   tmp_path: Path) -> None:
    head = tiny_eagle_head(target_dir, tmp_path / "h", aux_layer_ids=AUX)
    with pytest.raises(ValueError, match="use method 'eagle3'"):
        resolve_speculative_config(_spec("eagle", head), target=target, tensor_parallel_size=1)


@pytest.mark.parametrize("key", ["quantization", "max_model_len", "prompt_lookup_max"])
def test_keys_an_eagle_head_does_not_use_are_refused(key: str, target: ModelConfig,
                                                     target_dir: Path, tmp_path: Path) -> None:
    head = tiny_eagle_head(target_dir, tmp_path / "h", aux_layer_ids=AUX)
    value = {"quantization": "int4", "max_model_len": 64, "prompt_lookup_max": 3}[key]
    with pytest.raises(ValueError, match=rf"^speculative_config\.{key}: not used by method"):
        resolve_speculative_config(_spec("eagle3", head, **{key: value}), target=target,
                                   tensor_parallel_size=1)


# -- the drafts against a reference head -----------------------------------------------------


def _runner(target_dir: Path, spec: dict[str, Any]) -> ModelRunner:
    config = EngineArgs(model=str(target_dir), block_size=8, max_num_seqs=4,
                        max_model_len=256, device="cpu",
                        speculative_config=spec).create_engine_config()
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(64)
    return runner


@pytest.mark.parametrize(("method", "options"), [
    ("eagle3", {}), ("eagle3", {"draft_vocab_size": None, "num_layers": 2}),
    ("eagle", {}), ("eagle", {"own_embedding": True}),
])
def test_drafts_equal_the_reference_head(method: str, options: dict[str, Any], target_dir: Path,
                                         tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    head = tiny_eagle_head(target_dir, tmp_path / "h", method=method, aux_layer_ids=AUX,
                           **options)
    hf = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    reference = ReferenceHead(head, hf, method)
    runner = _runner(target_dir, _spec(method, head))
    assert runner.capture is not None, runner.capture_reason  # decodes and verify steps
    prompt = torch.randint(3, 8000, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0]
    truth = greedy[len(prompt):].tolist()
    blocks = list(range(1, 9))
    params = SamplingParams(temperature=0.0)

    def step(step_id: int, computed: int, count: int, drafts: list[int] | None = None,
             new: bool = False) -> Any:
        so = SchedulerOutput(
            step_id, [NewRequestData("r", prompt, params, blocks, 0)] if new else [],
            [] if new else [CachedRequestData("r", computed)], {"r": count}, count,
            spec_token_ids={"r": drafts} if drafts else {}, num_spec_tokens=K)
        out = runner.execute_model(so)
        assert out is not None and not out.request_errors
        return out

    # A chunked prefill: the first chunk samples nothing and proposes nothing.
    out = step(1, 0, 8, new=True)
    assert not out.draft_token_ids
    out = step(2, 8, len(prompt) - 8)
    assert out.sampled_token_ids == [[truth[0]]]
    tokens = [*prompt, truth[0]]
    assert out.draft_token_ids["r"] == reference.drafts(tokens, K)
    # A verify step whose first two drafts are right and whose third is wrong.
    wrong = (truth[3] + 1) % 8000
    out = step(3, len(prompt), 1 + K, drafts=[truth[1], truth[2], wrong])
    assert out.sampled_token_ids == [[truth[1], truth[2], truth[3]]]
    tokens = [*prompt, *truth[:4]]
    assert out.draft_token_ids["r"] == reference.drafts(tokens, K)
    # Everything rejected: one token, and the drafts after it.
    out = step(4, len(tokens) - 1, 1 + K, drafts=[(truth[4] + 1) % 8000] * K)
    assert out.sampled_token_ids == [[truth[4]]]
    assert out.draft_token_ids["r"] == reference.drafts([*tokens, truth[4]], K)
    assert np.all(runner.table.num_tokens[runner.table.slot_of("r")] == len(tokens) + 1)


def test_captured_step_keeps_the_layer_inputs_an_eager_forward_keeps(
        target_dir: Path, tmp_path: Path) -> None:
    from ringserve.gpu.runner.input_prep import prepare_inputs

    head = tiny_eagle_head(target_dir, tmp_path / "h", aux_layer_ids=AUX)
    runner = _runner(target_dir, _spec("eagle3", head))
    assert runner.capture is not None, runner.capture_reason
    prompt = list(range(40, 61))
    so = SchedulerOutput(1, [NewRequestData("r", prompt, SamplingParams(temperature=0.0),
                                            list(range(1, 9)), 0)], [], {"r": 21}, 21)
    runner.execute_model(so)
    table = runner.table
    table.num_computed[table.slot_of("r")] = len(prompt)
    inputs = prepare_inputs(table, ["r"], np.array([1]), runner.device)
    layers = (1, 0, 1)
    hidden, kept = runner.capture.run_keeping(inputs, 0, layers)
    stack = runner.model.model
    stack.aux_layers = layers
    try:
        want = runner.model.forward(inputs.input_ids, inputs.positions, runner.kv_caches,
                                    inputs.meta)
    finally:
        stack.aux_layers = ()
    assert kept is not None and kept.shape == (1, 3 * want.shape[1])
    torch.testing.assert_close(kept, torch.cat(stack.aux_hidden, dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, want, rtol=1e-5, atol=1e-5)


# -- greedy output with and without a head ---------------------------------------------------


PROMPTS = ["a b c d e f g h i j k l m n o p q r s t", "one two three four five " * 4,
           "Hello there, how are you today?"]


def _greedy_with_and_without_heads(model: Path, engine: dict[str, Any],
                                   tmp_path: Path) -> None:
    """Greedy tokens with an EAGLE-3 head and with an EAGLE-1 head equal those without, and
    each head's drafts were verified."""
    from ringserve.engine.frontend.llm import LLM

    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    pinned = {"num_speculative_tokens_per_batch_size": [[1, 8, K]]}
    runs: dict[str, list[list[int]]] = {}
    for mode in ("off", "eagle3", "eagle"):
        args = dict(engine)
        if mode != "off":
            head = tiny_eagle_head(model, tmp_path / mode, method=mode, aux_layer_ids=AUX)
            args["speculative_config"] = _spec(mode, head, **pinned)
        with LLM(str(model), **args) as llm:
            runs[mode] = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy)]
            drafts = sum(m.value for m in llm.get_metrics()  # type: ignore[attr-defined]
                         if m.name == "ringserve:spec_decode_num_draft_tokens")
        assert mode == "off" or drafts > 0, f"{mode}: no draft was verified"
    assert runs["eagle3"] == runs["off"]
    assert runs["eagle"] == runs["off"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3moe"])
def test_greedy_equal_with_an_eagle_head(family: str, tmp_path: Path) -> None:
    """Chunked prefill (16-token steps) and decodes, one head of each type."""
    _greedy_with_and_without_heads(
        tiny_model(family), {"device": "cpu", "kv_cache_memory": 16 << 20, "max_num_seqs": 8,
                             "max_num_batched_tokens": 16}, tmp_path)


@pytest.mark.slow
def test_greedy_equal_with_eagle_heads_at_tensor_parallel_2(tmp_path: Path) -> None:
    """Both head types over a TP = 2 target (the head runs whole on each rank; the target's
    vocabulary-parallel embedding and LM head are shared)."""
    _greedy_with_and_without_heads(
        tiny_model("qwen2"), {"device": "cpu", "kv_cache_memory": 16 << 20, "max_num_seqs": 8,
                              "tensor_parallel_size": 2}, tmp_path)
