"""An engine core's links to its frontends: one input and one output socket per frontend.

Owned by `core_proc.EngineCoreProc`, whose two socket threads run `serve_inputs` and
`serve_outputs`. A core serves `len(clients)` frontends (`--api-server-count`; client index =
position in the list). Each frontend binds a ROUTER for requests and a PULL for outputs; the
core connects a DEALER (routing id `core<i>`) and a PUSH to each. What the busy loop hands to
the output thread is `(target, message)`: a client index, or `BROADCAST` for what every
frontend must see (the handshake, fault status, the dead notice).

With `watch=True` (a deployment whose frontends live and die apart from the core: more than
one API server, or engines on other hosts) the input sockets are monitored:

* a frontend whose link drops is *gone*: the busy loop is told (`on_client_gone`) and aborts
  its requests, and outputs for it are dropped until it is back (a dead frontend must not
  fill the core's queue and stall the others);
* a frontend whose link comes up (its first start, a restart, a link that came back) gets
  the core's handshake and its last fault status, so a restarted frontend learns the core's
  state without the core restarting; nothing is sent to a frontend before its link is up
  (it could not yet send to the core either);
* with `heartbeat_s` set (engines on other hosts, and any core its frontends watch for hangs:
  `faults.hang_timeout_s`), an idle output link carries an empty batch every `heartbeat_s`,
  by which a frontend tells a silent core from a lost or hung one.

When a DP coordinator runs (`coordinator_addr`), the output thread also pushes the core's queue
lengths to it whenever they change (`cluster_wire.EngineLoad`), and at least every second.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from ringserve.engine.cluster.wire import EngineLoad
from ringserve.engine.wire import CoreInput, EngineCoreOutputs, HandshakeReply
from ringserve.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

BROADCAST = -1
_LOAD_REFRESH_S = 1.0
_SEND_RETRY_MS = 50  # a full pipe to a frontend: look again (and whether it is gone) this often
# "Up" once the ZMTP handshake is done: the frontend's ROUTER knows the routing id by then.
_MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class ClientLinks:
    """The sockets between one engine core and its frontends.

    Args:
        ctx: the core's zmq context.
        engine_index: the core's data-parallel rank (routing id `core<i>`).
        clients: per frontend, its (ROUTER address, PULL address).
        watch: monitor the links (see the module docstring).
        heartbeat_s: empty batches on idle output links this often (None: none).
        coordinator_addr: the DP coordinator's PULL address (None: no coordinator).
        secure: called on every socket before it connects (link authentication), or None.
    """

    def __init__(self, ctx: zmq.Context[Any], engine_index: int,
                 clients: list[tuple[str, str]], *, watch: bool = False,
                 heartbeat_s: float | None = None, coordinator_addr: str | None = None,
                 secure: Callable[[zmq.Socket[Any]], None] | None = None) -> None:
        if not clients:
            raise ValueError("an engine core needs at least one frontend")
        self.ctx = ctx
        self.engine_index = engine_index
        self.clients = list(clients)
        self.watch = watch or len(clients) > 1
        self.heartbeat_s = heartbeat_s
        self.coordinator_addr = coordinator_addr
        self._secure = secure
        # Written by the input thread, read by the output thread (a bool per client). With
        # watched links a frontend is up once its link is (it is greeted then).
        self.up = [not self.watch] * len(clients)
        self._lock = threading.Lock()
        self.handshake: HandshakeReply | None = None
        self.fault_status: EngineCoreOutputs | None = None

    def _connect(self, kind: int, addr: str,
                 monitors: dict[Any, int] | None = None) -> zmq.Socket[Any]:
        """A socket connected to `addr`; with `monitors`, its monitor (attached before it
        connects, so no event is missed) is added there under the next client index."""
        sock: zmq.Socket[Any] = self.ctx.socket(kind)
        if kind == zmq.DEALER:
            sock.setsockopt(zmq.ROUTING_ID, f"core{self.engine_index}".encode())
            sock.setsockopt(zmq.LINGER, 0)
        else:
            sock.setsockopt(zmq.LINGER, 2000)
        if self._secure is not None and addr.startswith("tcp://"):
            self._secure(sock)
        if monitors is not None:
            monitors[sock.get_monitor_socket(_MONITORED)] = len(monitors)
        sock.connect(addr)
        return sock

    # -- input ---------------------------------------------------------------------------------

    def serve_inputs(self, on_message: Callable[[int, CoreInput], None],
                     on_malformed: Callable[[int, list[Any], Exception], None],
                     on_client: Callable[[int, bool], None],
                     output_queue: queue.Queue[Any]) -> None:
        """The input thread: decode every frame into `on_message(client, message)` until the
        context is terminated. `on_client(client, connected)` follows the monitored links."""
        monitors: dict[Any, int] = {}
        socks = [self._connect(zmq.DEALER, addr, monitors if self.watch else None)
                 for addr, _ in self.clients]
        decoder: MsgpackDecoder[CoreInput] = MsgpackDecoder(CoreInput)  # type: ignore[arg-type]
        try:
            if not self.watch:
                self._serve_one(socks[0], decoder, on_message, on_malformed)
                return
            poller = zmq.Poller()
            for sock in (*monitors, *socks):
                poller.register(sock, zmq.POLLIN)
            index = {sock: client for client, sock in enumerate(socks)}
            while True:
                ready = dict(poller.poll())
                # Link events first: a frontend's disconnect is handled before anything its
                # successor sends on the same socket.
                for monitor, client in monitors.items():
                    if monitor in ready:
                        self._link_event(monitor, client, on_client, output_queue)
                for sock in socks:
                    if sock in ready:
                        self._drain(index[sock], sock, decoder, on_message, on_malformed)
        except zmq.ContextTerminated:
            pass
        finally:
            for sock in socks:
                if monitors:
                    with contextlib.suppress(zmq.ZMQError):
                        sock.disable_monitor()
                sock.close(linger=0)
            for monitor in monitors:
                monitor.close(linger=0)

    @staticmethod
    def _serve_one(sock: zmq.Socket[Any], decoder: MsgpackDecoder[CoreInput],
                   on_message: Callable[[int, CoreInput], None],
                   on_malformed: Callable[[int, list[Any], Exception], None]) -> None:
        while True:
            frames = sock.recv_multipart(copy=False)
            _deliver(0, frames, decoder, on_message, on_malformed)

    @staticmethod
    def _drain(client: int, sock: zmq.Socket[Any], decoder: MsgpackDecoder[CoreInput],
               on_message: Callable[[int, CoreInput], None],
               on_malformed: Callable[[int, list[Any], Exception], None]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            _deliver(client, frames, decoder, on_message, on_malformed)

    def _link_event(self, monitor: zmq.Socket[Any], client: int,
                    on_client: Callable[[int, bool], None],
                    output_queue: queue.Queue[Any]) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            connected = event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
            if not connected and not self.up[client]:
                continue  # one loss is reported once
            self.up[client] = connected
            if connected:
                # Through the output queue, in order after anything already queued for it.
                output_queue.put((client, _Hello()))
            else:
                logger.info("engine core %d: frontend %d disconnected; aborting its "
                               "requests", self.engine_index, client)
            on_client(client, connected)

    # -- output --------------------------------------------------------------------------------

    def serve_outputs(self, output_queue: queue.Queue[Any],
                      on_sent: Callable[[float], None]) -> None:
        """The output thread: send what the busy loop queued, until it queues None.

        Raises:
            BaseException: a socket failed (the caller treats the thread's death as fatal).
        """
        socks = [self._connect(zmq.PUSH, addr) for _, addr in self.clients]
        coordinator = None
        if self.coordinator_addr is not None:
            coordinator = self._connect(zmq.PUSH, self.coordinator_addr)
            coordinator.setsockopt(zmq.SNDHWM, 16)
        encoder = MsgpackEncoder()
        load_encoder = MsgpackEncoder()
        last_load: tuple[int, int] | None = None
        last_load_at = 0.0
        last_sent = [time.monotonic()] * len(socks)
        beat = self.heartbeat_s
        heartbeat = encoder.encode(EngineCoreOutputs(engine_index=self.engine_index))
        clock = time.perf_counter
        try:
            while True:
                wait = None
                if beat is not None and self.handshake is not None:
                    # Every frontend hears from this core at least every `beat`, also one
                    # whose requests are elsewhere while the others keep the queue busy.
                    # Not before the handshake: a restarted core's beats would otherwise
                    # keep its dead predecessor looking alive (same engine index).
                    now = time.monotonic()
                    for client, sent in enumerate(last_sent):
                        if self.up[client] and now - sent >= beat:
                            self._send(client, socks[client], heartbeat)
                            last_sent[client] = now
                    # Only links that are up have a beat due: a gone frontend's last send
                    # (or this thread's start) is long past, and counting it made the wait 0,
                    # a spin until it came back. Its beats count from its hello.
                    due = [sent for client, sent in enumerate(last_sent) if self.up[client]]
                    wait = max(0.0, min(due) + beat - now) if due else None
                try:
                    item = output_queue.get(timeout=wait)
                except queue.Empty:
                    continue
                if item is None:
                    break
                target, message = item
                start = clock()
                if isinstance(message, _Hello):
                    self._hello(socks[target], encoder)
                    last_sent[target] = time.monotonic()
                    continue
                if isinstance(message, HandshakeReply):
                    self.handshake = message
                elif isinstance(message, EngineCoreOutputs) and message.fault_status is not None:
                    self.fault_status = message
                frames = encoder.encode(message)
                now = time.monotonic()
                for client in (range(len(socks)) if target == BROADCAST else (target,)):
                    if self.up[client]:
                        self._send(client, socks[client], frames)
                        last_sent[client] = now
                if coordinator is not None and isinstance(message, EngineCoreOutputs):
                    stats = message.scheduler_stats
                    if stats is not None:
                        load = (stats.num_waiting_reqs, stats.num_running_reqs)
                        if load != last_load or now - last_load_at >= _LOAD_REFRESH_S:
                            last_load, last_load_at = load, now
                            _send_load(coordinator, load_encoder,
                                       EngineLoad(self.engine_index, load[0], load[1], now))
                on_sent(clock() - start)
        except zmq.ContextTerminated:
            pass
        finally:
            linger = 0 if self.handshake is None else None
            for sock in socks:
                sock.close(linger=linger)
            if coordinator is not None:
                coordinator.close(linger=0)

    def _send(self, client: int, sock: zmq.Socket[Any], frames: list[Any]) -> None:
        """Send to one frontend, waiting while its pipe is full; dropped once it is gone.

        A PUSH whose peer went away blocks a send until the peer comes back, and the input
        thread may see the link drop only after this thread has started such a send: a
        blocking send there would stall this core's outputs to every frontend for good.
        """
        while True:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if not self.up[client]:
                    return  # gone: its requests are being aborted
                sock.poll(_SEND_RETRY_MS, zmq.POLLOUT)

    def _hello(self, sock: zmq.Socket[Any], encoder: MsgpackEncoder) -> None:
        """A (re)connected frontend: the handshake (once the core is ready) and the fault
        status it would otherwise have missed."""
        if self.handshake is None:
            return  # the handshake goes to every frontend once the core is ready
        sock.send_multipart(encoder.encode(self.handshake), copy=False)
        if self.fault_status is not None:
            sock.send_multipart(encoder.encode(self.fault_status), copy=False)


class _Hello:
    """Queued by the input thread for a frontend that (re)connected."""


def _deliver(client: int, frames: list[Any], decoder: MsgpackDecoder[CoreInput],
             on_message: Callable[[int, CoreInput], None],
             on_malformed: Callable[[int, list[Any], Exception], None]) -> None:
    try:
        message = decoder.decode([f.buffer for f in frames])
    except (msgspec.MsgspecError, ValueError, TypeError) as exc:
        on_malformed(client, frames, exc)
        return
    on_message(client, message)


def _send_load(sock: zmq.Socket[Any], encoder: MsgpackEncoder, load: EngineLoad) -> None:
    # The coordinator behind or gone: the next change or refresh catches up.
    with contextlib.suppress(zmq.Again):
        sock.send_multipart(encoder.encode(load), flags=zmq.NOBLOCK, copy=False)

