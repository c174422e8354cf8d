"""The messages of a scaled-out deployment: its topology, engine load, and the join handshake.

A deployment with more than one API server, a DP coordinator or engines on other hosts is laid
out by `ringserve.engine.cluster.fleet` (the supervisor of `ringserve serve`): `ClusterTopology` says
where every frontend's sockets are and where the coordinator is; frontends, engine cores and
headless hosts all receive it. Engine cores push `EngineLoad` to the coordinator, which
publishes `LoadReport` to every frontend. A headless host asks the head for the topology with
`JoinRequest` and gets `JoinReply`. All msgpack, never pickle.
"""

from __future__ import annotations

import msgspec

# Exit status of an engine core whose start failed (its reason went out in the handshake):
# its supervisor does not restart it.
STARTUP_FAILED_STATUS = 2
# The same, when the reason is a setting that cannot work (the core's ValueError): the
# supervisor exits 2 (a user mistake) rather than 1.
STARTUP_FAILED_SETTING_STATUS = 4


class FrontendAddrs(msgspec.Struct, array_like=True):
    """Where one frontend's sockets are bound: requests (ROUTER) and outputs (PULL), and the
    REP its elastic-scaling agent answers the supervisor on ("": none, engines on other
    hosts)."""

    input_addr: str
    output_addr: str
    control_addr: str = ""


# A core on another host silent for this many heartbeats is lost.
LOST_AFTER_BEATS = 6


class ClusterTopology(msgspec.Struct, array_like=True, omit_defaults=True):
    """The layout every process of a scaled-out deployment shares.

    Attributes:
        frontends: per API server (client index = position), its socket addresses.
        data_parallel_size: engine cores in the deployment (all hosts).
        coordinator_input: the coordinator's PULL address (cores push load), or "".
        coordinator_publish: the coordinator's PUB address (frontends subscribe), or "".
        remote_engines: engine indexes on other hosts: watched by heartbeat, not by pid.
        heartbeat_s: how often a core on another host proves its link alive when idle.
        control_addr: the supervisor's elastic-scaling service (frontends ask it to scale;
            "": elastic scaling is not offered, engines on other hosts).
    """

    frontends: list[FrontendAddrs]
    data_parallel_size: int = 1
    coordinator_input: str = ""
    coordinator_publish: str = ""
    remote_engines: list[int] = []
    heartbeat_s: float = 0.5
    control_addr: str = ""

    @property
    def lost_after_s(self) -> float:
        """How long a core on another host may be silent before a frontend calls it lost
        (`LOST_AFTER_BEATS` heartbeats)."""
        return self.heartbeat_s * LOST_AFTER_BEATS

    @property
    def client_addrs(self) -> list[tuple[str, str]]:
        """(input, output) per frontend, as an engine core connects them."""
        return [(f.input_addr, f.output_addr) for f in self.frontends]


class EngineLoad(msgspec.Struct, tag="load", array_like=True, gc=False):
    """A core's queue lengths (core -> coordinator), sent when they change."""

    engine_index: int
    waiting: int
    running: int
    timestamp: float


class LoadReport(msgspec.Struct, array_like=True, gc=False):
    """Every core's queue lengths (coordinator -> frontends).

    Attributes:
        seq: increases with every report, also across a restart of the coordinator (a
            frontend ignores an older one).
        loads: per engine index, [waiting, running] (zeros for one never heard from).
        age_s: per engine, seconds since its last report reached the coordinator.
    """

    seq: int
    loads: list[list[int]]
    age_s: list[float]


class JoinRequest(msgspec.Struct, tag="join", array_like=True):
    """A headless host's request for the topology: the engine ranks it will run."""

    start_rank: int
    count: int
    data_parallel_size: int
    model: str


class JoinReply(msgspec.Struct, array_like=True, omit_defaults=True):
    """The head's answer: the topology, or why the host cannot join."""

    topology: ClusterTopology | None = None
    error: str = ""
