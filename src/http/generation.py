"""Running one HTTP request's prompts on the engine and merging their outputs.

A completion may carry several prompts; each becomes one engine request (`Job`) and runs in
its own task, and the route consumes the merged `(prompt index, RequestOutput)` stream in
arrival order. A job's failure (EngineGenerateError, EngineDeadError, a late ValueError)
travels through the channel as a value and is raised in the consumer unwrapped, so routes map
it to an HTTP error without unpacking exception groups. If the consumer fails or is cancelled
(a client disconnect), the nursery cancels the jobs and leaving `AsyncLLM.generate` early
aborts their requests in the core; a plain (non-streaming) response also watches for the
client's disconnect and stops the same way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio
from starlette.types import Receive

from ringserve.config import ModelConfig
from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.engine.frontend.input_processor import TokensPrompt
from ringserve.engine.structured.validation import check_structured_outputs
from ringserve.gpu.multimodal.features import ImageFeature
from ringserve.http.errors import bad_request
from ringserve.http.protocol import SamplingRequest
from ringserve.http.sampling import resolve_max_tokens
from ringserve.lora_request import LoRARequest
from ringserve.outputs import RequestOutput
from ringserve.sampling_params import SamplingParams

OnOutput = Callable[[int, RequestOutput], Awaitable[None]]


@dataclass(frozen=True)
class Job:
    """One engine request of an HTTP request."""

    request_id: str
    prompt: TokensPrompt
    params: SamplingParams
    priority: int = 0
    lora_request: LoRARequest | None = None  # the adapter the request's `model` names
    mm_features: list[ImageFeature] | None = None  # the prompt's images, rendered

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt's length in tokens."""
        return len(self.prompt.get("prompt_token_ids", []))


def make_job(request_id: str, prompt: TokensPrompt, params: SamplingParams,
             req: SamplingRequest, model_config: ModelConfig,
             lora_request: LoRARequest | None = None, *,
             mm_features: list[ImageFeature] | None = None) -> Job:
    """A job for one tokenized prompt: the request's cache salt and priority, and its
    `max_tokens` resolved against the context length. The prompt is checked here (not only
    in the engine), so a stream's bad prompt is a 400 rather than an error chunk.
    `mm_features`: the images of a prompt whose token ids hold their expanded tokens.

    Raises:
        APIError: 400 for an empty prompt, token ids outside the vocabulary, or a prompt and
            requested output that do not fit.
    """
    if req.cache_salt is not None:
        prompt["cache_salt"] = req.cache_salt
    ids = prompt.get("prompt_token_ids", [])
    if not ids:
        raise bad_request("prompt: empty prompts are not allowed", "prompt")
    vocab_size = model_config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"prompt: token ids {bad[:5]} outside the vocabulary "
                          f"[0, {vocab_size})", "prompt")
    requested = params.max_tokens
    max_tokens = resolve_max_tokens(requested, len(ids), model_config.max_model_len)
    if requested is None:  # the model's max_new_tokens caps what the context leaves
        max_tokens = min(max_tokens, int(model_config.generation_defaults.get("max_tokens",
                                                                              max_tokens)))
    if max_tokens != requested:
        params = params.clone(max_tokens=max_tokens)
    return Job(request_id, prompt, params, req.priority, lora_request, mm_features)


def check_constraint(params: SamplingParams, backend: str) -> None:
    """The input processor's grammar check, run before a stream starts, so a constraint the
    backend cannot compile is a 400 rather than an error chunk (plain responses get the same
    ValueError from `generate`).

    Raises:
        ValueError: the constraint is invalid (the message names the field).
    """
    if params.structured_outputs is not None:
        check_structured_outputs(params.structured_outputs, backend)


def check_admission(engine: AsyncLLM, jobs: list[Job]) -> None:
    """Apply the engine's admission limits to the whole request up front (503 before any
    response starts); `generate` checks again when each job is added.

    Raises:
        QueueOverflowError, MaxQueuedTokensError: a limit would be exceeded.
    """
    engine.check_admission(sum(job.params.n for job in jobs),
                           sum(job.params.n * job.num_prompt_tokens for job in jobs))


async def _pump(engine: AsyncLLM, index: int, job: Job,
                send: trio.MemorySendChannel[tuple[int, RequestOutput | Exception]]) -> None:
    async with send:
        try:
            # The adapter is passed only when there is one (engines without LoRA, and the
            # tests' scripted engines, take no such argument).
            extra: dict[str, Any] = ({} if job.lora_request is None
                                     else {"lora_request": job.lora_request})
            if job.mm_features is not None:  # likewise images
                extra["mm_features"] = job.mm_features
            async for output in engine.generate(job.prompt, job.params, job.request_id,
                                                priority=job.priority, **extra):
                await send.send((index, output))
        except Exception as exc:  # handed to the consumer, which raises it
            await send.send((index, exc))


async def run_jobs(engine: AsyncLLM, jobs: list[Job], on_output: OnOutput,
                   receive: Receive | None = None) -> bool:
    """Run every job and call `on_output(job index, output)` for each output, in order of
    arrival, from this task.

    Args:
        receive: the request's ASGI receive, once its body has been read: a client
            disconnect then cancels the jobs (a plain response; streams watch on their own).

    Returns:
        False when the client disconnected (the jobs were aborted), else True.

    Raises:
        The first job's error (unwrapped), or `on_output`'s.
    """
    # One slot per job: a job waits for the consumer rather than running ahead.
    send, recv = trio.open_memory_channel[tuple[int, RequestOutput | Exception]](len(jobs))
    failure: Exception | None = None
    left = trio.Event()
    async with trio.open_nursery() as nursery:
        if receive is not None:
            nursery.start_soon(_watch_disconnect, receive, left, nursery.cancel_scope)
        async with send:
            for index, job in enumerate(jobs):
                nursery.start_soon(_pump, engine, index, job, send.clone())
        try:
            async for index, item in recv:
                if isinstance(item, Exception):
                    raise item
                await on_output(index, item)
        except Exception as exc:
            failure = exc
        nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return not left.is_set()


async def _watch_disconnect(receive: Receive, left: trio.Event, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    left.set()
    scope.cancel()
