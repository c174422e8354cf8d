"""Image parts on `/v1/chat/completions` (issue 44): the official openai client and raw HTTP
against the app on a tiny Qwen2-VL (CPU), and on a text-only tiny Llama.

A good image part is answered with its image tokens counted in `usage.prompt_tokens`; every
bad part is a 400 naming `messages[i].content[j]`, and the server answers a good request after
each one.
"""

from __future__ import annotations

import base64
import io
import socket
from pathlib import Path
from typing import Any

import pytest
from http_app_harness import MODEL, Served, error_of, serving
from PIL import Image

from ringserve.gpu.multimodal.testing import tiny_vlm
from ringserve.http.settings import ServeSettings

SETTINGS = ServeSettings(served_model_name=MODEL)
GREEDY: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "temperature": 0.0}

def png_url(size: int = 56, colour: tuple[int, int, int] = (200, 30, 30)) -> str:
    """A data: URL of a small PNG (56x56: 4 image tokens on the tiny Qwen2-VL)."""
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

def image_part(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}

def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]

TEXT = {"type": "text", "text": "What is this?"}

def closed_port() -> int:
    """A localhost port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

async def chat(s: Served, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return await s.http.post("/v1/chat/completions",
                             json={**GREEDY, "messages": messages, **extra})

async def check_good(s: Served) -> int:
    """A good image request is answered; returns its prompt tokens."""
    r = await chat(s, user(image_part(png_url()), TEXT))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    return int(body["usage"]["prompt_tokens"])

@pytest.mark.slow
async def test_image_parts_on_a_vision_model(tmp_path: Path) -> None:
    async with serving(tiny_vlm("qwen2_vl"), "default", settings=SETTINGS,
                       limit_mm_per_prompt={"image": 2}) as s:
        client = s.openai()
        text_only = await client.chat.completions.create(
            messages=[{"role": "user", "content": "What is this?"}], **GREEDY)
        as_parts = await client.chat.completions.create(messages=user(TEXT), **GREEDY)
        with_image = await client.chat.completions.create(
            messages=user(image_part(png_url(), detail="low"), TEXT), **GREEDY)
        assert text_only.usage is not None and as_parts.usage is not None
        assert with_image.usage is not None and with_image.choices[0].message.content
        # Text parts alone keep today's prompt (joined into one string); the image adds its
        # placeholder's expansion: <|vision_start|> + 4 x <|image_pad|> + <|vision_end|>.
        assert as_parts.usage.prompt_tokens == text_only.usage.prompt_tokens
        assert with_image.usage.prompt_tokens == text_only.usage.prompt_tokens + 6

        two = await chat(s, user(image_part(png_url()), TEXT, image_part(png_url(112))))
        assert two.status_code == 200, two.text
        # 112x112: 8x8 patches merged 2x2 -> 16 tokens.
        assert two.json()["usage"]["prompt_tokens"] == text_only.usage.prompt_tokens + 6 + 18

        streamed = await chat(s, user(image_part(png_url()), TEXT), stream=True,
                              stream_options={"include_usage": True})
        assert streamed.status_code == 200 and '"prompt_tokens":' in streamed.text

        url = png_url()
        local = tmp_path / "cat.png"
        local.write_bytes(base64.b64decode(url.split(",", 1)[1]))
        bad: list[tuple[list[dict[str, Any]], str]] = [
            (user(TEXT, image_part("data:image/png;base64," + base64.b64encode(
                b"plain text, not a picture").decode())),
             "messages[0].content[1]: not an image Pillow can read"),
            (user(image_part(url[:-7])), "messages[0].content[0]: invalid base64"),
            (user(TEXT, image_part(url), image_part(url), image_part(url)),
             "messages[0].content[3]: 3 images in one prompt; at most 2 allowed"),
            (user(image_part(local.as_uri())),
             "messages[0].content[0]: file URLs are refused"),
            (user(TEXT, image_part(f"http://127.0.0.1:{closed_port()}/cat.png")),
             "messages[0].content[1]: fetching"),
            ([{"role": "system", "content": "Be brief."},
              {"role": "user", "content": [TEXT, {"type": "image_url"}]}],
             "messages[1].content[1]: a part of type 'image_url' needs its 'image_url' field "
             "alone; got neither"),
            (user({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}),
             "messages[0].content[0]: part type 'input_audio' is not supported"),
        ]
        for messages, message in bad:
            error = error_of(await chat(s, messages), 400)
            assert error["message"].startswith(message), (message, error)
            assert error["param"] == "messages"
            assert await check_good(s) == with_image.usage.prompt_tokens
        unknown = error_of(await chat(s, user(image_part(url, size=3))), 400)
        assert "size" in unknown["message"], unknown
        detail = error_of(await chat(s, user(image_part(url, detail="ultra"))), 400)
        assert "detail" in detail["message"], detail
        assert await check_good(s) == with_image.usage.prompt_tokens


@pytest.mark.slow
async def test_image_part_to_a_text_only_model(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, "default", settings=SETTINGS) as s:
        error = error_of(await chat(s, user(TEXT, image_part(png_url()))), 400)
        assert error["message"] == f"messages[0].content[1]: model {MODEL} takes text only"
        r = await chat(s, user(TEXT))
        assert r.status_code == 200, r.text


@pytest.mark.slow
async def test_image_parts_on_the_agents_routes() -> None:
    async with serving(tiny_vlm("qwen2_vl"), "default", settings=SETTINGS,
                       limit_mm_per_prompt={"image": 2}) as s:
        url = png_url()
        question = {"type": "input_text", "text": "What is this?"}
        text_only = await s.http.post("/v1/responses", json={
            "model": MODEL, "max_output_tokens": 3, "temperature": 0.0,
            "input": [{"role": "user", "content": [question]}]})
        assert text_only.status_code == 200, text_only.text
        good = await s.http.post("/v1/responses", json={
            "model": MODEL, "max_output_tokens": 3, "temperature": 0.0,
            "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": url, "detail": "auto"}, question]}]})
        assert good.status_code == 200, good.text
        assert (good.json()["usage"]["input_tokens"]
                == text_only.json()["usage"]["input_tokens"] + 6)
        bad = await s.http.post("/v1/responses", json={
            "model": MODEL, "max_output_tokens": 3,
            "input": [{"role": "developer", "content": "Be brief."},
                      {"role": "user", "content": [question, {
                          "type": "input_image", "image_url": url[:-7]}]}]})
        error = error_of(bad, 400)
        assert error["message"].startswith("input[1].content[1]: invalid base64"), error
        assert error["param"] == "input"

        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": url.split(",", 1)[1]}}
        body = {"model": MODEL, "max_tokens": 3, "temperature": 0.0,
                "messages": [{"role": "user", "content": [
                    block, {"type": "text", "text": "What is this?"}]}]}
        answered = await s.http.post("/v1/messages", json=body)
        assert answered.status_code == 200, answered.text
        counted = await s.http.post("/v1/messages/count_tokens", json=body)
        used = answered.json()["usage"]  # Anthropic's input_tokens leave out cache reads
        assert counted.json()["input_tokens"] == (used["input_tokens"]
                                                  + used["cache_read_input_tokens"])
        broken = {**block, "source": {**block["source"], "data": "aGVsbG8="}}
        refused = await s.http.post("/v1/messages", json={
            **body, "messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "Hello."},
                                 {"role": "user", "content": [
                                     {"type": "text", "text": "And this?"}, broken]}]})
        assert refused.status_code == 400, refused.text
        assert refused.json()["type"] == "error"
        message = refused.json()["error"]["message"]
        assert message.startswith("messages[2].content[1]: not an image Pillow can read"), message
        no_data = await s.http.post("/v1/messages", json={
            **body, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png"}}]}]})
        assert no_data.status_code == 400
        assert no_data.json()["error"]["message"].startswith(
            "messages[0].content[0].source.data: required"), no_data.text
        assert (await s.http.post("/v1/messages", json=body)).status_code == 200
