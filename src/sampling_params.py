"""Sampling parameters: what a request asks of the sampler and the stop checks.

`SamplingParams` is the one description of how to sample a request, shared by the offline `LLM`,
`AsyncLLM`, the HTTP layer (which builds it from OpenAI bodies) and the engine core (it travels
inside `EngineCoreRequest`). Field names, defaults and ranges follow vLLM's, so code written for
vLLM ports by changing the import. Validation runs on construction and again whenever the struct
is decoded from the wire, so a peer cannot smuggle an out-of-range value into the sampler.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from ringserve.typecheck import check_fields

_GREEDY_EPS = 1e-5
# The most outputs one request may ask for (vLLM's default VLLM_MAX_N_SEQUENCES): each is a
# request of its own, built at once, so an unbounded `n` is a denial of service.
MAX_N = 16384
# top_k travels to the workers as int32; anything at or past the vocabulary means "off".
_MAX_TOP_K = 2**31 - 1
# The signed integers a request's fields may hold: they travel to the engine core as msgpack
# int64, and past that a request could not even be sent (token counts, priority).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# torch.Generator.manual_seed's range (past it, the wire's msgpack ints end too).
_MAX_SEED = 2**64 - 1


class RequestOutputKind(enum.IntEnum):
    """How `generate` reports progress: the whole text so far, only what is new, or once."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(enum.IntEnum):
    """How the sampler draws the next token for a request."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _fail(field: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"SamplingParams.{field}: got {value!r}, allowed: {allowed}")


_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A constraint on a request's output, enforced by a grammar mask on the logits (vLLM's
    `StructuredOutputsParams`): exactly one of `json` (a JSON schema, as a dict or its JSON
    text), `regex`, `choice` (the output is one of these strings), `grammar` (EBNF / GBNF),
    `json_object=True` (any JSON object) or `structural_tag` (xgrammar's structural tag, as
    JSON text).

    Attributes:
        whitespace_pattern: with `json` / `json_object`, the regex whitespace between tokens
            must match (default: the backend's).
        disable_any_whitespace: with `json` / `json_object`, no whitespace at all between
            JSON tokens.

    Raises:
        TypeError: a field of the wrong type, naming it.
        ValueError: no kind or more than one kind set, an empty `choice`, or a JSON option
            with another kind; the message names the fields.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        check_fields(self)
        if self.json_object is False:
            self.json_object = None
        kinds = [k for k in _CONSTRAINT_KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(
                f"structured_outputs: got {kinds or 'no constraint'}, allowed: exactly one of "
                f"{', '.join(_CONSTRAINT_KINDS)}")
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice: got [], allowed: a non-empty list of "
                             "strings")
        json_like = self.kind in ("json", "json_object")
        if not json_like and (self.whitespace_pattern is not None or self.disable_any_whitespace):
            raise ValueError("structured_outputs.whitespace_pattern / disable_any_whitespace: "
                             "only with json or json_object")

    @property
    def kind(self) -> str:
        """Which constraint is set: json, regex, choice, grammar, json_object, structural_tag."""
        return next(k for k in _CONSTRAINT_KINDS if getattr(self, k) is not None)

    @property
    def spec(self) -> str:
        """The constraint as text (a dict schema as canonical JSON; choices as a JSON list)."""
        value = getattr(self, self.kind)
        if isinstance(value, str):
            return value
        if value is True:
            return ""
        return msgspec.json.encode(value, order="sorted").decode()

    def key(self) -> tuple[str, str, str | None, bool]:
        """What identifies the compiled grammar (the compile cache's key)."""
        return self.kind, self.spec, self.whitespace_pattern, self.disable_any_whitespace


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sampling and stopping parameters for one request (vLLM's names, defaults and ranges).

    Raises:
        TypeError: on construction when a field has the wrong type (as strict as the wire:
            `max_tokens=100.0` or `ignore_eos=1` is refused, naming the field).
        ValueError: on construction (or wire decoding) when a field is out of range; the
            message names the field, the value given and what is allowed.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._verify_counts()
        self._verify_penalties()
        self._verify_truncation()
        self._verify_stops()
        self._verify_token_lists()

    def _verify_counts(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise _fail("n", self.n, f"an integer in [1, {MAX_N}]")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= INT64_MAX:
            raise _fail("max_tokens", self.max_tokens,
                        "an integer in [1, 2**63), or None (up to max_model_len)")
        if not 0 <= self.min_tokens <= INT64_MAX:
            raise _fail("min_tokens", self.min_tokens, "an integer in [0, 2**63)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail("min_tokens", self.min_tokens, f"at most max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < -1:
            raise _fail("logprobs", self.logprobs, "None, -1 (whole vocabulary) or an integer >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise _fail(
                "prompt_logprobs", self.prompt_logprobs, "None, -1 (whole vocabulary) or an integer >= 0"
            )

    def _verify_penalties(self) -> None:
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise _fail("presence_penalty", self.presence_penalty, "a float in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise _fail("frequency_penalty", self.frequency_penalty, "a float in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise _fail("repetition_penalty", self.repetition_penalty, "a float > 0")

    def _verify_truncation(self) -> None:
        if not self.temperature >= 0.0:
            raise _fail("temperature", self.temperature, "a float >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise _fail("top_p", self.top_p, "a float in (0, 1]")
        if not -1 <= self.top_k <= _MAX_TOP_K:
            raise _fail("top_k", self.top_k,
                        f"0 or -1 (disabled) or an integer in [1, {_MAX_TOP_K}]")
        if not 0.0 <= self.min_p <= 1.0:
            raise _fail("min_p", self.min_p, "a float in [0, 1]")
        if self.seed is not None and not INT64_MIN <= self.seed <= _MAX_SEED:
            raise _fail("seed", self.seed, "None or an integer in [-2**63, 2**64)")

    def _verify_stops(self) -> None:
        if self.stop is not None and any(s == "" for s in self.stop):
            raise _fail("stop", self.stop, "non-empty strings")
        if self.stop and not self.detokenize:
            raise _fail("stop", self.stop, "stop strings only with detokenize=True")

    def _verify_token_lists(self) -> None:
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise _fail("stop_token_ids", self.stop_token_ids, "token ids >= 0")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise _fail("allowed_token_ids", self.allowed_token_ids, "a non-empty list, or None")
            if any(t < 0 for t in self.allowed_token_ids):
                raise _fail("allowed_token_ids", self.allowed_token_ids, "token ids >= 0")
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                if token < 0 or not -100.0 <= bias <= 100.0:
                    raise _fail(
                        "logit_bias", {token: bias}, "token ids >= 0 mapped to biases in [-100, 100]"
                    )

    # -- checks that need the engine's limits ------------------------------------------------

    def verify_for_model(self, *, vocab_size: int, max_logprobs: int) -> None:
        """Check the fields whose range depends on the model and engine configuration.

        Args:
            vocab_size: the model's vocabulary size.
            max_logprobs: the engine's cap on `logprobs` and `prompt_logprobs` (-1 = vocab).

        Raises:
            ValueError: naming the field, the value and the allowed range.
        """
        cap = vocab_size if max_logprobs == -1 else max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            wanted = vocab_size if value == -1 else value
            if wanted is not None and wanted > cap:
                raise _fail(name, value, f"at most max_logprobs={cap}")
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids: list[int] | None = getattr(self, name)
            if ids is not None and any(t >= vocab_size for t in ids):
                raise _fail(name, ids, f"token ids < vocab size {vocab_size}")
        if self.logit_bias is not None and any(t >= vocab_size for t in self.logit_bias):
            raise _fail("logit_bias", self.logit_bias, f"token ids < vocab size {vocab_size}")

    # -- derived values -----------------------------------------------------------------------

    @property
    def sampling_type(self) -> SamplingType:
        """Greedy below a temperature of 1e-5; seeded random when a seed is given."""
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list (possibly empty)."""
        stop = self.stop
        if stop is None:
            return []
        return [stop] if isinstance(stop, str) else list(stop)

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with some fields replaced (e.g. a child of an n > 1 request)."""
        return msgspec.structs.replace(self, **changes)


def default_sampling_params(defaults: dict[str, Any]) -> SamplingParams:
    """SamplingParams with `defaults` (a model's generation config: field -> value) set."""
    return SamplingParams(**defaults) if defaults else SamplingParams()
