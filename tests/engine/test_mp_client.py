"""Engine-core process plumbing: the core must survive the thread that launched it."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pytest

from ringserve import EngineArgs
from ringserve.engine.frontend.mp_client import CoreProcess


@pytest.mark.slow
def test_core_outlives_the_short_lived_thread_that_started_it(tiny_llama_dir: Path) -> None:
    """Regression: PR_SET_PDEATHSIG fires when the *forking thread* exits. AsyncLLM started
    its cores from a trio worker thread, which retires after ~10 s idle, and the core was
    SIGKILLed under a running server."""
    config = EngineArgs(model=str(tiny_llama_dir), device="cpu",
                        num_gpu_blocks_override=64).create_engine_config()
    holder: list[CoreProcess] = []
    with tempfile.TemporaryDirectory() as tmp:
        addr_in, addr_out = f"ipc://{tmp}/in", f"ipc://{tmp}/out"

        def start_and_linger() -> None:
            core = CoreProcess(config, 0, addr_in, addr_out, "null")
            holder.append(core)
            # Stay alive until the child has armed its parent-death signal, then exit.
            deadline = time.monotonic() + 60
            while "EngineCore_DP0" not in _cmdline(core.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)

        thread = threading.Thread(target=start_and_linger)
        thread.start()
        thread.join()
        (core,) = holder
        try:
            time.sleep(1.0)
            assert not core.exited.is_set(), f"the core died: {core.describe_exit()}"
        finally:
            core.terminate()
        assert core.exited.wait(10)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""
