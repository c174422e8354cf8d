"""The Ray executor against a private local Ray whose temp dir is in this module's tmp dir:
actors over zmq give the in-process runner's greedy tokens (TP 1 and 2), keep two steps in
flight, answer utility calls from every rank, turn an actor killed mid-step into a failed future
at once, and shutdown fails what is pending and leaves no Ray process behind.

All slow: starting Ray costs seconds, so the module shares one TP=1 executor (and one Ray) and
the last test shuts it down. Skipped when ray is not installed."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

if importlib.util.find_spec("ray") is None:  # not importorskip: importing ray is the executor's
    pytest.skip("ray is not installed", allow_module_level=True)

from ringserve.config import EngineConfig
from ringserve.engine.arg_utils import EngineArgs
from ringserve.gpu.executor.base import Executor
from ringserve.gpu.executor.errors import ExecutorShutdownError, WorkerDiedError, WorkerError
from ringserve.gpu.executor.ray_executor import RayExecutor
from ringserve.gpu.executor.select import executor_class
from ringserve.gpu.wire import ModelRunnerOutput, NewRequestData, SchedulerOutput
from ringserve.sampling_params import SamplingParams
from ringserve.shm.liveness import pid_alive

pytestmark = pytest.mark.slow

PROMPTS = [list(range(20, 33)), [7, 8, 9], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0.0)
NUM_BLOCKS = 256
TOKEN_FILE = Path.home() / ".ray" / "auth_token"


def _config(model_dir: Path, tp: int = 1) -> EngineConfig:
    return EngineArgs(
        model=str(model_dir), device="cpu", tensor_parallel_size=tp,
        distributed_executor_backend="ray", block_size=8, max_model_len=256,
        num_gpu_blocks_override=NUM_BLOCKS,
    ).create_engine_config()


class ExecutorRunner:
    """Lets runner_driver.ToyScheduler drive an executor as if it were a ModelRunner."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.config = executor.config
        self.request_errors: dict[str, str] = {}

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = self.executor.execute_model(so)
        self.request_errors = dict(out.request_errors)
        return out


def _greedy(runner: object) -> dict[str, list[int]]:
    from runner_driver import ToyScheduler

    sched = ToyScheduler(runner, budget=8)  # type: ignore[arg-type]
    for i, prompt in enumerate(PROMPTS):
        sched.add(f"r{i}", prompt, GREEDY, 6)
    return sched.run()


def _prefill(step_id: int, req_id: str, prompt: list[int], first_block: int) -> SchedulerOutput:
    nblocks = -(-len(prompt) // 8)
    new = NewRequestData(req_id, prompt, GREEDY, list(range(first_block, first_block + nblocks)), 0)
    return SchedulerOutput(step_id, [new], [], {req_id: len(prompt)}, len(prompt))


def _all_gone(pids: list[int], within: float = 3.0) -> bool:
    """Whether every pid has exited within `within` seconds (raylet reaps killed actors)."""
    deadline = time.monotonic() + within
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not any(pid_alive(pid) for pid in pids)


def _ray_processes(temp_dir: Path) -> list[str]:
    """Command lines of the processes (gcs_server, raylet, ...) that run out of `temp_dir`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(temp_dir) in cmdline:
            found.append(cmdline)
    return found


@pytest.fixture(scope="module")
def ray_tmp() -> Iterator[Path]:
    # A short directory of its own, not pytest's numbered one: Ray's unix sockets live below
    # it and a socket path holds at most 107 bytes (after 60-odd runs on one machine,
    # /tmp/pytest-of-root/pytest-61/popen-gw1/ray0 was a character too long).
    temp_dir = Path(tempfile.mkdtemp(prefix="rsray-"))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RINGSERVE_RAY_TMPDIR", str(temp_dir))
            mp.delenv("RAY_ADDRESS", raising=False)  # a private Ray, never the caller's cluster
            yield temp_dir
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> dict[str, list[int]]:
    from gpu_helpers import make_runner

    return _greedy(make_runner(tiny_llama_dir, num_blocks=NUM_BLOCKS))


@pytest.fixture(scope="module")
def token_file_existed() -> bool:
    return TOKEN_FILE.exists()


@pytest.fixture(scope="module")
def executor(
    ray_tmp: Path, tiny_llama_dir: Path, token_file_existed: bool
) -> Iterator[RayExecutor]:
    ex = RayExecutor(_config(tiny_llama_dir))
    ex.initialize_kv_cache(ex.determine_num_blocks())
    yield ex
    ex.shutdown()


def test_engine_args_accept_ray_and_get_class_picks_it(tiny_llama_dir: Path) -> None:
    config = _config(tiny_llama_dir)
    assert config.parallel_config.distributed_executor_backend == "ray"
    assert executor_class(config) is RayExecutor


def test_tp1_matches_in_process_runner(executor: RayExecutor, reference: dict[str, list[int]]) -> None:
    assert _greedy(ExecutorRunner(executor)) == reference


def test_two_steps_in_flight_and_logprob_arrays(
    executor: RayExecutor, reference: dict[str, list[int]], tiny_llama_dir: Path
) -> None:
    import numpy as np
    from gpu_helpers import make_runner

    assert executor.max_concurrent_batches == 2
    first = executor.execute_model(_prefill(100, "a0", PROMPTS[0], 200), non_block=True)
    second = executor.execute_model(_prefill(101, "a1", PROMPTS[2], 210), non_block=True)
    assert isinstance(first, Future) and isinstance(second, Future)
    out1, out0 = second.result(timeout=10), first.result(timeout=10)
    assert (out0.step_id, out1.step_id) == (100, 101)
    assert out0.sampled_token_ids == [[reference["r0"][0]]]
    assert out1.sampled_token_ids == [[reference["r2"][0]]]
    executor.execute_model(SchedulerOutput(102, finished_req_ids=["a0", "a1"]))

    so = _prefill(103, "lp", PROMPTS[2], 220)
    so.scheduled_new_reqs[0].sampling_params = SamplingParams(temperature=0.0, prompt_logprobs=5)
    got = executor.execute_model(so)
    want = make_runner(tiny_llama_dir, num_blocks=NUM_BLOCKS).execute_model(so)
    executor.execute_model(SchedulerOutput(104, finished_req_ids=["lp"]))
    plp, want_plp = got.prompt_logprobs["lp"], want.prompt_logprobs["lp"]
    assert plp.logprobs.nbytes > 256  # large enough to travel as its own zmq frame
    np.testing.assert_array_equal(plp.token_ids, want_plp.token_ids)
    np.testing.assert_allclose(plp.logprobs, want_plp.logprobs, rtol=1e-5, atol=1e-6)
    plp.logprobs[0, 0] = 0.0  # owned, writable memory


def test_collective_rpc(executor: RayExecutor) -> None:
    assert executor.collective_rpc("determine_num_blocks") == [NUM_BLOCKS]
    with pytest.raises(WorkerError, match="rank 0: AttributeError"):
        executor.collective_rpc("no_such_method")
    with pytest.raises(WorkerError, match="private"):
        executor.collective_rpc("_profile_free_bytes")
    executor.check_health()  # a failed call is not an engine fault
    assert executor.collective_rpc("determine_num_blocks") == [NUM_BLOCKS]


def test_tp2_matches_then_killed_actor_fails_pending_step(
    executor: RayExecutor, tiny_llama_dir: Path, reference: dict[str, list[int]]
) -> None:
    import ray

    ex = RayExecutor(_config(tiny_llama_dir, tp=2))  # joins the module's Ray
    try:
        assert ex.collective_rpc("determine_num_blocks") == [NUM_BLOCKS, NUM_BLOCKS]
        ex.initialize_kv_cache(ex.determine_num_blocks())
        assert _greedy(ExecutorRunner(ex)) == reference
        pids = ex.worker_pids
        os.kill(pids[1], signal.SIGSTOP)  # rank 0 waits for it in the all-reduce: step pending
        future = ex.execute_model(_prefill(50, "x", [1, 2, 3], 0), non_block=True)
        time.sleep(0.05)
        assert not future.done()
        start = time.monotonic()
        ray.kill(ex.actors[1])
        with pytest.raises(WorkerDiedError, match=r"rank 1 "):
            future.result(timeout=10)
        assert time.monotonic() - start < 2.0
        with pytest.raises(WorkerDiedError):
            ex.check_health()
        with pytest.raises(WorkerDiedError):
            ex.execute_model(_prefill(51, "y", [1, 2, 3], 8))
    finally:
        ex.shutdown()
    ex.shutdown()  # idempotent
    # The raylet SIGKILLs an actor that cannot take the kill request (stopped) after ~5 s.
    assert _all_gone(pids, within=10.0)
    executor.check_health()  # the other executor is untouched


def test_shutdown_fails_pending_and_stops_ray(
    executor: RayExecutor, ray_tmp: Path, token_file_existed: bool
) -> None:
    """Runs last: it shuts the module's executor (and so the module's Ray) down."""
    import ray

    running = " ".join(_ray_processes(ray_tmp))
    assert "gcs_server" in running and "raylet" in running
    (pid,) = executor.worker_pids
    os.kill(pid, signal.SIGSTOP)  # a hung worker: only ray.kill can stop it
    future = executor.execute_model(_prefill(300, "z", [1, 2, 3], 0), non_block=True)
    start = time.monotonic()
    executor.shutdown()
    assert time.monotonic() - start < 10.0
    with pytest.raises(ExecutorShutdownError):
        future.result(timeout=1)
    executor.shutdown()  # idempotent
    assert not ray.is_initialized()
    assert _all_gone([pid])
    assert _ray_processes(ray_tmp) == []
    assert TOKEN_FILE.exists() == token_file_existed  # Ray wrote no token to ~/.ray
