"""SamplingParams: vLLM defaults, range checks that name the field, wire validation."""

from __future__ import annotations

import msgspec
import pytest

from ringserve import RequestOutputKind, SamplingParams, SamplingType
from ringserve.sampling_params import MAX_N
from ringserve.serial import MsgpackDecoder, MsgpackEncoder


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.sampling_type is SamplingType.RANDOM


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("n", 0, "[1, 16384]"),
        ("n", MAX_N + 1, "[1, 16384]"),  # each output is a request: an unbounded n exhausts memory
        ("seed", 2**64, "[-2**63, 2**64)"),  # past the wire's and torch's integers
        ("seed", -(2**63) - 1, "[-2**63, 2**64)"),
        ("temperature", -0.1, ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_k", -2, "-1"),
        ("top_k", 2**31, "[1, 2147483647]"),  # an int32 on the workers: a bigger one faulted them
        ("min_p", 1.5, "[0, 1]"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -2.5, "[-2, 2]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("max_tokens", 0, "[1, 2**63)"),
        ("max_tokens", 2**63, "[1, 2**63)"),  # past int64 it could not be sent to a core
        ("min_tokens", -1, "[0, 2**63)"),
        ("min_tokens", 2**63, "[0, 2**63)"),
        ("logprobs", -2, ">= 0"),
        ("prompt_logprobs", -5, ">= 0"),
        ("stop", ["ok", ""], "non-empty"),
        ("allowed_token_ids", [], "non-empty"),
        ("stop_token_ids", [-1], ">= 0"),
        ("logit_bias", {5: 200.0}, "[-100, 100]"),
    ],
)
def test_each_violation_names_field_value_and_range(field: str, value: object, allowed: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    message = str(info.value)
    assert f"SamplingParams.{field}" in message
    assert repr(value) in message
    assert allowed in message


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match=r"min_tokens.*at most max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_stop_string_becomes_list_and_greedy_type() -> None:
    p = SamplingParams(stop="\n", temperature=0.0, seed=3)
    assert p.stop == ["\n"] and p.stop_strings == ["\n"]
    assert p.sampling_type is SamplingType.GREEDY
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(top_k=-1).top_k == -1  # -1 means disabled, as in vLLM


def test_verify_for_model_caps_logprobs_and_token_ids() -> None:
    SamplingParams(logprobs=20).verify_for_model(vocab_size=100, max_logprobs=20)
    with pytest.raises(ValueError, match=r"SamplingParams.logprobs: got 21.*max_logprobs=20"):
        SamplingParams(logprobs=21).verify_for_model(vocab_size=100, max_logprobs=20)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1).verify_for_model(vocab_size=100, max_logprobs=20)
    SamplingParams(logprobs=-1).verify_for_model(vocab_size=100, max_logprobs=-1)
    with pytest.raises(ValueError, match=r"stop_token_ids.*< vocab size 100"):
        SamplingParams(stop_token_ids=[100]).verify_for_model(vocab_size=100, max_logprobs=20)


def test_clone_revalidates() -> None:
    p = SamplingParams(n=4, seed=1)
    assert p.clone(n=1, seed=2) == SamplingParams(n=1, seed=2)
    with pytest.raises(ValueError, match="temperature"):
        p.clone(temperature=-1.0)


def test_wire_round_trip_and_validation_on_decode() -> None:
    p = SamplingParams(temperature=0.7, top_k=5, stop=["a", "b"], logit_bias={3: -1.5},
                       output_kind=RequestOutputKind.DELTA)
    enc, dec = MsgpackEncoder(), MsgpackDecoder(SamplingParams)
    assert dec.decode(enc.encode(p)) == p
    bad = msgspec.msgpack.encode({"top_p": 0.0})
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        dec.decode(bad)


def test_largest_accepted_integers_still_cross_the_wire() -> None:
    enc, dec = MsgpackEncoder(), MsgpackDecoder(SamplingParams)
    for p in (SamplingParams(n=MAX_N), SamplingParams(top_k=2**31 - 1),
              SamplingParams(seed=2**64 - 1), SamplingParams(seed=-(2**63))):
        assert dec.decode(enc.encode(p)) == p
