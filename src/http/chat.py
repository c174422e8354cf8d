"""`POST /v1/chat/completions`: messages through the chat template, an assistant reply out.

The rendered prompt is tokenized here (no special tokens added by default: the template has
them), checked against the context length, and run as one engine request with `n` choices.
Streams send each choice's role delta first, then content deltas, the finish reason in the
last delta, and (with `stream_options.include_usage`) a usage chunk. `echo` repeats the last
message's content when it has the reply's role (vLLM's rule, for continue_final_message).
Image parts (a vision-language model) are loaded and expanded into the prompt's tokens by
`ringserve.http.chat_images` and travel with the job as its features. `tools` go into the
template and, by `tool_choice`, become a constraint and a tool parser
(`ringserve.http.tool_parsers.request`); with a reasoning parser or a tool parser each
choice's text is split into reasoning, content and tool calls (`ringserve.http.chat_output`),
streamed as OpenAI's deltas; finish_reason is `tool_calls` when calls were made. Each choice
carries the weight versions of its tokens (`ringserve.http.responses`; the role and echo
deltas, sent before any token, have none).
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from ringserve.config import ModelConfig
from ringserve.http.chat_images import render_chat_images
from ringserve.http.chat_output import ChatOutputPlan, ChoiceOutput
from ringserve.http.chat_template import chat_conversation, render_chat
from ringserve.http.context import AppContext, request_id_of
from ringserve.http.errors import bad_request
from ringserve.http.generation import Job, check_admission, check_constraint, make_job, run_jobs
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
    weight_versions,
)
from ringserve.http.sampling import build_params, structured_outputs_of
from ringserve.http.streaming import Emit, SSEResponse
from ringserve.http.tool_parsers.request import ToolPlan, plan_tools
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
        tools = plan_tools(req, enable_auto_tool_choice=ctx.settings.enable_auto_tool_choice,
                           tool_call_parser=ctx.settings.tool_call_parser)
        conversation, images = chat_conversation(req.messages)
        text = render_chat(ctx, conversation, add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message,
                           template_kwargs=req.chat_template_kwargs, tools=tools.tools)
        features = None
        if images:
            token_ids, features = await render_chat_images(
                ctx, text, images, add_special_tokens=req.add_special_tokens)
        else:
            token_ids = await ctx.tokenize(text, add_special_tokens=req.add_special_tokens)
        config = ctx.engine.config
        job = make_job(f"chatcmpl-{request_id_of(request, req.request_id)}",
                       {"prompt_token_ids": token_ids, "prompt": text},
                       chat_params(req, tools, config.model_config), req, config.model_config,
                       ctx.lora_for(req.model), mm_features=features)
        check_admission(ctx.engine, [job])
        plan = ChatOutputPlan(config.structured_outputs_config.reasoning_parser, tools, text)
        echo = ""
        last = conversation[-1]
        if req.echo and last["role"] == (ROLE if req.add_generation_prompt else last["role"]):
            content = last["content"]
            echo = content if isinstance(content, str) else "\n".join(
                part["text"] for part in content if part["type"] == "text")  # images unechoed
        if req.stream:
            check_constraint(job.params, config.structured_outputs_config.resolved_backend)
            return SSEResponse(lambda emit: self._stream(req, job, plan, echo, emit))
        return await self._full(request, req, job, plan, echo)

    def _cached(self, cached_tokens: int) -> int | None:
        """The usage's cached tokens, when `--enable-prompt-tokens-details` asks for them."""
        return cached_tokens if self.ctx.settings.enable_prompt_tokens_details else None

    def _logprobs(self, req: ChatCompletionRequest, out: CompletionOutput) -> ChatLogprobs | None:
        if not req.logprobs or out.logprobs is None:
            return None
        return ChatLogprobs(content=chat_logprobs(self.ctx.tokenizer, out.token_ids,
                                                  out.logprobs, req.top_logprobs or 0))

    async def _full(self, request: Request, req: ChatCompletionRequest, job: Job,
                    plan: ChatOutputPlan, echo: str) -> Response:
        final: list[RequestOutput] = []

        async def keep(index: int, output: RequestOutput) -> None:
            final.append(output)

        if not await run_jobs(self.ctx.engine, [job], keep, request.receive):
            return Response(status_code=499)  # the client left; nobody reads this
        output = final[-1]
        choices = [self._choice(req, plan, out, echo)
                   for out in sorted(output.outputs, key=lambda o: o.index)]
        completion_tokens = sum(len(out.token_ids) for out in output.outputs)
        return json_response(ChatCompletionResponse(
            id=job.request_id, created=int(time.time()),
            model=self.ctx.response_model(req.model), choices=choices,
            usage=usage(job.num_prompt_tokens, completion_tokens,
                        self._cached(output.num_cached_tokens)),
            prompt_logprobs=(prompt_logprobs(output.prompt_logprobs)
                             if req.prompt_logprobs is not None else None)))

    def _choice(self, req: ChatCompletionRequest, plan: ChatOutputPlan, out: CompletionOutput,
                echo: str) -> ChatChoice:
        finish_reason = out.finish_reason
        if plan.parses:
            parsed = plan.choice()
            message = parsed.message(out.text, ROLE, echo)
            finish_reason = parsed.finish_reason(finish_reason)
        else:
            message = ChatMessageOut(role=ROLE, content=echo + out.text)
        return ChatChoice(index=out.index, message=message, logprobs=self._logprobs(req, out),
                          finish_reason=finish_reason, stop_reason=out.stop_reason,
                          weight_versions=weight_versions(out.weight_versions))

    async def _stream(self, req: ChatCompletionRequest, job: Job, plan: ChatOutputPlan,
                      echo: str, emit: Emit) -> None:
        created = int(time.time())
        model = self.ctx.response_model(req.model)
        completion_tokens = 0
        cached_tokens = 0
        parsers: dict[int, ChoiceOutput] = {}

        def chunk(choice: ChatStreamChoice | None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=job.request_id, created=created, model=model,
                choices=[] if choice is None else [choice],
                usage=(usage(job.num_prompt_tokens, completion_tokens,
                             self._cached(cached_tokens))
                       if req.continuous_usage else None))

        for index in range(job.params.n):
            await emit(chunk(ChatStreamChoice(index=index,
                                              delta=DeltaMessage(role=ROLE, content=""))))
            if echo:
                await emit(chunk(ChatStreamChoice(index=index, delta=DeltaMessage(content=echo))))

        async def send(_: int, output: RequestOutput) -> None:
            nonlocal completion_tokens, cached_tokens
            cached_tokens = max(cached_tokens, output.num_cached_tokens)
            for out in output.outputs:
                if not (out.text or out.token_ids or out.finish_reason):
                    continue
                completion_tokens += len(out.token_ids)
                delta = DeltaMessage(content=out.text)
                finish_reason = out.finish_reason
                if plan.parses:
                    parser = parsers.setdefault(out.index, plan.choice())
                    parsed = parser.feed(out.text)
                    if finish_reason is not None:
                        parsed.extend(parser.finish())
                        finish_reason = parser.finish_reason(finish_reason)
                    delta = parsed.delta()
                    if delta == DeltaMessage() and finish_reason is None and not req.logprobs:
                        continue  # all held back (a marker may be starting)
                await emit(chunk(ChatStreamChoice(
                    index=out.index, delta=delta, logprobs=self._logprobs(req, out),
                    finish_reason=finish_reason, stop_reason=out.stop_reason,
                    weight_version=out.weight_version)))

        await run_jobs(self.ctx.engine, [job], send)
        if req.include_usage:
            await emit(ChatCompletionChunk(id=job.request_id, created=created, model=model,
                                           choices=[],
                                           usage=usage(job.num_prompt_tokens, completion_tokens,
                                                       self._cached(cached_tokens))))


def chat_params(req: ChatCompletionRequest, tools: ToolPlan,
                model_config: ModelConfig) -> SamplingParams:
    """A chat request's SamplingParams: its sampling fields, logprobs, and the constraint its
    tool plan or response format asks for (also what the agents' routes run, translated).

    Raises:
        APIError, ValueError: a field is invalid (the message names it).
    """
    num_logprobs = None
    if req.logprobs:
        num_logprobs = req.top_logprobs or 0
    elif req.top_logprobs:
        raise bad_request("top_logprobs: only with logprobs=true", "top_logprobs")
    max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                  else req.max_tokens)
    constraint = tools.constraint or structured_outputs_of(req)
    params = build_params(req, model_config, max_tokens=max_tokens,
                          logprobs=num_logprobs, prompt_logprobs=req.prompt_logprobs,
                          structured_outputs=constraint)
    if tools.needs_special_tokens and params.skip_special_tokens:
        params = params.clone(skip_special_tokens=False)  # the markup is a special token
    return params
