"""The transports compared by ``ringserve bench ipc``: a client class and a server loop each.

Owns the benchmark's two-process plumbing; only ``bench.py`` uses it, and it re-runs itself as
the server process (``python -m ringserve.bench.ipc_peers SERVER ARGS``). The baselines are a
pure busy-spin Python ping-pong over raw shared memory (the floor: no frames, no waiting
protocol), the ring with its default policy, the ring forced to park, a zmq ``ipc://``
PUSH/PULL pair and ``multiprocessing.Pipe``. This module and ``bench.py`` are the only ones in
``ringserve.shm`` that import zmq or multiprocessing (lazily). No pickle: messages are bytes
with a one-byte kind.

Every consumer reads the payload of every message it gets: the server copies each ECHO and
BULK payload out into its own buffer, and the client copies each reply's payload, on every
transport. (The ring hands its reader a view into shared memory; without this its reader would
never touch the bytes while the socket transports' readers do, which flatters the ring.)

Server protocol (kind): ECHO returns the payload, CPU returns the server's CPU seconds as a
little-endian double, BULK is consumed silently, BULK_END answers with the count of BULK
frames, STOP ends the server.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from typing import Any, Protocol

from ringserve.shm.ring import RingReader, RingWriter
from ringserve.shm.segment import Segment
from ringserve.shm.wait import WaitPolicy

ECHO, CPU, BULK, BULK_END, STOP = 1, 2, 3, 4, 5
RING_CAPACITY = 1 << 24
_F64 = struct.Struct("<d")
_CPU_REPLY = _F64.size
MAX_PAYLOAD = 4 * 1024 * 1024 + 64


def touch(scratch: bytearray, data: memoryview | bytes) -> int:
    """Copy ``data`` into ``scratch`` (a consumer reading the payload); returns its length."""
    n = len(data)
    scratch[:n] = data
    return n


class Client(Protocol):
    """The benchmark's side of one transport: round trips."""

    def call(self, kind: int, data: bytes) -> int:
        """Send a message and wait for the reply; return the reply's size (or its value)."""
        ...

    def close(self) -> None:
        """Stop the server and release everything."""
        ...


class StreamClient(Client, Protocol):
    """A transport that also streams one way and reports its server's CPU (all but the floor,
    whose server spins by design and which only measures round trips)."""

    def push(self, data: bytes) -> None:
        """Send a BULK message without waiting."""
        ...

    def server_cpu(self) -> float:
        """CPU seconds the server process has used so far."""
        ...


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "ringserve.bench.ipc_peers", *args])


class RingClient:
    """Two SPSC rings (requests out, replies back) to a ring echo server."""

    def __init__(self, policy: WaitPolicy, park: bool) -> None:
        self.out = RingWriter.create(RING_CAPACITY, label="bench_out", policy=policy)
        self.back = RingReader.create(RING_CAPACITY, label="bench_back", policy=policy)
        self.proc = _spawn("ring", self.out.name, self.back.name, "park" if park else "spin")
        self.scratch = bytearray(MAX_PAYLOAD)
        self.out.wait_attached(60.0)
        self.back.wait_attached(60.0)

    def call(self, kind: int, data: bytes) -> int:
        self.out.send(data, kind)
        frame = self.back.recv(60.0)
        n = touch(self.scratch, frame.data)
        if frame.kind == BULK_END:
            n = int.from_bytes(frame.data, "little")
        self.back.release()
        return n

    def push(self, data: bytes) -> None:
        self.out.send(data, BULK)

    def server_cpu(self) -> float:
        self.out.send(b"", CPU)
        frame = self.back.recv(60.0)
        value: float = _F64.unpack(frame.data)[0]
        self.back.release()
        return value

    def close(self) -> None:
        self.out.send(b"", STOP)
        self.proc.wait(60.0)
        self.out.close()
        self.back.close()


def serve_ring(out_name: str, back_name: str, mode: str) -> None:
    """Echo server over two rings (attached here)."""
    policy = WaitPolicy.forced_park() if mode == "park" else WaitPolicy()
    with (
        RingReader.attach(out_name, policy=policy) as inbox,
        RingWriter.attach(back_name, policy=policy) as outbox,
    ):
        bulk = 0
        scratch = bytearray(MAX_PAYLOAD)
        while True:
            frame = inbox.recv()
            kind = frame.kind
            if kind == ECHO:
                touch(scratch, frame.data)
                outbox.send(frame.data, ECHO)
            elif kind == BULK:
                touch(scratch, frame.data)
                bulk += 1
            elif kind == BULK_END:
                outbox.send(bulk.to_bytes(8, "little"), BULK_END)
                bulk = 0
            elif kind == CPU:
                outbox.send(_F64.pack(time.process_time()), CPU)
            inbox.release()
            if kind == STOP:
                print(f"ring server ({mode}) waits: {inbox.stats}", file=sys.stderr)
                return


class SpinFloorClient:
    """The floor: busy-spin ping-pong of sequence numbers and payload copies, no protocol."""

    def __init__(self, max_bytes: int) -> None:
        self.seg = Segment.create("bench_floor", 4096 + 2 * max_bytes)
        self.words = memoryview(self.seg.mapping).cast("Q")
        self.req = memoryview(self.seg.mapping)[4096 : 4096 + max_bytes]
        self.rep = memoryview(self.seg.mapping)[4096 + max_bytes : 4096 + 2 * max_bytes]
        self.scratch = bytearray(max_bytes)
        self.seq = 0
        self.proc = _spawn("floor", self.seg.name, str(max_bytes))
        while self.words[32] != 1:  # the server's "ready" word
            time.sleep(0.001)
        self.seg.unlink()

    def call(self, kind: int, data: bytes) -> int:
        words = self.words
        self.seq += 1
        seq = self.seq
        n = len(data)
        self.req[:n] = data
        words[8] = n
        words[0] = seq * 8 + kind
        while words[16] != seq:
            pass
        self.scratch[:n] = self.rep[:n]
        return n

    def close(self) -> None:
        self.words[0] = (self.seq + 1) * 8 + STOP
        self.proc.wait(60.0)
        self.req.release()
        self.rep.release()
        self.words.release()
        self.seg.close()


def serve_floor(name: str, max_bytes: int) -> None:
    """The floor's server: spin on the request word, copy the payload back."""
    seg = Segment.attach(name)
    words = memoryview(seg.mapping).cast("Q")
    base = memoryview(seg.mapping)
    req, rep = base[4096 : 4096 + max_bytes], base[4096 + max_bytes : 4096 + 2 * max_bytes]
    words[32] = 1
    last = 0
    while True:
        while words[0] == last:
            pass
        last = words[0]
        if last & 7 == STOP:
            break
        n = words[8]
        rep[:n] = req[:n]
        words[16] = last >> 3
    req.release()
    rep.release()
    base.release()
    words.release()
    seg.close()


class ZmqClient:
    """A zmq ``ipc://`` PUSH/PULL pair each way."""

    def __init__(self, tmpdir: str) -> None:
        import zmq

        self.ctx = zmq.Context()
        out_addr = f"ipc://{tmpdir}/out-{os.getpid()}"
        back_addr = f"ipc://{tmpdir}/back-{os.getpid()}"
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.bind(out_addr)
        self.back = self.ctx.socket(zmq.PULL)
        self.back.bind(back_addr)
        self.proc = _spawn("zmq", out_addr, back_addr)
        self.scratch = bytearray(MAX_PAYLOAD)

    def call(self, kind: int, data: bytes) -> int:
        self.out.send_multipart([bytes((kind,)), data], copy=len(data) < 65536)
        _, payload = self.back.recv_multipart(copy=False)
        n = touch(self.scratch, payload.buffer)
        return n if kind != BULK_END else int.from_bytes(payload.bytes, "little")

    def push(self, data: bytes) -> None:
        self.out.send_multipart([bytes((BULK,)), data], copy=len(data) < 65536)

    def server_cpu(self) -> float:
        self.out.send_multipart([bytes((CPU,)), b""])
        value: float = _F64.unpack(self.back.recv_multipart()[1])[0]
        return value

    def close(self) -> None:
        self.out.send_multipart([bytes((STOP,)), b""])
        self.proc.wait(60.0)
        self.out.close(linger=0)
        self.back.close(linger=0)
        self.ctx.term()


def serve_zmq(out_addr: str, back_addr: str) -> None:
    """zmq echo server."""
    import zmq

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(out_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(back_addr)
    bulk = 0
    scratch = bytearray(MAX_PAYLOAD)
    while True:
        kind_b, data = inbox.recv_multipart(copy=False)
        kind = kind_b.bytes[0]
        if kind == ECHO:
            touch(scratch, data.buffer)
            outbox.send_multipart([kind_b, data])
        elif kind == BULK:
            touch(scratch, data.buffer)
            bulk += 1
        elif kind == BULK_END:
            outbox.send_multipart([kind_b, bulk.to_bytes(8, "little")])
            bulk = 0
        elif kind == CPU:
            outbox.send_multipart([kind_b, _F64.pack(time.process_time())])
        elif kind == STOP:
            break
    inbox.close(linger=0)
    outbox.close(linger=0)
    ctx.term()


class PipeClient:
    """``multiprocessing.Pipe`` (send_bytes / recv_bytes: no pickle), server forked."""

    def __init__(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc: Any = ctx.Process(target=serve_pipe, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.scratch = bytearray(MAX_PAYLOAD)

    def call(self, kind: int, data: bytes) -> int:
        self.conn.send_bytes(bytes((kind,)) + data)
        reply = self.conn.recv_bytes()
        n = touch(self.scratch, memoryview(reply)[1:])
        return n if kind != BULK_END else int.from_bytes(reply[1:], "little")

    def push(self, data: bytes) -> None:
        self.conn.send_bytes(bytes((BULK,)) + data)

    def server_cpu(self) -> float:
        self.conn.send_bytes(bytes((CPU,)))
        value: float = _F64.unpack(self.conn.recv_bytes()[1:])[0]
        return value

    def close(self) -> None:
        self.conn.send_bytes(bytes((STOP,)))
        self.proc.join(60.0)
        self.conn.close()


def serve_pipe(conn: Any) -> None:
    """Pipe echo server (runs in the forked child)."""
    bulk = 0
    scratch = bytearray(MAX_PAYLOAD)
    while True:
        msg = conn.recv_bytes()
        kind = msg[0]
        if kind == ECHO:
            touch(scratch, memoryview(msg)[1:])
            conn.send_bytes(msg)
        elif kind == BULK:
            touch(scratch, memoryview(msg)[1:])
            bulk += 1
        elif kind == BULK_END:
            conn.send_bytes(bytes((BULK_END,)) + bulk.to_bytes(8, "little"))
            bulk = 0
        elif kind == CPU:
            conn.send_bytes(bytes((CPU,)) + _F64.pack(time.process_time()))
        elif kind == STOP:
            return


def main(argv: list[str]) -> int:
    """Server entry point: ``ring OUT BACK MODE``, ``floor NAME BYTES`` or ``zmq OUT BACK``."""
    if argv[0] == "ring":
        serve_ring(argv[1], argv[2], argv[3])
    elif argv[0] == "floor":
        serve_floor(argv[1], int(argv[2]))
    elif argv[0] == "zmq":
        serve_zmq(argv[1], argv[2])
    else:
        raise SystemExit(f"unknown server {argv[0]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
