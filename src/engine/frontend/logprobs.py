"""Turning the workers' logprob arrays into the per-position dicts users read.

The engine core forwards `Logprobs` (int32 token ids and float32 log-probabilities, column 0
the sampled or prompt token, the other columns the top-k) for each request; the frontend keeps
one `LogprobsAccumulator` per request that converts only the new rows, decodes each candidate
token once, and keeps the running cumulative log-probability.
"""

from __future__ import annotations

import math
from typing import Any

from ringserve.gpu.wire import Logprobs
from ringserve.outputs import Logprob, PositionLogprobs


class LogprobsAccumulator:
    """Logprobs and prompt logprobs of one request, built incrementally.

    Args:
        tokenizer: decodes candidate tokens (None: no decoded_token).
        num_logprobs: top-k asked for generated positions (None: not asked; -1: all columns).
        num_prompt_logprobs: the same for prompt positions.
    """

    def __init__(self, tokenizer: Any, num_logprobs: int | None, num_prompt_logprobs: int | None) -> None:
        self._tokenizer = tokenizer
        self._k = num_logprobs
        self._prompt_k = num_prompt_logprobs
        self.logprobs: list[PositionLogprobs] | None = [] if num_logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if num_prompt_logprobs is not None else None  # the first prompt token has none
        )
        self.cumulative_logprob: float | None = 0.0 if num_logprobs is not None else None
        self._decoded: dict[int, str] = {}

    def add_sampled(self, lp: Logprobs | None, num_rows: int | None = None) -> list[PositionLogprobs]:
        """Add rows for newly sampled tokens; returns the new positions.

        Args:
            lp: the step's rows, one per new token.
            num_rows: keep only the first rows (the tokens a stop string left in the output).
        """
        if lp is None or self.logprobs is None or self._k is None:
            return []
        if num_rows is not None and num_rows < len(lp.ranks):
            lp = Logprobs(lp.token_ids[:num_rows], lp.logprobs[:num_rows], lp.ranks[:num_rows])
        rows = self._rows(lp, self._k)
        self.logprobs.extend(rows)
        if self.cumulative_logprob is not None:
            # One float64 addition per token, in order: the sum is the same however the engine
            # chunked the tokens into steps (a float32 sum of the chunk would not be).
            for value in lp.logprobs[:, 0].tolist():
                self.cumulative_logprob += value
        return rows

    def add_prompt(self, lp: Logprobs | None) -> list[PositionLogprobs | None]:
        """Add rows for prompt positions computed this step; returns the new positions."""
        if lp is None or self.prompt_logprobs is None or self._prompt_k is None:
            return []
        rows: list[PositionLogprobs | None] = list(self._rows(lp, self._prompt_k))
        self.prompt_logprobs.extend(rows)
        return rows

    def _rows(self, lp: Logprobs, k: int) -> list[PositionLogprobs]:
        ids = lp.token_ids.tolist()
        values = lp.logprobs.tolist()
        ranks = lp.ranks.tolist()
        width = len(ids[0]) if ids else 0
        cols = width if k < 0 else min(width, k + 1)
        out: list[PositionLogprobs] = []
        for row_ids, row_vals, rank in zip(ids, values, ranks, strict=True):
            position: PositionLogprobs = {}
            for col in range(cols):
                token = row_ids[col]
                if token in position:
                    continue
                value = row_vals[col]
                position[token] = Logprob(
                    logprob=value if not math.isnan(value) else -math.inf,
                    rank=rank if col == 0 else col,
                    decoded_token=self._decode(token),
                )
            out.append(position)
        return out

    def _decode(self, token: int) -> str | None:
        if self._tokenizer is None:
            return None
        text = self._decoded.get(token)
        if text is None:
            text = str(self._tokenizer.decode([token]))
            self._decoded[token] = text
        return text
