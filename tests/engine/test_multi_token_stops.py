"""Stop strings inside a multi-token step (speculative decoding, issue 41).

With speculative decoding one `EngineCoreOutput` carries several new tokens. Whatever the
chunking, a request must end exactly where the same tokens delivered one per output would have
ended: the same text, token ids, logprobs, cumulative logprob, finish and stop reasons and
completion token count. Each case below runs the output processor once with one token per
output (the reference) and again with the tokens in multi-token chunks laid out so that the
token completing the stop string sits first, in the middle or last in a 5-token chunk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from ringserve import RequestOutputKind, SamplingParams
from ringserve.engine.frontend.detokenizer import IncrementalDetokenizer
from ringserve.engine.frontend.output_processor import OutputProcessor
from ringserve.engine.wire import EngineCoreOutput, EngineCoreRequest, FinishReason, Logprobs
from ringserve.outputs import PositionLogprobs

TEXT = "one two three four five six seven eight nine ten"
SLOW = {"spaces_between_special_tokens": False}  # the convert_tokens_to_string detokenizer


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@dataclass
class Run:
    """What a caller saw of one request, folded over all its outputs."""

    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None
    completion_tokens: int  # what the HTTP layer counts: the outputs' len(token_ids)
    num_generation_tokens: int
    aborted: bool  # the processor asked the core to abort (a stop string ended it first)


def _logprobs(ids: list[int], start: int) -> Logprobs:
    """One row per token: the sampled token and one alternative, float32 values whose sums
    depend on the order they are added in (so a chunk summed at once would differ)."""
    n = len(ids)
    values = [[-0.1 * (start + i + 1), -3.0 - (start + i)] for i in range(n)]
    return Logprobs(np.array([[t, 7] for t in ids], np.int32).reshape(n, 2),
                    np.array(values, np.float32).reshape(n, 2),
                    np.array([(start + i) % 3 + 1 for i in range(n)], np.int32))


def _run(tok: Any, ids: list[int], params: SamplingParams, sizes: list[int],
         end: FinishReason, end_stop: int | None = None) -> Run:
    """Feed `ids` in chunks of `sizes`; the core finishes with `end` on the last chunk."""
    assert sum(sizes) == len(ids)
    proc = OutputProcessor(tok)
    proc.add_request(EngineCoreRequest("r", [0, 5, 6], params, time.time()), None)
    outputs = []
    num_generation_tokens = 0
    aborted = False
    start = 0
    for n, size in enumerate(sizes):
        chunk = ids[start:start + size]
        last = n == len(sizes) - 1
        out = EngineCoreOutput(
            "r", chunk,
            new_logprobs=_logprobs(chunk, start) if params.logprobs is not None else None,
            finish_reason=end if last else None, stop_reason=end_stop if last else None)
        result = proc.process_outputs([out])
        aborted = aborted or result.reqs_to_abort == ["r"]
        for ro in result.request_outputs:
            outputs.append(ro.outputs[0])
            num_generation_tokens = ro.metrics.num_generation_tokens
        start += size
    assert not proc.has_unfinished_requests()
    final = outputs[-1]
    if params.output_kind is RequestOutputKind.DELTA:
        text = "".join(o.text for o in outputs)
        token_ids = [t for o in outputs for t in o.token_ids]
        logprobs = (None if final.logprobs is None
                    else [p for o in outputs for p in (o.logprobs or [])])
        completion_tokens = sum(len(o.token_ids) for o in outputs)
    else:
        text, token_ids, logprobs = final.text, final.token_ids, final.logprobs
        completion_tokens = len(final.token_ids)
    return Run(text, token_ids, logprobs, final.cumulative_logprob, final.finish_reason,
               final.stop_reason, completion_tokens, num_generation_tokens, aborted)


def _layouts(num_ids: int, stop_at: int) -> dict[str, list[int]]:
    """Chunk sizes putting token `stop_at` first, in the middle and last in a 5-token chunk,
    plus steps of 3 and of up to 17 (the largest a speculative step sends)."""
    layouts: dict[str, list[int]] = {}
    for place, pos in (("first", 0), ("middle", 2), ("last", 4)):
        begin = stop_at - pos
        if begin < 0:
            continue
        sizes = [begin] if begin else []
        rest = num_ids - begin
        sizes += [5] * (rest // 5) + ([rest % 5] if rest % 5 else [])
        layouts[place] = sizes
    for step in (3, 17):
        layouts[f"by{step}"] = [step] * (num_ids // step) + ([num_ids % step] if num_ids % step else [])
    return layouts


# name -> (text, sampling params, how the core ends the sequence, expected text one by one,
#          expected stop reason)
CASES: dict[str, tuple[str, dict[str, Any], str, str, int | str | None]] = {
    "stop": (TEXT, {"stop": ["three"]}, "length", "one two ", "three"),
    "stop_included": (TEXT, {"stop": ["three"], "include_stop_str_in_output": True}, "length",
                      "one two three", "three"),
    "long_stop": (TEXT, {"stop": ["two three fo"]}, "length", "one ", "two three fo"),
    "late_stop": (TEXT, {"stop": ["nine"]}, "length", "one two three four five six seven eight ",
                  "nine"),
    "slow_detokenizer": (TEXT, {"stop": ["five"], **SLOW}, "length", "one two three four ",
                         "five"),
    "stop_at_first_token": (TEXT, {"stop": ["on"]}, "length", "", "on"),
    # "stop" (3 tokens) completes at token 3 < min_tokens: only the second one may match.
    "min_tokens": ("stop here stop there and more words", {"stop": ["stop"], "min_tokens": 4},
                   "length", "stop here ", "stop"),
    "min_tokens_reached_exactly": ("stop here stop there and more words",
                                   {"stop": ["stop"], "min_tokens": 3}, "length", "", "stop"),
    # The stop string that completes first wins, not the one that starts first.
    "first_completed_stop": ("xabcdefg hij", {"stop": ["abcdefg", "cd"]}, "length", "xab", "cd"),
    "no_stop_matches": (TEXT, {"stop": ["eleven"]}, "length", TEXT, None),
    "no_stop_strings": (TEXT, {}, "length", TEXT, None),
    # The core ends on EOS (stop_terminated): its text is left out.
    "eos_without_stop": ("alpha beta gamma", {"stop": ["delta"]}, "eos", "alpha beta gamma",
                         None),
    "stop_before_eos": ("alpha beta gamma", {"stop": ["beta"]}, "eos", "alpha ", "beta"),
    "stop_in_eos_text": ("alpha beta", {"stop": ["eos|>"], "include_stop_str_in_output": True,
                                        "skip_special_tokens": False},
                         "eos", "alpha beta<|eos|>", "eos|>"),
    "stop_token_id": ("alpha beta gamma", {"stop": ["zeta"]}, "stop_id", "alpha beta gamm", 69),
}


def _sequence(tok: Any, text: str, end: str) -> tuple[list[int], FinishReason, int | None]:
    ids = list(tok(text, add_special_tokens=False).input_ids)
    if end == "eos":
        return [*ids, tok.eos_token_id], FinishReason.STOP, None
    if end == "stop_id":  # the text's last token plays a stop token id
        return ids, FinishReason.STOP, ids[-1]
    return ids, FinishReason.LENGTH, None


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA],
                         ids=["cumulative", "delta"])
@pytest.mark.parametrize("logprobs", [None, 1], ids=["no_logprobs", "logprobs"])
@pytest.mark.parametrize("case", list(CASES))
def test_multi_token_step_ends_where_one_token_steps_end(
        tok: Any, case: str, logprobs: int | None, kind: RequestOutputKind) -> None:
    text, kwargs, end_kind, expected_text, expected_stop = CASES[case]
    ids, end, end_stop = _sequence(tok, text, end_kind)
    params = SamplingParams(max_tokens=64, logprobs=logprobs, output_kind=kind, **kwargs)
    ref = _run(tok, ids, params, [1] * len(ids), end, end_stop)
    assert (ref.text, ref.stop_reason) == (expected_text, expected_stop)
    assert ref.finish_reason == ("stop" if expected_stop is not None or end_kind != "length"
                                 else "length")
    assert ref.completion_tokens == len(ref.token_ids) == ref.num_generation_tokens
    assert ref.logprobs is None or len(ref.logprobs) == len(ref.token_ids)
    stop_at = len(ref.token_ids) - 1  # the token that ended the request
    assert ref.token_ids == ids[:stop_at + 1]
    for name, sizes in _layouts(len(ids), stop_at).items():
        run = _run(tok, ids, params, sizes, end, end_stop)
        ref_seen = Run(**{**vars(ref), "aborted": run.aborted})
        assert run == ref_seen, name
        # The core is asked to abort only when the stop string ended the request before the
        # core's own last output did.
        in_last_chunk = sum(sizes[:-1]) <= stop_at
        assert run.aborted == (isinstance(ref.stop_reason, str) and not in_last_chunk), name


WORDS = ["one", "two", "three", "ab", "abc", "bcd", "cd", " ", "x", "stop", "é", "你好"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.sampled_from(WORDS), min_size=2, max_size=12),
       stops=st.lists(st.sampled_from(["two", "ab", "bcd", "c", "o t", "stop", "好", "x x"]),
                      min_size=1, max_size=3),
       sizes=st.lists(st.integers(min_value=1, max_value=17), min_size=1, max_size=8),
       min_tokens=st.integers(min_value=0, max_value=6), include=st.booleans(),
       end_kind=st.sampled_from(["length", "eos", "stop_id"]), slow=st.booleans())
def test_random_chunkings_end_where_one_token_steps_end(
        tok: Any, words: list[str], stops: list[str], sizes: list[int], min_tokens: int,
        include: bool, end_kind: str, slow: bool) -> None:
    ids, end, end_stop = _sequence(tok, " ".join(words), end_kind)
    layout: list[int] = []
    for size in sizes * len(ids):  # the drawn sizes, repeated until they cover the sequence
        size = min(size, len(ids) - sum(layout))
        if not size:
            break
        layout.append(size)
    params = SamplingParams(stop=stops, min_tokens=min(min_tokens, 64), max_tokens=64,
                            include_stop_str_in_output=include, logprobs=1,
                            **(SLOW if slow else {}))
    ref = _run(tok, ids, params, [1] * len(ids), end, end_stop)
    run = _run(tok, ids, params, layout, end, end_stop)
    assert run == Run(**{**vars(ref), "aborted": run.aborted})


def test_stop_spans_two_chunks(tok: Any) -> None:
    """"three" is ' thre' + 'e': with 'e' first in its chunk, the stop spans two outputs."""
    ids, end, _ = _sequence(tok, TEXT, "length")
    params = SamplingParams(stop=["three"], logprobs=1)
    stop_at = 5
    assert tok.decode(ids[stop_at - 1:stop_at + 1]) == " three"
    sizes = _layouts(len(ids), stop_at)["first"]
    assert sizes[0] == stop_at
    run = _run(tok, ids, params, sizes, end)
    assert (run.text, run.stop_reason, run.finish_reason) == ("one two ", "three", "stop")
    assert run.token_ids == ids[:stop_at + 1] and run.completion_tokens == stop_at + 1
    assert run.logprobs is not None and len(run.logprobs) == stop_at + 1
    assert run.cumulative_logprob == sum(float(np.float32(-0.1 * (i + 1)))
                                         for i in range(stop_at + 1))


def test_request_metrics_count_only_the_kept_tokens(tok: Any) -> None:
    ids = list(tok(TEXT, add_special_tokens=False).input_ids)
    proc = OutputProcessor(tok)
    proc.add_request(EngineCoreRequest("r", [0, 5, 6], SamplingParams(stop=["three"]),
                                       time.time()), None)
    result = proc.process_outputs([EngineCoreOutput("r", ids[:10])])
    (ro,) = result.request_outputs
    assert ro.outputs[0].token_ids == ids[:6] and ro.metrics.num_generation_tokens == 6
    assert result.reqs_to_abort == ["r"]


@pytest.mark.parametrize("kwargs", [{}, SLOW], ids=["fast", "slow"])
def test_detokenizer_keeps_tokens_up_to_the_stop(tok: Any, kwargs: dict[str, Any]) -> None:
    ids = list(tok(TEXT, add_special_tokens=False).input_ids)
    d = IncrementalDetokenizer.for_request(tok, [], SamplingParams(stop=["three"], **kwargs))
    assert d.update(ids[:3], False) is None
    assert d.update(ids[3:12], False) == "three"
    assert d.token_ids == ids[:6] and d.output_text == "one two "
    assert d.update(ids[12:], False) == "three" and d.token_ids == ids[:6]
