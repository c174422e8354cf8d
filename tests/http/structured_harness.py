"""A scripted `generate` for the structured-output and tool tests: the app runs as usual over
the null-model engine, but the engine's `generate` answers a given text (in given pieces when
streaming) and records the prompt and SamplingParams each request brought."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.outputs import CompletionOutput, RequestOutput
from ringserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class Script:
    """What the fake generate answers, and what it was asked."""

    pieces: list[str]
    finish_reason: str = "stop"
    params: list[SamplingParams] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def script(monkeypatch: pytest.MonkeyPatch, engine: AsyncLLM, pieces: list[str],
           finish_reason: str = "stop") -> Script:
    """Make `engine.generate` answer `pieces` (each choice the same)."""
    s = Script(list(pieces), finish_reason)

    async def generate(prompt: Any, params: SamplingParams, request_id: str, *,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        s.params.append(params)
        s.prompts.append(prompt.get("prompt", ""))
        ids = list(prompt["prompt_token_ids"])
        chunks = s.pieces if params.output_kind == RequestOutputKind.DELTA else [s.text]
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            outs = [CompletionOutput(index=j, text=chunk, token_ids=[20],
                                     finish_reason=s.finish_reason if last else None)
                    for j in range(params.n)]
            yield RequestOutput(request_id, prompt.get("prompt"), ids, None, outs, last)

    monkeypatch.setattr(engine, "generate", generate)
    return s


def pieces_of(text: str, size: int = 3) -> list[str]:
    """`text` in deltas of `size` characters, as a detokenizer hands them out."""
    return [text[i:i + size] for i in range(0, len(text), size)]
