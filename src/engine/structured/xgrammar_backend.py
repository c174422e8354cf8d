"""The xgrammar backend (the default): constraints compiled by one `xgr.GrammarCompiler` per
engine core, matched by `xgr.GrammarMatcher`.

`xgrammar_grammar` turns a `StructuredOutputsParams` into an `xgr.Grammar` without a tokenizer;
the frontend's `validation.py` calls it to refuse a bad spec before it reaches the core, and
`XgrammarBackend.compile` compiles the same grammar for the model's tokenizer.

Strict JSON: xgrammar's JSON-schema strings already refuse raw U+0000-U+001F (its string rule
is `[^\\0-\\x1f"\\\\]` or an escape), but a schema `pattern` is matched against the raw string
body, so a pattern that names a quote, a backslash or a control character literally (`"`,
`\\\\`, `\\n`, `\\x01`) would let it emit that byte unescaped; such a schema is refused here
(the guidance backend escapes them). Keywords xgrammar 0.2.9 silently ignores (`not`, `if`,
`uniqueItems`, `contains`, `allOf` of several schemas, ...) are refused too, so a schema that
compiles is enforced. xgrammar compiles `oneOf` as `anyOf`, which is exact only when no value can
match two branches: a `oneOf` whose branches are not proven mutually exclusive (`one_of`) is
refused. `json_object` is the schema `{"type": "object"}` (an object, never a bare value).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import torch
import xgrammar as xgr

from ringserve.engine.structured.one_of import overlapping_branches
from ringserve.engine.structured.schema import load_schema
from ringserve.sampling_params import StructuredOutputsParams

__all__ = ["XgrammarBackend", "XgrammarMatcher", "xgrammar_grammar"]

# Keywords xgrammar accepts but does not enforce (checked against 0.2.9).
_UNENFORCED = ("not", "if", "then", "else", "uniqueItems", "contains", "dependentSchemas",
               "unevaluatedItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                  "propertyNames", "unevaluatedProperties", "unevaluatedItems",
                  "additionalItems")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
# "[hh:mm:ss] /project/cpp/file.cc:123: " in front of xgrammar's C++ messages.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")
# Escapes that denote a quote, a backslash or a control character (`\d`, `\s`, `\w` are fine:
# xgrammar's JSON-string classes leave those characters out).
_RAW_ESCAPE = re.compile(r"\\(?:[\\\"nrtfv0aeb]|c.|x\{?([0-9A-Fa-f]{1,6})|u\{?([0-9A-Fa-f]{1,6}))")


def _message(exc: BaseException) -> str:
    text = str(exc).strip()
    return _CPP_PREFIX.sub("", text.splitlines()[0] if text else type(exc).__name__)


def _subschemas(schema: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every (JSON-pointer-ish path, schema object) in a schema, itself first."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key in _SUBSCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield from _subschemas(sub, f"{path}/{key}/{name}")
    for key in _SUBSCHEMA_ONE:
        yield from _subschemas(schema.get(key), f"{path}/{key}")
    for key in _SUBSCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                yield from _subschemas(sub, f"{path}/{key}/{i}")


def _pattern_emits_raw(pattern: str) -> bool:
    """True when `pattern` can put a quote, a backslash or a control character into a JSON
    string verbatim (characters inside a negated class `[^...]` only take away)."""
    negated = False
    depth = 0
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            m = _RAW_ESCAPE.match(pattern, i)
            if m is not None:
                code = m.group(1) or m.group(2)
                if not negated and (code is None or int(code, 16) in _RAW_CODES):
                    return True
                i = m.end()
                continue
            i += 2
            continue
        if ch == "[":
            depth += 1
            if depth == 1:
                negated = pattern.startswith("^", i + 1)
        elif ch == "]" and depth:
            depth -= 1
            negated = negated and depth > 0
        elif not negated and (ch == '"' or ord(ch) < 0x20):
            return True
        i += 1
    return False


_RAW_CODES = frozenset([*range(0x20), 0x22, 0x5C])
_NEGATED_CLASS = re.compile(r"\[\^((?:[^\]\\]|\\.)*)\]")
_REGEX_CALL = re.compile(r'Regex\("(?:[^"\\]|\\.)*"[^)]*\)')


def _check_schema_features(schema: Any) -> None:
    for path, sub in _subschemas(schema, "#"):
        for key in _UNENFORCED:
            if key in sub:
                raise ValueError(f"structured_outputs.json: {key!r} at {path} is not supported "
                                 "by the xgrammar backend (try the guidance backend)")
        all_of = sub.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            raise ValueError(f"structured_outputs.json: 'allOf' with several schemas at {path} "
                             "is not supported by the xgrammar backend")
        _check_one_of(schema, sub.get("oneOf"), path)
        patterns = [sub.get("pattern")]
        properties = sub.get("patternProperties")
        if isinstance(properties, dict):
            patterns.extend(properties)
        for pattern in patterns:
            if isinstance(pattern, str) and _pattern_emits_raw(pattern):
                raise ValueError(
                    f"structured_outputs.json: the pattern {pattern!r} at {path} names a quote, "
                    "backslash or control character, which the xgrammar backend would emit "
                    "unescaped (invalid JSON); use the guidance backend")


def _check_one_of(root: Any, branches: Any, path: str) -> None:
    """Refuse a `oneOf` that xgrammar, which enforces it as `anyOf`, would not enforce."""
    if not isinstance(branches, list):
        return
    pair = overlapping_branches(root, branches)
    if pair is not None:
        raise ValueError(
            f"structured_outputs.json: 'oneOf' at {path}: branches {pair[0]} and {pair[1]} are "
            "not mutually exclusive, and the xgrammar backend enforces 'oneOf' as 'anyOf' (it "
            "would accept an output matching several branches, which the schema forbids); "
            "allowed: branches of different types or different 'const' / 'enum' values, or "
            "objects that require a property with a different 'const' / 'enum' in each (a "
            "discriminator); otherwise use 'anyOf'")


def _ebnf_literal(text: str) -> str:
    out = []
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif 0xD800 <= code < 0xE000:
            raise ValueError(f"structured_outputs.choice: {text!r} holds a lone surrogate")
        else:
            out.append(f"\\U{code:08x}" if code > 0xFFFF else f"\\u{code:04x}")
    return '"' + "".join(out) + '"'


def _json_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    if params.whitespace_pattern is not None:
        raise ValueError("structured_outputs.whitespace_pattern: not supported by the xgrammar "
                         "backend (use disable_any_whitespace, or the guidance backend)")
    schema = load_schema(params)
    _check_schema_features(schema)
    fmt: dict[str, Any] = ({"any_whitespace": False, "separators": (",", ":")}
                           if params.disable_any_whitespace else {"any_whitespace": True})
    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), **fmt)
        text = str(grammar)
        strict = _strict_strings(text)
        return grammar if strict == text else xgr.Grammar.from_ebnf(strict)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"structured_outputs.json: invalid JSON schema: {_message(exc)}"
                         ) from None


def _strict_strings(ebnf: str) -> str:
    """xgrammar's length-limited strings (`minLength` / `maxLength`) use `[^"\\\r\n]`, which
    lets raw tabs and other control characters into a string; add U+0000-U+001F to every
    negated class outside `Regex(...)` (in a JSON grammar those only occur inside strings)."""
    parts, last = [], 0
    for m in _REGEX_CALL.finditer(ebnf):
        parts += [_NEGATED_CLASS.sub(_add_controls, ebnf[last:m.start()]), m.group()]
        last = m.end()
    parts.append(_NEGATED_CLASS.sub(_add_controls, ebnf[last:]))
    return "".join(parts)


def _add_controls(m: re.Match[str]) -> str:
    return m.group() if "\\0-\\x1f" in m.group(1) else "[^\\0-\\x1f" + m.group(1) + "]"


def _structural_tag_grammar(spec: str) -> xgr.Grammar:
    try:
        tag = json.loads(spec)
        if isinstance(tag, dict) and "structures" in tag:  # the legacy {structures, triggers}
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                           end=s["end"]) for s in tag["structures"]]
            return xgr.Grammar.from_structural_tag(items, tag["triggers"])
        return xgr.Grammar.from_structural_tag(spec)
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"structured_outputs.structural_tag: invalid structural tag: "
                         f"{_message(exc)}") from None


def xgrammar_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The xgrammar grammar of a constraint (no tokenizer needed).

    Raises:
        ValueError: an invalid spec or one xgrammar cannot enforce, naming the field.
    """
    kind = params.kind
    if kind in ("json", "json_object"):
        return _json_grammar(params)
    if kind == "structural_tag":
        return _structural_tag_grammar(params.spec)
    try:
        if kind == "regex":
            return xgr.Grammar.from_regex(params.spec)
        if kind == "choice":
            choices = params.choice or []
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(map(_ebnf_literal, choices)))
        text = params.spec
        if "::=" in text:
            return xgr.Grammar.from_ebnf(text)
        return xgr.Grammar.from_lark(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        what = {"regex": "invalid regex", "choice": "invalid choices"}.get(kind, "invalid grammar")
        raise ValueError(f"structured_outputs.{kind}: {what}: {_message(exc)}") from None


class XgrammarMatcher:
    """One request's `xgr.GrammarMatcher` behind the `GrammarMatcher` protocol."""

    __slots__ = ("_matcher",)

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)


class XgrammarBackend:
    """Compiles constraints with xgrammar for one tokenizer.

    Args:
        tokenizer: the model's transformers tokenizer.
        vocab_size: the model's vocabulary size (ids past the tokenizer's are never allowed).
        stop_token_ids: the ids that end generation (default: the tokenizer's EOS).
    """

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int,
                 stop_token_ids: list[int] | None = None) -> None:
        if stop_token_ids is None and getattr(tokenizer, "eos_token_id", None) is not None:
            stop_token_ids = [int(tokenizer.eos_token_id)]
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids)
        # Thread-safe, with its own cache; compiles run on the manager's pool threads.
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Compile a constraint for this tokenizer.

        Raises:
            ValueError: naming the field (`structured_outputs.json: ...`).
        """
        grammar = xgrammar_grammar(params)
        try:
            return self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"structured_outputs.{params.kind}: cannot compile: "
                             f"{_message(exc)}") from None

    def matcher(self, compiled: xgr.CompiledGrammar) -> XgrammarMatcher:
        """A fresh matcher at the start of `compiled`."""
        return XgrammarMatcher(compiled)
