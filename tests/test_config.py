"""EngineArgs -> EngineConfig: vLLM names, field-naming errors, model directory checks."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from ringserve import EngineArgs
from ringserve.config import ModelConfig
from ringserve.engine.arg_utils import parse_bytes
from ringserve.errors import ModelDirectoryError


def test_config_from_tiny_llama(tiny_llama_dir: Path) -> None:
    cfg = EngineArgs(model=str(tiny_llama_dir), device="cpu").create_engine_config()
    m = cfg.model_config
    assert m.architecture == "LlamaForCausalLM" and m.dtype == "float32"
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads) == (64, 2, 4)
    assert (m.num_kv_heads, m.head_dim, m.vocab_size, m.max_model_len) == (2, 16, 8000, 2048)
    assert len(m.eos_token_ids) == 2 and m.bos_token_id is not None
    assert m.served_model_name == str(tiny_llama_dir)
    assert cfg.cache_config.enable_prefix_caching and cfg.cache_config.block_size == 16
    assert cfg.scheduler_config.max_num_batched_tokens == 8192
    assert cfg.scheduler_config.max_model_len == 2048
    assert cfg.parallel_config.distributed_executor_backend == "uni"
    assert cfg.device_config.device == "cpu"
    assert m.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 4


def test_qwen3_head_dim_and_dtype_override(tiny_qwen3_dir: Path) -> None:
    m = ModelConfig.from_model_dir(str(tiny_qwen3_dir), dtype="bfloat16", max_model_len=512)
    assert m.architecture == "Qwen3ForCausalLM" and m.head_dim == 32
    assert m.dtype == "bfloat16" and m.max_model_len == 512


def test_cli_flags_use_vllm_names(tiny_llama_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, positional_model=True)
    ns = parser.parse_args([
        str(tiny_llama_dir), "--max-model-len", "1024", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512", "--no-enable-prefix-caching",
        "--tensor-parallel-size", "1", "--kv-cache-memory", "64MiB",
        "--scheduling-policy", "priority", "--no-async-scheduling", "--seed", "7",
    ])
    args = EngineArgs.from_cli_args(ns)
    assert args.model == str(tiny_llama_dir) and args.kv_cache_memory == 64 << 20
    cfg = args.create_engine_config()
    assert cfg.model_config.max_model_len == 1024 and cfg.model_config.seed == 7
    assert cfg.scheduler_config.max_num_seqs == 8 and cfg.scheduler_config.policy == "priority"
    assert not cfg.cache_config.enable_prefix_caching
    assert not cfg.scheduler_config.async_scheduling


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"block_size": 12}, "block_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, "max_num_batched_tokens"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 256}, "max_num_batched_tokens"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
         "distributed_executor_backend"),
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"max_model_len": 100000}, "max_model_len"),
    ],
)
def test_bad_args_name_the_field(tiny_llama_dir: Path, changes: dict[str, object], field: str) -> None:
    values: dict[str, object] = {"model": str(tiny_llama_dir), "device": "cpu", **changes}
    args = EngineArgs(**values)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field):
        args.create_engine_config()


def test_missing_model_directory_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelDirectoryError, match=f"{missing} does not exist"):
        EngineArgs(model=str(missing), device="cpu").create_engine_config()


@pytest.mark.parametrize("remove", ["config.json", "model.safetensors", "tokenizer.json"])
def test_incomplete_model_directory_names_the_file(
    tiny_llama_dir: Path, tmp_path: Path, remove: str
) -> None:
    copy = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, copy)
    (copy / remove).unlink()
    with pytest.raises(ModelDirectoryError, match=remove.split(".")[0]):
        ModelConfig.from_model_dir(str(copy))


def test_unsupported_architecture_lists_supported(tiny_llama_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["architectures"] = ["LlamaForTokenClassification"]
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelDirectoryError, match="not supported; supported: LlamaForCausalLM"):
        ModelConfig.from_model_dir(str(copy))


def test_configs_are_frozen(tiny_llama_dir: Path) -> None:
    cfg = EngineArgs(model=str(tiny_llama_dir), device="cpu").create_engine_config()
    with pytest.raises(AttributeError):
        cfg.cache_config.block_size = 32  # type: ignore[misc]


def test_parse_bytes() -> None:
    assert parse_bytes("1024") == 1024
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("4G") == 4 << 30
    assert parse_bytes("1.5 GB") == 3 << 29
    with pytest.raises(ValueError, match="not a byte size"):
        parse_bytes("lots")
