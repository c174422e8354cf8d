"""Messages between the engine core and its workers (one step's input and output).

The core's scheduler produces a `SchedulerOutput` each step and the executor broadcasts it to
every worker through the broadcast ring; the output rank answers with a `ModelRunnerOutput`
through an SPSC ring. Following vLLM's V1 split, a request's full data crosses once
(`NewRequestData`) and afterwards only what changed (`CachedRequestData`). Arrays (logprobs)
travel as out-of-band frames through `ringserve.serial`.

This module lives in `gpu` because the worker owns its input contract; it imports no torch,
so the scheduler can build these structs without touching the device stack.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from ringserve.gpu.multimodal.features import ImageFeature
from ringserve.lora_request import LoRARequest
from ringserve.pooling_params import PoolingParams
from ringserve.sampling_params import SamplingParams


class Logprobs(msgspec.Struct, array_like=True, gc=False):
    """Top-k log-probabilities for a run of token positions.

    Attributes:
        token_ids: int32 [num_positions, k + 1]; column 0 is the sampled (or prompt) token.
        logprobs: float32 [num_positions, k + 1], aligned with `token_ids`.
        ranks: int32 [num_positions]: the rank of the column-0 token in the full distribution
            (1 = most likely).
    """

    token_ids: np.ndarray[Any, Any]
    logprobs: np.ndarray[Any, Any]
    ranks: np.ndarray[Any, Any]


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything a worker needs about a request it sees for the first time."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = []
    # Appended fields (array_like: only append at the end).
    # A pooling request (`ringserve.gpu.pooling`): pooled after its last prompt token, never
    # sampled.
    pooling_params: PoolingParams | None = None
    # The LoRA adapter it runs under (`ringserve.gpu.lora`; None: the base model).
    lora_request: LoRARequest | None = None
    # Its images with their arrays (`ringserve.gpu.multimodal`; sent once, kept by the
    # worker until the request finishes, across preemptions).
    mm_features: list[ImageFeature] | None = None


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What changed for a request the worker already holds.

    Attributes:
        req_id: the request.
        num_computed_tokens: tokens whose KV is in the cache before this step.
        new_block_ids: blocks appended to the request's block table this step.
        resumed_from_preemption: the request was preempted and is scheduled again; its block
            table is replaced by `new_block_ids` and its tokens by `all_token_ids`.
        all_token_ids: prompt + output tokens, only when resumed from preemption.
        new_token_ids: tokens sampled elsewhere that this worker has not seen (pipeline
            parallel); empty otherwise.
    """

    req_id: str
    num_computed_tokens: int
    new_block_ids: list[int] = []
    resumed_from_preemption: bool = False
    all_token_ids: list[int] = []
    new_token_ids: list[int] = []


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's work for the workers.

    Attributes:
        step_id: monotonically increasing step number (for ordering and debugging).
        scheduled_new_reqs: requests scheduled for the first time.
        scheduled_cached_reqs: requests the workers already hold.
        num_scheduled_tokens: request id -> tokens to compute this step.
        total_num_scheduled_tokens: the sum of `num_scheduled_tokens`.
        finished_req_ids: requests finished (or aborted) since the last step; workers drop
            their state.
        preempted_req_ids: requests preempted this step; workers drop their state until resumed.
    """

    step_id: int
    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: list[CachedRequestData] = []
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[str] = []
    preempted_req_ids: list[str] = []
    # Appended fields (array_like: order is the wire format; only append at the end).
    # Constrained requests that sample this step: the workers run the forward, then wait for
    # the step's `GrammarOutput` before sampling.
    grammar_req_ids: list[str] = []
    # Speculative decoding (`ringserve.gpu.spec_decode`): request id -> the draft tokens this
    # step verifies (the request is scheduled `1 + len(drafts)` tokens: its last sampled token,
    # then the drafts).
    spec_token_ids: dict[str, list[int]] = {}
    # Draft tokens each request that samples this step should get proposed for the next
    # (0: propose none).
    num_spec_tokens: int = 0
    # Images (`ringserve.gpu.multimodal.scheduling`): request id -> indices of its images
    # whose encoder runs this step (before the forward), and the encoder-cache entries to
    # drop first.
    encoder_inputs: dict[str, list[int]] = {}
    free_encoder_ids: list[str] = []


class GrammarOutput(msgspec.Struct, array_like=True, gc=False):
    """Core -> workers, after a step's forward was submitted: the grammar bitmask of its
    constrained rows (computed on the core while the forward runs).

    Attributes:
        step_id: the step (`SchedulerOutput.step_id`) this masks.
        req_ids: the constrained requests, one per bitmask row (the step's `grammar_req_ids`).
        bitmask: int32 [len(req_ids), ceil(vocab / 32)]; bit `t % 32` of word `t // 32` set
            when token `t` is allowed.
    """

    step_id: int
    req_ids: list[str]
    bitmask: np.ndarray[Any, Any]


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What a step produced, from the output rank.

    Attributes:
        step_id: the `SchedulerOutput.step_id` this answers.
        req_ids: the requests of the step, in batch order.
        sampled_token_ids: per request, the tokens sampled this step (empty while a prompt
            is still being prefilled in chunks).
        logprobs: rows aligned with the concatenation of `sampled_token_ids`, when any
            request asked for logprobs (rows of other requests are present but ignored).
        prompt_logprobs: request id -> logprobs of the prompt positions computed this step.
        request_errors: request id -> why that request failed alone this step (a prompt the
            worker rejects, NaN logits); the core ends it with finish reason error.
        skipped: the step was not run (a pause skipped it: `ringserve.gpu.executor.
            step_hold`); `req_ids` are then the requests that would have sampled, and the
            core takes the step back (`Scheduler.rollback_step`).
    """

    step_id: int
    req_ids: list[str] = []
    sampled_token_ids: list[list[int]] = []
    logprobs: Logprobs | None = None
    prompt_logprobs: dict[str, Logprobs] = {}
    request_errors: dict[str, str] = {}
    skipped: bool = False
    # Appended fields (array_like: only append at the end).
    # Speculative decoding: request id -> draft tokens proposed for its next step.
    draft_token_ids: dict[str, list[int]] = {}
    # Pooling requests that finished their prompt this step: request id -> the pooler's
    # output (float32; `ringserve.gpu.pooling`). They sample nothing (an empty token list).
    pooled: dict[str, np.ndarray[Any, Any]] = {}
