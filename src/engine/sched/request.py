"""A request's state inside the engine core's scheduler.

Owned by the scheduler (`scheduler.py`), which creates a `Request` from each
`EngineCoreRequest`, moves it between the waiting queue (`request_queue.py`) and the running
list, and appends the tokens the workers sample. The KV cache manager reads its token ids and
block hashes. Plain slotted objects, not msgspec Structs: they never cross a process boundary
and are mutated every step.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Collection
from typing import Any

from ringserve.engine.wire import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreRequest,
    FinishReason,
)
from ringserve.gpu.multimodal.features import ImageFeature
from ringserve.lora_request import LoRARequest
from ringserve.pooling_params import PoolingParams
from ringserve.sampling_params import SamplingParams

__all__ = ["Request", "RequestStatus"]


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; every status above PREEMPTED is final."""

    WAITING_FOR_GRAMMAR = -1  # its structured-output grammar is compiling
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        """True for the final statuses."""
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        """The wire finish reason of a final status (None while unfinished)."""
        return _FINISH_REASONS.get(self)

    @staticmethod
    def for_reason(reason: FinishReason) -> RequestStatus:
        """The final status that reports `reason`."""
        return _STATUS_FOR_REASON[reason]


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}
_STATUS_FOR_REASON = {reason: status for status, reason in _FINISH_REASONS.items()}
_STATUS_FOR_REASON[FinishReason.REPETITION] = RequestStatus.FINISHED_STOPPED

_sequence = itertools.count()


class Request:
    """One request's scheduling state.

    Attributes:
        request_id: the frontend's id.
        client_index: which frontend client sent it (outputs are grouped by it).
        prompt_token_ids: the prompt (the list from the wire; never mutated).
        all_token_ids: prompt then output tokens known so far.
        num_prompt_tokens: len(prompt_token_ids).
        sampling_params: the request's sampling parameters.
        max_tokens: the most output tokens (sampling max_tokens capped by max_model_len).
        min_tokens: no stop check before this many output tokens.
        stop_ids: token ids that end the request (EOS unless ignore_eos, and stop_token_ids).
        eos_ids: the EOS ids among `stop_ids` (they end it without a stop_reason).
        priority: lower is served first under the priority policy.
        arrival_time: the frontend's `time.time()` at arrival.
        seq: intake order in this process (breaks ties between equal arrival times).
        status: a `RequestStatus`.
        num_computed_tokens: tokens whose KV is (or is being) computed: advanced when a step
            is scheduled, not when its output arrives (async scheduling).
        num_output_placeholders: sampled tokens scheduled for but not yet received.
        num_cached_tokens: prompt tokens served from the prefix cache at the first
            scheduling (-1 before that).
        num_preemptions: times the request was preempted.
        scheduled_since_step: the step at which it last became running; outputs of earlier
            steps are stale (it was preempted in between) and are discarded.
        was_scheduled: workers have seen it (they must be told when it finishes).
        block_hashes: prefix-cache hashes of its full blocks (prefix caching on).
        num_cached_blocks: leading blocks of its table registered in the prefix cache
            (owned by the KV cache manager).
        events: life-cycle events not yet sent (None when stats are off).
        stop_reason: the stop token id that ended it, if any.
        error: why it finished with FinishReason.ERROR.
        grammar: its structured-output grammar (a `RequestGrammar`), or None.
        pooling_params: set for a pooling request (`ringserve.gpu.pooling`): it asks for
            one token that is never sampled, and ends with the pooler's output.
        lora_request: the LoRA adapter it runs under (None: the base model); its identity
            is one of the request's prefix-cache keys, as a salt is.
        mm_features: its images (`ringserve.gpu.multimodal`; None: text only); their
            identifiers are the prefix-cache keys of the blocks they touch.
    """

    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "cache_salt",
        "client_index",
        "eos_ids",
        "error",
        "events",
        "grammar",
        "lora_request",
        "max_tokens",
        "min_tokens",
        "mm_features",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "num_prompt_tokens",
        "pooling_params",
        "priority",
        "prompt_token_ids",
        "request_id",
        "sampling_params",
        "scheduled_since_step",
        "seq",
        "skip_prefix_cache_read",
        "status",
        "stop_ids",
        "stop_reason",
        "wants_logprobs",
        "wants_prompt_logprobs",
        "was_scheduled",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        client_index: int = 0,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: list[ImageFeature] | None = None,
    ) -> None:
        self.request_id = request_id
        self.mm_features = mm_features
        self.pooling_params = pooling_params
        self.lora_request = lora_request
        if lora_request is not None:
            # Blocks computed under an adapter (or under another load of it) are its own.
            cache_salt = f"{cache_salt or ''}\x00lora:{lora_request.identity}"
        self.client_index = client_index
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = n = len(prompt_token_ids)
        self.sampling_params = sp = sampling_params
        room = max(max_model_len - n, 0)
        self.max_tokens = room if sp.max_tokens is None else min(sp.max_tokens, room)
        self.min_tokens = sp.min_tokens
        self.eos_ids: Collection[int] = () if sp.ignore_eos else eos_token_ids
        if sp.stop_token_ids:
            self.stop_ids: Collection[int] = frozenset(sp.stop_token_ids).union(self.eos_ids)
        else:
            self.stop_ids = self.eos_ids
        self.wants_logprobs = sp.logprobs is not None
        self.wants_prompt_logprobs = sp.prompt_logprobs is not None
        # Prompt logprobs (and per-token pooling) need every prompt position computed, so no
        # prefix-cache read.
        self.skip_prefix_cache_read = self.wants_prompt_logprobs or (
            pooling_params is not None and pooling_params.task.startswith("token_"))
        if pooling_params is not None:
            # A pooling request's prompt may fill the whole context: the one token it asks
            # for (the scheduler's books) is never sampled.
            self.max_tokens = 1
        self.priority = priority
        self.arrival_time = arrival_time
        self.cache_salt = cache_salt
        self.seq = next(_sequence)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1
        self.num_cached_blocks = 0
        self.num_preemptions = 0
        self.scheduled_since_step = 0
        self.was_scheduled = False
        self.block_hashes: list[bytes] = []
        self.events: list[EngineCoreEvent] | None = None
        self.stop_reason: int | None = None
        self.error: str | None = None
        self.grammar: Any = None

    @classmethod
    def from_engine_core_request(
        cls, request: EngineCoreRequest, *, max_model_len: int, eos_token_ids: frozenset[int]
    ) -> Request:
        """Build the scheduler's state for a request received from the frontend."""
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            max_model_len=max_model_len,
            eos_token_ids=eos_token_ids,
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            client_index=request.client_index,
            pooling_params=request.pooling_params,
            lora_request=request.lora_request,
            mm_features=request.mm_features,
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus known output tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens received so far."""
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the output tokens received so far."""
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        """True once the request reached a final status."""
        return self.status > RequestStatus.PREEMPTED

    def record_event(self, kind: EngineCoreEventType, timestamp: float) -> None:
        """Queue a life-cycle event for the request's next output (stats on only)."""
        events = self.events
        if events is None:
            self.events = [EngineCoreEvent(kind, timestamp)]
        else:
            events.append(EngineCoreEvent(kind, timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """The queued events, handed over once."""
        events = self.events
        self.events = None
        return events

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"placeholders={self.num_output_placeholders})"
        )
