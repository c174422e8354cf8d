"""The prompt-length rule, in one place for every layer that checks a prompt.

A prompt has at least one token and at most `max_model_len - 1`, so at least one generated
token fits in the context (vLLM's rule). The frontend's input processor, the HTTP layer's
`max_tokens` resolution, the scheduler's admission limits and the worker's request validation
all ask this module; it is a leaf (standard library only) so that `ringserve.gpu`, which must
not import `ringserve.engine`, can use it too.
"""

from __future__ import annotations

__all__ = ["check_prompt_length", "max_prompt_len", "prompt_length_problem"]


def max_prompt_len(max_model_len: int) -> int:
    """The longest prompt a context of `max_model_len` tokens serves: `max_model_len - 1`."""
    return max_model_len - 1


def prompt_length_problem(num_prompt_tokens: int, max_model_len: int) -> str | None:
    """Why a prompt of this length is refused, or None if its length is allowed.

    Args:
        num_prompt_tokens: the prompt's length in tokens.
        max_model_len: the longest prompt + output, in tokens.
    """
    if num_prompt_tokens < 1:
        return "prompt: empty prompts are not allowed; at least one token is required"
    longest = max_model_len - 1
    if num_prompt_tokens > longest:
        return (
            f"prompt: got {num_prompt_tokens} tokens, allowed: at most {longest} (max_model_len "
            f"is {max_model_len} and at least one generated token must fit)"
        )
    return None


def check_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    """Raise unless a prompt of this length is allowed.

    Raises:
        ValueError: an empty prompt, or one longer than `max_prompt_len(max_model_len)`.
    """
    problem = prompt_length_problem(num_prompt_tokens, max_model_len)
    if problem is not None:
        raise ValueError(problem)
