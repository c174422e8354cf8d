"""`POST /tokenize` and `POST /detokenize` (vLLM's extras).

`/tokenize` takes a `prompt` (special tokens added by default) or chat `messages` (rendered
with the chat template, special tokens not added by default: the template has them) and
answers the token ids, their count and the context length; `/detokenize` turns token ids
back into text.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ringserve.http.chat_template import conversation_of, render_chat
from ringserve.http.context import AppContext
from ringserve.http.errors import bad_request
from ringserve.http.protocol import DetokenizeRequest, TokenizeRequest
from ringserve.http.responses import DetokenizeResponse, TokenizeResponse, json_response


class Tokenization:
    """The tokenize and detokenize routes."""

    def __init__(self, ctx: AppContext) -> None:
        self.ctx = ctx

    async def tokenize(self, request: Request) -> Response:
        """Token ids of a prompt or of chat messages."""
        ctx = self.ctx
        req = await ctx.parse(request, TokenizeRequest)
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("prompt, messages: give exactly one of them", "prompt")
        if req.messages is not None:
            text = render_chat(ctx, conversation_of(req.messages),
                               add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message)
            special = False if req.add_special_tokens is None else req.add_special_tokens
        else:
            assert req.prompt is not None
            text = req.prompt
            special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await ctx.tokenize(text, add_special_tokens=special)
        strs = None
        if req.return_token_strs:
            strs = [str(s) for s in ctx.tokenizer.convert_ids_to_tokens(ids)]
        return json_response(TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len,
                                              tokens=ids, token_strs=strs))

    async def detokenize(self, request: Request) -> Response:
        """The text of token ids."""
        ctx = self.ctx
        req = await ctx.parse(request, DetokenizeRequest)
        ctx.check_model(req.model)
        vocab_size = ctx.engine.config.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"tokens: {bad[:5]} outside the vocabulary [0, {vocab_size})",
                              "tokens")
        return json_response(DetokenizeResponse(prompt=str(ctx.tokenizer.decode(req.tokens))))
