"""From a request body to SamplingParams, and the context-length check.

Shared by completions and chat: nullable body fields get vLLM's defaults, `logit_bias`'s
string keys become token ids, and `resolve_max_tokens` applies vLLM's rule (no max_tokens:
whatever fits in `max_model_len` after the prompt) with vLLM's wording when a request cannot
fit. Range checks stay in `SamplingParams`, whose ValueErrors name the field (400).
`structured_outputs_of` maps `response_format` (OpenAI's) or `structured_outputs` (vLLM's)
to `SamplingParams.structured_outputs`; the engine's input processor checks the grammar
itself (an invalid schema is its ValueError, a 400 too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from ringserve.config import ModelConfig
from ringserve.http.errors import APIError, bad_request
from ringserve.http.protocol import ResponseFormat, SamplingRequest, StructuredOutputsRequest
from ringserve.prompt_length import max_prompt_len
from ringserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

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


RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")


def _from_response_format(fmt: ResponseFormat) -> StructuredOutputsParams | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request("response_format.json_schema: required with type json_schema "
                              "(an object with name and schema)", "response_format.json_schema")
        if fmt.json_schema.schema is None:
            raise bad_request("response_format.json_schema.schema: required (a JSON schema "
                              "object)", "response_format.json_schema.schema")
        return StructuredOutputsParams(json=fmt.json_schema.schema)
    if fmt.type == "structural_tag":
        if fmt.format is None and fmt.structures is None:
            raise bad_request("response_format: a structural_tag needs `format` (xgrammar's "
                              "structural tag) or `structures` and `triggers`",
                              "response_format")
        # vLLM hands the whole response_format to the backend as JSON text.
        tag = {"type": fmt.type, **{k: v for k, v in (("structures", fmt.structures),
                                                      ("triggers", fmt.triggers),
                                                      ("format", fmt.format)) if v is not None}}
        return StructuredOutputsParams(structural_tag=msgspec.json.encode(tag).decode())
    raise bad_request(f"response_format.type: got {fmt.type!r}, allowed: "
                      f"{', '.join(RESPONSE_FORMAT_TYPES)}", "response_format.type")


def _from_structured_outputs(so: StructuredOutputsRequest) -> StructuredOutputsParams:
    tag = so.structural_tag
    fields: dict[str, Any] = {
        "json": so.json, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
        "json_object": so.json_object,
        "structural_tag": tag if tag is None or isinstance(tag, str)
        else msgspec.json.encode(tag).decode(),
        "whitespace_pattern": so.whitespace_pattern,
        "disable_any_whitespace": so.disable_any_whitespace}
    try:
        return StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as exc:
        given = [k for k, v in fields.items() if v not in (None, False)]
        param = f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs"
        raise bad_request(str(exc), param) from None


def structured_outputs_of(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The constraint a request asks for: its `response_format` or its
    `structured_outputs` (not both), or None.

    Raises:
        APIError: 400 naming the field: both given, an unknown `response_format.type`, a
            json_schema without its schema, or a `structured_outputs` with no kind or
            several.
    """
    so = req.structured_outputs
    fmt = req.response_format
    if so is not None and fmt is not None and fmt.type != "text":
        raise bad_request("response_format, structured_outputs: give at most one of them "
                          "(both constrain the output)", "structured_outputs")
    if so is not None:
        return _from_structured_outputs(so)
    return None if fmt is None else _from_response_format(fmt)


def to_sampling_params(req: SamplingRequest, *, max_tokens: int | None, logprobs: int | None,
                       prompt_logprobs: int | None,
                       structured_outputs: StructuredOutputsParams | None = None,
                       defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """The request's SamplingParams (DELTA output when streaming, else FINAL_ONLY).

    `max_tokens` is the requested cap (None: fill the context); `resolve_max_tokens` fixes it
    per prompt. `structured_outputs` is the request's constraint (`structured_outputs_of`,
    or the one its tools need). `defaults` (the model's generation config,
    `ModelConfig.generation_defaults`) fill the sampling fields the request leaves unset.

    Raises:
        ValueError: a field is out of range (the message names it).
        APIError: `logit_bias` has a key that is not a token id.
    """
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    d = defaults or {}
    return SamplingParams(
        n=_or(req.n, 1),
        temperature=_or(req.temperature, float(d.get("temperature", 1.0))),
        top_p=_or(req.top_p, float(d.get("top_p", 1.0))),
        top_k=_or(req.top_k, int(d.get("top_k", 0))),
        min_p=_or(req.min_p, float(d.get("min_p", 0.0))),
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        presence_penalty=_or(req.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        repetition_penalty=_or(req.repetition_penalty, float(d.get("repetition_penalty", 1.0))),
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
        structured_outputs=structured_outputs,
    )


_FROM_REQUEST: Any = object()


def build_params(req: SamplingRequest, model_config: ModelConfig, *, max_tokens: int | None,
                 logprobs: int | None, prompt_logprobs: int | None,
                 structured_outputs: StructuredOutputsParams | None = _FROM_REQUEST
                 ) -> SamplingParams:
    """`to_sampling_params`, also checked against the model (vocabulary, max_logprobs), so
    every parameter error is a 400 before any response starts. The constraint is the
    request's own (`structured_outputs_of`) unless `structured_outputs` is given."""
    if structured_outputs is _FROM_REQUEST:
        structured_outputs = structured_outputs_of(req)
    params = to_sampling_params(req, max_tokens=max_tokens, logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs,
                                structured_outputs=structured_outputs,
                                defaults=model_config.generation_defaults)
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
