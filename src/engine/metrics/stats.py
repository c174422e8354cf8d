"""Iteration statistics: what one batch of core outputs tells about latency and tokens.

The `OutputProcessor` owns one `RequestStateStats` per request and, for each batch of
`EngineCoreOutput`s, fills an `IterationStats` (token counts, time to first token,
inter-token latencies, and a `FinishedRequestStats` per request that ended) that the frontend
hands to the `StatLoggerManager` together with the core's `SchedulerStats`.

Timestamps are `time.monotonic()` seconds. Token times are the core's batch timestamp
(`EngineCoreOutputs.timestamp`) and queue / schedule times come from the core's
`EngineCoreEvent`s; CLOCK_MONOTONIC is system-wide on Linux, so they compare with the
frontend's arrival time. Definitions follow vLLM's V1 metrics:

* time to first token: first token's batch time - arrival in the frontend;
* inter-token latency: batch time - the previous token batch's time;
* queue time: first SCHEDULED event - QUEUED event;
* prefill time: first token - first SCHEDULED; decode time: last token - first token;
* time per output token: decode time / (generation tokens - 1);
* e2e latency: finish time - arrival.

Pure Python: no trio, zmq or prometheus.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ringserve.engine.wire import EngineCoreEvent, EngineCoreEventType, FinishReason


@dataclass(slots=True)
class RequestStateStats:
    """Timing of one (child) request as the frontend has seen it so far.

    Attributes:
        arrival_time: monotonic time the request reached the frontend.
        queued_ts: the core's QUEUED event (0.0: not seen).
        scheduled_ts: the core's first SCHEDULED event (0.0: not seen).
        first_token_ts, last_token_ts: batch times of the first and latest tokens.
        num_generation_tokens: tokens received so far.
    """

    arrival_time: float
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    num_generation_tokens: int = 0

    @classmethod
    def from_wall_arrival(cls, arrival_time: float) -> RequestStateStats:
        """Stats for a request whose `time.time()` arrival was `arrival_time`."""
        waited = max(0.0, time.time() - arrival_time)
        return cls(arrival_time=time.monotonic() - waited)


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    """One finished request's numbers (observed once each into the request histograms)."""

    finish_reason: FinishReason
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None
    n_param: int
    queued_time: float
    prefill_time: float
    decode_time: float
    inference_time: float
    mean_time_per_output_token: float
    lora_name: str | None = None  # the adapter it ran under (`--enable-lora`), None: the base


@dataclass(slots=True)
class IterationStats:
    """What one batch of core outputs (one engine step) contributed.

    Attributes:
        iteration_timestamp: frontend monotonic time the batch was processed.
        num_prompt_tokens: prompt tokens of requests that got their first token in this batch.
        num_generation_tokens: tokens generated in this batch.
        time_to_first_tokens_iter: one TTFT per request that got its first token here.
        inter_token_latencies_iter: one latency per later token batch of each request.
        finished_requests: requests that ended in this batch.
    """

    iteration_timestamp: float = field(default_factory=time.monotonic)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)

    def update_from_output(
        self,
        num_new_tokens: int,
        events: list[EngineCoreEvent] | None,
        engine_core_timestamp: float,
        is_prefilling: bool,
        num_prompt_tokens: int,
        req_stats: RequestStateStats,
    ) -> None:
        """Fold one request's output of this batch in (before the request state applies it).

        Args:
            num_new_tokens: tokens the output carries.
            events: the output's life-cycle events.
            engine_core_timestamp: the batch's core timestamp (0.0: unknown, use now).
            is_prefilling: True until the request's first token.
            num_prompt_tokens: the request's prompt length.
            req_stats: the request's stats, updated here.
        """
        now = engine_core_timestamp or self.iteration_timestamp
        for event in events or ():
            if event.type is EngineCoreEventType.QUEUED:
                req_stats.queued_ts = event.timestamp
            elif event.type is EngineCoreEventType.SCHEDULED and not req_stats.scheduled_ts:
                req_stats.scheduled_ts = event.timestamp
        if not num_new_tokens:
            return
        self.num_generation_tokens += num_new_tokens
        if is_prefilling:
            self.num_prompt_tokens += num_prompt_tokens
            self.time_to_first_tokens_iter.append(max(0.0, now - req_stats.arrival_time))
            req_stats.first_token_ts = now
        else:
            self.inter_token_latencies_iter.append(max(0.0, now - req_stats.last_token_ts))
        req_stats.last_token_ts = now
        req_stats.num_generation_tokens += num_new_tokens

    def update_from_finished_request(
        self,
        finish_reason: FinishReason,
        num_prompt_tokens: int,
        max_tokens_param: int | None,
        n_param: int,
        req_stats: RequestStateStats,
        lora_name: str | None = None,
    ) -> None:
        """Record a request that ended in this batch (`lora_name`: the adapter it ran under)."""
        e2e = max(0.0, self.iteration_timestamp - req_stats.arrival_time)
        scheduled = req_stats.scheduled_ts
        first, last = req_stats.first_token_ts, req_stats.last_token_ts
        queued = scheduled - req_stats.queued_ts if scheduled and req_stats.queued_ts else 0.0
        prefill = first - scheduled if first and scheduled else 0.0
        decode = last - first if first else 0.0
        inference = last - scheduled if last and scheduled else 0.0
        tokens = req_stats.num_generation_tokens
        tpot = decode / (tokens - 1) if tokens > 1 else 0.0
        self.finished_requests.append(FinishedRequestStats(
            finish_reason=finish_reason,
            e2e_latency=e2e,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=tokens,
            max_tokens_param=max_tokens_param,
            n_param=n_param,
            queued_time=max(0.0, queued),
            prefill_time=max(0.0, prefill),
            decode_time=max(0.0, decode),
            inference_time=max(0.0, inference),
            mean_time_per_output_token=max(0.0, tpot),
            lora_name=lora_name,
        ))
