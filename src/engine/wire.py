"""Messages between the frontend (AsyncLLM, LLMEngine) and the engine core.

Requests, aborts and utility calls flow to the core as one tagged union, `CoreInput`; each
batch of results flows back as `EngineCoreOutputs`. All are msgspec Structs encoded with
`ringserve.serial` (msgpack, arrays out of band, no pickle), over zmq ipc:// or tcp://, so a
frontend and its cores may sit on different hosts.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec
import numpy as np

from ringserve.gpu.multimodal.features import ImageFeature
from ringserve.gpu.wire import Logprobs
from ringserve.lora_request import LoRARequest
from ringserve.pooling_params import PoolingParams
from ringserve.sampling_params import SamplingParams

__all__ = [
    "CORE_HUNG_METHOD",
    "DEAD_CALL_ID",
    "FAULT_INSTRUCTIONS",
    "FAULT_INSTRUCTION_METHOD",
    "AbortRequests",
    "AddRequest",
    "CoreInput",
    "EngineCoreEvent",
    "EngineCoreEventType",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineStatus",
    "FaultStatus",
    "FinishReason",
    "HandshakeReply",
    "Logprobs",
    "SchedulerStats",
    "SpecDecodingStats",
    "UtilityCall",
    "UtilityOutput",
]


class FinishReason(enum.IntEnum):
    """Why a sequence ended; `str()` gives the OpenAI-facing form ("stop", "length", ...)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreEventType(enum.IntEnum):
    """Request life-cycle events recorded by the core."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct, array_like=True, gc=False):
    """A life-cycle event with its `time.monotonic()` timestamp (seconds) in the core."""

    type: EngineCoreEventType
    timestamp: float


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A tokenized request, sent once from the frontend to a core.

    Attributes:
        request_id: unique among in-flight requests of the frontend.
        prompt_token_ids: the prompt, already tokenized.
        sampling_params: validated sampling parameters.
        arrival_time: `time.time()` when the frontend received the request.
        priority: lower values are served first under the `priority` policy.
        cache_salt: isolates this request's prefix-cache entries from other salts.
        data_parallel_rank: pin to one DP rank; None lets the client balance.
        client_index: which frontend client sent it (outputs are routed back by it).
        pooling_params: set for a pooling request (an embedding, a classification, a score):
            prefill only, answered with the pooler's output instead of tokens;
            `sampling_params` then asks for one token (the scheduler's books) that is never
            sampled.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    data_parallel_rank: int | None = None
    client_index: int = 0
    # Appended fields (array_like: order is the wire format; only append at the end).
    pooling_params: PoolingParams | None = None
    # The LoRA adapter the request runs under (`--enable-lora`; None: the base model).
    lora_request: LoRARequest | None = None
    # The prompt's images, in prompt order (`ringserve.gpu.multimodal`; None: text only).
    mm_features: list[ImageFeature] | None = None


class AddRequest(msgspec.Struct, tag="add", array_like=True, gc=False):
    """Frontend -> core: admit a request."""

    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort", array_like=True, gc=False):
    """Frontend -> core: abort these requests (unknown ids are ignored)."""

    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility", array_like=True, gc=False):
    """Frontend -> core: call a named utility method (reset_prefix_cache, retry, ...)."""

    call_id: int
    method: str
    args: list[Any] = []
    client_index: int = 0


CoreInput = AddRequest | AbortRequests | UtilityCall


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Core -> frontend: the result of a `UtilityCall` (or why it failed)."""

    call_id: int
    failure_message: str | None = None
    result: Any = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Core -> frontend: what happened to one request in one step.

    Attributes:
        request_id: the request.
        new_token_ids: tokens sampled this step.
        new_logprobs: logprobs of `new_token_ids`, when asked for.
        new_prompt_logprobs: logprobs of prompt positions computed this step, when asked for.
        finish_reason: set on the request's last output.
        stop_reason: the stop token id (or, from the frontend, stop string) that ended it.
        events: life-cycle events since the last output, when stats are on.
        num_cached_tokens: prompt tokens served from the prefix cache.
        pooling_output: a pooling request's result (float32; see `PoolingOutput`), on its
            last (and only) output.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    new_prompt_logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] | None = None
    num_cached_tokens: int = 0
    # Appended fields (array_like: order is the wire format; only append at the end).
    pooling_output: np.ndarray[Any, Any] | None = None

    @property
    def finished(self) -> bool:
        """True on the request's last output."""
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Speculative decoding's counts since the previous snapshot (vLLM's meanings).

    Attributes:
        num_drafts: request-steps that carried at least one draft token.
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: draft tokens accepted (the bonus token not counted).
        num_accepted_tokens_per_pos: accepted drafts per draft position 0..k-1 (the list as
            long as the largest k scheduled).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Scheduler state snapshot sent with an output batch (for logging and Prometheus).

    Counts named for events (prefix-cache queries and hits, preemptions, estimated FLOPs,
    expert load) are deltas since the previous snapshot (expert load: since the previous one
    that carried it); the frontend's counters add them up. With stats off
    (`disable_log_stats`) the core still sends the two queue lengths, which least-loaded DP
    routing needs, on the batches it sends anyway; every other field is then left at its
    default (and the frontend has no stat loggers to feed).
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    step_counter: int = 0
    current_wave: int = 0
    # Appended fields (array_like: order is the wire format; only append at the end).
    estimated_flops: float = 0.0  # per GPU, of the steps scheduled since the previous stats
    # Tokens routed to each expert, per sparse layer (in layer order) then per expert, since
    # the previous stats that carried it (--enable-expert-load-metrics; sent at most once per
    # stats interval and when the core runs out of requests; None in between).
    expert_load: list[list[int]] | None = None
    # Speculative decoding's counts since the previous stats (None: none this interval, or
    # speculation is off).
    spec_decoding: SpecDecodingStats | None = None
    # LoRA (`--enable-lora`): adapter name -> its running / waiting requests (None: off).
    lora_running: dict[str, int] | None = None
    lora_waiting: dict[str, int] | None = None
    # Images: the workers' encoder cache in use, 0..1 (None: a text-only model).
    encoder_cache_usage: float | None = None


class EngineStatus(enum.IntEnum):
    """A core's fault-tolerance state; `str()` gives the HTTP form ("healthy", ...)."""

    HEALTHY = 0
    UNHEALTHY = 1  # a fault: requests are refused until `retry` (or `abort`, or the timeout)
    DEAD = 2  # the core is shutting down and will not recover

    def __str__(self) -> str:
        return self.name.lower()


class FaultStatus(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Core -> frontend (in `EngineCoreOutputs.fault_status`): the core's state changed.

    Attributes:
        status: the new state.
        fault_info: what the fault was (the error, described), while not healthy.
        last_ft_request_id: the id of the last fault instruction the core acted on.
        ft_error: why the last instruction (or the recovery) failed, if it did.
    """

    status: EngineStatus
    fault_info: str | None = None
    last_ft_request_id: str | None = None
    ft_error: str | None = None


# The utility method a fault instruction travels as: args [instruction, ft_request_id].
FAULT_INSTRUCTION_METHOD = "apply_fault_instruction"
# The instructions an unhealthy core takes (`ringserve.engine.core.sentinel`).
FAULT_INSTRUCTIONS = ("retry", "abort")

# `UtilityOutput.call_id` of a core's dead notice (an engine fault; the core exits next).
DEAD_CALL_ID = -1
# The utility method by which a frontend tells a core it has declared it hung (silent for the
# hang timeout: stopped, or stuck): args [reason], call id 0 (no answer is awaited). The core,
# once it runs again, takes it as an engine fault (`ringserve.engine.core.faults.hang_timeout_s`).
CORE_HUNG_METHOD = "engine_core_hung"


class HandshakeReply(msgspec.Struct, tag="handshake", array_like=True):
    """Core -> frontend, first message: ready (with its sizes) or failed (with the reason)."""

    ready: bool
    num_blocks: int = 0
    max_model_len: int = 0
    error: str = ""
    engine_index: int = 0
    pid: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Core -> frontend: one batch of results.

    Attributes:
        engine_index: the data-parallel rank of the core that sent it.
        outputs: per-request outputs of one step.
        scheduler_stats: scheduler snapshot, when stats are on.
        timestamp: `time.monotonic()` in the core when the batch was made.
        utility_output: the answer to a utility call (then `outputs` is usually empty).
        finished_requests: ids finished in the core this step (for clients that track them).
        fault_status: the core's fault-tolerance state, sent when it changes.
        weight_version: the weight version the batch's tokens were generated with (None:
            the start-up weights, or no version set).
    """

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: list[str] | None = None
    # Appended fields (array_like: order is the wire format; only append at the end).
    fault_status: FaultStatus | None = None
    weight_version: str | None = None
