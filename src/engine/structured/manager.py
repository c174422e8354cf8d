"""The engine core's structured outputs: grammars compiled off the busy loop, one matcher per
request, and one packed bitmask per step.

The scheduler asks `StructuredOutputManager.grammar_for(params, prompt)` when a constrained
request arrives: compilation starts on a thread pool (cached by `StructuredOutputsParams.key()`,
so a repeated schema compiles once) and the request waits in WAITING_FOR_GRAMMAR until its
`RequestGrammar.ready()`; other requests keep running meanwhile, and the pool's completion
wakes the busy loop (`wake`). The backend itself (xgrammar or llguidance, `backend.py`) is
built on the pool too, on first use, from the model's tokenizer.

Each step, after the forward was submitted, the core calls `bitmask(request_grammars)` for the
step's constrained rows (`SchedulerOutput.grammar_req_ids`); the matchers advance as the
scheduler appends sampled tokens (`RequestGrammar.accept`), so under async scheduling the mask
of step N+1 is computed once step N's tokens are in. With a reasoning parser, tokens up to the
end-of-thinking token are not constrained.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ringserve.config import EngineConfig
from ringserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

__all__ = ["AllowAll", "RequestGrammar", "StructuredOutputManager"]

# The end-of-thinking token of each reasoning parser (constraints start after it).
_REASONING_END = {"qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>")}
# Distinct compiled grammars kept (a dict in insertion order: the oldest is dropped first).
_CACHE_SIZE = 256


class RequestGrammar:
    """One request's grammar: compiling, then a matcher that follows its sampled tokens.

    Attributes:
        error: why the request cannot be constrained (its compile failed, a token the grammar
            forbids was sampled, or no token is allowed), once known.
    """

    __slots__ = ("_compiled", "_manager", "_matcher", "_may_open", "_prompt", "_think",
                 "error", "reasoning_ended")

    def __init__(self, compiled: Future[tuple[Any, Any]], manager: StructuredOutputManager,
                 prompt_token_ids: Sequence[int]) -> None:
        self._compiled = compiled
        self._manager = manager
        self._prompt = prompt_token_ids
        self._matcher: Any = None
        self._think: tuple[int, int] | None = None  # (start, end) of thinking
        self.reasoning_ended = True
        # qwen3 without thinking open in the prompt: the first token decides (a <think>
        # opens it; anything else is constrained output).
        self._may_open = False
        self.error: str | None = None

    def ready(self) -> bool:
        """True once compiled (or failed: then `error` says why); never blocks."""
        if self._matcher is not None or self.error is not None:
            return True
        if not self._compiled.done():
            return False
        try:
            backend, compiled = self._compiled.result()
            self._matcher = backend.matcher(compiled)
        except Exception as exc:
            self.error = f"structured_outputs: {exc}"
            return True
        self._think, self.reasoning_ended, self._may_open = self._manager.reasoning_state(
            self._prompt)
        self._prompt = ()
        return True

    def accept(self, token_ids: Sequence[int]) -> bool:
        """Advance by newly sampled tokens; False (and `error` set) on a forbidden one."""
        matcher = self._matcher
        if matcher is None:
            return self.error is None
        for token in token_ids:
            think = self._think
            if self._may_open:
                self._may_open = False
                if think is not None and token == think[0]:
                    self.reasoning_ended = False
                    continue
            if not self.reasoning_ended:
                self.reasoning_ended = think is not None and token == think[1]
                continue
            if matcher.is_terminated():
                continue  # tokens after the end (ignore_eos): unconstrained
            if not matcher.accept_token(token):
                self.error = f"the sampled token {token} is not allowed by the grammar"
                return False
        return True

    def fill(self, bitmask: Any, row: int) -> bool:
        """Write the allowed tokens into `bitmask[row]`; False (the row left all-allowed)
        while reasoning or after the grammar's end."""
        matcher = self._matcher
        if matcher is None or not self.reasoning_ended or matcher.is_terminated():
            return False
        matcher.fill_bitmask(bitmask, row)
        if self._may_open and self._think is not None:
            start = self._think[0]  # thinking may still open here
            bitmask[row, start // 32] |= _bit(start % 32)
        return True


    def valid_drafts(self, drafts: Sequence[int]) -> int:
        """How many of a request's `drafts` (speculative decoding) the grammar takes in a row
        from its state; the state is the same afterwards (the matcher rolls back). 0 while
        reasoning, before the first token decides whether thinking opens, or after the end."""
        matcher = self._matcher
        if (matcher is None or not self.reasoning_ended or self._may_open
                or matcher.is_terminated()):
            return 0
        count = 0
        for token in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            count += 1
        matcher.rollback(count)
        return count

    def fill_after(self, bitmask: Any, row: int, drafts: Sequence[int]) -> bool:
        """`fill` for the state after `drafts` (a prefix `valid_drafts` accepted): the
        bitmask row of a draft position. The state is the same afterwards."""
        matcher = self._matcher
        if not drafts or matcher is None:
            return self.fill(bitmask, row)
        taken = 0
        try:
            for token in drafts:
                if not matcher.accept_token(token):
                    return False  # not a checked prefix: the row stays all-allowed
                taken += 1
            return self.fill(bitmask, row)
        finally:
            matcher.rollback(taken)


class DraftRow:
    """The bitmask row of a draft position: the request's grammar after its first drafts."""

    __slots__ = ("grammar", "prefix")

    def __init__(self, grammar: RequestGrammar, prefix: Sequence[int]) -> None:
        self.grammar = grammar
        self.prefix = prefix

    @property
    def error(self) -> str | None:
        """The request's grammar's error."""
        return self.grammar.error

    @error.setter
    def error(self, value: str | None) -> None:
        self.grammar.error = value

    def fill(self, bitmask: Any, row: int) -> bool:
        """Write the allowed tokens after the prefix into `bitmask[row]`."""
        return self.grammar.fill_after(bitmask, row, self.prefix)


def draft_rows(ids: list[str], grammars: list[Any], drafted: dict[str, list[int]],
               finished: object) -> tuple[list[str], list[Any]]:
    """Speculative decoding: a constrained request with `k` drafts gets `1 + k` bitmask rows,
    row `j` its grammar after its first `j` drafts (the workers mask draft position `j` with
    the request's `j`-th row); `finished` marks a request that ended meanwhile (one row)."""
    out_ids: list[str] = []
    out: list[Any] = []
    for rid, grammar in zip(ids, grammars, strict=True):
        out_ids.append(rid)
        out.append(grammar)
        drafts = drafted.get(rid)
        if drafts and grammar is not finished:
            for j in range(1, len(drafts) + 1):
                out_ids.append(rid)
                out.append(DraftRow(grammar, drafts[:j]))
    return out_ids, out


def _bit(index: int) -> int:
    """The int32 word value with bit `index` set (bit 31 is the sign bit)."""
    return (1 << index) - (1 << 32) if index == 31 else 1 << index


class AllowAll:
    """A bitmask row that allows every token (a request that finished meanwhile)."""

    error: str | None = None

    def fill(self, bitmask: Any, row: int) -> bool:
        """Leave the row all-allowed."""
        return False


class StructuredOutputManager:
    """Compiles grammars for one engine core and builds each step's bitmask.

    Args:
        config: the engine configuration (backend, reasoning parser, model and tokenizer).
        wake: called (from a pool thread) when a compile finishes, to wake an idle busy loop.
    """

    def __init__(self, config: EngineConfig, wake: Callable[[], None] | None = None) -> None:
        self.config = config
        self.wake = wake
        self.vocab_size = config.model_config.vocab_size
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ringserve-grammar")
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()
        self._backend: Any = None
        self._cache: dict[tuple[Any, ...], Future[tuple[Any, Any]]] = {}
        self._reasoning: tuple[int, int] | None = None  # (start, end) token ids

    def _load_backend(self) -> Any:
        from ringserve.engine.structured.backend import create_backend
        from ringserve.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self.config)
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer")
        parser = self.config.structured_outputs_config.reasoning_parser
        if parser is not None:
            start, end = (tokenizer.convert_tokens_to_ids(t) for t in _REASONING_END[parser])
            if not isinstance(end, int) or end == tokenizer.unk_token_id:
                raise ValueError(f"reasoning parser {parser}: the tokenizer has no "
                                 f"{_REASONING_END[parser][1]} token")
            self._reasoning = (start, end)
        stops = sorted(self.config.model_config.eos_token_ids) or None
        return create_backend(self.config.structured_outputs_config.resolved_backend,
                              tokenizer, self.vocab_size, stops)

    def _compile(self, params: StructuredOutputsParams) -> tuple[Any, Any]:
        # The first compile loads the backend on its own pool thread (never by submitting to
        # the pool and waiting: with every worker waiting so, nothing would run it).
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._load_backend()
            backend = self._backend
        return backend, backend.compile(params)

    def grammar_for(self, params: StructuredOutputsParams,
                    prompt_token_ids: Sequence[int]) -> RequestGrammar:
        """Start (or reuse) the compilation of a request's constraint; never blocks."""
        key = params.key()
        with self._lock:
            future = self._cache.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._pool.submit(self._compile, params)
                if self.wake is not None:
                    wake = self.wake
                    future.add_done_callback(lambda _: wake())
                self._cache[key] = future
                if len(self._cache) > _CACHE_SIZE:
                    del self._cache[next(iter(self._cache))]
        return RequestGrammar(future, self, prompt_token_ids)

    def reasoning_state(self, prompt_token_ids: Sequence[int],
                        ) -> tuple[tuple[int, int] | None, bool, bool]:
        """How a request's output starts: ((start, end) thinking token ids, whether thinking
        has ended, whether the first output token may still open it). Thinking is open when
        the prompt's last <think> comes after its last </think>; closed when a </think> comes
        last; with neither, deepseek_r1 starts inside it (its template opens it) and qwen3
        lets the first token decide. Without a reasoning parser: (None, True, False). Valid
        once the backend has loaded (any grammar is compiled)."""
        if self._reasoning is None:
            return None, True, False
        start, end = self._reasoning
        last_start = last_end = -1
        for i, token in enumerate(prompt_token_ids):
            if token == start:
                last_start = i
            elif token == end:
                last_end = i
        if last_start > last_end:
            return self._reasoning, False, False
        if last_end >= 0:
            return self._reasoning, True, False
        if self.config.structured_outputs_config.reasoning_parser == "deepseek_r1":
            return self._reasoning, False, False
        return self._reasoning, True, True

    def bitmask(self, grammars: Sequence[RequestGrammar | DraftRow | AllowAll],
                ) -> tuple[np.ndarray[Any, Any], list[int]]:
        """The packed bitmask of a step's constrained rows; with the rows whose grammar
        allows no token (those requests must fail: their rows are left all-allowed, and
        their grammar's `error` says why)."""
        from ringserve.engine.structured.backend import allocate_bitmask

        bitmask = allocate_bitmask(len(grammars), self.vocab_size)
        filled = [row for row, grammar in enumerate(grammars) if grammar.fill(bitmask, row)]
        dead: list[int] = []
        if filled:
            # One vectorized check: per row it would cost more than the fill itself.
            empty = ~bitmask[filled].any(dim=1)
            if bool(empty.any()):
                dead = [filled[i] for i in empty.nonzero().flatten().tolist()]
                for row in dead:
                    bitmask[row].fill_(-1)
                    grammar = grammars[row]
                    grammar.error = ("the grammar allows no token here (it can never be "
                                     "completed)")
        return bitmask.numpy(), dead

    def shutdown(self) -> None:
        """Stop the compile threads (compiles in progress finish)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
