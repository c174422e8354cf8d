"""Input processing (frontend side): a prompt and SamplingParams become an EngineCoreRequest.

Shared by the offline `LLMEngine` and `AsyncLLM`: validates the sampling parameters against the
model (vocabulary, `max_logprobs`), tokenizes text prompts (the caller runs this off the event
loop for long prompts), checks the prompt's token ids and length, and stamps the arrival time.
Every problem raises `ValueError` naming what is wrong, before anything reaches the core.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, TypedDict

from ringserve.config import LoRAConfig, ModelConfig, MultiModalConfig
from ringserve.engine.wire import EngineCoreRequest
from ringserve.gpu.multimodal.features import ImageFeature
from ringserve.lora_request import LoRARequest
from ringserve.pooling_params import PoolingParams
from ringserve.prompt_length import check_prompt_length
from ringserve.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    SamplingParams,
    StructuredOutputsParams,
)
from ringserve.typecheck import check_value

if TYPE_CHECKING:
    from ringserve.engine.frontend.multimodal.renderer import ImageRenderer

_PROMPT_KEYS = frozenset(("prompt_token_ids", "prompt", "cache_salt", "multi_modal_data"))


def _check_request_args(request_id: object, params: object, priority: object,
                        data_parallel_rank: object) -> None:
    """The types the wire will insist on, checked before anything is sent (a value the
    core cannot decode would otherwise be dropped there, and its request never answered).

    Raises:
        TypeError: naming the argument.
    """
    check_value(request_id, str, "request_id")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params: expected a SamplingParams, got "
                        f"{type(params).__name__}")
    check_value(priority, int, "priority")
    check_value(data_parallel_rank, int | None, "data_parallel_rank")


class TokensPrompt(TypedDict, total=False):
    """A pre-tokenized prompt, as in vLLM: `{"prompt_token_ids": [...]}`."""

    prompt_token_ids: list[int]
    prompt: str
    cache_salt: str
    # {"image": a PIL image or a list of them} (a vision-language model; the prompt holds
    # one placeholder per image, as vLLM's).
    multi_modal_data: dict[str, Any]


PromptType = str | TokensPrompt


class InputProcessor:
    """Validates and tokenizes requests for one model.

    Args:
        model_config: the model (vocabulary size, max_model_len, max_logprobs).
        tokenizer: a transformers tokenizer, or None when prompts come as token ids only.
        structured_backend: the grammar backend constraints are checked against.
        pooling: the engine runs a pooling model (`--runner pooling`): it takes pooling
            requests only; otherwise generation requests only (one runner per engine, as
            vLLM).
        lora: the engine's LoRA limits (`--enable-lora`; None: requests take no adapter).
        multimodal: the engine's image settings (None: a text-only model); prompts with
            images are then rendered here (`ringserve.engine.frontend.multimodal`).
    """

    def __init__(self, model_config: ModelConfig, tokenizer: Any,
                 structured_backend: str = "xgrammar", *, pooling: bool = False,
                 lora: LoRAConfig | None = None,
                 multimodal: MultiModalConfig | None = None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.structured_backend = structured_backend
        self.pooling = pooling
        self.lora = lora
        self._adapters: dict[str, Any] = {}  # path -> its checked adapter config
        self.renderer: ImageRenderer | None = None
        if multimodal is not None:
            from ringserve.engine.frontend.multimodal.renderer import ImageRenderer

            self.renderer = ImageRenderer(model_config, multimodal, tokenizer)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: list[ImageFeature] | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Build the core request; returns it with the prompt text (None for token prompts).

        `mm_features`: the images of a prompt already rendered (a chat's, by
        `ringserve.engine.frontend.multimodal.renderer`); a prompt's `multi_modal_data` is
        rendered here.

        Raises:
            TypeError: an argument or prompt field of the wrong type (a non-str request id
                or cache salt, a float or bool among the token ids, ...), naming it.
            ValueError: bad sampling parameters, an empty or over-long prompt, token ids
                outside the vocabulary, a text prompt without a tokenizer, or a priority
                outside int64.
        """
        cfg = self.model_config
        _check_request_args(request_id, params, priority, data_parallel_rank)
        if self.pooling and pooling_params is None:
            raise ValueError(f"model: {cfg.served_model_name} is a pooling model (embeddings, "
                             "classification, scores); it does not generate text")
        if lora_request is not None:
            self._check_adapter(lora_request)
        if pooling_params is not None and not self.pooling:
            raise ValueError(f"model: {cfg.served_model_name} generates text; it does not "
                             "pool (serve an embedding or classification model with "
                             "--runner pooling)")
        if not INT64_MIN <= priority <= INT64_MAX:
            # It travels as a msgpack int64: a larger one would fail to encode after admission.
            raise ValueError(f"priority: got {priority}, allowed: an integer in [-2**63, 2**63)")
        params.verify_for_model(vocab_size=cfg.vocab_size, max_logprobs=cfg.max_logprobs)
        if params.structured_outputs is not None:
            self._check_constraint(params.structured_outputs)
        images = isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None
        # A text prompt with images is tokenized once, after its placeholders are expanded.
        text, token_ids, cache_salt = self._tokenize(prompt, tokenize_text=not images)
        if images:
            assert isinstance(prompt, dict)
            token_ids, mm_features = self._render(prompt, text, token_ids)
        self._check_prompt(token_ids, params)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            data_parallel_rank=data_parallel_rank,
            pooling_params=pooling_params,
            lora_request=lora_request,
            mm_features=mm_features or None,
        )
        return request, text

    def _check_adapter(self, lora_request: LoRARequest) -> None:
        """A request's adapter, checked once per path before anything is sent.

        Raises:
            TypeError: not a LoRARequest.
            ValueError: LoRA is off, or the adapter cannot be served (its files, its config
                fields, its rank; naming them).
        """
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request: expected a LoRARequest, got "
                            f"{type(lora_request).__name__}")
        if self.lora is None:
            raise ValueError(f"lora_request: adapter {lora_request.lora_name!r} asked of an "
                             "engine without LoRA (start it with enable_lora=True / "
                             "--enable-lora)")
        if lora_request.lora_path not in self._adapters:
            from ringserve.gpu.lora.adapter_config import read_adapter_config

            self._adapters[lora_request.lora_path] = read_adapter_config(
                lora_request.lora_path, max_lora_rank=self.lora.max_lora_rank)

    def _check_constraint(self, constraint: StructuredOutputsParams) -> None:
        """A constraint the core's backend could not compile fails here, before sending.

        Raises:
            ValueError: naming the field and why (`structured_outputs.json: ...`).
        """
        from ringserve.engine.structured.validation import check_structured_outputs

        check_structured_outputs(constraint, self.structured_backend)

    def _tokenize(self, prompt: PromptType, *, tokenize_text: bool = True,
                  ) -> tuple[str | None, list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; pass prompt_token_ids")
            return prompt, list(self.tokenizer(prompt).input_ids), None
        if not isinstance(prompt, dict):
            raise ValueError(f"prompt: expected a string or a dict with prompt_token_ids, "
                             f"got {type(prompt).__name__}")
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            raise ValueError(f"prompt: unknown keys {sorted(map(str, unknown))}; "
                             f"allowed: {sorted(_PROMPT_KEYS)}")
        cache_salt = check_value(prompt.get("cache_salt"), str | None, "cache_salt")
        if "prompt_token_ids" in prompt:
            ids = check_value(prompt["prompt_token_ids"], list[int], "prompt_token_ids")
            text = check_value(prompt.get("prompt"), str | None, "prompt")
            return text, list(ids), cache_salt
        if "prompt" in prompt:
            if not tokenize_text:
                return check_value(prompt["prompt"], str, "prompt"), [], cache_salt
            text, ids, _ = self._tokenize(prompt["prompt"])
            return text, ids, cache_salt
        raise ValueError("prompt: a dict prompt needs 'prompt_token_ids' or 'prompt'")

    def _render(self, prompt: TokensPrompt, text: str | None,
                token_ids: list[int]) -> tuple[list[int], list[ImageFeature]]:
        """The prompt's images expanded into its tokens.

        Raises:
            ValueError: a text-only model, not an image, too many, or placeholders that do
                not match them.
        """
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict):
            raise ValueError(f"multi_modal_data: expected a dict such as {{'image': image}}, "
                             f"got {type(data).__name__}")
        unknown = sorted(set(map(str, data)) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data: modality {unknown[0]!r} is not supported; "
                             "allowed: image")
        renderer = self.renderer
        if renderer is None:
            raise ValueError(f"multi_modal_data: {self.model_config.served_model_name} takes "
                             "text only")
        raw = data.get("image")
        images = list(raw) if isinstance(raw, list | tuple) else [raw]
        renderer.check_count(len(images))
        processed = []
        for i, image in enumerate(images):
            try:
                processed.append(renderer.load_processed(image))
            except ValueError as exc:
                raise ValueError(f"multi_modal_data.image[{i}]: {exc}") from None
        if "prompt_token_ids" in prompt:
            return renderer.render_tokens(token_ids, processed)
        if text is None:
            raise ValueError("multi_modal_data: the prompt needs its text or token ids")
        return renderer.render_text(text, processed, add_special_tokens=True)

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        cfg = self.model_config
        check_prompt_length(len(token_ids), cfg.max_model_len)
        bad = [t for t in token_ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[:5]} outside the vocabulary "
                             f"[0, {cfg.vocab_size})")
        if params.min_tokens > cfg.max_model_len - len(token_ids):
            raise ValueError(
                f"min_tokens: {params.min_tokens} cannot fit after a {len(token_ids)}-token prompt "
                f"within max_model_len {cfg.max_model_len}"
            )
