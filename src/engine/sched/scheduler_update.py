"""The output side of the scheduler: sampled tokens in, stop checks, outputs to clients.

Part of `Scheduler` (`scheduler.py`, which mixes `OutputMixin` in); split out because it is the
other half of a step. The engine core calls `update_from_output()` with each step's
`SchedulerOutput` and the workers' `ModelRunnerOutput`, in step order, and sends the returned
`EngineCoreOutputs` to each frontend client.

Stop checks run here, in the engine, on token ids: EOS (unless ignore_eos), stop_token_ids
(the id becomes the stop_reason), max_tokens and max_model_len (LENGTH; `Request.max_tokens`
is already capped by max_model_len), none while fewer than min_tokens were generated. When one
token is both a stop token and the max_tokens-th token, STOP wins. `check_stop` is the one
place this rule lives, for a decode's single token and a multi-token step alike. Stop
strings are the frontend's job.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable

from ringserve.engine.sched.kv_cache_manager import KVCacheManager
from ringserve.engine.sched.request import Request, RequestStatus
from ringserve.engine.wire import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    Logprobs,
    SchedulerStats,
)
from ringserve.gpu.spec_decode.scheduling import SpecScheduling
from ringserve.gpu.wire import ModelRunnerOutput, SchedulerOutput

__all__ = ["OutputMixin", "append_tokens", "check_stop"]

_RUNNING = RequestStatus.RUNNING
_STOPPED = RequestStatus.FINISHED_STOPPED
_ERROR = RequestStatus.FINISHED_ERROR
_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED


class OutputMixin(ABC):
    """`update_from_output` and its helpers; the state lives in `Scheduler`."""

    kv_cache_manager: KVCacheManager
    requests: dict[str, Request]
    running: list[Request]
    block_size: int
    log_stats: bool
    engine_index: int
    _pending_outputs: list[tuple[int, EngineCoreOutput]]
    _finished_by_client: dict[int, list[str]]
    spec: SpecScheduling | None

    @abstractmethod
    def _free_request(self, req: Request) -> None:
        """Implemented by `Scheduler`."""

    @abstractmethod
    def finish_requests(
        self, request_ids: str | Iterable[str], reason: FinishReason = FinishReason.ABORT, *,
        notify: bool = False,
    ) -> None:
        """Implemented by `Scheduler`."""

    @abstractmethod
    def make_stats(self) -> SchedulerStats:
        """Implemented by `Scheduler`."""

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Apply one step's sampled tokens, check stops, and build outputs per client.

        Args:
            scheduler_output: the step, as `schedule()` returned it.
            model_runner_output: what the workers produced for it.

        Returns:
            client index -> that client's `EngineCoreOutputs` (with `SchedulerStats` on one
            of them: the full snapshot when stats are on, else only the running / waiting
            counts DP routing needs). Outputs queued between steps (admission errors,
            notified aborts) are included.
        """
        step_id = scheduler_output.step_id
        requests = self.requests
        if model_runner_output.request_errors:
            self._fail_in_worker(model_runner_output.request_errors)
        outputs: dict[int, list[EngineCoreOutput]] = {}
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        any_finished = False
        offset = 0
        last_client = -1
        client_list: list[EngineCoreOutput] = []
        drafted = scheduler_output.spec_token_ids
        pooled = model_runner_output.pooled
        for request_id, sampled in zip(
            model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True
        ):
            start = offset
            offset += len(sampled)
            req = requests.get(request_id)
            # Stale: finished or aborted meanwhile, or preempted after this step was scheduled.
            if req is None or req.status is not _RUNNING or step_id < req.scheduled_since_step:
                continue
            if drafted and sampled and request_id in drafted:
                # Speculative decoding: the rejected drafts' positions are computed again.
                assert self.spec is not None
                req.num_computed_tokens -= self.spec.verified(len(drafted[request_id]),
                                                              len(sampled))
            new_prompt_logprobs = prompt_logprobs.get(request_id) if prompt_logprobs else None
            if len(sampled) == 1:
                # A decode, the hot case: `append_tokens` without its loop, and `check_stop`
                # called only for a token that can end the request (a stop id, or the
                # max_tokens-th output): the call costs ~3% of a 256-decode step.
                if req.num_output_placeholders:
                    req.num_output_placeholders -= 1
                tokens = req.all_token_ids
                token = sampled[0]
                tokens.append(token)
                num_out = len(tokens) - req.num_prompt_tokens
                if token in req.stop_ids or num_out >= req.max_tokens:
                    check_stop(req, token, num_out)
                new_tokens = sampled
            elif sampled:
                new_tokens = append_tokens(req, sampled)
            elif pooled and request_id in pooled:
                # A pooling request's last chunk: it ends with the pooler's output.
                req.status = _STOPPED
                new_tokens = sampled
            elif new_prompt_logprobs is None:
                continue  # a prefill chunk: nothing to report yet
            else:
                new_tokens = sampled
            grammar = req.grammar
            if grammar is not None and new_tokens and not grammar.accept(new_tokens):
                req.status = _ERROR
                req.error = f"request {request_id!r}: {grammar.error}"
            new_logprobs = None
            if logprobs is not None and req.wants_logprobs and new_tokens:
                new_logprobs = _slice_logprobs(logprobs, start, start + len(new_tokens))
            events = req.events
            if events is not None:
                req.events = None
            status = req.status
            if status is _RUNNING:
                out = EngineCoreOutput(
                    request_id,
                    new_tokens,
                    new_logprobs,
                    new_prompt_logprobs,
                    None,
                    None,
                    events,
                    req.num_cached_tokens,
                )
            else:
                any_finished = True
                out = EngineCoreOutput(
                    request_id,
                    new_tokens,
                    new_logprobs,
                    new_prompt_logprobs,
                    status.finish_reason,
                    req.error if status is _ERROR else req.stop_reason,
                    events,
                    req.num_cached_tokens,
                )
                if pooled:
                    out.pooling_output = pooled.get(request_id)
                self._free_request(req)
            client = req.client_index
            if client != last_client:
                got = outputs.get(client)
                if got is None:
                    got = outputs[client] = []
                client_list = got
                last_client = client
            client_list.append(out)
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        if self.spec is not None:
            self.spec.end_step(model_runner_output.draft_token_ids,
                               not scheduler_output.scheduled_new_reqs
                               and all(n == 1 + len(drafted.get(r, ()))
                                       for r, n in scheduler_output.num_scheduled_tokens.items()),
                               offset)
        return self._package(outputs)

    def _fail_in_worker(self, errors: dict[str, str]) -> None:
        """End the requests a worker could not serve (ERROR outputs; their blocks freed)."""
        for request_id, message in errors.items():
            req = self.requests.get(request_id)
            if req is None:
                continue
            req.error = f"request {request_id!r} failed in the worker: {message}"
            self.finish_requests(request_id, FinishReason.ERROR, notify=True)

    def take_pending_outputs(self) -> dict[int, EngineCoreOutputs]:
        """Outputs produced between steps (admission errors, notified aborts), per client."""
        return self._package({})

    def _package(self, outputs: dict[int, list[EngineCoreOutput]]) -> dict[int, EngineCoreOutputs]:
        for client, output in self._pending_outputs:
            got = outputs.get(client)
            if got is None:
                outputs[client] = [output]
            else:
                got.append(output)
        self._pending_outputs = []
        finished_by_client = self._finished_by_client
        self._finished_by_client = {}
        for client in finished_by_client:
            outputs.setdefault(client, [])
        now = time.monotonic()
        result = {
            client: EngineCoreOutputs(
                engine_index=self.engine_index,
                outputs=outs,
                timestamp=now,
                finished_requests=finished_by_client.get(client),
            )
            for client, outs in outputs.items()
        }
        first = next(iter(result.values()), None)
        if self.log_stats:
            if first is None:
                first = result[0] = EngineCoreOutputs(engine_index=self.engine_index, timestamp=now)
            first.scheduler_stats = self.make_stats()
        elif first is not None:
            # Stats off: only the queue lengths least-loaded DP routing needs, on batches sent
            # anyway (requests holds exactly the running and the waiting ones).
            running = len(self.running)
            first.scheduler_stats = SchedulerStats(num_running_reqs=running,
                                                   num_waiting_reqs=len(self.requests) - running)
        return result


def check_stop(req: Request, token: int, num_out: int) -> bool:
    """Whether `token`, the request's `num_out`-th output token, ends it; if so, its final
    status (and stop_reason) is set.

    The one copy of the stop / length rule (see the module docstring): a token in
    `req.stop_ids` ends the request as STOPPED once `req.min_tokens` outputs exist (an EOS id
    without a stop_reason, any other stop id as the stop_reason); otherwise reaching
    `req.max_tokens` outputs ends it as LENGTH. Nothing else ends a request here, so a
    caller may skip the call for a token outside `req.stop_ids` below `req.max_tokens`.
    """
    if token in req.stop_ids and num_out >= req.min_tokens:
        req.status = _STOPPED
        if token not in req.eos_ids:
            req.stop_reason = token
        return True
    if num_out >= req.max_tokens:
        req.status = _LENGTH
        return True
    return False


def append_tokens(req: Request, sampled: list[int]) -> list[int]:
    """Append a multi-token step's sampled tokens up to the first that ends the request
    (`check_stop`), consuming the step's output placeholders (async scheduling).

    Returns:
        the tokens kept: `sampled` itself, or the prefix up to the one that ended it.
    """
    placeholders = req.num_output_placeholders - len(sampled)
    req.num_output_placeholders = placeholders if placeholders > 0 else 0
    tokens = req.all_token_ids
    num_out = len(tokens) - req.num_prompt_tokens
    for index, token in enumerate(sampled):
        tokens.append(token)
        num_out += 1
        if check_stop(req, token, num_out):
            return sampled if index == len(sampled) - 1 else sampled[: index + 1]
    return sampled


def _slice_logprobs(logprobs: Logprobs, start: int, stop: int) -> Logprobs:
    return Logprobs(
        logprobs.token_ids[start:stop], logprobs.logprobs[start:stop], logprobs.ranks[start:stop]
    )
