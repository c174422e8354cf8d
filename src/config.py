"""Engine configuration: one frozen object per layer, composed into `EngineConfig`.

Built once at the edge (`EngineArgs.create_engine_config()`, from the CLI or `LLM(...)`) and
passed down unchanged to the frontend, the engine core and the workers. Derived values are
properties; values measured at run time (the number of KV blocks) travel separately, never by
mutating these objects. `ModelConfig.from_model_dir` reads a Hugging Face model directory
(config.json through transformers' AutoConfig, generation_config.json) and checks it is complete.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ringserve.errors import ModelDirectoryError

DType = Literal["float32", "bfloat16", "float16"]
Device = Literal["cpu", "cuda"]
ExecutorBackend = Literal["uni", "mp", "ray"]
SchedulingPolicy = Literal["fcfs", "priority"]

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",  # served as text only
    "Phi3ForCausalLM",
)

_TORCH_DTYPE_NAMES: dict[str, DType] = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# Weight-only quantization of the linear layers at load (ringserve.gpu.quant); CPU only.
QUANTIZATION_METHODS = ("int8", "int4")


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
            `ringserve.gpu.quant`), or None for the float weights.
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
            quantization: None, "int8" or "int4" (weight-only, CPU only).

        Raises:
            ModelDirectoryError: the model, or one of its files, is missing, unreadable,
                truncated, or describes an architecture ringserve does not run.
            ValueError: `dtype`, `load_format`, `max_model_len`, `quantization` or the
                generation config options are not allowed for this model.
        """
        from ringserve.checkpoint.hub import resolve_model

        _check_quantization(quantization, device)

        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: got {load_format!r}, allowed: "
                             f"{', '.join(LOAD_FORMATS)}")
        source = resolve_model(model, revision=revision, download_dir=download_dir)
        if load_format == "gguf" or (load_format == "auto" and _is_gguf(source)):
            path, weights, fmt = _gguf_model_dir(source, tokenizer), source, "gguf"
        else:
            path, weights = source, source
            fmt = "dummy" if load_format == "dummy" else "safetensors"
            _check_model_dir(path, fmt)
        tok_path = Path(tokenizer) if tokenizer is not None else path
        _check_tokenizer_dir(tok_path)
        hf = _load_hf_config(path)
        arch = _architecture(path, hf)
        derived_len = _derived_max_len(hf)
        if max_model_len is None:
            max_model_len = derived_len
        elif max_model_len < 1 or max_model_len > derived_len:
            raise ValueError(
                f"max_model_len: got {max_model_len}, allowed: 1..{derived_len} "
                f"(max_position_embeddings of {path / 'config.json'}, with its rope scaling)"
            )
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        gen_dir = _generation_config_dir(generation_config, path)
        return cls(
            model=str(path),
            tokenizer=str(tok_path),
            served_model_name=served_model_name or model,
            architecture=arch,
            dtype=_resolve_dtype(dtype, hf, device),
            max_model_len=max_model_len,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            eos_token_ids=_eos_token_ids(path, hf, gen_dir),
            bos_token_id=hf.get("bos_token_id"),
            seed=seed,
            max_logprobs=max_logprobs,
            hf_config=hf,
            load_format=fmt,
            weights_path=str(weights),
            generation_defaults=generation_defaults(gen_dir, override_generation_config),
            quantization=quantization,
        )

    def kv_bytes_per_token(self, tensor_parallel_size: int = 1) -> int:
        """Bytes of K and V cache one token needs across all layers on one TP rank."""
        itemsize = 4 if self.dtype == "float32" else 2
        kv_heads = max(1, self.num_kv_heads // tensor_parallel_size)
        return 2 * self.num_hidden_layers * kv_heads * self.head_dim * itemsize


def _check_model_dir(path: Path, load_format: str) -> None:
    from ringserve.checkpoint.safetensors_file import check_headers, checkpoint_files

    if not path.is_dir():
        raise ModelDirectoryError(
            f"model directory {path} is not a directory (ringserve loads Hugging Face model "
            "directories, GGUF files and hub ids; `ringserve demo-model PATH` writes a small "
            "model)"
        )
    if not (path / "config.json").is_file():
        raise ModelDirectoryError(f"model directory {path}: config.json is missing")
    if load_format == "safetensors":
        check_headers(checkpoint_files(path))


def _check_quantization(quantization: str | None, device: str) -> None:
    """Refuse a quantization method ringserve does not run, or one on a device it lacks."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: got {quantization!r}, allowed: None (float weights), "
                         f"{', '.join(QUANTIZATION_METHODS)}")
    if quantization is not None and device != "cpu":
        # The packed kernels are torch's CPU weight-only matmuls; CUDA has its own layouts.
        raise ValueError(f"quantization: {quantization} runs on CPU only (device is {device})")


def _is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _gguf_model_dir(path: Path, tokenizer: str | None) -> Path:
    """A Hugging Face-style directory (config, generation config, tokenizer) written from a
    GGUF file's metadata, cached under RINGSERVE_HOME by the file's path, size and mtime."""
    import hashlib

    from ringserve.checkpoint.gguf_file import materialize
    from ringserve.envs import ringserve_home

    if not _is_gguf(path):
        raise ModelDirectoryError(f"{path}: not a GGUF file (load_format gguf)")
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|"
                         f"{tokenizer is None}".encode()).hexdigest()[:16]
    target = ringserve_home() / "gguf" / f"{path.stem}-{key}"
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        materialize(path, target, with_tokenizer=tokenizer is None)
    return target


def _check_tokenizer_dir(path: Path) -> None:
    if not path.is_dir():
        raise ModelDirectoryError(f"tokenizer directory {path} does not exist")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelDirectoryError(
            f"tokenizer directory {path}: no tokenizer file ({', '.join(_TOKENIZER_FILES)})"
        )


def _load_hf_config(path: Path) -> dict[str, Any]:
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelDirectoryError(f"model directory {path}: config.json unreadable: {exc}") from exc
    data: dict[str, Any] = hf.to_dict()
    text_config = data.get("text_config")
    if isinstance(text_config, dict):
        # A multimodal checkpoint served as text: the language model's settings, under the
        # checkpoint's own architecture (its text_config may name the text-only class).
        data = {**data, **text_config, "architectures": data.get("architectures")}
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if not isinstance(data.get(key), int):
            raise ModelDirectoryError(f"model directory {path}: config.json has no integer {key!r}")
    return data


def _architecture(path: Path, hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    raise ModelDirectoryError(
        f"model directory {path}: architecture {archs or 'missing'} in config.json is not "
        f"supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _derived_max_len(hf: dict[str, Any]) -> int:
    """The longest sequence the config allows: max_position_embeddings, stretched as vLLM
    does by a rope scaling that extends the context (yarn: its original context times the
    factor; linear and dynamic: times the factor). llama3 and longrope configs already count
    the scaling in max_position_embeddings, and so do Gemma 3's (whose rope parameters come
    per layer type)."""
    derived = 2048
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = hf.get(key)
        if isinstance(value, int) and value > 0:
            derived = value
            break
    rope = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not isinstance(rope, dict) or str(hf.get("model_type", "")).startswith("gemma3"):
        return derived
    rope_type = rope.get("rope_type") or rope.get("type")
    factor = rope.get("factor")
    if rope_type in ("yarn", "linear", "dynamic") and isinstance(factor, (int, float)):
        if rope_type == "yarn" and isinstance(rope.get("original_max_position_embeddings"), int):
            derived = int(rope["original_max_position_embeddings"])
        return max(derived, int(derived * float(factor)))
    return derived


def _resolve_dtype(dtype: str, hf: dict[str, Any], device: str) -> DType:
    """The compute dtype. "auto": the checkpoint's own dtype on CUDA; on CPU float32 (the
    CPU's GEMMs and attention have no native bf16/fp16 without AVX512-BF16 or AMX, and
    emulating it is slower than float32), except bfloat16 weights on a CPU that has native
    bf16."""
    if dtype != "auto":
        if dtype not in _TORCH_DTYPE_NAMES:
            raise ValueError(f"dtype: got {dtype!r}, allowed: auto, float32, bfloat16, float16")
        return _TORCH_DTYPE_NAMES[dtype]
    stored = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    resolved = _TORCH_DTYPE_NAMES.get(str(stored).removeprefix("torch."), "float32")
    if device == "cuda":
        return resolved
    return "bfloat16" if resolved == "bfloat16" and cpu_has_native_bf16() else "float32"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AVX512-BF16 or AMX-BF16 in /proc/cpuinfo)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def _eos_token_ids(path: Path, hf: dict[str, Any], gen_dir: Path | None) -> tuple[int, ...]:
    """The ids that end generation: the generation config's (the model's own, plus those of
    `--generation-config DIR`), else config.json's `eos_token_id`."""
    from ringserve.checkpoint.generation_config import read_generation_config

    ids: list[int] = []
    for directory in dict.fromkeys(d for d in (path, gen_dir) if d is not None):
        raw = read_generation_config(directory).get("eos_token_id")
        for i in raw if isinstance(raw, list) else [raw]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    if not ids:
        raw = hf.get("eos_token_id")
        ids = [int(i) for i in (raw if isinstance(raw, list) else [raw]) if isinstance(i, int)]
    return tuple(ids)


def _generation_config_dir(choice: str, model_dir: Path) -> Path | None:
    if choice == "vllm":
        return None
    if choice == "auto":
        return model_dir
    path = Path(choice)
    if not (path / "generation_config.json").is_file():
        raise ModelDirectoryError(f"--generation-config {choice}: no generation_config.json "
                                  "there (allowed: auto, vllm, or a directory holding one)")
    return path


def generation_defaults(gen_dir: Path | None, override: str | dict[str, Any] | None
                        ) -> dict[str, Any]:
    """The request defaults of `gen_dir`'s generation config with `override` over them."""
    from ringserve.checkpoint.generation_config import sampling_defaults

    return sampling_defaults(gen_dir, override)


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

    @property
    def world_size(self) -> int:
        """Workers per engine core (tensor parallel ranks)."""
        return self.tensor_parallel_size


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
