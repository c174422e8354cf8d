"""One streamed completion request of `ringserve bench serve`, timed token by token.

Owns the request body for each server flavour and the SSE reading: `openai` is vLLM's
OpenAI-compatible dialect (ringserve, vLLM: `ignore_eos`, `stream_options.include_usage`,
a final `data: [DONE]`); `transformers` is `transformers serve`, which answers 422 to any field
outside OpenAI's schema plus its own `generation_config`, and ends a stream by closing it after
the finish chunk (usage in that chunk) without `[DONE]`. `bench_serve` calls `send_request`;
this module imports no server code.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

Backend = Literal["openai", "transformers"]
BACKENDS: tuple[Backend, ...] = ("openai", "transformers")


@dataclass(frozen=True)
class SampleRequest:
    """One prompt of the workload: text or token ids, and the lengths asked for."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestOutput:
    """What one request measured (seconds; `itl` holds the gaps between token chunks)."""

    success: bool = False
    status: int = 0
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    token_chunks: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""


def build_payload(backend: Backend, model: str, request: SampleRequest,
                  ignore_eos: bool) -> dict[str, Any]:
    """The JSON body of a greedy streamed completion for `backend`.

    transformers serve accepts `stream_options` (and reports usage in its finish chunk anyway)
    but not `ignore_eos`; there, a `generation_config` with EOS disabled does the same.
    """
    payload: dict[str, Any] = {
        "model": model, "prompt": request.prompt, "temperature": 0.0,
        "max_tokens": request.output_len, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if backend == "openai":
        payload["ignore_eos"] = ignore_eos
    elif ignore_eos:
        payload["generation_config"] = json.dumps({"eos_token_id": -1, "do_sample": False})
    return payload


def _chunk_text(chunk: dict[str, Any]) -> tuple[bool, str]:
    """(whether the chunk carries a token, its text) for a completions chunk.

    A chunk with choices is a token unless it is a bare finish chunk (empty text with a
    finish reason: transformers' last chunk, or a stop with nothing left to flush).
    """
    choices = chunk.get("choices") or []
    if not choices:
        return False, ""
    choice = choices[0]
    text = choice.get("text") or ""
    return bool(text) or choice.get("finish_reason") is None, text


async def send_request(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
                       prompt_len: int, headers: dict[str, str]) -> RequestOutput:
    """Stream one completion and time it; never raises for a failed request.

    The stream ends at `data: [DONE]` or when the server closes it; output tokens are the
    usage's `completion_tokens`, or the number of token chunks when the server sends no usage.
    `token_chunks` is the client's own count of chunks that carried tokens (a server may merge
    several tokens into one chunk, never split one token over two).
    """
    out = RequestOutput(prompt_len=prompt_len)
    start = last = time.perf_counter()
    texts: list[str] = []
    token_chunks = 0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            out.status = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                out.error = f"HTTP {response.status_code}: {body[:500]}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"error chunk: {json.dumps(chunk['error'])[:500]}"
                    return out
                if usage := chunk.get("usage"):
                    out.usage_reported = True
                    out.output_tokens = int(usage.get("completion_tokens") or 0)
                    out.prompt_len = int(usage.get("prompt_tokens") or prompt_len)
                is_token, text = _chunk_text(chunk)
                if not is_token:
                    continue
                if token_chunks == 0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
                token_chunks += 1
                texts.append(text)
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.latency = time.perf_counter() - start
    out.generated_text = "".join(texts)
    out.token_chunks = token_chunks
    if not out.usage_reported:
        out.output_tokens = token_chunks
    out.success = True
    return out
