"""The DP coordinator's reports after it is restarted (found with issue 38 item 1).

A frontend takes a `LoadReport` only when its `seq` is above the last one it took. The
coordinator counted `seq` from 0 in each process, so after the supervisor restarted it every
frontend ignored its reports until the new one had published as many as its predecessor
(at most one a second when idle: for as long as the old one had run)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import zmq

from ringserve.engine.cluster.coordinator import Coordinator
from ringserve.engine.cluster.wire import LoadReport


def test_a_restarted_coordinator_reports_past_its_predecessor(tmp_path: Path) -> None:
    addrs = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/pub"
    first = Coordinator(2, *addrs)
    try:
        for _ in range(1000):  # it ran a while
            first.publish()
        last = first.seq
    finally:
        first.close()
    second = Coordinator(2, *addrs)  # the supervisor restarts it on the same addresses
    sub = second.ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(addrs[1])
        report = None
        for _ in range(200):  # a SUB drops what was published before it joined
            second.publish()
            if sub.poll(10):
                report = msgspec.msgpack.decode(sub.recv(), type=LoadReport)
                break
        assert report is not None
        assert report.seq > last, (report.seq, last)
    finally:
        sub.close()
        second.close()
