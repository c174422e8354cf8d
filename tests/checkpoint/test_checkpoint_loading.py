"""Safetensors checkpoints as they arrive: bf16 and sharded, dummy weights, hub ids in the
local cache, generation_config defaults, and one clear error per broken file."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ringserve.config import ModelConfig
from ringserve.errors import ModelDirectoryError
from ringserve.gpu.attention.backend import TorchAttentionBackend
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.weights.loader import load_model
from ringserve.sampling_params import default_sampling_params

NEW_TOKENS = 6
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpu"))  # gpu_helpers


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def bf16_sharded(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama saved in bfloat16 over several shards with an index."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("bf16") / "m"
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.bfloat16)
    model.save_pretrained(str(out), max_shard_size="400KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "special_tokens_map.json"):
        if (tiny_llama_dir / name).is_file():
            shutil.copy(tiny_llama_dir / name, out / name)
    return out


def _greedy_hf(model_dir: Path, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                      min_new_tokens=NEW_TOKENS, output_logits=True,
                      return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), out.logits[0][0].float()


def _run(model_dir: Path, prompt: list[int]) -> tuple[list[int], float]:
    """Greedy tokens and the first token's logprob, through the model runner."""
    from gpu_helpers import make_runner
    from runner_driver import ToyScheduler

    from ringserve.sampling_params import SamplingParams

    sched = ToyScheduler(make_runner(model_dir), budget=16)
    greedy = SamplingParams(temperature=0.0, min_tokens=NEW_TOKENS, max_tokens=NEW_TOKENS,
                            logprobs=1)
    sched.add("r", prompt, greedy, NEW_TOKENS)
    sched.run()
    req = sched.done["r"]
    return req.output, float(req.logprobs[0].logprobs[0])


@pytest.mark.slow
def test_bf16_sharded_loads_like_transformers(bf16_sharded: Path, tiny_llama_dir: Path) -> None:
    assert (bf16_sharded / "model.safetensors.index.json").is_file()
    assert len(list(bf16_sharded.glob("*.safetensors"))) > 1
    # auto: float32 compute on CPU (bf16 has no panels yet; see test_dtype_choice.py), what
    # transformers' upcast is compared with.
    assert ModelConfig.from_model_dir(str(bf16_sharded)).dtype == "float32"
    prompt = torch.randint(3, 8000, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    expected, _ = _greedy_hf(bf16_sharded, prompt)  # transformers upcasts the same weights
    tokens, logprob = _run(bf16_sharded, prompt)
    assert tokens == expected
    # Against the float32 single-file original: the first token (a robust argmax here) is
    # the same, its logprob within bf16 rounding of the weights.
    fp32_tokens, fp32_logprob = _run(tiny_llama_dir, prompt)
    assert tokens[0] == fp32_tokens[0]
    assert abs(logprob - fp32_logprob) < 0.05


def test_missing_shard_and_truncated_file(bf16_sharded: Path, tmp_path: Path) -> None:
    copy = _copy(bf16_sharded, tmp_path / "m")
    shard = sorted(copy.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelDirectoryError, match=rf"{shard}: truncated"):
        ModelConfig.from_model_dir(str(copy))
    shard.unlink()
    with pytest.raises(ModelDirectoryError, match=f"names missing shards: {shard.name}"):
        ModelConfig.from_model_dir(str(copy))


def test_pickled_checkpoint_is_refused_with_the_conversion(tiny_llama_dir: Path,
                                                           tmp_path: Path) -> None:
    copy = _copy(tiny_llama_dir, tmp_path / "m")
    (copy / "model.safetensors").unlink()
    (copy / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelDirectoryError, match=r"pytorch_model\.bin.*pickle.*save_pretrained"):
        ModelConfig.from_model_dir(str(copy))


def test_integer_tensor_is_refused_before_loading(tiny_llama_dir: Path, tmp_path: Path) -> None:
    copy = _copy(tiny_llama_dir, tmp_path / "m")
    weights = load_file(str(copy / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.int32)
    save_file(weights, str(copy / "model.safetensors"))
    with pytest.raises(ModelDirectoryError, match=r"'model\.norm\.weight' has dtype I32"):
        ModelConfig.from_model_dir(str(copy))


def test_an_integer_position_ids_buffer_is_skipped(tiny_llama_dir: Path,
                                                   tmp_path: Path) -> None:
    # BERT checkpoints (all-MiniLM-L6-v2) carry `embeddings.position_ids` as int64: a buffer
    # the model rebuilds, neither a weight nor a reason to refuse the checkpoint.
    from ringserve.checkpoint.safetensors_file import TensorReader, checkpoint_files

    copy = _copy(tiny_llama_dir, tmp_path / "m")
    weights = load_file(str(copy / "model.safetensors"))
    weights["model.embeddings.position_ids"] = torch.arange(8, dtype=torch.int64)[None]
    save_file(weights, str(copy / "model.safetensors"))
    ModelConfig.from_model_dir(str(copy))
    names = [name for name, _ in TensorReader(checkpoint_files(copy))]
    assert "model.embeddings.position_ids" not in names and len(names) == len(weights) - 1


def test_wrong_shape_names_file_and_tensor(tiny_llama_dir: Path, tmp_path: Path) -> None:
    copy = _copy(tiny_llama_dir, tmp_path / "m")
    weights = load_file(str(copy / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    weights[name] = weights[name][:1].contiguous()  # copy_ alone would broadcast this row
    save_file(weights, str(copy / "model.safetensors"))
    config = ModelConfig.from_model_dir(str(copy))
    with pytest.raises(ModelDirectoryError, match=rf"model.safetensors: tensor '{name}': "
                       r"shape \[1, 64\], expected \[64, 64\]"):
        load_model(config, tp=TPGroup(), device=torch.device("cpu"),
                   backend=TorchAttentionBackend())


def test_dummy_weights_need_no_weight_files(tiny_llama_dir: Path, tmp_path: Path) -> None:
    copy = _copy(tiny_llama_dir, tmp_path / "m")
    (copy / "model.safetensors").unlink()
    with pytest.raises(ModelDirectoryError, match=r"no \*\.safetensors"):
        ModelConfig.from_model_dir(str(copy))
    config = ModelConfig.from_model_dir(str(copy), load_format="dummy")
    assert config.load_format == "dummy"
    models = [load_model(config, tp=TPGroup(), device=torch.device("cpu"),
                         backend=TorchAttentionBackend()) for _ in range(2)]
    a, b = (torch.cat([p.detach().flatten() for p in m.parameters()]) for m in models)
    assert torch.equal(a, b) and 0 < a.abs().max() <= 1.0  # deterministic, small


def _hub_cache(src: Path, cache: Path, repo: str, commit: str) -> None:
    """Lay out `src` as the hub cache holds a snapshot of `repo` at `commit` (refs/main)."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copy(f, snap / f.name)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)


def test_hub_id_resolves_from_the_local_cache(tiny_llama_dir: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    commit = "0123456789abcdef0123456789abcdef01234567"
    _hub_cache(tiny_llama_dir, tmp_path / "hub", "acme/tiny-llama", commit)
    config = ModelConfig.from_model_dir("acme/tiny-llama", download_dir=str(tmp_path / "hub"))
    assert config.model.endswith(f"snapshots/{commit}")
    assert config.served_model_name == "acme/tiny-llama"
    by_commit = ModelConfig.from_model_dir("acme/tiny-llama", revision=commit,
                                           download_dir=str(tmp_path / "hub"))
    assert by_commit.model == config.model
    with pytest.raises(ModelDirectoryError, match=rf"acme/other: not a local path, and not in "
                       rf"the Hugging Face cache {tmp_path / 'hub'} \(revision main\); "
                       "HF_HUB_OFFLINE"):
        ModelConfig.from_model_dir("acme/other", download_dir=str(tmp_path / "hub"))


def test_generation_config_defaults(tiny_llama_dir: Path, tmp_path: Path) -> None:
    copy = _copy(tiny_llama_dir, tmp_path / "m")
    gen = json.loads((copy / "generation_config.json").read_text())
    gen.update(temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=64, eos_token_id=[1, 2, 3],
               do_sample=True)
    (copy / "generation_config.json").write_text(json.dumps(gen))
    config = ModelConfig.from_model_dir(str(copy))
    assert config.generation_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                          "max_tokens": 64}
    assert config.eos_token_ids == (1, 2, 3)
    params = default_sampling_params(config.generation_defaults)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, 20, 64)
    assert ModelConfig.from_model_dir(str(copy), generation_config="vllm").generation_defaults == {}
    over = ModelConfig.from_model_dir(str(copy), override_generation_config='{"temperature": 0.1}')
    assert over.generation_defaults["temperature"] == 0.1 and over.generation_defaults["top_k"] == 20
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1}))
    assert ModelConfig.from_model_dir(str(copy), generation_config=str(other)
                                      ).generation_defaults == {"repetition_penalty": 1.1}
    with pytest.raises(ValueError, match=r"unknown keys \['beam'\]"):
        ModelConfig.from_model_dir(str(copy), override_generation_config='{"beam": 2}')
    with pytest.raises(ModelDirectoryError, match=r"no generation_config\.json"):
        ModelConfig.from_model_dir(str(copy), generation_config=str(tmp_path))


def test_http_request_defaults_come_from_the_generation_config(tiny_llama_dir: Path,
                                                               tmp_path: Path) -> None:
    import msgspec

    from ringserve.http.protocol import ChatCompletionRequest
    from ringserve.http.sampling import build_params

    copy = _copy(tiny_llama_dir, tmp_path / "m")
    (copy / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 5}))
    config = ModelConfig.from_model_dir(str(copy))
    req = msgspec.convert({"model": "m", "messages": [], "top_k": 7}, ChatCompletionRequest)
    params = build_params(req, config, max_tokens=None, logprobs=None, prompt_logprobs=None)
    assert params.temperature == 0.3 and params.top_k == 7  # the request's own value wins


def test_dtype_auto_and_rope_stretched_length(tiny_llama_dir: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from ringserve.checkpoint import precision

    copy = _copy(tiny_llama_dir, tmp_path / "m")
    cfg = json.loads((copy / "config.json").read_text())
    cfg.update(dtype="bfloat16", max_position_embeddings=1024,
               rope_scaling={"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 512})
    (copy / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2"}))
    assert ModelConfig.from_model_dir(str(copy)).dtype == "float32"
    assert ModelConfig.from_model_dir(str(copy), device="cuda").dtype == "bfloat16"
    # With native bf16 too, until bf16 has panels (issue 48, item 4).
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert ModelConfig.from_model_dir(str(copy)).dtype == "float32"
    assert ModelConfig.from_model_dir(str(copy)).max_model_len == 2048  # 512 x 4 (yarn)
