"""OutputProcessor and InputProcessor against fake core outputs and the tiny tokenizer."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from ringserve import EngineArgs, RequestOutputKind, SamplingParams
from ringserve.config import ModelConfig
from ringserve.engine.frontend.input_processor import InputProcessor
from ringserve.engine.frontend.output_processor import OutputProcessor
from ringserve.engine.frontend.parent_request import ParentRequest
from ringserve.engine.wire import EngineCoreOutput, EngineCoreRequest, FinishReason, Logprobs


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def model_config(tiny_llama_dir: Path) -> ModelConfig:
    return EngineArgs(model=str(tiny_llama_dir), device="cpu",
                      max_model_len=64).create_engine_config().model_config


def _req(rid: str, params: SamplingParams, prompt: list[int] | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt or [0, 5, 6], params, time.time())


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False).input_ids)


def test_cumulative_delta_and_final_only(tok: Any) -> None:
    ids = _ids(tok, "hello brave new world")
    proc = OutputProcessor(tok)
    kinds = {"c": RequestOutputKind.CUMULATIVE, "d": RequestOutputKind.DELTA,
             "f": RequestOutputKind.FINAL_ONLY}
    for rid, kind in kinds.items():
        proc.add_request(_req(rid, SamplingParams(output_kind=kind)), "p")
    seen: dict[str, list[str]] = {rid: [] for rid in kinds}
    for n, token in enumerate(ids):
        last = n == len(ids) - 1
        outs = [EngineCoreOutput(rid, [token], finish_reason=FinishReason.LENGTH if last else None)
                for rid in kinds]
        result = proc.process_outputs(outs)
        assert result.reqs_to_abort == []
        for ro in result.request_outputs:
            seen[ro.request_id].append(ro.outputs[0].text)
            assert ro.finished == last
    assert seen["c"][-1] == "hello brave new world" and len(seen["c"]) == len(ids)
    assert "".join(seen["d"]) == "hello brave new world" and len(seen["d"]) == len(ids)
    assert seen["f"] == ["hello brave new world"]
    assert not proc.has_unfinished_requests()


def test_stop_string_truncates_and_asks_core_to_abort(tok: Any) -> None:
    proc = OutputProcessor(tok)
    proc.add_request(_req("r", SamplingParams(stop=["new"])), None)
    ids = _ids(tok, "hello brave new world")
    outputs = []
    for token in ids:
        result = proc.process_outputs([EngineCoreOutput("r", [token])])
        outputs.extend(result.request_outputs)
        if result.reqs_to_abort:
            assert result.reqs_to_abort == ["r"]
            break
    final = outputs[-1]
    assert final.finished and final.outputs[0].text == "hello brave "
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == "new"
    # late outputs for the stopped request are ignored
    assert proc.process_outputs([EngineCoreOutput("r", [5])]).request_outputs == []


def test_eos_finish_reason_passes_through(tok: Any) -> None:
    proc = OutputProcessor(tok)
    proc.add_request(_req("r", SamplingParams(skip_special_tokens=False)), None)
    ids = _ids(tok, "abc")
    res = proc.process_outputs([EngineCoreOutput("r", [*ids, tok.eos_token_id],
                                                 finish_reason=FinishReason.STOP)])
    out = res.request_outputs[0].outputs[0]
    assert out.text == "abc" and out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] == tok.eos_token_id


def test_n_children_merge(tok: Any) -> None:
    params = SamplingParams(n=3, seed=7, output_kind=RequestOutputKind.FINAL_ONLY)
    parent = ParentRequest("p", params)
    assert parent.child_ids == ["0_p", "1_p", "2_p"]
    assert [parent.child_params(i).seed for i in range(3)] == [7, 8, 9]
    proc = OutputProcessor(tok)
    for i, cid in enumerate(parent.child_ids):
        proc.add_request(_req(cid, parent.child_params(i)), "x", parent, i)
    res = proc.process_outputs([EngineCoreOutput("0_p", [10], finish_reason=FinishReason.LENGTH),
                                EngineCoreOutput("1_p", [11])])
    assert res.request_outputs == []
    res = proc.process_outputs([EngineCoreOutput("1_p", [12], finish_reason=FinishReason.LENGTH),
                                EngineCoreOutput("2_p", [13], finish_reason=FinishReason.LENGTH)])
    (ro,) = res.request_outputs
    assert ro.request_id == "p" and ro.finished
    assert [c.index for c in ro.outputs] == [0, 1, 2]
    assert [c.token_ids for c in ro.outputs] == [[10], [11, 12], [13]]
    assert not proc.has_unfinished_requests() and not proc.parent_requests


def test_abort_expands_parent_to_children(tok: Any) -> None:
    parent = ParentRequest("p", SamplingParams(n=2))
    proc = OutputProcessor(tok)
    for i, cid in enumerate(parent.child_ids):
        proc.add_request(_req(cid, parent.child_params(i)), None, parent, i)
    assert proc.abort_requests(["p", "unknown"]) == ["0_p", "1_p"]
    assert not proc.has_unfinished_requests()


def test_logprobs_and_prompt_logprobs(tok: Any) -> None:
    proc = OutputProcessor(tok)
    proc.add_request(_req("r", SamplingParams(logprobs=1, prompt_logprobs=0)), None)
    sampled = Logprobs(np.array([[9, 9, 4]], np.int32), np.array([[-0.5, -0.5, -2.0]], np.float32),
                       np.array([1], np.int32))
    prompt_lp = Logprobs(np.array([[5, 7], [6, 6]], np.int32),
                         np.array([[-3.0, -1.0], [-0.1, -0.1]], np.float32), np.array([4, 1], np.int32))
    res = proc.process_outputs([EngineCoreOutput("r", [9], new_logprobs=sampled,
                                                 new_prompt_logprobs=prompt_lp,
                                                 finish_reason=FinishReason.LENGTH)])
    ro = res.request_outputs[0]
    out = ro.outputs[0]
    assert out.logprobs is not None and list(out.logprobs[0]) == [9]
    assert out.logprobs[0][9].rank == 1 and out.logprobs[0][9].logprob == pytest.approx(-0.5)
    assert out.cumulative_logprob == pytest.approx(-0.5)
    assert ro.prompt_logprobs is not None and ro.prompt_logprobs[0] is None
    assert ro.prompt_logprobs[1] is not None and list(ro.prompt_logprobs[1]) == [5]
    assert ro.prompt_logprobs[1][5].rank == 4


def test_duplicate_request_id_rejected(tok: Any) -> None:
    proc = OutputProcessor(tok)
    proc.add_request(_req("r", SamplingParams()), None)
    with pytest.raises(ValueError, match="already in flight"):
        proc.add_request(_req("r", SamplingParams()), None)


def test_input_processor_tokenizes_and_checks(tok: Any, model_config: ModelConfig) -> None:
    ip = InputProcessor(model_config, tok)
    req, text = ip.process("a", "hello", SamplingParams(max_tokens=4))
    assert text == "hello" and req.prompt_token_ids == list(tok("hello").input_ids)
    req, text = ip.process("b", {"prompt_token_ids": [1, 2, 3], "cache_salt": "s"}, SamplingParams())
    assert text is None and req.prompt_token_ids == [1, 2, 3] and req.cache_salt == "s"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ip.process("c", {"prompt_token_ids": [1, 9000]}, SamplingParams())
    with pytest.raises(ValueError, match="empty prompts"):
        ip.process("d", {"prompt_token_ids": []}, SamplingParams())
    with pytest.raises(ValueError, match="max_model_len is 64"):
        ip.process("e", {"prompt_token_ids": [5] * 64}, SamplingParams())
    with pytest.raises(ValueError, match="logprobs"):
        ip.process("f", "x", SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match="prompt: expected a string"):
        ip.process("g", 42, SamplingParams())  # type: ignore[arg-type]
    # An int64 on the wire: a larger priority used to fail to encode after admission.
    with pytest.raises(ValueError, match=r"priority: got 9223372036854775808"):
        ip.process("h", "x", SamplingParams(), priority=2**63)
    assert ip.process("i", "x", SamplingParams(), priority=-(2**63))[0].priority == -(2**63)
