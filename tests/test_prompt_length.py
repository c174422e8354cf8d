"""One prompt-length rule (issue 14 item 6): every path that checks a prompt's length agrees.

The rule: a prompt has at least one token and at most `max_model_len - 1`, so at least one
generated token fits. The paths: the frontend's InputProcessor, the HTTP layer's `make_job`
(with and without max_tokens), the scheduler's admission (`RequestLimits`, `check_request`,
`add_request`) and the worker's `validate_request`. Each is tried at `max_model_len - 1`
(accepted) and `max_model_len` (refused), and the engine-side paths give the same message.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from ringserve.config import CacheConfig, ModelConfig, SchedulerConfig
from ringserve.engine.frontend.input_processor import InputProcessor
from ringserve.engine.sched.admission import RequestLimits
from ringserve.engine.sched.scheduler import Scheduler
from ringserve.engine.wire import EngineCoreRequest, FinishReason
from ringserve.gpu.runner.validation import validate_request
from ringserve.http.errors import APIError
from ringserve.http.generation import make_job
from ringserve.http.protocol import SamplingRequest
from ringserve.prompt_length import check_prompt_length, max_prompt_len, prompt_length_problem
from ringserve.sampling_params import SamplingParams

MAX_MODEL_LEN = 32
VOCAB = 100


def _model_config() -> ModelConfig:
    return ModelConfig(
        model="fake", tokenizer="fake", served_model_name="fake",
        architecture="LlamaForCausalLM", dtype="float32", max_model_len=MAX_MODEL_LEN,
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
        num_kv_heads=1, head_dim=8, eos_token_ids=(2,), bos_token_id=None, seed=0,
        max_logprobs=20, hf_config={},
    )


def _scheduler() -> Scheduler:
    # A KV cache and step budget far larger than max_model_len: only the length rule binds.
    return Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4096, max_model_len=MAX_MODEL_LEN),
        CacheConfig(block_size=4, enable_prefix_caching=False),
        1000,
    )


def _limits() -> RequestLimits:
    return RequestLimits(max_model_len=MAX_MODEL_LEN, block_size=4, num_usable_blocks=999,
                         max_num_batched_tokens=4096)


def _input_processor(n: int) -> None:
    InputProcessor(_model_config(), None).process(
        "r", {"prompt_token_ids": [5] * n}, SamplingParams(max_tokens=None)
    )


def _admission(n: int) -> None:
    _limits().check(n)


def _check_request(n: int) -> None:
    _scheduler().check_request(EngineCoreRequest("r", [5] * n, SamplingParams(), time.time()))


def _add_request(n: int) -> None:
    sched = _scheduler()
    sched.add_request(EngineCoreRequest("r", [5] * n, SamplingParams(), time.time()))
    outs = [out for batch in sched.take_pending_outputs().values() for out in batch.outputs]
    if outs:
        [out] = outs
        assert out.finish_reason == FinishReason.ERROR
        raise ValueError(str(out.stop_reason))


def _validate_request(n: int) -> None:
    validate_request([5] * n, SamplingParams(), _model_config())


def _make_job(max_tokens: int | None) -> Callable[[int], None]:
    def run(n: int) -> None:
        try:
            make_job("r", {"prompt_token_ids": [5] * n}, SamplingParams(max_tokens=max_tokens),
                     SamplingRequest(), _model_config())
        except APIError as exc:
            assert exc.status == 400
            raise ValueError(exc.message) from exc
    return run


PATHS: dict[str, Callable[[int], None]] = {
    "input_processor": _input_processor,
    "admission": _admission,
    "check_request": _check_request,
    "add_request": _add_request,
    "validate_request": _validate_request,
    "make_job(max_tokens=None)": _make_job(None),
    "make_job(max_tokens=1)": _make_job(1),
}
ENGINE_PATHS = ("input_processor", "admission", "check_request", "add_request",
                "validate_request")


def test_the_rule() -> None:
    assert max_prompt_len(MAX_MODEL_LEN) == MAX_MODEL_LEN - 1
    assert prompt_length_problem(MAX_MODEL_LEN - 1, MAX_MODEL_LEN) is None
    assert prompt_length_problem(1, MAX_MODEL_LEN) is None
    assert prompt_length_problem(1, 2) is None
    for n in (0, MAX_MODEL_LEN, MAX_MODEL_LEN + 1):
        with pytest.raises(ValueError, match="prompt"):
            check_prompt_length(n, MAX_MODEL_LEN)
    with pytest.raises(ValueError, match=f"at most {MAX_MODEL_LEN - 1}"):
        check_prompt_length(MAX_MODEL_LEN, MAX_MODEL_LEN)
    # max_model_len=1 leaves no room for a prompt at all.
    assert prompt_length_problem(1, 1) is not None


@pytest.mark.parametrize("path", PATHS)
def test_longest_prompt_is_accepted_everywhere(path: str) -> None:
    PATHS[path](MAX_MODEL_LEN - 1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 0])
def test_prompt_without_room_is_refused_everywhere(path: str, n: int) -> None:
    with pytest.raises(ValueError, match=r"prompt|context length"):
        PATHS[path](n)


@pytest.mark.parametrize("n", [MAX_MODEL_LEN, 0])
def test_engine_paths_give_one_message(n: int) -> None:
    messages = set()
    for path in ENGINE_PATHS:
        with pytest.raises(ValueError) as info:
            PATHS[path](n)
        messages.add(str(info.value))
    assert messages == {prompt_length_problem(n, MAX_MODEL_LEN)}
