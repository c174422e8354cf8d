"""From a request body to SamplingParams, and the context-length check.

Shared by completions and chat: nullable body fields get vLLM's defaults, `logit_bias`'s
string keys become token ids, and `resolve_max_tokens` applies vLLM's rule (no max_tokens:
whatever fits in `max_model_len` after the prompt) with vLLM's wording when a request cannot
fit. Range checks stay in `SamplingParams`, whose ValueErrors name the field (400).
"""

from __future__ import annotations

from typing import TypeVar

from ringserve.config import ModelConfig
from ringserve.http.errors import APIError, bad_request
from ringserve.http.protocol import SamplingRequest
from ringserve.prompt_length import max_prompt_len
from ringserve.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise bad_request("logit_bias: keys must be token ids (integers as strings)",
                          "logit_bias") from None


def to_sampling_params(req: SamplingRequest, *, max_tokens: int | None, logprobs: int | None,
                       prompt_logprobs: int | None) -> SamplingParams:
    """The request's SamplingParams (DELTA output when streaming, else FINAL_ONLY).

    `max_tokens` is the requested cap (None: fill the context); `resolve_max_tokens` fixes it
    per prompt.

    Raises:
        ValueError: a field is out of range (the message names it).
        APIError: `logit_bias` has a key that is not a token id.
    """
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    return SamplingParams(
        n=_or(req.n, 1),
        temperature=_or(req.temperature, 1.0),
        top_p=_or(req.top_p, 1.0),
        top_k=_or(req.top_k, 0),
        min_p=_or(req.min_p, 0.0),
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        presence_penalty=_or(req.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        repetition_penalty=_or(req.repetition_penalty, 1.0),
        logit_bias=_logit_bias(req.logit_bias),
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
        output_kind=kind,
    )


def build_params(req: SamplingRequest, model_config: ModelConfig, *, max_tokens: int | None,
                 logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
    """`to_sampling_params`, also checked against the model (vocabulary, max_logprobs), so
    every parameter error is a 400 before any response starts."""
    params = to_sampling_params(req, max_tokens=max_tokens, logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs)
    params.verify_for_model(vocab_size=model_config.vocab_size,
                            max_logprobs=model_config.max_logprobs)
    return params


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """The output-token cap for one prompt; the prompt itself must pass
    `ringserve.prompt_length`'s rule (at most `max_model_len - 1` tokens).

    Raises:
        APIError: 400 when the prompt (plus the requested output) does not fit.
    """
    if requested is None:
        if num_prompt_tokens > max_prompt_len(max_model_len):
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your request has {num_prompt_tokens} input tokens. Please reduce the length "
                "of the input messages.")
        return max_model_len - num_prompt_tokens
    # requested >= 1 (SamplingParams), so this also holds the prompt to max_prompt_len.
    if num_prompt_tokens + requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"messages, {requested} in the completion). Please reduce the length of the "
            "messages or completion.",
            "max_tokens")
    return requested
