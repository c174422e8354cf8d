"""`POST /v1/chat/completions`: messages through the chat template, an assistant reply out.

The rendered prompt is tokenized here (no special tokens added by default: the template has
them), checked against the context length, and run as one engine request with `n` choices.
Streams send each choice's role delta first, then content deltas, the finish reason in the
last delta, and (with `stream_options.include_usage`) a usage chunk. `echo` repeats the last
message's content when it has the reply's role (vLLM's rule, for continue_final_message).
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from ringserve.http.chat_template import conversation_of, render_chat
from ringserve.http.context import AppContext, request_id_of
from ringserve.http.errors import bad_request
from ringserve.http.generation import Job, check_admission, make_job, run_jobs
from ringserve.http.logprobs import chat_logprobs, prompt_logprobs
from ringserve.http.protocol import ChatCompletionRequest
from ringserve.http.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    DeltaMessage,
    json_response,
    usage,
)
from ringserve.http.sampling import build_params
from ringserve.http.streaming import Emit, SSEResponse
from ringserve.outputs import CompletionOutput, RequestOutput
from ringserve.sampling_params import SamplingParams

ROLE = "assistant"


class Chat:
    """The chat completions route."""

    def __init__(self, ctx: AppContext) -> None:
        self.ctx = ctx

    async def create(self, request: Request) -> Response:
        """Handle one chat completion request (the app's guard maps errors to responses)."""
        ctx = self.ctx
        req = await ctx.parse(request, ChatCompletionRequest)
        ctx.check_model(req.model)
        format_type = (req.response_format or {}).get("type", "text")
        if format_type != "text":
            raise bad_request(f"response_format: type {format_type!r} is not supported; "
                              "allowed: text", "response_format")
        conversation = conversation_of(req.messages)
        text = render_chat(ctx, conversation, add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message,
                           template_kwargs=req.chat_template_kwargs)
        token_ids = await ctx.tokenize(text, add_special_tokens=req.add_special_tokens)
        job = make_job(f"chatcmpl-{request_id_of(request, req.request_id)}",
                       {"prompt_token_ids": token_ids, "prompt": text},
                       self._params(req), req, ctx.engine.config.model_config)
        check_admission(ctx.engine, [job])
        echo = ""
        last = conversation[-1]
        if req.echo and last["role"] == (ROLE if req.add_generation_prompt else last["role"]):
            echo = last["content"]
        if req.stream:
            return SSEResponse(lambda emit: self._stream(req, job, echo, emit))
        return await self._full(request, req, job, echo)

    def _params(self, req: ChatCompletionRequest) -> SamplingParams:
        num_logprobs = None
        if req.logprobs:
            num_logprobs = req.top_logprobs or 0
        elif req.top_logprobs:
            raise bad_request("top_logprobs: only with logprobs=true", "top_logprobs")
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        return build_params(req, self.ctx.engine.config.model_config, max_tokens=max_tokens,
                            logprobs=num_logprobs, prompt_logprobs=req.prompt_logprobs)

    def _logprobs(self, req: ChatCompletionRequest, out: CompletionOutput) -> ChatLogprobs | None:
        if not req.logprobs or out.logprobs is None:
            return None
        return ChatLogprobs(content=chat_logprobs(self.ctx.tokenizer, out.token_ids,
                                                  out.logprobs, req.top_logprobs or 0))

    async def _full(self, request: Request, req: ChatCompletionRequest, job: Job,
                    echo: str) -> Response:
        final: list[RequestOutput] = []

        async def keep(index: int, output: RequestOutput) -> None:
            final.append(output)

        if not await run_jobs(self.ctx.engine, [job], keep, request.receive):
            return Response(status_code=499)  # the client left; nobody reads this
        output = final[-1]
        choices = [
            ChatChoice(index=out.index, message=ChatMessageOut(role=ROLE, content=echo + out.text),
                       logprobs=self._logprobs(req, out), finish_reason=out.finish_reason,
                       stop_reason=out.stop_reason)
            for out in sorted(output.outputs, key=lambda o: o.index)]
        completion_tokens = sum(len(out.token_ids) for out in output.outputs)
        return json_response(ChatCompletionResponse(
            id=job.request_id, created=int(time.time()), model=self.ctx.model_name,
            choices=choices, usage=usage(job.num_prompt_tokens, completion_tokens),
            prompt_logprobs=(prompt_logprobs(output.prompt_logprobs)
                             if req.prompt_logprobs is not None else None)))

    async def _stream(self, req: ChatCompletionRequest, job: Job, echo: str,
                      emit: Emit) -> None:
        created = int(time.time())
        model = self.ctx.model_name
        completion_tokens = 0

        def chunk(choice: ChatStreamChoice | None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=job.request_id, created=created, model=model,
                choices=[] if choice is None else [choice],
                usage=(usage(job.num_prompt_tokens, completion_tokens)
                       if req.continuous_usage else None))

        for index in range(job.params.n):
            await emit(chunk(ChatStreamChoice(index=index,
                                              delta=DeltaMessage(role=ROLE, content=""))))
            if echo:
                await emit(chunk(ChatStreamChoice(index=index, delta=DeltaMessage(content=echo))))

        async def send(_: int, output: RequestOutput) -> None:
            nonlocal completion_tokens
            for out in output.outputs:
                if not (out.text or out.token_ids or out.finish_reason):
                    continue
                completion_tokens += len(out.token_ids)
                await emit(chunk(ChatStreamChoice(
                    index=out.index, delta=DeltaMessage(content=out.text),
                    logprobs=self._logprobs(req, out), finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason)))

        await run_jobs(self.ctx.engine, [job], send)
        if req.include_usage:
            await emit(ChatCompletionChunk(id=job.request_id, created=created, model=model,
                                           choices=[],
                                           usage=usage(job.num_prompt_tokens, completion_tokens)))
