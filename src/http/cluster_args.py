"""The scale-out flags of `ringserve serve` (vLLM's names and meanings), and `ClusterSettings`.

`--api-server-count/-asc N` (default: the data-parallel size), `--headless`,
`--data-parallel-size-local/-dpl`, `--data-parallel-address/-dpa`,
`--data-parallel-rpc-port/-dpp`, `--data-parallel-start-rank/-dpr`, plus ringserve's own
`--cluster-secret-file` and `--insecure-cluster` (links between hosts are authenticated; see
`ringserve.engine.cluster.auth`). `check_cluster_args` runs the checks that need no model.
"""

from __future__ import annotations

import argparse

from ringserve import envs
from ringserve.engine.cluster.fleet import DEFAULT_RPC_PORT, ClusterSettings

_DEFAULTS = ClusterSettings()


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """Add the scale-out flags to `parser`."""
    group = parser.add_argument_group("scale-out")
    group.add_argument("--api-server-count", "-asc", type=int, default=None,
                       help="API server processes sharing the port, each connected to every "
                            "engine core (default: the data-parallel size)")
    group.add_argument("--headless", action="store_true",
                       help="run engine cores only; they join the head at "
                            "--data-parallel-address")
    group.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                       help="engine cores on this host (default: --data-parallel-size)")
    group.add_argument("--data-parallel-address", "-dpa", default=_DEFAULTS.data_parallel_address,
                       help="the head's address, where its API servers and join service "
                            f"listen for other hosts (default: {_DEFAULTS.data_parallel_address})")
    group.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=DEFAULT_RPC_PORT,
                       help=f"the head's join-service port (default: {DEFAULT_RPC_PORT})")
    group.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0,
                       help="the first engine rank of a --headless host (default: 0)")
    group.add_argument("--cluster-secret-file", default=None,
                       help="file (mode 600) with the shared secret that authenticates every "
                            "link between hosts (default: $RINGSERVE_CLUSTER_SECRET)")
    group.add_argument("--insecure-cluster", action="store_true",
                       help="allow unauthenticated links between hosts on non-loopback "
                            "addresses (anyone who can reach them can drive the engines)")


def cluster_from_args(ns: argparse.Namespace) -> ClusterSettings:
    """The `ClusterSettings` of a parsed command line."""
    return ClusterSettings(
        api_server_count=ns.api_server_count, headless=ns.headless,
        data_parallel_size_local=ns.data_parallel_size_local,
        data_parallel_address=ns.data_parallel_address,
        data_parallel_rpc_port=ns.data_parallel_rpc_port,
        data_parallel_start_rank=ns.data_parallel_start_rank,
        cluster_secret_file=ns.cluster_secret_file, insecure_cluster=ns.insecure_cluster)


def check_cluster_args(ns: argparse.Namespace) -> None:
    """The scale-out checks that need no model.

    Raises:
        ValueError: a flag's value is not allowed (the message names the flag).
    """
    from ringserve.engine.cluster.auth import is_loopback

    if ns.api_server_count is not None and ns.api_server_count < 1:
        raise ValueError(f"--api-server-count: got {ns.api_server_count}, allowed: >= 1")
    if ns.data_parallel_size_local is not None and ns.data_parallel_size_local < 0:
        raise ValueError(f"--data-parallel-size-local: got {ns.data_parallel_size_local}, "
                         "allowed: >= 0")
    if not 1 <= ns.data_parallel_rpc_port <= 65535:
        raise ValueError(f"--data-parallel-rpc-port: got {ns.data_parallel_rpc_port}, "
                         "allowed: 1..65535")
    multi_host = ns.headless or (ns.data_parallel_size_local is not None
                                 and ns.data_parallel_size_local < ns.data_parallel_size)
    secret = ns.cluster_secret_file or envs.cluster_secret()
    if (multi_host and not secret and not ns.insecure_cluster
            and not is_loopback(f"tcp://{ns.data_parallel_address}:1")):
        raise ValueError(
            f"--data-parallel-address {ns.data_parallel_address}: links between hosts on a "
            "non-loopback address must be authenticated: set RINGSERVE_CLUSTER_SECRET or "
            "--cluster-secret-file (the same secret on every host), or pass "
            "--insecure-cluster")
