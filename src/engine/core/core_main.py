"""The engine-core process's entry point: `python -m ringserve.engine.core.core_main`.

Started by a multiprocess client (`mp_client.CoreProcess`); parses the launch flags, installs
the lifeline and signal handlers (the parent's `lifeline.STOP_SIGNAL` ends the loop and exits
0, SIGUSR1 is the output thread's death, SIGTERM and SIGINT are ignored: a stop of the whole
process group must not end the core under the server's drain), reads the `EngineConfig` (msgpack on stdin), picks the
executor (the real one, or a null one for tests and benchmarks), and runs
`core_proc.EngineCoreProc` under the fault sentinel until shutdown. The process then leaves
with `os._exit` (every thread and socket is closed by then: no interpreter teardown).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import traceback
from typing import Any

import msgspec

from ringserve import envs
from ringserve.config import EngineConfig
from ringserve.engine.cluster.wire import (
    STARTUP_FAILED_SETTING_STATUS,
    STARTUP_FAILED_STATUS,
    ClusterTopology,
)
from ringserve.engine.core.core_proc import EngineCoreProc, OutputThreadDied, raise_output_died
from ringserve.engine.core.sentinel import FaultSentinel
from ringserve.gpu.executor.base import Executor
from ringserve.lifeline import STOP_SIGNAL, ignore_group_signals, install_lifeline


class _Shutdown(BaseException):
    """Raised in the main thread by the parent's stop signal (not an Exception: no fault
    handler catches it)."""


def _raise_shutdown(signum: int, frame: Any) -> None:
    # One-shot: a second stop signal (the server's group stop, then its own) must not land
    # in the `finally` that closes the core.
    signal.signal(STOP_SIGNAL, signal.SIG_IGN)
    raise _Shutdown


def _executor_class(choice: str) -> type[Executor] | None:
    """The executor `--executor` names (None: the configured one); RINGSERVE_NULL_STEP_MS
    turns the default into a null executor whose steps take that long."""
    null_step_ms = envs.null_step_ms()
    if null_step_ms is not None and choice == "default":
        import functools

        from ringserve.gpu.executor.null import NullExecutor

        return functools.partial(  # type: ignore[return-value]
            NullExecutor, step_s=null_step_ms / 1000)
    if choice == "null":
        from ringserve.gpu.executor.null import NullExecutor

        return NullExecutor
    if choice == "null-mp":
        from ringserve.gpu.executor.null import NullMultiprocExecutor

        return NullMultiprocExecutor
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the engine-core process (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="ringserve.engine.core.core_main")
    parser.add_argument("--engine-index", type=int, required=True)
    parser.add_argument("--input-addr", action="append", required=True,
                        help="a frontend's ROUTER (repeated: one per frontend)")
    parser.add_argument("--output-addr", action="append", required=True,
                        help="the same frontend's PULL (repeated, in the same order)")
    parser.add_argument("--topology", default=None,
                        help="the scaled-out deployment's ClusterTopology, msgpack in hex")
    parser.add_argument("--lifeline-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--executor", choices=("default", "null", "null-mp"), default="default")
    parser.add_argument("--greet-not-before", type=float, default=None,
                        help="send the ready handshake no earlier than this time.monotonic()")
    ns = parser.parse_args(argv)
    install_lifeline(ns.lifeline_fd, ns.parent_pid, f"ringserve::EngineCore_DP{ns.engine_index}")
    signal.signal(STOP_SIGNAL, _raise_shutdown)
    signal.signal(signal.SIGUSR1, raise_output_died)
    # Ctrl-C in a terminal, systemd and `kill 0` signal the whole process group (or cgroup);
    # the parent decides when this core stops (STOP_SIGNAL, or the lifeline), so a draining
    # server keeps its engine.
    ignore_group_signals()
    config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=EngineConfig)
    executor_class = _executor_class(ns.executor)
    topology = (msgspec.msgpack.decode(bytes.fromhex(ns.topology), type=ClusterTopology)
                if ns.topology else None)
    secure = None
    if topology is not None:
        from ringserve.engine.cluster.auth import ClusterAuth

        auth = ClusterAuth.load(envs.cluster_secret_file())
        if auth is not None:
            secure = auth.secure_client
    proc = EngineCoreProc(config, ns.engine_index, ns.input_addr, ns.output_addr, executor_class,
                          topology=topology, secure=secure,
                          greet_not_before=ns.greet_not_before)
    status = 0
    try:
        if proc.start_core():
            status = FaultSentinel(proc).run()
        else:
            setting = (proc.start_error.startswith("ValueError: ")
                       and "ModelDirectoryError" not in proc.start_error)
            status = STARTUP_FAILED_SETTING_STATUS if setting else STARTUP_FAILED_STATUS
            if topology is not None:  # the supervisor's log says why, before it stops
                print(f"ringserve: engine core {ns.engine_index} failed to start: "
                      f"{proc.start_error}", file=sys.stderr)
    except _Shutdown:
        status = 0
    except OutputThreadDied:
        status = 1  # nothing more can be sent; the frontend sees the exit
    except Exception as exc:
        traceback.print_exc()
        proc.fail_all(exc)
        status = 1
    finally:
        # A later stop must not cut close(); the first one may land right here when the run
        # just ended on its own (a full test run saw its traceback from this line): it asks
        # for what happens next anyway.
        with contextlib.suppress(_Shutdown):
            signal.signal(STOP_SIGNAL, signal.SIG_IGN)
        proc.close()
    return status


def run_process() -> None:
    """Run `main` and leave the process with its status, flushing stdout and stderr first."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: every thread and socket is already closed


if __name__ == "__main__":
    run_process()
