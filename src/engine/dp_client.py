"""`DPLBAsyncMPClient`: `AsyncMPClient` over N data-parallel cores with least-loaded routing.

Each new request goes to the core with the lowest `4 * waiting + running`, from the scheduler
stats each core publishes with its outputs plus the requests sent to it since (a core
recovering from a fault gets none while another is healthy); aborts go to the owning core,
utility calls to all. The cores publish those two counts even with `--disable-log-stats`, so
routing never goes blind (it would degrade to counting sends: round-robin).
"""

from __future__ import annotations

from ringserve.config import EngineConfig
from ringserve.engine.async_client import AsyncMPClient
from ringserve.engine.wire import EngineCoreOutputs, EngineCoreRequest


class DPLBAsyncMPClient(AsyncMPClient):
    """`AsyncMPClient` over `data_parallel_size` cores with least-loaded routing."""

    def __init__(self, config: EngineConfig, executor: str = "default") -> None:
        super().__init__(config, executor)
        # Per core: [waiting, running] from its last published stats.
        self._stats = [[0, 0] for _ in range(self.num_engines)]
        # Requests sent to each core since its last stats (counted as waiting).
        self._sent_since_stats = [0] * self.num_engines
        self._owner: dict[str, int] = {}

    def choose_engine(self, request: EngineCoreRequest) -> int:
        if request.data_parallel_rank is not None:
            engine = request.data_parallel_rank
            if not 0 <= engine < self.num_engines:
                raise ValueError(f"data_parallel_rank: got {engine}, allowed: "
                                 f"0..{self.num_engines - 1}")
        else:
            engine = min(range(self.num_engines), key=self._load)
        self._owner[request.request_id] = engine
        self._sent_since_stats[engine] += 1
        return engine

    def _load(self, engine: int) -> tuple[bool, int]:
        waiting, running = self._stats[engine]
        # A recovering core refuses requests: route around it while another is healthy.
        recovering = not self.fault_states[engine].healthy
        return recovering, 4 * (waiting + self._sent_since_stats[engine]) + running

    def engine_of(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def request_finished(self, request_id: str) -> None:
        self._owner.pop(request_id, None)

    def record_stats(self, outputs: EngineCoreOutputs) -> None:
        stats = outputs.scheduler_stats
        if stats is not None and 0 <= outputs.engine_index < self.num_engines:
            self._stats[outputs.engine_index] = [stats.num_waiting_reqs, stats.num_running_reqs]
            self._sent_since_stats[outputs.engine_index] = 0
        if outputs.finished_requests:
            for rid in outputs.finished_requests:
                self._owner.pop(rid, None)
