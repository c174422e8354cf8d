"""Incremental detokenizer and stop strings against full decodes of byte-level BPE."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from ringserve import SamplingParams
from ringserve.engine.frontend.detokenizer import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
)
from ringserve.engine.frontend.stop_strings import find_stop_string

TEXT = "naïve café — 你好 👋 and more: 東京 🇫🇷 über"
FAST = SamplingParams()
SLOW = SamplingParams(spaces_between_special_tokens=False)


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def _stream(tok: Any, ids: list[int], params: SamplingParams, chunk: int = 1) -> tuple[str, list[str]]:
    d = IncrementalDetokenizer.for_request(tok, tok("Say:").input_ids, params)
    deltas = []
    for i in range(0, len(ids), chunk):
        d.update(ids[i:i + chunk], False)
        deltas.append(d.text_delta(False))
    deltas.append(d.text_delta(True))
    return "".join(deltas), deltas


def test_paths_are_chosen_by_tokenizer_and_params(tok: Any) -> None:
    assert isinstance(IncrementalDetokenizer.for_request(tok, [], FAST), FastIncrementalDetokenizer)
    assert isinstance(IncrementalDetokenizer.for_request(tok, [], SLOW), SlowIncrementalDetokenizer)
    plain = IncrementalDetokenizer.for_request(tok, [], SamplingParams(detokenize=False))
    plain.update([5, 6], False)
    assert plain.output_text == "" and plain.token_ids == [5, 6]


@pytest.mark.parametrize("params", [FAST, SLOW], ids=["fast", "slow"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_multilingual_stream_equals_full_decode_without_half_characters(
    tok: Any, params: SamplingParams, chunk: int
) -> None:
    ids = tok(TEXT, add_special_tokens=False).input_ids
    text, deltas = _stream(tok, ids, params, chunk)
    assert text == TEXT
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(min_value=5, max_value=7999), min_size=1, max_size=24),
       slow=st.booleans(), chunk=st.integers(min_value=1, max_value=4))
def test_random_token_streams_equal_full_decode(tok: Any, ids: list[int], slow: bool, chunk: int) -> None:
    text, deltas = _stream(tok, ids, SLOW if slow else FAST, chunk)
    full = tok.decode(ids)
    assert text == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


def test_skip_special_tokens(tok: Any) -> None:
    ids = tok("a <|im_end|> b", add_special_tokens=False).input_ids
    assert _stream(tok, ids, FAST)[0] == "a  b"
    assert _stream(tok, ids, SamplingParams(skip_special_tokens=False))[0] == "a <|im_end|> b"


def test_stop_terminated_token_text_is_left_out(tok: Any) -> None:
    ids = tok("hello world", add_special_tokens=False).input_ids
    eos = tok.eos_token_id
    d = IncrementalDetokenizer.for_request(tok, [], SamplingParams(skip_special_tokens=False))
    d.update([*ids, eos], stop_terminated=True)
    assert d.output_text == "hello world"


def _run_stops(tok: Any, text: str, params: SamplingParams, eos_last: bool = False) -> tuple[str, str | None, list[str]]:
    ids = tok(text, add_special_tokens=False).input_ids
    if eos_last:
        ids = [*ids, tok.eos_token_id]
    d = IncrementalDetokenizer.for_request(tok, [], params)
    deltas: list[str] = []
    for n, token in enumerate(ids):
        last = n == len(ids) - 1
        stop = d.update([token], stop_terminated=eos_last and last)
        finished = stop is not None or last
        deltas.append(d.text_delta(finished))
        if stop is not None:
            break
    return "".join(deltas), d.stop_reason, deltas


def test_stop_string_spanning_tokens_truncates(tok: Any) -> None:
    text, reason, deltas = _run_stops(tok, "one two three four", SamplingParams(stop=["three"]))
    assert (text, reason) == ("one two ", "three")
    assert all("thr" not in d for d in deltas)


def test_stop_string_included(tok: Any) -> None:
    params = SamplingParams(stop=["three"], include_stop_str_in_output=True)
    assert _run_stops(tok, "one two three four", params)[:2] == ("one two three", "three")


def test_stop_string_at_start_and_overlapping_stops(tok: Any) -> None:
    assert _run_stops(tok, "abc def", SamplingParams(stop=["ab"]))[:2] == ("", "ab")
    # the earliest match wins, whichever stop string it is
    params = SamplingParams(stop=["cdef", "bcd"])
    assert _run_stops(tok, "xabcdefg", params)[:2] == ("xa", "bcd")


def test_no_stop_before_min_tokens(tok: Any) -> None:
    ids = tok("stop here stop there", add_special_tokens=False).input_ids
    params = SamplingParams(stop=["stop"], min_tokens=4, max_tokens=20)  # "stop" = 3 tokens
    d = IncrementalDetokenizer.for_request(tok, [], params)
    reason = None
    for token in ids:
        reason = d.update([token], False)
        if reason:
            break
    assert reason == "stop"
    assert d.output_text.startswith("stop here ")


def test_stop_string_in_same_step_as_eos(tok: Any) -> None:
    text, reason, _ = _run_stops(tok, "alpha beta", SamplingParams(stop=["beta"]), eos_last=True)
    assert (text, reason) == ("alpha ", "beta")


def test_holdback_released_at_the_end(tok: Any) -> None:
    text, reason, deltas = _run_stops(tok, "the end is near", SamplingParams(stop=["xyz!"]))
    assert text == "the end is near" and reason is None
    assert deltas[-1].endswith("ear")  # the last 3 characters came only at the end


def test_find_stop_string_searches_only_new_text_plus_overlap() -> None:
    assert find_stop_string("abcSTOPxyz", 3, ["STOP"], False) is None  # old match ignored
    assert find_stop_string("abcSTOPxyz", 6, ["STOP"], False) == ("STOP", 3)
    assert find_stop_string("abcSTOP", 1, ["STOP"], True) == ("STOP", 7)
    assert find_stop_string("abc", 2, [], False) is None


@pytest.mark.parametrize("params", [FAST, SLOW], ids=["fast", "slow"])
def test_prompt_ids_that_decode_to_replacement_chars_stay_out_of_the_output(
        tok: Any, params: SamplingParams) -> None:
    """A token-id prompt ending (or a context window starting) inside a multi-byte character
    decodes to U+FFFD; the output must still hold only the generated text (issue 14)."""
    partial = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])][:3]
    out_ids = tok("你好 👋 ok", add_special_tokens=False).input_ids
    expected = tok.decode(out_ids)
    for prompt in ([partial[0]], partial, [*tok("Say:").input_ids, *partial],
                   [*partial, *tok("Say: a b c d e f g").input_ids]):
        d = IncrementalDetokenizer.for_request(tok, prompt, params)
        deltas = []
        for token in out_ids:
            d.update([token], False)
            deltas.append(d.text_delta(False))
        deltas.append(d.text_delta(True))
        assert "".join(deltas).strip() == expected.strip(), prompt
        assert "\ufffd" not in "".join(deltas)
