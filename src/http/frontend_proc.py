"""One API-server process of a scaled-out deployment (`--api-server-count N`).

Started by `ringserve.http.scaleout` as `python -m ringserve.http.frontend_proc`, with the
engine configuration, the serving settings and the `ClusterTopology` as msgpack on stdin and
the shared listening socket as an inherited descriptor. It titles itself
`ringserve::APIServer_<i>`, holds a lifeline to the supervisor, and runs what a one-process
`ringserve serve` runs (`ringserve.http.server.serve`: hypercorn + `AsyncLLM` under one
nursery), its `AsyncLLM` attached to the deployment's cores as client `i`. The supervisor's
stop signal (`lifeline.STOP_SIGNAL`) drains it as SIGTERM drains a one-process server;
SIGTERM and SIGINT themselves are ignored: a stop of the whole process group or cgroup
(systemd) reaches this process as well as its supervisor, which drains it (a second stop
would cut its streams off). Exit status: 0 after a signal, `ENGINE_DEAD` when the
engine died and `STARTUP_FAILED` when a core reported it could not start (the supervisor then
stops the deployment), 1 for anything else (it is restarted).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import msgspec

from ringserve import envs
from ringserve.config import EngineConfig
from ringserve.engine.cluster.wire import ClusterTopology
from ringserve.engine.errors import EngineDeadError, EngineStartupError
from ringserve.engine.frontend.attached_client import Attachment
from ringserve.http.settings import ServeSettings
from ringserve.lifeline import STOP_SIGNAL, ignore_group_signals, install_lifeline

ENGINE_DEAD = 3
STARTUP_FAILED = 4


class FrontendInit(msgspec.Struct, array_like=True):
    """What the supervisor writes on a frontend's stdin."""

    config: EngineConfig
    settings: ServeSettings
    topology: ClusterTopology


def main(argv: list[str] | None = None) -> int:
    """Entry point of a frontend process (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="ringserve.http.frontend_proc")
    parser.add_argument("--client-index", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--lifeline-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    ns = parser.parse_args(argv)
    install_lifeline(ns.lifeline_fd, ns.parent_pid, f"ringserve::APIServer_{ns.client_index}")
    init = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=FrontendInit)
    from ringserve.engine.cluster.auth import ClusterAuth
    from ringserve.http import server

    auth = ClusterAuth.load(envs.cluster_secret_file())
    sock = socket.socket(fileno=ns.listen_fd)
    sock.set_inheritable(False)
    attach = Attachment(init.topology, ns.client_index, auth)
    try:
        server.serve(init.config, init.settings, sock=sock, attach=attach,
                     stop_signals=(STOP_SIGNAL,))
    except EngineDeadError as exc:
        print(f"ringserve: API server {ns.client_index}: the engine died: {exc}",
              file=sys.stderr)
        return ENGINE_DEAD
    except EngineStartupError as exc:
        print(f"ringserve: API server {ns.client_index}: {exc}", file=sys.stderr)
        return STARTUP_FAILED
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    ignore_group_signals()  # they reach the group or cgroup: the supervisor decides
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
