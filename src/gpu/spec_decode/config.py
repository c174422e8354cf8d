"""The speculative-decoding configuration: the user's `--speculative-config` JSON (vLLM's keys)
and its resolution, against the target model, into the `SpecDecodeConfig` the engine uses.

Built once at the edge: `EngineArgs.verify()` calls :func:`parse_speculative_config` (every
check that needs no model, so a bad flag fails before anything is read) and
`EngineArgs.create_engine_config()` calls :func:`resolve_speculative_config` (the draft model
read, its vocabulary compared with the target's). Imports no torch; transformers only to
compare two tokenizers.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

import msgspec

from ringserve.config import QUANTIZATION_METHODS, Device, ModelConfig, SpecDecodeConfig
from ringserve.errors import ModelDirectoryError

__all__ = ["MAX_SPECULATIVE_TOKENS", "METHODS", "SpecDecodeConfig", "SpeculativeConfig",
           "parse_speculative_config", "resolve_speculative_config"]

logger = logging.getLogger(__name__)

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_SPECULATIVE_TOKENS = 4
# vLLM's n-gram window when neither bound is given (vllm/config/speculative.py).
DEFAULT_PROMPT_LOOKUP = 5
_EAGLE = ("eagle", "eagle3")
# Keys that only a draft model uses, and keys that only the n-gram proposer uses: given with
# the other method they would be ignored, so they are refused instead.
_DRAFT_ONLY = ("model", "quantization", "draft_tensor_parallel_size", "max_model_len")
# An EAGLE head runs in the target's dtype (no panels of its own) for every length the target
# takes.
_NOT_FOR_EAGLE = ("quantization", "max_model_len")
_NGRAM_ONLY = ("prompt_lookup_min", "prompt_lookup_max")
_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4}'

_announced: set[str] = set()


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`--speculative-config` as the user wrote it (vLLM's keys; those ringserve runs).

    Attributes:
        method: "ngram", "draft_model", "eagle" (an EAGLE-1/2 head) or "eagle3" (an EAGLE-3
            head in its published layout).
        num_speculative_tokens: drafts per request per step, 1..16. vLLM requires it;
            ringserve defaults to 4.
        model: draft_model: the draft's directory, GGUF file or hub id (same vocabulary as
            the target); eagle / eagle3: the head's directory.
        quantization: draft_model: "int8" or "int4" panels for the draft (CPU), or None.
        prompt_lookup_min, prompt_lookup_max: ngram: the n-gram lengths tried; neither given:
            both 5 (vLLM's default); one given: the other is the same.
        draft_tensor_parallel_size: draft_model: 1 or the target's TP (default: the target's).
        max_model_len: draft_model: the longest sequence the draft proposes for, at most the
            target's max_model_len (the default) and the draft's own.
        num_speculative_tokens_per_batch_size: vLLM's dynamic schedule, a list of
            `[first_batch, last_batch, k]` entries with inclusive, non-overlapping batch-size
            ranges, the first starting at 1: a decode batch in a range uses k drafts
            (0..num_speculative_tokens); a batch between or past the ranges uses the k of the
            range below it.
    """

    method: str
    num_speculative_tokens: int | None = None
    model: str | None = None
    quantization: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_tensor_parallel_size: int | None = None
    max_model_len: int | None = None
    num_speculative_tokens_per_batch_size: tuple[tuple[int, ...], ...] | None = None

    @property
    def resolved_num_speculative_tokens(self) -> int:
        """`num_speculative_tokens`, or ringserve's default (4) when absent."""
        if self.num_speculative_tokens is None:
            return DEFAULT_SPECULATIVE_TOKENS
        return self.num_speculative_tokens


def parse_speculative_config(
    value: str | dict[str, Any] | SpeculativeConfig | None,
) -> SpeculativeConfig | None:
    """The user's configuration, with every check that needs no model.

    Args:
        value: JSON text (the CLI flag's value) such as
            ``'{"method": "ngram", "num_speculative_tokens": 4}'``, a dict of the same keys,
            a `SpeculativeConfig`, or None / blank (speculation off).

    Returns:
        The configuration, or None when `value` is None or blank.

    Raises:
        ValueError: not JSON, not an object, an unknown key, a bad value or a key the method
            does not use; the message starts with the key (`speculative_config.method: ...`)
            and says what is allowed.
    """
    if value is None:
        return None
    if isinstance(value, str) and not value.strip():
        return None
    spec = value if isinstance(value, SpeculativeConfig) else _decode(value)
    _check(spec)
    return spec


def resolve_speculative_config(
    value: str | dict[str, Any] | SpeculativeConfig | None,
    *,
    target: ModelConfig,
    tensor_parallel_size: int,
    device: Device = "cpu",
) -> SpecDecodeConfig | None:
    """Resolve the user's configuration against the target model.

    A draft model is read with `ModelConfig.from_model_dir` in the target's dtype, on the
    target's device, and must have the target's vocabulary (llama.cpp's check: the same
    vocab_size, tokenizer class, BOS / EOS ids and token texts). Logs one start-up line naming
    the draft.

    Args:
        value: as for :func:`parse_speculative_config`.
        target: the target model, resolved.
        tensor_parallel_size: the target's tensor-parallel degree.
        device: the device the target was resolved for ("cpu" or "cuda").

    Returns:
        The resolved configuration, or None when speculation is off.

    Raises:
        ValueError: a bad key or value (see :func:`parse_speculative_config`), a draft TP
            other than 1 or `tensor_parallel_size`, a draft the target's settings do not
            allow, or a draft whose vocabulary differs from the target's; the message starts
            with the key.
        ModelDirectoryError: the draft is missing, unreadable or not supported (the message
            starts with `speculative_config.model`).
    """
    spec = parse_speculative_config(value)
    if spec is None:
        return None
    k = spec.resolved_num_speculative_tokens
    per_batch = _per_batch_size(spec.num_speculative_tokens_per_batch_size, k)
    if spec.method == "ngram":
        low, high = _prompt_lookup(spec)
        return SpecDecodeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=low,
                                prompt_lookup_max=high, draft_model_config=None,
                                draft_tensor_parallel_size=1, per_batch_size=per_batch)
    draft_tp = _draft_tensor_parallel_size(spec.draft_tensor_parallel_size,
                                           tensor_parallel_size)
    if spec.method in _EAGLE:
        return _eagle(spec, target, k, per_batch, draft_tp)
    draft = _draft_model_config(spec, target, device)
    difference = _vocabulary_difference(target, draft)
    if difference is not None:
        raise ValueError(f"speculative_config.model: the draft's vocabulary differs from the "
                         f"target's ({difference}); the draft must use the target's tokenizer")
    _announce(f"speculative decoding: draft_model {draft.weights} ({_weights(draft)}), "
              f"{k} draft tokens")
    return SpecDecodeConfig(method="draft_model", num_speculative_tokens=k, prompt_lookup_min=0,
                            prompt_lookup_max=0, draft_model_config=draft,
                            draft_tensor_parallel_size=draft_tp, per_batch_size=per_batch)


# -- parsing ---------------------------------------------------------------------------------


def _decode(value: str | dict[str, Any]) -> SpeculativeConfig:
    try:
        if isinstance(value, str):
            return msgspec.json.decode(value, type=SpeculativeConfig)
        if isinstance(value, dict):
            return msgspec.convert(value, SpeculativeConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(_validation_message(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"--speculative-config is not valid JSON ({exc}): {value!r}; expected "
                         f"an object such as '{_EXAMPLE}'") from None
    raise ValueError(f"speculative_config: expected JSON text or a dict, got "
                     f"{type(value).__name__}, such as '{_EXAMPLE}'")


def _validation_message(message: str) -> str:
    """msgspec's message, led by the key it is about (`... - at `$.key``)."""
    keys = ", ".join(SpeculativeConfig.__struct_fields__)
    what, _, where = message.partition(" - at `$")
    key = where.rstrip("`").lstrip(".").split(".")[0].split("[")[0]
    if what.startswith("Object contains unknown field"):
        return f"speculative_config: unknown key {what.rsplit(' ', 1)[-1]}; allowed keys: {keys}"
    if what.startswith("Object missing required field"):
        return (f"speculative_config.method: required ({', '.join(METHODS)}), e.g. "
                f"'{_EXAMPLE}'")
    if not key:
        return f"speculative_config: {what}; expected an object such as '{_EXAMPLE}'"
    return f"speculative_config.{key}: {what} (at `${where.rstrip('`')}`)"


def _check(spec: SpeculativeConfig) -> None:
    method = spec.method
    if method not in METHODS:
        raise ValueError(f"speculative_config.method: got {method!r}, unknown method; allowed: "
                         f"{', '.join(METHODS)}")
    _in_range("num_speculative_tokens", spec.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
    unused: tuple[str, ...] = _DRAFT_ONLY if method == "ngram" else _NGRAM_ONLY
    if method in _EAGLE:
        unused = unused + _NOT_FOR_EAGLE
    for key in unused:
        if getattr(spec, key) is not None:
            raise ValueError(f"speculative_config.{key}: not used by method {method!r} "
                             f"(got {getattr(spec, key)!r}); remove it")
    if method == "ngram":
        _prompt_lookup(spec)
    else:
        _check_draft_keys(spec)
    _per_batch_size(spec.num_speculative_tokens_per_batch_size,
                    spec.resolved_num_speculative_tokens)


def _check_draft_keys(spec: SpeculativeConfig) -> None:
    if spec.model is None or not spec.model.strip():
        what = ("the EAGLE head's directory" if spec.method in _EAGLE else
                "the draft's directory, GGUF file or hub id")
        raise ValueError(f"speculative_config.model: required with method {spec.method!r} "
                         f"({what}), got {spec.model!r}")
    if spec.quantization is not None and spec.quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"speculative_config.quantization: got {spec.quantization!r}, allowed: "
                         f"None (the draft's own weights), {', '.join(QUANTIZATION_METHODS)}")
    _in_range("draft_tensor_parallel_size", spec.draft_tensor_parallel_size, 1, None)
    _in_range("max_model_len", spec.max_model_len, 1, None)


def _in_range(key: str, value: int | None, low: int, high: int | None) -> None:
    if value is None or (value >= low and (high is None or value <= high)):
        return
    allowed = f"{low}..{high}" if high is not None else f">= {low}"
    raise ValueError(f"speculative_config.{key}: got {value}, allowed: {allowed}")


def _prompt_lookup(spec: SpeculativeConfig) -> tuple[int, int]:
    """vLLM's n-gram window: neither bound given, 5..5; one given, the other is the same."""
    given_low, given_high = spec.prompt_lookup_min, spec.prompt_lookup_max
    _in_range("prompt_lookup_min", given_low, 1, None)
    _in_range("prompt_lookup_max", given_high, 1, None)
    fallback = given_high if given_high is not None else DEFAULT_PROMPT_LOOKUP
    low = given_low if given_low is not None else fallback
    high = given_high if given_high is not None else low
    if low > high:
        raise ValueError(f"speculative_config.prompt_lookup_min: got {low}, allowed: "
                         f"<= prompt_lookup_max ({high})")
    return low, high


def _per_batch_size(schedule: tuple[tuple[int, ...], ...] | None,
                    k: int) -> tuple[tuple[int, int], ...]:
    """vLLM's `[[first, last, k], ...]` as (min_batch, k) pairs: vLLM fills a gap between
    ranges, and the batches past the last, with the k of the range below, so only each
    range's first batch matters."""
    if schedule is None:
        return ()
    key = "speculative_config.num_speculative_tokens_per_batch_size"
    if not schedule:
        raise ValueError(f"{key}: got [], allowed: a non-empty list of [first_batch, "
                         f"last_batch, k] entries")
    pairs: list[tuple[int, int]] = []
    previous_last = 0
    for entry in sorted(schedule):
        if len(entry) != 3:
            raise ValueError(f"{key}: got entry {list(entry)}, allowed: [first_batch, "
                             f"last_batch, k] (vLLM's 5-item entries with context ranges are "
                             f"not supported)")
        first, last, drafts = entry
        if not 1 <= first <= last:
            raise ValueError(f"{key}: got entry {list(entry)}, allowed: 1 <= first_batch <= "
                             f"last_batch")
        if first <= previous_last:
            raise ValueError(f"{key}: got entry {list(entry)}, allowed: batch-size ranges "
                             f"that do not overlap")
        if not 0 <= drafts <= k:
            raise ValueError(f"{key}: got entry {list(entry)}, allowed: k in 0..{k} "
                             f"(num_speculative_tokens)")
        pairs.append((first, drafts))
        previous_last = last
    if pairs[0][0] != 1:
        raise ValueError(f"{key}: the first range starts at batch {pairs[0][0]}, allowed: 1 "
                         f"(every batch size needs a k)")
    return tuple(pairs)


def _draft_tensor_parallel_size(draft_tp: int | None, tensor_parallel_size: int) -> int:
    if draft_tp is None:
        return tensor_parallel_size
    if draft_tp not in (1, tensor_parallel_size):
        raise ValueError(f"speculative_config.draft_tensor_parallel_size: got {draft_tp}, "
                         f"allowed: 1 or the target's tensor_parallel_size "
                         f"({tensor_parallel_size})")
    return draft_tp


# -- EAGLE heads -----------------------------------------------------------------------------


def _eagle(spec: SpeculativeConfig, target: ModelConfig, k: int,
           per_batch: tuple[tuple[int, int], ...], draft_tp: int) -> SpecDecodeConfig:
    """An EAGLE head checked against the target (`eagle_config.EagleHeadConfig`). The head is
    small and runs whole on every tensor-parallel rank, whatever `draft_tensor_parallel_size`
    says (1 and the target's are both accepted, as vLLM's)."""
    from ringserve.gpu.spec_decode.eagle_config import EagleHeadConfig

    head = EagleHeadConfig.read(spec.method, cast(str, spec.model), target)
    reads = (f"target layers {list(head.aux_layer_ids)}" if head.aux_layer_ids else
             "the target's final hidden states")
    _announce(f"speculative decoding: {spec.method} head {head.directory} ({head.num_layers} "
              f"layer(s), draft vocabulary {head.draft_vocab_size}, reads {reads}), {k} draft "
              f"tokens")
    return SpecDecodeConfig(method=cast(Any, spec.method), num_speculative_tokens=k,
                            prompt_lookup_min=0, prompt_lookup_max=0, draft_model_config=None,
                            draft_tensor_parallel_size=draft_tp, per_batch_size=per_batch,
                            draft_head_dir=head.directory)


# -- the draft model -------------------------------------------------------------------------


def _draft_model_config(spec: SpeculativeConfig, target: ModelConfig,
                        device: Device) -> ModelConfig:
    """The draft read as the target was: its dtype, device, seed and load format (a dummy
    target gets a dummy draft, as vLLM's draft takes the target's load config), for the
    target's max_model_len unless `max_model_len` asks for less."""
    model = cast(str, spec.model)
    if spec.max_model_len is not None and spec.max_model_len > target.max_model_len:
        raise ValueError(f"speculative_config.max_model_len: got {spec.max_model_len}, "
                         f"allowed: 1..{target.max_model_len} (the target's max_model_len)")
    try:
        return ModelConfig.from_model_dir(
            model, dtype=target.dtype, device=device, quantization=spec.quantization,
            max_model_len=spec.max_model_len or target.max_model_len, seed=target.seed,
            max_logprobs=target.max_logprobs,
            load_format="dummy" if target.load_format == "dummy" else "auto")
    except ModelDirectoryError as exc:
        raise ModelDirectoryError(f"speculative_config.model: {exc}") from exc
    except ValueError as exc:
        raise ValueError(_draft_value_message(spec, target, str(exc))) from None


def _draft_value_message(spec: SpeculativeConfig, target: ModelConfig, message: str) -> str:
    """`from_model_dir`'s message, led by the speculative key it is about."""
    key = message.split(":", 1)[0]
    if key == "max_model_len" and spec.max_model_len is None:
        return (f"speculative_config.model: the draft {spec.model} is shorter than the "
                f"target's max_model_len {target.max_model_len} ({message}); give a smaller "
                f"--max-model-len")
    if key in ("quantization", "max_model_len"):
        return f"speculative_config.{message}"
    return f"speculative_config.model: the draft {spec.model}: {message}"


def _vocabulary_difference(target: ModelConfig, draft: ModelConfig) -> str | None:
    """What differs between the two vocabularies, or None (llama.cpp's
    `common_speculative_are_compatible`, over the Hugging Face tokenizers)."""
    if draft.vocab_size != target.vocab_size:
        return f"vocab_size {draft.vocab_size} in the draft's config, {target.vocab_size} " \
               f"in the target's"
    if Path(draft.tokenizer).resolve() == Path(target.tokenizer).resolve():
        return None
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(draft.tokenizer, local_files_only=True)
    ours = AutoTokenizer.from_pretrained(target.tokenizer, local_files_only=True)
    if type(theirs).__name__ != type(ours).__name__:
        return f"tokenizer class {type(theirs).__name__} in the draft, " \
               f"{type(ours).__name__} in the target"
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(theirs, name) != getattr(ours, name):
            return f"{name} {getattr(theirs, name)} in the draft, {getattr(ours, name)} in " \
                   f"the target"
    return _token_texts_difference(theirs.get_vocab(), ours.get_vocab())


def _token_texts_difference(draft: dict[str, int], target: dict[str, int]) -> str | None:
    if draft == target:
        return None
    by_id = {token_id: text for text, token_id in draft.items()}
    differing = sorted({i for t, i in target.items() if by_id.get(i) != t}
                       | {i for t, i in draft.items() if target.get(t) != i})
    first = differing[0]
    target_text = next((t for t, i in target.items() if i == first), None)
    return (f"{len(differing)} token ids have other texts, e.g. id {first} is "
            f"{by_id.get(first)!r} in the draft, {target_text!r} in the target")


def _weights(draft: ModelConfig) -> str:
    if draft.quantization is not None:
        return f"{draft.quantization} panels"
    return f"{draft.dtype} weights"


def _announce(line: str) -> None:
    """Log the start-up line once per process (the config may be resolved more than once)."""
    if line not in _announced:
        _announced.add(line)
        logger.info("%s", line)
