"""The wire codec: Structs round-trip, arrays go out of band, unknown types are refused."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import torch

from ringserve.engine.wire import (
    AbortRequests,
    AddRequest,
    CoreInput,
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Logprobs,
    SchedulerStats,
    UtilityCall,
    UtilityOutput,
)
from ringserve.sampling_params import SamplingParams
from ringserve.serial import INLINE_MAX_BYTES, MsgpackDecoder, MsgpackEncoder


def _request() -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id="req-1", prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=8),
        arrival_time=time.time(), priority=2, cache_salt="salt", client_index=1,
    )


def test_engine_core_request_round_trip() -> None:
    req = _request()
    out = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(req))
    assert out == req


def test_core_input_tagged_union() -> None:
    enc, dec = MsgpackEncoder(), MsgpackDecoder(CoreInput)  # type: ignore[arg-type]
    for msg in (AddRequest(_request()), AbortRequests(["a", "b"]),
                UtilityCall(7, "reset_prefix_cache", [1, "x"])):
        assert dec.decode(enc.encode(msg)) == msg


def test_outputs_with_one_mib_array_out_of_band() -> None:
    big = np.arange(1 << 18, dtype=np.int32).reshape(-1, 4)  # exactly 1 MiB
    lp = Logprobs(big, big.astype(np.float32), np.ones(big.shape[0], np.int32))
    outs = EngineCoreOutputs(
        engine_index=1,
        outputs=[EngineCoreOutput(
            "r", [5, 6], new_logprobs=lp, finish_reason=FinishReason.LENGTH,
            events=[EngineCoreEvent(EngineCoreEventType.QUEUED, 1.5)], num_cached_tokens=16,
        )],
        scheduler_stats=SchedulerStats(num_running_reqs=3, kv_cache_usage=0.5),
        timestamp=123.0, utility_output=UtilityOutput(1, result={"ok": True}),
        finished_requests=["r"],
    )
    bufs = MsgpackEncoder().encode(outs)
    assert len(bufs) == 4  # body + three arrays
    assert len(bufs[0]) < 512  # the 1 MiB array is not in the body
    assert memoryview(bufs[1]).nbytes == 1 << 20
    got = MsgpackDecoder(EngineCoreOutputs).decode([bytes(b) for b in bufs])
    got_lp = got.outputs[0].new_logprobs
    assert got_lp is not None
    np.testing.assert_array_equal(got_lp.token_ids, big)
    np.testing.assert_array_equal(got_lp.ranks, lp.ranks)
    assert got.outputs[0].finish_reason is FinishReason.LENGTH
    assert got.outputs[0].finished and str(got.outputs[0].finish_reason) == "length"
    assert got.scheduler_stats == outs.scheduler_stats
    assert got.utility_output == outs.utility_output


def test_small_arrays_stay_inline_and_oob_decode_is_zero_copy() -> None:
    small = np.arange(INLINE_MAX_BYTES // 4, dtype=np.int32)
    assert len(MsgpackEncoder().encode(Logprobs(small, small, small))) == 1
    big = np.arange(4096, dtype=np.float32)
    bufs = MsgpackEncoder().encode(Logprobs(big, big, big))
    backing = [bytes(bufs[0])] + [bytearray(b) for b in bufs[1:]]
    got = MsgpackDecoder(Logprobs).decode(backing)
    backing[1][0:4] = np.float32(42.0).tobytes()
    assert got.token_ids[0] == 42.0  # a view into the frame, not a copy


def test_finish_reason_strings() -> None:
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort", "error", "repetition"]
    assert [int(r) for r in FinishReason] == [0, 1, 2, 3, 4]


def test_torch_tensors_including_bfloat16() -> None:
    class Holder(msgspec.Struct):
        t: torch.Tensor

    enc = MsgpackEncoder()
    for tensor in (torch.randn(3, 300).to(torch.bfloat16), torch.arange(5), torch.empty(0, 2)):
        got = MsgpackDecoder(Holder).decode(enc.encode(Holder(tensor))).t
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got, tensor)


def test_unknown_types_are_refused() -> None:
    class Evil:
        def __reduce__(self) -> tuple[object, ...]:
            return (print, ("pwned",))

    with pytest.raises(TypeError, match=r"cannot encode a value of type .*Evil"):
        MsgpackEncoder().encode({"x": Evil()})
    with pytest.raises(TypeError, match="object arrays"):
        MsgpackEncoder().encode(np.array([object()] * 100, dtype=object))
    bogus = msgspec.msgpack.encode(msgspec.msgpack.Ext(99, b"\x00"))
    with pytest.raises(msgspec.DecodeError, match="unknown extension type 99"):
        MsgpackDecoder(object).decode(bogus)


def test_missing_out_of_band_buffer_is_a_decode_error() -> None:
    big = np.zeros(1024, dtype=np.int64)
    bufs = MsgpackEncoder().encode(Logprobs(big, big, big))
    with pytest.raises(msgspec.DecodeError, match="missing out-of-band buffer"):
        MsgpackDecoder(Logprobs).decode(bufs[:1])


def _array_ext(code: int, dtype: str, shape: list[int], data: bytes = b"", index: int = -1) -> bytes:
    header = msgspec.msgpack.encode([dtype, shape, index, data])
    return msgspec.msgpack.encode([msgspec.msgpack.Ext(code, header)])


@pytest.mark.parametrize("body", [
    _array_ext(1, "float32", [1], b"abc"),            # numpy: size not a multiple of the dtype
    _array_ext(1, "<i4", [2**62]),                    # numpy: cannot reshape
    _array_ext(1, "no-such-dtype", [1], b"abcd"),     # numpy: TypeError
    _array_ext(3, "float32", [1], b"abc"),            # torch: RuntimeError in view()
    _array_ext(3, "float32", [2**40]),                # torch: would allocate 4 TiB
    _array_ext(3, "float32", [-1], b"abcd"),
    b"\x91" * 100_000 + b"\x01",                      # RecursionError inside msgspec
])
def test_every_malformed_message_is_a_msgspec_error(body: bytes) -> None:
    # Callers that drop malformed frames catch msgspec.MsgspecError; nothing else may escape.
    with pytest.raises(msgspec.DecodeError):
        MsgpackDecoder(list[object]).decode(body)
