"""Waiting queues for the two scheduling policies.

Mirrors upstream ``vllm/v1/core/sched/request_queue.py`` at v0.22.1
(``SchedulingPolicy`` :13, ``FCFSRequestQueue`` :75, ``PriorityRequestQueue``
:131, ``create_request_queue`` :201). Left out: the abstract base class
(duck typing is enough here).

Invariants kept:
- FCFS pops in arrival order; ``prepend_request`` puts a preempted request
  back at the *front*, so it resumes before anyone who arrived later;
- PRIORITY pops the smallest ``(priority, arrival_time, request_id)``;
  "prepend" just re-inserts, because order is decided by the key alone.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from enum import Enum

from mini_vllm.request import Request


class SchedulingPolicy(Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


# mirrors vllm/v1/core/sched/request_queue.py:75-128
class FCFSRequestQueue(deque):
    def add_request(self, request: Request) -> None:
        self.append(request)

    def pop_request(self) -> Request:
        return self.popleft()

    def peek_request(self) -> Request:
        if not self:
            raise IndexError("peek from an empty queue")
        return self[0]

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Each of ``requests`` to the front in turn: the last ends up first
        (``extendleft``, as upstream; the scheduler's ``step_skipped_waiting``
        is filled by prepending, so its order comes out restored)."""
        self.extendleft(requests)

    def remove_request(self, request: Request) -> None:
        self.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = set(requests)
        kept = [r for r in self if r not in doomed]
        self.clear()
        self.extend(kept)


# mirrors vllm/v1/core/sched/request_queue.py:131-198
class PriorityRequestQueue:
    """A heap ordered by ``Request.__lt__``: (priority, arrival_time, id)."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = set(requests)
        self._heap = [r for r in self._heap if r not in doomed]
        heapq.heapify(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In pop order (the heap itself is only partially ordered)."""
        return iter(sorted(self._heap))


# mirrors vllm/v1/core/sched/request_queue.py:201-208
def create_request_queue(policy: SchedulingPolicy) -> FCFSRequestQueue | PriorityRequestQueue:
    if policy == SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    if policy == SchedulingPolicy.FCFS:
        return FCFSRequestQueue()
    raise ValueError(f"Unknown scheduling policy: {policy}")
