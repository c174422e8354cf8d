"""Fuzz pass over the HTTP app (issue 9, hardening): 10,000 malformed bodies never get a 500.

Every JSON POST route is fuzzed: completions, chat completions, tokenize, detokenize, the
fault-tolerance instruction and the control routes that read a body (/sleep, /pause).
Hypothesis draws the values from strategies built from the request structs of
`ringserve.http.protocol` (and the admin and fault-tolerance bodies): every field gets valid
values mixed with wrong types, out-of-range numbers (NaN and infinities as Python clients
encode them, ints past int64), nested lists, bad roles and content parts, reserved template
variables, unknown fields and very long strings. A Random seeded by the route then assembles
distinct bodies from them: mostly a valid body with one to three fields replaced (so the deep
checks are reached), objects of any fields, the same documents corrupted (truncated, junk
bytes, invalid UTF-8, a BOM, UTF-16), bodies that are not JSON objects, and deep nesting, each
under a right or wrong Content-Type. (Hypothesis costs a few milliseconds per example, and
repeats itself: drawing every body with it took ~45 s; drawing the values and combining them
takes ~10 s.) Both steps are seeded (`derandomize=True`, no database), so a run is
reproducible.

The bodies are sent 16 at a time to the app over the null model (max_model_len 128), so the
ones that happen to be valid run real, cheap generations next to the rejected ones. Every
response must come within 20 s and be below 500, every 4xx must carry OpenAI's error body,
and a stream must end with [DONE] and no internal-error chunk. Afterwards the server must be
healthy: /health is 200, a normal completion works, nothing is left in flight and the engine
did not fail. The control routes change the engine's state when a body happens to be valid,
so they go last, one at a time, each success undone (/wake_up, /resume); a fault instruction
that would really run is never sent.

The null model ignores sampling parameters, so a second, smaller pass sends valid generation
bodies with damaged sampling fields to the real tiny model (CPU), whose workers put them in
tensors: the engine must stay healthy there too.
"""

from __future__ import annotations

import json
import math
import random
import traceback
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from http_app_harness import MODEL, Served, drained, error_of, serving, sse_events
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ringserve.http.settings import ServeSettings

pytestmark = pytest.mark.slow

VOCAB = 8000  # the tiny Llama's
ADMIN = {"Authorization": "Bearer sk-admin"}
SETTINGS = ServeSettings(served_model_name=MODEL, admin_api_key="sk-admin",
                         max_request_body_bytes=1 << 20)
CONCURRENCY = 16
REQUEST_TIMEOUT_S = 20  # far more than any body needs: a hang is a failure too
REAL_MODEL_CASES = 120  # per generation route, on the real tiny model

# Bodies per route: 10,000 in all.
COUNTS = {
    "/v1/completions": 3300,
    "/v1/chat/completions": 3300,
    "/tokenize": 1400,
    "/detokenize": 1000,
    "/fault_tolerance/apply": 400,
    "/sleep": 300,
    "/pause": 300,
}
SERIAL_ROUTES = ("/sleep", "/pause")  # a valid body changes the engine: one at a time, undone
UNDO = {"/sleep": "/wake_up", "/pause": "/resume"}

# -- values ----------------------------------------------------------------------------------

EDGE_INTS = [0, -1, -2, 1, 2, 20, 21, VOCAB - 1, VOCAB, 2**31 - 1, 2**31, 2**32, 2**53 + 1,
             2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30, -(10**30)]
EDGE_FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-320, 1e308, -1e308, 0.5, 2.0001]
# Values of the wrong type for any field (null too: most fields take it).
ODD: list[Any] = [None, True, False, 0, -1, 1.5, -1e30, "", "x", "NaN", "1", "\u0000", "\ud800",
                  [], [None], [[]], [1, "a"], [[[1]]], {}, {"a": 1}, {"": []}, {"type": "text"}]

odd = st.sampled_from(ODD)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
# Small, edge and huge ints; not the middle (an n of 5,000 is valid and merely slow).
ints = st.one_of(st.integers(-3, 40), st.sampled_from(EDGE_INTS),
                 st.integers(100_000, 2**70), st.integers(-(2**70), -100_000))
floats = st.one_of(st.floats(-3, 3), st.sampled_from(EDGE_FLOATS), st.floats())
long_text = st.builds(lambda chunk, n: chunk * n, st.sampled_from(["ab ", "\u00e9\u4e2d ", "x"]),
                      st.sampled_from([200, 2_000, 20_000, 150_000]))
texts = st.one_of(st.text(max_size=30), st.text(max_size=30), long_text)
in_vocab = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
token_ids = st.one_of(in_vocab, st.lists(st.one_of(st.integers(0, VOCAB - 1), ints), max_size=8))


def field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's value: mostly from `valid` (which has its own edge cases), else any type."""
    return st.one_of(valid, valid, valid, odd)


small_count = st.one_of(st.integers(1, 4), ints)
stop = st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3),
                 st.lists(st.lists(st.text(max_size=3), max_size=2), max_size=2))
stream_options = st.fixed_dictionaries({}, optional={
    "include_usage": field(st.booleans()), "continuous_usage_stats": field(st.booleans())})
logit_bias = st.dictionaries(
    st.one_of(st.integers(-2, VOCAB + 2).map(str), st.sampled_from(EDGE_INTS).map(str),
              st.text(max_size=4)), field(floats), max_size=3)
model = st.one_of(st.just(MODEL), st.text(max_size=8))
SAMPLING = {
    "model": model, "n": small_count, "temperature": floats, "top_p": floats, "top_k": ints,
    "min_p": floats, "seed": ints, "stop": stop, "stop_token_ids": token_ids,
    "presence_penalty": floats, "frequency_penalty": floats, "repetition_penalty": floats,
    "logit_bias": logit_bias, "user": st.text(max_size=8),
    "stream": st.booleans(), "stream_options": stream_options,
    "ignore_eos": st.booleans(), "min_tokens": small_count,
    "skip_special_tokens": st.booleans(), "spaces_between_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "prompt_logprobs": small_count,
    "allowed_token_ids": token_ids, "bad_words": st.lists(st.text(max_size=6), max_size=3),
    "priority": ints, "request_id": st.text(max_size=10), "cache_salt": st.text(max_size=6),
}
prompts = st.one_of(
    texts, st.lists(st.text(max_size=20), max_size=3), token_ids,
    st.lists(token_ids, max_size=3), st.lists(st.lists(token_ids, max_size=2), max_size=2),
    st.lists(st.one_of(st.text(max_size=5), st.integers(0, 100)), min_size=2, max_size=4))
COMPLETION = {
    **SAMPLING, "prompt": prompts, "max_tokens": small_count, "echo": st.booleans(),
    "logprobs": small_count, "suffix": st.text(max_size=4), "best_of": small_count,
}
ROLES = ["user", "assistant", "system", "tool", "developer", "", "bogus", "USER"]
parts = st.lists(st.fixed_dictionaries({}, optional={
    "type": field(st.sampled_from(["text", "image_url", "input_audio", ""])),
    "text": field(texts), "image_url": odd}), max_size=3)
message = st.fixed_dictionaries({}, optional={
    "role": field(st.sampled_from(ROLES)), "content": field(st.one_of(texts, parts)),
    "name": field(st.text(max_size=6)), "tool_calls": odd})
messages = st.one_of(st.lists(message, max_size=4), st.lists(odd, max_size=2))
TEMPLATE_KEYS = ["conversation", "tokenize", "chat_template", "tools", "documents",
                 "add_generation_prompt", "continue_final_message", "return_dict",
                 "return_assistant_tokens_mask", "messages", "bos_token", "padding",
                 "truncation", "max_length", "tokenizer_kwargs", "enable_thinking", "x"]
CHAT = {
    **SAMPLING, "messages": messages, "max_tokens": small_count,
    "max_completion_tokens": small_count, "logprobs": st.booleans(), "top_logprobs": small_count,
    "echo": st.booleans(), "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(), "add_special_tokens": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(TEMPLATE_KEYS), json_values,
                                            max_size=3),
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])}),
        st.dictionaries(st.text(max_size=5), odd, max_size=2)),
}
TOKENIZE = {
    "model": model, "prompt": texts, "messages": messages, "add_special_tokens": st.booleans(),
    "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
    "return_token_strs": st.booleans(),
}
DETOKENIZE = {"model": model, "tokens": st.one_of(token_ids, st.lists(token_ids, max_size=2))}
FAULT = {"instruction": st.sampled_from(["retry", "abort", "Retry", "", "restart"]),
         "params": st.one_of(st.dictionaries(st.text(max_size=5), odd, min_size=1, max_size=2),
                             json_values)}
SLEEP = {"level": st.one_of(st.sampled_from([1, 2, "1", "2"]), ints)}
PAUSE = {"mode": st.sampled_from(["keep", "abort", "wait", "later", "KEEP", ""])}
FIELDS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/tokenize": TOKENIZE,
    "/detokenize": DETOKENIZE, "/fault_tolerance/apply": FAULT, "/sleep": SLEEP, "/pause": PAUSE,
}
user_message = st.fixed_dictionaries({"role": st.just("user"),
                                      "content": st.sampled_from(["hi", "Hello there"])})
# Valid bodies, of which `objects` replaces one to three fields.
BASES: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "/v1/completions": st.fixed_dictionaries({
        "prompt": st.one_of(st.sampled_from(["Hello", "a b c"]), in_vocab),
        "max_tokens": st.integers(1, 8)}),
    "/v1/chat/completions": st.fixed_dictionaries({
        "messages": st.lists(user_message, min_size=1, max_size=2),
        "max_tokens": st.integers(1, 8)}),
    "/tokenize": st.one_of(st.fixed_dictionaries({"prompt": st.just("Hello")}),
                           st.fixed_dictionaries({"messages": st.lists(user_message, min_size=1,
                                                                       max_size=2)})),
    "/detokenize": st.fixed_dictionaries({"tokens": in_vocab}),
}


def _fault_is_valid(body: Any) -> bool:
    """A fault instruction that would really run (abort would stop the engine)."""
    return (isinstance(body, dict) and body.get("instruction") in ("retry", "abort")
            and not body.get("params") and set(body) <= {"instruction", "params"})


# -- pools: what hypothesis draws ------------------------------------------------------------

@dataclass
class Pools:
    """The values hypothesis drew for one route, which `assemble` combines into bodies.

    Attributes:
        fields: each field's values, valid and not.
        bases: valid bodies.
        unknown: objects of unknown fields.
        raw: bodies that are not JSON objects: other JSON values, random bytes.
    """

    fields: dict[str, list[Any]]
    bases: list[dict[str, Any]]
    unknown: list[dict[str, Any]]
    raw: list[bytes]


def encode(value: Any, ascii_only: bool) -> bytes:
    """JSON as Python clients write it: NaN and Infinity literals, lone surrogates kept."""
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def draw_pools(route: str) -> Pools:
    """Values for every field of `route` (and the rest of `Pools`), drawn by hypothesis.

    Each example draws a value for every field at once: hypothesis's cost is mostly per
    example, and `assemble` makes the combinations.
    """
    fields = FIELDS[route]
    pools = Pools({name: [] for name in fields}, [], [], [])
    raw = st.one_of(
        st.builds(encode, json_values.filter(lambda v: not isinstance(v, dict)), st.booleans()),
        st.binary(max_size=64))

    @settings(max_examples=max(200, COUNTS[route] // 5), database=None, derandomize=True,
              deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.fixed_dictionaries({name: field(value) for name, value in fields.items()}),
           BASES.get(route, st.just({})), st.dictionaries(st.text(max_size=10), odd, max_size=2),
           raw)
    def collect(values: dict[str, Any], base: dict[str, Any], unknown: dict[str, Any],
                raw: bytes) -> None:
        for name, value in values.items():
            pools.fields[name].append(value)
        pools.bases.append(base)
        pools.unknown.append(unknown)
        pools.raw.append(raw)

    collect()
    return pools


# -- bodies: what a seeded Random assembles --------------------------------------------------

def corrupt(data: bytes, rng: random.Random) -> bytes:
    """A damaged document: truncated, a byte replaced, junk inserted or appended, a BOM in
    front, or UTF-16."""
    at = rng.randrange(len(data) + 1)
    junk = rng.randbytes(rng.randint(1, 4))
    return [data[:at], data[:at] + junk + data[at + 1:], data[:at] + junk + data[at:],
            data + junk, b"\xef\xbb\xbf" + data,
            data.decode("latin-1").encode("utf-16")][rng.randrange(6)]


def nested(depth: int, key: str | None) -> bytes:
    """An array nested `depth` deep, alone or as the value of `key`."""
    inner = b"[" * depth + b"]" * depth
    return inner if key is None else b'{"' + key.encode() + b'": ' + inner + b"}"


def an_object(route: str, pools: Pools, rng: random.Random, *,
              from_base: bool | None = None) -> dict[str, Any]:
    """A valid body with one to three fields replaced (so the deep checks are reached), or
    up to eight fields of any value next to unknown ones; `from_base` None: the first two
    times in three."""
    names = sorted(pools.fields)
    if from_base is None:
        from_base = rng.random() < 2 / 3
    if route in BASES and from_base:
        body, low, high = dict(rng.choice(pools.bases)), 1, 3
    else:
        body, low, high = dict(rng.choice(pools.unknown)), 1, 8
    for name in rng.sample(names, rng.randint(low, min(high, len(names)))):
        body[name] = rng.choice(pools.fields[name])
    return body


def a_body(route: str, pools: Pools, rng: random.Random) -> bytes:
    """One body: an object of the route's fields (70%), the same corrupted (17%), not a JSON
    object (10%), or nested deeply (3%)."""
    kind = rng.random()
    if kind < 0.10:
        return rng.choice(pools.raw)
    if kind < 0.13:
        return nested(rng.choice([64, 600, 5_000, 200_000]),
                      rng.choice([None, *sorted(pools.fields)]))
    body = an_object(route, pools, rng)
    while route == "/fault_tolerance/apply" and _fault_is_valid(body):
        body = an_object(route, pools, rng)
    data = encode(body, ascii_only=rng.random() < 0.5)
    return corrupt(data, rng) if kind < 0.30 else data


@dataclass(frozen=True)
class Case:
    """One request of the fuzz pass."""

    route: str
    body: bytes
    content_type: str | None

    def show(self) -> str:
        """The request, its body cut at 600 bytes (the corpus is seeded: rerun to see all)."""
        body = self.body if len(self.body) <= 600 else self.body[:600] + b"..."
        return (f"POST {self.route} content-type={self.content_type!r} "
                f"({len(self.body)} bytes) body={body!r}")


CONTENT_TYPES = ["application/json", "application/json", "application/json; charset=utf-8",
                 "text/plain", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=x", "application/json; charset=latin-1", "",
                 None]


def assemble(route: str, pools: Pools, count: int) -> list[Case]:
    """`count` cases with distinct bodies for `route`, from a Random seeded by the route."""
    rng = random.Random(route)
    cases: dict[bytes, Case] = {}
    for _ in range(count * 10):
        if len(cases) == count:
            break
        body = a_body(route, pools, rng)
        cases.setdefault(body, Case(route, body, rng.choice(CONTENT_TYPES)))
    assert len(cases) == count, (route, len(cases))
    return list(cases.values())


@pytest.fixture(scope="module")
def pools() -> dict[str, Pools]:
    """Every route's pools (drawn once: the draw is most of the file's time)."""
    return {route: draw_pools(route) for route in COUNTS}


@pytest.fixture(scope="module")
def corpus(pools: dict[str, Pools]) -> dict[str, list[Case]]:
    """Every route's cases."""
    return {route: assemble(route, pools[route], count) for route, count in COUNTS.items()}


# -- sending and checking --------------------------------------------------------------------

@dataclass(frozen=True)
class Failure:
    """A response (or exception) that breaks the rules, with the case that caused it."""

    kind: str
    case: Case
    detail: str


def report(failures: list[Failure]) -> str:
    """How many failures of each kind, with the first case of each (to reproduce it)."""
    kinds: dict[str, list[Failure]] = {}
    for failure in failures:
        kinds.setdefault(failure.kind, []).append(failure)
    lines = [f"{len(failures)} bad responses, {len(kinds)} kinds:"]
    for kind, group in kinds.items():
        first = group[0]
        lines.append(f"\n[{len(group)}x] {kind}\n  {first.case.show()}\n  {first.detail}")
    return "\n".join(lines)


def problem_of(response: httpx.Response) -> str | None:
    """What is wrong with a response to a malformed body, or None."""
    status = response.status_code
    if status >= 500:
        return f"status {status}"
    if status >= 400:
        try:
            error_of(response, status)
        except (AssertionError, ValueError, KeyError, TypeError) as exc:
            return f"a {status} without OpenAI's error body ({exc!r})"
        return None
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_events(response.text)
        if not events or events[-1] != "[DONE]":
            return "a stream that does not end with [DONE]"
        for event in events:
            if isinstance(event, dict) and "error" in event and event["error"]["code"] >= 500:
                return f"a stream's error chunk {event['error']}"
    return None


async def send(s: Served, case: Case, failures: list[Failure],
               statuses: Counter[tuple[str, int]]) -> None:
    """Send one case and record what is wrong with the answer; undo a control route's
    success."""
    headers = {} if case.route not in (*SERIAL_ROUTES, "/fault_tolerance/apply") else ADMIN
    if case.content_type is not None:
        headers = {**headers, "content-type": case.content_type}
    try:
        with trio.fail_after(REQUEST_TIMEOUT_S):
            response = await s.http.post(case.route, content=case.body, headers=headers)
    except trio.TooSlowError:
        failures.append(Failure(f"{case.route}: no answer in {REQUEST_TIMEOUT_S} s", case, ""))
        return
    except Exception as exc:  # the app raised: a server would answer 500
        where = "".join(traceback.format_tb(exc.__traceback__, limit=-4))
        failures.append(Failure(f"raised {exc!r}"[:200], case, f"{where}{exc!r}"))
        return
    statuses[case.route, response.status_code] += 1
    problem = problem_of(response)
    if problem is not None:
        failures.append(Failure(f"{case.route}: {problem}"[:200], case, response.text[:1000]))
        return
    undo = UNDO.get(case.route)
    if undo is not None and response.status_code < 300:
        assert (await s.http.post(undo, headers=ADMIN)).status_code == 200, undo


async def send_all(s: Served, cases: list[Case], failures: list[Failure],
                   statuses: Counter[tuple[str, int]], concurrency: int) -> None:
    """Send every case, `concurrency` at a time."""
    pending = iter(cases)

    async def worker() -> None:
        for case in pending:
            await send(s, case, failures, statuses)

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)


async def check_healthy(s: Served) -> None:
    """The server after the fuzz: healthy, serving, nothing in flight, no block held."""
    assert not s.engine.errored
    assert (await s.http.get("/health")).status_code == 200
    r = await s.http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    with trio.fail_after(5):
        while s.engine.output_processor.get_num_unfinished_requests():
            await trio.sleep(0.02)
    stats = await drained(s.engine)
    assert stats["kv_cache_usage"] == 0.0
    assert s.state.in_flight == 0


async def test_malformed_bodies_never_500(tiny_llama_dir: Path,
                                          corpus: dict[str, list[Case]]) -> None:
    concurrent = [case for route, cases in corpus.items() if route not in SERIAL_ROUTES
                  for case in cases]
    # Interleave the routes so every route meets the others' requests in flight.
    concurrent.sort(key=lambda case: zlib.crc32(case.body))
    serial = [case for route in SERIAL_ROUTES for case in corpus[route]]
    assert len(concurrent) + len(serial) == sum(COUNTS.values()) == 10_000
    failures: list[Failure] = []
    statuses: Counter[tuple[str, int]] = Counter()
    async with serving(tiny_llama_dir, settings=SETTINGS, max_model_len=128) as s:
        await send_all(s, concurrent, failures, statuses, CONCURRENCY)
        await send_all(s, serial, failures, statuses, 1)
        for route in COUNTS:  # shown with -s: how deep the bodies got
            print(route, {status: n for (r, status), n in sorted(statuses.items()) if r == route})
        assert not failures, report(failures)
        await check_healthy(s)



# The sampling fields the workers turn into tensors (the null model ignores them all). Not n
# or max_tokens: the null pass covers them, and here they only make requests long (n = 40
# outputs of 120 tokens on a busy CPU takes more than REQUEST_TIMEOUT_S).
_TENSOR_FIELDS = ["temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                  "allowed_token_ids", "stop_token_ids", "bad_words", "ignore_eos",
                  "prompt_logprobs", "logprobs"]
TENSOR_FIELDS = {"/v1/completions": _TENSOR_FIELDS,
                 "/v1/chat/completions": [*_TENSOR_FIELDS, "top_logprobs"]}


def a_sampling_body(route: str, pools: Pools, rng: random.Random) -> bytes:
    """A valid body with one to three tensor fields replaced by a value of a JSON type the
    field takes (numbers, lists, objects), so most pass the type checks and many the range
    checks."""
    body = dict(rng.choice(pools.bases))
    for name in rng.sample(TENSOR_FIELDS[route], rng.randint(1, 3)):
        body[name] = rng.choice([v for v in pools.fields[name]
                                 if v is not None and not isinstance(v, str)])
    return encode(body, ascii_only=True)


async def test_sampling_edges_leave_real_workers_healthy(
        tiny_llama_dir: Path, pools: dict[str, Pools]) -> None:
    # On the real tiny model (CPU) the sampling fields reach the workers' tensors, where a
    # value the checks let through faults the whole engine (a top_k past int32 did).
    cases = []
    for route in TENSOR_FIELDS:
        rng = random.Random(f"{route} on the real model")
        cases += [Case(route, a_sampling_body(route, pools[route], rng), "application/json")
                  for _ in range(REAL_MODEL_CASES)]
    failures: list[Failure] = []
    statuses: Counter[tuple[str, int]] = Counter()
    async with serving(tiny_llama_dir, "default", settings=SETTINGS, max_model_len=128) as s:
        await send_all(s, cases, failures, statuses, CONCURRENCY)
        print({f"{route} {status}": n for (route, status), n in sorted(statuses.items())})
        assert not failures, report(failures)
        assert s.engine.is_healthy
        await check_healthy(s)
