"""/v1/completions over the null model: shapes, n and multiple prompts, echo, usage,
streaming (include_usage, continuous_usage_stats), max_tokens rules, context-length errors."""

from __future__ import annotations

from pathlib import Path

from http_app_harness import MODEL, drained, error_of, serving, sse_events


async def test_completion_shapes_and_usage(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir) as s:
        r = await s.http.post("/v1/completions", json={
            "model": MODEL, "prompt": "Hello there", "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == MODEL
        assert body["id"].startswith("cmpl-")
        [choice] = body["choices"]
        assert choice["index"] == 0 and choice["finish_reason"] == "length"
        assert choice["text"] and choice["logprobs"] is None
        prompt_len = len(s.engine.get_tokenizer()("Hello there").input_ids)
        assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 5,
                                 "total_tokens": prompt_len + 5}

        # Two prompts (one as token ids) with n=2: choice i*n+j is output j of prompt i.
        r = await s.http.post("/v1/completions", json={
            "model": MODEL, "prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 3,
            "request_id": "mine"})
        body = r.json()
        assert body["id"] == "cmpl-mine"
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12,
                                 "total_tokens": 17}

        # Echo prepends the prompt; max_tokens null fills the context (512 - 500).
        r = await s.http.post("/v1/completions", json={
            "prompt": [7] * 500, "max_tokens": None, "echo": True, "ignore_eos": True})
        body = r.json()
        assert body["usage"]["completion_tokens"] == 12
        prompt_text = s.engine.get_tokenizer().decode([7] * 500)
        assert body["choices"][0]["text"].startswith(prompt_text)
        assert (await drained(s.engine))["kv_cache_usage"] == 0.0


async def test_context_length_and_parameter_errors(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir) as s:
        r = await s.http.post("/v1/completions", json={"prompt": [5] * 500, "max_tokens": 20})
        assert error_of(r, 400)["message"] == (
            "This model's maximum context length is 512 tokens. However, you requested 520 "
            "tokens (500 in the messages, 20 in the completion). Please reduce the length of "
            "the messages or completion.")
        r = await s.http.post("/v1/completions", json={"prompt": [5] * 512, "max_tokens": None})
        assert error_of(r, 400)["message"].startswith(
            "This model's maximum context length is 512 tokens. However, your request has 512")
        r = await s.http.post("/v1/completions", json={"prompt": "hi", "temperature": -1})
        error = error_of(r, 400)
        assert "temperature" in error["message"] and error["param"] == "temperature"
        r = await s.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": "many"})
        error = error_of(r, 400)
        assert "$.max_tokens" in error["message"] and error["param"] == "max_tokens"
        r = await s.http.post("/v1/completions", json={"prompt": [[1, 2], "x"]})
        assert error_of(r, 400)["param"] == "prompt"
        for stream in (False, True):  # a stream's bad prompt is a 400 too, not an error chunk
            r = await s.http.post("/v1/completions", json={"prompt": [99999], "stream": stream})
            assert "vocabulary" in error_of(r, 400)["message"]
        r = await s.http.post("/v1/completions", json={"prompt": "hi", "logprobs": 50})
        assert "max_logprobs" in error_of(r, 400)["message"]
        r = await s.http.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
        assert error_of(r, 404)["message"] == "The model `gpt-4` does not exist."
        r = await s.http.post("/v1/completions", content=b"{not json")
        assert "Invalid request body" in error_of(r, 400)["message"]
        r = await s.http.post("/v1/completions", json={})
        assert error_of(r, 400)["param"] == "prompt"
        r = await s.http.post("/v1/completions", json={"prompt": "hi", "request_id": "same",
                                                       "max_tokens": 2, "n": 2})
        assert r.status_code == 200, r.text  # the id is free again once the request ends


async def test_completion_stream(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir) as s:
        r = await s.http.post("/v1/completions", json={
            "prompt": "Hi", "max_tokens": 6, "stream": True, "n": 2, "echo": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks, usage_chunk = events[:-2], events[-2]
        assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
        texts = {0: "", 1: ""}
        for chunk in chunks:
            assert chunk["object"] == "text_completion" and chunk["usage"] is not None
            [choice] = chunk["choices"]
            texts[choice["index"]] += choice["text"]
        assert all(t.startswith("Hi") and len(t) > 2 for t in texts.values())
        finishes = [c["choices"][0]["finish_reason"] for c in chunks]
        assert finishes.count("length") == 2
        assert chunks[-1]["usage"]["completion_tokens"] == 12

        # Without stream_options: no usage anywhere, still [DONE].
        r = await s.http.post("/v1/completions", json={"prompt": "Hi", "stream": True,
                                                       "max_tokens": 3})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and all(e["usage"] is None for e in events[:-1])
        assert s.state.in_flight == 0 and s.state.idle.is_set()


async def test_huge_integers_and_deep_nesting_are_400s(tiny_llama_dir: Path) -> None:
    # Found by tests/http/test_http_fuzz.py: an int the wire cannot carry was a 500 (seed,
    # priority, top_k; a top_k past int32 also faulted real workers), a huge n made one
    # request per output until memory ran out, and msgspec's RecursionError was a 500.
    async with serving(tiny_llama_dir) as s:
        for name, value in [("n", 2**63 - 1), ("top_k", 10**30), ("seed", 2**64),
                            ("priority", 2**64)]:
            for stream in (False, True):
                r = await s.http.post("/v1/completions", json={
                    "prompt": "hi", "max_tokens": 2, "stream": stream, name: value})
                assert error_of(r, 400)["param"] == name, r.text
        deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        r = await s.http.post("/v1/completions", content=deep)
        assert "nested too deeply" in error_of(r, 400)["message"]
        r = await s.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert (await drained(s.engine))["kv_cache_usage"] == 0.0
