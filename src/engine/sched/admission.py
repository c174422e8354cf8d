"""Admission limits: whether a request can ever be served by one engine core.

Used by the scheduler (`scheduler.py`) on every `add_request`, where a request that fails ends
alone with FinishReason.ERROR, and by the frontend before it sends a request, where the same
check raises a `ValueError` the client sees (HTTP 400). The frontend builds a
`RequestLimits` from the engine configuration and the number of KV blocks the core reports.
The length rule itself (at least one token, at most `max_model_len - 1`) is
`ringserve.prompt_length`'s, shared with the input processor, the HTTP layer and the worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.prompt_length import max_prompt_len, prompt_length_problem

__all__ = ["RequestLimits"]


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a prompt must satisfy to be servable.

    Attributes:
        max_model_len: the longest prompt + output; a prompt must leave room for one token
            (`ringserve.prompt_length`).
        block_size: tokens per KV block.
        num_usable_blocks: KV blocks a request may hold (all but the null block).
        max_num_batched_tokens: the token budget of one step.
        enable_chunked_prefill: without it, a prompt must fit one step's budget.
    """

    max_model_len: int
    block_size: int
    num_usable_blocks: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt that passes `check`."""
        in_cache = self.num_usable_blocks * self.block_size
        longest = min(max_prompt_len(self.max_model_len), in_cache)
        if not self.enable_chunked_prefill:
            longest = min(longest, self.max_num_batched_tokens)
        return longest

    def problem(self, num_prompt_tokens: int) -> str | None:
        """Why a prompt of this length can never be served, or None if it can."""
        problem = prompt_length_problem(num_prompt_tokens, self.max_model_len)
        if problem is not None:
            return problem
        blocks = -(-num_prompt_tokens // self.block_size)
        if blocks > self.num_usable_blocks:
            return (
                f"the prompt has {num_prompt_tokens} tokens and needs {blocks} KV blocks of "
                f"{self.block_size} tokens, but the whole KV cache holds {self.num_usable_blocks} "
                f"blocks ({self.num_usable_blocks * self.block_size} tokens)"
            )
        if not self.enable_chunked_prefill and num_prompt_tokens > self.max_num_batched_tokens:
            return (
                f"the prompt has {num_prompt_tokens} tokens, more than max_num_batched_tokens="
                f"{self.max_num_batched_tokens}, and chunked prefill is off"
            )
        return None

    def check(self, num_prompt_tokens: int) -> None:
        """Raise if a prompt of this length can never be served.

        Raises:
            ValueError: saying what is wrong and what is allowed.
        """
        problem = self.problem(num_prompt_tokens)
        if problem is not None:
            raise ValueError(problem)
