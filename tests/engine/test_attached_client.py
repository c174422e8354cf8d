"""A frontend counts a remote core's silence from its handshake (issue 38 item 1).

The silence of a core on another host was counted from the frontend's start: a headless host
that joined 17 s after the head was declared lost two seconds after its handshake, and stayed
UNHEALTHY (it never greets again, so it never "rejoined"). No processes: a PUSH plays the
cores, and the frontend's clock is trio's `MockClock` (`autojump_clock`), so a 40 s wait and
the heartbeats take no real time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
import zmq

from ringserve import EngineArgs
from ringserve.engine.cluster.wire import ClusterTopology, FrontendAddrs
from ringserve.engine.frontend import attached_client
from ringserve.engine.frontend.attached_client import AttachedMPClient
from ringserve.engine.wire import EngineCoreOutputs, HandshakeReply

JOINED_AFTER_S = 40.0  # the headless host joins this long after the head's frontend starts


@pytest.fixture
def client(tmp_path: Path, tiny_llama_dir: Path, autojump_clock: trio.testing.MockClock,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[AttachedMPClient]:
    """The frontend of a head with engine 0 here and engine 1 on another host, its clock
    trio's mock clock."""
    monkeypatch.setattr(attached_client, "time",
                        SimpleNamespace(monotonic=autojump_clock.current_time))
    config = EngineArgs(model=str(tiny_llama_dir), device="cpu", data_parallel_size=2,
                        kv_cache_memory=16 << 20).create_engine_config()
    topology = ClusterTopology([FrontendAddrs(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")],
                               data_parallel_size=2, remote_engines=[1])
    frontend = AttachedMPClient(config, topology, 0)
    yield frontend
    frontend.shutdown()


@pytest.fixture
def cores(client: AttachedMPClient) -> Iterator[zmq.Socket[Any]]:
    """What the cores send to the frontend on (one PUSH for both)."""
    ctx: zmq.Context[Any] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(client.output_addr)
    yield push
    push.close()
    ctx.term()


def _greet(push: zmq.Socket[Any], index: int, pid: int) -> None:
    push.send(msgspec.msgpack.encode(HandshakeReply(ready=True, num_blocks=8,
                                                    engine_index=index, pid=pid)))


async def test_silence_counts_from_the_handshake_and_from_a_rejoin(
        autojump_clock: trio.testing.MockClock, client: AttachedMPClient,
        cores: zmq.Socket[Any]) -> None:
    beat, lost_after = client.topology.heartbeat_s, client.topology.lost_after_s
    await trio.sleep(JOINED_AFTER_S)  # e.g. a host with the wrong secret was refused meanwhile
    _greet(cores, 0, 100)
    _greet(cores, 1, 101)
    client._start_cores()  # the frames are queued: returns at once
    deaths: list[tuple[float, str]] = []

    def on_core_death(index: int, reason: str) -> None:
        deaths.append((trio.current_time(), reason))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(client._watch_core, 1, on_core_death, nursery.cancel_scope)
        # Fewer than LOST_AFTER_BEATS beats after its handshake, and no beat yet: not lost.
        await trio.sleep(lost_after - beat)
        assert deaths == [], "a core that just greeted was counted silent since the start"
        for _ in range(20):  # it beats: it stays healthy
            client.record_stats(EngineCoreOutputs(engine_index=1))
            await trio.sleep(beat)
        assert deaths == [] and client.fault_states[1].healthy
        last_beat = trio.current_time() - beat
        while not deaths:  # then it falls silent: lost within a beat of the limit
            await trio.sleep(beat / 10)
        lost_at, reason = deaths[0]
        assert lost_after <= lost_at - last_beat <= lost_after + beat + 1e-6, reason
        assert "silent" in reason and not client.fault_states[1].healthy
        # The host restarts it (after a while), and the new process greets: healthy again,
        # its silence counted from this handshake, not from the last beat of its predecessor.
        await trio.sleep(JOINED_AFTER_S)
        client._take_handshake([msgspec.msgpack.encode(
            HandshakeReply(ready=True, num_blocks=8, engine_index=1, pid=102))])
        rejoined = trio.current_time()
        while not client.fault_states[1].healthy:  # the watcher takes the handshake
            await trio.sleep(0.001)
        assert client.pids[1] == 102 and client.restarts[1] == 1
        await trio.sleep(lost_after - beat)
        assert len(deaths) == 1, deaths
        while len(deaths) == 1:
            await trio.sleep(beat / 10)
        assert lost_after <= deaths[1][0] - rejoined <= lost_after + beat + 0.01, deaths
        nursery.cancel_scope.cancel()
