"""The DP coordinator: every engine core's queue lengths, published to every frontend.

Run by the supervisor of a scaled-out deployment (`ringserve.engine.cluster.fleet`) as
`python -m ringserve.engine.cluster.coordinator`, a process of its own (title
`ringserve::DPCoordinator`) holding a lifeline to the supervisor. It binds a PULL, where each
core's output thread pushes `EngineLoad` whenever its (waiting, running) changes and at least
once a second, and a PUB, where it publishes a `LoadReport` of all cores to every frontend's
`AttachedMPClient`.

Staleness: a change is published at most `_MIN_INTERVAL_S` after it reached the coordinator
(changes within that window are coalesced into one report), and the report is republished
every `_REFRESH_S` even without change (a frontend that just started learns the loads within
that time). A core reports from its output thread, so its figures lag its scheduler by at most
one step. Frontends also take the same figures from the output batches they receive, and
count what they sent since the last report, so a burst sent between two reports is not all
routed to the same core. This works with `--disable-log-stats`: cores always publish the
queue lengths routing needs.

The supervisor stops it with `lifeline.STOP_SIGNAL` (it exits 0 at once); SIGTERM and SIGINT,
which a stop of the whole process group sends every process, are ignored.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from typing import Any

import msgspec
import zmq

from ringserve import envs
from ringserve.engine.cluster.auth import ClusterAuth
from ringserve.engine.cluster.wire import EngineLoad, LoadReport
from ringserve.lifeline import STOP_SIGNAL, ignore_group_signals, install_lifeline

logger = logging.getLogger(__name__)

_MIN_INTERVAL_S = 0.005
_MAX_ENGINES = 512  # elastic_dp.MAX_DATA_PARALLEL_SIZE
_REFRESH_S = 1.0


class Coordinator:
    """The coordinator's state and loop (a plain object: tests drive it over real sockets).

    Args:
        data_parallel_size: the number of engine cores.
        input_addr: where cores push their loads (bound).
        publish_addr: where reports are published (bound).
        auth: the deployment's link authentication, or None.
    """

    def __init__(self, data_parallel_size: int, input_addr: str, publish_addr: str,
                 auth: ClusterAuth | None = None) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
        secured = auth is not None and any(
            a.startswith("tcp://") for a in (input_addr, publish_addr))
        if auth is not None and secured:
            auth.start(self.ctx)
        self.auth = auth if secured else None
        self.pull = self.ctx.socket(zmq.PULL)
        self.pub = self.ctx.socket(zmq.PUB)
        for sock, addr in ((self.pull, input_addr), (self.pub, publish_addr)):
            sock.setsockopt(zmq.LINGER, 0)
            if self.auth is not None and addr.startswith("tcp://"):
                self.auth.secure_server(sock)
            sock.bind(addr)
        self.loads = [[0, 0] for _ in range(data_parallel_size)]
        self.heard = [0.0] * data_parallel_size
        # From the host's monotonic clock, not 0: a frontend takes only reports newer than the
        # last it took, so a restarted coordinator counting from 0 again was ignored until it
        # had published as many reports as its predecessor (it publishes far less than once a
        # nanosecond, so it starts past any seq its predecessor on this host reached).
        self.seq = time.monotonic_ns()
        self._decoder = msgspec.msgpack.Decoder(EngineLoad)
        self._encoder = msgspec.msgpack.Encoder()

    def take(self, frame: bytes) -> bool:
        """Apply one pushed load; True when it changed something."""
        try:
            load = self._decoder.decode(frame)
        except (msgspec.MsgspecError, ValueError, TypeError) as exc:
            logger.warning("coordinator: dropped a malformed load frame: %s", exc)
            return False
        if not 0 <= load.engine_index < _MAX_ENGINES:
            logger.warning("coordinator: dropped a load of unknown engine %d", load.engine_index)
            return False
        while load.engine_index >= len(self.loads):  # a core added by elastic scaling
            self.loads.append([0, 0])
            self.heard.append(0.0)
        self.heard[load.engine_index] = time.monotonic()
        new = [load.waiting, load.running]
        if self.loads[load.engine_index] == new:
            return False
        self.loads[load.engine_index] = new
        return True

    def publish(self) -> None:
        """Send the current report to every subscriber."""
        self.seq += 1
        now = time.monotonic()
        age = [round(now - heard, 3) if heard else -1.0 for heard in self.heard]
        self.pub.send(self._encoder.encode(LoadReport(self.seq, self.loads, age)))

    def run(self) -> None:
        """Serve until the process is stopped (or the context is terminated)."""
        last_publish = 0.0
        dirty = False
        while True:
            now = time.monotonic()
            if dirty:
                timeout = max(0.0, last_publish + _MIN_INTERVAL_S - now)
            else:
                timeout = max(0.0, last_publish + _REFRESH_S - now)
            if self.pull.poll(int(timeout * 1000) + 1):
                while True:
                    try:
                        frame = self.pull.recv(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    dirty = self.take(frame) or dirty
            now = time.monotonic()
            due = last_publish + (_MIN_INTERVAL_S if dirty else _REFRESH_S)
            if now >= due:
                self.publish()
                last_publish, dirty = now, False

    def close(self) -> None:
        """Close the sockets."""
        self.pull.close(linger=0)
        self.pub.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the coordinator process (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="ringserve.engine.cluster.coordinator")
    parser.add_argument("--data-parallel-size", type=int, required=True)
    parser.add_argument("--input-addr", required=True)
    parser.add_argument("--publish-addr", required=True)
    parser.add_argument("--lifeline-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    ns = parser.parse_args(argv)
    install_lifeline(ns.lifeline_fd, ns.parent_pid, "ringserve::DPCoordinator")
    ignore_group_signals()  # the supervisor stops it, after the frontends have drained
    from ringserve.engine.cluster.auth import ClusterAuth

    auth = ClusterAuth.load(envs.cluster_secret_file())
    coordinator = Coordinator(ns.data_parallel_size, ns.input_addr, ns.publish_addr, auth)
    signal.signal(STOP_SIGNAL, lambda *_: os._exit(0))
    coordinator.run()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
