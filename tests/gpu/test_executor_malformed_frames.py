"""A malformed frame on an executor ring is logged and dropped; the engine core's response
reader and the worker keep serving, and a lost answer surfaces as `FrameLostError`.

The fast tests run the real loops in this process over real rings: the response reader
(`multiproc.serve_responses`, called until its ring is idle) and a worker's `WorkerLoop` (in a
thread, with a fake worker). One slow test sends garbage through the broadcast ring to a real
worker process. The bogus ring headers are written straight into the segment, as a buggy peer
could; `tests/shm/test_shm_ring_validation.py` covers the ring's own checks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
import pytest

from ringserve.engine.arg_utils import EngineArgs
from ringserve.gpu.executor.errors import FrameLostError, WorkerError
from ringserve.gpu.executor.inbound import DropLog, ResponseHandler
from ringserve.gpu.executor.multiproc import serve_responses
from ringserve.gpu.executor.null import NullMultiprocExecutor
from ringserve.gpu.executor.pending import Pending
from ringserve.gpu.executor.wire import (
    FrameKind,
    RpcReply,
    RpcRequest,
    StepError,
    read_buffers,
    write_message,
)
from ringserve.gpu.executor.worker_proc import WorkerLoop
from ringserve.gpu.wire import Logprobs, ModelRunnerOutput, SchedulerOutput
from ringserve.serial import MsgpackDecoder, MsgpackEncoder
from ringserve.shm import CorruptRingError, RingReader, RingWriter, WaitPolicy
from ringserve.shm.frames import frame_span, pack_header

CAPACITY = 1 << 16
PARK = WaitPolicy.forced_park()
C = TypeVar("C", RingReader, RingWriter)
A = TypeVar("A", RingReader, RingWriter)

Payload = list[Any] | bytes  # buffers for write_message, or a raw frame payload


def _encode(message: Any) -> list[Any]:
    return MsgpackEncoder().encode(message)


def _body(message: Any) -> bytes:
    return bytes(_encode(message)[0])


def _output_with_logprobs(step_id: int) -> list[Any]:
    rows = np.zeros((64, 4), dtype=np.float32)  # 1 KiB: travels as an out-of-band buffer
    ids = np.zeros((64, 4), dtype=np.int32)
    return _encode(ModelRunnerOutput(step_id, logprobs=Logprobs(ids, rows, ids[:, 0].copy())))


# (kind, payload, what the logged reason says): each is something no worker sends.
GARBAGE_RESPONSES: list[tuple[int, Payload, str]] = [
    (FrameKind.OUTPUT, [b"\xc1"], "OUTPUT frame"),                               # not msgpack
    (FrameKind.OUTPUT, [_body("hello")], "Expected `array`"),                    # wrong type
    (FrameKind.OUTPUT, [_body(ModelRunnerOutput(1, ["a"], [[5]]))[:-3]], "truncated"),
    (FrameKind.OUTPUT, [msgspec.msgpack.encode([1, [], [], [msgspec.msgpack.Ext(42, b"")] * 3])],
     "unknown extension type 42"),
    (FrameKind.OUTPUT, _output_with_logprobs(1)[:1], "missing out-of-band buffer"),
    (FrameKind.OUTPUT, b"", "no buffer count"),                                  # empty frame
    (FrameKind.OUTPUT, b"\xff\xff\xff\x7f\0\0\0\0", "claims 2147483647 buffers"),
    (FrameKind.OUTPUT, b"\x01\0\0\0\0\0\0\0\xff\0\0\0\0\0\0\0", "overruns the frame"),
    (FrameKind.RPC_REPLY, [_body(ModelRunnerOutput(1))], "RPC_REPLY frame: Expected `int`"),
    (FrameKind.STEP_ERROR, [_body([1, "rank"])], "STEP_ERROR frame"),
    (FrameKind.STEP, [_body(SchedulerOutput(1))], "STEP frame: not a worker's answer"),
    (999, [_body(ModelRunnerOutput(1))], "unknown kind 999 frame: not a worker's answer"),
    (FrameKind.OUTPUT, [_body(ModelRunnerOutput(12345))], "step 12345, which is not in flight"),
    (FrameKind.RPC_REPLY, [_body(RpcReply(1, 7))], "from rank 7, which does not exist"),
]

GARBAGE_REQUESTS: list[tuple[int, Payload, str]] = [
    (FrameKind.STEP, [b"\xc1"], "STEP frame"),
    (FrameKind.STEP, [_body(RpcRequest(1, "ping", (1,)))], "Expected `array`, got `str`"),
    (FrameKind.STEP, [_body(SchedulerOutput(1, num_scheduled_tokens={"a": 1}))[:-2]], "truncated"),
    (FrameKind.STEP, b"", "no buffer count"),
    (FrameKind.RPC, [_body(SchedulerOutput(1))], "RPC frame"),
    (FrameKind.RPC, [msgspec.msgpack.encode([1, "ping", [msgspec.msgpack.Ext(
        1, msgspec.msgpack.encode(["<f4", [1], -1, b"abc"]))]])], "malformed array"),
    (FrameKind.OUTPUT, [_body(ModelRunnerOutput(1))], "OUTPUT frame: not a step, a grammar or a call"),
    (7777, [_body(SchedulerOutput(1))], "unknown kind 7777 frame: not a step, a grammar or a call"),
]


def _write(writer: RingWriter, kind: int, payload: Payload) -> None:
    if isinstance(payload, bytes):
        writer.send(payload, kind=kind)  # a raw frame, not laid out by write_message
    else:
        write_message(writer, kind, payload)  # type: ignore[arg-type]


def _write_bogus_header(writer: RingWriter, kind: int) -> None:
    """A frame whose header claims 1 MiB (call it while no reader looks at the ring)."""
    writer.send(b"\0" * 16, kind=kind)
    at = writer._write - frame_span(16)
    writer._words[writer._data_word + ((at & writer._mask) >> 3)] = pack_header(1 << 20, kind, 0)


def _ring(create: Callable[[], C], attach: Callable[[str], A]) -> tuple[C, A]:
    """A ring whose two ends live in this process (the attach runs in a thread)."""
    end = create()
    attached: list[A] = []
    thread = threading.Thread(target=lambda: attached.append(attach(end.name)))
    thread.start()
    end.wait_attached(10.0)
    thread.join()
    return end, attached[0]


def _wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10.0
    while not condition():
        assert time.monotonic() < deadline, "gave up waiting"
        time.sleep(0.001)


@pytest.fixture(autouse=True)
def no_leftover_segments() -> Iterator[None]:
    yield
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"ringserve-{os.getpid()}-")]


@pytest.fixture
def drops(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, logger="ringserve.gpu.executor.inbound")
    return caplog


def _drop_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "dropped a malformed frame" in r.getMessage()]


# ---- the engine core's response reader ------------------------------------------------------


class ResponseRing:
    """A response ring: the test holds the worker's (writing) end and runs the core's reader."""

    def __init__(self, world_size: int = 1) -> None:
        self.pending = Pending(world_size)
        self.step_errors: list[StepError] = []
        self.handler = ResponseHandler(self.pending, self.step_errors.append, "worker rank 0")
        self.handler.drops = DropLog("worker rank 0", interval_s=0.0)  # log every drop
        self.ring, self.writer = _ring(
            lambda: RingReader.create(CAPACITY, label="out", policy=PARK),
            lambda name: RingWriter.attach(name),
        )

    def serve(self) -> None:
        """Run the reader over everything written so far (it returns once the ring is idle)."""
        serve_responses(self.ring, self.handler, lambda: True, tick_s=0.01)

    def close(self) -> None:
        self.writer.close()
        self.ring.close()


@pytest.fixture
def responses() -> Iterator[ResponseRing]:
    ring = ResponseRing()
    yield ring
    ring.close()


def test_reader_drops_garbage_and_keeps_serving(
    responses: ResponseRing, drops: pytest.LogCaptureFixture
) -> None:
    step = responses.pending.add_step(1)
    call_id, call = responses.pending.add_call()
    for kind, payload, _ in GARBAGE_RESPONSES:
        _write(responses.writer, kind, payload)
    write_message(responses.writer, FrameKind.OUTPUT, _output_with_logprobs(1))
    write_message(responses.writer, FrameKind.RPC_REPLY, _encode(RpcReply(call_id, 0, value=[1, "x"])))
    responses.serve()

    output = step.result(0)
    assert output.step_id == 1 and output.logprobs is not None
    assert output.logprobs.logprobs.shape == (64, 4)
    assert call.result(0) == [[1, "x"]]
    assert responses.pending.failure is None
    assert responses.handler.drops.count == len(GARBAGE_RESPONSES)
    lines = _drop_lines(drops)
    for line, (_, _, reason) in zip(lines, GARBAGE_RESPONSES, strict=True):
        assert line.startswith("worker rank 0: dropped a malformed frame: ")
        assert reason in line, line


def test_reader_skips_a_bogus_ring_header(
    responses: ResponseRing, drops: pytest.LogCaptureFixture
) -> None:
    step = responses.pending.add_step(1)
    _write_bogus_header(responses.writer, FrameKind.OUTPUT)
    responses.serve()
    assert "does not fit" in _drop_lines(drops)[0]
    write_message(responses.writer, FrameKind.OUTPUT, _encode(ModelRunnerOutput(1)))
    responses.serve()
    assert step.result(0).step_id == 1


def test_dropped_output_fails_its_step_when_the_next_one_answers(responses: ResponseRing) -> None:
    first, second = responses.pending.add_step(1), responses.pending.add_step(2)
    write_message(responses.writer, FrameKind.OUTPUT, [_body(ModelRunnerOutput(1))[:-1]])
    write_message(responses.writer, FrameKind.OUTPUT, _encode(ModelRunnerOutput(2)))
    responses.serve()
    with pytest.raises(FrameLostError, match="answered step 2 before step 1: the output of step 1"):
        first.result(0)
    with pytest.raises(FrameLostError):
        second.result(0)
    assert isinstance(responses.pending.failure, FrameLostError)  # an engine fault from now on


def test_dropped_reply_fails_its_call_when_a_later_one_answers(responses: ResponseRing) -> None:
    (first_id, first), (second_id, second) = responses.pending.add_call(), responses.pending.add_call()
    write_message(responses.writer, FrameKind.RPC_REPLY, [b"\x93\xc1"])
    write_message(responses.writer, FrameKind.RPC_REPLY, _encode(RpcReply(second_id, 0, value=3)))
    responses.serve()
    assert second.result(0) == [3]
    with pytest.raises(FrameLostError, match=f"its reply to call {first_id} was lost"):
        first.result(0)
    assert responses.pending.failure is None  # a lost call is not an engine fault


def test_step_error_frames_still_report(responses: ResponseRing) -> None:
    write_message(responses.writer, FrameKind.STEP_ERROR, _encode(StepError(3, 0, "E: boom", "tb")))
    responses.serve()
    assert [e.error for e in responses.step_errors] == ["E: boom"]


def test_corrupt_control_block_ends_the_reader(responses: ResponseRing) -> None:
    word = responses.writer._wword
    real = responses.writer._words[word]
    responses.writer._words[word] = real + 2 * CAPACITY
    with pytest.raises(CorruptRingError):
        responses.serve()
    responses.writer._words[word] = real


# ---- Pending, as plain objects ---------------------------------------------------------------


def test_pending_stray_output_and_reply_change_nothing() -> None:
    pending = Pending(2)
    assert not pending.complete_step(ModelRunnerOutput(5))  # nothing in flight
    step = pending.add_step(1)
    assert not pending.complete_step(ModelRunnerOutput(2))
    call_id, call = pending.add_call()
    assert not pending.complete_call(RpcReply(call_id, 2))  # no rank 2 in a world of 2
    assert pending.complete_call(RpcReply(call_id + 100, 0))  # nobody waits for it: ignored
    assert not step.done() and not call.done() and pending.failure is None
    assert pending.complete_step(ModelRunnerOutput(1))
    assert step.result(0).step_id == 1


def test_pending_lost_reply_is_per_rank() -> None:
    pending = Pending(2)
    (a_id, a), (b_id, b) = pending.add_call(), pending.add_call()
    pending.complete_call(RpcReply(a_id, 0, value="a0"))
    pending.complete_call(RpcReply(b_id, 0, value="b0"))  # rank 0 answered both: nothing lost
    assert not a.done() and not b.done()
    pending.complete_call(RpcReply(b_id, 1, value="b1"))  # rank 1 skipped call a
    assert b.result(0) == ["b0", "b1"]
    with pytest.raises(FrameLostError, match="worker rank 1"):
        a.result(0)


def test_pending_error_reply_is_still_a_worker_error() -> None:
    pending = Pending(1)
    call_id, call = pending.add_call()
    pending.complete_call(RpcReply(call_id, 0, error="ValueError: no"))
    with pytest.raises(WorkerError, match="rank 0: ValueError: no"):
        call.result(0)


def test_drop_log_is_rate_limited(drops: pytest.LogCaptureFixture) -> None:
    log = DropLog("worker rank 3", interval_s=3600.0)
    for i in range(1000):
        log.drop(f"garbage {i}")
    assert log.count == 1000
    assert _drop_lines(drops) == ["worker rank 3: dropped a malformed frame: garbage 0"]
    log._next_report = 0.0  # as if the interval had passed
    log.drop("garbage 1000")
    assert _drop_lines(drops)[-1].endswith("garbage 1000 (999 more dropped since the last report)")


# ---- a worker's loop -------------------------------------------------------------------------


class EchoWorker:
    """The part of the `Worker` interface the loop calls; a step answers at once."""

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(so.step_id, list(so.num_scheduled_tokens))

    def ping(self, value: int) -> int:
        return value + 1


class WorkerRings:
    """A `WorkerLoop` over in-process rings; the test holds the executor's ends."""

    def __init__(self) -> None:
        self.sched, sched_reader = _ring(
            lambda: RingWriter.create(CAPACITY, 1, label="sched", policy=PARK),
            lambda name: RingReader.attach(name, 0, policy=PARK),
        )
        self.out, out_writer = _ring(
            lambda: RingReader.create(CAPACITY, label="out", policy=PARK),
            lambda name: RingWriter.attach(name),
        )
        self.loop = WorkerLoop(EchoWorker(), 0, sched_reader, out_writer)
        self.loop.drops = DropLog("worker rank 0", interval_s=0.0)  # log every drop
        self.thread = threading.Thread(target=self.loop.run, daemon=True)

    def answer(self, decoder: MsgpackDecoder[Any]) -> Any:
        frame = self.out.recv(10.0)
        try:
            return decoder.decode(read_buffers(frame.data, copy_out_of_band=True))
        finally:
            self.out.release()

    def step_and_call(self) -> None:
        """A valid step and call are answered (the first answers: none came for garbage)."""
        write_message(self.sched, FrameKind.STEP,
                      _encode(SchedulerOutput(7, num_scheduled_tokens={"r": 3})))
        write_message(self.sched, FrameKind.RPC, _encode(RpcRequest(1, "ping", (41,))))
        output = self.answer(MsgpackDecoder(ModelRunnerOutput))
        assert (output.step_id, output.req_ids) == (7, ["r"])
        assert self.answer(MsgpackDecoder(RpcReply)) == RpcReply(1, 0, value=42)

    def close(self) -> None:
        if self.thread.is_alive():
            self.sched.send(b"", int(FrameKind.SHUTDOWN), timeout=5)
            self.thread.join(timeout=10)
            assert not self.thread.is_alive()
        for ring in (self.loop.out, self.loop.sched, self.out, self.sched):
            ring.close()


@pytest.fixture
def worker() -> Iterator[WorkerRings]:
    rings = WorkerRings()
    yield rings
    rings.close()


def test_worker_loop_drops_garbage_and_keeps_serving(
    worker: WorkerRings, drops: pytest.LogCaptureFixture
) -> None:
    worker.thread.start()
    for kind, payload, _ in GARBAGE_REQUESTS:
        _write(worker.sched, kind, payload)
    worker.step_and_call()
    assert worker.loop.drops.count == len(GARBAGE_REQUESTS)
    for line, (_, _, reason) in zip(_drop_lines(drops), GARBAGE_REQUESTS, strict=True):
        assert reason in line, line


def test_worker_loop_skips_a_bogus_ring_header(
    worker: WorkerRings, drops: pytest.LogCaptureFixture
) -> None:
    _write_bogus_header(worker.sched, FrameKind.STEP)  # before the loop starts: no race
    worker.thread.start()
    _wait_until(lambda: worker.loop.drops.count == 1)  # skipped (else the next frame would be)
    worker.step_and_call()
    assert "does not fit" in _drop_lines(drops)[0]


# ---- a real worker process -------------------------------------------------------------------


@pytest.mark.slow
def test_worker_process_survives_garbage_on_the_broadcast_ring(
    tiny_llama_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    config = EngineArgs(model=str(tiny_llama_dir), device="cpu",
                        num_gpu_blocks_override=64).create_engine_config()
    executor = NullMultiprocExecutor(config)
    try:
        (pid,) = executor.worker_pids
        with executor._send_lock:  # as the executor's own sends do
            for kind, payload, _ in GARBAGE_REQUESTS:
                _write(executor._sched, kind, payload)
        assert executor.execute_model(SchedulerOutput(1)).step_id == 1
        assert executor.collective_rpc("determine_num_blocks", timeout=10) == [64]
        executor.check_health()
        assert executor.worker_pids == [pid]
    finally:
        executor.shutdown()
    # The worker's log goes to its stderr, which it shares with this process.
    assert "worker rank 0: dropped a malformed frame: STEP frame" in capfd.readouterr().err
