"""The multiprocess executor: worker processes over shm rings give the in-process runner's
greedy tokens (TP 1 and 2), keep two steps in flight, answer utility calls from every rank,
turn a worker's exception or death into a failed future at once, and leave no process or
/dev/shm segment behind, even when their parent is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from ringserve.config import EngineConfig
from ringserve.engine.arg_utils import EngineArgs
from ringserve.gpu.executor.base import Executor
from ringserve.gpu.executor.errors import ExecutorShutdownError, WorkerDiedError, WorkerError
from ringserve.gpu.executor.multiproc import MultiprocExecutor
from ringserve.gpu.executor.select import executor_class
from ringserve.gpu.wire import ModelRunnerOutput, NewRequestData, SchedulerOutput
from ringserve.sampling_params import SamplingParams
from ringserve.shm.liveness import pid_alive

PROMPTS = [list(range(20, 33)), [7, 8, 9], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0.0)
NUM_BLOCKS = 256


def _config(model_dir: Path, tp: int = 1) -> EngineConfig:
    return EngineArgs(
        model=str(model_dir), device="cpu", tensor_parallel_size=tp,
        distributed_executor_backend="mp", block_size=8, max_model_len=256,
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


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> dict[str, list[int]]:
    from gpu_helpers import make_runner

    return _greedy(make_runner(tiny_llama_dir, num_blocks=NUM_BLOCKS))


def _segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"ringserve-{os.getpid()}-")}


@pytest.fixture(scope="module")
def executor(tiny_llama_dir: Path) -> Iterator[MultiprocExecutor]:
    ex = MultiprocExecutor(_config(tiny_llama_dir))
    ex.initialize_kv_cache(ex.determine_num_blocks())
    yield ex
    ex.shutdown()


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def test_get_class_picks_mp(tiny_llama_dir: Path) -> None:
    assert executor_class(_config(tiny_llama_dir)) is MultiprocExecutor


def test_tp1_matches_in_process_runner(
    executor: MultiprocExecutor, reference: dict[str, list[int]]
) -> None:
    assert _greedy(ExecutorRunner(executor)) == reference
    assert _segments() == set()  # names are unlinked as soon as the workers attached
    (pid,) = executor.worker_pids
    assert "ringserve::Worker_TP0" in _cmdline(pid)


def _prefill(step_id: int, req_id: str, prompt: list[int], first_block: int) -> SchedulerOutput:
    nblocks = -(-len(prompt) // 8)
    new = NewRequestData(req_id, prompt, GREEDY, list(range(first_block, first_block + nblocks)), 0)
    return SchedulerOutput(step_id, [new], [], {req_id: len(prompt)}, len(prompt))


def test_two_steps_in_flight_complete_in_order(
    executor: MultiprocExecutor, reference: dict[str, list[int]]
) -> None:
    assert executor.max_concurrent_batches == 2
    first = executor.execute_model(_prefill(100, "a0", PROMPTS[0], 200), non_block=True)
    second = executor.execute_model(_prefill(101, "a1", PROMPTS[2], 210), non_block=True)
    assert isinstance(first, Future) and isinstance(second, Future)
    out1, out0 = second.result(timeout=10), first.result(timeout=10)
    assert (out0.step_id, out1.step_id) == (100, 101)
    assert out0.sampled_token_ids == [[reference["r0"][0]]]
    assert out1.sampled_token_ids == [[reference["r2"][0]]]
    executor.execute_model(SchedulerOutput(102, finished_req_ids=["a0", "a1"]))


def test_logprob_arrays_cross_out_of_band(executor: MultiprocExecutor, tiny_llama_dir: Path) -> None:
    import numpy as np
    from gpu_helpers import make_runner

    params = SamplingParams(temperature=0.0, logprobs=5, prompt_logprobs=5)
    so = _prefill(200, "lp", PROMPTS[2], 220)
    so.scheduled_new_reqs[0].sampling_params = params
    got = executor.execute_model(so)
    want = make_runner(tiny_llama_dir, num_blocks=NUM_BLOCKS).execute_model(so)
    executor.execute_model(SchedulerOutput(201, finished_req_ids=["lp"]))
    assert got.sampled_token_ids == want.sampled_token_ids
    assert got.logprobs is not None and want.logprobs is not None
    plp, want_plp = got.prompt_logprobs["lp"], want.prompt_logprobs["lp"]
    assert plp.logprobs.nbytes > 256  # large enough to travel as its own buffer
    for a, b in [(got.logprobs, want.logprobs), (plp, want_plp)]:
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-6)
    plp.logprobs[0, 0] = 0.0  # owned, writable memory: it outlives the ring frame


def test_collective_rpc(executor: MultiprocExecutor) -> None:
    assert executor.collective_rpc("determine_num_blocks") == [NUM_BLOCKS]
    with pytest.raises(WorkerError, match="rank 0: AttributeError"):
        executor.collective_rpc("no_such_method")
    with pytest.raises(WorkerError, match="private"):
        executor.collective_rpc("_profile_free_bytes")
    # A failed call is not an engine fault: the executor stays healthy and keeps working.
    executor.check_health()
    assert executor.collective_rpc("determine_num_blocks") == [NUM_BLOCKS]


@pytest.mark.slow
def test_step_exception_fails_future_with_worker_message(tiny_llama_dir: Path) -> None:
    ex = MultiprocExecutor(_config(tiny_llama_dir))
    try:
        # No KV cache yet: the worker's execute_model raises.
        future = ex.execute_model(_prefill(0, "x", [1, 2, 3], 0), non_block=True)
        message = r"worker rank 0 failed in step 0: RuntimeError: .*initialize_kv_cache"
        with pytest.raises(WorkerError, match=message) as info:
            future.result(timeout=10)
        assert "Traceback" in info.value.worker_traceback
        with pytest.raises(WorkerError):
            ex.check_health()
    finally:
        ex.shutdown()


@pytest.mark.slow
def test_worker_sigkill_fails_pending_step_at_once(tiny_llama_dir: Path) -> None:
    ex = MultiprocExecutor(_config(tiny_llama_dir))
    try:
        ex.initialize_kv_cache(NUM_BLOCKS)
        (pid,) = ex.worker_pids
        os.kill(pid, signal.SIGSTOP)  # keeps the step pending until the kill
        future = ex.execute_model(_prefill(0, "x", [1, 2, 3], 0), non_block=True)
        time.sleep(0.05)
        assert not future.done()
        start = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=r"rank 0 .*killed by signal 9"):
            future.result(timeout=5)
        assert time.monotonic() - start < 1.0
        with pytest.raises(WorkerDiedError):
            ex.check_health()
        with pytest.raises(WorkerDiedError):
            ex.execute_model(_prefill(1, "y", [1, 2, 3], 8))
    finally:
        ex.shutdown()
    ex.shutdown()  # idempotent
    assert not pid_alive(pid)
    assert _segments() == set()


@pytest.mark.slow
def test_shutdown_fails_pending_and_reaps(tiny_llama_dir: Path) -> None:
    ex = MultiprocExecutor(_config(tiny_llama_dir))
    pids = ex.worker_pids
    os.kill(pids[0], signal.SIGSTOP)  # a hung worker: only the signals can stop it
    future = ex.execute_model(_prefill(0, "x", [1, 2, 3], 0), non_block=True)
    start = time.monotonic()
    ex.shutdown()
    assert time.monotonic() - start < 5.0
    with pytest.raises(ExecutorShutdownError):
        future.result(timeout=1)
    assert not any(pid_alive(pid) for pid in pids)
    # With a step unanswered the workers are killed at once (no frame, no grace period).
    assert [p.returncode for p in ex._procs if p is not None] == [-signal.SIGKILL]
    assert _segments() == set()


def test_idle_shutdown_is_graceful(tiny_llama_dir: Path) -> None:
    ex = MultiprocExecutor(_config(tiny_llama_dir))
    ex.initialize_kv_cache(NUM_BLOCKS)
    ex.execute_model(_prefill(0, "x", [1, 2, 3], 0))
    ex.shutdown()
    assert [p.returncode for p in ex._procs if p is not None] == [0]  # left on the frame
    assert _segments() == set()


_PARENT = """
import sys, time
from ringserve.engine.arg_utils import EngineArgs
from ringserve.gpu.executor.multiproc import MultiprocExecutor
config = EngineArgs(model=sys.argv[1], device="cpu", tensor_parallel_size=int(sys.argv[2]),
                    distributed_executor_backend="mp", num_gpu_blocks_override=16,
                    ).create_engine_config()
ex = MultiprocExecutor(config)
print(" ".join(map(str, ex.worker_pids)), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_sigkilled_parent_leaves_no_worker(tiny_llama_dir: Path, tp: int) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(tiny_llama_dir), str(tp)], stdout=subprocess.PIPE
    )
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == tp and all(pid_alive(pid) for pid in pids)
        assert [_cmdline(pid).strip() for pid in pids] == [f"ringserve::Worker_TP{r}" for r in range(tp)]
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 2.0
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(pid_alive(pid) for pid in pids)
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(f"ringserve-{parent.pid}-")]
    assert leftovers == []


@pytest.mark.slow
def test_tp2_matches_in_process_runner(tiny_llama_dir: Path, reference: dict[str, list[int]]) -> None:
    ex = MultiprocExecutor(_config(tiny_llama_dir, tp=2))
    try:
        assert ex.collective_rpc("determine_num_blocks") == [NUM_BLOCKS, NUM_BLOCKS]
        ex.initialize_kv_cache(ex.determine_num_blocks())
        assert _greedy(ExecutorRunner(ex)) == reference
        assert [_cmdline(pid).strip() for pid in ex.worker_pids] == [
            "ringserve::Worker_TP0", "ringserve::Worker_TP1"
        ]
    finally:
        ex.shutdown()
    assert _segments() == set()
