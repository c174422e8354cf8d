"""A worker's side of a weight update from a trainer (RL weight sync).

The engine core drives four phases on every worker, between steps (`ringserve.engine.
weight_sync`): `init` once (the transport's receiver, `ringserve.weight_transfer.make_receiver`),
then per round `start` (check the round's tensor list against the model), `update` one or
more times (receive a bucket of named tensors and load them into the round's target model),
`finish` (swap the round's weights in) or `abort` (drop the round).

Loading goes through the model's own `load_weights`, the code path of start-up loading: HF
names, fused q/k/v and gate/up layouts, tied embeddings, renamings (Gemma 3's multimodal
prefixes, Phi-3's fused tensors) and each TP rank's shard are handled there. Because one
`load_weights` call must see every tensor of the round while the tensors arrive over several
`update` calls, it runs on a thread of its own that is handed one bucket at a time; each
`update` waits until the thread has copied every tensor of its bucket (the received tensors
are views of a transport buffer that is reused afterwards).

What a round loads into (`ringserve.gpu.weights.standby`): for float32 panels or plain weights,
a standby copy of the serving model, written straight in its serving layout (one read of the
transport buffer and one write per byte) and swapped in at `finish` (the replaced model is the
next round's standby); otherwise a plain staging copy, repacked into the serving model at
`finish`. Either is built at the first round and kept (one more model in memory while weight
transfer is in use), released by sleep level 2.

`start` checks names, shapes and dtypes before any byte is copied by running the same
`load_weights` over "meta" tensors on a model built on the meta device: the first mismatch
(a name that matches no parameter, a wrong shape, a non-float dtype, a missing tensor) is
refused with the loader's own message. A round whose metadata equals the last accepted one
is not checked again (the same model gives the same answer).

The serving model is never touched until `finish`: a failed or abandoned round leaves the
worker on its last complete weights. TP rank 0 also writes the round into the snapshot
(`ringserve.gpu.weights.snapshot`), on a helper thread that reads each bucket while the loading
thread packs it; `update` returns once both are done with the bucket.
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
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.models.llama import LlamaForCausalLM
from ringserve.gpu.models.registry import model_class
from ringserve.gpu.moe.cpu_experts import PackedExperts
from ringserve.gpu.native.panel import PackBatch, batched_packs, load_library
from ringserve.gpu.weights.loader import _load
from ringserve.gpu.weights.snapshot import SnapshotWriter
from ringserve.gpu.weights.standby import Target, make_target, refresh_weights
from ringserve.weight_transfer.background import BackgroundCall

logger = logging.getLogger(__name__)

_END = object()  # the round's last tensor was handed over
_ABORT = object()  # the round is abandoned


class _Abandoned(Exception):
    """Raised inside the loading thread's tensor stream when the round is aborted."""


def _write_all(snapshot: SnapshotWriter, tensors: list[tuple[str, torch.Tensor]]) -> None:
    for name, tensor in tensors:
        snapshot.write(name, tensor)


class WeightUpdateError(ValueError):
    """A weight update that cannot proceed (bad input, a transport failure, a timeout); the
    worker is still on its last complete weights."""


class _RoundLoad:
    """`load_weights` of the round's target model on a thread, fed one bucket at a time."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self._inbox: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._consumed = threading.Semaphore(0)
        self.error: BaseException | None = None
        self.count = 0
        self._thread = threading.Thread(target=self._run, name="weight-update-load", daemon=True)
        self._thread.start()

    def _stream(self, packs: PackBatch | None) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            item = self._inbox.get()
            if item is _END:
                return
            if item is _ABORT:
                raise _Abandoned
            for tensor in item:
                yield tensor
                self.count += 1
            if packs is not None:
                packs.flush()  # the bucket's packs into panels, in one parallel region
            self._consumed.release()  # every tensor is copied: the bucket may be reused

    def _run(self) -> None:
        try:
            with torch.inference_mode(), batched_packs(load_library()) as packs:
                _load(self.model, self._stream(packs), lambda: "weight update")
        except _Abandoned:
            pass
        except BaseException as exc:
            self.error = exc
        finally:
            self._consumed.release()  # wake a feeder waiting on a bucket that will never load

    def feed(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Hand one bucket's tensors over and wait until every one is copied.

        Raises:
            WeightUpdateError: the loader refused one of them (or an earlier one).
        """
        if self.error is not None or not self._thread.is_alive():
            raise WeightUpdateError(f"the weight update failed: {self._describe()}")
        if not tensors:
            return
        self._inbox.put(tensors)
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
            while True:  # an unconsumed bucket may sit in the one-slot inbox
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
        serving: the model being served (the model runner's).
        swap: serves the given model from the next step on and returns the one it replaces
            (the model runner's `swap_model`; a standby round's `finish`).
        refreshed: called after the serving model's weights were rewritten in place (a
            staging round's `finish`; the model runner's `capture_decode`).
    """

    def __init__(self, config: EngineConfig, tp: TPGroup, device: torch.device,
                 backend: AttentionBackend, serving: Callable[[], LlamaForCausalLM],
                 swap: Callable[[LlamaForCausalLM], LlamaForCausalLM],
                 refreshed: Callable[[], None]) -> None:
        self.config = config
        self.tp = tp
        self.device = device
        self.backend = backend
        self._serving = serving
        self._swap = swap
        self._refreshed = refreshed
        self._receiver: Any = None
        self._round: _RoundLoad | None = None
        # What rounds load into (`ringserve.gpu.weights.standby`): built at the first round,
        # kept (warm pages, no model to build per round) until sleep level 2.
        self._target: Target | None = None
        self._meta: LlamaForCausalLM | None = None
        # The last metadata `check_metadata` accepted, and its answer.
        self._checked: tuple[Any, list[tuple[str, torch.dtype, list[int]]]] | None = None
        self._snapshot: SnapshotWriter | None = None

    @property
    def timeout_s(self) -> float:
        """How long a transport may wait for the trainer (`--weight-transfer-timeout-s`)."""
        return self.config.weight_transfer_timeout_s

    @property
    def standby(self) -> bool | None:
        """Whether rounds load into a standby model that is swapped in (True) or into a
        staging copy repacked into the serving model (False); None before the first round."""
        return None if self._target is None else self._target.standby

    def init(self, init_info: dict[str, Any], first_worker: int, num_workers: int) -> None:
        """Open the transport channel (once; again to re-initialize).

        Args:
            init_info: the trainer's, for the transport.
            first_worker: the index of this engine's TP rank 0 among every receiving worker
                (``engine_index * tp_size``); every TP rank is sent the same.
            num_workers: the receiving workers of every engine.

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
            # Each TP rank is its own member of a gloo / nccl group: one index (one rank) each.
            self._receiver = make_receiver(transfer, init_info,
                                           worker_index=first_worker + self.tp.rank,
                                           num_workers=num_workers, timeout_s=self.timeout_s)
        except Exception as exc:
            raise WeightUpdateError(f"init_weight_transfer_engine: {exc}") from exc

    def start(self, metadata: dict[str, Any] | None, snapshot: str | None = None) -> None:
        """Begin a round: check `metadata` (names, shapes, dtypes) against the model when
        given, then open the round on its target model (built at the first round). A round
        already open is abandoned first. With `snapshot` (a directory; TP rank 0 only) and
        metadata, the round's tensors are also written there (`ringserve.gpu.weights.snapshot`),
        committed by `finish`.

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
        if self._target is None:
            start = time.perf_counter()
            self._target, reason = make_target(self.config, self.tp, self.device, self.backend,
                                               self._serving())
            if self._target.standby:
                logger.info("weight update: standby model built in %.3f s (rounds load into "
                            "it and swap it in)", time.perf_counter() - start)
            else:
                logger.info("weight update: staging model built in %.3f s (rounds are "
                            "repacked into the serving model: %s)",
                            time.perf_counter() - start, reason)
        self._round = _RoundLoad(self._target.model)

    def check_metadata(self, metadata: dict[str, Any]) -> list[tuple[str, torch.dtype, list[int]]]:
        """Dry-run the model's loader over meta tensors of `metadata`'s shapes and dtypes;
        returns (name, dtype, shape) of each tensor. Metadata equal to the last accepted one
        gets the same answer without a second dry run.

        Raises:
            WeightUpdateError: malformed metadata, or the first mismatch with the model.
        """
        from ringserve.weight_transfer import dtype_from_name

        try:
            names, dtypes, shapes = (list(metadata[k]) for k in ("names", "dtype_names", "shapes"))
            if not len(names) == len(dtypes) == len(shapes):
                raise ValueError(f"{len(names)} names, {len(dtypes)} dtype_names and "
                                 f"{len(shapes)} shapes")
            key = (tuple(str(n) for n in names), tuple(str(t) for t in dtypes),
                   tuple(tuple(int(d) for d in s) for s in shapes))
            if self._checked is not None and self._checked[0] == key:
                return self._checked[1]
            metas = [(n, torch.empty(list(s), dtype=dtype_from_name(t), device="meta"))
                     for n, t, s in zip(*key, strict=True)]
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
        tensors = [(name, t.dtype, list(t.shape)) for name, t in metas]
        self._checked = (key, tensors)
        return tensors

    def update(self, update_info: dict[str, Any]) -> int:
        """Receive one bucket and load it into the round's target model (TP rank 0 writes it
        into the snapshot meanwhile); returns its tensor count.

        Raises:
            WeightUpdateError: no round is open, the bucket is refused, the transport failed
                or timed out; the round is abandoned.
        """
        loading = self._round
        if loading is None or self._receiver is None:
            raise WeightUpdateError("update_weights: call start_weight_update first")
        try:
            tensors = list(self._receiver.receive(update_info))
            snapshot = self._snapshot
            writer = None if snapshot is None or not tensors else BackgroundCall(
                lambda: _write_all(snapshot, tensors), "weight-update-snapshot")
            try:
                loading.feed(tensors)
            finally:
                # Never return while a thread still reads the bucket the trainer refills next.
                error = None if writer is None else writer.join()
            if error is not None:
                raise error
        except Exception as exc:
            self.abort()
            if isinstance(exc, WeightUpdateError):
                raise
            raise WeightUpdateError(f"update_weights: {type(exc).__name__}: {exc}") from exc
        return len(tensors)

    def finish(self) -> int:
        """End the round: every tensor must have arrived; the round's weights then serve from
        the next step on (the standby model swapped in, or the staging copy repacked into
        the serving model's own tensors). Returns the tensors loaded.

        Raises:
            WeightUpdateError: no round is open, or a tensor is missing (the round is
                abandoned; the serving model is unchanged).
            Exception: anything else while swapping or rewriting is not an update error but
                an engine fault (a repack may have half-written the serving weights; the
                fault path restarts the workers from the last complete round).
        """
        loading, target = self._round, self._target
        if loading is None or target is None:
            raise WeightUpdateError("finish_weight_update: no weight update is in progress "
                                    "(call start_weight_update first)")
        self._round = None
        try:
            loading.end()
        except WeightUpdateError:
            loading.abort()
            self.abort()  # the snapshot's partial file goes too
            raise
        start = time.perf_counter()
        if target.standby:
            target.model = self._swap(target.model)  # the replaced weights: the next standby
        else:
            with torch.inference_mode():
                refresh_weights(self._serving(), target.model)
            self._refreshed()
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is not None:
            snapshot.commit()
        logger.info("weight update: %d tensors, %s in %.3f s", loading.count,
                    "swapped in" if target.standby else "packed into the serving model",
                    time.perf_counter() - start)
        return loading.count

    def abort(self) -> None:
        """Abandon the open round, if any (idempotent)."""
        loading, self._round = self._round, None
        if loading is not None:
            loading.abort()
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is not None:
            snapshot.discard()

    def release_staging(self) -> None:
        """Drop the standby or staging model (sleep level 2 frees the weights; the next round
        builds it again)."""
        self.abort()
        self._target = None

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
