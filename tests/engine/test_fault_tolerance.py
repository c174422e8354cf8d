"""Fault tolerance of an engine core (mp executor, TP 1, tiny model): a killed worker ends the
streams with an error and leaves the engine unhealthy, not dead; `retry` rebuilds the workers
(same greedy tokens after), `abort` and the recovery timeout end the engine, auto-retry
recovers without an operator, and a hung worker (SIGSTOP) is a fault by the step timeout."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import trio

from ringserve import EngineArgs, RequestOutputKind, SamplingParams
from ringserve.engine.errors import EngineDeadError, EngineGenerateError, EngineRecoveringError
from ringserve.engine.frontend.async_llm import AsyncLLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True,
                      output_kind=RequestOutputKind.DELTA)
PROMPT = {"prompt_token_ids": list(range(20, 33))}


def ft_engine(model_dir: Path, **kw: Any) -> AsyncLLM:
    """An AsyncLLM with the mp executor (one worker process) on `model_dir`."""
    values: dict[str, Any] = {"model": str(model_dir), "device": "cpu", "max_model_len": 512,
                              "kv_cache_memory": 16 << 20, "distributed_executor_backend": "mp",
                              **kw}
    return AsyncLLM.from_engine_args(EngineArgs(**values))


def _title(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")


def worker_pids(llm: AsyncLLM) -> list[int]:
    """The worker processes of the engine's (only) core."""
    assert llm.client is not None
    core = llm.client.processes[0].pid
    kids: list[int] = []
    for task in Path(f"/proc/{core}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return [pid for pid in kids if _title(pid).startswith("ringserve::Worker_TP")]


async def greedy_tokens(llm: AsyncLLM) -> list[int]:
    """The tokens of one greedy request."""
    outputs = [o async for o in llm.generate(PROMPT, GREEDY)]
    return list(outputs[-1].outputs[0].token_ids)


async def wait_status(llm: AsyncLLM, status: str, timeout: float = 30.0) -> dict[str, Any]:
    """Poll the engine's fault status until its engine 0 reports `status`."""
    with trio.fail_after(timeout):
        while True:
            engine = llm.fault_status().engines[0]
            if engine.status == status:
                return {"status": engine.status, "fault_info": engine.fault_info,
                        "last_ft_request_id": engine.last_ft_request_id,
                        "ft_error": engine.ft_error}
            await trio.sleep(0.05)


async def stream_until_fault(llm: AsyncLLM, fault: Any) -> tuple[int, BaseException | None]:
    """Stream a long request, call `fault()` after its second output; (outputs, error)."""
    count = 0
    try:
        async for _ in llm.generate(PROMPT, LONG):
            count += 1
            if count == 2:
                fault()
    except EngineGenerateError as exc:
        return count, exc
    return count, None


def core_exitcode(llm: AsyncLLM, timeout: float = 20.0) -> int | None:
    """The core process's exit status once it has exited."""
    assert llm.client is not None
    proc = llm.client.processes[0]
    assert proc.exited.wait(timeout), "the engine core did not exit"
    return proc.proc.returncode


@pytest.mark.slow
async def test_worker_death_then_retry_then_abort(tiny_llama_dir: Path) -> None:
    async with ft_engine(tiny_llama_dir) as llm:
        before = await greedy_tokens(llm)
        (worker,) = worker_pids(llm)
        count, error = await stream_until_fault(
            llm, lambda: os.kill(worker, signal.SIGKILL))
        assert error is not None and "engine fault" in str(error), (count, error)
        status = await wait_status(llm, "unhealthy")
        assert "WorkerDied" in (status["fault_info"] or ""), status
        assert llm.is_running and not llm.errored and not llm.is_healthy and llm.recovering
        with pytest.raises(EngineRecoveringError, match="recovering from a fault"):
            await greedy_tokens(llm)

        rid = await llm.apply_fault_instruction("retry")
        status = await wait_status(llm, "healthy")
        assert status["last_ft_request_id"] == rid and status["fault_info"] is None
        assert worker_pids(llm) and worker_pids(llm) != [worker]
        assert await greedy_tokens(llm) == before
        stats = (await llm.call_utility("get_stats"))[0]
        assert stats["kv_cache_usage"] == 0.0

        with pytest.raises(ValueError, match="allowed: retry, abort"):
            await llm.apply_fault_instruction("reboot")
        await llm.apply_fault_instruction("abort")
        await wait_status(llm, "dead")
        assert core_exitcode(llm) == 0
        with pytest.raises(EngineDeadError):
            await greedy_tokens(llm)


@pytest.mark.slow
async def test_auto_retry_recovers_without_an_instruction(tiny_llama_dir: Path) -> None:
    async with ft_engine(tiny_llama_dir, fault_tolerance_auto_retry=1) as llm:
        before = await greedy_tokens(llm)
        (worker,) = worker_pids(llm)
        os.kill(worker, signal.SIGKILL)  # idle: the executor's failure callback wakes the core
        await wait_status(llm, "unhealthy", timeout=10)
        status = await wait_status(llm, "healthy")
        assert status["last_ft_request_id"] == "auto-retry-1"
        assert await greedy_tokens(llm) == before


@pytest.mark.slow
async def test_hung_worker_is_a_fault_and_the_recovery_timeout_ends_the_engine(
        tiny_llama_dir: Path) -> None:
    async with ft_engine(tiny_llama_dir, execute_model_timeout_s=1.0,
                         engine_recovery_timeout_sec=2.0) as llm:
        (worker,) = worker_pids(llm)
        try:
            _, error = await stream_until_fault(llm, lambda: os.kill(worker, signal.SIGSTOP))
            assert error is not None and "execute_model did not finish" in str(error), error
            await wait_status(llm, "unhealthy", timeout=5)
            status = await wait_status(llm, "dead", timeout=15)
            assert "TimeoutError" in (status["fault_info"] or ""), status
            assert core_exitcode(llm) == 1
            assert llm.errored
        finally:
            if Path(f"/proc/{worker}").exists():
                os.kill(worker, signal.SIGKILL)


@pytest.mark.slow
async def test_hung_core_fails_its_streams_within_the_timeout(tiny_llama_dir: Path) -> None:
    """SIGSTOP of the engine core itself (not a worker) under a stream: the frontend hears
    nothing from it for --execute-model-timeout-s, so the stream ends with an engine fault
    while the core is still stopped (before, it waited for SIGCONT), the core is UNHEALTHY and
    new requests are refused as recovering. Woken, the core faults by itself (its step is past
    the timeout, or it reads the frontend's notice; its outputs for the failed request are
    dropped); `retry` brings it back
    with the same greedy tokens, no request or KV block in use and its old worker gone."""
    async with ft_engine(tiny_llama_dir, execute_model_timeout_s=2.0) as llm:
        assert llm.client is not None
        before = await greedy_tokens(llm)
        core, workers = llm.client.processes[0].pid, worker_pids(llm)
        try:
            with trio.fail_after(30):
                _, error = await stream_until_fault(llm, lambda: os.kill(core, signal.SIGSTOP))
            assert error is not None and "engine fault" in str(error), error
            assert "hung" in str(error), error
            status = await wait_status(llm, "unhealthy", timeout=1)
            assert "hung" in (status["fault_info"] or ""), status
            with pytest.raises(EngineRecoveringError, match="recovering from a fault"):
                await greedy_tokens(llm)
        finally:
            os.kill(core, signal.SIGCONT)
        with trio.fail_after(30):
            while llm.client.hung:  # until it is heard from again (retry reaches it then)
                await trio.sleep(0.05)
        await llm.apply_fault_instruction("retry")
        await wait_status(llm, "healthy")
        assert await greedy_tokens(llm) == before
        stats = (await llm.call_utility("get_stats"))[0]
        assert stats["num_running_reqs"] == 0 and stats["kv_cache_usage"] == 0.0
        assert llm.output_processor.get_num_unfinished_requests() == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in workers)


@pytest.mark.slow
async def test_worker_hung_in_sleep_is_a_fault(tiny_llama_dir: Path) -> None:
    """A worker that does not answer `sleep` within --execute-model-timeout-s is an engine
    fault (the core no longer waits forever): the call fails, the core is UNHEALTHY, and
    `retry` brings it back with the same greedy tokens."""
    async with ft_engine(tiny_llama_dir, execute_model_timeout_s=1.0) as llm:
        before = await greedy_tokens(llm)
        # A step may still be in flight after the last output; sleep drains it first.
        await llm.call_utility("sleep", 1)
        await llm.call_utility("wake_up")
        (worker,) = worker_pids(llm)
        os.kill(worker, signal.SIGSTOP)
        try:
            with trio.fail_after(15), pytest.raises(
                    ValueError, match="WorkerTimeoutError: sleep did not finish"):
                await llm.call_utility("sleep", 1)
            status = await wait_status(llm, "unhealthy", timeout=10)
            assert "WorkerTimeoutError" in (status["fault_info"] or ""), status
            await llm.apply_fault_instruction("retry")
            await wait_status(llm, "healthy")
            assert (await llm.call_utility("is_sleeping")) == [0]
            assert await greedy_tokens(llm) == before
        finally:
            if Path(f"/proc/{worker}").exists():
                os.kill(worker, signal.SIGKILL)


@pytest.mark.slow
async def test_killed_core_is_restarted(tiny_llama_dir: Path) -> None:
    """SIGKILL of the core process: its stream fails at once, the core is UNHEALTHY (new
    requests refused as recovering) until a new process is ready, then HEALTHY again with
    the same greedy tokens; its old workers follow it."""
    async with ft_engine(tiny_llama_dir) as llm:
        assert llm.client is not None
        before = await greedy_tokens(llm)
        old_core, old_workers = llm.client.processes[0].pid, worker_pids(llm)
        count = 0
        with pytest.raises(EngineDeadError, match="SIGKILL; it is being restarted"):
            async for _ in llm.generate(PROMPT, LONG):
                count += 1
                if count == 2:
                    os.kill(old_core, signal.SIGKILL)
        assert count < 400
        status = llm.fault_status().engines[0]
        if status.status == "unhealthy":  # the new core may already be up on a fast machine
            assert "being restarted" in (status.fault_info or ""), status
            with pytest.raises(EngineRecoveringError, match="recovering"):
                await greedy_tokens(llm)
        if 0 in llm.client.restarting:
            # A retry while a core is being restarted goes to the other cores (none here): the
            # restarting one comes back by itself, so the instruction does not fail (issue 45).
            await llm.apply_fault_instruction("retry")
        await wait_status(llm, "healthy", timeout=60)
        assert llm.is_running and llm.is_healthy and llm.client.restarts == [1]
        assert llm.client.processes[0].pid != old_core
        assert await greedy_tokens(llm) == before
        assert llm.output_processor.get_num_unfinished_requests() == 0
        for pid in old_workers:
            with trio.fail_after(10):
                while Path(f"/proc/{pid}").exists() and _state(pid) not in ("Z", "X"):
                    await trio.sleep(0.05)


@pytest.mark.slow
async def test_crash_looping_core_ends_the_engine(tiny_llama_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A core that already used up its restarts within the window is not restarted again:
    the engine is dead, and the reason says why."""
    monkeypatch.setenv("RINGSERVE_CORE_RESTART_LIMIT", "1")
    async with ft_engine(tiny_llama_dir) as llm:
        assert llm.client is not None
        os.kill(llm.client.processes[0].pid, signal.SIGKILL)
        await wait_status(llm, "healthy", timeout=60)
        with trio.fail_after(60):
            while llm.client.restarts != [1]:
                await trio.sleep(0.05)
        os.kill(llm.client.processes[0].pid, signal.SIGKILL)
        with trio.fail_after(10):
            while not llm.errored:
                await trio.sleep(0.02)
        assert llm.client.restarts == [1]
        with pytest.raises(EngineDeadError, match="not restarted: it was restarted 1 time"):
            await greedy_tokens(llm)


async def test_a_bad_restart_limit_fails_the_start(tiny_llama_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGSERVE_CORE_RESTART_LIMIT", "many")
    with pytest.raises(ValueError, match="RINGSERVE_CORE_RESTART_LIMIT: got 'many'"):
        async with ft_engine(tiny_llama_dir):
            pass


@pytest.mark.slow
async def test_killed_core_without_fault_tolerance_ends_the_engine(
        tiny_llama_dir: Path) -> None:
    async with ft_engine(tiny_llama_dir, enable_fault_tolerance=False) as llm:
        assert llm.client is not None
        os.kill(llm.client.processes[0].pid, signal.SIGKILL)
        with trio.fail_after(10):
            while not llm.errored:
                await trio.sleep(0.02)
        assert llm.client.restarts == [0]
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            await greedy_tokens(llm)


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "X"
    return stat[stat.rfind(")") + 2]


@pytest.mark.slow
def test_offline_llm_retry_after_a_worker_death(tiny_llama_dir: Path) -> None:
    """`LLM`: a fault's requests come back with finish reason "error" (and new ones while the
    core waits); `apply_fault_instruction("retry")` brings the same greedy output back."""
    from ringserve import LLM

    with LLM(str(tiny_llama_dir), device="cpu", max_model_len=512, kv_cache_memory=16 << 20,
             distributed_executor_backend="mp") as llm:
        before = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        engine = llm.llm_engine.engine_core
        core = engine.process.pid  # type: ignore[attr-defined]
        kids = [int(k) for task in Path(f"/proc/{core}/task").iterdir()
                for k in (task / "children").read_text().split()]
        (worker,) = [pid for pid in kids if _title(pid).startswith("ringserve::Worker_TP")]
        os.kill(worker, signal.SIGKILL)
        refused = None
        for _ in range(100):  # the idle core notices the death within moments
            (out,) = llm.generate([PROMPT], GREEDY, use_tqdm=False)
            refused = out.outputs[0]
            if refused.finish_reason == "error":
                break
        assert refused is not None and refused.finish_reason == "error", refused
        with pytest.raises(ValueError, match="allowed: retry, abort"):
            llm.apply_fault_instruction("reboot")
        llm.apply_fault_instruction("retry")
        after = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert after == before
        llm.apply_fault_instruction("retry")  # healthy: a no-op


@pytest.mark.slow
async def test_killed_core_of_two_fails_only_its_requests(tiny_llama_dir: Path) -> None:
    """DP=2 (null model): killing core 1 fails only the streams routed to it; core 0's go
    on to the end; new requests go to core 0 meanwhile; core 1 comes back."""
    args = EngineArgs(model=str(tiny_llama_dir), device="cpu", max_model_len=2048,
                      kv_cache_memory=16 << 20, num_gpu_blocks_override=4096,
                      data_parallel_size=2)
    params = SamplingParams(max_tokens=2000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    async with AsyncLLM.from_engine_args(args, executor="null") as llm:
        client = llm.client
        assert client is not None
        outcomes: dict[str, str] = {}
        started = [trio.Event() for _ in range(8)]

        async def stream(i: int) -> None:
            try:
                async for _ in llm.generate({"prompt_token_ids": [5 + i] * 8}, params, f"s{i}"):
                    started[i].set()
                    await trio.sleep(0.001)
                outcomes[f"s{i}"] = "finished"
            except EngineDeadError as exc:
                outcomes[f"s{i}"] = str(exc)

        owners: dict[str, int | None] = {}
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(stream, i)
            with trio.fail_after(30):
                for event in started:
                    await event.wait()
            # The core sees each request under its internal id (the handle).
            handles = llm.output_processor.handles_of
            owners = {f"s{i}": client.engine_of(handles([f"s{i}"])[0]) for i in range(8)}
            os.kill(client.processes[1].pid, signal.SIGKILL)
            with trio.fail_after(10):
                while 1 not in client.restarting:
                    await trio.sleep(0.005)
            # Core 0 is healthy: a new request is served meanwhile (by core 0).
            out = [o async for o in llm.generate({"prompt_token_ids": [9] * 4},
                                                 SamplingParams(max_tokens=4))]
            assert out[-1].finished
        assert sorted(owners.values()) == [0] * 4 + [1] * 4, owners
        for rid, engine in owners.items():
            if engine == 0:
                assert outcomes[rid] == "finished", outcomes
            else:
                assert "engine core 1 killed by signal SIGKILL" in outcomes[rid], outcomes
        with trio.fail_after(60):
            while llm.fault_status().engines[1].status != "healthy":
                await trio.sleep(0.05)
        assert client.restarts == [0, 1] and llm.is_healthy
        assert len(await llm.call_utility("ping")) == 2
        assert llm.output_processor.get_num_unfinished_requests() == 0


@pytest.mark.slow
async def test_a_core_reaped_before_the_watch_starts_is_seen_dead(tiny_llama_dir: Path) -> None:
    """The race the engine's start can lose: the core dies (and its watcher thread reaps it)
    before `watch_cores` opens its pidfd; the death is still reported, with its signal."""
    from ringserve.engine.frontend.async_client import AsyncMPClient

    config = EngineArgs(model=str(tiny_llama_dir), device="cpu", max_model_len=512,
                        kv_cache_memory=16 << 20, enable_fault_tolerance=False,
                        ).create_engine_config()
    client = await AsyncMPClient.create(config, executor="null")
    try:
        proc = client.processes[0]
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.exited.wait(10)
        deaths: list[tuple[int, str]] = []
        with trio.fail_after(10):
            await client.watch_cores(lambda index, reason: deaths.append((index, reason)))
        assert deaths == [(0, "engine core 0 killed by signal SIGKILL")], deaths
        assert client.dead is not None and "SIGKILL" in client.dead
    finally:
        client.shutdown()


def test_restart_budget_counts_restarts_within_its_window(monkeypatch: pytest.MonkeyPatch) -> None:
    from ringserve.engine.frontend import fault_tolerance

    monkeypatch.setenv("RINGSERVE_CORE_RESTART_LIMIT", "2")
    monkeypatch.setenv("RINGSERVE_CORE_RESTART_WINDOW_S", "10")
    clock = [100.0]
    monkeypatch.setattr(fault_tolerance.time, "monotonic", lambda: clock[0])
    budget = fault_tolerance.RestartBudget()
    assert budget.spend() is None
    clock[0] += 6
    assert budget.spend() is None
    assert "restarted 2 time(s) within 10 s" in (budget.spend() or "")
    clock[0] += 5  # the first restart is out of the window now
    assert budget.spend() is None
    assert budget.spend() is not None
