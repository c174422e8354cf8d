"""Sending to engine cores from trio under backpressure: `CoreSender`, used by `AsyncMPClient`.

The client reaches every core through one ROUTER socket with ROUTER_MANDATORY, so a full pipe
to a core (its high-water mark reached: the core is busy, stopped or slow to read) is EAGAIN,
never a silent drop. A message that meets a full pipe waits in that core's queue; each core's
queue is sent in order, and always before any later message to the same core, so an abort is
never overtaken, lost or dropped: aborts wait in the queue even when the task that sent them
gives up (other messages are withdrawn then; they were never sent).

Waiting without polling: zmq signals a change of the socket's state (a core drained its pipe, a
peer left) on the socket's FD, edge-triggered. The task that pumps the queues reads
`zmq.EVENTS` (which processes zmq's pending commands, so the FD signals only later ones),
retries every queue, and only then parks in `wait_readable(FD)`. `POLLOUT` is no use for
waiting: with more than one core it means *some* pipe has room, not the one a message needs.
One task pumps at a time (trio allows one waiter per FD): the client's own pump task
(`run`, in `AsyncMPClient.watch_cores`' nursery), or else the first task waiting for its
message. Any other task's send may consume the FD's signal, so every send wakes the parked
pump to retry once.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio
import zmq

from ringserve.serial import MsgpackEncoder

__all__ = ["CoreSender", "Queued", "socket_events", "socket_fd"]


def socket_events(sock: zmq.Socket[Any]) -> int:
    """The socket's pending events; reading them also lets zmq process its commands."""
    return int(sock.getsockopt(zmq.EVENTS))


def socket_fd(sock: zmq.Socket[Any]) -> int:
    """The socket's edge-triggered notification FD."""
    return int(sock.getsockopt(zmq.FD))


async def recv_frame(sock: zmq.Socket[Any]) -> bytes:
    """The next single-frame message of `sock`, parked (never polling) while there is none.

    Raises:
        zmq.ZMQError: the socket was closed.
    """
    while True:
        try:
            frame: bytes = sock.recv(flags=zmq.NOBLOCK)
            return frame
        except zmq.Again:
            if not socket_events(sock) & zmq.POLLIN:
                await trio.lowlevel.wait_readable(socket_fd(sock))


@dataclass(eq=False)
class Queued:
    """A message waiting for room in its core's pipe.

    Attributes:
        engine: the core it goes to.
        message: the `CoreInput`.
        keep: send it even when its sender stops waiting (aborts).
        done: set once it was sent, or failed (`error`).
        error: why it was not sent (the core is unreachable, the engine died).
    """

    engine: int
    message: Any
    keep: bool
    done: trio.Event
    error: BaseException | None = None
    waiter: trio.CancelScope | None = None  # its sender, while waiting for the pump

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.done.set()
        if self.waiter is not None:
            self.waiter.cancel()


class CoreSender:
    """The send side of an `AsyncMPClient`'s ROUTER socket: per-core queues and a pump.

    Args:
        sock: the ROUTER (routing ids `core<i>`, ROUTER_MANDATORY set).
        num_engines: the number of cores.
        on_error: turns a send's `zmq.ZMQError` (other than EAGAIN) for a core into the
            exception its waiting senders get (and may mark the engine dead).
    """

    def __init__(self, sock: zmq.Socket[Any], num_engines: int,
                 on_error: Callable[[int, zmq.ZMQError], BaseException]) -> None:
        self._sock = sock
        self._fd = socket_fd(sock)
        self._encoder = MsgpackEncoder()
        self._ids = [f"core{i}".encode() for i in range(num_engines)]
        self._queues: list[collections.deque[Queued]] = [
            collections.deque() for _ in range(num_engines)]
        self._on_error = on_error
        self._pump_lock = trio.Lock()
        self._parked: trio.CancelScope | None = None
        self._work = trio.Event()  # set when a message was queued that could not go at once
        self._closed = False

    def queued(self, engine: int) -> int:
        """How many messages wait for room in core `engine`'s pipe."""
        return len(self._queues[engine])

    # -- non-blocking ----------------------------------------------------------------------------

    def _send(self, engine: int, message: Any) -> bool:
        frames = [self._ids[engine], *self._encoder.encode(message)]
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def _flush(self, engine: int) -> bool:
        """Send the core's queue in order; True once it is empty (sent, or failed)."""
        queue = self._queues[engine]
        while queue:
            item = queue[0]
            try:
                if not self._send(engine, item.message):
                    return False
            except zmq.ZMQError as exc:
                self.fail(engine, self._on_error(engine, exc))
                return True
            queue.popleft()
            item.finish()
        return True

    def try_send(self, engine: int, message: Any) -> bool:
        """Send now, after the core's queue; False (nothing queued) when its pipe is full.

        Raises:
            zmq.ZMQError: sending failed other than with EAGAIN.
        """
        try:
            return self._flush(engine) and self._send(engine, message)
        finally:
            self._wake()  # this send may have consumed the FD signal the pump waits for

    def post(self, engine: int, message: Any, *, keep: bool = False) -> Queued:
        """Queue a message behind the core's others and send what the pipe takes now;
        `wait` for the rest. `keep`: never withdrawn (aborts)."""
        item = Queued(engine, message, keep, trio.Event())
        self._queues[engine].append(item)
        try:
            if not self._flush(engine):
                self._work.set()
        finally:
            self._wake()
        return item

    def fail(self, engine: int, error: BaseException) -> None:
        """End core `engine`'s queue with `error` (it is unreachable; aborts for it are moot)."""
        queue = self._queues[engine]
        while queue:
            queue.popleft().finish(error)

    def resize(self, num_engines: int, error: BaseException) -> None:
        """Have queues for `num_engines` cores (elastic scaling): new cores get empty ones,
        the queues of removed cores end with `error`."""
        for engine in range(num_engines, len(self._queues)):
            self.fail(engine, error)
        del self._queues[num_engines:], self._ids[num_engines:]
        for engine in range(len(self._queues), num_engines):
            self._ids.append(f"core{engine}".encode())
            self._queues.append(collections.deque())

    def close(self, error: BaseException) -> None:
        """End every queue with `error` and stop the pump (before the socket is closed)."""
        self._closed = True
        for engine in range(len(self._queues)):
            self.fail(engine, error)
        self._wake()
        self._work.set()

    # -- waiting ---------------------------------------------------------------------------------

    async def wait(self, item: Queued) -> None:
        """Return once `item` was sent or failed, pumping the queues while no task does.

        Cancelled before then, a message that is not `keep` is withdrawn (it was never sent).
        """
        done = item.done
        try:
            while not done.is_set():
                with trio.CancelScope() as scope:
                    item.waiter = scope  # the pump cancels it once the item is sent
                    async with self._pump_lock:
                        item.waiter = None
                        await self._pump(done)
                item.waiter = None
        except BaseException:
            if not done.is_set() and not item.keep:
                self._queues[item.engine].remove(item)
            raise

    async def run(self) -> None:
        """Pump the queues until the client closes, so that queued messages (aborts sent
        without waiting) go out as soon as their core's pipe has room."""
        async with self._pump_lock:
            await self._pump(None)

    async def _pump(self, until: trio.Event | None) -> None:
        """Flush every queue until `until` is set (None: until closed), parking on the socket's
        FD while everything left would block, and on new work while nothing is left."""
        while not self._closed and (until is None or not until.is_set()):
            socket_events(self._sock)  # take zmq's pending commands: the FD signals only new ones
            pending = False
            for engine in range(len(self._queues)):
                pending = not self._flush(engine) or pending
            if until is not None and until.is_set():
                return
            if not pending:
                if until is not None:
                    return  # its item was withdrawn meanwhile
                self._work = trio.Event()
                await self._work.wait()
                continue
            with trio.CancelScope() as self._parked:
                try:
                    await trio.lowlevel.wait_readable(self._fd)
                finally:
                    self._parked = None

    def _wake(self) -> None:
        """Have a parked pump retry (another task used the socket, or the client closed)."""
        if self._parked is not None:
            self._parked.cancel()
