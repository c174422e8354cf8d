"""The llguidance backend (`"guidance"`): constraints as llguidance grammars, matched by
`llguidance.LLMatcher` over an `LLTokenizer` built once from the model's tokenizer.

`guidance_grammar` turns a `StructuredOutputsParams` into llguidance's grammar text without a
tokenizer (a structural tag, in either form, through `guidance_structural_tag.py`);
`validation.py` checks it with `LLMatcher.validate_grammar`, and `GuidanceBackend.compile`
builds it for the tokenizer.

Strict JSON: llguidance's JSON strings refuse raw U+0000-U+001F and it matches a schema
`pattern` against the decoded string, emitting quotes, backslashes and control characters
escaped; unknown or unimplemented keywords are errors (it is not lenient by default), so what
compiles is enforced. `json_object` is the schema `{"type": "object"}`. `whitespace_pattern`
is handed to llguidance's JSON compiler after checking it can only match JSON whitespace
(space, tab, newline, carriage return); `disable_any_whitespace` turns flexible whitespace off.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from ringserve.engine.structured.guidance_structural_tag import structural_tag_grammar
from ringserve.engine.structured.schema import load_schema
from ringserve.sampling_params import StructuredOutputsParams

__all__ = ["GuidanceBackend", "GuidanceMatcher", "guidance_grammar"]

# A regex built only from JSON's four whitespace characters and regex operators (no ranges,
# classes like \s, negation or dots), so whatever it matches `json.loads` accepts.
_JSON_WHITESPACE_REGEX = re.compile(
    r"(?:\(\?:|[()\[\]|*+?]|\{\d+(?:,\d*)?\}|[ \t\n\r]|\\[tnr ]|\\x(?:20|09|0[aAdD])"
    r"|\\u00(?:20|09|0[aAdD]))*")


def _check_whitespace_pattern(pattern: str) -> None:
    if not _JSON_WHITESPACE_REGEX.fullmatch(pattern):
        raise ValueError(
            f"structured_outputs.whitespace_pattern: got {pattern!r}, allowed: a regex over "
            "JSON whitespace only (space, \\t, \\n, \\r with ( ) [ ] | * + ? {m,n}), "
            "e.g. '[ \\n]{0,2}'")


def _json_options(params: StructuredOutputsParams) -> JsonCompileOptions:
    options: JsonCompileOptions = {"lenient": False}
    if params.disable_any_whitespace:
        options["whitespace_flexible"] = False
    elif params.whitespace_pattern is not None:
        _check_whitespace_pattern(params.whitespace_pattern)
        options["whitespace_pattern"] = params.whitespace_pattern
    return options


def guidance_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet validated: see `validate`).

    Raises:
        ValueError: a spec that cannot even be converted, naming the field.
    """
    kind = params.kind
    if kind in ("json", "json_object"):
        options = _json_options(params)
        schema = load_schema(params)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                  overrides=options)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json: invalid JSON schema: {exc}") from None
    if kind == "structural_tag":
        return structural_tag_grammar(params.spec)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.spec)
    if kind == "choice":
        choices = params.choice or []
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices))
    try:
        return llguidance.grammar_from("grammar", params.spec)
    except ValueError as exc:
        raise ValueError(f"structured_outputs.grammar: invalid grammar: {exc}") from None


_WHAT = {"json": "invalid JSON schema", "json_object": "invalid JSON schema",
         "regex": "invalid regex", "choice": "invalid choices", "grammar": "invalid grammar",
         "structural_tag": "invalid structural tag"}


def _refused(params: StructuredOutputsParams, error: str) -> ValueError:
    kind = params.kind
    field = "json" if kind == "json_object" else kind
    return ValueError(f"structured_outputs.{field}: {_WHAT[kind]}: "
                      f"{error.strip().splitlines()[0]}")


def validate(params: StructuredOutputsParams) -> None:
    """Check a constraint without a tokenizer.

    Raises:
        ValueError: llguidance refuses it; the message names the field.
    """
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        guidance_grammar(params))
    if is_error:
        raise _refused(params, messages[0] if messages else "refused")


class GuidanceMatcher:
    """One request's `LLMatcher` behind the `GrammarMatcher` protocol."""

    __slots__ = ("_eos", "_matcher", "_scratch", "_terminated", "_vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, eos: frozenset[int], vocab_size: int,
                 scratch: torch.Tensor | None) -> None:
        self._matcher = matcher
        self._eos = eos
        self._terminated = False
        self._vocab_size = vocab_size
        self._scratch = scratch  # llguidance's own width, when the tokenizer outgrows vocab

    def accept_token(self, token_id: int) -> bool:
        # consume_token on a forbidden token would leave the matcher in an error state for
        # good; the protocol wants the state unchanged, so check first. A stopped matcher
        # (nothing can extend the match) takes only EOS, which validate_tokens refuses.
        matcher = self._matcher
        if matcher.is_error() or self._terminated:
            return False
        if token_id in self._eos:
            if not matcher.is_accepting():
                return False
        elif matcher.is_stopped() or matcher.validate_tokens([token_id]) != 1:
            return False
        if not matcher.consume_token(token_id):
            return False
        self._terminated = token_id in self._eos
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        scratch = self._scratch
        if scratch is None:
            llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)
            return
        llguidance.torch.fill_next_token_bitmask(self._matcher, scratch, 0)
        words = bitmask.shape[1]
        bitmask[row] = scratch[0, :words]
        tail = self._vocab_size % 32
        if tail:  # ids at and past vocab_size in the last word
            bitmask[row, self._vocab_size // 32] &= (1 << tail) - 1

    def is_terminated(self) -> bool:
        return self._terminated

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)
            self._terminated = False


class GuidanceBackend:
    """Compiles constraints with llguidance for one tokenizer.

    Args:
        tokenizer: the model's transformers tokenizer (a fast one).
        vocab_size: the model's vocabulary size (ids past the tokenizer's are never allowed).
        stop_token_ids: the ids that end generation (default: the tokenizer's EOS).
    """

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int,
                 stop_token_ids: list[int] | None = None) -> None:
        self.vocab_size = vocab_size
        # llguidance needs every tokenizer id; ids past the model's vocab are cut off the mask.
        n_vocab = max(vocab_size, len(tokenizer))
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab,
                                                       eos_token=stop_token_ids)
        self._wide = n_vocab > vocab_size
        self._n_vocab = n_vocab
        self._eos = frozenset(self._tokenizer.eos_tokens)

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A matcher at the start of the constraint, never advanced: each request's matcher
        is a deep copy (cheaper than building the lexer again).

        Raises:
            ValueError: naming the field (`structured_outputs.json: ...`).
        """
        grammar = guidance_grammar(params)
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise _refused(params, template.get_error())
        return template

    def matcher(self, compiled: llguidance.LLMatcher) -> GuidanceMatcher:
        """A fresh matcher at the start of a compiled constraint."""
        scratch = (torch.empty((1, (self._n_vocab + 31) // 32), dtype=torch.int32)
                   if self._wide else None)
        return GuidanceMatcher(compiled.deep_copy(), self._eos, self.vocab_size, scratch)
