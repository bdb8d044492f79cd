"""Aging for the PRIORITY policy: a course extension, not upstream.

Upstream v1 has no aging. Its PRIORITY waiting queue
(``PriorityRequestQueue``, vllm/v1/core/sched/request_queue.py:131) pops the
smallest ``(priority, arrival_time)`` (``Request.__lt__``,
vllm/v1/request.py:301), so a low-priority request waits as long as
better-priority requests keep arriving: it can starve. This module adds the
simplest aging rule with a bound one can state, as a ``scheduler_cls``:

    a request that has waited ``max_wait_steps`` engine steps or more (since
    it last entered the waiting queue: its arrival, or its preemption) is
    promoted: promoted requests go before all others, longest-waiting first;
    the others keep upstream's ``(priority, arrival_time)`` order.

So once a request has waited ``max_wait_steps`` steps, no request that
started waiting after it is admitted before it. That bounds how long later
arrivals can jump it, not its whole wait (that also depends on how fast the
requests ahead of it finish). Everything else is upstream's: which running
request is preempted (``max`` of ``(priority, arrival_time)``), admission in
strict queue order, the FCFS policy (``AgingScheduler`` leaves an FCFS
queue as it is). With no request promoted, the schedule is upstream's PRIORITY
schedule, step for step.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator

from mini_vllm.config import VllmConfig
from mini_vllm.core.sched.request_queue import SchedulingPolicy
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.request import Request


class AgingRequestQueue:
    """PRIORITY order, except that requests waiting ``max_wait_steps`` go first.

    Two views of the same requests: a heap by ``(priority, arrival_time, id)``
    (upstream's order) and a FIFO by the step each entered the queue. An entry
    is live while ``self.entered`` maps its request to that entry's ticket;
    removed or re-queued requests leave stale entries behind, skipped lazily.
    ``now`` is the number of steps scheduled so far (``AgingScheduler`` moves it).
    """

    def __init__(self, max_wait_steps: int) -> None:
        if max_wait_steps < 0:
            raise ValueError(f"max_wait_steps must be >= 0, got {max_wait_steps}")
        self.max_wait_steps = max_wait_steps
        self.now = 0
        self.entered: dict[Request, tuple[int, int]] = {}  # request -> (step, ticket)
        self._heap: list[tuple[Request, int]] = []
        self._fifo: deque[tuple[int, int, Request]] = deque()
        self._tickets = 0

    # BEGIN LAB 09.2: a request enters the queue: both views, one new ticket
    def _enter(self, request: Request) -> None:
        """Record that ``request`` starts waiting now, in both views."""
        # HINT: a fresh ticket (self._tickets counts them) makes older entries of the same
        # HINT: request stale; the heap holds (request, ticket), the FIFO (step, ticket, request).
        self._tickets += 1
        self.entered[request] = (self.now, self._tickets)
        heapq.heappush(self._heap, (request, self._tickets))
        self._fifo.append((self.now, self._tickets, request))

    # END LAB 09.2

    def _live(self, request: Request, ticket: int) -> bool:
        entry = self.entered.get(request)
        return entry is not None and entry[1] == ticket

    def _best(self) -> Request:
        """The live request first in upstream's order (dropping stale entries)."""
        while not self._live(*self._heap[0]):
            heapq.heappop(self._heap)
        return self._heap[0][0]

    def _longest_waiting(self) -> Request:
        """The live request that entered the queue first (dropping stale entries)."""
        while not self._live(self._fifo[0][2], self._fifo[0][1]):
            self._fifo.popleft()
        return self._fifo[0][2]

    # BEGIN LAB 09.2: which waiting request goes next
    def _select(self) -> Request:
        """The request the next admission takes: the longest-waiting one if it
        has waited ``max_wait_steps`` steps or more, else upstream's first."""
        # HINT: self.entered[request] is (step it entered, ticket); self.now is the step.
        # HINT: _longest_waiting() and _best() skip removed requests for you.
        oldest = self._longest_waiting()
        if self.now - self.entered[oldest][0] >= self.max_wait_steps:
            return oldest
        return self._best()

    # END LAB 09.2

    def add_request(self, request: Request) -> None:
        self._enter(request)

    # BEGIN LAB 09.2: a preempted request enters the queue again
    def prepend_request(self, request: Request) -> None:
        """A preempted request comes back. Under PRIORITY, upstream re-inserts it
        by its key (vllm/v1/core/sched/request_queue.py:160); here it also starts
        waiting anew."""
        # HINT: its wait counts from now: the step it was preempted in.
        self._enter(request)

    # END LAB 09.2

    def peek_request(self) -> Request:
        if not self.entered:
            raise IndexError("peek from an empty queue")
        return self._select()

    def pop_request(self) -> Request:
        if not self.entered:
            raise IndexError("pop from an empty queue")
        request = self._select()
        del self.entered[request]
        return request

    def remove_request(self, request: Request) -> None:
        del self.entered[request]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.entered.pop(request, None)

    # BEGIN LAB 09.2: the clock moves once a step
    def step_done(self) -> None:
        """The scheduler finished a step: every waiting request has waited one more."""
        self.now += 1

    # END LAB 09.2

    def is_promoted(self, request: Request) -> bool:
        return self.now - self.entered[request][0] >= self.max_wait_steps

    def __bool__(self) -> bool:
        return bool(self.entered)

    def __len__(self) -> int:
        return len(self.entered)

    def __iter__(self) -> Iterator[Request]:
        """In pop order at the current step."""
        promoted = sorted((r for r in self.entered if self.is_promoted(r)), key=self.entered.get)
        rest = sorted(r for r in self.entered if not self.is_promoted(r))
        return iter(promoted + rest)


class AgingScheduler(Scheduler):
    """Upstream's Scheduler with ``AgingRequestQueue`` under PRIORITY.

    ``max_wait_steps`` is the bound this rule states: after waiting that
    many steps, a request is admitted before anyone who started waiting
    after it. Subclass to change it (``class A(AgingScheduler): max_wait_steps = 8``).
    """

    max_wait_steps: int = 32

    def __init__(self, vllm_config: VllmConfig, log_stats: bool = False, **kwargs) -> None:
        super().__init__(vllm_config, log_stats, **kwargs)
        if self.policy == SchedulingPolicy.PRIORITY:
            self.waiting = self.make_aging_queue()

    # BEGIN LAB 09.2: the queue a PRIORITY scheduler waits in
    def make_aging_queue(self) -> AgingRequestQueue:
        """The waiting queue, with this class's stated bound."""
        # HINT: the bound is the class attribute max_wait_steps.
        return AgingRequestQueue(self.max_wait_steps)

    # END LAB 09.2

    def schedule(self):
        out = super().schedule()
        if isinstance(self.waiting, AgingRequestQueue):
            # Requests added or preempted during this step entered at its number.
            self.waiting.step_done()
        return out
