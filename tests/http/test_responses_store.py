"""The bounded response store of `/v1/responses` as a plain object: least recently used out
past the bound, an entry's lifetime renewed by each use, nothing kept at a bound of 0, and a
continuation's conversation (input items, then output items)."""

from __future__ import annotations

import pytest

from ringserve.http.agents.responses_protocol import (
    FunctionCallItem,
    InputText,
    MessageItem,
    ResponseObject,
)
from ringserve.http.agents.responses_store import ResponseStore, StoredResponse


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def entry(response_id: str) -> StoredResponse:
    question = MessageItem(id=f"msg_in_{response_id}", role="user",
                           content=[InputText("Weather?")])
    call = FunctionCallItem(id=f"fc_{response_id}", call_id=f"call_{response_id}",
                            name="get_weather", arguments='{"city": "Paris"}')
    response = ResponseObject(id=response_id, created_at=0, status="completed", model="m",
                              output=[call], parallel_tool_calls=True, tool_choice="auto",
                              tools=[])
    return StoredResponse(response, [question])


def test_least_recently_used_goes_first() -> None:
    store = ResponseStore(2, ttl=60, clock=Clock())
    store.put(entry("a"))
    store.put(entry("b"))
    assert store.get("a") is not None  # a is now the most recently used
    store.put(entry("c"))
    assert "b" not in store and "a" in store and "c" in store
    assert len(store) == 2
    store.put(entry("a"))  # replacing keeps one entry
    assert len(store) == 2 and store.get("a") is not None


def test_entries_expire_after_their_last_use() -> None:
    clock = Clock()
    store = ResponseStore(10, ttl=60, clock=clock)
    store.put(entry("a"))
    store.put(entry("b"))
    clock.now += 50
    assert store.get("a") is not None  # renewed until 210
    clock.now += 20  # 170: b (stored at 100) expired, a not
    assert store.get("b") is None and store.get("a") is not None
    clock.now += 61
    assert store.get("a") is None and len(store) == 0


def test_delete_and_a_bound_of_zero() -> None:
    store = ResponseStore(3, ttl=60)
    store.put(entry("a"))
    assert store.delete("a") and not store.delete("a")
    assert store.get("a") is None
    empty = ResponseStore(0, ttl=60)
    empty.put(entry("a"))
    assert len(empty) == 0 and empty.get("a") is None


def test_conversation_is_inputs_then_outputs() -> None:
    stored = entry("a")
    conversation = stored.conversation
    assert [type(item) for item in conversation] == [MessageItem, FunctionCallItem]
    assert conversation[0] is stored.input_items[0]  # shared, not copied
    assert conversation[1] is stored.response.output[0]


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        ResponseStore(-1, ttl=60)
    with pytest.raises(ValueError, match="ttl"):
        ResponseStore(1, ttl=0)
