"""/v1/chat/completions over the null model: the chat template, role delta first, n > 1,
max_completion_tokens, continue_final_message with echo, usage, and template overrides."""

from __future__ import annotations

from pathlib import Path

from http_app_harness import MODEL, error_of, serving, sse_events

from ringserve.http.settings import ServeSettings

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]}]


async def test_chat_completion_and_stream(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir) as s:
        tok = s.engine.get_tokenizer()
        rendered = tok.apply_chat_template(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
            tokenize=False, add_generation_prompt=True)
        prompt_len = len(tok(rendered, add_special_tokens=False).input_ids)

        r = await s.http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "max_completion_tokens": 4, "max_tokens": 9,
            "n": 2})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert all(c["message"]["role"] == "assistant" and c["finish_reason"] == "length"
                   for c in body["choices"])
        assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 8,
                                 "total_tokens": prompt_len + 8}

        r = await s.http.post("/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 5, "stream": True, "n": 2,
            "stream_options": {"include_usage": True}})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        first = [e["choices"][0] for e in events[:2]]
        assert [c["delta"] for c in first] == [{"role": "assistant", "content": ""}] * 2
        assert [c["index"] for c in first] == [0, 1]
        rest = events[2:-2]
        assert all("role" not in e["choices"][0]["delta"] for e in rest)
        assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
        assert sum(e["choices"][0]["finish_reason"] == "length" for e in rest) == 2
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 10


async def test_continue_final_message_and_template(tiny_llama_dir: Path) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    settings = ServeSettings(served_model_name=MODEL, chat_template=template)
    async with serving(tiny_llama_dir, settings=settings) as s:
        messages = [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Well,"}]
        r = await s.http.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": 3, "echo": True,
            "add_generation_prompt": False, "continue_final_message": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"].startswith("Well,")
        r = await s.http.post("/tokenize", json={"messages": messages,
                                                 "add_generation_prompt": False})
        expected = s.engine.get_tokenizer()("[user] Hi\n[assistant] Well,\n",
                                             add_special_tokens=False).input_ids
        assert r.json()["tokens"] == expected

        r = await s.http.post("/v1/chat/completions", json={
            "messages": messages, "continue_final_message": True})
        assert error_of(r, 400)["param"] == "continue_final_message"
        r = await s.http.post("/v1/chat/completions", json={"messages": []})
        assert error_of(r, 400)["param"] == "messages"
        r = await s.http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
        assert "image_url" in error_of(r, 400)["message"]
        r = await s.http.post("/v1/chat/completions", json={
            "messages": messages, "top_logprobs": 2})
        assert error_of(r, 400)["param"] == "top_logprobs"
        r = await s.http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x " * 600}]})
        assert "maximum context length is 512 tokens" in error_of(r, 400)["message"]


async def test_chat_template_kwargs_reserved_keys_and_bad_values(tiny_llama_dir: Path) -> None:
    # Found by tests/http/test_http_fuzz.py: each of these was a 500. A client's own
    # template is refused, as vLLM refuses it (it would be compiled and run here).
    async with serving(tiny_llama_dir) as s:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for key, value in [("chat_template", "{{ 7 * 7 }}"), ("chat_template", 0),
                           ("conversation", []), ("tokenize", True)]:
            r = await s.http.post("/v1/chat/completions", json={
                **body, "chat_template_kwargs": {key: value}})
            error = error_of(r, 400)
            assert error["param"] == "chat_template_kwargs" and key in error["message"]
        for kwargs in ({"documents": [5]}, {"tools": 5}, {"messages": 1}):
            r = await s.http.post("/v1/chat/completions", json={
                **body, "chat_template_kwargs": kwargs})
            assert "chat template rejected" in error_of(r, 400)["message"], kwargs
        r = await s.http.post("/v1/chat/completions", json={
            **body, "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text
