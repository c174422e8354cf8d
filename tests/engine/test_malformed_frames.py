"""A malformed frame on either zmq socket is logged and dropped; nobody crashes.

The frontend's ROUTER can address the core's input DEALER directly, so random bytes reach the
core's input thread; a stray PUSH connected to the frontend's PULL delivers garbage to the
client's output decoding. In both cases the core keeps answering and serving requests.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import trio
import zmq

from ringserve import EngineArgs
from ringserve.config import EngineConfig
from ringserve.engine.frontend.async_client import AsyncMPClient
from ringserve.engine.frontend.core_client import EngineCoreClient
from ringserve.engine.frontend.mp_client import SyncMPClient
from ringserve.engine.wire import UtilityCall
from ringserve.serial import MsgpackDecoder, MsgpackEncoder

pytestmark = pytest.mark.slow


def _bad_array_in_utility_args() -> bytes:
    """A well-formed UtilityCall whose `Any` argument is an array header with a bogus dtype."""
    header = msgspec.msgpack.encode(["no-such-dtype", [2], -1, b"xx"])
    return MsgpackEncoder().encode(UtilityCall(7, "is_sleeping", [
        msgspec.msgpack.Ext(1, header)]))[0]  # type: ignore[return-value]


def _bad_tensor_in_utility_args() -> bytes:
    """A UtilityCall whose argument is a 3-byte float32 tensor (torch raises RuntimeError)."""
    header = msgspec.msgpack.encode(["float32", [1], -1, b"abc"])
    return MsgpackEncoder().encode(UtilityCall(7, "is_sleeping", [
        msgspec.msgpack.Ext(3, header)]))[0]  # type: ignore[return-value]


GARBAGE = [
    [_bad_array_in_utility_args()],
    [_bad_tensor_in_utility_args()],
    [b"\x91" * 100_000 + b"\x01"],    # nested past the recursion limit
    [b"\xc1"],                      # not msgpack at all
    [b"\x92\x01\x02"],              # msgpack, wrong shape
    [os.urandom(64)],
    [os.urandom(1), os.urandom(300)],
    [b"\x91\xc7\x03\x7f\x00\x00\x00"],  # an unknown extension type
]


def _config(model_dir: Path) -> EngineConfig:
    return EngineArgs(model=str(model_dir), device="cpu",
                      num_gpu_blocks_override=64).create_engine_config()


@pytest.fixture
def client(tiny_llama_dir: Path) -> Iterator[SyncMPClient]:
    mp = SyncMPClient(_config(tiny_llama_dir), executor="null")
    yield mp
    mp.shutdown()


def test_the_bogus_array_frame_does_not_decode() -> None:
    with pytest.raises((msgspec.MsgspecError, ValueError, TypeError)):
        MsgpackDecoder(UtilityCall).decode(_bad_array_in_utility_args())


def _alive(client: EngineCoreClient) -> None:
    # In a thread, so that a core whose input thread died fails the test instead of hanging it.
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        assert not pool.submit(client.call_utility, "is_sleeping").result(timeout=30)
    finally:
        pool.shutdown(wait=False)


def test_random_bytes_to_the_core_input_leave_it_serving(client: SyncMPClient) -> None:
    for frames in GARBAGE * 20:
        client.input_sock.send_multipart([b"core0", *frames])
    _alive(client)
    assert not client.process.exited.is_set()


def test_random_bytes_to_the_client_output_are_dropped(client: SyncMPClient) -> None:
    stray = client.ctx.socket(zmq.PUSH)
    try:
        stray.connect(client.output_sock.getsockopt_string(zmq.LAST_ENDPOINT))
        for frames in GARBAGE * 20:
            stray.send_multipart(frames)
        _alive(client)
        _alive(client)
    finally:
        stray.close(linger=0)


async def test_random_bytes_to_the_async_client_output_are_dropped(tiny_llama_dir: Path) -> None:
    client = await AsyncMPClient.create(_config(tiny_llama_dir), executor="null")
    stray = client.ctx.socket(zmq.PUSH)
    try:
        stray.connect(client.output_addr)
        for frames in GARBAGE * 20:
            stray.send_multipart(frames)
        async with trio.open_nursery() as nursery:

            async def read_outputs() -> None:
                while True:
                    await client.get_output()

            nursery.start_soon(read_outputs)
            with trio.fail_after(30):
                assert await client.call_utility("is_sleeping") == [0]
            nursery.cancel_scope.cancel()
        assert client.dead is None
    finally:
        stray.close(linger=0)
        client.shutdown()
