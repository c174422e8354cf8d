"""Tiny vision-language model directories for tests and benchmarks (no hub at run time).

`tiny_vlm(family)` writes (once, cached under `$RINGSERVE_HOME/models` like
`ringserve.gpu.testing`'s text models) a random-weight Qwen2-VL, Qwen2.5-VL, Gemma 3 or
Idefics3 built with transformers' own classes, vision tower included: config.json,
model.safetensors, the byte-level BPE tokenizer of the text models plus the family's image
tokens, a chat template that writes the family's placeholder for `{"type": "image"}` parts, and
`preprocessor_config.json` of the family's image processor at sizes small enough for tests.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ringserve.envs import ringserve_home
from ringserve.gpu.testing import BOS, EOS, IM_END, PAD, _build_tokenizer, build_cached

VERSION = 1
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "gemma3", "idefics3")

_TOKENS: dict[str, list[str]] = {
    "qwen2_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    "gemma3": ["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
    "idefics3": ["<fake_token_around_image>", "<image>", "<global-img>",
                 *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))],
}
_TOKENS["qwen2_5_vl"] = _TOKENS["qwen2_vl"]
_PLACEHOLDER = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
                "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
                "gemma3": "<start_of_image>", "idefics3": "<image>"}


def chat_template(placeholder: str) -> str:
    """The tiny models' chat template, writing `placeholder` for an image part."""
    return (
        "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
        + placeholder +
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% endif %}")


def tiny_vlm(family: str, seed: int = 0) -> Path:
    """The cached directory of a tiny `family` model, built on first use.

    Raises:
        ValueError: an unknown family.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny VLM family {family!r}; known: {', '.join(FAMILIES)}")
    key = hashlib.sha256(json.dumps([VERSION, family, seed]).encode()).hexdigest()[:12]
    target = ringserve_home() / "models" / f"tinyvlm-{family}-{key}"
    return build_cached(target, lambda tmp: _build(tmp, family, seed))


def _build(path: Path, family: str, seed: int) -> None:
    import torch
    from transformers import GenerationConfig

    tokenizer = _build_tokenizer(seed, 4000)
    tokenizer.add_tokens(_TOKENS[family], special_tokens=True)
    tokenizer.chat_template = chat_template(_PLACEHOLDER[family])
    tokenizer.save_pretrained(str(path))
    ids = {t: int(tokenizer.convert_tokens_to_ids(t))
           for t in [BOS, EOS, PAD, IM_END, *_TOKENS[family]]}
    vocab = (len(tokenizer) + 63) // 64 * 64
    config, model_cls, processor = _family(family, ids, vocab)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        with torch.no_grad():  # larger weights: well-separated greedy argmaxes
            for name, param in model.named_parameters():
                if "norm" in name and family == "gemma3":
                    param.add_(torch.randn_like(param) * 0.2)
                elif param.dim() > 1:
                    param.normal_(0.0, 0.08)
    model.eval().save_pretrained(str(path))
    processor.save_pretrained(str(path))
    GenerationConfig(bos_token_id=ids[BOS], eos_token_id=[ids[EOS], ids[IM_END]],
                     pad_token_id=ids[PAD]).save_pretrained(str(path))


def _text(vocab: int, ids: dict[str, int], **extra: Any) -> dict[str, Any]:
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD], **extra)


def _family(family: str, ids: dict[str, int], vocab: int) -> tuple[Any, Any, Any]:
    if family in ("qwen2_vl", "qwen2_5_vl"):
        return _qwen(family, ids, vocab)
    if family == "gemma3":
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration
        from transformers.models.gemma3.image_processing_pil_gemma3 import (
            Gemma3ImageProcessorPil,
        )

        text = _text(vocab, ids, head_dim=16, sliding_window=64, query_pre_attn_scalar=16,
                     layer_types=["sliding_attention", "full_attention"])
        vision: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, image_size=28, patch_size=7,
                      vision_use_head=False)
        config: Any = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                              image_token_index=ids["<image_soft_token>"],
                              boi_token_index=ids["<start_of_image>"],
                              eoi_token_index=ids["<end_of_image>"])
        processor: Any = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
        return config, Gemma3ForConditionalGeneration, processor
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8)
    config = Idefics3Config(text_config=dict(_text(vocab, ids), model_type="llama"),
                            vision_config=vision, scale_factor=2,
                            image_token_id=ids["<image>"])
    processor = Idefics3ImageProcessorPil(size={"longest_edge": 64},
                                          max_image_size={"longest_edge": 32})
    return config, Idefics3ForConditionalGeneration, processor


def _qwen(family: str, ids: dict[str, int], vocab: int) -> tuple[Any, Any, Any]:
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    text = _text(vocab, ids, rope_parameters=rope)
    tokens: dict[str, Any] = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"],
                  vision_end_token_id=ids["<|vision_end|>"])
    vision: dict[str, Any]
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
        config: Any = Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
        cls: Any = Qwen2VLForConditionalGeneration
    else:
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                      num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                      window_size=56, fullatt_block_indexes=[1])
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
        cls = Qwen2_5_VLForConditionalGeneration
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=224 * 224,
                                         patch_size=14, merge_size=2, temporal_patch_size=2)
    return config, cls, processor
