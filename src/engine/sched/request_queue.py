"""The scheduler's waiting queue, one class per scheduling policy.

Owned by the scheduler (`scheduler.py`): new requests are added at the back, preempted ones
go back in front (FCFS) or by their key (priority), and each step the scheduler peeks at the
head and pops it once it is admitted. Removal (aborts) is batched: one O(n) pass per call.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from ringserve.config import SchedulingPolicy
from ringserve.engine.sched.request import Request

__all__ = ["FCFSRequestQueue", "PriorityRequestQueue", "RequestQueue", "create_request_queue"]


class RequestQueue(Protocol):
    """What the scheduler needs from a waiting queue."""

    def add(self, request: Request) -> None:
        """Queue a new request."""

    def prepend(self, request: Request) -> None:
        """Queue a preempted request ahead of new ones (as far as the policy allows)."""

    def peek(self) -> Request:
        """The request to admit next (IndexError when empty)."""
        ...

    def pop(self) -> Request:
        """Remove and return the request to admit next (IndexError when empty)."""
        ...

    def remove_many(self, requests: set[Request]) -> None:
        """Remove these requests (those not queued are ignored)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSRequestQueue:
    """First come, first served; preempted requests go back to the very front."""

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        """Queue a new request at the back."""
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        """Queue a preempted request at the front."""
        self._queue.appendleft(request)

    def peek(self) -> Request:
        """The head of the queue."""
        return self._queue[0]

    def pop(self) -> Request:
        """Remove and return the head."""
        return self._queue.popleft()

    def remove_many(self, requests: set[Request]) -> None:
        """Remove these requests, keeping the order of the rest."""
        self._queue = deque(r for r in self._queue if r not in requests)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Lowest (priority, arrival_time) first; a preempted request keeps its key."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []

    def add(self, request: Request) -> None:
        """Queue a request by its (priority, arrival time, intake order) key."""
        heapq.heappush(self._heap, (request.priority, request.arrival_time, request.seq, request))

    prepend = add

    def peek(self) -> Request:
        """The request with the smallest key."""
        return self._heap[0][3]

    def pop(self) -> Request:
        """Remove and return the request with the smallest key."""
        return heapq.heappop(self._heap)[3]

    def remove_many(self, requests: set[Request]) -> None:
        """Remove these requests and restore the heap."""
        self._heap = [entry for entry in self._heap if entry[3] not in requests]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """The queued requests in admission order (sorts a copy; for stats and tests)."""
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    """The waiting queue for a scheduling policy ("fcfs" or "priority").

    Raises:
        ValueError: an unknown policy.
    """
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"policy: got {policy!r}, allowed: 'fcfs', 'priority'")
