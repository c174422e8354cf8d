"""Constraints start after reasoning ends (issue 15 item 6): the core's `RequestGrammar` feeds
its matcher only the tokens after </think>, leaves the mask open while thinking, and for
qwen3 lets the first token open thinking (the frontend's reasoning parser uses the same rule).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from ringserve.engine.structured.manager import RequestGrammar, StructuredOutputManager

START, END = 50, 51


class FakeMatcher:
    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept_token(self, token: int) -> bool:
        self.accepted.append(token)
        return token < 40

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].zero_()
        bitmask[row, 0] = 0b1110  # tokens 1, 2, 3

    def is_terminated(self) -> bool:
        return False


class FakeBackend:
    def matcher(self, compiled: Any) -> FakeMatcher:
        return FakeMatcher()


def _manager(parser: str | None) -> Any:
    manager = StructuredOutputManager.__new__(StructuredOutputManager)
    manager._reasoning = None if parser is None else (START, END)

    class Cfg:
        class structured_outputs_config:
            reasoning_parser = parser

    manager.config = Cfg  # type: ignore[assignment]
    return manager


def _grammar(parser: str | None, prompt: list[int]) -> RequestGrammar:
    future: Future[tuple[Any, Any]] = Future()
    future.set_result((FakeBackend(), None))
    grammar = RequestGrammar(future, _manager(parser), prompt)
    assert grammar.ready()
    return grammar


def _row(grammar: RequestGrammar) -> list[int]:
    bitmask = torch.full((1, 2), -1, dtype=torch.int32)
    grammar.fill(bitmask, 0)
    bits = [(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(64)]
    return [t for t, bit in enumerate(bits) if bit]


def test_thinking_open_in_the_prompt_is_not_constrained_until_it_ends() -> None:
    grammar = _grammar("deepseek_r1", [7, START, 8])
    assert len(_row(grammar)) == 64  # open while thinking
    assert grammar.accept([60, 61, END])
    assert _row(grammar) == [1, 2, 3]
    assert grammar.accept([2]) and grammar._matcher.accepted == [2]


def test_deepseek_starts_inside_thinking_and_a_closed_prompt_does_not() -> None:
    assert not _grammar("deepseek_r1", [7, 8]).reasoning_ended
    assert _grammar("qwen3", [START, 9, END, 4]).reasoning_ended
    assert _row(_grammar("qwen3", [START, 9, END, 4])) == [1, 2, 3]


def test_qwen3_first_token_may_open_thinking() -> None:
    grammar = _grammar("qwen3", [7, 8])
    assert _row(grammar) == [1, 2, 3, START]
    assert grammar.accept([START, 45, 46, END, 3])
    assert grammar._matcher.accepted == [3]
    direct = _grammar("qwen3", [7, 8])
    assert direct.accept([1]) and direct._matcher.accepted == [1]
    assert _row(direct) == [1, 2, 3]  # decided: no more <think>
    assert not direct.accept([45]) and "not allowed" in str(direct.error)


def test_without_a_parser_everything_is_constrained() -> None:
    grammar = _grammar(None, [START])
    assert _row(grammar) == [1, 2, 3]
