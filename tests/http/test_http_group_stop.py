"""A stop signal to the whole process group of `ringserve serve` is a clean stop (issue 48).

systemd's default (`KillMode=control-group`), `kill 0`, container runtimes and a terminal's
Ctrl-C signal every process at once: the server, its engine core and the core's workers. The
core and the workers ignore SIGTERM and SIGINT; the server drains and then stops them itself
(`ringserve.lifeline.STOP_SIGNAL`). Before, the core died of the group's SIGTERM: a stream in
flight ended with an error while the server "restarted" the core (with
`--no-enable-fault-tolerance`: "the engine died", exit 1), and a core death seen in the same
scheduling step as the server's own shutdown ended the stop with "the engine died: the engine
was shut down" and exit 1.

The group's delivery order decides the race, so the stops here do not leave it to chance: the
signal to the group while a stream runs; after a request, at once; and the worst order made
deterministic, the core and its workers signalled before the server. Every stop must drain the
stream to its end, log "stopped", exit 0, and leave no process in the group and no
shared-memory segment of the run. The repeated stops and the scaled-out deployment (frontends,
coordinator; every process signalled, as systemd does) run under CI=true only (`LONG` in
tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trio
from test_http_server import LiveServer, _completion_body, _stream_events

from ringserve import EngineArgs
from ringserve.engine.frontend.async_llm import AsyncLLM

pytestmark = pytest.mark.slow

MP = ("--distributed-executor-backend", "mp")  # a worker process under the core, with rings
FLAGS = (*MP, "--shutdown-timeout", "30")
SCALED_OUT = ("--data-parallel-size", "2", "--api-server-count", "2", "--shutdown-timeout", "30")
# What the old code logged or printed when the core died of the group's signal.
SYMPTOMS = ("engine died", "restarting it", "Traceback")


# -- the process group -----------------------------------------------------------------------


def _group(pgid: int) -> list[int]:
    """Every live process of process group `pgid` (zombies included: not yet reaped)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[2]) == pgid:  # state, ppid, pgrp
            members.append(int(entry))
    return members


def _segments(pids: list[int]) -> list[str]:
    """The shared-memory segments these processes created (`ringserve-<pid>-...`)."""
    prefixes = tuple(f"ringserve-{pid}-" for pid in pids)
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefixes))


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _group_signal(live: LiveServer, signum: int) -> Callable[[], None]:
    """Signal the whole group, as `kill 0` / killpg / a terminal does."""
    return lambda: os.killpg(live.pid, signum)


def _children_first(live: LiveServer) -> Callable[[], None]:
    """SIGTERM to every process of the group but the server, then (a moment later, long enough
    for a core that obeys it to have exited) to the server: the group's worst delivery order,
    made deterministic."""
    def deliver() -> None:
        _signal_all([pid for pid in _group(live.pid) if pid != live.pid], signal.SIGTERM)
        time.sleep(0.5)
        os.kill(live.pid, signal.SIGTERM)
    return deliver


def _whole_tree(live: LiveServer) -> Callable[[], None]:
    """SIGTERM to every process of the server's group, children first (systemd signals its
    cgroup: processes in a process group of their own, as a scaled-out deployment's API
    servers are, get it too)."""
    def deliver() -> None:
        tree = _descendants(live.pid)
        _signal_all(tree, signal.SIGTERM)
        os.kill(live.pid, signal.SIGTERM)
    return deliver


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in (int(c) for c in path.read_text().split()):
            found += [child, *_descendants(child)]
    return found


# -- one stop --------------------------------------------------------------------------------


async def _stop_with_stream_in_flight(live: LiveServer, deliver: Callable[[], None],
                                      max_tokens: int = 64) -> None:
    """Stop while a stream runs: it must still run to its end (finish reason "length")."""
    events: list[str] = []
    async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
        async for event in _stream_events(client, _completion_body(max_tokens)):
            events.append(event)
            if len(events) == 2:
                deliver()
    assert events[-1] == "[DONE]", (events[-3:], live.output())
    final = json.loads(events[-2])
    assert "error" not in final and final["choices"][0]["finish_reason"] == "length", (
        final, live.output())


async def _stop_after_request(live: LiveServer, deliver: Callable[[], None]) -> None:
    """Stop as soon as a request has finished."""
    async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
        body = {**_completion_body(8), "stream": False}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
    deliver()


def _check_clean_stop(live: LiveServer, run_pids: list[int]) -> None:
    """Exit 0 after "stopped", none of the old symptoms, nothing left behind."""
    code = live.wait(timeout=60)
    output = live.output()
    assert code == 0, output
    assert "stopped" in output, output
    for symptom in SYMPTOMS:
        assert symptom not in output, output
    # The server stopped its cores, and they their workers, before it exited: nothing of the
    # group is left (a lifeline kill would be the only other way out, and is not waited for).
    assert _group(live.pid) == [], output
    assert _segments(run_pids) == [], output


STOPS = {
    "sigterm-in-flight": lambda live: _stop_with_stream_in_flight(
        live, _group_signal(live, signal.SIGTERM)),
    "sigint-in-flight": lambda live: _stop_with_stream_in_flight(
        live, _group_signal(live, signal.SIGINT)),
    "sigterm-after-request": lambda live: _stop_after_request(
        live, _group_signal(live, signal.SIGTERM)),
    "sigterm-core-first": lambda live: _stop_with_stream_in_flight(live, _children_first(live)),
}


async def _one_stop(model: Path, log: Path, how: str, extra: tuple[str, ...] = FLAGS) -> None:
    with LiveServer(model, log, extra) as live:
        run_pids = _group(live.pid)
        assert len(run_pids) >= 3, live.output()  # the server, its core, the core's worker
        await STOPS[how](live)
        _check_clean_stop(live, run_pids)


# -- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", list(STOPS))
async def test_group_signal_drains_and_exits_zero(tiny_llama_dir: Path, tmp_path: Path,
                                                  how: str) -> None:
    await _one_stop(tiny_llama_dir, tmp_path / "server.log", how)


async def test_group_signal_repeated(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Every kind of stop, again and again: a race left anywhere shows as one failed stop."""
    for round_ in range(3):
        for how in STOPS:
            await _one_stop(tiny_llama_dir, tmp_path / f"server-{how}-{round_}.log", how)


async def test_scaled_out_deployment_stops_cleanly_when_every_process_is_signalled(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`--api-server-count 2 -dp 2`: SIGTERM to every process (API servers, cores, the
    coordinator, the supervisor), as systemd does; the API servers drain their streams."""
    with LiveServer(tiny_llama_dir, tmp_path / "server.log", SCALED_OUT) as live:
        run_pids = [live.pid, *_descendants(live.pid)]
        assert len(run_pids) == 6, live.output()  # 2 frontends, 2 cores, the coordinator
        finished: list[str] = []

        async def one() -> None:
            events: list[str] = []
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
                async for event in _stream_events(client, _completion_body(64)):
                    events.append(event)
            finished.append(json.loads(events[-2])["choices"][0].get("finish_reason")
                            or "error")

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(one)
                await trio.sleep(1.0)
                _whole_tree(live)()
        assert finished == ["length"] * 4, live.output()
        assert live.wait(timeout=60) == 0, live.output()
        for symptom in SYMPTOMS:
            assert symptom not in live.output(), live.output()
        deadline = time.monotonic() + 5
        while any(Path(f"/proc/{pid}").exists() for pid in run_pids[1:]):
            assert time.monotonic() < deadline, live.output()
            await trio.sleep(0.05)
        assert _segments(run_pids) == [], live.output()


class _ShutdownWhenWatcherWakes(trio.abc.Instrument):
    """Calls `llm.shutdown()` just before the core watcher's next step: the core's death and
    the shutdown land in the same scheduling step, as when the group's SIGTERM reaches the
    core and the server together."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm
        self.fired = False

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if not self.fired and task.name.endswith("._watch_core"):
            self.fired = True
            self.llm.shutdown()


async def test_core_death_in_the_step_of_shutdown_is_part_of_the_stop(
        tiny_llama_dir: Path) -> None:
    """`AsyncLLM.run` returns after `shutdown()` even when the core's death is seen in the
    same scheduling step (it raised EngineDeadError("the engine was shut down"): the server
    reported "the engine died" and exited 1)."""
    args = EngineArgs(model=str(tiny_llama_dir), device="cpu", max_model_len=512,
                      kv_cache_memory=16 << 20, disable_log_stats=True)
    llm = AsyncLLM.from_engine_args(args, executor="null")
    instrument = _ShutdownWhenWatcherWakes(llm)
    async with trio.open_nursery() as nursery:
        await nursery.start(llm.run)
        assert llm.client is not None
        core = llm.client.processes[0]
        os.kill(core.pid, signal.SIGKILL)
        assert core.exited.wait(10)  # blocking: the event loop has not seen the death yet
        trio.lowlevel.add_instrument(instrument)
    assert instrument.fired
