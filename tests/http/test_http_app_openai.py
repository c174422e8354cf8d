"""The official openai client against the app on the real tiny Llama: completions and chat,
streaming and not, n=2, logprobs, echo, stop, usage, and errors as the client's exceptions."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from http_app_harness import MODEL, serving

from ringserve.http.settings import ServeSettings

SETTINGS = ServeSettings(served_model_name=MODEL, api_key="sk-test")
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.mark.slow
async def test_openai_completions(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, "default", settings=SETTINGS) as s:
        client = s.openai("sk-test")
        full = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8,
                                               logprobs=2, **GREEDY)
        choice = full.choices[0]
        assert choice.finish_reason == "length" and choice.text
        assert full.usage is not None and full.usage.completion_tokens == 8
        lp = choice.logprobs
        assert lp is not None and lp.tokens is not None and len(lp.tokens) == 8
        assert lp.token_logprobs is not None and all(v is not None and v <= 0
                                                     for v in lp.token_logprobs)
        assert lp.top_logprobs is not None and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

        stream = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8,
                                                 stream=True, stream_options={"include_usage": True},
                                                 **GREEDY)
        pieces, usage = [], None
        async for chunk in stream:
            pieces.extend(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        assert "".join(pieces) == choice.text
        assert usage is not None and usage.total_tokens == full.usage.total_tokens

        # A stop string cuts the text before it.
        stop = choice.text[3:6]
        stopped = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8,
                                                  stop=[stop], **GREEDY)
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].text == choice.text[:choice.text.index(stop)]

        only = await client.completions.create(
            model=MODEL, prompt="Once upon", max_tokens=4, temperature=1.0,
            extra_body={"allowed_token_ids": [1000], "cache_salt": "salt", "priority": 1,
                        "request_id": "fixed", "ignore_eos": True})
        assert only.id == "cmpl-fixed"
        assert only.choices[0].text == s.engine.get_tokenizer().decode([1000] * 4)

        echoed = await client.completions.create(
            model=MODEL, prompt="Once upon", max_tokens=2, echo=True, logprobs=1, n=2,
            temperature=1.0, seed=3, extra_body={"prompt_logprobs": 1})
        assert [c.index for c in echoed.choices] == [0, 1]
        for c in echoed.choices:
            assert c.text.startswith("Once upon")
            assert c.logprobs is not None and c.logprobs.token_logprobs is not None
            prompt_len = echoed.usage.prompt_tokens if echoed.usage else 0
            assert len(c.logprobs.token_logprobs) == prompt_len + 2
            assert c.logprobs.token_logprobs[0] is None  # the first prompt token has none
            extra = c.model_extra or {}
            assert len(extra["prompt_logprobs"]) == prompt_len


@pytest.mark.slow
async def test_openai_chat_and_errors(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, "default", settings=SETTINGS) as s:
        client = s.openai("sk-test")
        messages = [{"role": "user", "content": "Hello"}]
        full = await client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=6, logprobs=True,
            top_logprobs=2, n=2, **GREEDY)  # type: ignore[arg-type]
        assert len(full.choices) == 2 and full.usage is not None
        assert full.usage.completion_tokens == 12
        for choice in full.choices:
            assert choice.message.role == "assistant" and choice.message.content
            assert choice.logprobs is not None and choice.logprobs.content is not None
            assert len(choice.logprobs.content) == 6
            assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
        text = full.choices[0].message.content

        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, stream=True,
            stream_options={"include_usage": True}, **GREEDY)  # type: ignore[arg-type]
        roles, pieces, finish, usage = [], [], None, None
        async for chunk in stream:
            for c in chunk.choices:
                roles.append(c.delta.role)
                pieces.append(c.delta.content or "")
                finish = c.finish_reason or finish
            usage = chunk.usage or usage
        assert roles[0] == "assistant" and set(roles[1:]) == {None}
        assert "".join(pieces) == text and finish == "length"
        assert usage is not None and usage.completion_tokens == 6

        with pytest.raises(openai.BadRequestError, match="temperature"):
            await client.completions.create(model=MODEL, prompt="x", temperature=-1)
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            await client.completions.create(model=MODEL, prompt="x " * 600, max_tokens=4)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await client.chat.completions.create(model="gpt-4", messages=messages)  # type: ignore[arg-type]
        with pytest.raises(openai.AuthenticationError):
            await s.openai("sk-wrong").models.list()
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
