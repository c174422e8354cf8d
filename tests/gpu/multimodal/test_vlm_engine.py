"""Images through the engine, end to end with the offline `LLM`, on the tiny random models of
the four families (`ringserve.gpu.multimodal.testing.tiny_vlm`): greedy tokens and logprobs
equal to transformers' `generate`, images split over steps by chunked prefill (never for Gemma
3, whose too-long images are refused), prefix-cache hits keyed by the image, one encode per
image through the encoder cache, and bad image inputs refused with the engine still serving.

The engine core runs in this process (RINGSERVE_ENABLE_MULTIPROCESSING=0) so that the worker's
encoder can be counted. TP = 2 is in conftest's LONG list.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from ringserve import LLM, SamplingParams
from ringserve.gpu.multimodal.runner_seam import ImageSeam
from ringserve.gpu.multimodal.testing import FAMILIES, tiny_vlm

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=5)
LOGPROB_TOL = 2e-3
SMALL: dict[str, Any] = dict(limit_mm_per_prompt={"image": 3}, max_model_len=1024,
                             kv_cache_memory=64 << 20)


def image(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


ONE = [image(60, 80, 0)]
THREE = [image(60, 80, 1), image(40, 30, 2), image(112, 140, 3)]


def chat(llm: LLM, n: int, text: str = "what is this?") -> str:
    parts: list[dict[str, str]] = [{"type": "image"}] * n
    content = [*parts, {"type": "text", "text": text}]
    return str(llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True))


@pytest.fixture(scope="module", autouse=True)
def in_process() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RINGSERVE_ENABLE_MULTIPROCESSING", "0")
        yield


@pytest.fixture(scope="module")
def llms(in_process: None) -> Iterator[dict[str, LLM]]:
    """One engine per family, built on first use and shut down with the module."""
    made: dict[str, LLM] = {}
    yield made
    for llm in made.values():
        llm.close()


def engine(llms: dict[str, LLM], family: str) -> LLM:
    if family not in llms:
        llms[family] = LLM(model=str(tiny_vlm(family)), **SMALL)
    return llms[family]


def _hf_generate(llm: LLM, family: str, text: str,
                 images: list[Image.Image]) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and each step's log-softmax of the raw logits."""
    from transformers import AutoModelForImageTextToText

    renderer = llm.llm_engine.input_processor.renderer
    assert renderer is not None
    path = str(tiny_vlm(family))
    procs = [renderer.process(i) for i in images]
    ids, _ = renderer.render_text(text, procs, add_special_tokens=True)
    kw: dict[str, Any] = {}
    if family.startswith("qwen"):
        kw["pixel_values"] = torch.from_numpy(np.concatenate([p.data["pixel_values"]
                                                              for p in procs]))
        kw["image_grid_thw"] = torch.from_numpy(np.concatenate([p.data["image_grid_thw"]
                                                                for p in procs]))
        kw["mm_token_type_ids"] = (torch.tensor(ids) == renderer.embed_token_id).int()[None]
    elif family == "gemma3":
        kw["pixel_values"] = torch.from_numpy(np.concatenate([p.data["pixel_values"]
                                                              for p in procs]))
        kw["token_type_ids"] = (torch.tensor(ids) == renderer.embed_token_id).long()[None]
    else:
        from transformers import Idefics3Processor
        from transformers.models.idefics3.image_processing_pil_idefics3 import (
            Idefics3ImageProcessorPil,
        )

        proc = Idefics3Processor(image_processor=Idefics3ImageProcessorPil.from_pretrained(path),
                                 tokenizer=llm.get_tokenizer(), image_seq_len=4)
        enc = proc(text=[text], images=[images], return_tensors="pt", add_special_tokens=True)
        assert enc["input_ids"][0].tolist() == ids  # our expansion is the processor's
        kw["pixel_values"] = enc["pixel_values"]
        kw["pixel_attention_mask"] = enc["pixel_attention_mask"]
    hf = AutoModelForImageTextToText.from_pretrained(path).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                          dtype=torch.long), max_new_tokens=MAX_TOKENS, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, **kw)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1) for s in out.logits]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logprobs_equal_transformers(llms: dict[str, LLM],
                                                       family: str) -> None:
    llm = engine(llms, family)
    prompts = [(chat(llm, 1), ONE), (chat(llm, 3, "compare them"), THREE)]
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in prompts],
                        GREEDY, use_tqdm=False)
    for (text, ims), out in zip(prompts, outs, strict=True):
        tokens, logprobs = _hf_generate(llm, family, text, ims)
        got = out.outputs[0]
        assert list(got.token_ids) == tokens
        assert got.logprobs is not None and len(got.logprobs) == len(tokens)
        for position, ref in zip(got.logprobs, logprobs, strict=False):
            for token, lp in position.items():
                assert abs(lp.logprob - float(ref[token])) <= LOGPROB_TOL, (family, token)
            # The top candidates are transformers' (ranks agree with its order).
            best = max(position.items(), key=lambda kv: kv[1].logprob)[0]
            assert abs(float(ref[best]) - float(ref.max())) <= LOGPROB_TOL


def _tokens(llm: LLM, text: str, images: list[Image.Image]) -> list[int]:
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}},
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
    assert out[0].outputs[0].finish_reason != "error", out[0].outputs[0].stop_reason
    return list(out[0].outputs[0].token_ids)


@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3"])
def test_an_image_split_by_chunked_prefill_gives_the_same_tokens(llms: dict[str, LLM],
                                                                 family: str) -> None:
    whole = engine(llms, family)
    text, images = chat(whole, 1, "a long question about the picture"), [image(112, 140, 3)]
    renderer = whole.llm_engine.input_processor.renderer
    assert renderer is not None
    _, features = renderer.render_text(text, [renderer.process(images[0])],
                                       add_special_tokens=True)
    budget = 16
    assert features[0].length > budget  # the image cannot be computed in one step
    want = _tokens(whole, text, images)
    with LLM(model=str(tiny_vlm(family)), max_num_batched_tokens=budget, max_num_seqs=4,
             enable_prefix_caching=False, **SMALL) as chunked:
        sched = chunked.llm_engine.config.scheduler_config
        assert sched.enable_chunked_prefill and sched.max_num_batched_tokens == budget
        assert _tokens(chunked, text, images) == want


def test_gemma3_images_are_never_split_and_too_long_ones_are_refused(
        llms: dict[str, LLM]) -> None:
    whole = engine(llms, "gemma3")
    text = chat(whole, 2, "tell")
    images = [image(60, 80, 5), image(30, 40, 6)]
    want = _tokens(whole, text, images)
    renderer = whole.llm_engine.input_processor.renderer
    assert renderer is not None
    _, features = renderer.render_text(text, [renderer.process(i) for i in images],
                                       add_special_tokens=True)
    span, first = features[0].length, features[0]
    budget = span + 1
    # Chunks of `budget` tokens from the start would end inside the first image.
    assert any(first.offset < k * budget < first.end for k in range(1, first.end))
    with LLM(model=str(tiny_vlm("gemma3")), max_num_batched_tokens=budget, max_num_seqs=2,
             enable_prefix_caching=False, **SMALL) as unsplit:
        assert _tokens(unsplit, text, images) == want
    with LLM(model=str(tiny_vlm("gemma3")), max_num_batched_tokens=span - 1, max_num_seqs=2,
             **SMALL) as small:
        # Refused by the frontend before it reaches the core (a 400 over HTTP).
        with pytest.raises(ValueError, match=rf"image 0 spans {span} tokens, more than "
                                             rf"max_num_batched_tokens \({span - 1}\)"):
            small.generate({"prompt": text, "multi_modal_data": {"image": images}},
                           SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert small.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)[0] \
            .outputs[0].finish_reason == "length"


def test_prefix_cache_hits_follow_the_image(llms: dict[str, LLM]) -> None:
    llm = engine(llms, "qwen2_vl")
    before = "describe every detail of this picture for me please " * 3
    text = chat(llm, 1, "and then say what colour dominates it, in one long sentence " * 3)
    text = before + text
    first, other = image(112, 140, 7), image(112, 140, 8)
    renderer = llm.llm_engine.input_processor.renderer
    assert renderer is not None
    ids, features = renderer.render_text(text, [renderer.process(first)], add_special_tokens=True)
    feature = features[0]
    block = llm.llm_engine.config.cache_config.block_size
    assert feature.offset >= block and len(ids) - feature.end > 2 * block

    def run(im: Image.Image) -> tuple[list[int], int]:
        out = llm.generate({"prompt": text, "multi_modal_data": {"image": [im]}},
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
        return list(out[0].outputs[0].token_ids), out[0].num_cached_tokens

    tokens, _ = run(first)
    again, cached = run(first)
    assert again == tokens
    assert cached >= feature.end  # the image's blocks came from the cache
    changed, cached = run(other)
    assert cached <= feature.offset // block * block  # nothing past the image's first block
    assert changed != tokens


def test_a_repeated_image_is_encoded_once(llms: dict[str, LLM],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    llm = engine(llms, "idefics3")
    encoded: list[str] = []
    real = ImageSeam._encode

    def counting(self: ImageSeam, feature: Any) -> torch.Tensor:
        encoded.append(feature.identifier)
        return real(self, feature)

    monkeypatch.setattr(ImageSeam, "_encode", counting)
    shared, fresh = image(50, 70, 11), image(50, 70, 12)
    # Different text before the image: no prefix-cache hit, the encoder cache serves it.
    _tokens(llm, chat(llm, 1, "first"), [shared])
    _tokens(llm, "a different opening. " + chat(llm, 1, "second"), [shared])
    _tokens(llm, chat(llm, 2, "both"), [shared, shared])
    assert len(encoded) == 1
    _tokens(llm, chat(llm, 2, "new one"), [fresh, shared])
    assert len(encoded) == 2 and encoded[0] != encoded[1]


BAD = {
    "not an image": ({"image": [42]}, 1, "expected a PIL image or an image URL, got int"),
    "too many": ({"image": [ONE[0]] * 4}, 4, "4 images in one prompt; at most 3 allowed"),
    "placeholders": ({"image": ONE}, 2, "holds 2 image placeholders"),
    "unknown modality": ({"video": ONE}, 1, "modality 'video' is not supported"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_image_inputs_are_refused_and_the_engine_serves_on(llms: dict[str, LLM],
                                                              case: str) -> None:
    llm = engine(llms, "qwen2_vl")
    data, placeholders, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        llm.generate({"prompt": chat(llm, placeholders), "multi_modal_data": data},
                     SamplingParams(max_tokens=2), use_tqdm=False)
    assert _tokens(llm, chat(llm, 1), ONE)


def test_images_to_a_text_only_model_are_refused() -> None:
    from ringserve.gpu.testing import tiny_model

    with LLM(model=str(tiny_model("llama")), max_model_len=256,
             kv_cache_memory=16 << 20) as llm:
        with pytest.raises(ValueError, match="takes text only"):
            llm.generate({"prompt": "look: <image>", "multi_modal_data": {"image": ONE}},
                         SamplingParams(max_tokens=2), use_tqdm=False)
        assert llm.generate("hello", SamplingParams(max_tokens=2),
                            use_tqdm=False)[0].outputs[0].token_ids


def test_tensor_parallel_2_equals_tp_1(llms: dict[str, LLM]) -> None:
    one = engine(llms, "qwen2_vl")
    text = chat(one, 3, "compare them")
    want = _tokens(one, text, THREE)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RINGSERVE_ENABLE_MULTIPROCESSING", "1")
        with LLM(model=str(tiny_vlm("qwen2_vl")), tensor_parallel_size=2,
                 distributed_executor_backend="mp", **SMALL) as two:
            assert _tokens(two, text, THREE) == want


def test_gemma3_prefix_hit_ending_inside_an_image(llms: dict[str, LLM]) -> None:
    """A hit whose last block ends inside an image: the rest of the (unsplit-attention)
    image is computed against the cached part and gives the uncached logprobs."""
    llm = engine(llms, "gemma3")
    renderer = llm.llm_engine.input_processor.renderer
    assert renderer is not None
    block = llm.llm_engine.config.cache_config.block_size
    questions = ("tell me more about it " * 4, "what colour is it? " * 4)
    for pad in range(block):
        texts = ["x " * pad + chat(llm, 1, q) for q in questions]
        _, features = renderer.render_text(texts[0], [renderer.process(ONE[0])],
                                           add_special_tokens=True)
        if features[0].offset // block != (features[0].end - 1) // block:
            break
    feature = features[0]
    boundary = feature.end // block * block
    assert feature.offset < boundary < feature.end
    prompts = [{"prompt": t, "multi_modal_data": {"image": ONE}} for t in texts]
    outs = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert outs[1].num_cached_tokens == boundary
    with LLM(model=str(tiny_vlm("gemma3")), enable_prefix_caching=False, **SMALL) as fresh:
        refs = fresh.generate(prompts, GREEDY, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert list(out.outputs[0].token_ids) == list(ref.outputs[0].token_ids)
        for ours, theirs in zip(out.outputs[0].logprobs or [], ref.outputs[0].logprobs or [],
                                strict=True):
            for token, lp in theirs.items():
                assert abs(ours[token].logprob - lp.logprob) <= LOGPROB_TOL
