"""Tiny-model factory: small random-weight Hugging Face model directories built locally.

No hub is reachable, so every test, benchmark and the default `ringserve serve` run on model
directories this module writes: config.json, model.safetensors, generation_config.json and a
byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json with a chat template) trained
with `tokenizers` on a corpus generated here from a seed. Models are built through
transformers' own classes, so a directory loads in `AutoModelForCausalLM` and serves as the
oracle for ringserve's model code.

Directories are cached under `$RINGSERVE_HOME/models` (default `~/.cache/ringserve`), keyed by
a hash of the spec; a build writes to a temporary sibling and renames it into place, so
concurrent builders never see a half-written directory. Used by tests (fixtures in
tests/conftest.py), `ringserve demo-model PATH`, and `EngineArgs` for the demo model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringserve.envs import ringserve_home

FACTORY_VERSION = 1

BOS, EOS, PAD, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """The shape of a tiny model; every field goes into the cache key.

    Attributes:
        arch: "llama", "mistral", "qwen2" (qkv bias), "qwen3" (q/k norm), "gemma2",
            "gemma3" (text), "phi3" (fused projections), or the mixtures of experts
            "qwen3_moe", "qwen2_moe" and "mixtral" (expert settings in `extra_config`).
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
        num_key_value_heads, head_dim (None: hidden_size // heads): the model's shape.
        vocab_size: the embedding rows (>= the tokenizer's vocabulary).
        max_position_embeddings: the longest sequence.
        tie_word_embeddings: share the embedding and LM head weights.
        initializer_range: weight init std; larger than HF's 0.02 so greedy argmaxes are
            well separated (token-exact comparisons need no near-ties).
        seed: torch seed for the weights and the corpus seed for the tokenizer.
        dtype: the dtype weights are stored in.
        rope_theta: the rope base.
        extra_config: JSON object of further config.json keys, merged over the fields above
            (e.g. '{"rope_scaling": {"rope_type": "linear", "factor": 2.0}}', a sliding
            window, soft-capping); JSON text so the spec stays hashable.
    """

    arch: str = "llama"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    vocab_size: int = 8000
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    initializer_range: float = 0.1
    seed: int = 0
    dtype: str = "float32"
    rope_theta: float = 10000.0
    extra_config: str = "{}"


DEMO_SPEC = TinyModelSpec(
    arch="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05,
)

PRESETS: dict[str, TinyModelSpec] = {
    "demo": DEMO_SPEC,
    "llama": TinyModelSpec(arch="llama"),
    "mistral": TinyModelSpec(arch="mistral"),
    "qwen2": TinyModelSpec(arch="qwen2", tie_word_embeddings=True),
    "qwen3": TinyModelSpec(arch="qwen3", head_dim=32),
    # mixtures of experts: 8 experts, top-2; a dense layer among the sparse ones for the Qwen
    # families (mlp_only_layers / decoder_sparse_step), a gated shared expert for Qwen2-MoE
    "qwen3moe": TinyModelSpec(arch="qwen3_moe", head_dim=32, num_hidden_layers=3, extra_config=(
        '{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, '
        '"norm_topk_prob": true, "mlp_only_layers": [1]}')),
    "qwen2moe": TinyModelSpec(arch="qwen2_moe", num_hidden_layers=3, extra_config=(
        '{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48, '
        '"shared_expert_intermediate_size": 96, "norm_topk_prob": false, '
        '"decoder_sparse_step": 2}')),
    "mixtral": TinyModelSpec(arch="mixtral", extra_config=(
        '{"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": null}')),
    # The three below cross their 8-token sliding windows within a test prompt. Gemma's head
    # size differs from hidden / heads and from query_pre_attn_scalar, and its soft-caps are
    # small enough to bend the scores and logits of these weights.
    "gemma2": TinyModelSpec(arch="gemma2", head_dim=32, extra_config=(
        '{"sliding_window": 8, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0, '
        '"final_logit_softcapping": 3.0}')),
    "gemma3": TinyModelSpec(arch="gemma3", head_dim=32, extra_config=(
        '{"sliding_window": 8, "query_pre_attn_scalar": 24, "final_logit_softcapping": 3.0, '
        '"layer_types": ["sliding_attention", "full_attention"], "rope_parameters": '
        '{"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, '
        '"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}}')),
    "phi3": TinyModelSpec(arch="phi3", extra_config='{"sliding_window": 8}'),
    # Phi-4-mini's shape: tied embeddings, 3/4 of each head rotated, longrope past position 64.
    "phi4mini": TinyModelSpec(
        arch="phi3", tie_word_embeddings=True, max_position_embeddings=256, extra_config=(
            '{"sliding_window": 8, "original_max_position_embeddings": 64, "rope_parameters": '
            '{"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75, '
            '"short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], '
            '"long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}}')),
}

# Families whose RMSNorm weights transformers initialises to a constant that the norm's own
# form cancels (Gemma: zeros, scaled by 1 + w): the factory draws them at random instead, so
# the tests see the norm weights matter.
_RANDOM_NORM_ARCHS = ("gemma2", "gemma3", "phi3")


def tiny_model(preset: str = "llama", **overrides: Any) -> Path:
    """The cached directory of a preset (with field overrides), built on first use.

    Args:
        preset: a key of PRESETS ("demo", "llama", "mistral", "qwen2", "qwen3", "gemma2",
            "gemma3", "phi3", "phi4mini", "qwen3moe", "qwen2moe", "mixtral").
        **overrides: TinyModelSpec fields to change (e.g. seed=1, num_hidden_layers=3).

    Raises:
        ValueError: an unknown preset or field.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny model preset {preset!r}; known: {', '.join(PRESETS)}")
    spec = dataclasses.replace(PRESETS[preset], **overrides)
    return cached_model(spec, name=preset)


def demo_model_path() -> Path:
    """The demo model's directory (Llama family, hidden 256, 4 layers, vocab 8000)."""
    return cached_model(DEMO_SPEC, name="demo")


def cached_model(spec: TinyModelSpec, name: str = "tiny") -> Path:
    """The cached directory for `spec`, built (atomically) when missing."""
    fields = dataclasses.asdict(spec)
    if fields["extra_config"] == "{}":
        del fields["extra_config"]  # keeps the keys of the directories built before it existed
    key = hashlib.sha256(json.dumps([FACTORY_VERSION, fields]).encode()).hexdigest()
    target = ringserve_home() / "models" / f"{name}-{spec.arch}-{key[:12]}"
    return build_cached(target, lambda tmp: build_model_dir(tmp, spec))


def build_cached(target: Path, build: Callable[[Path], object]) -> Path:
    """`target`, a model directory: built (when it holds no model.safetensors) by `build`
    into a temporary sibling renamed into place, so concurrent builders never see a
    half-written directory (the one that loses the race keeps the winner's)."""
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_model_dir(path: Path, spec: TinyModelSpec) -> Path:
    """Write a complete Hugging Face model directory for `spec` into `path`.

    Returns:
        `path`, holding config.json, model.safetensors, generation_config.json,
        tokenizer.json, tokenizer_config.json and special_tokens_map.json.
    """
    import torch
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(spec.seed, spec.vocab_size)
    tokenizer.save_pretrained(str(path))
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    hf_config = _hf_config(spec, bos=ids[BOS], eos=ids[EOS], pad=ids[PAD])
    model_cls = _model_class(spec.arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = model_cls(hf_config)
        if spec.arch in _RANDOM_NORM_ARCHS:
            _randomize_norms(model)
        model = model.to(getattr(torch, spec.dtype))
    model.eval()
    model.save_pretrained(str(path))
    GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=[ids[EOS], ids[IM_END]], pad_token_id=ids[PAD],
    ).save_pretrained(str(path))
    return path


def _randomize_norms(model: Any) -> None:
    """Draw every norm weight near its neutral value (under the caller's seeded RNG)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)


def _hf_config(spec: TinyModelSpec, *, bos: int, eos: int, pad: int) -> Any:
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    classes: dict[str, Any] = {
        "llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
        "qwen3_moe": Qwen3MoeConfig, "qwen2_moe": Qwen2MoeConfig, "mixtral": MixtralConfig,
        "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig, "phi3": Phi3Config,
    }
    kwargs: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.initializer_range,
        rope_theta=spec.rope_theta,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype=spec.dtype,
    )
    if spec.head_dim is not None:
        kwargs["head_dim"] = spec.head_dim
    if spec.arch == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(json.loads(spec.extra_config))
    return classes[spec.arch](**kwargs)


def _model_class(arch: str) -> Any:
    from transformers import (
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        LlamaForCausalLM,
        MistralForCausalLM,
        MixtralForCausalLM,
        Phi3ForCausalLM,
        Qwen2ForCausalLM,
        Qwen2MoeForCausalLM,
        Qwen3ForCausalLM,
        Qwen3MoeForCausalLM,
    )

    classes: dict[str, Any] = {
        "llama": LlamaForCausalLM, "mistral": MistralForCausalLM,
        "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
        "qwen3_moe": Qwen3MoeForCausalLM, "qwen2_moe": Qwen2MoeForCausalLM,
        "mixtral": MixtralForCausalLM,
        "gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM, "phi3": Phi3ForCausalLM,
    }
    if arch not in classes:
        raise ValueError(f"unknown tiny model arch {arch!r}; known: {', '.join(classes)}")
    return classes[arch]


# -- tokenizer ------------------------------------------------------------------------------


def _build_tokenizer(seed: int, vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on `corpus(seed)`, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )


_SEED_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "A naïve café owner served crème brûlée and a piña colada — déjà vu!",
    "Größere Äpfel schmecken süß; Ölfässer sind schwer.",
    "¿Dónde está la estación? Él comió paella con años de experiencia.",
    "Ça coûte cher, mais c'est très élégant à Noël.",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "こんにちは、元気ですか？東京は大きな都市です。",
    "안녕하세요, 만나서 반갑습니다.",
    "Привет, как дела? Это простой пример текста.",
    "Emoji: 👋 😀 🎉 🚀 ❤️ 👍🏽 🇫🇷 — and ‘quotes’ “too” … done.",
    "def main(argv: list[str]) -> int:\n    return 0\n",
    "for i in range(10):\n    total += i * 2  # accumulate\n",
    "SELECT name, count(*) FROM users WHERE age >= 21 GROUP BY name;",
    '{"role": "user", "content": "Hello!", "tokens": [1, 2, 3]}',
)

_SYLLABLES = ["ka", "ri", "to", "na", "me", "so", "lu", "ve", "an", "ter", "ing", "ed", "es", "ion", "al", "or", "en", "th", "re", "st", "ch", "sh", "qu", "pro", "con", "tion", "ment", "able", "ness", "over", "under", "inter", "trans", "str", "pl", "gr", "bl", "cl", "dr", "fl"]


def corpus(seed: int, num_lines: int = 12000) -> list[str]:
    """Training text generated deterministically from `seed`: English-like words, code,
    numbers, accented Latin, CJK, Hangul, Cyrillic and emoji (all written by this module)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 600)]
    emoji = [chr(c) for c in range(0x1F600, 0x1F650)]
    accented = list("àáâäãåçèéêëìíîïñòóôöõùúûüýÿßæœøÀÉÎÖÜÇ")
    lines = list(_SEED_TEXTS) * 20
    for _ in range(num_lines):
        kind = rng.random()
        if kind < 0.6:
            line = " ".join(rng.choice(words) for _ in range(rng.randint(4, 16)))
            line = line.capitalize() + rng.choice(".!?,;:")
        elif kind < 0.7:
            line = "".join(rng.choice(cjk) for _ in range(rng.randint(4, 20))) + "。"
        elif kind < 0.8:
            line = " ".join(rng.choice(words) + rng.choice(accented) for _ in range(rng.randint(2, 8)))
        elif kind < 0.9:
            name = rng.choice(words)
            line = f"def {name}(x_{rng.randint(0, 99)}):\n    return x * {rng.randint(0, 9999)}\n"
        else:
            line = " ".join(rng.choice(emoji) + rng.choice(words) for _ in range(rng.randint(1, 6)))
        lines.append(line)
    return lines
