"""`ringserve.LLM`: the offline batch API (vLLM's `LLM`), over `LLMEngine`.

`LLM(model=None, **engine_args)` builds an engine (None: the demo model); `generate` takes
prompts (strings or `{"prompt_token_ids": [...]}`) with one SamplingParams or one per prompt
and returns finished RequestOutputs in input order, with a progress bar; `chat` renders
conversations through the tokenizer's chat template first (with their images, on a
vision-language model). Every prompt is validated before
any is queued, so a bad one raises without leaving work behind. The engine's processes are
closed by `close()`, on `with` exit, and at interpreter exit.

Fault tolerance is on by default here too: when a worker dies or a step fails, the requests
in flight come back with finish reason "error" and the core waits (up to
`engine_recovery_timeout_sec`) for `apply_fault_instruction("retry" | "abort")`, or retries by
itself with `fault_tolerance_auto_retry=N`; `enable_fault_tolerance=False` makes the engine
die at once instead (the next call raises EngineDeadError).
"""

from __future__ import annotations

import atexit
import itertools
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

from ringserve.engine.arg_utils import DEMO_MODEL, EngineArgs
from ringserve.engine.errors import EngineDeadError
from ringserve.engine.frontend.fault_tolerance import check_instruction
from ringserve.engine.frontend.input_processor import PromptType, TokensPrompt
from ringserve.engine.frontend.llm_engine import LLMEngine
from ringserve.engine.frontend.llm_pooling import SyncPoolingMethods
from ringserve.engine.frontend.multimodal.chat_parts import (
    ImageRef,
    check_images,
    dict_conversation,
    load_part,
    render_prompt,
)
from ringserve.engine.frontend.rl_api import SyncRLMethods
from ringserve.engine.metrics.metrics_reader import Metric
from ringserve.engine.wire import FAULT_INSTRUCTION_METHOD
from ringserve.gpu.multimodal.features import ImageFeature
from ringserve.lora_request import LoRARequest
from ringserve.outputs import RequestOutput
from ringserve.sampling_params import RequestOutputKind, SamplingParams, default_sampling_params

ChatMessage = dict[str, Any]
Conversation = list[ChatMessage]


class LLM(SyncRLMethods, SyncPoolingMethods):
    """An offline engine for batch generation.

    Args:
        model: a local Hugging Face model directory; None for the demo model.
        **engine_args: any `EngineArgs` field (max_model_len, tensor_parallel_size, ...).

    Raises:
        ValueError: an engine argument is invalid (the message names it).
        ModelDirectoryError: the model directory is missing or incomplete.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        args = EngineArgs(model=model or DEMO_MODEL, **engine_args)
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._counter = itertools.count()
        self._closed = False
        self._finalizer = weakref.finalize(self, LLMEngine.shutdown, self.llm_engine)
        atexit.register(self._finalizer)

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Shut the engine down (idempotent)."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer."""
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams `generate` uses when given none: the model's generation config
        (`--generation-config`, as vLLM does), else SamplingParams' own defaults."""
        return default_sampling_params(self.llm_engine.config.model_config.generation_defaults)

    def sleep(self, level: int = 1) -> None:
        """Free memory while idle: level 1 the KV cache, level 2 also the weights."""
        self.llm_engine.call_utility("sleep", level)

    def wake_up(self) -> None:
        """Restore what `sleep` freed."""
        self.llm_engine.call_utility("wake_up")

    def get_metrics(self) -> list[Metric]:
        """A snapshot of the engine's metrics (the `ringserve:` Prometheus series) as
        `Counter` / `Gauge` / `Histogram` dataclasses; empty with `disable_log_stats=True`."""
        return self.llm_engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block that no request uses."""
        return bool(self.llm_engine.call_utility("reset_prefix_cache"))

    def apply_fault_instruction(self, instruction: str) -> str:
        """Tell the engine core what to do after a fault (a worker died, a step failed or
        hung): `"retry"` rebuilds the workers (a no-op on a healthy core), `"abort"` shuts
        the core down. Requests the fault ended came back with finish reason "error"; until
        an instruction (or `fault_tolerance_auto_retry`), new ones do too.

        Returns:
            The instruction's id (the core reports it as `last_ft_request_id`).

        Raises:
            ValueError: an unknown instruction, or the retry failed (the message says why).
            EngineDeadError: the engine is dead.
        """
        check_instruction(instruction, None)
        rid = f"ft-{uuid.uuid4().hex}"
        try:
            self.llm_engine.call_utility(FAULT_INSTRUCTION_METHOD, instruction, rid)
        except EngineDeadError:
            if instruction != "abort":
                raise
        return rid

    # -- generation ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns the finished outputs in input order.

        Args:
            lora_request: the adapter every prompt runs under, or one per prompt (None for a
                base-model prompt); needs `enable_lora=True`.

        Raises:
            ValueError: a prompt, parameter set or adapter is invalid, or the counts do not
                match.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_for(prompt_list, sampling_params)
        loras = _per_prompt(lora_request, len(prompt_list))
        request_ids = self._add_all(prompt_list, params_list, loras)
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (OpenAI-style messages).

        A vision-language model's messages may hold image parts in vLLM's forms
        (`{"type": "image_url", "image_url": {"url": URL}}`, `{"type": "image", "image":
        PIL_IMAGE}`, `{"type": "image_pil", "image_pil": PIL_IMAGE}`;
        `ringserve.engine.frontend.multimodal.chat_parts`).

        Raises:
            ValueError: a conversation is malformed, the tokenizer has no chat template, or an
                image part cannot be used (the message starts with its location,
                `messages[0].content[1]: ...`).
        """
        single = bool(messages) and isinstance(messages[0], dict)
        conversations: list[Conversation] = (
            [messages] if single else list(messages)  # type: ignore[list-item, arg-type]
        )
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        features: list[list[ImageFeature] | None] = []
        for k, conversation in enumerate(conversations):
            conversation, images = dict_conversation(
                conversation, "messages" if single else f"messages[{k}]")
            text = _render_chat(tokenizer, conversation, add_generation_prompt, chat_template)
            if images:
                ids, rendered = self._render_images(text, images)
            else:
                ids, rendered = list(tokenizer(text, add_special_tokens=False).input_ids), None
            prompts.append(TokensPrompt(prompt_token_ids=ids, prompt=text))
            features.append(rendered)
        params = self._params_for(prompts, sampling_params)
        return self._run(self._add_all(prompts, params, mm_features=features), use_tqdm)

    def _render_images(self, text: str,
                       images: list[ImageRef]) -> tuple[list[int], list[ImageFeature]]:
        """A chat prompt's token ids with its images expanded, and their features."""
        model_config = self.llm_engine.config.model_config
        renderer = check_images(self.llm_engine.input_processor.renderer, images,
                                model_config.served_model_name)
        processed = [load_part(renderer, ref) for ref in images]
        return render_prompt(renderer, text, processed, add_special_tokens=False)

    def _params_for(
        self, prompts: list[PromptType], params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            params_list = [params] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params: {len(params_list)} given for "
                                 f"{len(prompts)} prompts; pass one or one per prompt")
        return [p.clone(output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list]

    def _add_all(self, prompts: list[PromptType], params: list[SamplingParams],
                 loras: list[LoRARequest | None] | None = None, *,
                 mm_features: list[list[ImageFeature] | None] | None = None) -> list[str]:
        engine = self.llm_engine
        adapters = loras if loras is not None else [None] * len(prompts)
        images = mm_features if mm_features is not None else [None] * len(prompts)
        # Validate and tokenize everything first: a bad prompt raises before any is queued.
        processed = [engine.input_processor.process(str(next(self._counter)), prompt, p,
                                                    lora_request=lora, mm_features=features)
                     for prompt, p, lora, features in zip(prompts, params, adapters, images,
                                                          strict=True)]
        for request, text in processed:
            engine.add_processed_request(request, text)
        return [request.request_id for request, _ in processed]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(request_ids)) if use_tqdm else None
        start, out_tokens = time.perf_counter(), 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        done[output.request_id] = output
                        out_tokens += sum(len(c.token_ids) for c in output.outputs)
                        if bar is not None:
                            rate = out_tokens / max(time.perf_counter() - start, 1e-9)
                            bar.set_postfix_str(f"output {rate:,.0f} tok/s", refresh=False)
                            bar.update(1)
        except BaseException:
            engine.abort_request(list(request_ids))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in request_ids]


def _per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                count: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt.

    Raises:
        ValueError: a list of adapters whose length is not the number of prompts.
    """
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"lora_request: {len(loras)} given for {count} prompts; pass one, or "
                         "one per prompt (None for the base model)")
    return loras


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    return list(prompts)


def _render_chat(tokenizer: Any, conversation: Conversation, add_generation_prompt: bool,
                 chat_template: str | None) -> str:
    for message in conversation:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"chat message: expected {{'role': ..., 'content': ...}}, got {message!r}")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat: the tokenizer has no chat template; pass chat_template")
    text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template)
    return str(text)


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
