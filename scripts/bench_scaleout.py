#!/usr/bin/env python3
"""Scale-out of the HTTP frontend (`ringserve serve --api-server-count N`): streamed tokens/s, P99
ITL and the CPU per streamed token of a frontend, with 1 and 2 API servers in one run.

The workload is frontend-bound on purpose: the engine cores run the null model
(`RINGSERVE_NULL_STEP_MS`: no weights, made-up tokens that are never EOS, each step a fixed
sleep of `--step-ms`), the tokenizer is the tiny test Llama's
(`ringserve.gpu.testing.tiny_model("llama")`), and `--concurrency` (1,024) streams of short
outputs (`--output-len` 16 tokens, `ignore_eos`, a short text prompt) run at once, a new one
starting on a connection as soon as its previous one ends, `--num-requests` (4,096) in all. The
step time: one step answers every running request, so with 1,024 streams the null engine offers
at most 1,024 tokens per 2 ms step (512k tokens/s, less its own scheduling time), far above
what one Python frontend streams (~2k tokens/s on the 2-core VM this was written on), so the
frontend is the bottleneck: its process at ~100% of a core with one API server is the check,
printed at the end. The step sleeps rather than computes, so the engine core only takes the CPU
its scheduling needs, as a GPU-bound core would; a 0 ms step would run steps back to back and
take CPU from the frontends it shares the cores with. A step much longer than 1,024 / (the
frontends' tokens/s) would make the engine the limit.

Each round (`--runs`) starts a server per `--api-servers` entry in turn (1, 2, 1, 2, ...: the
configurations alternate under the same background load), waits for `/health` and for every API
server to be serving, runs one warm-up request on each connection (so every connection is open
and accepted before the clock starts; which frontend the kernel gave how many connections is
printed), then the measured requests, and stops it (SIGTERM, then SIGKILL of the supervisor and
every process it had started).

The client is as cheap as Python gets, so the server, not the client, is measured: one process,
one epoll loop over `--concurrency` non-blocking keep-alive HTTP/1.1 sockets, each request a
prebuilt byte string, each receive one `recv` appended to the stream's buffer with its arrival
time; the SSE events are parsed only after the measured interval (JSON, token events, usage,
`[DONE]`, finish reason). One client process rather than several: on 2 shared cores more client
processes add no capacity, only context switches and CPU taken from the server; its CPU share
is measured and printed, so a reader can see it is small next to the frontends'.

Every stream is checked: HTTP 200, no error chunk, `[DONE]`, finish reason "length", and usage
`completion_tokens` == `--output-len` (the server may merge several tokens into one chunk when
a stream lags, so token events can be fewer than tokens; their count per stream is reported).
Failures are counted and printed, never dropped. Streamed tokens/s: the tokens received / (last
measured stream's end - first measured request's send). ITL: the gaps between consecutive token
events of a stream (vLLM's `bench serve` definition). CPU: utime + stime (/proc/<pid>/stat) of
every server process (supervisor, API servers, engine cores, coordinator) and of the client
over the measured interval only; "other" is the machine's busy time (/proc/stat) minus all of
these (whatever else runs on the machine: each round's ratio is printed with it, and the ratio
over the rounds where it stayed under 20% of a core). With one API server the deployment is one
process (hypercorn + the engine client) plus the engine core, so that process is the frontend;
with N > 1 a supervisor process owns N frontend processes.

The target (the issue): 2 API servers >= 1.4x one API server's tokens/s on 2 cores, taken per
round; the frontend's CPU per streamed token is compared with the ~37 µs per token reported for
a Python streaming server.

    .venv/bin/python scripts/bench_scaleout.py [--api-servers 1,2] [--runs 3]
        [--concurrency 1024] [--num-requests 4096] [--output-len 16] [--step-ms 2.0]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import importlib.metadata as md
import itertools
import json
import os
import platform
import resource
import select
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import timeit
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The quick brown fox jumps over the lazy dog and"
PYTHON_STREAMING_US = 37.0  # µs per streamed token, the figure for a Python server
TARGET_RATIO = 1.4
QUIET_OTHER_PCT = 20.0  # other processes' CPU (% of a core) under which a run counts as quiet
CLK_TCK = os.sysconf("SC_CLK_TCK")
END_OF_STREAM = b"data: [DONE]\n\n\r\n0\r\n\r\n"  # the [DONE] event, then the last chunk


# -- the server ------------------------------------------------------------------------------


@dataclass
class Proc:
    """One process of the deployment: its role, title, and start time (to never signal a
    reused pid)."""

    pid: int
    role: str  # "frontend", "supervisor", "engine core", "coordinator", "other"
    title: str
    start_ticks: int


@dataclass
class Deployment:
    """A running `ringserve serve`: the supervisor's Popen and every process found under it."""

    api_servers: int
    popen: subprocess.Popen[bytes]
    log: Path
    command: str
    procs: list[Proc] = field(default_factory=list)


class Stat(NamedTuple):
    """A process's CPU so far (user and system clock ticks) and its start time (ticks)."""

    user: int
    sys: int
    start: int


def proc_stat(pid: int) -> Stat:
    """`pid`'s utime, stime and start time, from /proc/<pid>/stat (every thread's CPU)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    return Stat(int(fields[11]), int(fields[12]), int(fields[19]))


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children of each of its threads, recursively)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = [int(k) for k in (task / "children").read_text().split()]
                found.extend(kids)
                todo.extend(kids)
    return found


def role_of(title: str, is_root: bool, api_servers: int) -> str:
    """The role of a process from its title (setproctitle's `ringserve::...`)."""
    if is_root:
        # One API server: no supervisor process; the served process is the frontend itself.
        return "supervisor" if api_servers > 1 else "frontend"
    for prefix, role in (("ringserve::APIServer", "frontend"),
                         ("ringserve::EngineCore", "engine core"),
                         ("ringserve::DPCoordinator", "coordinator")):
        if title.startswith(prefix):
            return role
    return "other"


def find_procs(dep: Deployment) -> list[Proc]:
    """The supervisor and every process under it, with their roles."""
    procs = []
    root = dep.popen.pid
    for pid in [root, *descendants(root)]:
        with contextlib.suppress(OSError):
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace").strip()
            procs.append(Proc(pid, role_of(title, pid == root, dep.api_servers), title[:80],
                              proc_stat(pid).start))
    return procs


def server_command(ns: argparse.Namespace, model: str, port: int, api_servers: int) -> list[str]:
    """`ringserve serve` of the benchmark (the null model comes from the environment)."""
    blocks = ns.concurrency * -(-(len(PROMPT) + ns.output_len) // 16)  # a token per char at most
    return [sys.executable, "-m", "ringserve.cli", "serve", model, "--port", str(port),
            "--served-model-name", "tiny", "--device", "cpu", "--kv-cache-memory", "16MiB",
            "--max-model-len", "512", "--disable-log-stats",
            "--api-server-count", str(api_servers),
            "--max-num-seqs", str(max(1024, ns.concurrency)),
            "--max-num-batched-tokens", "16384",
            "--num-gpu-blocks-override", str(max(4096, blocks)),
            *shlex.split(ns.server_args)]


def wait_ready(dep: Deployment, port: int, timeout_s: float) -> None:
    """Until /health answers 200 and the log says every API server is serving.

    Raises:
        RuntimeError: the server exited, or is not ready within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    healthy = False
    while True:
        if dep.popen.poll() is not None:
            raise RuntimeError(f"the server exited with {dep.popen.returncode}:\n"
                               f"{log_tail(dep.log)}")
        if not healthy:
            healthy = http_status(port, "/health") == 200
        # Each API server logs "serving <model> at" once it accepts connections: one that is
        # not yet serving would leave every connection to its siblings.
        if healthy and dep.log.read_text(errors="replace").count(" serving tiny at ") >= \
                dep.api_servers:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not ready in {timeout_s:.0f} s:\n"
                               f"{log_tail(dep.log)}")
        time.sleep(0.2)


def http_status(port: int, path: str) -> int:
    """The status of a GET (0 when nothing answers)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2.0) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            head = sock.recv(64)
            return int(head[9:12]) if head.startswith(b"HTTP/1.1 ") else 0
    except (OSError, ValueError):
        return 0


def log_tail(log: Path, lines: int = 30) -> str:
    """The last lines of a server log, indented."""
    with contextlib.suppress(OSError):
        text = log.read_text(errors="replace")
        return "\n".join("    " + ln for ln in text.splitlines()[-lines:])
    return "    (no log)"


@contextlib.contextmanager
def deployment(ns: argparse.Namespace, model: str, port: int, api_servers: int,
               log: Path) -> Iterator[Deployment]:
    """A started, ready server; stopped (and every process of it gone) on exit."""
    cmd = server_command(ns, model, port, api_servers)
    env = {**os.environ, "RINGSERVE_NULL_STEP_MS": str(ns.step_ms), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    with log.open("wb") as out:
        # Its own session: a Ctrl-C at the terminal reaches this script only, which stops it.
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True, cwd=ROOT)
    dep = Deployment(api_servers, popen, log,
                     f"RINGSERVE_NULL_STEP_MS={ns.step_ms} {shlex.join(cmd)}")
    try:
        wait_ready(dep, port, ns.ready_timeout)
        dep.procs = find_procs(dep)
        yield dep
    finally:
        stop(dep)


def stop(dep: Deployment) -> None:
    """SIGTERM the supervisor and wait; then SIGKILL it and every process found under it."""
    known = {p.pid: p.start_ticks for p in dep.procs}
    for pid in descendants(dep.popen.pid):  # anything started since the last look, too
        with contextlib.suppress(OSError):
            known.setdefault(pid, proc_stat(pid).start)
    if dep.popen.poll() is None:
        dep.popen.send_signal(signal.SIGTERM)
        try:
            dep.popen.wait(30)
        except subprocess.TimeoutExpired:
            print(f"!!! the server did not stop within 30 s of SIGTERM; SIGKILL\n"
                  f"{log_tail(dep.log)}")
            dep.popen.kill()
            dep.popen.wait()
    deadline = time.monotonic() + 5.0  # the children die by themselves within ~1 s
    while time.monotonic() < deadline and any(_alive(pid, t) for pid, t in known.items()):
        time.sleep(0.1)
    for pid, ticks in known.items():
        if _alive(pid, ticks):
            print(f"!!! pid {pid} outlived the supervisor; SIGKILL")
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int, start_ticks: int) -> bool:
    """`pid` is still the process that had this start time (and is not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return proc_stat(pid).start == start_ticks and state != "Z"
    except (OSError, IndexError):
        return False


def connections_per_proc(procs: list[Proc], port: int) -> dict[int, int]:
    """Established TCP connections on `port` held by each process (which frontend the
    kernel gave each client connection to)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            cols = line.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "01":
                inodes.add(f"socket:[{cols[9]}]")
    counts = {}
    for p in procs:
        n = 0
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{p.pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    n += os.readlink(fd) in inodes
        counts[p.pid] = n
    return counts


# -- the client ------------------------------------------------------------------------------


@dataclass
class Stream:
    """One request as received: the raw bytes and when each piece of them arrived."""

    sent: float
    raw: bytearray = field(default_factory=bytearray)
    recvs: list[tuple[float, int]] = field(default_factory=list)  # (time, len(raw) after)
    closed: bool = False  # the server closed the connection before the response ended
    hung: bool = False  # still running at the deadline
    retried: bool = False  # sent again: its keep-alive connection had been closed


class Client:
    """Up to `concurrency` keep-alive HTTP/1.1 connections driven by one epoll loop.

    A connection is opened when a request needs one and sends it at once: hypercorn closes a
    connection idle for 5 s (its keep-alive timeout), before its first request too. A request
    whose reused connection the server closed before answering a byte (that timeout racing
    the send) is sent once more on a new connection, as HTTP clients do; `retries` counts them.
    """

    def __init__(self, port: int, concurrency: int, body: bytes) -> None:
        self.port = port
        self.concurrency = concurrency
        self.request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                        ).encode() + body
        self.epoll = select.epoll()
        self.socks: dict[int, socket.socket] = {}
        self.streams: dict[int, Stream] = {}
        self.idle: list[int] = []  # open connections without a request
        self.reused: set[int] = set()  # connections that have completed a response
        self.retries = 0

    def _connect(self) -> int:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30.0)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self.socks[sock.fileno()] = sock
        self.epoll.register(sock.fileno(), select.EPOLLIN)
        return sock.fileno()

    def _drop(self, fd: int) -> None:
        self.epoll.unregister(fd)
        self.socks.pop(fd).close()
        self.reused.discard(fd)
        with contextlib.suppress(ValueError):
            self.idle.remove(fd)

    def close(self) -> None:
        """Close every connection (the server sees the streams still running end)."""
        for fd in list(self.socks):
            self._drop(fd)
        self.epoll.close()

    def refresh(self) -> None:
        """Drop the idle connections the server has closed (those that ended early in the
        warm-up may have been idle for its keep-alive timeout)."""
        for fd, _ in self.epoll.poll(0):
            if fd not in self.streams:
                self._receive(fd)

    def _start(self, stream: Stream | None = None) -> None:
        """Send a new request on an idle connection or a new one; or `stream` again, always
        on a new connection (an idle one is closed instead, to keep `concurrency` of them)."""
        if stream is None:
            fd = self.idle.pop() if self.idle else self._connect()
            stream = Stream(time.perf_counter())
        else:
            if self.idle:
                self._drop(self.idle[0])
            fd = self._connect()
        self.streams[fd] = stream
        self.socks[fd].send(self.request)  # a few hundred bytes: the socket buffer takes them

    def drive(self, total: int, timeout_s: float) -> list[Stream]:
        """Run `total` requests, `concurrency` at a time (a new one as soon as one ends);
        returns them all, those still running after `timeout_s` marked hung."""
        done: list[Stream] = []
        issued = 0
        while issued < min(total, self.concurrency):
            self._start()
            issued += 1
        deadline = time.perf_counter() + timeout_s
        while self.streams and time.perf_counter() < deadline:
            for fd, _ in self.epoll.poll(1.0):
                finished = self._receive(fd)
                if finished is None:
                    continue
                done.append(finished)
                if issued < total:
                    self._start()
                    issued += 1
        for stream in self.streams.values():
            stream.hung = True
            done.append(stream)
        self.streams.clear()
        return done

    def _receive(self, fd: int) -> Stream | None:
        """Read what arrived on `fd`; the stream if it ended (it leaves `streams`)."""
        stream = self.streams.get(fd)
        try:
            data = self.socks[fd].recv(1 << 18)
        except BlockingIOError:
            return None
        except OSError:
            data = b""
        if stream is None:  # bytes (or a close) outside any request: drop the connection
            self._drop(fd)
            return None
        if not data:
            del self.streams[fd]
            stale = fd in self.reused and not stream.raw and not stream.retried
            self._drop(fd)
            if stale:
                self.retries += 1
                stream.retried, stream.sent = True, time.perf_counter()
                self._start(stream)
                return None
            stream.closed = True
            return stream
        stream.raw += data
        stream.recvs.append((time.perf_counter(), len(stream.raw)))
        if not (stream.raw.endswith(END_OF_STREAM) or _ended_other(stream.raw)):
            return None
        del self.streams[fd]
        self.idle.append(fd)
        self.reused.add(fd)
        return stream


def _ended_other(raw: bytearray) -> bool:
    """A complete response that is not a 200 stream (an error with a Content-Length body)."""
    if raw.startswith(b"HTTP/1.1 200 "):
        return False
    head_end = raw.find(b"\r\n\r\n")
    if head_end < 0:
        return False
    for line in bytes(raw[:head_end]).lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(raw) >= head_end + 4 + int(line.split(b":")[1])
    return False


# -- the streams' analysis -------------------------------------------------------------------


@dataclass
class StreamResult:
    """What one stream delivered; `error` is empty for a stream that passed every check."""

    tokens: int = 0  # usage completion_tokens (the token events when there is no usage)
    events: int = 0  # SSE events that carried tokens
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def sse_events(raw: bytes, recvs: list[tuple[float, int]]) -> tuple[int, list[tuple[float, bytes]]]:
    """(HTTP status, [(arrival time, event bytes)]) of a chunked SSE response."""
    head_end = raw.find(b"\r\n\r\n")
    if head_end < 0 or not raw.startswith(b"HTTP/1.1 "):
        return 0, []
    status = int(raw[9:12])
    if status != 200:
        return status, [(recvs[-1][0], raw[head_end + 4:])]
    ends = [n for _, n in recvs]
    events: list[tuple[float, bytes]] = []
    payload = bytearray()
    pos = head_end + 4
    while (eol := raw.find(b"\r\n", pos)) >= 0:
        size = int(raw[pos:eol], 16)
        end = eol + 2 + size
        if size == 0 or end > len(raw):
            break
        payload += raw[eol + 2:end]
        arrived = recvs[min(bisect.bisect_left(ends, end), len(recvs) - 1)][0]
        while (k := payload.find(b"\n\n")) >= 0:
            events.append((arrived, bytes(payload[:k])))
            del payload[:k + 2]
        pos = end + 2
    return status, events


def analyze(stream: Stream, output_len: int) -> StreamResult:
    """Parse one stream and check it delivered `output_len` tokens and ended properly."""
    res = StreamResult()
    status, events = sse_events(bytes(stream.raw), stream.recvs)
    if status != 200:
        body = events[0][1].decode(errors="replace")[:300] if events else ""
        res.error = f"HTTP {status}: {body}" if status else "no HTTP response" + (
            " (connection closed)" if stream.closed else " (hung)" if stream.hung else "")
    times: list[float] = []
    usage = finish = None
    done = False
    for arrived, event in events if status == 200 else []:
        data = event.removeprefix(b"data: ")
        if data == b"[DONE]":
            done = True
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            res.error = f"error chunk: {json.dumps(chunk['error'])[:300]}"
        if chunk.get("usage"):
            usage = int(chunk["usage"]["completion_tokens"])
        if choices := chunk.get("choices"):
            finish = choices[0].get("finish_reason") or finish
            if choices[0].get("text") or choices[0].get("finish_reason") is None:
                times.append(arrived)
    res.events = len(times)
    res.tokens = usage if usage is not None else len(times)
    if times:
        res.ttft = times[0] - stream.sent
        res.itl = [b - a for a, b in itertools.pairwise(times)]
    if not res.error:
        res.error = ("hung (still streaming at the deadline)" if stream.hung else
                     "connection closed mid-stream" if stream.closed else
                     "no [DONE]" if not done else
                     f"finish_reason {finish!r}, not 'length'" if finish != "length" else
                     f"{res.tokens} tokens, not {output_len}" if res.tokens != output_len else
                     "")
    return res


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (linear interpolation), 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


# -- one measured run ------------------------------------------------------------------------


def machine_busy_ticks() -> int:
    """Busy clock ticks of the whole machine (every CPU), from /proc/stat."""
    cols = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(cols[:8]) - cols[3] - cols[4]  # user .. steal, less idle and iowait


CLIENT, MACHINE = 0, -1  # keys of a CPU snapshot beside the server's pids


def cpu_snapshot(procs: list[Proc]) -> dict[int, tuple[int, int]]:
    """(user, system) CPU ticks of each live process, of this client (key CLIENT) and of the
    whole machine (MACHINE: busy ticks as user, 0 as system)."""
    snap = {}
    for p in procs:
        with contextlib.suppress(OSError):
            stat = proc_stat(p.pid)
            snap[p.pid] = (stat.user, stat.sys)
    own = proc_stat(os.getpid())
    snap[CLIENT] = (own.user, own.sys)
    snap[MACHINE] = (machine_busy_ticks(), 0)
    return snap


def measure(dep: Deployment, ns: argparse.Namespace, port: int) -> dict[str, Any]:
    """Warm up, run the measured requests, and summarise them with each process's CPU."""
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": ns.output_len,
                       "stream": True, "ignore_eos": True, "temperature": 0.0,
                       "stream_options": {"include_usage": True}}).encode()
    client = Client(port, ns.concurrency, body)
    try:
        warm = [analyze(s, ns.output_len) for s in client.drive(ns.concurrency, ns.timeout)]
        client.refresh()
        conns = connections_per_proc(dep.procs, port)
        client.retries = 0
        before, t0 = cpu_snapshot(dep.procs), time.perf_counter()
        streams = client.drive(ns.num_requests, ns.timeout)
        t1 = max((s.recvs[-1][0] for s in streams if s.recvs), default=time.perf_counter())
        after = cpu_snapshot(dep.procs)
    finally:
        client.close()
    results = [analyze(s, ns.output_len) for s in streams]
    wall = t1 - t0
    cpu = {pid: ((after[pid][0] - before[pid][0]) / CLK_TCK,
                 (after[pid][1] - before[pid][1]) / CLK_TCK) for pid in before if pid in after}
    return {**summarize(dep, results, warm, wall, cpu, conns), "retries": client.retries}


def summarize(dep: Deployment, results: list[StreamResult], warm: list[StreamResult],
              wall: float, usr_sys: dict[int, tuple[float, float]],
              conns: dict[int, int]) -> dict[str, Any]:
    """One run's numbers: throughput, latency, failures, CPU per process and role."""
    cpu = {pid: u + s for pid, (u, s) in usr_sys.items()}
    tokens = sum(r.tokens for r in results)
    itl = [x for r in results for x in r.itl]
    failed = [r.error for r in results if r.error]
    gone = [p for p in dep.procs if p.pid not in cpu or not _alive(p.pid, p.start_ticks)]
    procs = [{"pid": p.pid, "role": p.role, "title": p.title, "cpu_s": cpu.get(p.pid),
              "cpu_pct": 100 * cpu.get(p.pid, 0.0) / wall,
              "user_pct": 100 * usr_sys.get(p.pid, (0.0, 0.0))[0] / wall,
              "sys_pct": 100 * usr_sys.get(p.pid, (0.0, 0.0))[1] / wall,
              "connections": conns.get(p.pid, 0)} for p in dep.procs]
    role_cpu: dict[str, float] = {}
    for p in dep.procs:
        role_cpu[p.role] = role_cpu.get(p.role, 0.0) + cpu.get(p.pid, 0.0)
    ours = sum(cpu.get(p.pid, 0.0) for p in dep.procs) + cpu[CLIENT]
    return {
        "api_servers": dep.api_servers, "requests": len(results), "wall_s": wall,
        "tokens": tokens, "tok_s": tokens / wall, "events": sum(r.events for r in results),
        "events_per_stream": sorted({r.events for r in results}),
        "p50_itl_ms": 1e3 * percentile(itl, 50), "p99_itl_ms": 1e3 * percentile(itl, 99),
        "p50_ttft_ms": 1e3 * percentile([r.ttft for r in results if r.events], 50),
        "frontend_us_per_token": 1e6 * role_cpu.get("frontend", 0.0) / max(tokens, 1),
        "frontend_cpu_pct": 100 * role_cpu.get("frontend", 0.0) / wall,
        "supervisor_cpu_pct": 100 * role_cpu.get("supervisor", 0.0) / wall,
        "core_cpu_pct": 100 * (role_cpu.get("engine core", 0.0)
                               + role_cpu.get("coordinator", 0.0)) / wall,
        "client_cpu_pct": 100 * cpu[CLIENT] / wall,
        "client_user_sys_pct": [100 * x / wall for x in usr_sys[CLIENT]],
        "other_cpu_pct": 100 * (cpu[MACHINE] - ours) / wall,
        "machine_cpu_pct": 100 * cpu[MACHINE] / wall,
        "failures": len(failed), "failure_examples": sorted(set(failed))[:5],
        "warmup_failures": sum(bool(r.error) for r in warm),
        "processes_gone": [f"{p.role} {p.title} (pid {p.pid})" for p in gone],
        "processes": procs, "command": dep.command, "log": str(dep.log),
    }


def run_one(ns: argparse.Namespace, model: str, api_servers: int, round_no: int,
            log_dir: Path) -> dict[str, Any]:
    """Start a deployment of `api_servers`, measure it, stop it; print its line."""
    port = free_port()
    log = log_dir / f"run{round_no}-api{api_servers}.log"
    with deployment(ns, model, port, api_servers, log) as dep:
        print(f"\n## round {round_no}, {api_servers} API server(s) (load average "
              f"{os.getloadavg()[0]:.2f})\nserver: {dep.command}", flush=True)
        result = measure(dep, ns, port)
        alive_after = set(descendants(dep.popen.pid))
    new = alive_after - {p.pid for p in dep.procs}
    if new:  # a frontend or core that died was restarted by the supervisor
        result["processes_gone"].append(f"new processes appeared: {sorted(new)}")
    result["round"] = round_no
    print_run(result)
    return result


def print_run(r: dict[str, Any]) -> None:
    """One run's line, the processes' CPU, and any failure, loudly."""
    print(f"{r['tokens']:,} tokens in {r['wall_s']:.2f} s: {r['tok_s']:,.0f} tok/s; ITL P50 "
          f"{r['p50_itl_ms']:.1f} / P99 {r['p99_itl_ms']:.1f} ms; TTFT P50 "
          f"{r['p50_ttft_ms']:.0f} ms; token events per stream {r['events_per_stream'][:8]}; "
          f"frontend {r['frontend_us_per_token']:.1f} µs CPU per token; requests sent again "
          f"after a keep-alive close: {r['retries']}")
    for p in r["processes"]:
        conns = f", {p['connections']} connections" if p["role"] == "frontend" else ""
        print(f"  {p['role']:<11} pid {p['pid']:<7} {p['cpu_pct']:5.1f}% CPU (user "
              f"{p['user_pct']:.1f}, sys {p['sys_pct']:.1f}){conns}  {p['title']}")
    user, sys_ = r["client_user_sys_pct"]
    print(f"  {'client':<11} pid {os.getpid():<7} {r['client_cpu_pct']:5.1f}% CPU (user "
          f"{user:.1f}, sys {sys_:.1f})\n"
          f"  other processes on the machine: {r['other_cpu_pct']:.1f}% CPU; machine total "
          f"{r['machine_cpu_pct']:.0f}% of {100 * (os.cpu_count() or 1)}%")
    if r["failures"] or r["warmup_failures"] or r["processes_gone"]:
        print(f"!!! FAILED: {r['failures']} of {r['requests']} streams (warm-up: "
              f"{r['warmup_failures']}); {r['failure_examples']}; processes gone: "
              f"{r['processes_gone']}\n  server log: {r['log']}\n{log_tail(Path(r['log']))}")


def free_port() -> int:
    """A free TCP port on the loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# -- the report ------------------------------------------------------------------------------


def span(values: list[float], fmt: str) -> str:
    """'median [min-max]'."""
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


COLUMNS = (("streamed tok/s", "tok_s", ",.0f"), ("ITL P50 ms", "p50_itl_ms", ".1f"),
           ("ITL P99 ms", "p99_itl_ms", ".1f"),
           ("frontend µs CPU / token", "frontend_us_per_token", ".1f"),
           ("frontends CPU %", "frontend_cpu_pct", ".0f"),
           ("supervisor CPU %", "supervisor_cpu_pct", ".1f"),
           ("engine core CPU %", "core_cpu_pct", ".0f"), ("client CPU %", "client_cpu_pct", ".0f"),
           ("other CPU %", "other_cpu_pct", ".0f"))


def table(results: list[dict[str, Any]], api_servers: list[int]) -> str:
    """One row per configuration: medians over the runs, [min-max]."""
    rows = ["| API servers | runs | " + " | ".join(c[0] for c in COLUMNS) + " | failed streams |",
            "|---:|---:|" + "---:|" * len(COLUMNS) + "---:|"]
    for n in api_servers:
        rs = [r for r in results if r["api_servers"] == n]
        if not rs:
            continue
        failed = sum(r["failures"] for r in rs)
        rows.append(f"| {n} | {len(rs)} | " + " | ".join(span([r[k] for r in rs], f)
                                                         for _, k, f in COLUMNS)
                    + f" | {failed}"
                    + (" !!!" if failed or any(r["processes_gone"] for r in rs) else "") + " |")
    return "\n".join(rows)


def ratios(results: list[dict[str, Any]], api_servers: list[int]) -> list[str]:
    """Each configuration's tokens/s over the first's, taken within each round, with the CPU
    that other processes took in the two runs (a shared machine); and the same over the
    rounds where both stayed under QUIET_OTHER_PCT."""
    lines = []
    base = api_servers[0]
    by_round: dict[int, dict[int, dict[str, Any]]] = {}
    for r in results:
        by_round.setdefault(r["round"], {})[r["api_servers"]] = r
    for n in api_servers[1:]:
        pairs = [(v[n], v[base]) for v in by_round.values() if n in v and base in v]
        if not pairs:
            continue
        per = [a["tok_s"] / b["tok_s"] for a, b in pairs]
        med = statistics.median(per)
        verdict = ""
        if (base, n) == (1, 2):
            verdict = (f"; target >= {TARGET_RATIO}x on the median: "
                       f"{'met' if med >= TARGET_RATIO else 'NOT met'}")
        shown = ", ".join(f"{x:.2f} (other processes {b['other_cpu_pct']:.0f}% / "
                          f"{a['other_cpu_pct']:.0f}%)"
                          for x, (a, b) in zip(per, pairs, strict=True))
        lines.append(f"{n} / {base} API servers, streamed tok/s: {med:.2f}x (per round: {shown}; "
                     f"range {min(per):.2f}-{max(per):.2f}){verdict}")
        quiet = [x for x, (a, b) in zip(per, pairs, strict=True)
                 if max(a["other_cpu_pct"], b["other_cpu_pct"]) < QUIET_OTHER_PCT]
        lines.append(f"  rounds where other processes took < {QUIET_OTHER_PCT:.0f}% of a core in "
                     f"both runs: {len(quiet)} of {len(per)}" + (
                         f", ratio {span(quiet, '.2f')}" if quiet else ""))
    return lines


def frontend_cost(results: list[dict[str, Any]], api_servers: list[int]) -> list[str]:
    """The frontends' CPU per streamed token against the Python streaming figure, and whether
    one API server was the bottleneck (its process near a full core)."""
    lines = []
    one = [r for r in results if r["api_servers"] == 1]
    if one:
        pct = [r["frontend_cpu_pct"] for r in one]
        other = statistics.median(r["other_cpu_pct"] for r in one)
        verdict = ("frontend-bound" if statistics.median(pct) >= 85 else
                   f"NOT frontend-bound, or starved: other processes took {other:.0f}% CPU")
        lines.append(f"bottleneck check: with 1 API server its process used {span(pct, '.0f')}% "
                     f"of a core ({verdict})")
    for n in api_servers:
        us = [r["frontend_us_per_token"] for r in results if r["api_servers"] == n]
        if us:
            med = statistics.median(us)
            lines.append(f"{n} API server(s): {span(us, '.1f')} µs of frontend CPU per streamed "
                         f"token = {med / PYTHON_STREAMING_US:.2f}x the ~{PYTHON_STREAMING_US:.0f}"
                         f" µs reported for a Python streaming server")
    return lines


def machine_info() -> dict[str, Any]:
    """Machine, versions and the command."""
    cpu = "?"
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
        cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    versions = {}
    for pkg in ("ringserve", "hypercorn", "trio", "httpx", "h11", "msgspec"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = "not installed"
    # The speed of this machine's Python, to scale the µs per token by (best of 5).
    loop_us = min(timeit.repeat("sum(range(1000))", number=2000, repeat=5)) / 2000 * 1e6
    return {"cpu": cpu, "cpus": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), **versions,
            "python_sum_range_1000_us": round(loop_us, 1),
            "load_average": os.getloadavg(), "command": shlex.join([sys.argv[0], *sys.argv[1:]])}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--api-servers", default="1,2",
                   help="API server counts, in the order each round runs them (default 1,2)")
    p.add_argument("--runs", type=int, default=3, help="rounds; medians and ranges reported")
    p.add_argument("--concurrency", type=int, default=1024, help="streams at once")
    p.add_argument("--num-requests", type=int, default=4096, help="measured requests per run")
    p.add_argument("--output-len", type=int, default=16, help="max_tokens (EOS ignored)")
    p.add_argument("--step-ms", type=float, default=2.0,
                   help="the null model's step time, RINGSERVE_NULL_STEP_MS (default 2.0)")
    p.add_argument("--model", default=None,
                   help="model directory for the tokenizer (default: the tiny test Llama)")
    p.add_argument("--server-args", default="", help="extra `ringserve serve` flags")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds the warm-up and the measured requests may take each")
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--log-dir", type=Path, default=ROOT / ".cache" / "bench_scaleout")
    p.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    ns = p.parse_args(argv)
    try:
        ns.api_server_counts = [int(x) for x in ns.api_servers.split(",")]
    except ValueError:
        p.error(f"--api-servers: comma-separated integers, got {ns.api_servers!r}")
    if (min(ns.api_server_counts) < 1 or ns.runs < 1 or ns.concurrency < 1
            or ns.num_requests < 1 or ns.output_len < 1 or ns.step_ms < 0):
        p.error("--api-servers, --runs, --concurrency, --num-requests and --output-len must "
                "be >= 1, --step-ms >= 0")
    return ns


def raise_fd_limit(needed: int) -> None:
    """Lift the soft open-files limit (the servers inherit it) to hold every connection."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        print(f"open files limit raised from {soft} to {target}")


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    # SIGTERM (and SIGINT, even where the shell started this with it ignored) stop the script
    # as Ctrl-C does: through every `finally`, so the servers are stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    info = machine_info()
    print(json.dumps(info), flush=True)
    raise_fd_limit(ns.concurrency * 2 + 256)
    if ns.model is None:
        from ringserve.gpu.testing import tiny_model

        ns.model = str(tiny_model("llama"))
    ns.log_dir.mkdir(parents=True, exist_ok=True)
    print(f"client: one process, one epoll loop over {ns.concurrency} keep-alive HTTP/1.1 "
          f"connections (raw sockets, SSE parsed after the measured interval); its CPU is "
          f"measured below; server logs in {ns.log_dir}")
    results = []
    for i in range(1, ns.runs + 1):
        for n in ns.api_server_counts:
            results.append(run_one(ns, ns.model, n, i, ns.log_dir))
    print(f"\n### {ns.concurrency} concurrent streams, {ns.num_requests} requests of "
          f"{ns.output_len} tokens, null model {ns.step_ms} ms/step, {os.cpu_count()} CPUs; "
          f"median [min-max] of {ns.runs} runs; CPU % of one core over the measured interval\n")
    print(table(results, ns.api_server_counts) + "\n")
    print("\n".join(ratios(results, ns.api_server_counts) + frontend_cost(
        results, ns.api_server_counts)))
    failed = [r for r in results if r["failures"] or r["warmup_failures"] or r["processes_gone"]]
    if failed:
        print(f"\n!!! {len(failed)} run(s) had failed streams or lost processes: rounds "
              f"{[(r['round'], r['api_servers']) for r in failed]}")
    print(f"load average at the end: {os.getloadavg()}")
    if ns.json is not None:
        ns.json.write_text(json.dumps({"machine": info, "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()},
            "runs": results}, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
