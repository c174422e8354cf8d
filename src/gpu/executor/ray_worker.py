"""The Ray executor's worker side: the actor body, its step loop, and the zmq framing both use.

`RayWorker` is the class `ray_executor.RayExecutor` turns into a Ray actor, one per TP rank.
Ray only places and supervises it; its constructor and methods take and return plain strings,
ints, bools and bytes (the `EngineConfig` arrives as msgpack bytes), so nothing but Ray's own
bookkeeping is pickled. The data path is zmq over TCP, msgpack through `ringserve.serial`:

* the executor binds a ROUTER socket (steps, utility calls, shutdown) and a PULL socket
  (replies); each actor connects a DEALER whose identity is `identity(rank)` and a PUSH;
* an actor's first message on its DEALER is `HELLO`, so the executor knows the ROUTER can
  route to it before it sends anything;
* a message is one zmq multipart message: ``[kind, body, *out_of_band_buffers]`` where kind is
  one byte, a `wire.FrameKind` (STEP / RPC / SHUTDOWN executor -> worker; OUTPUT / RPC_REPLY /
  STEP_ERROR worker -> executor), and the rest is `MsgpackEncoder.encode`'s buffer list. The
  ROUTER side adds the peer's identity in front.

The loop mirrors `worker_proc.WorkerLoop`: rank 0 sends each step's `ModelRunnerOutput`; every
rank answers every `RpcRequest` with an `RpcReply`; the rank whose `execute_model` raises sends a
`StepError` and keeps serving; `SHUTDOWN` ends `RayWorker.run`; a malformed message is logged
(rate-limited) and dropped (`inbound.py`). Imports no ray and no torch at module level (torch
is imported inside the actor, after it said hello).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from ringserve.config import EngineConfig
from ringserve.gpu.executor.inbound import DECODE_ERRORS, DropLog, RequestDecoder
from ringserve.gpu.executor.wire import FrameKind
from ringserve.gpu.executor.worker_calls import reply_to
from ringserve.serial import Buffer, MsgpackEncoder

HELLO = b"hello"
REPLY_LINGER_MS = 1000  # how long a closing PUSH socket may still flush its last replies


def identity(rank: int) -> bytes:
    """The zmq routing identity of rank `rank`'s DEALER socket."""
    return b"rank%d" % rank


def send_message(
    sock: zmq.Socket[Any], kind: FrameKind, bufs: Sequence[Buffer], *, prefix: Sequence[bytes] = (),
    flags: int = 0,
) -> None:
    """Send one message (`[*prefix, kind, *bufs]`) as a zmq multipart message.

    The frames are copied into zmq's messages (`copy=True`), so array buffers that the sender
    reuses after this call (a model runner's output arrays) cannot change under the send.
    """
    sock.send_multipart([*prefix, bytes((int(kind),)), *bufs], flags=flags, copy=True)


def split_message(frames: Sequence[zmq.Frame]) -> tuple[int, list[Buffer]]:
    """The kind and buffers of a received message (without any routing prefix).

    The body stays a view into its zmq frame; out-of-band buffers are copied into owned
    `bytearray`s, so arrays decoded from them are writable and outlive the frames.

    Raises:
        ValueError: the message has no kind byte.
    """
    if not frames or len(frames[0].bytes) != 1:
        raise ValueError("ringserve ray executor: a message without its kind byte")
    bufs: list[Buffer] = [memoryview(f.buffer) for f in frames[1:2]]
    bufs += [bytearray(f.buffer) for f in frames[2:]]
    return frames[0].bytes[0], bufs


def free_port(host: str) -> int:
    """A TCP port on `host` that is free right now (for torch.distributed's rendezvous)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class StepLoop:
    """Serves one rank's sockets: decodes steps and calls, runs the worker, replies.

    Args:
        worker: the `ringserve.gpu.worker.Worker` (typed loosely: built after torch's import).
        rank: the TP rank.
        inbox: the DEALER connected to the executor's ROUTER.
        outbox: the PUSH connected to the executor's PULL.
    """

    def __init__(self, worker: Any, rank: int, inbox: zmq.Socket[Any], outbox: zmq.Socket[Any]) -> None:
        self.worker = worker
        self.rank = rank
        self.inbox = inbox
        self.outbox = outbox
        self._decoder = RequestDecoder()
        self._encoder = MsgpackEncoder()
        self.drops = DropLog(f"Ray worker rank {rank}")

    def run(self) -> None:
        """Serve messages until a shutdown message (returns); malformed ones are dropped."""
        while True:
            try:
                kind, bufs = split_message(self.inbox.recv_multipart(copy=False))
                if kind == FrameKind.SHUTDOWN:
                    return
                message = self._decoder.decode(kind, bufs)
            except DECODE_ERRORS as exc:
                self.drops.drop(exc)
                continue
            reply = reply_to(self.worker, self.rank, message, self._encoder)
            if reply is not None:
                send_message(self.outbox, *reply)


class RayWorker:
    """The body of one Ray actor: one TP rank (see the module docstring).

    Construction is cheap and imports no torch; `run` does the work and lasts as long as the
    worker serves, so the executor watches that one task to learn of the actor's death.

    Args:
        config_msgpack: the `EngineConfig`, as `msgspec.msgpack.encode(config)`.
        rank: this actor's TP rank.
        sched_addr: the executor's ROUTER address (``tcp://host:port``).
        out_addr: the executor's PULL address.
        share_cpu: on CPU, give torch `cores // tensor_parallel_size` threads (Ray sets
            OMP_NUM_THREADS=1 in its workers; False when the driver set OMP_NUM_THREADS itself).
    """

    def __init__(
        self, config_msgpack: bytes, rank: int, sched_addr: str, out_addr: str, share_cpu: bool
    ) -> None:
        self.config = msgspec.msgpack.decode(config_msgpack, type=EngineConfig)
        self.rank = rank
        self.sched_addr = sched_addr
        self.out_addr = out_addr
        self.share_cpu = share_cpu

    def node_info(self) -> tuple[str, int, int, str]:
        """This actor's node IP, a free TCP port on it, its pid and its Ray node id (hex).

        The executor takes rank 0's IP and port for torch.distributed's rendezvous.
        """
        import ray

        host = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        node_id = str(ray.get_runtime_context().get_node_id())
        return host, free_port(host), os.getpid(), node_id

    def run(self, distributed_init_method: str) -> int:
        """Connect, say hello, build the `Worker` and serve until the shutdown message.

        Args:
            distributed_init_method: torch.distributed's init URL ("" when TP is 1).

        Returns:
            This actor's rank (the executor learns of a normal end by this task's completion).
        """
        ctx = zmq.Context()
        inbox = ctx.socket(zmq.DEALER)
        outbox = ctx.socket(zmq.PUSH)
        try:
            inbox.setsockopt(zmq.IDENTITY, identity(self.rank))
            inbox.setsockopt(zmq.LINGER, 0)
            outbox.setsockopt(zmq.LINGER, REPLY_LINGER_MS)
            inbox.connect(self.sched_addr)
            outbox.connect(self.out_addr)
            inbox.send(HELLO)
            worker = self._build_worker(distributed_init_method)
            StepLoop(worker, self.rank, inbox, outbox).run()
        finally:
            inbox.close()
            outbox.close()
            ctx.term()
        return self.rank

    def _build_worker(self, distributed_init_method: str) -> Any:
        import torch

        from ringserve.gpu.worker import Worker

        config = self.config
        tp = config.parallel_config.tensor_parallel_size
        if config.device_config.device == "cpu" and self.share_cpu:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
        # Ray gives each GPU actor its own device through CUDA_VISIBLE_DEVICES: always index 0.
        return Worker(
            config, rank=self.rank, local_rank=0, distributed_init_method=distributed_init_method
        )
