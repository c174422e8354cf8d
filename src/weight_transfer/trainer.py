"""The trainer side of a weight update: `TrainerWeightTransferEngine` pushes a
`WeightSource`'s tensors into a running engine through a sync client.

The client is anything with vLLM's four weight-transfer methods
(`WeightSyncClientProtocol`): `ringserve.weight_transfer.WeightSyncClient` over HTTP, an
in-process `ringserve.LLM`, or a trainer's own client written to vLLM's
``VLLMWeightSyncClient`` (`VLLMWeightSyncClientProtocol`: ``start_weight_update()`` and
``finish_weight_update()`` without arguments). A round (`send_weights`) is
``start_weight_update`` with the source's metadata, one ``update_weights`` per bucket, and
``finish_weight_update`` with the round's version; the transport (``shm_transport``,
``collective``) lays the buckets out and moves the bytes.

Threads: every client call is made on the caller's thread except ``update_weights`` with the
shm backend, which runs on a helper thread so the next bucket is filled meanwhile (never two
client calls at once).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Protocol

import torch

from ringserve.weight_transfer.buckets import BucketPlan
from ringserve.weight_transfer.config import WeightTransferConfig, parse_weight_transfer_config
from ringserve.weight_transfer.messages import (
    CollectiveTrainerOptions,
    ShmTrainerOptions,
    decode,
)
from ringserve.weight_transfer.source import (
    TensorMeta,
    WeightSource,
    metadata_dict,
    tensor_metas,
)


class WeightSyncClientProtocol(Protocol):
    """The engine's weight-transfer calls (vLLM's names and arguments)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> Any:
        """Open the channel the transport describes in `init_info`."""
        ...

    def start_weight_update(self, metadata: dict[str, Any] | None = None) -> Any:
        """Begin a round; the engine checks `metadata` against its model."""
        ...

    def update_weights(self, update_info: dict[str, Any]) -> Any:
        """Have every worker receive one bucket."""
        ...

    def finish_weight_update(self, weight_version: str | None = None) -> Any:
        """Swap the engine to the round's weights."""
        ...


class VLLMWeightSyncClientProtocol(Protocol):
    """vLLM's ``VLLMWeightSyncClient``, which a trainer's own client may be written to: the
    same calls, with ``start_weight_update`` and ``finish_weight_update`` taking no argument
    (or only vLLM's ``is_checkpoint_format`` flag). Such a client is sent neither the
    round's metadata (the engine checks nothing before the bytes arrive and writes no
    snapshot) nor its version (the engine serves the round unnamed)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> Any:
        """Open the channel the transport describes in `init_info`."""
        ...

    def start_weight_update(self) -> Any:
        """Begin a round."""
        ...

    def update_weights(self, update_info: dict[str, Any]) -> Any:
        """Have every worker receive one bucket."""
        ...

    def finish_weight_update(self) -> Any:
        """Swap the engine to the round's weights."""
        ...


AnyClient = WeightSyncClientProtocol | VLLMWeightSyncClientProtocol


def _takes_argument(method: Callable[..., Any]) -> bool:
    """Whether `method` takes ringserve's argument (the metadata, the version) in first
    place. vLLM's client protocol declares ``start_weight_update()`` and
    ``finish_weight_update()`` bare, and vLLM's ``start_weight_update(is_checkpoint_format=
    True)`` has a flag there that a metadata dict would silently set."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # nothing to read (a C callable): call it as ours
        return True
    for parameter in parameters:
        if parameter.kind is parameter.VAR_POSITIONAL:
            return True
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            return parameter.name != "is_checkpoint_format"
    return False


def _check_sender(rank: int, backend: str) -> None:
    if rank != 0:
        raise ValueError(f"init_info for the {backend} backend: rank {rank}, but only the "
                         "sender, rank 0, runs a TrainerWeightTransferEngine; the other "
                         "trainer ranks only iterate their source in step with it (each "
                         "gather)")


class _Transport(Protocol):
    @property
    def broken(self) -> bool: ...

    def connect(self, init: Any) -> None: ...

    def plan(self, metas: list[TensorMeta]) -> list[BucketPlan]: ...

    def send_round(self, plan: list[BucketPlan], tensors: Iterator[tuple[str, torch.Tensor]],
                   update: Any) -> None: ...

    def close(self) -> None: ...


class TrainerWeightTransferEngine:
    """Sends a trainer's weights to an engine, round after round (run it on rank 0).

    Args:
        config: the transport (a `WeightTransferConfig`, its JSON text or dict; None: shm
            with the default bucket size). It must name the engine's backend.
        client: the engine's sync client (ringserve's protocol, or vLLM's
            `VLLMWeightSyncClientProtocol`).
        timeout_s: how long the trainer's side of a gloo / nccl collective may wait for the
            engine's workers.

    Raises:
        ValueError: a bad config or timeout.
    """

    def __init__(self, config: WeightTransferConfig | str | dict[str, Any] | None,
                 client: AnyClient, *, timeout_s: float = 300.0) -> None:
        if not isinstance(timeout_s, int | float) or not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        self.config = parse_weight_transfer_config(config) or WeightTransferConfig()
        self.client = client
        self.timeout_s = float(timeout_s)
        self.rounds = 0  # complete rounds sent
        self._source: WeightSource | None = None
        self._transport: _Transport | None = None
        self._closed = False

    def trainer_init(self, source: WeightSource, init_info: dict[str, Any] | None = None) -> None:
        """Set up the transport for `source` and open the engine's side of it
        (``init_weight_transfer_engine``). Calling it again replaces the source and channel.

        Args:
            source: the tensors every round sends; its `metadata` entries may be any records
                of ``name``, ``shape`` and ``dtype`` (`tensor_metas`).
            init_info: shm: nothing (None or {}); gloo / nccl: optional ``master_address``
                (default loopback: pass the trainer's address when the engine is elsewhere),
                ``master_port`` (default: a free one) and ``world_size`` (default: the
                client's ``get_world_size() + 1``), and vLLM's ``rank_offset`` (the
                workers' first rank: 1, after this trainer's rank 0). Either backend takes
                vLLM's trainer ``rank``, which must be 0.

        Raises:
            TypeError: a malformed `metadata` entry (before any call to the engine).
            ValueError: bad `init_info`, or nccl without CUDA.
            Exception: what the client raised (the engine refused).
        """
        if self._closed:
            raise RuntimeError("the TrainerWeightTransferEngine is closed")
        if not isinstance(source, WeightSource):
            raise TypeError(f"source must be a WeightSource (metadata() and __iter__), got "
                            f"{type(source).__name__}")
        self._close_transport()
        self._source = None
        transport = self._make_transport(source, init_info)
        try:
            transport.connect(self.client.init_weight_transfer_engine)
        except BaseException:
            transport.close()
            raise
        self._transport, self._source = transport, source

    def _make_transport(self, source: WeightSource,
                        init_info: dict[str, Any] | None) -> _Transport:
        backend = self.config.backend
        metas = tensor_metas(source.metadata())
        if backend == "shm":
            _check_sender(decode(ShmTrainerOptions, init_info or {}, "init_info", backend).rank,
                          backend)
            from ringserve.weight_transfer.shared_weights import SharedWeights
            from ringserve.weight_transfer.shm_transport import ShmSender

            shared = source if isinstance(source, SharedWeights) else None
            return ShmSender(self.config.bucket_bytes, metas, shared)
        from ringserve.weight_transfer.collective import CollectiveSender

        options = decode(CollectiveTrainerOptions, init_info or {}, "init_info", backend)
        _check_sender(options.rank, backend)
        if options.rank_offset != 1:
            raise ValueError(f"init_info for the {backend} backend: rank_offset "
                             f"{options.rank_offset}, but a TrainerWeightTransferEngine is the "
                             "group's one trainer rank (0), so the engine's workers start at "
                             "rank_offset 1")
        world_size = options.world_size or self._engine_world_size() + 1
        return CollectiveSender(backend, options, world_size, self.config.bucket_bytes,
                                self.timeout_s)

    def _engine_world_size(self) -> int:
        get = getattr(self.client, "get_world_size", None)
        if not callable(get):
            raise ValueError(f"the {self.config.backend} backend needs the group's size: pass "
                             "init_info={'world_size': 1 + the engine's receiving workers} "
                             "(the client has no get_world_size())")
        return int(get(include_dp=True))

    def send_weights(self, weight_version: str | None = None) -> str:
        """Send one round: every tensor of the source, then switch the engine to them.

        Args:
            weight_version: the version the engine stamps on its outputs from now on;
                default: the number of this round among the complete ones ("1", "2", ...).

        Returns:
            The round's version (a `VLLMWeightSyncClientProtocol` client is not sent it, and
            its engine serves the round unnamed).

        Raises:
            RuntimeError: `trainer_init` was not called, or the engine is closed.
            TypeError: a malformed `metadata` entry (before any call to the engine).
            ValueError: the source yielded something its metadata did not announce.
            Exception: what the client or the transport raised. The round is abandoned (the
                engine keeps serving its last weights; its next ``start_weight_update``
                drops the open round) and a later `send_weights` starts afresh.
        """
        transport, source = self._transport, self._source
        if self._closed:
            raise RuntimeError("the TrainerWeightTransferEngine is closed")
        if transport is None or source is None:
            raise RuntimeError("call trainer_init(source) before send_weights")
        if weight_version is not None and not isinstance(weight_version, str):
            raise ValueError(f"weight_version must be a string or None, got {weight_version!r}")
        version = str(self.rounds + 1) if weight_version is None else weight_version
        metas = tensor_metas(source.metadata())
        if transport.broken:  # a failed bucket dropped the group: rebuild it
            transport.connect(self.client.init_weight_transfer_engine)
        plan = transport.plan(metas)
        start: Callable[..., Any] = self.client.start_weight_update
        if _takes_argument(start):
            start(metadata_dict(metas))
        else:
            start()
        tensors = iter(source)
        transport.send_round(plan, tensors, self.client.update_weights)
        extra = next(tensors, None)
        if extra is not None:
            raise ValueError(f"the weight source yielded {extra[0]!r} after the "
                             f"{len(metas)} tensors its metadata lists")
        finish: Callable[..., Any] = self.client.finish_weight_update
        if _takes_argument(finish):
            finish(version)
        else:
            finish()
        self.rounds += 1
        return version

    def _close_transport(self) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()

    def close(self) -> None:
        """Unlink the shm segments / leave the gloo or nccl group (idempotent)."""
        self._closed = True
        self._source = None
        self._close_transport()

    def __enter__(self) -> TrainerWeightTransferEngine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
