"""The CLI flags of `EngineArgs` (`ringserve.engine.arg_utils`): one `FlagSpec` per field, with
vLLM's flag names, help texts, types and choices; `EngineArgs.add_cli_args` adds them to a
parser with the fields' defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from ringserve.config import REASONING_PARSERS, STRUCTURED_OUTPUT_BACKENDS
from ringserve.engine.flag_values import (
    flag_type,
    human_readable_int,
    human_readable_int_or_auto,
    parse_bytes,
    quantization_method,
)

__all__ = ["FLAG_SPECS", "FlagSpec"]


@dataclass(frozen=True)
class FlagSpec:
    """One `EngineArgs` field's flag: `--field-name`, its help, type or choices."""

    field: str
    help: str
    type: Any = None
    choices: tuple[str, ...] | None = None
    boolean: bool = False
    aliases: tuple[str, ...] = ()  # vLLM's short forms (-tp, -dp)
    nargs: str | None = None

    def add_to(self, group: Any, default: Any) -> None:
        """Add the flag to an argparse group, with the field's default."""
        flags = ["--" + self.field.replace("_", "-"), *self.aliases]
        if self.boolean:
            group.add_argument(*flags, dest=self.field, action=argparse.BooleanOptionalAction,
                               default=default, help=self.help)
            return
        group.add_argument(*flags, dest=self.field, type=self.type, choices=self.choices,
                           nargs=self.nargs, default=default,
                           help=f"{self.help} (default: {default})")


FLAG_SPECS: tuple[FlagSpec, ...] = (
    FlagSpec("model", "model directory, or ringserve-demo", str),
    FlagSpec("tokenizer", "tokenizer directory (default: the model's)", str),
    FlagSpec("served_model_name", "names clients may use for the model; the first is the one "
              "metrics use (default: MODEL as given)", str, nargs="+"),
    FlagSpec("dtype", "weight and activation dtype (auto: the checkpoint's on CUDA, float32 "
              "on CPU until bf16 has panels there; the start-up line says which and why)", str,
              ("auto", "float32", "float", "bfloat16", "float16", "half")),
    FlagSpec("seed", "random seed", int),
    FlagSpec("max_model_len", "longest prompt + output in tokens: 4096, 32k (= 32000), 32K "
              "(= 32768), or auto / -1 (from config.json, the default)",
              flag_type(human_readable_int_or_auto)),
    FlagSpec("block_size", "tokens per KV cache block", int),
    FlagSpec("enable_prefix_caching", "reuse KV blocks of common prefixes", boolean=True),
    FlagSpec("max_num_seqs", "most requests running at once", int),
    FlagSpec("max_num_batched_tokens", "token budget of one step (e.g. 8192, 8k)",
              flag_type(human_readable_int)),
    FlagSpec("enable_chunked_prefill", "split long prompts over steps", boolean=True),
    FlagSpec("long_prefill_token_threshold", "cap of one prompt chunk (0: off)", int),
    FlagSpec("tensor_parallel_size", "tensor parallel ranks", int, aliases=("-tp",)),
    FlagSpec("data_parallel_size", "engine cores (data parallel ranks)", int, aliases=("-dp",)),
    FlagSpec("enable_expert_parallel", "partition the experts of MoE models over the "
              "TP x DP workers (tokens go to their expert's rank and back by all-to-all; "
              "with DP > 1 the engine cores step in lockstep) instead of slicing every "
              "expert over the TP ranks", boolean=True, aliases=("-ep",)),
    FlagSpec("dp_sync_interval", "lockstep data parallelism (expert-parallel MoE): "
              "the cores' consensus step (does any core have work?) every this many "
              "steps of a wave, and at its first", int),
    FlagSpec("distributed_executor_backend", "executor", str, ("uni", "mp", "ray")),
    FlagSpec("gpu_memory_utilization", "fraction of GPU memory to use", float),
    FlagSpec("kv_cache_memory", "KV cache size in bytes (e.g. 1G, 512MiB)", parse_bytes),
    FlagSpec("num_gpu_blocks_override", "exact number of KV blocks", int),
    FlagSpec("async_scheduling", "schedule the next step while one runs", boolean=True),
    FlagSpec("scheduling_policy", "scheduling policy", str, ("fcfs", "priority")),
    FlagSpec("max_logprobs", "cap on logprobs per position (-1: vocab)", int),
    FlagSpec("device", "device to run on", str, ("auto", "cpu", "cuda")),
    FlagSpec("disable_log_stats", "turn off the periodic stats log line", boolean=True),
    FlagSpec("log_stats_interval", "seconds between stats log lines", float),
    FlagSpec("enable_log_requests", "log each request", boolean=True),
    FlagSpec("enable_mfu_metrics", "export analytic FLOPs per GPU "
              "(ringserve:estimated_flops_per_gpu_total) and log TF/s",
              boolean=True),
    FlagSpec("enable_expert_load_metrics", "export the tokens routed to each expert of each "
              "MoE layer (ringserve:moe_expert_load_tokens_total) and log the imbalance",
              boolean=True),
    FlagSpec("enable_fault_tolerance", "on an engine fault (a worker dies, a step raises or "
              "times out) fail every request, report unhealthy and wait for a retry/abort "
              "instruction (off: fail fast and stop the engine)", boolean=True),
    FlagSpec("engine_recovery_timeout_sec", "seconds to wait for a retry/abort instruction "
              "after a fault before the engine stops", float),
    FlagSpec("execute_model_timeout_s", "a step not done within this many seconds is a fault "
              "(a hung worker)", float),
    FlagSpec("fault_tolerance_auto_retry", "retry this many times by itself after a fault "
              "(with backoff) before waiting for an operator", int),
    FlagSpec("max_num_queued_reqs", "admission limit on requests (503 beyond)", int),
    FlagSpec("max_num_queued_tokens", "admission limit on prompt tokens in prefill", int),
    FlagSpec("structured_outputs_config", "constrained decoding, as JSON: "
              f"{{\"backend\": one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}}}", str),
    FlagSpec("reasoning_parser", "split <think>...</think> into the reasoning field; "
              "constraints apply after it", str, REASONING_PARSERS),
    FlagSpec("load_format", "weights format: auto (safetensors, or gguf for a .gguf file), "
              "safetensors, gguf, or dummy (random weights of the right shapes)", str,
              ("auto", "safetensors", "gguf", "dummy")),
    FlagSpec("revision", "the model's branch, tag or commit (a hub model id)", str),
    FlagSpec("download_dir", "where hub models are looked up and downloaded (default: the "
              "Hugging Face cache)", str),
    FlagSpec("generation_config", "request defaults: auto (the model's "
              "generation_config.json), vllm (none), or a directory holding one", str),
    FlagSpec("quantization", "weight-only quantization of the linear layers and the LM head "
              "at load, on CPU: int8 (per output channel) or int4 (groups of 32), or gguf "
              "(each layer of a GGUF file on the panels of its own codes: Q4_0/Q4_1/Q4_K on "
              "int4, Q8_0 on int8, other quantized types rounded to int8, float tensors "
              "float); the embedding stays float. Default: gguf for a quantized GGUF file on "
              "CPU, else none", flag_type(quantization_method), aliases=("-q",)),
    FlagSpec("gguf_dequantize", "serve a quantized GGUF file's float model: its blocks "
              "dequantized to the compute dtype at load (in float32 several times the "
              "file's size in memory), not its codes on int4 / int8 panels", boolean=True),
    FlagSpec("enforce_eager", "run every step module by module: no captured decode step "
              "(ringserve.gpu.runner.decode_capture)", boolean=True),
    FlagSpec("cuda_graph_sizes", "the decode batch sizes that get a captured step (on CPU "
              "the fused C step, which runs any batch up to the largest; default 1 2 4 8 16 "
              "... 512)", int, nargs="+"),
    FlagSpec("weight_transfer_config", "receive weights from an RL trainer, as JSON: "
              '{"backend": "shm" (same host), "gloo" (CPU, any host) or "nccl"} '
              "(ringserve.weight_transfer)", str),
    FlagSpec("weight_transfer_timeout_s", "a weight-update phase that waits longer than this "
              "for the trainer fails (the old weights keep serving)", float),
    FlagSpec("speculative_config", "speculative decoding, as JSON: {\"method\": \"ngram\" "
              "(drafts from the request's own tokens; prompt_lookup_min, prompt_lookup_max) or "
              "\"draft_model\" (model: a smaller model with the target's vocabulary; "
              "quantization: int8 or int4; draft_tensor_parallel_size; max_model_len), "
              "num_speculative_tokens: 1..16 (default 4), "
              "num_speculative_tokens_per_batch_size: [[first_batch, last_batch, k], ...]}; "
              "scheduling is synchronous while it is on (ringserve.gpu.spec_decode)", str),
    FlagSpec("runner", "generate text, or pool (embeddings, classification, scores); auto: "
              "pooling for encoders, *ForSequenceClassification and sentence-transformers "
              "layouts (ringserve.gpu.pooling)", str, ("auto", "generate", "pooling")),
    FlagSpec("convert", "what a pooling model computes: embed or classify (auto: classify "
              "for *ForSequenceClassification, else embed)", str,
              ("auto", "none", "embed", "classify")),
    FlagSpec("task", "vLLM's older spelling of --runner / --convert: generate, embed, "
              "classify or score", str,
              ("auto", "generate", "embed", "embedding", "classify", "score", "reward")),
    FlagSpec("pooler_config", "the pooler, as JSON: {\"pooling_type\": \"CLS\" | \"MEAN\" | "
              "\"LAST\", \"normalize\": bool, \"enable_chunked_processing\": bool, "
              "\"max_embed_len\": int} (default: the model's sentence-transformers files)", str),
    FlagSpec("enable_lora", "serve LoRA adapters (ringserve.gpu.lora; steps run eagerly "
              "while it is on)", boolean=True),
    FlagSpec("max_loras", "adapters one step may hold", int),
    FlagSpec("max_lora_rank", "the largest adapter rank", int),
    FlagSpec("max_cpu_loras", "adapters kept read in memory (default: --max-loras)", int),
    FlagSpec("lora_dtype", "the adapters' dtype (on CPU they compute in float32)", str),
    FlagSpec("limit_mm_per_prompt", "most images per prompt, as JSON: '{\"image\": 2}' "
             "(default: 1 for a vision-language model)", str),
    FlagSpec("encoder_cache_size", "image encoder rows the workers keep (default: "
             "max_num_batched_tokens, raised to the largest image's)", int),
    FlagSpec("mm_processor_cache_gb", "the frontend's processed-image cache, GiB (0: off)",
             float),
    FlagSpec("allowed_local_media_path", "file:// image URLs are read only under this "
             "directory (default: refused)", str),
    FlagSpec("allowed_media_domains", "hosts http(s) image URLs may name (default: any)", str,
             nargs="+"),
    FlagSpec("media_fetch_timeout", "seconds an image fetch may take", float),
    FlagSpec("max_image_pixels", "largest image accepted, in pixels (default: Pillow's "
             "decompression-bomb limit)", int),
    FlagSpec("override_generation_config", "JSON object over the generation config, e.g. "
              "'{\"temperature\": 0.5}'", str),
)
