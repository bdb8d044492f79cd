"""Unit tests for mini_vllm.core.sched.request_queue.

- FCFS pops in arrival order; prepend_request puts a (preempted) request at
  the front, so it resumes before later arrivals.
- PRIORITY pops the smallest (priority, arrival_time, request_id); "prepend"
  is just an insert, because the key alone decides the order.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_vllm.core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    SchedulingPolicy,
    create_request_queue,
)
from mini_vllm.testing import create_requests


def drain(queue) -> list[str]:
    out = []
    while queue:
        out.append(queue.pop_request().request_id)
    return out


# --------------------------------------------------------------------------
# factory
# --------------------------------------------------------------------------


def test_create_request_queue_picks_the_class_by_policy():
    """Each policy gets its own queue type; an unknown one is an error."""
    assert isinstance(create_request_queue(SchedulingPolicy.FCFS), FCFSRequestQueue)
    assert isinstance(create_request_queue(SchedulingPolicy.PRIORITY), PriorityRequestQueue)
    with pytest.raises(ValueError):
        create_request_queue("lifo")  # type: ignore[arg-type]


def test_policy_parses_from_its_config_string():
    """The scheduler builds the policy from the config string."""
    assert SchedulingPolicy("fcfs") is SchedulingPolicy.FCFS
    assert SchedulingPolicy("priority") is SchedulingPolicy.PRIORITY


# --------------------------------------------------------------------------
# FCFS
# --------------------------------------------------------------------------


def test_fcfs_pops_in_insertion_order_ignoring_priority():
    """FCFS is first come, first served: priorities play no part."""
    q = FCFSRequestQueue()
    for r in create_requests(3, priorities=[5, 0, 9]):
        q.add_request(r)
    assert q.peek_request().request_id == "0"
    assert len(q) == 3  # peek does not pop
    assert drain(q) == ["0", "1", "2"]


def test_fcfs_prepend_puts_a_request_at_the_front():
    """A preempted request goes back to the front of the line."""
    r0, r1, r2 = create_requests(3)
    q = FCFSRequestQueue()
    q.add_request(r1)
    q.add_request(r2)
    q.prepend_request(r0)
    assert drain(q) == ["0", "1", "2"]


def test_fcfs_empty_queue():
    """An empty FCFS queue is falsy, and peek/pop raise IndexError."""
    q = FCFSRequestQueue()
    assert not q and len(q) == 0
    with pytest.raises(IndexError):
        q.peek_request()
    with pytest.raises(IndexError):
        q.pop_request()


def test_fcfs_remove_keeps_the_others_in_order():
    """remove_request / remove_requests drop just those requests."""
    reqs = create_requests(5)
    q = FCFSRequestQueue()
    for r in reqs:
        q.add_request(r)
    q.remove_request(reqs[1])
    q.remove_requests([reqs[3], reqs[0]])
    assert [r.request_id for r in q] == ["2", "4"]


# --------------------------------------------------------------------------
# PRIORITY
# --------------------------------------------------------------------------


def test_priority_pops_smallest_priority_then_earliest_then_id():
    """Lower priority value first; ties by arrival time, then by request id."""
    q = PriorityRequestQueue()
    reqs = create_requests(
        4, req_ids=["d", "c", "b", "a"], priorities=[1, 0, 0, 0], arrival_times=[0.0, 5.0, 3.0, 3.0]
    )
    for r in reqs:
        q.add_request(r)
    # c, b, a have priority 0; b and a arrived first (3.0); a < b by id.
    assert q.peek_request().request_id == "a"
    assert drain(q) == ["a", "b", "c", "d"]


def test_priority_prepend_reinserts_by_key():
    """prepend_request does not jump the line: the key decides."""
    urgent, late = create_requests(2, req_ids=["urgent", "late"], priorities=[0, 1])
    q = PriorityRequestQueue()
    q.add_request(urgent)
    q.prepend_request(late)
    assert drain(q) == ["urgent", "late"]


def test_priority_iterates_in_pop_order_without_popping():
    """Iterating the heap yields pop order and leaves it intact."""
    q = PriorityRequestQueue()
    # Pushed in this order the heap's list is [0, 2, 1, 3] by priority, which
    # is not sorted, so iterating the raw heap would give the wrong order.
    for r in create_requests(4, priorities=[0, 3, 1, 2]):
        q.add_request(r)
    assert [r.request_id for r in q] == ["0", "2", "3", "1"]
    assert len(q) == 4
    assert drain(q) == ["0", "2", "3", "1"]


def test_priority_empty_queue():
    """An empty priority queue is falsy, and peek/pop raise IndexError."""
    q = PriorityRequestQueue()
    assert not q and len(q) == 0
    with pytest.raises(IndexError):
        q.peek_request()
    with pytest.raises(IndexError):
        q.pop_request()


def test_priority_remove_keeps_the_heap_valid():
    """Removing requests from anywhere leaves the rest popping in key order."""
    reqs = create_requests(6, priorities=[5, 4, 3, 2, 1, 0])
    q = PriorityRequestQueue()
    for r in reqs:
        q.add_request(r)
    q.remove_request(reqs[5])  # the current head
    q.remove_requests([reqs[2], reqs[0]])
    assert drain(q) == ["4", "3", "1"]


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(st.tuples(st.integers(-2, 2), st.integers(0, 3)), max_size=15),
    prepend_mask=st.lists(st.booleans(), max_size=15),
)
def test_priority_pop_order_is_sorted_key_order(keys, prepend_mask):
    """Whatever the insert order (add or prepend), pops come out sorted by
    (priority, arrival_time, request_id)."""
    n = len(keys)
    reqs = create_requests(
        n,
        req_ids=[f"r{i:02d}" for i in range(n)],
        priorities=[p for p, _ in keys],
        arrival_times=[float(t) for _, t in keys],
    )
    q = PriorityRequestQueue()
    for i, r in enumerate(reqs):
        if i < len(prepend_mask) and prepend_mask[i]:
            q.prepend_request(r)
        else:
            q.add_request(r)
    expected = sorted(reqs, key=lambda r: (r.priority, r.arrival_time, r.request_id))
    assert drain(q) == [r.request_id for r in expected]


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(st.tuples(st.integers(-2, 2), st.integers(0, 3)), min_size=1, max_size=15),
    removals=st.lists(st.integers(0, 100), max_size=8),
)
def test_priority_pop_order_after_removals(keys, removals):
    """Removing requests one by one (from anywhere in the heap) never breaks
    the pop order of those that remain."""
    n = len(keys)
    reqs = create_requests(
        n,
        req_ids=[f"r{i:02d}" for i in range(n)],
        priorities=[p for p, _ in keys],
        arrival_times=[float(t) for _, t in keys],
    )
    q = PriorityRequestQueue()
    for r in reqs:
        q.add_request(r)
    remaining = list(reqs)
    for k in removals:
        if not remaining:
            break
        victim = remaining.pop(k % len(remaining))
        q.remove_request(victim)
    expected = sorted(remaining, key=lambda r: (r.priority, r.arrival_time, r.request_id))
    assert drain(q) == [r.request_id for r in expected]
