"""The Ray executor on a two-node Ray cluster started the way Ray users start one: `ray start
--head`, then `ray start --address`, each node with one CPU, its own custom resource (``node_a``,
``node_b``) and its own temp dir under this module's tmp dir, both on this machine.

Joined through RAY_ADDRESS with ``STRICT_SPREAD``, the TP=2 ranks land on different nodes and
give the in-process runner's greedy tokens; a placement the cluster has no room for fails fast
with a message that says so and leaves no placement group; and node B lost mid-step (every
process of its session SIGKILLed: raylet, agents, the actor it ran) fails the pending step with
`WorkerDiedError` within seconds and `check_health` raises: what the fault-tolerance path
consumes; node B started again, the retry's new executor gives the same greedy tokens. A bad placement strategy is a ValueError before Ray is touched (and, without Ray
nodes, a fast test of the variable alone); a private Ray used earlier in the same process does
not lock it out of the cluster (its token auth is undone on release).

Each `ray start` runs in a session of its own (`start_new_session`), and the processes a node
starts (its raylet, agents and actor workers) stay in it: killing a session is losing that node,
and teardown kills both sessions and checks nothing of them is left. Not `ray stop`: it stops
every Ray on the machine, other test runs' included. Slow (two Ray nodes and two executors,
about a minute on two cores); skipped when ray is not installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

if importlib.util.find_spec("ray") is None:  # not importorskip: importing ray is the executor's
    pytest.skip("ray is not installed", allow_module_level=True)

from test_gpu_executor_ray import (
    GREEDY,
    NUM_BLOCKS,
    PROMPTS,
    ExecutorRunner,
    _config,
    _greedy,
)

from ringserve.gpu.executor import ray_placement
from ringserve.gpu.executor.errors import WorkerDiedError
from ringserve.gpu.executor.ray_executor import RayExecutor
from ringserve.gpu.wire import NewRequestData, SchedulerOutput

# The `ray` CLI of the Python running the tests (the venv's), else the first on PATH.
RAY = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray") or "ray"
# Ray's unix sockets live at <temp dir>/session_<date>_<time>_<us>_<pid>/sockets/plasma_store.1
# and a socket path holds at most 107 bytes.
MAX_TEMP_DIR_CHARS = 107 - 66
NODE_START_TIMEOUT_S = 120


@dataclass
class Node:
    """One `ray start`ed node: its name (and custom resource), temp dir and session id."""

    name: str
    temp_dir: Path
    session: int

    def processes(self) -> list[int]:
        """The live (not zombie) processes of this node: its session's, or out of its temp dir."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
                session = os.getsid(pid)
            except (OSError, IndexError):
                continue  # gone meanwhile
            if state != b"Z" and (session == self.session or bytes(self.temp_dir) in cmdline):
                found.append(pid)
        return found

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):  # gone meanwhile
                os.kill(pid, sig)

    def wait_gone(self, within: float) -> bool:
        deadline = time.monotonic() + within
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.processes()


@dataclass
class Cluster:
    """The two nodes, the head's address (what RAY_ADDRESS and `ray start --address` get) and
    the short directory their temp dirs are in."""

    address: str
    head: Node
    worker: Node
    base: Path
    nodes: list[Node]  # every node started (teardown stops them all)


def _short_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bool]:
    """A directory for both nodes' temp dirs, and whether it is ours to remove: under pytest's
    tmp dir when that is short enough for Ray's socket paths, else a short one of our own."""
    base = tmp_path_factory.mktemp("ray2n")
    if len(str(base / "a")) <= MAX_TEMP_DIR_CHARS:
        return base, False
    return Path(tempfile.mkdtemp(prefix="rs-ray-")), True


def _ray_start(name: str, temp_dir: Path, *args: str) -> Node:
    """`ray start` one node in a session of its own; returns once the node is up."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    command = [
        RAY, "start", *args, "--num-cpus", "1", "--num-gpus", "0",
        "--resources", f'{{"node_{name}": 1}}', "--temp-dir", str(temp_dir),
        "--object-store-memory", str(100 << 20), "--disable-usage-stats",
    ]
    proc = subprocess.Popen(
        command, env=env, start_new_session=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    node = Node(name, temp_dir, proc.pid)  # the session id is the leader's pid
    try:
        out, _ = proc.communicate(timeout=NODE_START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        node.kill()
        raise
    if proc.returncode != 0:
        node.kill()
        raise RuntimeError(f"{' '.join(command)} failed:\n{out.decode(errors='replace')}")
    return node


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from gpu_helpers import free_port

    base, remove_base = _short_dir(tmp_path_factory)
    nodes: list[Node] = []
    token = Path.home() / ".ray" / "auth_token"
    token_existed = token.exists()
    try:
        nodes.append(_ray_start(
            "a", base / "a", "--head", "--port", str(free_port()), "--include-dashboard=false",
        ))
        # The address the head advertises (its node IP, as `ray start --head` prints it).
        address = (base / "a" / "ray_current_cluster").read_text().strip()
        nodes.append(_ray_start("b", base / "b", "--address", address))
        yield Cluster(address, nodes[0], nodes[1], base, nodes)
    finally:
        for node in nodes:
            node.kill(signal.SIGTERM)
        if not all(node.wait_gone(within=3.0) for node in nodes):
            for node in nodes:
                node.kill(signal.SIGKILL)
        left = {node.name: node.processes() for node in nodes if not node.wait_gone(within=10.0)}
        if remove_base:
            shutil.rmtree(base, ignore_errors=True)
        assert not left, f"Ray processes left behind: {left}"
        assert token.exists() == token_existed  # no token written to ~/.ray


@pytest.fixture
def joined(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    """The executor joins the cluster (RAY_ADDRESS) with its ranks on different nodes."""
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    monkeypatch.setenv(ray_placement.PLACEMENT_STRATEGY_ENV, "STRICT_SPREAD")
    return cluster


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> dict[str, list[int]]:
    from gpu_helpers import make_runner

    return _greedy(make_runner(tiny_llama_dir, num_blocks=NUM_BLOCKS))


def _prefill(step_id: int, req_id: str, prompt: list[int]) -> SchedulerOutput:
    blocks = list(range(-(-len(prompt) // 8)))
    new = NewRequestData(req_id, prompt, GREEDY, blocks, 0)
    return SchedulerOutput(step_id, [new], [], {req_id: len(prompt)}, len(prompt))


def _node_names() -> dict[str, str]:
    """Ray node id (hex) -> our node name, from each node's custom resource."""
    import ray

    names = {}
    for node in ray.nodes():
        for name in ("a", "b"):
            if f"node_{name}" in node["Resources"]:
                names[node["NodeID"]] = name
    return names


BAD_STRATEGY = (
    r"^RINGSERVE_RAY_PLACEMENT_STRATEGY: got 'spreadd', allowed: PACK, SPREAD, STRICT_PACK, "
    r"STRICT_SPREAD$"
)


def test_placement_strategy_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ray_placement.PLACEMENT_STRATEGY_ENV, raising=False)
    assert ray_placement.placement_strategy() == "PACK"
    monkeypatch.setenv(ray_placement.PLACEMENT_STRATEGY_ENV, " strict_spread ")
    assert ray_placement.placement_strategy() == "STRICT_SPREAD"
    monkeypatch.setenv(ray_placement.PLACEMENT_STRATEGY_ENV, "spreadd")
    with pytest.raises(ValueError, match=BAD_STRATEGY):
        ray_placement.placement_strategy()


def _out_of(directory: Path) -> list[str]:
    """Command lines of the live processes that run out of `directory`."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if bytes(directory) in cmdline:
            found.append(cmdline.decode(errors="replace"))
    return found


@pytest.mark.slow
def test_a_private_ray_before_does_not_lock_this_process_out_of_the_cluster(
    cluster: Cluster, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A private Ray turns Ray's token auth on in this process (os.environ and Ray's cached
    config); released, it must leave them as they were, or the cluster's calls to this driver
    are refused and every actor it creates is cancelled at once ("all references to the actor
    were removed"). The bug showed as this module failing after test_gpu_executor_ray.py."""
    import msgspec
    import ray

    from ringserve.gpu.executor.ray_session import RaySession
    from ringserve.gpu.executor.ray_worker import RayWorker

    private = cluster.base / "p"
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RINGSERVE_RAY_TMPDIR", str(private))
    auth = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")
    before = {name: os.environ.get(name) for name in auth}
    RaySession.acquire()
    RaySession.release()
    assert {name: os.environ.get(name) for name in auth} == before
    deadline = time.monotonic() + 5.0
    while _out_of(private) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _out_of(private) == []  # the private Ray is stopped

    config = msgspec.msgpack.encode(_config(tiny_llama_dir, tp=1))
    ray.init(address=cluster.address, logging_level="WARNING")
    try:
        actor = ray.remote(RayWorker).options(num_cpus=0.1).remote(config, 0, "", "", False)
        _, _, pid, node = ray.get(actor.node_info.remote(), timeout=60)
        assert node in _node_names() and pid > 0
        ray.kill(actor)
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_two_node_tp2_parity(
    joined: Cluster, tiny_llama_dir: Path, reference: dict[str, list[int]]
) -> None:
    import ray

    ex = RayExecutor(_config(tiny_llama_dir, tp=2))
    try:
        assert sorted(_node_names()[node] for node in ex.worker_node_ids) == ["a", "b"]
        ex.initialize_kv_cache(ex.determine_num_blocks())
        assert _greedy(ExecutorRunner(ex)) == reference
    finally:
        ex.shutdown()
    assert not ray.is_initialized()  # it joined the cluster, and left it on shutdown


@pytest.mark.slow
def test_no_room_is_a_clear_error_and_leaves_no_placement_group(
    joined: Cluster, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    monkeypatch.setenv(ray_placement.PLACEMENT_STRATEGY_ENV, "spreadd")
    with pytest.raises(ValueError, match=BAD_STRATEGY):
        RayExecutor(_config(tiny_llama_dir, tp=2))
    assert not ray.is_initialized()  # refused before joining
    monkeypatch.setenv(ray_placement.PLACEMENT_STRATEGY_ENV, "STRICT_SPREAD")
    monkeypatch.setattr(ray_placement, "PLACEMENT_TIMEOUT_S", 1.0)
    ray.init(address=joined.address, logging_level="WARNING")  # ours: the executor leaves it be
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=(
            r"^the Ray cluster has no room for 3 workers needing \{'CPU': 0.1\} each \(placement "
            r"strategy STRICT_SPREAD, each on its own node\) after 1 s: 2 alive nodes, CPU 2 free "
            r"of 2; "
        )):
            RayExecutor(_config(tiny_llama_dir, tp=3))
        assert time.monotonic() - start < 10.0
        states = [pg["state"] for pg in ray.util.placement_group_table().values()]
        assert states and set(states) == {"REMOVED"}  # every group so far: this job's
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_node_lost_mid_step_is_a_worker_death(joined: Cluster, tiny_llama_dir: Path,
                                              reference: dict[str, list[int]]) -> None:
    """Runs last: it loses node B, then a new node joins and the retry (what the core's
    `rebuild_executor` does: the old executor shut down, a new one built) serves the same
    greedy tokens again (the cluster fixture checks what is left at teardown)."""
    ex = RayExecutor(_config(tiny_llama_dir, tp=2))
    try:
        ex.initialize_kv_cache(ex.determine_num_blocks())
        names = _node_names()
        (rank_b,) = [r for r, node in enumerate(ex.worker_node_ids) if names[node] == "b"]
        assert ex.worker_pids[rank_b] in joined.worker.processes()  # the actor is node B's
        ex.execute_model(_prefill(1, "warm", PROMPTS[0]))
        ex.execute_model(SchedulerOutput(2, finished_req_ids=["warm"]))
        # Stopped, rank B cannot finish its half of the step: the step stays pending.
        os.kill(ex.worker_pids[rank_b], signal.SIGSTOP)
        future = ex.execute_model(_prefill(3, "x", PROMPTS[2]), non_block=True)
        time.sleep(0.2)
        assert not future.done()
        start = time.monotonic()
        joined.worker.kill()  # node B is lost: its raylet, its agents, the actor
        with pytest.raises(WorkerDiedError, match=rf"^worker rank {rank_b} "):
            future.result(timeout=30)
        elapsed = time.monotonic() - start
        print(f"node loss -> WorkerDiedError in {elapsed:.2f} s")
        assert elapsed < 10.0
        with pytest.raises(WorkerDiedError):
            ex.check_health()
        with pytest.raises(WorkerDiedError):
            ex.execute_model(_prefill(4, "y", PROMPTS[1]))
    finally:
        ex.shutdown()
    assert joined.worker.wait_gone(within=5.0)
    assert joined.head.processes()  # the head is untouched
    # The node comes back (`ray start --address` again, which returns once its raylet has
    # registered): the retry places the ranks on both nodes again.
    joined.nodes.append(_ray_start("b", joined.base / "c", "--address", joined.address))
    retried = RayExecutor(_config(tiny_llama_dir, tp=2))
    try:
        assert sorted(_node_names()[node] for node in retried.worker_node_ids) == ["a", "b"]
        retried.initialize_kv_cache(retried.determine_num_blocks())
        assert _greedy(ExecutorRunner(retried)) == reference
    finally:
        retried.shutdown()
