"""Engine logprobs in the API's shapes: legacy completions, chat, and vLLM's prompt logprobs.

The engine gives, per position, a dict token id -> Logprob whose first entry is the sampled
(or prompt) token and whose others are the top-k candidates. Completions list that token and
up to k candidates (OpenAI: "up to logprobs+1 elements"); chat lists the k most likely
candidates. JSON has no infinity, so -inf becomes -9999.0 as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ringserve.http.responses import (
    CompletionLogprobs,
    LogprobEntry,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from ringserve.outputs import Logprob, PositionLogprobs

_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, _FLOOR)


def _text(tokenizer: Any, token: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return str(tokenizer.decode([token]))


def append_completion_logprobs(out: CompletionLogprobs, tokenizer: Any, token_ids: Sequence[int],
                               positions: Sequence[PositionLogprobs | None], num: int,
                               offset: int) -> int:
    """Append positions (token ids with their logprob dicts; None for a prompt's first token)
    in the legacy format, text offsets starting at `offset`; returns the offset after them."""
    for token, position in zip(token_ids, positions, strict=True):
        lp = position.get(token) if position is not None else None
        text = _text(tokenizer, token, lp)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if position is None or lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_value(lp.logprob))
        top: dict[str, float] = {}
        for i, (cand, cand_lp) in enumerate(position.items()):
            if i > num:
                break
            top.setdefault(_text(tokenizer, cand, cand_lp), _value(cand_lp.logprob))
        out.top_logprobs.append(top)
    return offset


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int],
                  positions: Sequence[PositionLogprobs], num: int) -> list[LogprobEntry]:
    """Chat entries for generated tokens, each with its `num` most likely candidates."""
    entries = []
    for token, position in zip(token_ids, positions, strict=True):
        text = _text(tokenizer, token, position.get(token))
        lp = position.get(token)
        ranked = sorted(position.items(), key=lambda item: -item[1].logprob)[:num]
        top = [TopLogprob(token=(t := _text(tokenizer, cand, cand_lp)),
                          logprob=_value(cand_lp.logprob), bytes=list(t.encode()))
               for cand, cand_lp in ranked]
        entries.append(LogprobEntry(token=text, logprob=_value(lp.logprob if lp else _FLOOR),
                                    bytes=list(text.encode()), top_logprobs=top))
    return entries


def prompt_logprobs(positions: Sequence[PositionLogprobs | None] | None) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs`: per prompt position, token id -> logprob, rank, text."""
    if positions is None:
        return None
    return [None if position is None else
            {token: PromptLogprob(logprob=_value(lp.logprob), rank=lp.rank,
                                  decoded_token=lp.decoded_token)
             for token, lp in position.items()}
            for position in positions]
