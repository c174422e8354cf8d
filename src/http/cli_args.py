"""The flags of `ringserve serve` that belong to the HTTP layer, and `ServeSettings` from them.

`ringserve.cli` adds these next to the engine flags of `EngineArgs.add_cli_args` (which already
carry `--served-model-name`, `--max-num-queued-reqs`, `--max-num-queued-tokens`,
`--disable-log-stats` and `--enable-log-requests`), then calls `settings_from_args` once the
engine configuration exists (the served model name comes from it). Names follow vLLM's
(`--host`, `--port`, `--api-key`, `--chat-template`, `--root-path`, `--allowed-origins`,
`--uvicorn-log-level`, ...). `check_serve_args` runs the checks that need no model, so a
command line can be vetted without loading one. Every bad value raises `ValueError` naming
the flag, the value and what is allowed, so the CLI prints one line.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
from pathlib import Path

from ringserve import envs
from ringserve.config import EngineConfig
from ringserve.engine.flag_values import parse_bytes
from ringserve.http.lora_modules import parse_lora_modules
from ringserve.http.settings import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    ServeSettings,
    split_api_keys,
)
from ringserve.http.tool_parsers import TOOL_PARSERS, check_tool_parser

_DEFAULTS = ServeSettings()

# vLLM's --uvicorn-log-level values, as levels of hypercorn's loggers ("trace" is below DEBUG).
LOG_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING,
              "info": logging.INFO, "debug": logging.DEBUG, "trace": logging.DEBUG}
_METRICS_PREFIX = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add the HTTP-server flags (`--host`, `--port`, `--api-key`, ...) to `parser`."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=_DEFAULTS.host,
                       help=f"address to listen on (default: {_DEFAULTS.host})")
    group.add_argument("--port", type=int, default=_DEFAULTS.port,
                       help="TCP port to listen on; 0 picks a free one "
                            f"(default: {_DEFAULTS.port})")
    group.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                       help="keys the /v1 routes accept as 'Authorization: Bearer KEY' or "
                            "'x-api-key: KEY'; several as separate values (as vLLM) or "
                            "comma-separated, any one authorizes (default: "
                            "$RINGSERVE_API_KEY, else $VLLM_API_KEY, else open)")
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="ADAPTER",
                       help="LoRA adapters served by name (needs --enable-lora): name=path, or "
                            '\'{"name": ..., "path": ..., "base_model_name": ...}\'; a '
                            "request selects one with its model field")
    group.add_argument("--admin-api-key", default=None,
                       help="key the control routes (/sleep, /wake_up, /pause, /resume, "
                            "/reset_prefix_cache, the weight-update and RL routes, "
                            "/fault_tolerance/*) require (default: those routes are refused)")
    group.add_argument("--chat-template", default=None,
                       help="chat template: a file path or the Jinja text itself "
                            "(default: the tokenizer's)")
    group.add_argument("--certfile", "--ssl-certfile", dest="certfile", default=None,
                       help="TLS certificate (PEM); with --keyfile serves HTTPS, h2 by ALPN")
    group.add_argument("--keyfile", "--ssl-keyfile", dest="keyfile", default=None,
                       help="TLS private key (PEM) for --certfile")
    group.add_argument("--max-request-body-bytes", type=parse_bytes,
                       default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                       help="larger request bodies get 413, e.g. 16MiB "
                            f"(default: {DEFAULT_MAX_REQUEST_BODY_BYTES})")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='serve tool_choice "auto" (the default with tools): the model '
                            "decides, --tool-call-parser reads its calls")
    group.add_argument("--tool-call-parser", default=None,
                       help="how the model writes tool calls: "
                            f"{', '.join(sorted(TOOL_PARSERS))}")
    group.add_argument("--shutdown-timeout", type=float, default=_DEFAULTS.shutdown_timeout,
                       help="seconds in-flight requests may take to finish after SIGTERM/SIGINT "
                            f"(default: {_DEFAULTS.shutdown_timeout:g})")
    group.add_argument("--timeout-keep-alive", type=float, default=_DEFAULTS.timeout_keep_alive,
                       help="seconds an idle keep-alive connection (or one that has not sent "
                            "its first request yet) stays open "
                            f"(default: {_DEFAULTS.timeout_keep_alive:g}, as vLLM)")
    group.add_argument("--root-path", default=_DEFAULTS.root_path,
                       help="path prefix a proxy serves the API under (ASGI root_path): "
                            "/PREFIX/v1/... and /v1/... are both served")
    for name, what in (("origins", "origins"), ("methods", "HTTP methods"),
                       ("headers", "request headers")):
        group.add_argument(f"--allowed-{name}", nargs="+", type=_json_or_text, default=["*"],
                           help=f"CORS: allowed {what}, as vLLM's JSON list "
                                f"('[\"a\", \"b\"]') or as separate values (default: *)")
    group.add_argument("--allow-credentials", action="store_true",
                       help="CORS: allow credentials (cookies, Authorization) cross-origin")
    group.add_argument("--uvicorn-log-level", choices=tuple(LOG_LEVELS), default="info",
                       help="level of the HTTP server's own log (hypercorn; default: info)")
    group.add_argument("--metrics-prefix", default=_DEFAULTS.metrics_prefix,
                       help="prefix of the metric families on /metrics; vllm exposes vllm:... "
                            "for existing dashboards and autoscalers (default: ringserve)")
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="chat and completions usage carries "
                            "prompt_tokens_details.cached_tokens (the prefix-cache hit)")
    group.add_argument("--responses-store-max-entries", type=int,
                       default=_DEFAULTS.responses_store_max_entries,
                       help="most responses /v1/responses stores for previous_response_id "
                            "and GET (least recently used evicted; 0 stores none; default: "
                            f"{_DEFAULTS.responses_store_max_entries})")
    group.add_argument("--responses-store-ttl", type=float,
                       default=_DEFAULTS.responses_store_ttl,
                       help="seconds a stored response is kept after its last use "
                            f"(default: {_DEFAULTS.responses_store_ttl:g})")
    group.add_argument("--config", metavar="FILE",
                       help="read flags from a YAML file (keys: long flag names); flags on "
                            "the command line win")


def _json_or_text(text: str) -> list[str]:
    """One `--allowed-*` value: vLLM's JSON list of strings, or a plain item."""
    if not text.lstrip().startswith("["):
        return [text]
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not a JSON list: {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def check_serve_args(ns: argparse.Namespace) -> None:
    """The HTTP flags' checks that need no model (ranges, parsers, prefixes).

    Raises:
        ValueError: a flag's value is not allowed (the message names the flag).
    """
    if not 0 <= ns.port <= 65535:
        raise ValueError(f"--port: got {ns.port}, allowed: 0..65535")
    if not ns.host:
        raise ValueError("--host: got an empty string, allowed: an address or host name")
    if ns.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes: got {ns.max_request_body_bytes}, "
                         "allowed: a byte count >= 1")
    if not (math.isfinite(ns.shutdown_timeout) and ns.shutdown_timeout >= 0):
        raise ValueError(f"--shutdown-timeout: got {ns.shutdown_timeout}, allowed: seconds >= 0")
    if not (math.isfinite(ns.timeout_keep_alive) and ns.timeout_keep_alive > 0):
        raise ValueError(f"--timeout-keep-alive: got {ns.timeout_keep_alive}, allowed: "
                         "seconds > 0")
    if ns.tool_call_parser is not None:
        check_tool_parser(ns.tool_call_parser)
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (allowed: "
                         f"{', '.join(sorted(TOOL_PARSERS))})")
    if ns.responses_store_max_entries < 0:
        raise ValueError(f"--responses-store-max-entries: got {ns.responses_store_max_entries},"
                         " allowed: an integer >= 0")
    if not (math.isfinite(ns.responses_store_ttl) and ns.responses_store_ttl > 0):
        raise ValueError(f"--responses-store-ttl: got {ns.responses_store_ttl}, allowed: "
                         "seconds > 0")
    root_path(ns.root_path)
    api_key(ns)
    if hasattr(ns, "api_server_count"):  # the scale-out flags are there (`ringserve serve`)
        from ringserve.http.cluster_args import check_cluster_args

        check_cluster_args(ns)
    if not _METRICS_PREFIX.fullmatch(ns.metrics_prefix):
        raise ValueError(f"--metrics-prefix: got {ns.metrics_prefix!r}, allowed: a Prometheus "
                         "name (letters, digits, _; not starting with a digit), e.g. vllm")


def api_key(ns: argparse.Namespace) -> str | None:
    """The API keys as one comma-separated list: `--api-key`'s values, else the environment's
    (`envs.api_key`); None: the API routes are open.

    Raises:
        ValueError: an empty key in the list (the message names `--api-key`, or the variable
            the keys came from; never a key).
    """
    given = ns.api_key
    if given is not None:
        text, source = ",".join([given] if isinstance(given, str) else given), "--api-key"
    else:
        variable = envs.api_key_variable()
        if variable is None:
            return None
        text, source = envs.api_key() or "", f"--api-key (from ${variable})"
    split_api_keys(text, source)
    return text


def root_path(value: str | None) -> str:
    """`--root-path` normalized: "" or "/a/b" (a trailing slash dropped).

    Raises:
        ValueError: a non-empty value not starting with "/".
    """
    if not value or value == "/":
        return ""
    if not value.startswith("/"):
        raise ValueError(f"--root-path: got {value!r}, allowed: a path starting with /, "
                         "e.g. /llm")
    return value.rstrip("/")


def apply_server_log_level(level: str) -> None:
    """Set hypercorn's loggers to `--uvicorn-log-level` (vLLM's name for its server's level)."""
    logging.getLogger("hypercorn").setLevel(LOG_LEVELS[level])


def settings_from_args(ns: argparse.Namespace, engine_config: EngineConfig) -> ServeSettings:
    """Build the frozen `ServeSettings` from the parsed flags.

    Args:
        ns: the namespace `add_serve_args` (and `EngineArgs.add_cli_args`) filled.
        engine_config: the engine's configuration (served model name, request logging).

    Raises:
        ValueError: a flag's value is not allowed (the message names the flag).
    """
    check_serve_args(ns)
    certfile, keyfile = _tls_files(ns.certfile, ns.keyfile)
    names = _served_names(ns, engine_config.model_config.served_model_name)
    return ServeSettings(
        host=ns.host,
        port=ns.port,
        served_model_name=names[0],
        served_model_aliases=names[1:],
        api_key=api_key(ns),
        admin_api_key=ns.admin_api_key or None,
        chat_template=resolve_chat_template(ns.chat_template),
        max_request_body_bytes=ns.max_request_body_bytes,
        shutdown_timeout=ns.shutdown_timeout,
        timeout_keep_alive=ns.timeout_keep_alive,
        certfile=certfile,
        keyfile=keyfile,
        enable_log_requests=engine_config.observability_config.enable_log_requests,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        tool_call_parser=ns.tool_call_parser,
        root_path=root_path(ns.root_path),
        allowed_origins=_flat(ns.allowed_origins),
        allowed_methods=_flat(ns.allowed_methods),
        allowed_headers=_flat(ns.allowed_headers),
        allow_credentials=ns.allow_credentials,
        metrics_prefix=ns.metrics_prefix,
        enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
        responses_store_max_entries=ns.responses_store_max_entries,
        responses_store_ttl=ns.responses_store_ttl,
        lora_modules=parse_lora_modules(getattr(ns, "lora_modules", None),
                                        engine_config.lora_config, names),
    )


def _served_names(ns: argparse.Namespace, first: str) -> tuple[str, ...]:
    """Every `--served-model-name` (the engine's, which metrics use, first)."""
    given = getattr(ns, "served_model_name", None)
    names = [given] if isinstance(given, str) else list(given or [])
    return tuple(dict.fromkeys([first, *names]))


def _flat(values: list[list[str]] | list[str]) -> tuple[str, ...]:
    """The items of an `--allowed-*` flag (each value parsed into a list, or the default)."""
    items: list[str] = []
    for value in values:
        items.extend([value] if isinstance(value, str) else value)
    return tuple(items)


def resolve_chat_template(value: str | None) -> str | None:
    """The template text for `--chat-template` (a file path or the template itself).

    As in vLLM: an existing file is read; a value holding any of `{`, `}` or a newline is
    the template itself; anything else is taken for a mistyped path.

    Raises:
        ValueError: the value looks like a path but no such file exists, or it cannot be read.
    """
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template: cannot read {value}: {exc}") from None
    if any(ch in value for ch in "{}\n"):
        return value
    raise ValueError(f"--chat-template: {value!r} is not a file, nor a Jinja template "
                     "(allowed: a path to a template file, or the template text)")


def _tls_files(certfile: str | None, keyfile: str | None) -> tuple[str | None, str | None]:
    if (certfile is None) != (keyfile is None):
        given, missing = ("--certfile", "--keyfile") if keyfile is None else ("--keyfile",
                                                                             "--certfile")
        raise ValueError(f"{given} needs {missing} too (TLS takes a certificate and its key)")
    for flag, name in (("--certfile", certfile), ("--keyfile", keyfile)):
        if name is not None and not Path(name).is_file():
            raise ValueError(f"{flag}: no such file: {name}")
    return certfile, keyfile
