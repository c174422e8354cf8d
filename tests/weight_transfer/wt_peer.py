"""Fakes for the weight-transfer tests: an engine whose workers are threads of the test
process (`FakeEngine`), one whose workers are spawned processes talking JSON over a pipe
(`PipeEngine`, `Peer`, `peer_main`), and the digests both compare.

Nothing here imports transformers: a spawned peer imports torch and ringserve.weight_transfer
only.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import Any

import torch

from ringserve.weight_transfer import (
    StateDictSource,
    TrainerWeightTransferEngine,
    WeightReceiver,
    WeightTransferConfig,
    make_receiver,
)

Digest = tuple[str, str, tuple[int, ...], str]  # name, dtype, shape, sha256 of the bytes


def digest(name: str, tensor: torch.Tensor) -> Digest:
    """What a receiver saw of one tensor (computed before the iterator advances)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    sha = hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()
    return name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), sha


def as_digest(value: list[Any]) -> Digest:
    """A digest that came back as JSON."""
    return str(value[0]), str(value[1]), tuple(int(d) for d in value[2]), str(value[3])


def digests(pairs: Iterable[tuple[str, torch.Tensor]]) -> list[Digest]:
    return [digest(name, tensor) for name, tensor in pairs]


def source_digests(tensors: dict[str, torch.Tensor]) -> list[Digest]:
    return digests(tensors.items())


def run_all(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run `calls` at once on threads (every member of a collective must); raise the first
    error."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except BaseException as exc:
            errors[index] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for error in errors:
        if error is not None:
            raise error
    return results


class FakeEngine:
    """A sync client whose `num_workers` workers are receivers in this process.

    Records every phase; `received[r]` is round r's digests (worker 0's, checked equal on
    every worker). `fail_update` makes the n-th update_weights call (1-based, counted over the
    engine's life) raise before any worker receives. `hold_s` keeps every bucket's views
    around that long before digesting them (a trainer refilling the bucket early would show).
    """

    def __init__(self, config: WeightTransferConfig, num_workers: int = 1, *,
                 timeout_s: float = 10.0, hold_s: float = 0.0) -> None:
        self.config = config
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.hold_s = hold_s
        self.receivers: list[WeightReceiver] = []
        self.calls: list[str] = []
        self.init_infos: list[dict[str, Any]] = []
        self.update_infos: list[dict[str, Any]] = []
        self.metadata: list[dict[str, Any] | None] = []
        self.versions: list[str | None] = []
        self.received: list[list[Digest]] = []
        self._round: list[Digest] = []
        self.fail_update: int | None = None
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()

    def get_world_size(self, include_dp: bool = True) -> int:
        return self.num_workers

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append("init")
        self.init_infos.append(init_info)
        self.close()
        self.receivers = run_all([
            functools.partial(make_receiver, self.config, init_info, worker_index=i,
                              num_workers=self.num_workers, timeout_s=self.timeout_s)
            for i in range(self.num_workers)])

    def start_weight_update(self, metadata: dict[str, Any] | None = None) -> None:
        self.calls.append("start")
        self.metadata.append(metadata)
        self._round = []

    def _receive(self, receiver: WeightReceiver, info: dict[str, Any]) -> list[Digest]:
        pairs = list(receiver.receive(info))  # views stay valid for the whole call
        if self.hold_s:
            time.sleep(self.hold_s)
        return digests(pairs)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            self.calls.append("update")
            self.update_infos.append(update_info)
            if self.fail_update is not None and self.calls.count("update") == self.fail_update:
                raise RuntimeError("the engine refused this bucket")
            seen = run_all([functools.partial(self._receive, r, update_info)
                            for r in self.receivers])
            if any(s != seen[0] for s in seen):
                raise AssertionError("workers received different bytes")
            self._round.extend(seen[0])
        finally:
            with self._lock:
                self.in_flight -= 1

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")
        self.versions.append(weight_version)
        self.received.append(self._round)

    def close(self) -> None:
        for receiver in self.receivers:
            receiver.close()
        self.receivers = []


# -- spawned peers -------------------------------------------------------------------------


def _send(conn: Connection, message: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(message).encode())


def _recv(conn: Connection) -> dict[str, Any]:
    message: dict[str, Any] = json.loads(conn.recv_bytes())
    return message


class _ParentInit:
    """A trainer-side client, in a peer, whose init asks the test process to open the
    receivers (and whose other phases do nothing)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        _send(self.conn, {"event": "init", "init_info": init_info})
        reply = _recv(self.conn)
        if not reply["ok"]:
            raise RuntimeError(reply["error"])

    def start_weight_update(self, metadata: dict[str, Any] | None = None) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        pass

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


def peer_main(conn: Connection) -> None:
    """A fake engine worker (or, for "trainer", a trainer) driven by JSON commands."""
    receiver: WeightReceiver | None = None
    trainer: TrainerWeightTransferEngine | None = None
    while True:
        try:
            command = _recv(conn)
        except EOFError:  # the test process is gone
            return
        op = command["op"]
        reply: dict[str, Any] = {"ok": True}
        try:
            if op == "receiver":
                receiver = make_receiver(WeightTransferConfig(**command["config"]),
                                         command["init_info"],
                                         worker_index=command["worker_index"],
                                         num_workers=command["num_workers"],
                                         timeout_s=command["timeout_s"])
            elif op == "receive":
                if receiver is None:
                    raise RuntimeError("no receiver")
                reply["tensors"] = digests(receiver.receive(command["update_info"]))
            elif op == "close":
                if receiver is not None:
                    receiver.close()
                receiver = None
            elif op == "trainer":
                trainer = TrainerWeightTransferEngine({"backend": command["backend"]},
                                                      _ParentInit(conn),
                                                      timeout_s=command["timeout_s"])
                trainer.trainer_init(StateDictSource({}), {"world_size": command["world_size"]})
            elif op == "exit":
                return
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        _send(conn, reply)


class Peer:
    """One spawned peer process and our end of its pipe."""

    def __init__(self, process: Any, conn: Connection) -> None:
        self.process = process
        self.conn = conn

    def send(self, message: dict[str, Any]) -> None:
        _send(self.conn, message)

    def recv(self, timeout: float = 60.0) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer {self.process.pid} did not answer within {timeout} s")
        return _recv(self.conn)

    def call(self, message: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        self.send(message)
        reply = self.recv(timeout)
        if not reply.get("ok"):
            raise RuntimeError(f"peer: {reply.get('error')}")
        return reply

    def alive(self) -> bool:
        return bool(self.process.is_alive())

    def ask_to_exit(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):  # it died meanwhile
                self.send({"op": "exit"})

    def stop(self) -> None:
        """Ask it to exit; kill it if it does not (and reap it)."""
        if self.process.is_alive():
            self.ask_to_exit()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()


class PipeEngine:
    """A sync client whose workers are spawned peers (each runs a receiver)."""

    def __init__(self, config: WeightTransferConfig, peers: list[Peer], *,
                 timeout_s: float = 10.0) -> None:
        self.config = config
        self.peers = peers
        self.timeout_s = timeout_s
        self.received: list[list[Digest]] = []
        self.versions: list[str | None] = []
        self._round: list[Digest] = []

    def get_world_size(self, include_dp: bool = True) -> int:
        return len(self.peers)

    def _all(self, make: Callable[[int], dict[str, Any]]) -> list[dict[str, Any]]:
        for index, peer in enumerate(self.peers):  # every worker at once, then the answers
            peer.send(make(index))
        replies = [peer.recv() for peer in self.peers]
        for reply in replies:
            if not reply.get("ok"):
                raise RuntimeError(f"worker: {reply.get('error')}")
        return replies

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all(lambda i: {"op": "receiver", "config": {"backend": self.config.backend,
                                                          "bucket_bytes": self.config.bucket_bytes},
                             "init_info": init_info, "worker_index": i,
                             "num_workers": len(self.peers), "timeout_s": self.timeout_s})

    def start_weight_update(self, metadata: dict[str, Any] | None = None) -> None:
        self._round = []

    def update_weights(self, update_info: dict[str, Any]) -> None:
        replies = self._all(lambda i: {"op": "receive", "update_info": update_info})
        seen = [[as_digest(d) for d in reply["tensors"]] for reply in replies]
        if any(s != seen[0] for s in seen):
            raise AssertionError("workers received different bytes")
        self._round.extend(seen[0])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.versions.append(weight_version)
        self.received.append(self._round)

    def close(self) -> None:
        for peer in self.peers:
            if peer.alive():
                peer.call({"op": "close"})

