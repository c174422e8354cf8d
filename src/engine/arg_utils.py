"""`EngineArgs`: the user-facing knobs of an engine, with vLLM's names, and their CLI flags.

The CLI (`ringserve serve`, `generate`, `bench`) and `LLM(...)` both build an `EngineArgs`, and
`create_engine_config()` turns it, once, into the frozen `EngineConfig` every layer receives.
Every check on a user's value raises `ValueError` naming the field, the value and what is
allowed, so the CLI can print one line instead of a traceback. The flags themselves (names,
help, types) are listed in `ringserve.engine.engine_flags`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any, get_args

from ringserve.config import (
    QUANTIZATION_CHOICES,
    REASONING_PARSERS,
    STRUCTURED_OUTPUT_BACKENDS,
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    ExecutorBackend,
    FaultToleranceConfig,
    FrontendConfig,
    LoRAConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SchedulingPolicy,
    SpecDecodeConfig,
    StructuredOutputsConfig,
)
from ringserve.engine.engine_flags import FLAG_SPECS
from ringserve.engine.flag_values import (
    flag_type,
    human_readable_int,
    human_readable_int_or_auto,
    parse_bytes,
    quantization_method,
)
from ringserve.errors import ModelDirectoryError
from ringserve.gpu.multimodal.engine_config import multimodal_config
from ringserve.gpu.pooling.engine_config import PoolingSettings, pooling_settings
from ringserve.gpu.spec_decode.config import (
    parse_speculative_config,
    resolve_speculative_config,
)
from ringserve.weight_transfer.config import WeightTransferConfig, parse_weight_transfer_config

__all__ = ["DEMO_MODEL", "EngineArgs", "human_readable_int", "human_readable_int_or_auto",
           "parse_bytes", "quantization_method"]

DEMO_MODEL = "ringserve-demo"

logger = logging.getLogger(__name__)

# The dense decoder families an adapter may target (`ringserve.gpu.lora`).
_LORA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                       "Qwen3ForCausalLM", "Phi3ForCausalLM")


@dataclass
class EngineArgs:
    """Arguments for one engine (names and defaults follow vLLM where the meaning matches).

    `model` is a local Hugging Face model directory, or "ringserve-demo" for the project's
    demo model (built on first use under RINGSERVE_HOME).
    """

    model: str = DEMO_MODEL
    tokenizer: str | None = None
    served_model_name: str | list[str] | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    dp_sync_interval: int = 16
    distributed_executor_backend: str | None = None
    gpu_memory_utilization: float = 0.92
    kv_cache_memory: int | None = None
    num_gpu_blocks_override: int | None = None
    async_scheduling: bool = True
    scheduling_policy: str = "fcfs"
    max_logprobs: int = 20
    device: str = "auto"
    disable_log_stats: bool = False
    log_stats_interval: float = 10.0
    enable_log_requests: bool = False
    enable_mfu_metrics: bool = False
    enable_expert_load_metrics: bool = False
    enable_fault_tolerance: bool = True
    engine_recovery_timeout_sec: float = 120.0
    execute_model_timeout_s: float | None = None
    fault_tolerance_auto_retry: int = 0
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    structured_outputs_config: str | dict[str, Any] | None = None
    reasoning_parser: str | None = None
    load_format: str = "auto"
    revision: str | None = None
    download_dir: str | None = None
    generation_config: str = "auto"
    override_generation_config: str | dict[str, Any] | None = None
    quantization: str | None = None
    gguf_dequantize: bool = False
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | list[int] | None = None
    weight_transfer_config: str | dict[str, Any] | None = None
    weight_transfer_timeout_s: float = 60.0
    speculative_config: str | dict[str, Any] | None = None
    # The pooling runner (`ringserve.gpu.pooling`): vLLM's `--runner`, `--convert`, the older
    # `--task`, and `--pooler-config`.
    runner: str = "auto"
    convert: str = "auto"
    task: str | None = None
    pooler_config: str | dict[str, Any] | None = None
    # Multi-LoRA serving (`ringserve.gpu.lora`; vLLM's flags).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    # Images in (`ringserve.gpu.multimodal`; vLLM's flags).
    limit_mm_per_prompt: str | dict[str, Any] | None = None
    encoder_cache_size: int | None = None
    mm_processor_cache_gb: float = 4.0
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None
    media_fetch_timeout: float = 10.0
    max_image_pixels: int | None = None

    # -- CLI -------------------------------------------------------------------------------

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, positional_model: bool = False) -> None:
        """Add one vLLM-named flag per field (`--max-model-len`, ...) to `parser`.

        Args:
            parser: the parser (or subcommand parser) to extend.
            positional_model: take the model as an optional positional argument (as
                `vllm serve MODEL` does) in addition to `--model`.
        """
        group = parser.add_argument_group("engine")
        if positional_model:
            parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                                help=f"model directory (default: {DEMO_MODEL})")
        for spec in FLAG_SPECS:
            spec.add_to(group, _DEFAULTS[spec.field])
        # vLLM's spellings of the same settings (their defaults come from the flags above).
        group.add_argument("--kv-cache-memory-bytes", dest="kv_cache_memory",
                           type=flag_type(human_readable_int), default=argparse.SUPPRESS,
                           help="vLLM's name of --kv-cache-memory (4G = 4 GiB, 4g = 4e9)")
        group.add_argument("--disable-log-requests", dest="enable_log_requests",
                           action="store_false", default=argparse.SUPPRESS,
                           help="do not log each request (the default; vLLM's old flag)")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        """Build from the namespace `add_cli_args` filled (a positional MODEL wins)."""
        values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
        model_tag = getattr(ns, "model_tag", None)
        if model_tag is not None:
            values["model"] = model_tag
        return cls(**values)

    # -- validation and config -------------------------------------------------------------

    def create_engine_config(self) -> EngineConfig:
        """Validate every field and build the frozen configuration.

        Raises:
            ValueError: a field is out of range (the message names it).
            ModelDirectoryError: the model directory is missing or incomplete.
        """
        self._verify()
        model_config = ModelConfig.from_model_dir(
            self._model_dir(),
            tokenizer=self.tokenizer,
            served_model_name=self.served_model_names()[0],
            dtype=self.dtype,
            max_model_len=None if self.max_model_len == -1 else self.max_model_len,
            seed=self.seed,
            max_logprobs=self.max_logprobs,
            load_format=self.load_format,
            revision=self.revision,
            download_dir=self.download_dir,
            generation_config=self.generation_config,
            override_generation_config=self.override_generation_config,
            device=_resolve_device(self.device),
            quantization=self.quantization,
            gguf_dequantize=self.gguf_dequantize,
        )
        pooling = self._pooling_settings(model_config)
        if pooling is not None:
            model_config = pooling.model_config
        speculative_config = self._spec_decode_config(model_config)
        if pooling is not None and speculative_config is not None:
            raise ValueError("speculative_config: a pooling model does not generate, so it "
                             "cannot speculate (drop --speculative-config)")
        config = EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory=self.kv_cache_memory,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
            ),
            scheduler_config=self._scheduler_config(model_config.max_model_len,
                                                    speculative=speculative_config is not None),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                data_parallel_size=self.data_parallel_size,
                distributed_executor_backend=self._executor_backend(),
                enable_expert_parallel=self.enable_expert_parallel,
                dp_sync_interval=self.dp_sync_interval,
            ),
            device_config=DeviceConfig(device=_resolve_device(self.device)),
            observability_config=ObservabilityConfig(
                disable_log_stats=self.disable_log_stats,
                log_stats_interval=self.log_stats_interval,
                enable_log_requests=self.enable_log_requests,
                enable_mfu_metrics=self.enable_mfu_metrics,
                enable_expert_load_metrics=self.enable_expert_load_metrics,
            ),
            fault_tolerance_config=FaultToleranceConfig(
                enable_fault_tolerance=self.enable_fault_tolerance,
                engine_recovery_timeout_sec=self.engine_recovery_timeout_sec,
                execute_model_timeout_s=self.execute_model_timeout_s,
                fault_tolerance_auto_retry=self.fault_tolerance_auto_retry,
            ),
            frontend_config=FrontendConfig(
                max_num_queued_reqs=self.max_num_queued_reqs,
                max_num_queued_tokens=self.max_num_queued_tokens,
            ),
            structured_outputs_config=self._structured_outputs_config(),
            compilation_config=self._compilation_config(),
            weight_transfer_config=self._weight_transfer_config(),
            weight_transfer_timeout_s=self._weight_transfer_timeout(),
            speculative_config=speculative_config,
        )
        lora = self._lora_config(config)
        if lora is not None:
            logger.info("LoRA on (up to %d adapters per step, rank <= %d): steps with adapter "
                        "rows run eagerly (the captured decode step serves base-only steps)",
                        lora.max_loras, lora.max_lora_rank)
            config = dataclasses.replace(config, lora_config=lora)
        images = multimodal_config(
            model_config, max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
            limit_mm_per_prompt=self.limit_mm_per_prompt,
            encoder_cache_size=self.encoder_cache_size,
            mm_processor_cache_gb=self.mm_processor_cache_gb,
            allowed_local_media_path=self.allowed_local_media_path,
            allowed_media_domains=self.allowed_media_domains,
            media_fetch_timeout=self.media_fetch_timeout, max_image_pixels=self.max_image_pixels)
        if images is not None:
            if speculative_config is not None or pooling is not None or lora is not None:
                raise ValueError("limit_mm_per_prompt: images with speculative decoding, "
                                 "pooling or LoRA are not supported in this version")
            config = dataclasses.replace(config, multimodal_config=images)
        if pooling is None:
            return config
        return dataclasses.replace(
            config, pooler_config=pooling.pooler,
            cache_config=pooling.cache_config(config.cache_config),
            scheduler_config=pooling.scheduler_config(config.scheduler_config))

    def _lora_config(self, config: EngineConfig) -> LoRAConfig | None:
        """`--enable-lora` and its limits, checked against the rest of the engine.

        Raises:
            ValueError: a limit out of range, or LoRA beside something it cannot run with in
                this version (naming both).
        """
        if not self.enable_lora:
            return None
        _require("max_loras", self.max_loras,
                 lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, ">= 1")
        _require("max_lora_rank", self.max_lora_rank,
                 lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, ">= 1")
        cpu = self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
        if cpu < self.max_loras:
            raise _fail("max_cpu_loras", cpu, f">= max_loras ({self.max_loras})")
        if self.lora_dtype not in ("auto", "float32", "float", "bfloat16", "float16", "half"):
            raise _fail("lora_dtype", self.lora_dtype, "auto, float32, bfloat16, float16")
        for other, value in (("speculative_config", config.speculative_config),
                             ("runner pooling", config.pooler_config)):
            if value is not None:
                raise ValueError(f"enable_lora: LoRA with {other} is not supported in this "
                                 "version (drop one of them)")
        if config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("enable_lora: LoRA runs with tensor_parallel_size 1 in this "
                             "version")
        if config.model_config.architecture not in _LORA_ARCHITECTURES:
            raise ValueError(f"enable_lora: {config.model_config.architecture} takes no "
                             f"adapters in this version (allowed: "
                             f"{', '.join(_LORA_ARCHITECTURES)})")
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=cpu)

    def _pooling_settings(self, model_config: ModelConfig) -> PoolingSettings | None:
        """The pooling runner's settings (`ringserve.gpu.pooling.engine_config`), or None
        when the model generates text."""
        return pooling_settings(
            model_config, runner=self.runner, convert=self.convert,
            task=self.task if self.task not in (None, "auto") else None,
            override=self.pooler_config,
            user_max_model_len=None if self.max_model_len in (None, -1) else self.max_model_len)

    def _weight_transfer_config(self) -> WeightTransferConfig | None:
        try:
            return parse_weight_transfer_config(self.weight_transfer_config)
        except ValueError as exc:
            raise _fail("weight_transfer_config", self.weight_transfer_config,
                        f'a JSON object such as {{"backend": "shm"}} ({exc})') from None

    def _speculative_config_checked(self) -> None:
        """The checks on `speculative_config` that need no model (`verify`)."""
        try:
            parse_speculative_config(self.speculative_config)
        except ValueError as exc:
            raise _spec_fail(exc) from None

    def _spec_decode_config(self, model_config: ModelConfig) -> SpecDecodeConfig | None:
        """`speculative_config` resolved against the target; a missing or unreadable draft is
        a `ModelDirectoryError` (the CLI exits 1), any other mistake a ValueError naming it."""
        try:
            return resolve_speculative_config(
                self.speculative_config, target=model_config,
                tensor_parallel_size=self.tensor_parallel_size,
                device=_resolve_device(self.device))
        except ModelDirectoryError:
            raise
        except ValueError as exc:
            raise _spec_fail(exc) from None

    def _weight_transfer_timeout(self) -> float:
        timeout = self.weight_transfer_timeout_s
        if not isinstance(timeout, int | float) or not 0 < timeout <= 86400:
            raise _fail("weight_transfer_timeout_s", timeout, "seconds, > 0 and <= 86400")
        return float(timeout)

    def _compilation_config(self) -> CompilationConfig:
        sizes = self.cuda_graph_sizes
        try:
            if sizes is None:
                return CompilationConfig(enforce_eager=self.enforce_eager)
            return CompilationConfig(enforce_eager=self.enforce_eager,
                                     capture_sizes=tuple(int(v) for v in sizes))
        except (TypeError, ValueError) as exc:
            raise _fail("cuda_graph_sizes", sizes,
                        "distinct ascending batch sizes >= 1") from exc

    def served_model_names(self) -> tuple[str, ...]:
        """The names clients may use (the first is the one metrics and logs use).

        Raises:
            ValueError: an empty list or an empty name.
        """
        names = self.served_model_name
        if names is None:
            return (self.model,)
        listed = (names,) if isinstance(names, str) else tuple(names)
        if not listed or not all(isinstance(n, str) and n for n in listed):
            raise _fail("served_model_name", names, "one or more non-empty names")
        return tuple(dict.fromkeys(listed))  # a repeated name is listed once

    def verify(self) -> None:
        """The checks that need no model directory (every field's range and choices).

        Raises:
            ValueError: a field is out of range (the message names it).
        """
        self._verify()
        self.served_model_names()
        self._structured_outputs_config()
        self._executor_backend()
        self._speculative_config_checked()

    def _structured_outputs_config(self) -> StructuredOutputsConfig:
        """`structured_outputs_config` (a dict, or its JSON text from the CLI) and
        `reasoning_parser`, checked.

        Raises:
            ValueError: not JSON, an unknown key, backend or reasoning parser.
        """
        raw = self.structured_outputs_config
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs_config: not JSON ({exc})") from None
        raw = dict(raw or {})
        if not isinstance(raw, dict):
            raise ValueError("structured_outputs_config: expected a JSON object")
        allowed = {"backend", "reasoning_parser"}
        unknown = sorted(set(raw) - allowed)
        if unknown:
            raise ValueError(f"structured_outputs_config: unknown keys {unknown}; allowed: "
                             f"{sorted(allowed)}")
        backend = raw.get("backend", "auto")
        if backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"structured_outputs_config.backend: got {backend!r}, allowed: "
                             f"{', '.join(STRUCTURED_OUTPUT_BACKENDS)}")
        parser = self.reasoning_parser or raw.get("reasoning_parser")
        if parser is not None and parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: got {parser!r}, allowed: "
                             f"{', '.join(REASONING_PARSERS)}")
        return StructuredOutputsConfig(backend=backend, reasoning_parser=parser)

    def _model_dir(self) -> str:
        if self.model == DEMO_MODEL:
            from ringserve.gpu.testing import demo_model_path

            return str(demo_model_path())
        return self.model

    def _scheduler_config(self, max_model_len: int, *,
                          speculative: bool = False) -> SchedulerConfig:
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = max(8192, self.max_num_seqs)
            if not self.enable_chunked_prefill:
                budget = max(budget, max_model_len)
        if budget < self.max_num_seqs:
            raise _fail("max_num_batched_tokens", budget, f">= max_num_seqs ({self.max_num_seqs})")
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise _fail(
                "max_num_batched_tokens", budget,
                f">= max_model_len ({max_model_len}) when chunked prefill is disabled",
            )
        policy: SchedulingPolicy = "priority" if self.scheduling_policy == "priority" else "fcfs"
        if speculative and self.async_scheduling:
            logger.info("speculative decoding runs with synchronous scheduling in this version: "
                        "async scheduling is off")
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=policy,
            async_scheduling=self.async_scheduling and not speculative,
        )

    def _executor_backend(self) -> ExecutorBackend:
        backend = self.distributed_executor_backend
        if backend is None:
            return "uni" if self.tensor_parallel_size == 1 else "mp"
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise _fail("distributed_executor_backend", backend,
                        "mp or ray when tensor_parallel_size > 1")
        if backend == "ray":
            return "ray"
        return "mp" if backend == "mp" else "uni"

    def _verify(self) -> None:
        for name in ("max_num_seqs", "tensor_parallel_size", "data_parallel_size", "block_size",
                     "dp_sync_interval"):
            _require(name, getattr(self, name), lambda v: v >= 1, "an integer >= 1")
        _require("block_size", self.block_size, lambda v: v & (v - 1) == 0 and v <= 256,
                 "a power of two up to 256")
        _require("max_num_batched_tokens", self.max_num_batched_tokens,
                 lambda v: v is None or v >= 1, "an integer >= 1")
        _require("max_model_len", self.max_model_len,
                 lambda v: v is None or v == -1 or v >= 1,
                 "an integer >= 1, or -1 / None (from the model's config.json)")
        _require("long_prefill_token_threshold", self.long_prefill_token_threshold,
                 lambda v: v >= 0, "an integer >= 0 (0: off)")
        _require("gpu_memory_utilization", self.gpu_memory_utilization,
                 lambda v: 0.0 < v <= 1.0, "a float in (0, 1]")
        _require("kv_cache_memory", self.kv_cache_memory, lambda v: v is None or v > 0,
                 "a byte count > 0")
        _require("num_gpu_blocks_override", self.num_gpu_blocks_override,
                 lambda v: v is None or v >= 1, "an integer >= 1")
        _require("max_logprobs", self.max_logprobs, lambda v: v >= -1, "-1 (vocab) or >= 0")
        _require("scheduling_policy", self.scheduling_policy,
                 lambda v: v in get_args(SchedulingPolicy), "fcfs or priority")
        _require("distributed_executor_backend", self.distributed_executor_backend,
                 lambda v: v is None or v in get_args(ExecutorBackend), "uni, mp or ray")
        _require("device", self.device, lambda v: v in ("auto", "cpu", "cuda"), "auto, cpu or cuda")
        _require("dtype", self.dtype,
                 lambda v: v in ("auto", "float32", "float", "bfloat16", "float16", "half"),
                 "auto, float32, bfloat16 or float16")
        _require("log_stats_interval", self.log_stats_interval, lambda v: v > 0, "seconds > 0")
        _require("engine_recovery_timeout_sec", self.engine_recovery_timeout_sec,
                 lambda v: v > 0, "seconds > 0")
        _require("execute_model_timeout_s", self.execute_model_timeout_s,
                 lambda v: v is None or v > 0, "seconds > 0")
        _require("fault_tolerance_auto_retry", self.fault_tolerance_auto_retry,
                 lambda v: v >= 0, "an integer >= 0")
        _require("quantization", self.quantization,
                 lambda v: v is None or v in QUANTIZATION_CHOICES,
                 f"None or {', '.join(QUANTIZATION_CHOICES)} (weight-only, CPU)")
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            _require(name, getattr(self, name), lambda v: v is None or v >= 1, "an integer >= 1")
        if self.device == "cuda" and _resolve_device("auto") != "cuda":
            raise _fail("device", self.device, "cpu or auto: no CUDA device is available")


_SPECULATIVE_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4}'


def _fail(field: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"EngineArgs.{field}: got {value!r}, allowed: {allowed}")


def _spec_fail(exc: ValueError) -> ValueError:
    """A speculative-config mistake: the flag, then the key and the reason (the message of
    `ringserve.gpu.spec_decode.config` names `speculative_config.<key>`)."""
    return ValueError(f"--speculative-config: {exc}; expected a JSON object such as "
                      f"{_SPECULATIVE_EXAMPLE}")


def _require(field: str, value: Any, ok: Any, allowed: str) -> None:
    try:
        good = bool(ok(value))
    except TypeError:
        good = False
    if not good:
        raise _fail(field, value, allowed)


def _resolve_device(device: str) -> Any:
    if device != "auto":
        return device
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
