"""The engine-core process's side of a lockstep deployment (DP + expert parallelism): joining
the cores' waves, announcing a fault to them, and the busy loop that steps with them
(`LockstepProcMixin`, a base of `EngineCoreProc`; the waves themselves are
`ringserve.engine.core.dp_wave`).

A `sleep` that reaches a core inside a wave is applied when the wave ends (on every core at
the same step), never between two of its steps: at level 2 the core's experts leave with its
weights, and the wave's remaining dummy passes would leave its peers' exchanges waiting. The
frontend makes every core sleep together (`ringserve.engine.frontend.lockstep_sleep`), so the
wave ends at its next consensus step.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ringserve.engine.core.dp_wave import PeerFault, WaveSync, lockstep_timeout
from ringserve.engine.core.faults import FaultInstruction, describe
from ringserve.engine.wire import EngineCoreOutputs, UtilityCall, UtilityOutput

if TYPE_CHECKING:
    from ringserve.config import EngineConfig
    from ringserve.engine.core.engine_core import EngineCore

logger = logging.getLogger(__name__)

# Utility calls a core inside a wave applies only when the wave has ended.
_AT_WAVE_END = frozenset({"sleep"})


class WaveStarted:
    """Put in the input queue by the lockstep watcher: wave `number` of `epoch` has started
    on some core (`ringserve.engine.core.dp_wave`)."""

    def __init__(self, epoch: int, number: int) -> None:
        self.epoch, self.number = epoch, number


class PeerFaulted:
    """Put in the input queue by the lockstep watcher: a fault of `epoch` was announced."""

    def __init__(self, epoch: int, reason: str) -> None:
        self.epoch, self.reason = epoch, reason


class LockstepProcMixin:
    """`join_lockstep`, `announce_fault` and the lockstep busy loop for `EngineCoreProc`."""

    config: EngineConfig
    engine_index: int
    input_queue: queue.Queue[Any]
    waves: WaveSync | None
    # EngineCoreProc's:
    _drain_inputs: Callable[[bool], None]
    _call_utility: Callable[[EngineCore, UtilityCall], None]
    send_outputs: Callable[[dict[int, EngineCoreOutputs]], None]
    send: Callable[[int, Any], None]

    # Utility calls waiting for the end of the current wave (`defer_to_wave_end`).
    _at_wave_end: list[UtilityCall]

    def join_lockstep(self) -> None:
        """Join (again, after a retry: in the new epoch) the other cores' lockstep, when the
        deployment has one (`ringserve.engine.core.dp_wave`)."""
        parallel = self.config.parallel_config
        if not parallel.lockstep:
            return
        if self.waves is not None:
            self.waves.close()
        put = self.input_queue.put
        self.waves = WaveSync(
            self.engine_index, parallel.data_parallel_size, parallel.data_parallel_master_port,
            lockstep_timeout(self.config.fault_tolerance_config.execute_model_timeout_s),
            lambda epoch, n: put(WaveStarted(epoch, n)),
            lambda epoch, reason: put(PeerFaulted(epoch, reason)),
            parallel.dp_sync_interval)

    def announce_fault(self, error: BaseException) -> None:
        """An engine fault of this core ends the lockstep epoch for every core (a no-op
        without lockstep)."""
        if self.waves is not None and not isinstance(error, PeerFault):
            try:
                self.waves.announce_fault(f"engine core {self.engine_index}: {describe(error)}")
            except RuntimeError as exc:  # the frontend (and its store) is gone
                logger.warning("engine core %d: cannot announce the fault: %s",
                               self.engine_index, exc)

    def defer_to_wave_end(self, call: UtilityCall) -> bool:
        """Keep `call` for the end of the current wave when it must not run inside one;
        whether it was kept."""
        waves = self.waves
        if waves is None or not waves.running or call.method not in _AT_WAVE_END:
            return False
        self._at_wave_end.append(call)
        return True

    def run_lockstep(self, core: EngineCore, waves: WaveSync) -> None:
        """The busy loop of a lockstep deployment (see `ringserve.engine.core.dp_wave`): within a
        wave, a consensus step, then a real step or a dummy pass, on every core alike.

        Raises:
            Exception: an engine fault (the calls kept for the wave's end are answered with
                it first).
        """
        try:
            while True:
                self._drain_inputs(not (core.has_work() or waves.wants_to_run()))
                if not waves.enter(core.has_work()):
                    continue
                if not waves.any_work(core.has_work()):
                    self._run_at_wave_end(core)  # the wave has ended, on every core at once
                    continue
                outputs, ran = core.step()
                if not ran:
                    core.dummy_pass()
                if outputs:
                    self.send_outputs(outputs)
        except FaultInstruction:
            raise  # a healthy core's instruction: the loop goes on after it
        except Exception as exc:
            kept, self._at_wave_end = self._at_wave_end, []
            for call in kept:
                self.send(call.client_index, EngineCoreOutputs(
                    engine_index=self.engine_index,
                    utility_output=UtilityOutput(call.call_id, failure_message=describe(exc))))
            raise

    def _run_at_wave_end(self, core: EngineCore) -> None:
        while self._at_wave_end:
            self._call_utility(core, self._at_wave_end.pop(0))
