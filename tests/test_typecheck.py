"""Strict field types at construction: what the wire's decoder would refuse fails at once."""

from __future__ import annotations

import msgspec
import pytest

from ringserve import RequestOutputKind, SamplingParams
from ringserve.engine.wire import EngineCoreRequest
from ringserve.serial import MsgpackDecoder, MsgpackEncoder
from ringserve.typecheck import check_fields, check_value


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": 100.0}, r"SamplingParams\.max_tokens: expected an int or None, got float"),
    ({"n": True}, r"SamplingParams\.n: expected an int, got bool"),
    ({"ignore_eos": 1}, r"SamplingParams\.ignore_eos: expected a bool"),
    ({"temperature": "0.5"}, r"SamplingParams\.temperature: expected a float"),
    ({"stop": [1]}, r"SamplingParams\.stop\[0\]: expected a str"),
    ({"stop_token_ids": [2, 3.0]}, r"SamplingParams\.stop_token_ids\[1\]: expected an int"),
    ({"logit_bias": {"5": 1.0}}, r"SamplingParams\.logit_bias key: expected an int"),
    ({"seed": 1.5}, r"SamplingParams\.seed: expected an int or None"),
    ({"output_kind": 7}, r"SamplingParams\.output_kind: expected a RequestOutputKind"),
])
def test_sampling_params_refuse_what_the_wire_refuses(kwargs: dict[str, object],
                                                      message: str) -> None:
    with pytest.raises(TypeError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_values_the_wire_takes_are_kept() -> None:
    params = SamplingParams(temperature=1, top_p=1, output_kind=1,  # type: ignore[arg-type]
                            stop=("a", "b"), logit_bias={3: 2})
    assert params.output_kind is RequestOutputKind.DELTA
    wire = MsgpackDecoder(SamplingParams).decode(MsgpackEncoder().encode(params))
    assert wire.output_kind is RequestOutputKind.DELTA and wire.stop == ["a", "b"]


def test_every_accepted_struct_decodes_strictly() -> None:
    """What check_fields passes, the strict decoder takes (the property the check exists for)."""
    request = EngineCoreRequest("r", [1, 2], SamplingParams(max_tokens=3), 1.0,
                                cache_salt="s")
    check_fields(request)
    body = MsgpackEncoder().encode(request)
    assert MsgpackDecoder(EngineCoreRequest).decode(body) == request
    bad = EngineCoreRequest("r", [1, 2.0], SamplingParams(), 1.0)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"EngineCoreRequest\.prompt_token_ids\[1\]"):
        check_fields(bad)
    with pytest.raises(msgspec.ValidationError):
        MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(bad))


def test_check_value_names_the_path() -> None:
    assert check_value(None, str | None, "cache_salt") is None
    with pytest.raises(TypeError, match="cache_salt: expected a str or None, got int 5"):
        check_value(5, str | None, "cache_salt")
