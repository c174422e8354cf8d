"""A core on another host beats only once it has sent its handshake (issue 19 item 3).

A restarted core has the engine index of the process it replaces; beats sent while it loads
its model kept the dead predecessor looking alive to the frontends (its SIGKILL was never
reported and its streams never failed)."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import msgspec
import zmq

from ringserve.engine.core.core_links import BROADCAST, ClientLinks
from ringserve.engine.wire import EngineCoreOutputs, HandshakeReply


def test_no_heartbeat_before_the_handshake(tmp_path: Path) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    out_addr = f"ipc://{tmp_path}/out"
    pull.bind(out_addr)
    links = ClientLinks(ctx, 3, [(f"ipc://{tmp_path}/in", out_addr)], heartbeat_s=0.02)
    outputs: queue.Queue[Any] = queue.Queue()
    thread = threading.Thread(target=links.serve_outputs, args=(outputs, lambda _s: None))
    thread.start()
    try:
        assert not pull.poll(300)  # 15 beat periods while "loading": silent
        outputs.put((BROADCAST, HandshakeReply(ready=True, engine_index=3, pid=1)))
        assert pull.poll(2000)
        first = msgspec.msgpack.decode(pull.recv_multipart()[0], type=HandshakeReply)
        assert first.ready and first.engine_index == 3
        for _ in range(3):  # then it beats, idle
            assert pull.poll(2000)
            beat = msgspec.msgpack.decode(pull.recv_multipart()[0], type=EngineCoreOutputs)
            assert beat.engine_index == 3 and not beat.outputs
    finally:
        outputs.put(None)
        thread.join(10)
        pull.close()
        ctx.term()
    assert not thread.is_alive()


class _CountingQueue(queue.Queue[Any]):
    """The output queue, counting how often the output thread looks at it."""

    gets = 0

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        self.gets += 1
        return super().get(block, timeout)


def test_a_gone_frontend_neither_spins_the_output_thread_nor_stops_the_others_beats(
        tmp_path: Path) -> None:
    """Found with issue 38 item 1: the beat wait counted a gone frontend's last send (long
    past), so it was 0 and the output thread of a core on another host spun while any
    frontend was down."""
    ctx: zmq.Context[Any] = zmq.Context()
    pulls, clients = [], []
    for i in range(2):
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(f"ipc://{tmp_path}/out{i}")
        pulls.append(pull)
        clients.append((f"ipc://{tmp_path}/in{i}", f"ipc://{tmp_path}/out{i}"))
    beat = 0.05
    links = ClientLinks(ctx, 1, clients, watch=True, heartbeat_s=beat)
    links.up = [True, False]  # frontend 1 is gone (it is being restarted)
    outputs = _CountingQueue()
    thread = threading.Thread(target=links.serve_outputs, args=(outputs, lambda _s: None))
    thread.start()
    try:
        outputs.put((BROADCAST, HandshakeReply(ready=True, engine_index=1, pid=1)))
        assert pulls[0].poll(2000)
        pulls[0].recv_multipart()  # the handshake
        beats = 0
        while beats < 10:  # frontend 0 still gets a beat every `beat`
            assert pulls[0].poll(2000)
            pulls[0].recv_multipart()
            beats += 1
        # About one look per beat (a spin looked ~100,000 times in that while).
        assert outputs.gets < 4 * beats, outputs.gets
        assert not pulls[1].poll(0)  # nothing for the gone one
    finally:
        outputs.put(None)
        thread.join(10)
        for pull in pulls:
            pull.close()
        ctx.term()
    assert not thread.is_alive()
