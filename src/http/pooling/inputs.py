"""A pooling request's inputs as token ids: texts tokenized in one batch (in a worker thread
when they are long, so the event loop keeps serving), token ids checked against the
vocabulary, both truncated as `truncate_prompt_tokens` asks
(`ringserve.engine.frontend.pooling_inputs` does the work; this module only decides where it
runs and what the messages call the inputs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import trio

from ringserve.config import PoolerConfig
from ringserve.engine.frontend.pooling_inputs import (
    TokenizedInput,
    check_token_ids,
    tokenize_pairs,
    tokenize_texts,
    truncate_token_ids,
    truncation_length,
)
from ringserve.http.context import AppContext
from ringserve.http.errors import APIError

T = TypeVar("T")

# Batches with more characters than this are tokenized in a worker thread (AsyncLLM's cut-off
# for one prompt).
_INLINE_TOKENIZE_CHARS = 2048


def pooler_of(ctx: AppContext, route: str) -> PoolerConfig:
    """The engine's pooler (the app's guard already refused pooling routes on a generation
    server; this is the same refusal for a caller that skipped it)."""
    pooler = ctx.engine.config.pooler_config
    if pooler is None:
        raise APIError(400, f"The model `{ctx.model_name}` does not support {route}: it is a "
                       "generation model (serve a pooling model, --runner pooling)", "model")
    return pooler


async def _off_loop(chars: int, work: Callable[[], T]) -> T:
    if chars > _INLINE_TOKENIZE_CHARS:
        return await trio.to_thread.run_sync(work)
    return work()


async def token_inputs(ctx: AppContext, inputs: Sequence[str] | Sequence[list[int]], *,
                       truncate_prompt_tokens: int | None, field: str,
                       noun: str = "input", add_special_tokens: bool = True,
                       ) -> list[list[int]]:
    """Each input's token ids, truncated and checked.

    Raises:
        ValueError: a bad `truncate_prompt_tokens`, an empty input, ids outside the
            vocabulary (each naming its field).
    """
    pooler = pooler_of(ctx, field)
    truncate_to = truncation_length(truncate_prompt_tokens, pooler)
    texts = [x for x in inputs if isinstance(x, str)]
    if texts:
        ids = await _off_loop(sum(len(t) for t in texts), lambda: tokenize_texts(
            ctx.tokenizer, texts, truncate_to, add_special_tokens=add_special_tokens))
    else:
        ids = truncate_token_ids([list(x) for x in inputs if not isinstance(x, str)],
                                 truncate_to)
    check_token_ids(ids, ctx.engine.config.model_config.vocab_size, field, noun)
    return ids


async def pair_inputs(ctx: AppContext, firsts: Sequence[str], seconds: Sequence[str], *,
                      truncate_prompt_tokens: int | None, field: str,
                      noun: str = "pair") -> list[TokenizedInput]:
    """Each text pair tokenized as the cross-encoder reads it, truncated and checked.

    Raises:
        ValueError: a bad `truncate_prompt_tokens`, or a pair with no tokens.
    """
    pooler = pooler_of(ctx, field)
    truncate_to = truncation_length(truncate_prompt_tokens, pooler)
    chars = sum(len(t) for t in firsts) + sum(len(t) for t in seconds)
    pairs = await _off_loop(chars, lambda: tokenize_pairs(ctx.tokenizer, firsts, seconds,
                                                          truncate_to))
    check_token_ids([p.token_ids for p in pairs], ctx.engine.config.model_config.vocab_size,
                    field, noun)
    return pairs
