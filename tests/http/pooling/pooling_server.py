"""`ringserve serve` on a pooling checkpoint as a subprocess on a free port, for a module of
tests to share (one engine start per module), and the checks of an OpenAI-shaped error."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

MODEL = "tiny"
READY_TIMEOUT_S = 90.0
SERVE = (sys.executable, "-m", "ringserve.cli", "serve")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PoolingServer:
    """A `ringserve serve MODEL` subprocess (its own session, killed with its group on
    exit), served as `tiny`; `http` is a client bound to it once it is ready."""

    def __init__(self, model: Path, log: Path, extra: Sequence[str] = ()) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.cmd = [*SERVE, str(model), "--port", str(self.port), "--served-model-name", MODEL,
                    "--device", "cpu", "--kv-cache-memory", "16MiB", "--disable-log-stats",
                    *extra]
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def __enter__(self) -> PoolingServer:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.http.close()
        self.kill()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"exited with {self.proc.returncode}:\n{self.output()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.1)
        raise AssertionError(f"not ready in {READY_TIMEOUT_S} s:\n{self.output()}")

    def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """POST a JSON body (the model named `tiny` unless the body names one)."""
        return self.http.post(path, json={"model": MODEL, **body})


def error_of(response: httpx.Response, status: int = 400,
             param: str | None = None) -> str:
    """The message of an OpenAI-shaped error, after checking its status, shape and param."""
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    message: str = error["message"]
    return message
