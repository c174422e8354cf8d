"""Every step's bitmask equals a slow reference (issue 15 item 8): a fresh xgrammar matcher
stepped one token at a time through the tokens the request had when its mask was made, for
a batch mixing constrained and free requests, with async scheduling on and off."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from ringserve import EngineArgs, SamplingParams, StructuredOutputsParams
from ringserve.engine.core.engine_core import EngineCore
from ringserve.engine.structured.backend import allocate_bitmask
from ringserve.engine.structured.xgrammar_backend import XgrammarBackend
from ringserve.engine.wire import EngineCoreRequest
from ringserve.gpu.wire import GrammarOutput

pytestmark = pytest.mark.slow

CONSTRAINTS = {
    "json": StructuredOutputsParams(json={"type": "object", "properties": {
        "n": {"type": "integer"}, "s": {"enum": ["x", "yz"]}}, "required": ["n", "s"]},
        disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=r"(ab|cd){2,4}!"),
    "choice": StructuredOutputsParams(choice=["alpha", "beta", "gamma"]),
}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_step_mask_matches_a_matcher_stepped_by_hand(tiny_llama_dir: Path,
                                                          async_scheduling: bool) -> None:
    config = EngineArgs(model=str(tiny_llama_dir), device="cpu", kv_cache_memory=16 << 20,
                        async_scheduling=async_scheduling,
                        distributed_executor_backend="uni").create_engine_config()
    core = EngineCore(config)
    sent: list[tuple[GrammarOutput, dict[str, int]]] = []
    original = core.executor.sample_tokens

    def record(grammar: GrammarOutput) -> None:
        requests = core.scheduler.requests
        known = {rid: len(requests[rid].all_token_ids) - requests[rid].num_prompt_tokens
                 for rid in grammar.req_ids if rid in requests}
        sent.append((GrammarOutput(grammar.step_id, list(grammar.req_ids),
                                   grammar.bitmask.copy()), known))
        original(grammar)

    core.executor.sample_tokens = record  # type: ignore[method-assign]
    tokens: dict[str, list[int]] = {}
    try:
        for i, (rid, constraint) in enumerate([*CONSTRAINTS.items(), ("free", None)]):
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=40,
                                    structured_outputs=constraint)
            core.add_request(EngineCoreRequest(rid, [5 + i] * (3 + 7 * i), params, time.time()))
        deadline = time.monotonic() + 120
        while core.scheduler.has_unfinished_requests() or core.batch_queue:
            assert time.monotonic() < deadline
            step = core.step_with_batch_queue if async_scheduling else core.step
            outputs, _ = step()
            for batch in (outputs or {}).values():
                for out in batch.outputs:
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if not outputs and core.scheduler.waiting_for_grammar:
                time.sleep(0.005)  # compiling: the busy loop would block on its wake-up
    finally:
        core.shutdown()
    assert sent and all("free" not in g.req_ids for g, _ in sent)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    backend = XgrammarBackend(tokenizer, config.model_config.vocab_size,
                              list(config.model_config.eos_token_ids))
    compiled = {rid: backend.compile(c) for rid, c in CONSTRAINTS.items()}
    checked = 0
    for grammar, known in sent:
        for row, rid in enumerate(grammar.req_ids):
            if rid not in known:
                continue  # finished meanwhile: its row is all-allowed and unused
            matcher = backend.matcher(compiled[rid])
            for token in tokens[rid][:known[rid]]:
                assert matcher.accept_token(token)
            want = allocate_bitmask(1, config.model_config.vocab_size)
            matcher.fill_bitmask(want, 0)
            np.testing.assert_array_equal(grammar.bitmask[row], want[0].numpy())
            checked += 1
    assert checked >= 6
    assert all(rid in tokens for rid in CONSTRAINTS)


