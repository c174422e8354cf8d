"""The bounded store behind `store: true`, `previous_response_id` and the GET / DELETE /
input_items routes of `/v1/responses`.

Each entry is a finished response object and the full list of its input items (the stored
conversation it continued, its predecessor's output, then its own new input), so a
continuation rebuilds the conversation from one entry: its input items, then its output.
Memory is bounded two ways, unlike vLLM's store: at most `max_entries` responses (the least
recently used goes first; 0 keeps nothing) and each is dropped `ttl` seconds after its last
use. Items are immutable once stored and shared between the entries of one conversation, so
an entry costs a list of references, not a copy of its history. Plain Python, no I/O: the
route owns the one instance and the clock is injectable for tests.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ringserve.http.agents.responses_protocol import Item, ResponseObject


@dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    Attributes:
        response: the response object as answered.
        input_items: every item of the conversation before its output.
    """

    response: ResponseObject
    input_items: list[Item]

    @property
    def conversation(self) -> list[Item]:
        """What a continuation starts from: the input items, then the output items."""
        return [*self.input_items, *self.response.output]


class ResponseStore:
    """Responses by id, least recently used first out, each kept `ttl` seconds after its
    last use.

    Args:
        max_entries: the most responses kept (0: none is kept).
        ttl: seconds an entry lives after it was stored or last read.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, max_entries: int, ttl: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries: got {max_entries}, allowed: 0 or more")
        if ttl <= 0:
            raise ValueError(f"ttl: got {ttl}, allowed: more than 0 seconds")
        self.max_entries = max_entries
        self.ttl = ttl
        self._clock = clock
        # id -> (entry, when it expires); ordered from least to most recently used.
        self._entries: OrderedDict[str, tuple[StoredResponse, float]] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        self._expire()
        return response_id in self._entries

    def put(self, entry: StoredResponse) -> None:
        """Store (or replace) `entry` as the most recently used, evicting the least recently
        used past the bound."""
        if self.max_entries == 0:
            return
        key = entry.response.id
        self._entries.pop(key, None)
        self._entries[key] = (entry, self._clock() + self.ttl)
        self._expire()
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, now the most recently used with its lifetime renewed; None when it is
        unknown, deleted, evicted or expired."""
        self._expire()
        found = self._entries.pop(response_id, None)
        if found is None:
            return None
        entry = found[0]
        self._entries[response_id] = (entry, self._clock() + self.ttl)
        return entry

    def delete(self, response_id: str) -> bool:
        """Drop the entry; False when there was none."""
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        # Least recently used first, so expiry times ascend: stop at the first one alive.
        now = self._clock()
        while self._entries:
            key, (_, expires) = next(iter(self._entries.items()))
            if expires > now:
                return
            del self._entries[key]
