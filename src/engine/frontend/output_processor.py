"""Output processing (frontend side): engine-core token deltas become `RequestOutput`s.

`LLMEngine` and `AsyncLLM` hand each batch of `EngineCoreOutput`s to one `OutputProcessor`,
which keeps a `RequestState` per request (detokenizer, logprobs, timing), applies stop strings
(collecting the ids the core must abort because the frontend stopped them), shapes the result by
output kind (cumulative, delta, final only) and merges the children of an n > 1 request through
their `ParentRequest`. Pure Python over the wire structs: no trio, zmq or torch.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ringserve.engine.frontend.detokenizer import IncrementalDetokenizer
from ringserve.engine.frontend.logprobs import LogprobsAccumulator
from ringserve.engine.frontend.parent_request import ParentRequest
from ringserve.engine.metrics.stats import IterationStats, RequestStateStats
from ringserve.engine.wire import EngineCoreOutput, EngineCoreRequest, FinishReason
from ringserve.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    WeightVersionSpan,
)
from ringserve.sampling_params import RequestOutputKind


class RequestState:
    """Everything the frontend tracks for one (child) request."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        tokenizer: Any,
        parent: ParentRequest | None,
        index: int,
        queue: Any,
        external_id: str | None = None,
    ) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        if external_id is None:
            external_id = parent.request_id if parent is not None else request.request_id
        self.external_id = external_id
        # What aborts this request as a whole: its parent's internal id, or its own.
        self.handle = parent.internal_id if parent is not None else request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.parent = parent
        self.index = index
        self.queue = queue
        self.output_kind = params.output_kind
        self.detokenizer = IncrementalDetokenizer.for_request(tokenizer, request.prompt_token_ids,
                                                              params)
        self.logprobs = LogprobsAccumulator(tokenizer, params.logprobs, params.prompt_logprobs)
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)
        self.stats = RequestStateStats.from_wall_arrival(request.arrival_time)
        lora = request.lora_request
        self.lora_name = lora.lora_name if lora is not None else None
        self.max_tokens_param = params.max_tokens
        self.n_param = parent.params.n if parent is not None else params.n
        self.num_cached_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.prefilling = True  # until the first token (admission: queued prompt tokens)
        self.weight_versions: list[WeightVersionSpan] = []
        self._sent_prompt_logprobs = False
        # A pooling request (`ringserve.engine.frontend.pooling`): answered with the pooler's
        # output, which its last core output carries.
        self.pooling = request.pooling_params is not None
        self.pooling_output: Any = None

    def apply(self, out: EngineCoreOutput, weight_version: str | None = None) -> list[int]:
        """Fold one core output in (its tokens generated with `weight_version`).

        Returns:
            The output's new token ids that the request keeps: all of them, unless a stop
            string completed before the last one (a multi-token step), which ends the request
            there and drops the rest, as one-token steps would have.
        """
        now = time.time()
        new_token_ids = out.new_token_ids
        # The core stops on EOS (stop_reason None) or a stop token id: that token is no text.
        stop_terminated = (out.finish_reason is FinishReason.STOP
                           and not isinstance(out.stop_reason, str))
        num_before = len(self.detokenizer.token_ids)
        stop_string = self.detokenizer.update(new_token_ids, stop_terminated)
        num_kept: int | None = None
        if stop_string is not None:
            num_kept = len(self.detokenizer.token_ids) - num_before
            new_token_ids = new_token_ids[:num_kept]
        if new_token_ids:
            spans = self.weight_versions
            if not spans or spans[-1].version != weight_version:
                spans.append(WeightVersionSpan(weight_version,
                                               self.metrics.num_generation_tokens))
            if self.metrics.first_token_time is None:
                self.metrics.first_token_time = now
            self.metrics.last_token_time = now
            self.metrics.num_generation_tokens += len(new_token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.pooling_output is not None:
            self.pooling_output = out.pooling_output
        self.logprobs.add_prompt(out.new_prompt_logprobs)
        self.logprobs.add_sampled(out.new_logprobs, num_kept)
        if stop_string is not None:
            self.finish_reason, self.stop_reason = FinishReason.STOP, stop_string
        elif out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        if self.finish_reason is not None:
            self.metrics.finished_time = now
        return new_token_ids

    @property
    def finished(self) -> bool:
        """True once the core or a stop string ended the request."""
        return self.finish_reason is not None

    def completion(self, new_token_ids: list[int]) -> CompletionOutput | None:
        """This request's CompletionOutput for its output kind (None: nothing to report)."""
        finished = self.finished
        kind = self.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind is RequestOutputKind.DELTA:
            text = self.detokenizer.text_delta(finished)
            token_ids = new_token_ids
            all_logprobs = self.logprobs.logprobs
            logprobs = None
            if all_logprobs is not None:
                logprobs = all_logprobs[len(all_logprobs) - len(new_token_ids):]
        else:
            text = self.detokenizer.visible_text(finished)
            token_ids = list(self.detokenizer.token_ids)
            logprobs = self.logprobs.logprobs
        if not new_token_ids and not finished:
            return None
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.logprobs.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=str(self.finish_reason) if self.finish_reason is not None else None,
            stop_reason=self.stop_reason,
            weight_versions=list(self.weight_versions),
        )

    def prompt_logprobs_for_output(self) -> Any:
        """Prompt logprobs: in every cumulative output, once for delta outputs."""
        if self.logprobs.prompt_logprobs is None:
            return None
        if self.output_kind is RequestOutputKind.DELTA:
            if self._sent_prompt_logprobs:
                return None
            self._sent_prompt_logprobs = True
        return self.logprobs.prompt_logprobs


@dataclass
class ProcessedOutputs:
    """The result of one `process_outputs` call.

    Attributes:
        request_outputs: outputs for callers without a queue (the sync LLMEngine).
        reqs_to_abort: requests a stop string ended that the core must abort.
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)
    pooling_outputs: list[PoolingRequestOutput] = field(default_factory=list)


class OutputProcessor:
    """Per-request state for a frontend, fed with each batch of core outputs.

    Args:
        tokenizer: a transformers tokenizer (None: token ids only, no text).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        # Keyed by the parent's internal id (its handle).
        self.parent_requests: dict[str, ParentRequest] = {}
        # Internal ids are `{user id}#{counter}` (children: `{i}_` before it): everything after
        # the last '#' is this request's own counter value, so no two collide in this frontend
        # whatever the user ids are. Deterministic on purpose (runs repeat exactly). Frontends
        # that share a core must also fold in their client index (scale-out).
        self._id_counter = itertools.count()
        # Set by a frontend of a scaled-out deployment ("f<client index>."): internal ids stay
        # unique across frontends that share the cores, whatever ids their callers pick.
        self.id_prefix = ""
        # Prompt tokens of tracked requests that have not produced a token yet.
        self.num_prefill_tokens = 0

    def admit(self, request: EngineCoreRequest, prompt: str | None,
              queue: Any = None) -> tuple[str, list[EngineCoreRequest]]:
        """Start tracking a user request under a fresh internal id (n > 1: n children).

        The user's `request.request_id` is only echoed in the outputs: two requests may share
        it, and neither can abort, fail or receive the other's outputs.

        Args:
            request: the processed request, with the user's id.
            prompt: its prompt text (None for token prompts).
            queue: where its RequestOutputs go (None: returned by `process_outputs`).

        Returns:
            The request's handle (for `abort_requests`) and the core requests to send.
        """
        external_id = request.request_id
        handle = f"{external_id}#{self.id_prefix}{next(self._id_counter)}"
        params = request.sampling_params
        if params.n == 1:
            core_request = msgspec.structs.replace(request, request_id=handle)
            self.add_request(core_request, prompt, queue=queue, external_id=external_id)
            return handle, [core_request]
        parent = ParentRequest(external_id, params, internal_id=handle)
        children = [msgspec.structs.replace(request, request_id=cid,
                                            sampling_params=parent.child_params(i))
                    for i, cid in enumerate(parent.child_ids)]
        for index, child in enumerate(children):
            self.add_request(child, prompt, parent, index, queue=queue)
        return handle, children

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent: ParentRequest | None = None,
        index: int = 0,
        queue: Any = None,
        external_id: str | None = None,
    ) -> None:
        """Start tracking a (child) request under its core id (`admit` picks unique ones).

        Raises:
            ValueError: the request id is already in flight.
        """
        if request.request_id in self.request_states:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        self.request_states[request.request_id] = RequestState(
            request, prompt, self.tokenizer, parent, index, queue, external_id)
        self.num_prefill_tokens += len(request.prompt_token_ids)
        if parent is not None:
            self.parent_requests[parent.internal_id] = parent

    def handles_of(self, external_ids: list[str]) -> list[str]:
        """The handles of the tracked requests with these user ids (in admission order)."""
        wanted = set(external_ids)
        handles = dict.fromkeys(state.handle for state in self.request_states.values()
                                if state.external_id in wanted)
        return list(handles)

    def abort_requests(self, request_ids: list[str], notify: bool = False) -> list[str]:
        """Stop tracking requests (parents expand to their children); returns core ids.

        Args:
            request_ids: handles from `admit` (or core ids); `handles_of` maps user ids.
            notify: put a final output with finish reason "abort" in each request's queue.
        """
        core_ids: list[str] = []
        for rid in request_ids:
            parent = self.parent_requests.get(rid)
            ids = list(parent.child_ids) if parent is not None else [rid]
            for cid in ids:
                state = self.request_states.get(cid)
                if state is None:
                    continue
                core_ids.append(cid)
                state.finish_reason = FinishReason.ABORT
                output = self._make_output(state, []) if notify else None
                self._forget(state)
                if output is not None and state.queue is not None:
                    state.queue.put(output)
            self.parent_requests.pop(rid, None)
        return core_ids

    def fail_requests(self, request_ids: list[str], error: BaseException) -> None:
        """Fail the given (child) requests with `error` (their engine core died); forget them.

        Ids no longer tracked are skipped.
        """
        for cid in request_ids:
            state = self.request_states.get(cid)
            if state is None:
                continue
            if state.queue is not None:
                state.queue.put(error)
            self._forget(state)
            parent = state.parent
            if parent is not None and not any(c in self.request_states
                                              for c in parent.child_ids):
                self.parent_requests.pop(parent.internal_id, None)

    def propagate_error(self, error: BaseException) -> None:
        """Fail every tracked request with `error` (engine death); forget them all."""
        for state in list(self.request_states.values()):
            if state.queue is not None:
                state.queue.put(error)
        self.request_states.clear()
        self.parent_requests.clear()
        self.num_prefill_tokens = 0

    def has_unfinished_requests(self) -> bool:
        """True while any request is tracked."""
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        """Number of tracked (child) requests."""
        return len(self.request_states)

    def process_outputs(
        self,
        outputs: list[EngineCoreOutput],
        engine_core_timestamp: float = 0.0,
        iteration_stats: IterationStats | None = None,
        weight_version: str | None = None,
    ) -> ProcessedOutputs:
        """Fold one batch of core outputs into request states and build RequestOutputs.

        Outputs of requests no longer tracked (aborted meanwhile) are dropped. Requests with
        a queue get their RequestOutput put there; others are returned.

        Args:
            outputs: the batch (or a chunk of it).
            engine_core_timestamp: the batch's `EngineCoreOutputs.timestamp` (token times).
            iteration_stats: filled with this batch's token counts and latencies, when given.
            weight_version: the batch's `EngineCoreOutputs.weight_version`.
        """
        result = ProcessedOutputs()
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue
            if iteration_stats is not None:
                iteration_stats.update_from_output(
                    len(out.new_token_ids), out.events, engine_core_timestamp, state.prefilling,
                    len(state.prompt_token_ids), state.stats)
            new_token_ids = state.apply(out, weight_version)
            if state.finished and out.finish_reason is None:
                # A stop string ended it: the core, which still runs it, must abort it.
                result.reqs_to_abort.append(out.request_id)
            if new_token_ids:
                self._end_prefill(state)
            if state.pooling and state.pooling_output is not None:
                pooled = PoolingRequestOutput(state.external_id,
                                              PoolingOutput(state.pooling_output),
                                              state.prompt_token_ids,
                                              num_cached_tokens=state.num_cached_tokens)
                if iteration_stats is not None and state.finish_reason is not None:
                    iteration_stats.update_from_finished_request(
                        state.finish_reason, len(state.prompt_token_ids), state.max_tokens_param,
                        state.n_param, state.stats, state.lora_name)
                self._forget(state)
                if state.queue is not None:
                    state.queue.put(pooled)
                else:
                    result.pooling_outputs.append(pooled)
                continue
            request_output = self._make_output(state, new_token_ids)
            if state.finished:
                if iteration_stats is not None and state.finish_reason is not None:
                    iteration_stats.update_from_finished_request(
                        state.finish_reason, len(state.prompt_token_ids), state.max_tokens_param,
                        state.n_param, state.stats, state.lora_name)
                self._forget(state)
            if request_output is None:
                continue
            if state.queue is not None:
                state.queue.put(request_output)
            else:
                result.request_outputs.append(request_output)
        return result

    def _end_prefill(self, state: RequestState) -> None:
        if state.prefilling:
            state.prefilling = False
            self.num_prefill_tokens -= len(state.prompt_token_ids)

    def _make_output(self, state: RequestState, new_token_ids: list[int]) -> RequestOutput | None:
        completion = state.completion(new_token_ids)
        if state.parent is not None:
            completions, finished = state.parent.merge(state.index, completion, state.finished,
                                                       state.output_kind)
            if completions is None:
                return None
        else:
            if completion is None:
                return None
            completions, finished = [completion], state.finished
        return RequestOutput(
            request_id=state.external_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs_for_output(),
            outputs=completions,
            finished=finished,
            metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens,
        )

    def _forget(self, state: RequestState) -> None:
        del self.request_states[state.request_id]
        self._end_prefill(state)
        parent = state.parent
        if parent is not None and parent.all_finished:
            self.parent_requests.pop(parent.internal_id, None)
