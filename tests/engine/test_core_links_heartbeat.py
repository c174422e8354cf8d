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
