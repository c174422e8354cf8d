"""GGUF checkpoints: metadata -> config.json, the tokenizer, weights (F32 exact, quantized
within the format's error) and end to end through `ringserve.LLM`.

The GGUF files are written once per session by the test-side exporter (`gguf_export`) from the
tiny models' safetensors directories, which are the oracle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf_export import export_gguf, llama3_rope_factors
from safetensors.torch import load_file

from ringserve.checkpoint import gguf_config, gguf_weights
from ringserve.checkpoint.gguf_file import (
    gguf_hf_config,
    is_gguf,
    iterate_gguf_weights,
    materialize,
)
from ringserve.checkpoint.gguf_header import TensorInfo, read_header
from ringserve.errors import ModelDirectoryError
from ringserve.gpu.testing import tiny_model

Q = gguf.GGMLQuantizationType
FAMILIES = ("llama", "qwen2", "qwen3")
CONFIG_FIELDS = (
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "pad_token_id", "dtype",
)
TEXTS = (
    "Hello world, this is a test.",
    "Größere Äpfel schmecken süß — naïve café, déjà vu!",
    "你好，世界！こんにちは、안녕하세요, Привет 👋 🇫🇷",  # noqa: RUF001
    "  two leading spaces\n\ttab and newline\n\n",
    "<|im_start|>user\nhi<|im_end|> and <|endoftext|> as text",
    "def f(x):\n    return x * 42  # ok",
)


@pytest.fixture(scope="session")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """F32 files of each family and Q8_0 llama and qwen2 files, written once."""
    out = tmp_path_factory.mktemp("gguf")
    for family in FAMILIES:
        export_gguf(tiny_model(family), out / f"{family}.gguf")
    export_gguf(tiny_model("llama"), out / "llama-q8_0.gguf", qtype=Q.Q8_0)
    export_gguf(tiny_model("qwen2"), out / "qwen2-q8_0.gguf", qtype=Q.Q8_0)
    return out


def _source_config(family: str) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((tiny_model(family) / "config.json").read_text())
    return config


# -- config ---------------------------------------------------------------------------------


def test_is_gguf(gguf_dir: Path, tmp_path: Path) -> None:
    assert is_gguf(gguf_dir / "llama.gguf")
    assert not is_gguf(tiny_model("llama") / "model.safetensors")
    assert not is_gguf(tmp_path / "missing.gguf")
    assert not is_gguf(tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trip(family: str, gguf_dir: Path) -> None:
    source = _source_config(family)
    config = gguf_hf_config(gguf_dir / f"{family}.gguf")
    assert {k: config[k] for k in CONFIG_FIELDS} == {k: source[k] for k in CONFIG_FIELDS}
    heads = source["num_attention_heads"]
    assert config["head_dim"] == (source.get("head_dim") or source["hidden_size"] // heads)
    assert config["rope_theta"] == source["rope_parameters"]["rope_theta"]
    assert "rope_scaling" not in config
    assert config["attention_bias"] is (family == "qwen2")


@pytest.mark.slow
def test_materialized_config_reads_through_autoconfig(gguf_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    materialize(gguf_dir / "qwen2.gguf", tmp_path / "m", with_tokenizer=False)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "config.json", "generation_config.json"]
    got = AutoConfig.from_pretrained(str(tmp_path / "m")).to_dict()
    want = AutoConfig.from_pretrained(str(tiny_model("qwen2"))).to_dict()
    for key in (*CONFIG_FIELDS, "rope_parameters"):
        assert got[key] == want[key], key
    generation = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    source = json.loads((tiny_model("qwen2") / "generation_config.json").read_text())
    assert generation == {k: source[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


@pytest.mark.slow  # transformers' rope module is the oracle; importing it takes the time
@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
     "original_max_position_embeddings": 2048, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
])
def test_llama3_rope_recovered_from_rope_freqs(rope: dict[str, Any]) -> None:
    """Llama 3's rope scaling travels as the rope_freqs divisors; the recovered parameters give
    the same inverse frequencies (head dims 16 and 128: the tiny model's and Llama 3's)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def inv_freq(params: dict[str, Any], head_dim: int) -> torch.Tensor:
        config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4,
                             max_position_embeddings=131072, rope_parameters=params)
        return ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0]

    head_dim = 16 if rope["rope_theta"] == 10000.0 else 128
    factors = llama3_rope_factors({"head_dim": head_dim}, rope)
    params = gguf_config.llama3_rope(Path("x.gguf"), factors, rope["rope_theta"], head_dim)
    assert params is not None and params["factor"] == rope["factor"]
    got = inv_freq({**params, "rope_theta": rope["rope_theta"]}, head_dim)
    torch.testing.assert_close(got, inv_freq(rope, head_dim), rtol=1e-6, atol=0)
    unscaled = np.ones(head_dim // 2, dtype=np.float32)
    assert gguf_config.llama3_rope(Path("x.gguf"), unscaled, 10000.0, head_dim) is None


def test_rope_scaling_keys(tmp_path: Path) -> None:
    path = tmp_path / "linear.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(2.0)
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = read_header(path).metadata
    assert gguf_config.rope_scaling(path, meta, "llama") == {"rope_type": "linear", "factor": 2.0}


# -- tokenizer ------------------------------------------------------------------------------


@pytest.mark.slow
def test_materialized_tokenizer_matches_source(gguf_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    materialize(gguf_dir / "llama.gguf", tmp_path / "m")
    got = AutoTokenizer.from_pretrained(str(tmp_path / "m"), local_files_only=True)
    want = AutoTokenizer.from_pretrained(str(tiny_model("llama")), local_files_only=True)
    for text in TEXTS:
        ids = want(text).input_ids
        assert got(text).input_ids == ids, text
        assert got.decode(ids) == want.decode(ids)
        assert got.decode(ids, skip_special_tokens=True) == want.decode(ids, skip_special_tokens=True)
        assert max(got(text).input_ids) < 8000  # no token past the embedding
    assert (got.bos_token, got.eos_token, got.pad_token) == (want.bos_token, want.eos_token,
                                                             want.pad_token)
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == want.chat_template == got.chat_template
    chat = [{"role": "user", "content": "Ça va? 你好"}]
    assert got.apply_chat_template(chat, add_generation_prompt=True) == want.apply_chat_template(
        chat, add_generation_prompt=True)


@pytest.mark.slow
def test_materialize_replaces_an_incomplete_directory(gguf_dir: Path, tmp_path: Path) -> None:
    """A directory written without the tokenizer is replaced when one with it is asked for."""
    out = tmp_path / "m"
    materialize(gguf_dir / "qwen3.gguf", out, with_tokenizer=False)
    materialize(gguf_dir / "qwen3.gguf", out)
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary left behind


# -- weights --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_weights_equal_safetensors(family: str, gguf_dir: Path) -> None:
    """Exact: llama's q/k un-permutation, qwen2's biases and tied embeddings, qwen3's q/k norms."""
    want = load_file(str(tiny_model(family) / "model.safetensors"))
    path = gguf_dir / f"{family}.gguf"
    got = dict(iterate_gguf_weights(path, gguf_hf_config(path)))
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], tensor), name


def test_q8_0_weights_within_half_a_step(gguf_dir: Path) -> None:
    """Q8_0 stores blocks of 32 as int8 times an f16 scale d = absmax / 127: each weight is off
    by at most d / 2 (plus d's own f16 rounding, 2^-11 relative, times 127)."""
    want = load_file(str(tiny_model("llama") / "model.safetensors"))
    path = gguf_dir / "llama-q8_0.gguf"
    for name, tensor in iterate_gguf_weights(path, gguf_hf_config(path)):
        source = want[name]
        if source.ndim == 1:
            assert torch.equal(tensor, source), name  # norms stay F32
            continue
        absmax = source.reshape(-1, 32).abs().amax(dim=1, keepdim=True)
        bound = absmax * (0.5 / 127 + 2.0**-11) + 1e-7
        error = (tensor - source).reshape(-1, 32).abs()
        assert bool((error <= bound).all()), name
        assert not torch.equal(tensor, source), name


def _write_single(path: Path, qtype: gguf.GGMLQuantizationType, raw: np.ndarray) -> TensorInfo:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("t.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_header(path).tensors[0]


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_block_quant_dequantize_matches_transformers(qtype: gguf.GGMLQuantizationType,
                                                     tmp_path: Path) -> None:
    """gguf-py cannot quantize K-quants, so random blocks (with finite f16 scales) are read
    and compared with transformers' own torch dequantizer, written apart from gguf-py's."""
    from transformers.integrations.gguf.dequant import dequantize

    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 3, 2 * 256
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)
    scale_at = {Q.Q6_K: (208,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q4_0: (0,), Q.Q4_1: (0, 2)}
    for start in scale_at[qtype]:
        scales = rng.uniform(0.001, 0.05, size=(rows, cols // block)).astype(np.float16)
        raw[:, :, start:start + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    raw = raw.reshape(rows, -1)
    tensor = _write_single(tmp_path / "t.gguf", qtype, raw)
    with (tmp_path / "t.gguf").open("rb") as handle:
        got = gguf_weights.read_tensor(tmp_path / "t.gguf", handle, tensor)
    want = dequantize(torch.from_numpy(raw.copy()).reshape(-1), int(qtype)).reshape(rows, cols)
    assert got.shape == (rows, cols) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_supported_types_cover_the_common_ones() -> None:
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"):
        assert name in gguf_weights.supported_types()


# -- errors ---------------------------------------------------------------------------------


def test_not_gguf_and_truncated(gguf_dir: Path, tmp_path: Path) -> None:
    text = tmp_path / "model.gguf"
    text.write_text("not a model")
    with pytest.raises(ModelDirectoryError, match=r"model\.gguf is not a GGUF file"):
        gguf_hf_config(text)
    with pytest.raises(ModelDirectoryError, match="does not exist"):
        gguf_hf_config(tmp_path / "missing.gguf")
    data = (gguf_dir / "llama.gguf").read_bytes()
    for cut in (len(data) - 1000, 2000, 10):
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ModelDirectoryError, match=rf"short{cut}\.gguf is truncated"):
            gguf_hf_config(short)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelDirectoryError,
                       match=r"gpt2\.gguf: architecture 'gpt2' is not supported; supported: "
                             r"llama, qwen2, qwen3"):
        gguf_hf_config(path)


def test_unsupported_type_and_missing_tensor(tmp_path: Path) -> None:
    model = tiny_model("llama")
    bad = export_gguf(model, tmp_path / "i8.gguf",
                      replace={"blk.0.ffn_down.weight": np.zeros((64, 128), dtype=np.int8)})
    with pytest.raises(ModelDirectoryError,
                       match=r"'blk\.0\.ffn_down\.weight' has quantization type I8, not "
                             r"supported; supported: F32, F16, .*Q8_0.*Q6_K"):
        gguf_hf_config(bad)
    missing = export_gguf(model, tmp_path / "missing.gguf", drop=frozenset({"blk.1.ffn_up.weight"}))
    with pytest.raises(ModelDirectoryError, match=r"missing tensor 'blk\.1\.ffn_up\.weight'$"):
        gguf_hf_config(missing)
    with pytest.raises(ModelDirectoryError, match=r"missing tensor 'blk\.1\.ffn_up\.weight'$"):
        next(iter(iterate_gguf_weights(missing, _source_config("llama"))))


# -- end to end -----------------------------------------------------------------------------

E2E_PROMPTS = ["Hello there", "naïve café — 你好 👋 and more", "x"]
E2E_ENGINE = {"device": "cpu", "kv_cache_memory": 16 << 20, "max_num_seqs": 4,
              "max_num_batched_tokens": 64}
E2E_NEW_TOKENS = 10


def _hf_reference(family: str) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """transformers on the safetensors model: each prompt's ids, its greedy continuation, and
    the logprob of every token of prompt + continuation after the first (teacher-forced)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = str(tiny_model(family))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts, continuations, logprobs = [], [], []
    for text in E2E_PROMPTS:
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            full = model.generate(ids, max_new_tokens=E2E_NEW_TOKENS, do_sample=False,
                                  eos_token_id=None)
            scores = torch.log_softmax(model(full).logits[0, :-1].float(), dim=-1)
        prompts.append(ids[0].tolist())
        continuations.append(full[0, ids.shape[1]:].tolist())
        logprobs.append(scores.gather(1, full[0, 1:, None])[:, 0].tolist())
    return prompts, continuations, logprobs


def _llm(model: str) -> Any:
    from ringserve.engine.frontend.llm import LLM

    return LLM(model, **E2E_ENGINE)


@pytest.mark.slow
def test_llm_f32_gguf_greedy_equals_transformers(gguf_dir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`LLM(model=file.gguf)` (materialized config and tokenizer, GGUF weights with llama's
    q/k order undone) generates token for token what transformers does on the source model."""
    from ringserve import SamplingParams

    prompts, want, _ = _hf_reference("llama")
    monkeypatch.setenv("RINGSERVE_HOME", str(tmp_path / "home"))  # the materialized directory
    params = SamplingParams(temperature=0.0, max_tokens=E2E_NEW_TOKENS, ignore_eos=True)
    with _llm(str(gguf_dir / "llama.gguf")) as llm:
        got = llm.generate(E2E_PROMPTS, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in got] == prompts  # the GGUF's tokenizer, BOS included
    assert [o.outputs[0].token_ids for o in got] == want


@pytest.mark.slow
def test_llm_q8_0_gguf_logprobs_near_transformers(gguf_dir: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Teacher-forced: a Q8_0 qwen2 (biases, tied embeddings) scores the float32 model's greedy
    sequences. Q8_0 moves each weight by at most half a step (absmax / 254 of its block of 32);
    through this 2-layer model that moves a token's logprob by about a hundredth of a nat, so
    the bound is 0.1 nats at most and 0.03 on average: well above the quantization noise, far
    below what a wrong scale, bias or tie opens (whole nats)."""
    from ringserve import SamplingParams

    prompts, continuations, want = _hf_reference("qwen2")
    monkeypatch.setenv("RINGSERVE_HOME", str(tmp_path / "home"))
    sequences = [p + c for p, c in zip(prompts, continuations, strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    with _llm(str(gguf_dir / "qwen2-q8_0.gguf")) as llm:
        scored = llm.generate([{"prompt_token_ids": s} for s in sequences], params,
                              use_tqdm=False)
    got = [[p[t].logprob for p, t in zip(o.prompt_logprobs[1:], s[1:], strict=True)]
           for o, s in zip(scored, sequences, strict=True)]
    diffs = [abs(a - b) for ws, gs in zip(want, got, strict=True)
             for a, b in zip(ws, gs, strict=True)]
    worst, mean = max(diffs), sum(diffs) / len(diffs)
    print(f"Q8_0 logprob error: max {worst:.4f}, mean {mean:.4f} nats")
    assert worst < 0.1 and mean < 0.03, (worst, mean)
