"""HTTP-server settings and the server's shared state (readiness, draining, in-flight count).

`ServeSettings` is the frozen serving layer of the configuration, built once by
`ringserve serve` from its flags (next to the EngineConfig built from the engine flags).
`ServerState` is the one mutable object the app and the server share: the server marks the
engine ready and, on SIGTERM/SIGINT, draining; the routes refuse new work while draining
(503), count the requests in flight, and `/health` answers 200 only when ready, not draining
and the engine is alive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from ringserve.lora_request import LoRARequest

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20


@dataclass(frozen=True)
class ServeSettings:
    """What the HTTP layer needs beyond the engine configuration.

    Attributes:
        host, port: where to listen (default 127.0.0.1:8000).
        served_model_name: the model name clients send and `/v1/models` lists (the first of
            vLLM's `--served-model-name` list; metrics use it).
        served_model_aliases: the other names of that list, served the same way.
        api_key: the keys every `/v1` route accepts (as `Authorization: Bearer <key>` or
            `x-api-key: <key>`), one key or several separated by commas; any one of them
            authorizes a request (None: open). An empty item is refused (`api_keys`).
        admin_api_key: required on the control routes (/sleep, /wake_up, /pause, /resume,
            /reset_prefix_cache, the weight-update and RL routes of `ringserve.http.rl_routes`,
            /fault_tolerance/*); None: those routes are refused (403).
        chat_template: a Jinja chat template overriding the tokenizer's (text, not a path).
        max_request_body_bytes: larger bodies get 413.
        shutdown_timeout: seconds in-flight requests may take to finish after SIGTERM.
        timeout_keep_alive: seconds an idle connection stays open (hypercorn's keep-alive
            timeout; vLLM's `--timeout-keep-alive`, default 5).
        certfile, keyfile: TLS (h2 by ALPN) when both are given.
        enable_log_requests: log one line per request.
        enable_auto_tool_choice: `tool_choice: "auto"` is served (with `tool_call_parser`).
        tool_call_parser: the parser of auto tool calls (`ringserve.http.tool_parsers`).
        root_path: the prefix a proxy serves the app under ("" or "/a/b"), the ASGI root_path.
        allowed_origins, allowed_methods, allowed_headers, allow_credentials: CORS, with
            vLLM's defaults (any origin, method and header; no credentials).
        metrics_prefix: the prefix of the Prometheus families on /metrics ("vllm": `vllm:...`).
        enable_prompt_tokens_details: chat and completions usage carries
            `prompt_tokens_details.cached_tokens` (vLLM's `--enable-prompt-tokens-details`).
        responses_store_max_entries: the most responses `/v1/responses` keeps (least
            recently used evicted first).
        responses_store_ttl: seconds a stored response is kept after its last use.
        lora_modules: the LoRA adapters served by name (`--lora-modules`).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "ringserve-demo"
    api_key: str | None = None
    admin_api_key: str | None = None
    chat_template: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    shutdown_timeout: float = 30.0
    timeout_keep_alive: float = 5.0
    certfile: str | None = None
    keyfile: str | None = None
    enable_log_requests: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    served_model_aliases: tuple[str, ...] = ()
    root_path: str = ""
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    metrics_prefix: str = "ringserve"
    enable_prompt_tokens_details: bool = False
    responses_store_max_entries: int = 1000
    responses_store_ttl: float = 3600.0
    lora_modules: tuple[LoRARequest, ...] = ()

    def __post_init__(self) -> None:
        if self.api_key is not None:
            split_api_keys(self.api_key, "api_key")

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys of `api_key`, in order (empty: the API routes are open)."""
        return () if self.api_key is None else split_api_keys(self.api_key, "api_key")

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name a request may use, the primary one first."""
        return (self.served_model_name, *self.served_model_aliases)


def split_api_keys(text: str, source: str) -> tuple[str, ...]:
    """The keys of a comma-separated key list (`--api-key a,b`), each stripped of the
    whitespace around it (a header cannot carry it, so such a key could never match).

    Args:
        text: the list as given.
        source: where it came from, for the error (`--api-key`, an environment variable).

    Raises:
        ValueError: an item is empty (`"a,,b"`, `"a,"`, `""`): it would let an empty key in.
            The message names `source` and the item's position, never a key.
    """
    items = [item.strip() for item in text.split(",")]
    for at, item in enumerate(items, start=1):
        if not item:
            raise ValueError(f"{source}: item {at} of {len(items)} is an empty key; allowed: "
                             "one or more non-empty keys separated by commas")
    return tuple(items)


@dataclass
class ServerState:
    """Mutable state shared by the server task and the routes (all on one trio loop).

    Attributes:
        ready: the engine finished starting (its handshake came back).
        draining: a shutdown began: new requests get 503, in-flight ones finish.
        in_flight: requests being served now (generation routes).
        idle: set whenever `in_flight` drops to zero (the drain waits on it).
        background: the nursery of work that outlives its HTTP request (`/v1/responses`
            with `background: true`); the server sets its root nursery, so a stop cancels
            it. None: background requests are refused (503).
    """

    ready: bool = False
    draining: bool = False
    in_flight: int = 0
    idle: trio.Event = field(default_factory=trio.Event)
    background: trio.Nursery | None = None

    def enter(self) -> None:
        """A generation request starts."""
        self.in_flight += 1
        if self.idle.is_set():
            self.idle = trio.Event()

    def leave(self) -> None:
        """A generation request ends (however it ends)."""
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()
