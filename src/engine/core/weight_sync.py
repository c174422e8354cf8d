"""The engine core's side of a weight update from a trainer, and `collective_rpc`.

A mixin of `EngineCore` (its state lives there): the utility methods
`init_weight_transfer_engine`, `start_weight_update`, `update_weights`, `finish_weight_update`
(vLLM's four phases, driven by `ringserve.weight_transfer.TrainerWeightTransferEngine` through
`LLM`, `AsyncLLM` or the HTTP routes) and `collective_rpc`. Each phase runs on every worker
between steps (`ringserve.gpu.weights.update`); the workers load into a standby copy of the
model (swapped in) or a staging copy (repacked), never into the serving weights, so those
change only in `finish_weight_update`, all at once, between two steps. Then:

- the steps in flight are drained first (their outputs go out with the old version);
- every request that holds KV is preempted and recomputes it from its tokens (KV computed with
  old weights is never reused), and the prefix cache is reset;
- the weight version becomes the one given, stamped on every output batch from then on.

Failures: a phase a worker refuses (bad input, a metadata mismatch, the trainer gone, a
transport timeout of `--weight-transfer-timeout-s`) raises `WeightTransferError` to the caller
and abandons the round on every worker; the old weights keep serving. A worker that dies or
does not answer within the timeout plus a grace period is an engine fault (the fault-tolerance
path: every request fails, `/health` is 503, `retry` restarts the workers from the last
complete weights: the snapshot of the last round when it has one, `restart_config`, else the
start-up weights, and the version returns to the one they are).

`collective_rpc(method, args, timeout)` calls a worker method named in `RPC_METHODS`, a short
allow-list of read-only calls; anything else is refused (no arbitrary code, no pickle).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from ringserve.config import EngineConfig
from ringserve.engine.sched.scheduler import Scheduler
from ringserve.engine.wire import EngineCoreOutputs
from ringserve.gpu.executor.base import Executor
from ringserve.gpu.executor.errors import WorkerTimeoutError
from ringserve.gpu.weights import snapshot_dirs as weight_snapshot

logger = logging.getLogger(__name__)

# Worker methods `collective_rpc` may call: read-only, msgpack results.
RPC_METHODS = frozenset({"get_weight_checksum", "get_device_info"})

# Seconds a worker gets beyond --weight-transfer-timeout-s before it counts as hung.
_GRACE_S = 10.0

WEIGHT_SYNC_UTILITIES = frozenset({
    "init_weight_transfer_engine", "start_weight_update", "update_weights",
    "finish_weight_update", "collective_rpc",
})


class WeightTransferError(ValueError):
    """A weight-update phase failed; the engine still serves its last complete weights."""


class WeightSyncMixin:
    """Weight updates and `collective_rpc` for `EngineCore` (state lives there)."""

    config: EngineConfig
    executor: Executor
    scheduler: Scheduler
    engine_index: int
    weight_version: str | None
    _stashed: list[dict[int, EngineCoreOutputs]]
    _update_open: bool
    # The round being sent writes a snapshot (it came with metadata); the snapshot on disk
    # holds the weights being served (restarts and wake-ups load it).
    _round_snapshot: bool
    _snapshot_current: bool

    drain: Callable[[], dict[int, EngineCoreOutputs]]  # EngineCore's

    def _rpc(self, method: str, args: tuple[Any, ...], timeout: float | None) -> list[Any]:
        try:
            results = self.executor.collective_rpc(method, args, timeout=timeout)
        except TimeoutError:
            if timeout is None:
                raise
            raise WorkerTimeoutError(f"{method} did not finish on every worker within "
                                     f"{timeout:g} s") from None
        return results

    def _phase(self, method: str, *args: Any) -> list[Any]:
        """Run one phase on every worker; the values in rank order.

        Raises:
            WeightTransferError: a worker refused or failed it (the round is abandoned).
        """
        timeout = self.config.weight_transfer_timeout_s + _GRACE_S
        replies = self._rpc(method, args, timeout)
        errors = [(rank, reply[0]) for rank, reply in enumerate(replies) if reply[0] is not None]
        if errors:
            if method != "init_weight_transfer_engine":
                self._abandon_round()
            rank, error = errors[0]
            raise WeightTransferError(f"{method}: worker rank {rank}: {error}")
        return [reply[1] for reply in replies]

    def _abandon_round(self) -> None:
        self._update_open = False
        self._rpc("abort_weight_update", (), self.config.weight_transfer_timeout_s + _GRACE_S)

    def _check_enabled(self, method: str) -> None:
        if self.config.weight_transfer_config is None:
            raise WeightTransferError(
                f"{method}: weight transfer is off; start the engine with "
                "--weight-transfer-config '{\"backend\": \"shm\"}' (or gloo / nccl)")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Open the channel from the trainer on every worker (once per trainer).

        Raises:
            WeightTransferError: weight transfer is off, or a worker refused `init_info`.
        """
        self._check_enabled("init_weight_transfer_engine")
        if not isinstance(init_info, dict):
            raise WeightTransferError(f"init_info: expected a JSON object, got {init_info!r}")
        tp = self.config.parallel_config.tensor_parallel_size
        dp = self.config.parallel_config.data_parallel_size
        self._update_open = False
        self._phase("init_weight_transfer_engine", init_info, self.engine_index * tp, dp * tp)

    def start_weight_update(self, metadata: dict[str, Any] | None = None) -> None:
        """Begin a round. With `metadata` (`{"names", "dtype_names", "shapes"}` of every
        tensor the round sends), every worker checks it against the model before any byte
        is copied.

        Raises:
            WeightTransferError: the transport is not initialized, the engine is asleep at
                level 2, or the metadata does not match the model (naming the first
                mismatch).
        """
        self._check_enabled("start_weight_update")
        if metadata is not None and not isinstance(metadata, dict):
            raise WeightTransferError(f"metadata: expected a JSON object, got {metadata!r}")
        transfer = self.config.weight_transfer_config
        self._round_snapshot = metadata is not None and transfer is not None and transfer.snapshot
        snapshot = (str(weight_snapshot.snapshot_dir(self.engine_index))
                    if self._round_snapshot else None)
        self._phase("start_weight_update", metadata, snapshot)
        self._update_open = True

    def update_weights(self, update_info: dict[str, Any]) -> int:
        """Receive one bucket on every worker; returns the tensors rank 0 loaded.

        Raises:
            WeightTransferError: no round is open, or a worker refused or failed the bucket.
        """
        self._check_enabled("update_weights")
        if not isinstance(update_info, dict):
            raise WeightTransferError(f"update_info: expected a JSON object, got {update_info!r}")
        if not self._update_open:
            raise WeightTransferError("update_weights: call start_weight_update first")
        return int(self._phase("update_weights", update_info)[0])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Swap every worker to the round's weights between two steps, make every request
        recompute its KV, reset the prefix cache and set the weight version.

        Raises:
            WeightTransferError: no round is open, or a tensor is missing (the old weights
                keep serving).
        """
        self._check_enabled("finish_weight_update")
        if weight_version is not None and not isinstance(weight_version, str):
            raise WeightTransferError(f"weight_version: expected a string or null, got "
                                      f"{weight_version!r}")
        if not self._update_open:
            raise WeightTransferError("finish_weight_update: no weight update is in progress "
                                      "(call start_weight_update first)")
        start = time.perf_counter()
        drained = self.drain()  # the steps in flight finish on the old weights
        if drained:
            self._stashed.append(drained)
        self._update_open = False
        self._phase("finish_weight_update")
        self._snapshot_current = self._round_snapshot
        if not self._snapshot_current:
            logger.warning("engine core %d: weight version %r has no snapshot (no metadata, or "
                           "snapshot off): a restart or a wake-up from sleep level 2 would load "
                           "the start-up weights", self.engine_index, weight_version)
        recomputing = self.scheduler.invalidate_computed_kv()
        self.scheduler.reset_prefix_cache()
        self.weight_version = weight_version
        logger.info("engine core %d: new weights (version %r) in %.3f s; %d requests "
                    "recompute their KV", self.engine_index, weight_version,
                    time.perf_counter() - start, recomputing)

    def served_weights_path(self) -> str | None:
        """The snapshot directory holding the weights being served, when they came from a
        trainer with metadata (None: the start-up checkpoint serves)."""
        if not self._snapshot_current:
            return None
        return str(weight_snapshot.current_snapshot(self.engine_index))

    def restart_config(self) -> tuple[EngineConfig, str | None]:
        """(the config new workers load with, the weight version they will serve): the last
        complete weights from a trainer when there is a snapshot, else the start-up ones."""
        path = self.served_weights_path()
        if path is None:
            return self.config, None
        model = dataclasses.replace(self.config.model_config, load_format="safetensors",
                                    weights_path=path)
        return dataclasses.replace(self.config, model_config=model), self.weight_version

    def remove_snapshot(self) -> None:
        """Delete this core's snapshot directory (shutdown)."""
        self._snapshot_current = False
        weight_snapshot.remove(weight_snapshot.snapshot_dir(self.engine_index))

    def collective_rpc(self, method: str, args: list[Any] | tuple[Any, ...] = (),
                       timeout: float | None = None) -> list[Any]:
        """Call an allow-listed worker method (`RPC_METHODS`) on every worker of this core;
        the results in rank order.

        Raises:
            ValueError: a method off the allow-list, or bad arguments.
        """
        if method not in RPC_METHODS:
            raise ValueError(f"collective_rpc: method {method!r} is not allowed; allowed: "
                             f"{sorted(RPC_METHODS)}")
        if args:  # every allowed method takes none (a worker raising would be a fault)
            raise ValueError(f"collective_rpc: {method} takes no arguments, got {args!r}")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise ValueError(f"collective_rpc: timeout must be a number of seconds > 0, got "
                             f"{timeout!r}")
        return self._rpc(method, tuple(args), None if timeout is None else float(timeout))
