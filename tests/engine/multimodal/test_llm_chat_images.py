"""`LLM.chat` with images (issue 44) on a tiny Qwen2-VL (CPU): vLLM's three image part forms
give the tokens `LLM.generate` gives for the same prompt text and image; a bad part raises
naming its location; messages without images keep today's prompt."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
from PIL import Image

from ringserve import LLM, SamplingParams
from ringserve.engine.frontend.multimodal.chat_parts import ImagePartError, dict_conversation
from ringserve.gpu.multimodal.testing import tiny_vlm

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def picture(colour: tuple[int, int, int] = (200, 30, 30)) -> Image.Image:
    return Image.new("RGB", (56, 56), colour)


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def conversation(part: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}]


def test_dict_conversation_forms() -> None:
    image = picture()
    plain = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert dict_conversation(plain)[0] == plain and dict_conversation(plain)[1] == []
    converted, refs = dict_conversation(
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}},
                                      {"type": "text", "text": "and"},
                                      {"type": "image_pil", "image_pil": image}]}],
        "messages[1]")
    assert converted[1]["content"] == [{"type": "image"}, {"type": "text", "text": "and"},
                                       {"type": "image"}]
    assert [(r.where, r.source) for r in refs] == [("messages[1][1].content[0]", "data:x"),
                                                   ("messages[1][1].content[2]", image)]
    with pytest.raises(ImagePartError,
                       match=r"^messages\[0\]\.content\[0\]: a part of type 'image' needs"):
        dict_conversation([{"role": "user", "content": [{"type": "image"}]}])


@pytest.mark.slow
def test_chat_with_images_matches_generate() -> None:
    image = picture()
    with LLM(str(tiny_vlm("qwen2_vl")), device="cpu", kv_cache_memory=16 << 20,
             max_model_len=512, limit_mm_per_prompt={"image": 2}) as llm:
        tokenizer = llm.get_tokenizer()
        text = tokenizer.apply_chat_template(
            conversation({"type": "image"}), tokenize=False, add_generation_prompt=True)
        # generate adds the tokenizer's BOS to a text prompt; chat takes the template's.
        text = text.removeprefix(tokenizer.bos_token)
        expected = llm.generate({"prompt": text, "multi_modal_data": {"image": image}},
                                GREEDY, use_tqdm=False)[0]
        outs = llm.chat([conversation({"type": "image_url",
                                       "image_url": {"url": data_url(image)}}),
                         conversation({"type": "image", "image": image}),
                         conversation({"type": "image_pil", "image_pil": image})],
                        GREEDY, use_tqdm=False)
        for out in outs:
            assert out.prompt_token_ids == expected.prompt_token_ids
            assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        # A different image changes the reply's inputs, not the prompt's token ids.
        other = llm.chat(conversation({"type": "image", "image": picture((0, 90, 240))}),
                         GREEDY, use_tqdm=False)[0]
        assert other.prompt_token_ids == expected.prompt_token_ids

        text_only = [{"role": "user", "content": "What is it?"}]
        plain = llm.chat(text_only, GREEDY, use_tqdm=False)[0]
        ids = tokenizer(tokenizer.apply_chat_template(text_only, tokenize=False,
                                                      add_generation_prompt=True),
                        add_special_tokens=False).input_ids
        assert plain.prompt_token_ids == ids

        bad = data_url(image)[:-7]
        with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[0\]: invalid base64"):
            llm.chat(conversation({"type": "image_url", "image_url": {"url": bad}}), GREEDY)
        with pytest.raises(ValueError, match=r"^messages\[1\]\[0\]\.content\[0\]: not an image"):
            llm.chat([conversation({"type": "image", "image": image}),
                      conversation({"type": "image_url",
                                    "image_url": {"url": "data:;base64,aGVsbG8="}})], GREEDY)
        three = [{"role": "user", "content": [{"type": "image", "image": image}] * 3}]
        with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[2\]: 3 images"):
            llm.chat(three, GREEDY)
        again = llm.chat(conversation({"type": "image", "image": image}), GREEDY,
                         use_tqdm=False)[0]
        assert again.outputs[0].token_ids == expected.outputs[0].token_ids
