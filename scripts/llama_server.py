"""A llama-server for the benchmarks that compare with it (bench_spec, bench_lora): started on a
free localhost port with the given arguments, waited for, asked over HTTP, and killed with its
whole process group whatever happens."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any


class LlamaServer:
    """`binary -m gguf --port P --host 127.0.0.1 *args`, its output in `log_path`.

    Raises:
        RuntimeError: the server exited or was not ready within `ready_s` seconds.
    """

    def __init__(self, binary: str, gguf: Path, args: list[str], log_path: Path,
                 ready_s: float = 120.0) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [binary, "-m", str(gguf.resolve()), "--port", str(port), "--host",
                    "127.0.0.1", *args]
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.cmd, stdout=log_path.open("wb"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + ready_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited {self.proc.returncode}: see "
                                       f"{log_path}")
                with contextlib.suppress(OSError), \
                        urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server not ready in {ready_s:.0f} s: see "
                                       f"{log_path}")
                time.sleep(0.5)
        except BaseException:
            self.close()
            raise

    def post(self, route: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        """POST `body` as JSON to `route`; the JSON reply."""
        request = urllib.request.Request(self.url + route, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            result: dict[str, Any] = json.loads(reply.read())
        return result

    def close(self) -> None:
        """Kill the server's process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
