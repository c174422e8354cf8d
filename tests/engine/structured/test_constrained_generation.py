"""Constrained generation end to end (issue 15): the grammar mask makes a random-weight model's
output valid, under async scheduling and without, for n > 1, mixed with free requests, and a
bad or impossible constraint fails alone while the engine keeps serving."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import trio

from ringserve import EngineArgs, RequestOutputKind, SamplingParams, StructuredOutputsParams
from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.engine.frontend.llm import LLM

pytestmark = pytest.mark.slow

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def _params(**constraint: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=120,
                          structured_outputs=StructuredOutputsParams(**constraint))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_constraints_hold_on_a_random_model(tiny_llama_dir: Path, async_scheduling: bool,
                                            ) -> None:
    with LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory=16 << 20,
             async_scheduling=async_scheduling) as llm:
        outs = llm.generate(
            ["Describe a person:", "Pick:", "Digits:", "free text"],
            [_params(json=SCHEMA), _params(choice=["yes", "no", "maybe"]),
             _params(regex=r"[0-9]{3}-[a-z]{2}"), SamplingParams(temperature=0.0, max_tokens=8)],
            use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert texts[1] in ("yes", "no", "maybe")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[2])
    assert len(outs[3].outputs[0].token_ids) == 8  # the free request is not constrained
    for out in (outs[0], outs[1], outs[2]):
        assert out.outputs[0].finish_reason == "stop"  # grammar complete, then EOS


def test_async_and_sync_scheduling_agree(tiny_llama_dir: Path) -> None:
    results = []
    for flag in (True, False):
        with LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory=16 << 20,
                 async_scheduling=flag) as llm:
            outs = llm.generate(["a", "b"], [_params(json=SCHEMA), _params(regex=r"[a-f]{5}")],
                                use_tqdm=False)
            results.append([o.outputs[0].token_ids for o in outs])
    assert results[0] == results[1]


def test_n_children_and_bad_or_impossible_constraints(tiny_llama_dir: Path) -> None:
    with LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory=16 << 20) as llm:
        params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=300,
                                structured_outputs=StructuredOutputsParams(
                                    json=SCHEMA, disable_any_whitespace=True))
        (out,) = llm.generate(["People:"], params, use_tqdm=False)
        for completion in out.outputs:
            jsonschema.validate(json.loads(completion.text), SCHEMA)
        with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
            llm.generate(["x"], _params(regex="(unclosed"), use_tqdm=False)
        with pytest.raises(ValueError, match=r"structured_outputs\.json"):
            llm.generate(["x"], _params(json={"type": "no-such-type"}), use_tqdm=False)
        ok = llm.generate(["x"], _params(choice=["fine"]), use_tqdm=False)
        assert ok[0].outputs[0].text == "fine"


async def test_mixed_batch_on_the_null_model_with_the_rings(tiny_llama_dir: Path) -> None:
    """Half the requests constrained, with the mp executor's rings (the GRAMMAR frame) and
    async scheduling; every constrained output is valid, every free one full length."""
    args = EngineArgs(model=str(tiny_llama_dir), device="cpu", num_gpu_blocks_override=512,
                      distributed_executor_backend="mp")
    async with AsyncLLM.from_engine_args(args, executor="null-mp") as llm:
        texts: dict[int, str] = {}
        lengths: dict[int, int] = {}

        async def one(i: int) -> None:
            params = (_params(json=SCHEMA) if i % 2 else
                      SamplingParams(max_tokens=20, ignore_eos=True))
            params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            async for out in llm.generate({"prompt_token_ids": [5 + i] * 6}, params, f"r{i}"):
                texts[i] = out.outputs[0].text
                lengths[i] = len(out.outputs[0].token_ids)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i in range(16):
                    nursery.start_soon(one, i)
    for i in range(16):
        if i % 2:
            jsonschema.validate(json.loads(texts[i]), SCHEMA)
        else:
            assert lengths[i] == 20


def _pet(kind: dict[str, Any], field: str, value: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"kind": kind, field: value},
            "required": ["kind", field], "additionalProperties": False}


# A discriminated union in pydantic's shape (branches in $defs, a const / one-value enum tag)
# beside a branch of another type: a `oneOf` whose branches exclude each other, so xgrammar
# (which enforces `oneOf` as `anyOf`) enforces it exactly (issue 45 item 6).
PETS: dict[str, Any] = {
    "$defs": {"Cat": _pet({"const": "cat"}, "lives",
                          {"type": "integer", "minimum": 1, "maximum": 9}),
              "Dog": _pet({"enum": ["dog"]}, "name", {"type": "string", "maxLength": 6})},
    "type": "object",
    "properties": {"pets": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"},
                  {"type": "string", "maxLength": 4}]}}},
    "required": ["pets"],
    "additionalProperties": False,
}


def test_discriminated_one_of_holds_on_the_demo_model(demo_model_dir: Path) -> None:
    with LLM(str(demo_model_dir), device="cpu", kv_cache_memory=32 << 20) as llm:
        params = SamplingParams(n=6, temperature=1.0, seed=7, max_tokens=200,
                                structured_outputs=StructuredOutputsParams(
                                    json=PETS, disable_any_whitespace=True))
        (out,) = llm.generate(["My pets:"], params, use_tqdm=False)
        with pytest.raises(ValueError, match=r"structured_outputs\.json: 'oneOf' at #/items"):
            llm.generate(["x"], _params(json={"type": "array", "items": {
                "oneOf": [{"type": "integer"}, {"type": "number"}]}}), use_tqdm=False)
    for completion in out.outputs:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), PETS)  # exactly one branch per pet
