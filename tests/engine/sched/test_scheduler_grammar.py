"""The scheduler's side of structured outputs, with a fake grammar source: a constrained
request waits for its grammar without holding the batch, is listed in `grammar_req_ids` only
on the steps where it samples, and a failed compile or a forbidden token ends it alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sched_fakes import Driver, check_no_leaks, make_request, make_scheduler

from ringserve.engine.sched.request import RequestStatus
from ringserve.engine.wire import FinishReason
from ringserve.sampling_params import StructuredOutputsParams

__all__ = ["check_no_leaks"]  # the autouse leak check


class FakeGrammar:
    def __init__(self) -> None:
        self.compiled = False
        self.error: str | None = None
        self.accepted: list[int] = []
        self.forbidden: set[int] = set()

    def ready(self) -> bool:
        return self.compiled or self.error is not None

    def accept(self, tokens: Sequence[int]) -> bool:
        for token in tokens:
            if token in self.forbidden:
                self.error = f"token {token} forbidden"
                return False
            self.accepted.append(token)
        return True


class FakeSource:
    def __init__(self) -> None:
        self.grammars: list[FakeGrammar] = []

    def grammar_for(self, params: StructuredOutputsParams, prompt: Sequence[int]) -> Any:
        grammar = FakeGrammar()
        self.grammars.append(grammar)
        return grammar


def _constrained(rid: str, prompt: int, **kw: Any) -> Any:
    return make_request(rid, prompt, structured_outputs=StructuredOutputsParams(regex="a+"),
                        **kw)


def test_waiting_for_grammar_does_not_hold_the_batch() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    source = FakeSource()
    sched.structured = source
    driver = Driver(sched)
    sched.add_request(_constrained("c", 40, max_tokens=3))
    sched.add_request(make_request("free", 8, max_tokens=3))
    assert sched.requests["c"].status is RequestStatus.WAITING_FOR_GRAMMAR
    so = driver.step()
    assert "c" not in so.num_scheduled_tokens and "free" in so.num_scheduled_tokens
    assert so.grammar_req_ids == []
    source.grammars[0].compiled = True
    steps = []
    while "c" not in driver.finished:
        steps.append(driver.step())
    listed = [s for s in steps if "c" in s.grammar_req_ids]
    # 40 prompt tokens in chunks of <= 32: the first chunk samples nothing, so no mask row.
    assert len(listed) == 3 and "c" not in steps[0].grammar_req_ids
    assert source.grammars[0].accepted == driver.tokens["c"]
    driver.run()


def test_a_failed_compile_or_a_forbidden_token_ends_that_request_alone() -> None:
    sched = make_scheduler()
    source = FakeSource()
    sched.structured = source
    driver = Driver(sched, async_scheduling=True)
    sched.add_request(_constrained("bad-spec", 4))
    sched.add_request(_constrained("bad-token", 4, max_tokens=10))
    sched.add_request(make_request("free", 4, max_tokens=5))
    source.grammars[0].error = "invalid regex"
    source.grammars[1].compiled = True
    driver.run()
    first = driver.tokens.get("bad-token", [None])[0]
    assert driver.finished["bad-spec"].finish_reason is FinishReason.ERROR
    assert "invalid regex" in str(driver.finished["bad-spec"].stop_reason)
    assert driver.finished["free"].finish_reason is FinishReason.LENGTH
    # Forbid the token that request samples at its third output: it fails right there.
    sched.add_request(_constrained("bad-token-2", 4, max_tokens=10))
    grammar = source.grammars[-1]
    grammar.compiled = True
    grammar.forbidden = {driver.sampler("bad-token-2", 2)}
    driver.run()
    out = driver.finished["bad-token-2"]
    assert out.finish_reason is FinishReason.ERROR and "forbidden" in str(out.stop_reason)
    assert len(driver.tokens["bad-token-2"]) == 3 and first is not None


def test_abort_while_compiling_leaves_nothing_behind() -> None:
    sched = make_scheduler()
    sched.structured = FakeSource()
    sched.add_request(_constrained("c", 4))
    assert not sched.has_requests()  # nothing to step until the grammar is ready
    sched.finish_requests("c", FinishReason.ABORT)
    assert not sched.requests and not sched.waiting_for_grammar
    sched.check_invariants()


def test_without_a_grammar_source_a_constrained_request_fails() -> None:
    sched = make_scheduler()
    sched.add_request(_constrained("c", 4))
    out = sched.take_pending_outputs()[0].outputs[0]
    assert out.finish_reason is FinishReason.ERROR and "structured outputs" in str(out.stop_reason)
