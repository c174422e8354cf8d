"""Speculative decoding's metrics in the frontend: Prometheus counters and the log line.

The core counts drafts in its `SchedulerStats.spec_decoding` (`SpecDecodingStats`: deltas since
the previous stats; None while nothing was verified, and always with speculation off). The
`PrometheusStatLogger` hands them to one `SpecDecodingProm`, each engine's `LoggingStatLogger`
to its own `SpecDecodingLogging`. Names and meanings are vLLM's (`vllm/v1/spec_decode/
metrics.py`):

* `ringserve:spec_decode_num_drafts`: request-steps that carried drafts;
* `ringserve:spec_decode_num_draft_tokens`: draft tokens verified;
* `ringserve:spec_decode_num_accepted_tokens`: draft tokens accepted (bonus token not counted);
* `ringserve:spec_decode_num_accepted_tokens_per_pos{position="i"}`: drafts accepted at
  position i (0-based), so `per_pos[i] / num_drafts` is the acceptance rate at i.

From them, in PromQL (`_total` as exported): acceptance rate = rate(accepted) / rate(draft
tokens); mean acceptance length = 1 + rate(accepted) / rate(drafts) (the bonus token counted).

vLLM registers the families when its config has a speculative config. ringserve's config has
none yet, so a frontend registers them when the first `SpecDecodingStats` arrives (which only a
speculating core sends), for every engine at once, with a `position` series per draft
position seen; `start()` is the hook for registering them at start-up once the config says k.

Pure Python over prometheus_client: no trio or zmq.
"""

from __future__ import annotations

import math
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from ringserve.engine.wire import SpecDecodingStats

# Family names after the `ringserve:` prefix.
NUM_DRAFTS = "spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "spec_decode_num_draft_tokens"
NUM_ACCEPTED_TOKENS = "spec_decode_num_accepted_tokens"
NUM_ACCEPTED_TOKENS_PER_POS = "spec_decode_num_accepted_tokens_per_pos"


class SpecDecodingProm:
    """The four speculative-decoding counter families of one frontend, per engine.

    Args:
        registry: the `PrometheusStatLogger`'s registry the families are created in.
        prefix: the families' prefix (`ringserve`).
        model_name: the `model_name` label value.
        engine_indexes: the engines (data-parallel ranks) to publish series for; shared with
            the caller, which adds and removes engines.
    """

    def __init__(self, registry: CollectorRegistry, prefix: str, model_name: str,
                 engine_indexes: list[int]) -> None:
        self._registry = registry
        self._prefix = prefix
        self._model_name = model_name
        self._engine_indexes = engine_indexes
        self._families: dict[str, Counter] = {}
        self._num_positions = 0

    @property
    def started(self) -> bool:
        """The families exist (speculation has been seen, or `start()` was called)."""
        return bool(self._families)

    def start(self, num_positions: int) -> None:
        """Create the families (once) with zero series for every engine and draft position
        0..`num_positions`-1 (more positions are added as longer stats arrive)."""
        if not self._families:
            labels = ["model_name", "engine"]
            for name, doc in ((NUM_DRAFTS, "Number of spec decoding drafts."),
                              (NUM_DRAFT_TOKENS, "Number of draft tokens."),
                              (NUM_ACCEPTED_TOKENS, "Number of accepted draft tokens.")):
                self._families[name] = Counter(f"{self._prefix}:{name}", doc, labels,
                                               registry=self._registry)
            self._families[NUM_ACCEPTED_TOKENS_PER_POS] = Counter(
                f"{self._prefix}:{NUM_ACCEPTED_TOKENS_PER_POS}",
                "Accepted tokens per draft position.", [*labels, "position"],
                registry=self._registry)
        self._num_positions = max(self._num_positions, num_positions)
        for engine in self._engine_indexes:
            self.add_engine(engine)

    def add_engine(self, engine: int) -> None:
        """Publish zero series for an engine (a no-op until started)."""
        if not self._families:
            return
        for name in (NUM_DRAFTS, NUM_DRAFT_TOKENS, NUM_ACCEPTED_TOKENS):
            self._child(name, engine)
        for position in range(self._num_positions):
            self._child(NUM_ACCEPTED_TOKENS_PER_POS, engine, str(position))

    def record(self, stats: SpecDecodingStats, engine_idx: int) -> None:
        """Add one snapshot's deltas to engine `engine_idx`'s counters."""
        if not self._families or len(stats.num_accepted_tokens_per_pos) > self._num_positions:
            self.start(len(stats.num_accepted_tokens_per_pos))
        self._child(NUM_DRAFTS, engine_idx).inc(stats.num_drafts)
        self._child(NUM_DRAFT_TOKENS, engine_idx).inc(stats.num_draft_tokens)
        self._child(NUM_ACCEPTED_TOKENS, engine_idx).inc(stats.num_accepted_tokens)
        for position, accepted in enumerate(stats.num_accepted_tokens_per_pos):
            self._child(NUM_ACCEPTED_TOKENS_PER_POS, engine_idx, str(position)).inc(accepted)

    def _child(self, name: str, engine: int, *extra: str) -> Any:
        return self._families[name].labels(self._model_name, str(engine), *extra)


class SpecDecodingLogging:
    """One engine's speculative-decoding counts over a log interval, and their log line."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start a new interval."""
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

    def record(self, stats: SpecDecodingStats) -> None:
        """Add one snapshot's deltas."""
        self.num_drafts += stats.num_drafts
        self.num_draft_tokens += stats.num_draft_tokens
        self.num_accepted_tokens += stats.num_accepted_tokens
        per_pos = stats.num_accepted_tokens_per_pos
        if len(per_pos) > len(self.accepted_per_pos):
            self.accepted_per_pos.extend([0] * (len(per_pos) - len(self.accepted_per_pos)))
        for position, accepted in enumerate(per_pos):
            self.accepted_per_pos[position] += accepted

    def format_line(self, elapsed: float) -> str | None:
        """The interval's line (vLLM's `SpecDecoding metrics: ...`), or None without drafts.

        Args:
            elapsed: the interval's length in seconds (for the throughputs).
        """
        drafts = self.num_drafts
        if not drafts:
            return None
        accepted, drafted = self.num_accepted_tokens, self.num_draft_tokens
        elapsed = max(elapsed, 1e-9)
        # The mean acceptance length counts the bonus token each verification adds.
        mean_length = 1 + accepted / drafts
        rates = ", ".join(f"{count / drafts:.3f}" for count in self.accepted_per_pos)
        draft_rate = accepted / drafted * 100 if drafted else math.nan
        return (f"SpecDecoding metrics: Mean acceptance length: {mean_length:.2f}, "
                f"Accepted throughput: {accepted / elapsed:.2f} tokens/s, "
                f"Drafted throughput: {drafted / elapsed:.2f} tokens/s, "
                f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
                f"Per-position acceptance rate: {rates}, "
                f"Avg Draft acceptance rate: {draft_rate:.1f}%")
