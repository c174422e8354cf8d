"""One agent turn on the engine: a translated request run exactly as the chat route runs it.

`prepare_turn(ctx, chat, request_id)` takes the `ChatCompletionRequest` an agents' route built
from its own request and does what `/v1/chat/completions` does before any response starts:
the tool plan (`tool_choice` checks, the forced-call constraint, the auto parser), the chat
template, tokenization (images rendered by `ringserve.http.chat_images`), the context-length check, admission and the constraint's compile check,
so every error is the route's 400 / 503 and nothing reaches the core. `run_turn` then runs the
one engine request: a stream feeds each text delta through the choice's reasoning and tool
parsers and hands the `ChoiceDelta` to the route; a plain request parses the final text
once. Either way the route gets a `TurnResult` at the end, the same for both (the parsers
give the same split whatever the deltas), with the usage the APIs report: prompt tokens, those
read from the prefix cache, output tokens and the reasoning tokens among them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Receive

from ringserve.http.chat import chat_params
from ringserve.http.chat_images import render_chat_images
from ringserve.http.chat_output import ChatOutputPlan, ChoiceDelta, ChoiceOutput
from ringserve.http.chat_template import chat_conversation, render_chat
from ringserve.http.context import AppContext
from ringserve.http.generation import Job, check_admission, check_constraint, make_job, run_jobs
from ringserve.http.protocol import ChatCompletionRequest
from ringserve.http.reasoning.base import END as REASONING_END
from ringserve.http.tool_parsers.base import ToolCall, merge_calls
from ringserve.http.tool_parsers.request import plan_tools
from ringserve.outputs import RequestOutput

OnDelta = Callable[[ChoiceDelta], Awaitable[None]]


@dataclass(frozen=True)
class Turn:
    """A prepared engine request and how its text is parsed.

    Attributes:
        job: the engine request (one choice).
        plan: the reasoning and tool parsing of its text.
        prompt: the rendered prompt text.
        stream: the route streams it (the engine hands out deltas).
    """

    job: Job
    plan: ChatOutputPlan
    prompt: str
    stream: bool

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt's length in tokens."""
        return self.job.num_prompt_tokens


@dataclass
class TurnResult:
    """What a turn produced, whole.

    Attributes:
        reasoning: the reasoning text ("" without a reasoning parser or thinking).
        content: the answer text (tool-call markup taken out).
        calls: the tool calls, in order (arguments as JSON text).
        finish_reason: the engine's ("stop", "length", "abort"), or "tool_calls" when the
            model stopped after making calls.
        stop_reason: the stop string or token id that ended it, if one did.
        prompt_tokens: the prompt's tokens.
        cached_tokens: prompt tokens read from the prefix cache.
        output_tokens: tokens generated.
        reasoning_tokens: the generated tokens that were reasoning.
    """

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0


async def prepare_turn(ctx: AppContext, chat: ChatCompletionRequest, request_id: str, *,
                       locations: Mapping[str, str] | None = None) -> Turn:
    """Everything the chat route does before its response starts.

    Args:
        locations: the route's names of the chat messages' image parts (an image error
            names `input[0].content[1]` rather than the chat location).

    Raises:
        APIError, ValueError: 400 for bad tools, messages, parameters, a prompt that does not
            fit or a constraint that does not compile; QueueOverflowError and
            MaxQueuedTokensError (503) when admission refuses it.
    """
    settings = ctx.settings
    tools = plan_tools(chat, enable_auto_tool_choice=settings.enable_auto_tool_choice,
                       tool_call_parser=settings.tool_call_parser)
    conversation, images = chat_conversation(chat.messages)
    text = render_chat(ctx, conversation, add_generation_prompt=chat.add_generation_prompt,
                       continue_final_message=chat.continue_final_message,
                       template_kwargs=chat.chat_template_kwargs, tools=tools.tools)
    features = None
    if images:
        token_ids, features = await render_chat_images(
            ctx, text, images, add_special_tokens=chat.add_special_tokens, locations=locations)
    else:
        token_ids = await ctx.tokenize(text, add_special_tokens=chat.add_special_tokens)
    config = ctx.engine.config
    job = make_job(request_id, {"prompt_token_ids": token_ids, "prompt": text},
                   chat_params(chat, tools, config.model_config), chat, config.model_config,
                   ctx.lora_for(chat.model), mm_features=features)
    check_admission(ctx.engine, [job])
    check_constraint(job.params, config.structured_outputs_config.resolved_backend)
    plan = ChatOutputPlan(config.structured_outputs_config.reasoning_parser, tools, text)
    return Turn(job, plan, text, bool(chat.stream))


def _reasoning_tokens(tokenizer: Any, token_ids: list[int], reasoning: str) -> int:
    """How many of the generated tokens were reasoning: those up to and including the end
    marker's token when the vocabulary has one, else (a reply cut short in its reasoning,
    or a marker spelled in several tokens) every token when there was reasoning."""
    if not reasoning:
        return 0
    end = tokenizer.convert_tokens_to_ids(REASONING_END)
    unknown = getattr(tokenizer, "unk_token_id", None)
    if isinstance(end, int) and end != unknown and end in token_ids:
        return token_ids.index(end) + 1
    return len(token_ids)


class _Collector:
    """Gathers a turn's parsed pieces and token counts."""

    def __init__(self, parser: ChoiceOutput | None) -> None:
        self.parser = parser
        self.whole = ChoiceDelta()
        self.token_ids: list[int] = []
        self.result = TurnResult()

    def take(self, output: RequestOutput, on_piece: Callable[[ChoiceDelta], None]) -> bool:
        """Fold one engine output in; True once the choice finished."""
        out = output.outputs[0]
        self.token_ids += out.token_ids
        self.result.cached_tokens = max(self.result.cached_tokens, output.num_cached_tokens)
        piece = ChoiceDelta(content=out.text)
        if self.parser is not None:
            piece = self.parser.feed(out.text)
            if out.finish_reason is not None:
                piece.extend(self.parser.finish())
        self.whole.extend(piece)
        on_piece(piece)
        if out.finish_reason is None:
            return False
        reason = out.finish_reason
        if self.parser is not None:
            reason = self.parser.finish_reason(reason) or reason
        self.result.finish_reason = reason
        self.result.stop_reason = out.stop_reason
        return True


async def run_turn(ctx: AppContext, turn: Turn, on_delta: OnDelta | None = None,
                   receive: Receive | None = None) -> TurnResult | None:
    """Run the turn; with `on_delta` each non-empty parsed delta goes to it as it comes.

    Args:
        receive: the request's ASGI receive (a plain response): a client disconnect aborts
            the request.

    Returns:
        The whole result, or None when the client left.

    Raises:
        The engine's errors (EngineGenerateError, EngineDeadError, ValueError), unwrapped.
    """
    parser = turn.plan.choice() if turn.plan.parses else None
    collector = _Collector(parser)
    pending: list[ChoiceDelta] = []

    async def take(_: int, output: RequestOutput) -> None:
        collector.take(output, pending.append)
        if on_delta is not None:
            for piece in pending:
                if piece.reasoning or piece.content or piece.tool_calls:
                    await on_delta(piece)
        pending.clear()

    if not await run_jobs(ctx.engine, [turn.job], take, receive):
        return None
    result = collector.result
    whole = collector.whole
    result.reasoning = whole.reasoning
    result.content = whole.content
    result.calls = merge_calls(whole.tool_calls)
    result.prompt_tokens = turn.num_prompt_tokens
    result.output_tokens = len(collector.token_ids)
    result.reasoning_tokens = _reasoning_tokens(ctx.tokenizer, collector.token_ids,
                                                whole.reasoning)
    return result
