"""`POST /v1/completions`: prompts in, text (streamed or not) out, in OpenAI's legacy shape.

Each prompt (a string, or token ids) is one engine request; choice `i * n + j` is output `j`
of prompt `i`, as in vLLM. Text prompts are tokenized here, so the context-length check can
answer vLLM's message before anything reaches the engine; the engine then receives token ids
(with the text, for echo and detokenization). `echo` prepends the prompt (and, with
`logprobs`, its logprobs, for which the prompt's logprobs are requested from the engine).
Each choice carries the weight versions of its tokens (`ringserve.http.responses`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response

from ringserve.engine.frontend.input_processor import TokensPrompt
from ringserve.http.context import AppContext, request_id_of
from ringserve.http.errors import bad_request
from ringserve.http.generation import Job, check_admission, check_constraint, make_job, run_jobs
from ringserve.http.logprobs import append_completion_logprobs, prompt_logprobs
from ringserve.http.protocol import CompletionRequest, prompts_of
from ringserve.http.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    json_response,
    usage,
    weight_versions,
)
from ringserve.http.sampling import build_params
from ringserve.http.streaming import Emit, SSEResponse
from ringserve.outputs import CompletionOutput, RequestOutput


@dataclass
class _Choice:
    """Per-choice streaming state."""

    started: bool = False
    offset: int = 0
    num_tokens: int = 0


@dataclass
class _Stream:
    """Per-request streaming state."""

    choices: dict[int, _Choice] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)  # prompt index -> cached tokens

    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices.values())


class Completions:
    """The completions route."""

    def __init__(self, ctx: AppContext) -> None:
        self.ctx = ctx

    async def create(self, request: Request) -> Response:
        """Handle one completion request (the app's guard maps errors to responses)."""
        ctx = self.ctx
        req = await ctx.parse(request, CompletionRequest)
        ctx.check_model(req.model)
        if req.suffix is not None:
            raise bad_request("suffix: not supported", "suffix")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise bad_request(f"best_of: got {req.best_of}, allowed: None or n", "best_of")
        base_id = f"cmpl-{request_id_of(request, req.request_id)}"
        jobs = await self._jobs(req, base_id)
        check_admission(ctx.engine, jobs)
        if req.stream:
            # A constraint the backend refuses is a 400, not an error event (as on chat).
            check_constraint(jobs[0].params, ctx.engine.config.structured_outputs_config
                             .resolved_backend)
            return SSEResponse(lambda emit: self._stream(req, base_id, jobs, emit))
        return await self._full(request, req, base_id, jobs)

    async def _jobs(self, req: CompletionRequest, base_id: str) -> list[Job]:
        ctx = self.ctx
        num_prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            num_prompt_logprobs = max(num_prompt_logprobs or 0, req.logprobs)
        params = build_params(req, ctx.engine.config.model_config, max_tokens=req.max_tokens,
                              logprobs=req.logprobs, prompt_logprobs=num_prompt_logprobs)
        jobs = []
        for i, prompt in enumerate(prompts_of(req.prompt)):
            tokens: TokensPrompt
            if isinstance(prompt, str):
                tokens = {"prompt_token_ids": await ctx.tokenize(prompt), "prompt": prompt}
            else:
                tokens = {"prompt_token_ids": prompt}
            jobs.append(make_job(f"{base_id}-{i}", tokens, params, req,
                                 ctx.engine.config.model_config, ctx.lora_for(req.model)))
        return jobs

    def _cached(self, cached_tokens: int) -> int | None:
        """The usage's cached tokens, when `--enable-prompt-tokens-details` asks for them."""
        return cached_tokens if self.ctx.settings.enable_prompt_tokens_details else None

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return str(self.ctx.tokenizer.decode(output.prompt_token_ids))

    def _choice(self, req: CompletionRequest, output: RequestOutput, out: CompletionOutput,
                index: int, first: bool, offset: int,
                stream: bool = False) -> tuple[CompletionChoice, int]:
        """One choice (or, with `stream`, a delta of it); `first`: the choice's first chunk
        (echo goes there). Returns it with the text offset after it."""
        tokenizer = self.ctx.tokenizer
        text = out.text
        logprobs = None
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
        if first and req.echo:
            text = self._prompt_text(output) + text
            if logprobs is not None:
                positions = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
                offset = append_completion_logprobs(logprobs, tokenizer, output.prompt_token_ids,
                                                    positions, req.logprobs or 0, offset)
        if logprobs is not None and out.logprobs is not None:
            offset = append_completion_logprobs(logprobs, tokenizer, out.token_ids,
                                                out.logprobs, req.logprobs or 0, offset)
        choice = CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            prompt_logprobs=(prompt_logprobs(output.prompt_logprobs)
                             if first and req.prompt_logprobs is not None else None))
        if stream:
            choice.weight_version = out.weight_version
        else:
            choice.weight_versions = weight_versions(out.weight_versions)
        return choice, offset

    async def _full(self, request: Request, req: CompletionRequest, base_id: str,
                    jobs: list[Job]) -> Response:
        finals: dict[int, RequestOutput] = {}

        async def keep(index: int, output: RequestOutput) -> None:
            finals[index] = output

        if not await run_jobs(self.ctx.engine, jobs, keep, request.receive):
            return Response(status_code=499)  # the client left; nobody reads this
        n = jobs[0].params.n
        choices = []
        completion_tokens = 0
        for i in range(len(jobs)):
            output = finals[i]
            for out in output.outputs:
                choices.append(self._choice(req, output, out, i * n + out.index, True, 0)[0])
                completion_tokens += len(out.token_ids)
        prompt_tokens = sum(job.num_prompt_tokens for job in jobs)
        cached = sum(output.num_cached_tokens for output in finals.values())
        return json_response(CompletionResponse(
            id=base_id, created=int(time.time()), model=self.ctx.response_model(req.model),
            choices=sorted(choices, key=lambda c: c.index),
            usage=usage(prompt_tokens, completion_tokens, self._cached(cached))))

    async def _stream(self, req: CompletionRequest, base_id: str, jobs: list[Job],
                      emit: Emit) -> None:
        created = int(time.time())
        model = self.ctx.response_model(req.model)
        n = jobs[0].params.n
        prompt_tokens = sum(job.num_prompt_tokens for job in jobs)
        state = _Stream()

        async def send(index: int, output: RequestOutput) -> None:
            state.cached[index] = max(state.cached.get(index, 0), output.num_cached_tokens)
            for out in output.outputs:
                choice_state = state.choices.setdefault(index * n + out.index, _Choice())
                if not (out.text or out.token_ids or out.finish_reason
                        or (req.echo and not choice_state.started)):
                    continue
                choice, choice_state.offset = self._choice(
                    req, output, out, index * n + out.index, not choice_state.started,
                    choice_state.offset, stream=True)
                choice_state.started = True
                choice_state.num_tokens += len(out.token_ids)
                await emit(CompletionResponse(
                    id=base_id, created=created, model=model, choices=[choice],
                    usage=(usage(prompt_tokens, state.completion_tokens(),
                                 self._cached(sum(state.cached.values())))
                           if req.continuous_usage else None)))

        await run_jobs(self.ctx.engine, jobs, send)
        if req.include_usage:
            await emit(CompletionResponse(
                id=base_id, created=created, model=model, choices=[],
                usage=usage(prompt_tokens, state.completion_tokens(),
                            self._cached(sum(state.cached.values())))))

