"""The fault sentinel: the engine core's fault-tolerance policy around its busy loop.

`FaultSentinel.run` is what an engine-core process (`core_main.main`) runs. It runs
`EngineCoreProc.run_busy_loop`; an exception out of it (a worker died, `execute_model` raised
or exceeded `--execute-model-timeout-s`, a call to the workers between steps such as `sleep`
failed or exceeded that timeout) is an engine fault. With fault tolerance on, the
sentinel then

1. ends every in-flight request with finish reason ERROR (the clients' streams end with an
   error at once), forgets the steps in flight and frees every block;
2. publishes UNHEALTHY (`EngineCoreOutputs.fault_status`, a `FaultStatus`);
3. waits, up to `engine_recovery_timeout_sec` from the fault, for a fault instruction through
   the utility channel (`UtilityCall` named `FAULT_INSTRUCTION_METHOD`, args
   `[instruction, ft_request_id]`), refusing new requests meanwhile with an ERROR output
   ("the engine is recovering from a fault"):
   * `retry`: shut the broken executor down and build a new one (new workers and rings,
     weights reloaded, the same number of KV blocks), a fresh scheduler; publish HEALTHY and
     go back to the busy loop. A retry that fails leaves the core UNHEALTHY (`ft_error` says
     why) and still waiting;
   * `abort`: publish DEAD and return exit status 0;
   * nothing in time: publish DEAD and re-raise the original error (the process exits 1).

With `fault_tolerance_auto_retry` N the sentinel retries by itself up to N times per fault,
with exponential backoff, before it waits for an operator. With fault tolerance off it
re-raises at once (fail fast: every request fails, the dead notice goes out, exit 1).

An instruction that reaches a healthy core is answered too: `retry` is a no-op, `abort`
fails every request and shuts the core down.
"""

from __future__ import annotations

import logging
import queue
import time
import traceback
from typing import Any

from ringserve.engine.core.core_proc import EngineCoreProc
from ringserve.engine.core.faults import FaultInstruction, describe
from ringserve.engine.errors import RECOVERING_MESSAGE
from ringserve.engine.wire import (
    FAULT_INSTRUCTION_METHOD,
    FAULT_INSTRUCTIONS,
    AddRequest,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineStatus,
    FaultStatus,
    FinishReason,
    UtilityCall,
    UtilityOutput,
)

logger = logging.getLogger(__name__)

# Auto-retry backoff: 0.5 s, 1 s, 2 s, ... at most this many seconds.
_MAX_BACKOFF_S = 10.0
_ABORTED_MESSAGE = "the engine was aborted by an operator"


class FaultSentinel:
    """Runs an engine core's busy loop under the fault-tolerance policy (module docstring).

    Args:
        proc: the engine-core process object (its core must have started).
    """

    def __init__(self, proc: EngineCoreProc) -> None:
        self.proc = proc
        self.config = proc.config.fault_tolerance_config
        self.last_ft_request_id: str | None = None

    def run(self) -> int:
        """Serve until shutdown; the exit status (0 after an `abort` instruction).

        Raises:
            Exception: the fault, with fault tolerance off or when no instruction came in time.
        """
        while True:
            try:
                self.proc.run_busy_loop()
            except FaultInstruction as signal:
                if not self._instruction_while_healthy(signal.call):
                    return 0
            except Exception as exc:
                if not self.config.enable_fault_tolerance:
                    raise
                logger.error("engine core %d: engine fault\n%s", self.proc.engine_index,
                             "".join(traceback.format_exception(exc)))
                if not self._recover(exc):
                    return 0

    # -- instructions ------------------------------------------------------------------------

    def _instruction_while_healthy(self, call: UtilityCall) -> bool:
        """Answer an instruction on a healthy core; False when it was `abort`."""
        instruction, ft_request_id = _instruction_of(call)
        if instruction == "abort":
            self._abort(call, ft_request_id)
            return False
        if instruction == "retry":
            self.last_ft_request_id = ft_request_id
            self._reply(call, result=str(EngineStatus.HEALTHY))
            self._publish(EngineStatus.HEALTHY)
        else:
            self._reply(call, failure=_unknown(instruction))
        return True

    def _recover(self, error: Exception) -> bool:
        """Handle a fault: True once healthy again, False after `abort`.

        Raises:
            Exception: `error`, when no instruction came within the recovery timeout.
        """
        core = self.proc.core
        assert core is not None  # run_busy_loop checked it
        fault = describe(error)
        self.proc.announce_fault(error)
        self.proc.send_outputs(core.fail_all_requests(f"engine fault: {fault}"))
        self._publish(EngineStatus.UNHEALTHY, fault)
        timeout = self.config.engine_recovery_timeout_sec
        deadline = time.monotonic() + timeout
        for attempt in range(self.config.fault_tolerance_auto_retry):
            backoff = min(0.5 * 2 ** attempt, _MAX_BACKOFF_S)
            call = self._wait_for_instruction(min(deadline, time.monotonic() + backoff), fault)
            if call is not None:
                outcome = self._apply(call, fault)
                if outcome is not None:
                    return outcome
            if time.monotonic() >= deadline:
                break
            logger.warning("engine core %d: automatic retry %d of %d", self.proc.engine_index,
                           attempt + 1, self.config.fault_tolerance_auto_retry)
            if self._retry(None, f"auto-retry-{attempt + 1}", fault):
                return True
        while True:
            call = self._wait_for_instruction(deadline, fault)
            if call is None:
                self._publish(EngineStatus.DEAD, fault,
                              ft_error=f"no fault instruction within {timeout:g} s")
                raise error
            outcome = self._apply(call, fault)
            if outcome is not None:
                return outcome

    def _apply(self, call: UtilityCall, fault: str) -> bool | None:
        """Act on an instruction while unhealthy: True healthy, False aborted, None still
        unhealthy (a failed retry, or an unknown instruction)."""
        instruction, ft_request_id = _instruction_of(call)
        if instruction == "retry":
            return True if self._retry(call, ft_request_id, fault) else None
        if instruction == "abort":
            self._abort(call, ft_request_id)
            return False
        self._reply(call, failure=_unknown(instruction))
        return None

    def _retry(self, call: UtilityCall | None, ft_request_id: str | None, fault: str) -> bool:
        """Replace the executor; publish the outcome and answer `call`. True on success."""
        core = self.proc.core
        assert core is not None
        self.last_ft_request_id = ft_request_id
        started = time.monotonic()
        try:
            core.rebuild_executor()
            self.proc.join_lockstep()
        except Exception as exc:
            logger.error("engine core %d: retry failed\n%s", self.proc.engine_index,
                         "".join(traceback.format_exception(exc)))
            failure = f"retry failed: {describe(exc)}"
            self._publish(EngineStatus.UNHEALTHY, fault, ft_error=failure)
            if call is not None:
                self._reply(call, failure=failure)
            return False
        self.proc.watch_executor()
        logger.warning("engine core %d: recovered in %.1f s", self.proc.engine_index,
                       time.monotonic() - started)
        self._publish(EngineStatus.HEALTHY)
        if call is not None:
            self._reply(call, result=str(EngineStatus.HEALTHY))
        return True

    def _abort(self, call: UtilityCall, ft_request_id: str | None) -> None:
        """Fail every request, publish DEAD and answer `call` (the process exits next)."""
        core = self.proc.core
        assert core is not None
        self.last_ft_request_id = ft_request_id
        self.proc.send_outputs(core.fail_all_requests(_ABORTED_MESSAGE))
        # The answer first: the frontend takes DEAD as the end of the engine.
        self._reply(call, result=str(EngineStatus.DEAD))
        self._publish(EngineStatus.DEAD, _ABORTED_MESSAGE)

    # -- while unhealthy -----------------------------------------------------------------------

    def _wait_for_instruction(self, deadline: float, fault: str) -> UtilityCall | None:
        """Serve the input queue until an instruction arrives (returned) or `deadline`
        passes (None): new requests and other utility calls are refused."""
        inputs = self.proc.input_queue
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                message = inputs.get(timeout=remaining)
            except queue.Empty:
                return None
            if isinstance(message, AddRequest):
                self._refuse(message)
            elif isinstance(message, UtilityCall):
                if message.method == FAULT_INSTRUCTION_METHOD:
                    return message
                self._reply(message, failure=f"{RECOVERING_MESSAGE} ({fault})")
            # Aborts have nothing left to abort; a stale executor failure is the same fault.

    def _refuse(self, message: AddRequest) -> None:
        request = message.request
        output = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR,
                                  stop_reason=RECOVERING_MESSAGE)
        self.proc.send(request.client_index, EngineCoreOutputs(
            engine_index=self.proc.engine_index, outputs=[output],
            finished_requests=[request.request_id]))

    # -- messages ------------------------------------------------------------------------------

    def _publish(self, status: EngineStatus, fault_info: str | None = None,
                 ft_error: str | None = None) -> None:
        self.proc.broadcast(EngineCoreOutputs(
            engine_index=self.proc.engine_index, timestamp=time.monotonic(),
            fault_status=FaultStatus(status, fault_info, self.last_ft_request_id, ft_error)))

    def _reply(self, call: UtilityCall, *, result: Any = None,
               failure: str | None = None) -> None:
        self.proc.send(call.client_index, EngineCoreOutputs(
            engine_index=self.proc.engine_index,
            utility_output=UtilityOutput(call.call_id, failure_message=failure, result=result)))


def _instruction_of(call: UtilityCall) -> tuple[str, str | None]:
    """(instruction, ft_request_id) from a fault-instruction call's arguments."""
    args = call.args
    instruction = str(args[0]) if args else ""
    ft_request_id = str(args[1]) if len(args) > 1 and args[1] is not None else None
    return instruction, ft_request_id


def _unknown(instruction: str) -> str:
    return f"fault instruction: got {instruction!r}, allowed: {', '.join(FAULT_INSTRUCTIONS)}"
