"""Engine configuration: one frozen object per layer, composed into `EngineConfig`.

Built once at the edge (`EngineArgs.create_engine_config()`, from the CLI or `LLM(...)`) and
passed down unchanged to the frontend, the engine core and the workers. Derived values are
properties; values measured at run time (the number of KV blocks) travel separately, never by
mutating these objects. `ModelConfig.from_model_dir` resolves a model (directory, GGUF file or
hub id) and reads it through `ringserve.checkpoint.model_dir`, which checks it is complete.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# What a checkpoint may be lives a floor down, with the checkpoint readers, so that they
# need nothing of this module; re-exported for the engine's modules that read them here.
from ringserve.checkpoint.support import GGUF_QUANTIZATION as GGUF_QUANTIZATION
from ringserve.checkpoint.support import LOAD_FORMATS as LOAD_FORMATS
from ringserve.checkpoint.support import QUANTIZATION_CHOICES as QUANTIZATION_CHOICES
from ringserve.checkpoint.support import QUANTIZATION_METHODS as QUANTIZATION_METHODS
from ringserve.checkpoint.support import SUPPORTED_ARCHITECTURES as SUPPORTED_ARCHITECTURES
from ringserve.checkpoint.support import DType as DType
from ringserve.weight_transfer.config import WeightTransferConfig

Device = Literal["cpu", "cuda"]
ExecutorBackend = Literal["uni", "mp", "ray"]
SchedulingPolicy = Literal["fcfs", "priority"]

@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The model as read from its directory, plus the user's choices about it.

    Attributes:
        model: the model directory.
        tokenizer: the tokenizer directory (the model directory unless given).
        served_model_name: the name clients use for this model.
        architecture: the HF architecture class name (one of SUPPORTED_ARCHITECTURES).
        dtype: the dtype weights and activations run in.
        max_model_len: the longest prompt + output, in tokens.
        vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_kv_heads,
        head_dim: the shape of the model.
        eos_token_ids: the ids that end generation (generation_config.json first).
        bos_token_id: the beginning-of-sequence id, if any.
        seed: the engine's random seed.
        max_logprobs: the cap on logprobs / prompt_logprobs per position (-1: vocab size).
        hf_config: the raw config.json contents (for the model code).
        load_format: "safetensors", "gguf" or "dummy" (resolved from "auto").
        weights_path: the directory or GGUF file the weights come from ("": `model`).
        generation_defaults: SamplingParams defaults from the model's generation config
            (`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `max_tokens`);
            a request's own values win.
        quantization: "int8" or "int4" (weight-only, quantized at load; see
            `ringserve.gpu.layers.quant`), "gguf" (a GGUF file's layers each on the panels
            of its own codes, the default for a quantized GGUF file on CPU; see
            `ringserve.checkpoint.precision`), or None for the float weights.
        weight_format: "bf16" when a bf16 checkpoint's linears and LM head stay bf16 in
            panels around float32 compute (CPU, `--dtype auto`; see
            `ringserve.checkpoint.precision.cpu_weight_format`), else None.
    """

    model: str
    tokenizer: str
    served_model_name: str
    architecture: str
    dtype: DType
    max_model_len: int
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    seed: int
    max_logprobs: int
    hf_config: dict[str, Any]
    load_format: str = "safetensors"
    weights_path: str = ""
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    quantization: str | None = None
    weight_format: str | None = None

    @property
    def weights(self) -> str:
        """Where the weights are read from: the directory, or the GGUF file."""
        return self.weights_path or self.model

    @classmethod
    def from_model_dir(
        cls,
        model: str,
        *,
        tokenizer: str | None = None,
        served_model_name: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        max_logprobs: int = 20,
        load_format: str = "auto",
        revision: str | None = None,
        download_dir: str | None = None,
        generation_config: str = "auto",
        override_generation_config: str | dict[str, Any] | None = None,
        device: str = "cpu",
        quantization: str | None = None,
        gguf_dequantize: bool = False,
    ) -> ModelConfig:
        """Read and check a model: a local Hugging Face directory, a GGUF file, or a hub id
        (resolved through the local Hugging Face cache, see `ringserve.checkpoint.hub`).

        Args:
            load_format: "auto" (GGUF for a GGUF file, else safetensors), "safetensors",
                "gguf", or "dummy" (random weights of the right shapes; no weights read).
            generation_config: "auto" (request defaults from the model's
                generation_config.json), "vllm" (none), or a directory holding one.
            override_generation_config: a JSON object (or its text) over those defaults.
            device: the resolved device ("cpu" or "cuda"), for what dtype "auto" means.
            quantization: None (float weights; a quantized GGUF file's codes on CPU), "int8",
                "int4" or "gguf" (weight-only, CPU only).
            gguf_dequantize: serve a quantized GGUF file's float model (dequantized at load)
                instead of its codes.

        Logs one line naming the dtype and weight format chosen and why (and warns about
        bf16 on a CPU without native bf16), once per process; see
        `ringserve.checkpoint.precision`.

        Raises:
            ModelDirectoryError: the model, or one of its files, is missing, unreadable,
                truncated, or describes an architecture ringserve does not run.
            ValueError: `dtype`, `load_format`, `max_model_len`, `quantization` or the
                generation config options are not allowed for this model.
        """
        from ringserve.checkpoint import model_dir as md
        from ringserve.checkpoint import precision
        from ringserve.checkpoint.generation_config import sampling_defaults
        from ringserve.checkpoint.gguf_file import is_gguf
        from ringserve.checkpoint.hub import resolve_model

        md.check_quantization(quantization, device, gguf_dequantize=gguf_dequantize)

        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: got {load_format!r}, allowed: "
                             f"{', '.join(LOAD_FORMATS)}")
        source = resolve_model(model, revision=revision, download_dir=download_dir)
        gguf_weights: str | None = None
        if load_format == "gguf" or (load_format == "auto" and is_gguf(source)):
            path, weights, fmt = md.gguf_model_dir(source, tokenizer), source, "gguf"
            quantization, gguf_weights = precision.gguf_quantization(
                md.gguf_tensors(source), quantization, device, dequantize=gguf_dequantize)
        else:
            path, weights = source, source
            fmt = "dummy" if load_format == "dummy" else "safetensors"
            md.check_model_dir(path, fmt)
            if quantization == GGUF_QUANTIZATION:
                raise ValueError(f"quantization: gguf serves a GGUF file from its codes; "
                                 f"{source} is not a GGUF file (allowed here: None, "
                                 f"{', '.join(QUANTIZATION_METHODS)})")
        tok_path = Path(tokenizer) if tokenizer is not None else path
        md.check_tokenizer_dir(tok_path)
        hf = md.load_hf_config(path)
        arch = md.architecture(path, hf)
        derived_len = md.derived_max_len(hf)
        if max_model_len is None:
            max_model_len = derived_len
        elif max_model_len < 1 or max_model_len > derived_len:
            raise ValueError(
                f"max_model_len: got {max_model_len}, allowed: 1..{derived_len} "
                f"(max_position_embeddings of {path / 'config.json'}, with its rope scaling)"
            )
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        gen_dir = md.generation_config_dir(generation_config, path)
        resolved, dtype_why = precision.resolve_dtype(dtype, hf, device)
        weight_format = precision.cpu_weight_format(dtype, hf, device, quantization, fmt)
        precision.announce(
            precision.startup_line(resolved, dtype_why, quantization, gguf_weights,
                                   weight_format),
            precision.bf16_warning(resolved, device))
        return cls(
            model=str(path),
            tokenizer=str(tok_path),
            served_model_name=served_model_name or model,
            architecture=arch,
            dtype=resolved,
            max_model_len=max_model_len,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            eos_token_ids=md.eos_token_ids(path, hf, gen_dir),
            bos_token_id=hf.get("bos_token_id"),
            seed=seed,
            max_logprobs=max_logprobs,
            hf_config=hf,
            load_format=fmt,
            weights_path=str(weights),
            generation_defaults=sampling_defaults(gen_dir, override_generation_config),
            quantization=quantization,
            weight_format=weight_format,
        )

    def kv_bytes_per_token(self, tensor_parallel_size: int = 1) -> int:
        """Bytes of K and V cache one token needs across all layers on one TP rank."""
        itemsize = 4 if self.dtype == "float32" else 2
        kv_heads = max(1, self.num_kv_heads // tensor_parallel_size)
        return 2 * self.num_hidden_layers * kv_heads * self.head_dim * itemsize


# The decode batch sizes captured by default (vLLM's ladder: 1, 2, 4, then every 8 to 512). A
# CUDA graph runs the smallest captured size >= B with padding rows; the CPU's fused step runs
# any B up to the largest.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, *range(8, 513, 8))


@dataclass(frozen=True, slots=True)
class CompilationConfig:
    """How the decode step runs (`ringserve.gpu.runner.decode_capture`).

    Attributes:
        enforce_eager: run every step eagerly (module by module); no captured decode step.
        capture_sizes: the ladder of decode batch sizes with a captured step (ascending);
            a pure-decode step of more requests than the largest runs eagerly.
    """

    enforce_eager: bool = False
    capture_sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES

    def __post_init__(self) -> None:
        sizes = self.capture_sizes
        if not sizes or any(s < 1 for s in sizes) or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"cuda_graph_sizes: got {list(sizes)}, expected distinct "
                             "ascending batch sizes >= 1")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache and prefix caching.

    Attributes:
        block_size: tokens per KV block.
        enable_prefix_caching: reuse KV blocks across requests with a common prefix.
        gpu_memory_utilization: on CUDA, the fraction of device memory the engine may use.
        kv_cache_memory: bytes for the KV cache (required meaning on CPU; overrides the
            profiled size on CUDA).
        num_gpu_blocks_override: use exactly this many blocks (tests, benchmarks).
    """

    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.92
    kv_cache_memory: int | None = None
    num_gpu_blocks_override: int | None = None


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduling policy and per-step budgets.

    Attributes:
        max_num_seqs: the most requests running at once.
        max_num_batched_tokens: the token budget of one step.
        max_model_len: copied from the model config for the scheduler's checks.
        enable_chunked_prefill: split long prompts over several steps.
        long_prefill_token_threshold: a prompt chunk is capped at this many tokens (0: off).
        policy: "fcfs" or "priority".
        async_scheduling: schedule step N+1 while step N runs.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: SchedulingPolicy = "fcfs"
    async_scheduling: bool = True


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How the model is spread over devices and engine cores."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: ExecutorBackend = "uni"
    # Experts partitioned over the TP x DP workers instead of sliced over the TP ranks.
    enable_expert_parallel: bool = False
    # Lockstep only: a consensus step every this many steps of a wave, and at its first.
    dp_sync_interval: int = 16
    # Set per engine core at start-up: its data-parallel rank, and the port of the
    # frontend's TCPStore that the cores and workers of a lockstep deployment meet at.
    data_parallel_rank: int = 0
    data_parallel_master_port: int = 0

    @property
    def world_size(self) -> int:
        """Workers per engine core (tensor parallel ranks)."""
        return self.tensor_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the experts are partitioned over (1: no expert parallelism)."""
        if not self.enable_expert_parallel:
            return 1
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def lockstep(self) -> bool:
        """The engine cores step together (expert parallelism across data-parallel ranks:
        every MoE layer is a collective over all of them)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """The device the workers run on ("cpu" or "cuda"), resolved from "auto" at the edge."""

    device: Device = "cpu"


@dataclass(frozen=True, slots=True)
class ObservabilityConfig:
    """Logging and metrics switches."""

    disable_log_stats: bool = False
    log_stats_interval: float = 10.0
    enable_log_requests: bool = False
    enable_mfu_metrics: bool = False
    # Tokens routed to each expert of each sparse layer (MoE models; ringserve.engine.metrics.
    # expert_load).
    enable_expert_load_metrics: bool = False

    @property
    def record_expert_load(self) -> bool:
        """Expert load is counted and published: asked for, and stats are on."""
        return self.enable_expert_load_metrics and not self.disable_log_stats


@dataclass(frozen=True, slots=True)
class FaultToleranceConfig:
    """What the engine core does when a worker or step fails."""

    enable_fault_tolerance: bool = True
    engine_recovery_timeout_sec: float = 120.0
    execute_model_timeout_s: float | None = None
    fault_tolerance_auto_retry: int = 0


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    """Admission control in the frontend (None: unlimited)."""

    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None


STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar", "guidance")
REASONING_PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    """Constrained decoding (`--structured-outputs-config`, `--reasoning-parser`).

    Attributes:
        backend: the grammar backend: "xgrammar", "guidance" (llguidance), or "auto"
            (xgrammar).
        reasoning_parser: with a reasoning model, the parser whose end-of-thinking marker
            (`</think>`) starts the constraint: tokens before it are not constrained.
    """

    backend: str = "auto"
    reasoning_parser: str | None = None

    @property
    def resolved_backend(self) -> str:
        """The backend `auto` stands for."""
        return "xgrammar" if self.backend == "auto" else self.backend


@dataclass(frozen=True, slots=True)
class SpecDecodeConfig:
    """Speculative decoding, resolved (`--speculative-config`; built by
    `ringserve.gpu.spec_decode.config.resolve_speculative_config`, which owns the rules).

    Here rather than beside its resolver: it holds the draft's `ModelConfig` and the engine's
    config holds it, so it lives with both (the resolver imports this module, not the reverse).

    Attributes:
        method: "ngram" (drafts copied from an earlier match of the last n tokens in the
            request's own tokens), "draft_model" (a smaller model with the target's
            vocabulary proposes them), "eagle" / "eagle3" (an EAGLE head reads the target's
            hidden states: `ringserve.gpu.spec_decode.eagle`).
        num_speculative_tokens: drafts proposed per request per step (1..16).
        prompt_lookup_min, prompt_lookup_max: the n-gram lengths tried, longest first (ngram;
            0 for draft_model).
        draft_model_config: the draft model (draft_model; None for ngram). Its
            `max_model_len` is the target's, or less when the user's `max_model_len` asks:
            a sequence longer than that gets no drafts.
        draft_tensor_parallel_size: the draft's TP degree, 1 or the target's (1 for ngram).
        per_batch_size: (min_batch, k) pairs, ascending: a decode batch of at least
            `min_batch` requests uses `k` drafts (0: none), the last pair that fits winning;
            empty: always `num_speculative_tokens`.
        draft_head_dir: eagle / eagle3: the head's directory (checked by the resolver).
    """

    method: Literal["ngram", "draft_model", "eagle", "eagle3"]
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    draft_model_config: ModelConfig | None
    draft_tensor_parallel_size: int
    per_batch_size: tuple[tuple[int, int], ...] = ()
    draft_head_dir: str | None = None

    @property
    def uses_draft_model(self) -> bool:
        """A draft model or an EAGLE head proposes (weights and a KV cache of its own)."""
        return self.method != "ngram"


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """The pooling runner, resolved (`--runner pooling`, `--convert`, `--pooler-config`, and
    the model's own files: built by `ringserve.gpu.pooling.layout.resolve_pooler_config`).

    Attributes:
        convert: "embed" (embeddings, and scores as their cosine) or "classify" (a
            classifier head: classification, and scores of a cross-encoder).
        pooling_type: "CLS" (the first token), "MEAN" (the mean over the tokens) or "LAST"
            (the last token).
        normalize: L2-normalise embeddings unless a request says otherwise.
        encoder: the model is a bidirectional encoder (BERT, XLM-RoBERTa): no KV cache, and
            each input runs whole in one step.
        enable_chunked_processing: an input longer than max_model_len is split into chunks
            of max_model_len tokens, each from position 0, pooled into their token-weighted
            mean (embed with MEAN pooling only, as vLLM).
        max_embed_len: the longest input chunked processing takes (None: no limit).
        matryoshka_dimensions: the `dimensions` a request may ask for (None: not a Matryoshka
            model; empty: any up to the hidden size).
        id2label: the classifier's label names, in label order (classify).
        max_input_len: the longest input in tokens (set at the edge from the model's length;
            the engine's `max_model_len` is one more, for the one token a pooling request
            books and never samples).
    """

    convert: Literal["embed", "classify"]
    pooling_type: Literal["CLS", "MEAN", "LAST"]
    normalize: bool
    encoder: bool
    enable_chunked_processing: bool = False
    max_embed_len: int | None = None
    matryoshka_dimensions: tuple[int, ...] | None = None
    id2label: tuple[str, ...] = ()
    max_input_len: int = 0


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Multi-LoRA serving (`--enable-lora`; `ringserve.gpu.lora`).

    Attributes:
        max_loras: adapters one step may hold (the workers' slots).
        max_lora_rank: the largest rank an adapter may have.
        max_cpu_loras: adapters kept read in each worker's memory (least recently used
            evicted; an evicted one is read again from its files when needed).
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1


@dataclass(frozen=True, slots=True)
class MultiModalConfig:
    """Images in (issue 44; `ringserve.gpu.multimodal`), set for a vision-language model.

    Attributes:
        family: the vision family ("qwen2_vl", "qwen2_5_vl", "gemma3", "idefics3").
        limit_per_prompt: the most images one prompt may hold (`--limit-mm-per-prompt`).
        encoder_cache_size: encoder output rows the workers keep (`--encoder-cache-size`).
        max_num_encoder_input_tokens: encoder output rows one step may produce.
        no_split: an image is never split across steps (its tokens attend both ways).
        max_span: with `no_split`, the most positions one image may span (the step's token
            budget; a longer image is refused by the frontend); 0: no limit.
        processor_cache_gb: the frontend's processed-image cache (`--mm-processor-cache-gb`;
            0: off).
        allowed_local_media_path: `file://` URLs are read only under it (None: refused).
        allowed_media_domains: hosts `http(s)` URLs may name (None: any).
        media_fetch_timeout: seconds one fetch may take (`--media-fetch-timeout`).
        max_image_pixels: the pixel cap (None: Pillow's decompression-bomb limit).
    """

    family: str
    limit_per_prompt: int = 1
    encoder_cache_size: int = 8192
    max_num_encoder_input_tokens: int = 8192
    no_split: bool = False
    max_span: int = 0
    processor_cache_gb: float = 4.0
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    media_fetch_timeout: float = 10.0
    max_image_pixels: int | None = None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The whole configuration of one engine, passed from the edge to every layer."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    observability_config: ObservabilityConfig
    fault_tolerance_config: FaultToleranceConfig
    frontend_config: FrontendConfig
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    compilation_config: CompilationConfig = CompilationConfig()
    # Weights from a trainer (`--weight-transfer-config`; None: off) and how long one phase of
    # an update may wait for the trainer (`--weight-transfer-timeout-s`).
    weight_transfer_config: WeightTransferConfig | None = None
    weight_transfer_timeout_s: float = 60.0
    # Speculative decoding (`--speculative-config`; None: off).
    speculative_config: SpecDecodeConfig | None = None
    # The pooling runner (`--runner pooling`; None: the model generates text).
    pooler_config: PoolerConfig | None = None
    # Multi-LoRA serving (`--enable-lora`; None: off).
    lora_config: LoRAConfig | None = None
    # Images in (a vision-language model; None: text only).
    multimodal_config: MultiModalConfig | None = None
