"""A worker's side of a weight update from a trainer (RL weight sync).

The engine core drives four phases on every worker, between steps (`ringserve.engine.
weight_sync`): `init` once (the transport's receiver, `ringserve.weight_transfer.make_receiver`),
then per round `start` (check the round's tensor list against the model, build a staging copy
of the model), `update` one or more times (receive a bucket of named tensors and load them
into the staging copy), `finish` (post-process the staging copy and swap it in) or `abort`
(drop it).

Loading goes through the model's own `load_weights`, the code path of start-up loading: HF
names, fused q/k/v and gate/up layouts, tied embeddings, renamings (Gemma 3's multimodal
prefixes, Phi-3's fused tensors) and each TP rank's shard are handled there. Because one
`load_weights` call must see every tensor of the round while the tensors arrive over several
`update` calls, it runs on a thread of its own that is handed one tensor at a time; each
`update` waits until the thread has copied every tensor it was handed (the received tensors
may be views of a transport buffer that is reused afterwards).

`start` checks names, shapes and dtypes before any byte is copied by running the same
`load_weights` over "meta" tensors on a model built on the meta device: the first mismatch
(a name that matches no parameter, a wrong shape, a non-float dtype, a missing tensor) is
refused with the loader's own message.

The serving model is never touched until `finish`: a failed or abandoned round leaves the
worker on its last complete weights. At `finish` (between two steps) the serving model's own
tensors are rewritten from the staging copy (`refresh_weights`: the linear layers and the LM
head repack into their panels in place, so nothing is allocated and the captured decode step's
pointers stay valid). The staging copy is built at the first round and kept: one more model in
memory (its plain weights) while weight transfer is in use, released by sleep level 2.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ringserve.config import EngineConfig
from ringserve.gpu.attention.backend import AttentionBackend
from ringserve.gpu.linear import ColumnParallelLinear, RowParallelLinear, refresh_layer
from ringserve.gpu.loader import _load
from ringserve.gpu.models.llama import LlamaForCausalLM
from ringserve.gpu.models.registry import model_class
from ringserve.gpu.moe.cpu_experts import PackedExperts
from ringserve.gpu.moe.layer import FusedMoE
from ringserve.gpu.parallel import TPGroup
from ringserve.gpu.vocab_embedding import ParallelLMHead
from ringserve.gpu.weight_snapshot import SnapshotWriter

logger = logging.getLogger(__name__)

_END = object()  # the round's last tensor was handed over
_ABORT = object()  # the round is abandoned


class _Abandoned(Exception):
    """Raised inside the loading thread's tensor stream when the round is aborted."""


class WeightUpdateError(ValueError):
    """A weight update that cannot proceed (bad input, a transport failure, a timeout); the
    worker is still on its last complete weights."""


class _StagingLoad:
    """`load_weights` of a staging model on a thread, fed one tensor at a time."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self._inbox: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._consumed = threading.Semaphore(0)
        self.error: BaseException | None = None
        self.count = 0
        self._thread = threading.Thread(target=self._run, name="weight-update-load", daemon=True)
        self._thread.start()

    def _stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            item = self._inbox.get()
            if item is _END:
                return
            if item is _ABORT:
                raise _Abandoned
            yield item
            self.count += 1
            self._consumed.release()  # the tensor is copied: its buffer may be reused

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                _load(self.model, self._stream(), lambda: "weight update")
        except _Abandoned:
            pass
        except BaseException as exc:
            self.error = exc
        finally:
            self._consumed.release()  # wake a feeder waiting on a tensor that will never load

    def feed(self, name: str, tensor: torch.Tensor) -> None:
        """Hand one tensor over and wait until it is copied.

        Raises:
            WeightUpdateError: the loader refused this tensor (or an earlier one).
        """
        if self.error is not None or not self._thread.is_alive():
            raise WeightUpdateError(f"the weight update failed: {self._describe()}")
        self._inbox.put((name, tensor))
        self._consumed.acquire()
        if self.error is not None:
            raise WeightUpdateError(f"the weight update failed: {self._describe()}")

    def end(self) -> None:
        """Signal the last tensor and wait for `load_weights` to return.

        Raises:
            WeightUpdateError: a tensor is missing, or loading failed.
        """
        if self._thread.is_alive():
            self._inbox.put(_END)
        self._thread.join()
        if self.error is not None:
            raise WeightUpdateError(f"the weight update failed: {self._describe()}")

    def abort(self) -> None:
        """Stop the loading thread (idempotent)."""
        if self._thread.is_alive():
            while True:  # an unconsumed tensor may sit in the one-slot inbox
                try:
                    self._inbox.get_nowait()
                except queue.Empty:
                    break
            self._inbox.put(_ABORT)
        self._thread.join()

    def _describe(self) -> str:
        exc = self.error
        return "the loading thread stopped" if exc is None else str(exc)


class WeightUpdater:
    """One worker's weight-update state.

    Args:
        config: the engine configuration (model, transfer backend, timeout).
        tp: this worker's TP group (each rank loads its own shard).
        device: the worker's device.
        backend: the attention backend the serving model was built with.
        serving: the model being served (the model runner's, read at `finish`).
        refreshed: called after the serving model's weights were rewritten at `finish` (the
            model runner's `capture_decode`).
    """

    def __init__(self, config: EngineConfig, tp: TPGroup, device: torch.device,
                 backend: AttentionBackend, serving: Callable[[], LlamaForCausalLM],
                 refreshed: Callable[[], None]) -> None:
        self.config = config
        self.tp = tp
        self.device = device
        self.backend = backend
        self._serving = serving
        self._refreshed = refreshed
        self._receiver: Any = None
        self._staging: _StagingLoad | None = None
        # The plain weights a round loads into: built at the first round, kept (warm pages,
        # no model to build per round) until sleep level 2.
        self._staging_model: LlamaForCausalLM | None = None
        self._meta: LlamaForCausalLM | None = None
        self._snapshot: SnapshotWriter | None = None

    @property
    def timeout_s(self) -> float:
        """How long a transport may wait for the trainer (`--weight-transfer-timeout-s`)."""
        return self.config.weight_transfer_timeout_s

    def init(self, init_info: dict[str, Any], worker_index: int, num_workers: int) -> None:
        """Open the transport channel (once; again to re-initialize).

        Raises:
            WeightUpdateError: no transport is configured, or `init_info` is refused.
        """
        from ringserve.weight_transfer import make_receiver

        transfer = self.config.weight_transfer_config
        if transfer is None:
            raise WeightUpdateError("weight transfer is off: start the engine with "
                                    "--weight-transfer-config '{\"backend\": \"shm\"}' "
                                    "(or gloo / nccl)")
        self.abort()
        self.close()
        try:
            self._receiver = make_receiver(transfer, init_info, worker_index=worker_index,
                                           num_workers=num_workers, timeout_s=self.timeout_s)
        except Exception as exc:
            raise WeightUpdateError(f"init_weight_transfer_engine: {exc}") from exc

    def start(self, metadata: dict[str, Any] | None, snapshot: str | None = None) -> None:
        """Begin a round: check `metadata` (names, shapes, dtypes) against the model when
        given, then build the staging model. A round already open is abandoned first. With
        `snapshot` (a directory; TP rank 0 only) and metadata, the round's tensors are also
        written there (`ringserve.gpu.weight_snapshot`), committed by `finish`.

        Raises:
            WeightUpdateError: the transport is not initialized, or the metadata does not
                match the model (the message names the first mismatch).
        """
        if self._receiver is None:
            raise WeightUpdateError("start_weight_update: call init_weight_transfer_engine first")
        self.abort()
        if metadata is not None:
            tensors = self.check_metadata(metadata)
            if snapshot is not None and self.tp.rank == 0:
                try:
                    self._snapshot = SnapshotWriter(Path(snapshot), tensors)
                except (ValueError, OSError) as exc:
                    raise WeightUpdateError(f"start_weight_update: {exc}") from exc
        if self._staging_model is None:
            start = time.perf_counter()
            cls = model_class(self.config.model_config.architecture)
            with torch.device(self.device):
                self._staging_model = cls.from_config(self.config.model_config, self.tp,
                                                      self.backend)
            logger.info("weight update: staging model built in %.3f s",
                        time.perf_counter() - start)
        self._staging = _StagingLoad(self._staging_model)

    def check_metadata(self, metadata: dict[str, Any]) -> list[tuple[str, torch.dtype, list[int]]]:
        """Dry-run the model's loader over meta tensors of `metadata`'s shapes and dtypes;
        returns (name, dtype, shape) of each tensor.

        Raises:
            WeightUpdateError: malformed metadata, or the first mismatch with the model.
        """
        from ringserve.weight_transfer import dtype_from_name

        try:
            names, dtypes, shapes = (list(metadata[k]) for k in ("names", "dtype_names", "shapes"))
            if not len(names) == len(dtypes) == len(shapes):
                raise ValueError(f"{len(names)} names, {len(dtypes)} dtype_names and "
                                 f"{len(shapes)} shapes")
            metas = [(str(n), torch.empty([int(d) for d in s], dtype=dtype_from_name(str(t)),
                                          device="meta"))
                     for n, t, s in zip(names, dtypes, shapes, strict=True)]
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightUpdateError(f"start_weight_update: bad metadata ({exc}); expected "
                                    "{\"names\": [...], \"dtype_names\": [...], \"shapes\": "
                                    "[[...], ...]}") from None
        if self._meta is None:
            cls = model_class(self.config.model_config.architecture)
            with torch.device("meta"):
                self._meta = cls.from_config(self.config.model_config, self.tp, self.backend)
        try:
            _load(self._meta, iter(metas), lambda: "weight update")
        except Exception as exc:
            raise WeightUpdateError(f"the trainer's weights do not match the model: {exc}") from None
        return [(name, t.dtype, list(t.shape)) for name, t in metas]

    def update(self, update_info: dict[str, Any]) -> int:
        """Receive one bucket and load it into the staging model; returns its tensor count.

        Raises:
            WeightUpdateError: no round is open, the bucket is refused, the transport failed
                or timed out; the round is abandoned.
        """
        staging = self._staging
        if staging is None or self._receiver is None:
            raise WeightUpdateError("update_weights: call start_weight_update first")
        count = 0
        try:
            snapshot = self._snapshot
            for name, tensor in self._receiver.receive(update_info):
                if snapshot is not None:
                    snapshot.write(name, tensor)
                staging.feed(name, tensor)
                count += 1
        except Exception as exc:
            self.abort()
            if isinstance(exc, WeightUpdateError):
                raise
            raise WeightUpdateError(f"update_weights: {type(exc).__name__}: {exc}") from exc
        return count

    def finish(self) -> int:
        """End the round: every tensor must have arrived; the serving model's weights are
        then rewritten in place from the staging model (packed for the device's kernels, in
        the tensors the kernels and the captured step already point at). Returns the tensors
        loaded.

        Raises:
            WeightUpdateError: no round is open, or a tensor is missing (the round is
                abandoned; the serving model is unchanged).
            Exception: anything else while rewriting is not an update error but an engine
                fault (the serving weights may be half-written; the fault path restarts the
                workers from the last complete round).
        """
        staging = self._staging
        if staging is None:
            raise WeightUpdateError("finish_weight_update: no weight update is in progress "
                                    "(call start_weight_update first)")
        self._staging = None
        try:
            staging.end()
        except WeightUpdateError:
            staging.abort()
            self.abort()  # the snapshot's partial file goes too
            raise
        start = time.perf_counter()
        with torch.inference_mode():
            refresh_weights(self._serving(), staging.model)
        self._refreshed()
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is not None:
            snapshot.commit()
        logger.info("weight update: %d tensors, packed into the serving model in %.3f s",
                    staging.count, time.perf_counter() - start)
        return staging.count

    def abort(self) -> None:
        """Abandon the open round, if any (idempotent)."""
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.abort()
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is not None:
            snapshot.discard()

    def release_staging(self) -> None:
        """Drop the staging model (sleep level 2 frees the weights; the next round builds it
        again)."""
        self.abort()
        self._staging_model = None

    def close(self) -> None:
        """Close the transport (idempotent)."""
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()


def weight_checksum(model: torch.nn.Module) -> str:
    """SHA-256 over every tensor the model serves from: parameters and buffers (non-empty),
    and the panels (data, scales, mins, bias) or oneDNN copies its layers keep, in module
    order."""
    import hashlib

    digest = hashlib.sha256()

    def add(tensor: torch.Tensor | None) -> None:
        if tensor is None or tensor.numel() == 0:
            return
        flat = tensor.detach().contiguous().cpu().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes())

    for _, module in model.named_modules():
        for tensor in module.parameters(recurse=False):
            add(tensor)
        for tensor in module.buffers(recurse=False):
            add(tensor)
        panel = getattr(module, "panel", None)
        if panel is not None:
            for tensor in (panel.data, panel.scales, panel.mins, panel.bias):
                add(tensor)
        packed = getattr(module, "packed", None)
        if isinstance(packed, torch.Tensor) and packed.layout == torch.strided:
            add(packed)
        elif isinstance(packed, PackedExperts):
            for expert in packed.panels():
                for tensor in (expert.data, expert.scales, expert.mins, expert.bias):
                    add(tensor)
    return digest.hexdigest()


def refresh_weights(serving: LlamaForCausalLM, loaded: LlamaForCausalLM) -> None:
    """Rewrite `serving`'s weights in place from `loaded`, the same architecture with its
    weights just loaded and not processed: each linear layer and the LM head repack into
    their own panels (`ringserve.gpu.linear.refresh_layer`), the experts of an MoE layer into
    theirs (`FusedMoE.refresh_from`); every other parameter the serving model keeps (norms,
    the embedding, routers) is copied."""
    pairs = zip(serving.named_modules(), loaded.named_modules(), strict=True)
    for (name, mine), (other_name, theirs) in pairs:
        if name != other_name:
            raise RuntimeError(f"weight update: module {name!r} against {other_name!r}")
        if isinstance(mine, ColumnParallelLinear | RowParallelLinear):
            refresh_layer(mine, theirs)
        elif isinstance(mine, ParallelLMHead):
            mine.refresh_from(theirs)
        elif isinstance(mine, FusedMoE):
            assert isinstance(theirs, FusedMoE)
            mine.refresh_from(theirs)
        else:
            for pname, param in mine.named_parameters(recurse=False):
                if param.numel():
                    param.data.copy_(getattr(theirs, pname).data)
