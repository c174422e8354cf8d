"""The `vllm serve` flags ringserve takes beyond its own, so published command lines run as is.

`ringserve.cli` adds these to the `serve` parser (`add_vllm_flags`), spells flags as vLLM does
(`--max_model_len` is `--max-model-len`: `normalize_flag_spelling`) and reads `--config FILE`
(`config_file_argv`). Three tables say what each flag does here, with the reason:

- `NO_EFFECT`: accepted, with one start-up log line saying it has no effect (`no_effect_lines`)
  because the thing it tunes does not exist here and outputs stay the same.
- `REFUSED`: a feature ringserve does not have and that would change outputs (LoRA, ...), or
  a flag vLLM itself replaced (`--speculative-model`: `--speculative-config`): giving the flag
  is a usage error naming it, never silently ignored.
- `ONLY_VALUES`: a flag whose default (or another listed value) is what ringserve does; any
  other value is a usage error naming the supported ones (`--kv-cache-dtype fp8`).

A flag in none of them, and not one of ringserve's own, stays argparse's "unrecognized
arguments" error (status 2).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_NO_EFFECT_DEST = "_vllm_no_effect_"


@dataclass(frozen=True)
class NoEffect:
    """A vLLM flag accepted with one log line.

    Attributes:
        flags: the option strings (long name first).
        reason: why it changes nothing here (the log line's parenthesis).
        takes_value: the flag takes a value (else it is a switch, `--no-` form included).
        nargs: argparse's nargs for a flag taking several values.
    """

    flags: tuple[str, ...]
    reason: str
    takes_value: bool = False
    nargs: str | None = None


@dataclass(frozen=True)
class Refused:
    """A vLLM flag refused: ringserve lacks the feature and it would change outputs."""

    flags: tuple[str, ...]
    reason: str
    takes_value: bool = True


@dataclass(frozen=True)
class OnlyValues:
    """A vLLM flag whose listed values are what ringserve does; others are refused."""

    flags: tuple[str, ...]
    allowed: tuple[str, ...]
    reason: str


_NO_CUDA_GRAPHS = ("ringserve captures decode steps by batch size (--cuda-graph-sizes); a "
                   "captured step reads any sequence length")

NO_EFFECT: tuple[NoEffect, ...] = (
    NoEffect(("--trust-remote-code",), "ringserve runs its own model implementations and "
             "never executes code from a model repository"),
    NoEffect(("--max-seq-len-to-capture",), _NO_CUDA_GRAPHS, takes_value=True),
    NoEffect(("--compilation-config", "-O"), "ringserve does not torch.compile the model",
             takes_value=True),
    NoEffect(("--disable-uvicorn-access-log",), "ringserve's HTTP server writes no access "
             "log; --enable-log-requests logs one line per request"),
    NoEffect(("--max-log-len",), "request log lines carry no prompt text to cut",
             takes_value=True),
    NoEffect(("--enable-sleep-mode",), "POST /sleep and /wake_up are always served, "
             "behind --admin-api-key"),
    NoEffect(("--swap-space",), "a preempted request is recomputed; nothing is swapped to "
             "CPU memory", takes_value=True),
    NoEffect(("--enable-reasoning",), "--reasoning-parser alone turns reasoning output on, "
             "as in vLLM since 0.9"),
    NoEffect(("--disable-custom-all-reduce",), "tensor-parallel all-reduce is "
             "torch.distributed's; there is no custom kernel to turn off"),
    NoEffect(("--disable-frontend-multiprocessing",), "the HTTP frontend and the engine "
             "core always run as they do; outputs are the same either way"),
    NoEffect(("--disable-fastapi-docs",), "ringserve serves no OpenAPI docs"),
)

# vLLM removed these two in favour of --speculative-config, which ringserve takes.
_SPECULATIVE_CONFIG = ("vLLM replaced it with --speculative-config; use --speculative-config "
                       "'{\"method\": \"draft_model\", \"model\": DRAFT, "
                       "\"num_speculative_tokens\": 4}'")

REFUSED: tuple[Refused, ...] = (
    Refused(("--speculative-model",), _SPECULATIVE_CONFIG),
    Refused(("--num-speculative-tokens",), _SPECULATIVE_CONFIG),
    Refused(("--hf-overrides",), "overriding the model's config is not implemented (edit "
            "config.json instead)"),
    Refused(("--rope-scaling",), "RoPE scaling overrides are not implemented"),
    Refused(("--rope-theta",), "RoPE overrides are not implemented"),
    Refused(("--disable-sliding-window",), "full attention over a sliding-window model is not "
            "implemented", takes_value=False),
    Refused(("--kv-transfer-config",), "disaggregated prefill (KV transfer) is not implemented"),
    Refused(("--return-tokens-as-token-ids",), "tokens are always returned as text",
            takes_value=False),
    Refused(("--tool-parser-plugin",), "tool parser plugins are not loaded; --tool-call-parser "
            "names a built-in parser"),
)

ONLY_VALUES: tuple[OnlyValues, ...] = (
    OnlyValues(("--kv-cache-dtype",), ("auto",), "the KV cache is kept in the model's dtype"),
    OnlyValues(("--pipeline-parallel-size", "-pp"), ("1",),
               "pipeline parallelism is not implemented"),
    OnlyValues(("--tokenizer-mode",), ("auto", "hf"), "the Hugging Face tokenizer is used"),
    OnlyValues(("--config-format",), ("auto", "hf"), "the model's config.json is read"),
    OnlyValues(("--chat-template-content-format",), ("auto", "string"),
               "message content is rendered into the chat template as a string"),
)


class _Refuse(argparse.Action):
    """Fails the parse with one line naming the flag, unless its value is an allowed one."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, reason: str,
                 allowed: tuple[str, ...] | None = None, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.reason = reason
        self.allowed = allowed

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        flag = self.option_strings[0]
        if self.allowed is None:
            parser.error(f"{flag} is not supported: {self.reason}")
        if values not in self.allowed:
            supported = ", ".join(self.allowed) if self.allowed else "none"
            reason = self.reason if "supported:" in self.reason else \
                f"{self.reason}; supported: {supported}"
            parser.error(f"{flag} {values} is not supported: {reason}")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Add every flag of the three tables to the `serve` parser."""
    group = parser.add_argument_group(
        "vLLM flags", "accepted so vLLM command lines run: see ringserve.vllm_flags")
    for entry in NO_EFFECT:
        dest = _NO_EFFECT_DEST + entry.flags[0].lstrip("-").replace("-", "_")
        help_text = f"no effect here ({entry.reason})"
        if entry.takes_value:
            group.add_argument(*entry.flags, dest=dest, nargs=entry.nargs,
                               default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(*entry.flags, dest=dest, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
    for refused in REFUSED:
        group.add_argument(*refused.flags, action=_Refuse, reason=refused.reason,
                           nargs=None if refused.takes_value else 0,
                           default=argparse.SUPPRESS, help=f"refused: {refused.reason}")
    for only in ONLY_VALUES:
        shown = ", ".join(only.allowed) or "none"
        group.add_argument(*only.flags, action=_Refuse, reason=only.reason,
                           allowed=only.allowed, default=argparse.SUPPRESS,
                           help=f"supported: {shown} ({only.reason})")


def no_effect_lines(ns: argparse.Namespace) -> list[str]:
    """One start-up log line for each no-effect flag that was given."""
    lines = []
    for entry in NO_EFFECT:
        dest = _NO_EFFECT_DEST + entry.flags[0].lstrip("-").replace("-", "_")
        if getattr(ns, dest, False) not in (False, None):  # given, and not as --no-...
            lines.append(f"ringserve: {entry.flags[0]} has no effect here ({entry.reason})")
    return lines


_LONG_FLAG = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_-]*")


def normalize_flag_spelling(argv: Sequence[str]) -> list[str]:
    """`--max_model_len` as `--max-model-len` (vLLM accepts either), values untouched."""
    out = []
    for token in argv:
        name, sep, value = token.partition("=")
        if _LONG_FLAG.fullmatch(name):
            token = name.replace("_", "-") + sep + value
        out.append(token)
    return out


def config_file_argv(path: str, negatable: set[str]) -> list[str]:
    """The flags a vLLM `--config` YAML file holds, as command-line tokens.

    Keys are long flag names, with or without dashes in front, spelled with dashes or
    underscores. `true` is the bare switch; `false` is its `--no-` form where the flag has
    one (else left out: a switch is off by default); a list is several values; a mapping is
    its JSON text; null is left out.

    Args:
        path: the YAML file.
        negatable: the switches with a `--no-` form.

    Raises:
        ValueError: the file cannot be read, is not YAML, or is not a mapping of flags (one
            line naming the file).
    """
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"--config {path}: cannot read the file: {reason}") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ValueError(f"--config {path}: not valid YAML{at}: {problem}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values, got "
                         f"a {type(data).__name__}")
    argv: list[str] = []
    for key, value in data.items():
        argv.extend(_tokens(path, key, value, negatable))
    return argv


def _tokens(path: str, key: object, value: object, negatable: set[str]) -> list[str]:
    if not isinstance(key, str) or not key.strip("-"):
        raise ValueError(f"--config {path}: {key!r} is not a flag name")
    flag = "--" + key.lstrip("-").replace("_", "-")
    if flag == "--config":
        raise ValueError(f"--config {path}: a config file cannot name another (config key)")
    if value is None:
        return []
    if isinstance(value, bool):
        if value:
            return [flag]
        return ["--no-" + flag[2:]] if flag in negatable else []
    if isinstance(value, list):
        return [flag, *(_scalar(v) for v in value)] if value else []
    # `--flag=value`: a value that starts with "-" stays a value.
    return [f"{flag}={_scalar(value)}"]


def _scalar(value: object) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
