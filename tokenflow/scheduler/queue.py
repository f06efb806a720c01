"""Waiting queues: one class per scheduling policy, both serving in their policy's order."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from tokenflow.config import SCHEDULING_POLICIES
from tokenflow.scheduler.request import Request


class RequestQueue(ABC):
    """The waiting requests of one scheduler, in the order they are to be served."""

    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Put a request back at the head of its turn (a preempted or skipped request)."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove_many(self, requests: Iterable[Request]) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue(RequestQueue):
    """First come, first served; preempted requests go back to the very front."""

    def __init__(self) -> None:
        self._deque: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._deque.append(request)

    def prepend(self, request: Request) -> None:
        self._deque.appendleft(request)

    def peek(self) -> Request:
        return self._deque[0]

    def pop(self) -> Request:
        return self._deque.popleft()

    def remove_many(self, requests: Iterable[Request]) -> None:
        gone = set(map(id, requests))
        self._deque = deque(r for r in self._deque if id(r) not in gone)

    def __len__(self) -> int:
        return len(self._deque)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._deque)


class PriorityQueue(RequestQueue):
    """Lowest `priority` first, ties broken by arrival time (then by insertion order)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, entry)

    # A preempted request keeps its (priority, arrival) key, so its place is already right.
    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_many(self, requests: Iterable[Request]) -> None:
        gone = set(map(id, requests))
        self._heap = [e for e in self._heap if id(e[3]) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; valid: {', '.join(SCHEDULING_POLICIES)}")
