"""Elastic data parallelism: grow or shrink a running `AsyncLLM`'s engine cores in two phases.

`prepare_elastic_dp(n)` gets a new size ready without touching routing:
- scale-up: it starts cores `old..n-1` on the client's sockets and waits for their handshakes
  (they load the model meanwhile; requests keep going to the old cores);
- scale-down: it marks cores `n..old-1` for removal.
A prepare that fails (a new core exits, reports an error or is not ready within
`RINGSERVE_ENGINE_READY_TIMEOUT_S`) stops what it started and leaves the deployment as it was.

`commit_elastic_dp(drain_timeout)` switches:
- scale-up: the new cores are routed to from that moment;
- scale-down: no new request goes to the leaving cores, and the commit returns once they have
  finished every request they own (nothing is aborted or lost), then stops them. A drain that
  takes longer than `drain_timeout` rolls back: the leaving cores take requests again and the
  size stays.
`cancel_elastic_dp()` drops a prepared scale. `scale_elastic_dp(n)` does both phases (the
`POST /scale_elastic_dp` route).

In a scaled-out deployment (several API servers on one host) the supervisor owns the cores:
an API server runs each phase through it, and it switches every API server at the commit
(`ringserve.engine.cluster.elastic_cluster`).

Only what a new core would not have is refused, each with its reason (`ElasticScaleError`, a
400): expert parallelism (the cores step in lockstep over a fixed group), weights from a
trainer (the world size the trainer joined would change, and a new core would load the
checkpoint's weights, not the trainer's), cores asleep or paused, a core that is not healthy,
and engine cores on other hosts (`--headless`, `-dpl`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ringserve import envs
from ringserve.config import EngineConfig
from ringserve.engine.cluster.elastic_cluster import ScaleCall, call_supervisor, resized
from ringserve.engine.errors import EngineDeadError, EngineStartupError
from ringserve.engine.frontend.dp_client import DPLBAsyncMPClient
from ringserve.engine.frontend.mp_client import CoreProcess

DEFAULT_DRAIN_TIMEOUT_S = 120.0  # vLLM's default for /scale_elastic_ep
MAX_DATA_PARALLEL_SIZE = 512
_SUPERVISOR_SLACK_S = 30.0  # beyond a phase's own timeout, for the supervisor to answer


class ElasticScaleError(ValueError):
    """A scale that was refused or failed; the deployment is as it was. HTTP 400."""


class ScaleInProgressError(ElasticScaleError):
    """Another scale is being prepared or committed. HTTP 409."""


class ScaleFailedError(RuntimeError):
    """A scale that failed on the server's side (a new core did not start, or died before
    the commit); the deployment is as it was. HTTP 500."""


class DrainTimeoutError(TimeoutError):
    """A scale-down's leaving cores did not finish their requests in time; rolled back.
    HTTP 408."""


@dataclasses.dataclass
class ScalePlan:
    """A prepared scale: from `old_size` to `new_size` cores (`started`: the new ones)."""

    old_size: int
    new_size: int
    config: EngineConfig
    started: list[CoreProcess]


def check_new_size(value: object) -> int:
    """The new data-parallel size, checked.

    Raises:
        ElasticScaleError: not an integer in 1..MAX_DATA_PARALLEL_SIZE.
    """
    if isinstance(value, bool) or not isinstance(value, int) or \
            not 1 <= value <= MAX_DATA_PARALLEL_SIZE:
        raise ElasticScaleError(f"new_data_parallel_size: got {value!r}, allowed: an integer "
                                f"from 1 to {MAX_DATA_PARALLEL_SIZE}")
    return value


def check_drain_timeout(value: object) -> float:
    """The drain timeout in seconds, checked (a positive finite number)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not math.isfinite(value) or value <= 0:
        raise ElasticScaleError(f"drain_timeout: got {value!r}, allowed: a positive number "
                                "of seconds")
    return float(value)


class AsyncElasticDPMethods:
    """For `AsyncLLM` (which provides the client, the config, the output processor, the stat
    loggers and `call_utility`)."""

    client: Any
    config: EngineConfig
    attach: Any
    stat_loggers: Any
    call_utility: Callable[..., Awaitable[list[Any]]]  # AsyncLLM's
    _scale_plan: ScalePlan | None = None
    _scaling = False

    @property
    def is_scaling_elastic_dp(self) -> bool:
        """True from a prepare until its commit or cancel has finished."""
        return self._scaling or self._scale_plan is not None

    @property
    def data_parallel_size(self) -> int:
        """The engine cores requests are routed to now."""
        return int(self.config.parallel_config.data_parallel_size)

    def _elastic_client(self) -> DPLBAsyncMPClient:
        if self.attach is not None and not self.attach.topology.control_addr:
            raise ElasticScaleError(
                "elastic data parallelism is not supported with engine cores on other hosts "
                "(--headless, --data-parallel-size-local below --data-parallel-size)")
        client = self.client
        if client is None:
            raise EngineDeadError("the engine is not running (use `async with` or run())")
        if client.dead is not None:
            raise EngineDeadError(client.dead)
        assert isinstance(client, DPLBAsyncMPClient)  # what AsyncLLM starts
        return client

    async def _check_scalable(self, client: DPLBAsyncMPClient) -> None:
        parallel = self.config.parallel_config
        if parallel.enable_expert_parallel:
            raise ElasticScaleError("elastic data parallelism is not supported with "
                                    "--enable-expert-parallel: the cores step in lockstep "
                                    "over a group fixed at start-up")
        if self.config.weight_transfer_config is not None:
            raise ElasticScaleError("elastic data parallelism is not supported with "
                                    "--weight-transfer-config: a new core would serve the "
                                    "checkpoint's weights, not the trainer's, and the world "
                                    "size the trainer joined would change")
        for state in client.fault_states:
            if not state.healthy:
                raise ElasticScaleError(f"engine core {state.id} is not healthy "
                                        f"({state.fault_info}); scale once it has recovered")
        if any(await self.call_utility("is_sleeping")):
            raise ElasticScaleError("the engine cores are asleep: wake them up (/wake_up) "
                                    "before scaling")
        if any(await self.call_utility("is_paused")):
            raise ElasticScaleError("the engine cores are paused: resume them (/resume) "
                                    "before scaling")

    async def prepare_elastic_dp(self, new_data_parallel_size: int) -> None:
        """Get `new_data_parallel_size` cores ready without routing to the new ones (see the
        module docstring).

        Raises:
            ElasticScaleError: a bad size, or a scale that is refused.
            ScaleFailedError: a new core did not start (the ones started are stopped; the
                deployment is as it was).
            ScaleInProgressError: a scale is prepared or running already.
            EngineDeadError: the engine is not running.
        """
        size = check_new_size(new_data_parallel_size)
        client = self._elastic_client()
        if self.is_scaling_elastic_dp:
            planned = self._scale_plan
            raise ScaleInProgressError(
                "a scale is in progress" if planned is None else
                f"a scale to {planned.new_size} is prepared: commit or cancel it first")
        self._scaling = True
        try:
            await self._check_scalable(client)
            old = client.num_engines
            config = resized(self.config, size)
            started: list[CoreProcess] = []
            if self.attach is not None:
                await self._ask_supervisor(client, "prepare", size,
                                           envs.engine_ready_timeout_s())
            elif size > old:
                try:
                    started = await client.start_cores(config, range(old, size))
                except EngineStartupError as exc:
                    raise ScaleFailedError(f"{exc}; the deployment stays at {old} engine "
                                           "core(s)") from exc
            self._scale_plan = ScalePlan(old, size, config, started)
        finally:
            self._scaling = False

    async def _ask_supervisor(self, client: Any, phase: str, size: int = 0,
                              timeout: float = 0.0) -> None:
        """Run a phase on the supervisor of a scaled-out deployment (`elastic_cluster`).

        Raises:
            the error the supervisor's answer stands for.
        """
        answer = await call_supervisor(client, ScaleCall(phase, size, timeout),
                                       timeout + _SUPERVISOR_SLACK_S)
        errors: dict[str, type[Exception]] = {
            "refused": ElasticScaleError, "busy": ScaleInProgressError,
            "timeout": DrainTimeoutError, "failed": ScaleFailedError}
        if answer.kind:
            raise errors.get(answer.kind, ScaleFailedError)(answer.error)

    async def cancel_elastic_dp(self) -> None:
        """Drop the prepared scale: stop the cores it started (none is routed to)."""
        plan, self._scale_plan = self._scale_plan, None
        client = self.client
        if plan is None or not isinstance(client, DPLBAsyncMPClient):
            return
        if self.attach is not None:
            with trio.CancelScope(shield=True):
                await self._ask_supervisor(client, "cancel", timeout=10.0)
        elif plan.started:
            await client.stop_pending(plan.started)

    async def commit_elastic_dp(self, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        """Switch to the prepared size (see the module docstring). Whatever happens, the
        prepared scale is used up.

        Raises:
            ElasticScaleError: nothing is prepared.
            ScaleFailedError: a new core died since the prepare (the others are stopped;
                the deployment is as it was).
            DrainTimeoutError: a scale-down's drain took longer than `drain_timeout` (rolled
                back).
            EngineDeadError: the engine died meanwhile.
        """
        timeout = check_drain_timeout(drain_timeout)
        plan = self._scale_plan
        if plan is None:
            raise ElasticScaleError("no scale is prepared: call prepare_elastic_dp(n) first")
        if self._scaling:
            raise ScaleInProgressError("the prepared scale is being committed already")
        self._scaling = True
        try:
            client = self._elastic_client()
            if self.attach is not None:
                # The supervisor has each API server (this one too) switch, then answers.
                await self._ask_supervisor(client, "commit", plan.new_size, timeout)
                self._scale_plan = None  # used up: nothing to cancel
            elif plan.new_size > plan.old_size:
                self._commit_up(client, plan)
            elif plan.new_size < plan.old_size:
                await self._commit_down(client, plan, timeout)
        except BaseException:
            await self.cancel_elastic_dp()
            raise
        finally:
            self._scale_plan = None
            self._scaling = False

    def elastic_resized(self, size: int) -> None:
        """The cores are now `size` (a commit): the configuration and the stat loggers
        follow (a core restarted later starts at the new size)."""
        old = self.data_parallel_size
        config = resized(self.config, size)
        self.config = config
        if self.client is not None:
            self.client.config = config
        if self.stat_loggers is not None:
            for index in range(old, size):
                self.stat_loggers.add_engine(config, index)
            for index in range(size, old):
                self.stat_loggers.remove_engine(index)

    def _commit_up(self, client: DPLBAsyncMPClient, plan: ScalePlan) -> None:
        for proc in plan.started:
            if proc.exited.is_set():
                raise ScaleFailedError(
                    f"engine core {proc.engine_index} {proc.describe_exit()} after it was "
                    f"prepared; the deployment stays at {plan.old_size} engine core(s)")
        client.pending = []
        client.add_cores(plan.started)
        self.elastic_resized(plan.new_size)

    async def _commit_down(self, client: DPLBAsyncMPClient, plan: ScalePlan,
                           timeout: float) -> None:
        size = plan.new_size
        client.routable = size
        deadline = time.monotonic() + timeout
        leaving = set(range(size, plan.old_size))
        # A leaving core being restarted (its process died) is waited for like a request.
        while client.owned_from(size) or client.restarting & leaving:
            if client.dead is not None:
                raise EngineDeadError(client.dead)
            if time.monotonic() >= deadline:
                client.routable = client.num_engines
                raise DrainTimeoutError(
                    f"engine cores {size}..{plan.old_size - 1} still had "
                    f"{client.owned_from(size)} request(s) after {timeout:g} s "
                    f"(drain_timeout); the scale-down was rolled back: the deployment stays "
                    f"at {plan.old_size} engine cores")
            # An admin call, not a hot loop: the output handler finishes the requests.
            await trio.sleep(0.01)
        gone = client.remove_cores(size)
        self.elastic_resized(size)
        await client.stop_pending(gone)

    async def scale_elastic_dp(self, new_data_parallel_size: int,
                               drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        """`prepare_elastic_dp` then `commit_elastic_dp` (the errors of both)."""
        check_drain_timeout(drain_timeout)
        await self.prepare_elastic_dp(new_data_parallel_size)
        await self.commit_elastic_dp(drain_timeout)
