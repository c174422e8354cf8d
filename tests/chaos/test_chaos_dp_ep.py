"""The chaos suite's DP=2 + expert-parallel case: a live `ringserve serve` of a tiny
Qwen3-MoE with `-dp 2 --enable-expert-parallel` (each core's worker holds half the experts; the
cores step in lockstep; two API servers, the default for -dp 2, so the lockstep runs under the
scaled-out supervisor), fault tolerance on, `--execute-model-timeout-s 3`:

1. 16 streams in flight over both cores, SIGKILL one core: every stream, on either core, ends
   with an error event and `[DONE]` within 2 s (the survivor's collectives fail at once);
   both engines report unhealthy; `retry` (the killed core is restarted by the server and
   rejoins) makes both healthy within 60 s; 16 greedy requests equal the fault-free run's.
2. SIGSTOP a core (a hang): the other's step gives up after the timeout and fails its
   streams; the hung core's own end as well (its frontends hear nothing from it for the
   timeout), and it is woken after that; the same checks.
3. Pool check: no request running or waiting and no KV block in use (`/metrics`).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from test_chaos import EXECUTE_TIMEOUT_S, SLACK, STREAMS, Chaos, _pool_is_full, _write_report
from test_http_server import ADMIN_KEY, LiveServer, _auth

from ringserve.gpu.testing import tiny_model

FLAGS = ("--data-parallel-size", "2", "--enable-expert-parallel", "--admin-api-key", ADMIN_KEY,
         "--execute-model-timeout-s", str(EXECUTE_TIMEOUT_S),
         "--engine-recovery-timeout-sec", "120")


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except FileNotFoundError:
        return ""


class LockstepChaos(Chaos):
    """`Chaos` over two engine cores (TP=1: the worker runs in its core's process)."""

    def tree(self) -> tuple[int, list[int]]:
        # With -dp 2 the server runs 2 API servers and a DP coordinator next to the cores.
        cores = [pid for pid in self.live.children()
                 if _title(pid).startswith("ringserve::EngineCore_DP")]
        assert len(cores) == 2, (cores, self.live.output()[-3000:])
        self.seen.update(cores)
        return cores[0], cores

    async def status(self) -> dict[str, Any]:
        """Both engines' common status ("mixed" while they differ)."""
        response = await self.client.get("/fault_tolerance/status", headers=_auth(ADMIN_KEY))
        assert response.status_code == 200, response.text
        engines: list[dict[str, Any]] = response.json()["engines"]
        statuses = {e["status"] for e in engines}
        return {"status": statuses.pop() if len(statuses) == 1 else "mixed", "engines": engines}

    async def retry(self) -> float:
        start = time.monotonic()
        response = await self.client.post("/fault_tolerance/apply", headers=_auth(ADMIN_KEY),
                                          json={"instruction": "retry", "params": {}})
        assert response.status_code == 202, response.text
        await self.wait_status("healthy", 60.0 * SLACK)
        return time.monotonic() - start


async def _core_kill(chaos: LockstepChaos, rng: random.Random) -> None:
    _, cores = chaos.tree()
    victim = rng.choice(cores)
    ended, health = await chaos.fault_under_streams(lambda: os.kill(victim, signal.SIGKILL))
    assert ended < 2.0 * SLACK, ended
    state = await chaos.wait_status("unhealthy", 10.0)
    # An API server watches a core it did not start: it sees the exit, not its signal (the
    # supervisor's log names that).
    assert any(f"(pid {victim}) exited" in (e["fault_info"] or "")
               for e in state["engines"]), state
    recover = await chaos.retry()
    assert victim not in chaos.tree()[1]
    await chaos.check_recovered([victim])
    chaos.record("SIGKILL a core (DP=2, EP)", detect=ended, health=health, recover=recover)


async def _core_hang(chaos: LockstepChaos) -> None:
    """Every stream ends about the timeout after the SIGSTOP: the other core's by its failed
    collective, the hung core's own by its frontends, which hear nothing from it. It is woken
    once they have ended (or a second after the timeout)."""
    _, cores = chaos.tree()
    victim = cores[1]
    wake = threading.Timer(EXECUTE_TIMEOUT_S + 1.0, lambda: os.kill(victim, signal.SIGCONT))
    try:
        ended, health = await chaos.fault_under_streams(
            lambda: (os.kill(victim, signal.SIGSTOP), wake.start()))
    finally:
        wake.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
    assert ended < EXECUTE_TIMEOUT_S + 1.0 + 2.0 * SLACK, ended
    await chaos.wait_status("unhealthy", 10.0 * SLACK)
    recover = await chaos.retry()
    await chaos.check_recovered([])
    chaos.record("SIGSTOP a core (DP=2, EP)", detect=ended, health=health, recover=recover)


async def test_chaos_dp_ep(tmp_path: Path) -> None:
    live = LiveServer(tiny_model("qwen3moe"), tmp_path / "server.log", FLAGS)
    live.cmd.remove("--disable-log-stats")  # the pool check reads /metrics
    with live:
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
            chaos = LockstepChaos(live, client)
            chaos.baseline = await chaos.greedy()
            await _core_kill(chaos, random.Random(int(os.environ.get("RINGSERVE_CHAOS_SEED",
                                                                     "9"))))
            await _core_hang(chaos)
            await _pool_is_full(chaos)
    assert chaos.streams["errored"] + chaos.streams["finished"] == 2 * STREAMS
    assert chaos.streams["errored"] == 2 * STREAMS  # lockstep: no core runs on alone
    _write_report(chaos)  # RINGSERVE_CHAOS_REPORT=path.json keeps the timings
