"""Lab 09.2 — an aging rule for the PRIORITY policy, as a ``scheduler_cls``.

Graded: the ``LAB 09.2`` regions of ``labs/phase_09/aging.py``.

First the queue alone (a few requests and a clock you move by hand), then
the scheduler: a starving request admitted at the bound, the two promises
checked at every step of generated workloads (``mini_vllm/grading/
aging_checks.py``: once a request has waited ``max_wait_steps`` steps nobody
who started waiting after it goes first; below the bound, upstream's
``(priority, arrival_time)`` order decides), for the bound your class states
and for others; and with a bound no request reaches, your scheduler must be
upstream's, step for step (the reference equals upstream:
tests/upstream/test_lockstep.py; the recorded scenarios come from the pin).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import mini_vllm.testing as mini
from mini_vllm.core.sched.request_queue import FCFSRequestQueue
from mini_vllm.grading import checks
from mini_vllm.grading.aging_checks import contended_workloads, watching, with_bound
from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle import snapshots, strategies
from mini_vllm.oracle.workload import RequestSpec, Stalled, Workload, run_workload
from mini_vllm.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(20)

PROPERTY = lab_settings(60, shrink=True)
NEVER = 10**9  # a bound no request reaches


def request(req_id: str, priority: int, arrival: float):
    from mini_vllm.request import Request

    return Request(req_id, [1, 2, 3], SamplingParams(max_tokens=4), arrival, priority)


def drain(queue) -> list[str]:
    out = []
    while queue:
        out.append(queue.pop_request().request_id)
    return out


@pytest.fixture
def aging(impl, short_shrink):
    """The module under grade, once a small PRIORITY run gets past the lab's regions."""
    workload = starving_workload()
    try:
        run_workload(
            mini,
            workload,
            scheduler=mini.create_scheduler(
                scheduler_cls=with_bound(impl.aging.AgingScheduler, 4), **workload.config
            ),
        )
    except NotImplementedError as e:
        pytest.fail(f"{e}: a lab region is not written yet.", pytrace=False)
    except Exception:  # noqa: BLE001 - a real bug: the tests below say which
        pass
    return impl.aging


# ------------------------------------------------------------------ the queue


@pytest.mark.points(2)
def test_below_the_bound_upstream_order(impl):
    q = impl.aging.AgingRequestQueue(5)
    for r in (request("b", 1, 0.0), request("a", 0, 1.0), request("c", 0, 2.0)):
        q.add_request(r)
    got = drain(q)
    assert got == ["a", "c", "b"], (
        f"nobody has waited 5 steps: the order is upstream's (priority, arrival_time): "
        f"a (0, 1.0), c (0, 2.0), b (1, 0.0). Got {got}"
    )


@pytest.mark.points(3)
def test_a_promoted_request_goes_first(impl):
    q = impl.aging.AgingRequestQueue(3)
    q.add_request(request("low", 3, 0.0))  # enters at step 0
    q.step_done()
    q.add_request(request("high", 0, 1.0))  # enters at step 1
    q.step_done()
    first = q.peek_request().request_id
    assert first == "high", (
        f"at step 2 low has waited 2 of 3 steps: upstream's order holds, high first; got {first}"
    )
    q.step_done()
    got = drain(q)
    assert got == ["low", "high"], (
        "at step 3 low has waited 3 steps (the bound): it goes before high, which "
        f"started waiting after it; got {got}"
    )


@pytest.mark.points(2)
def test_promoted_requests_longest_waiting_first(impl):
    q = impl.aging.AgingRequestQueue(2)
    q.add_request(request("x", 3, 0.0))  # step 0
    q.step_done()
    q.add_request(request("y", 0, 1.0))  # step 1
    for _ in range(3):
        q.step_done()
    got = drain(q)
    assert got == ["x", "y"], (
        f"at step 4 x has waited 4 steps and y 3, both past the bound of 2: the "
        f"longest-waiting goes first, whatever its priority. Got {got}"
    )


@pytest.mark.points(2)
def test_a_preempted_request_waits_anew(impl):
    q = impl.aging.AgingRequestQueue(2)
    a = request("a", 1, 0.0)
    q.add_request(a)  # step 0
    assert q.pop_request() is a  # admitted
    for _ in range(5):
        q.step_done()
    q.add_request(request("b", 0, 1.0))  # step 5
    q.prepend_request(a)  # preempted at step 5
    q.step_done()
    got = drain(q)
    assert got == ["b", "a"], (
        "a was preempted at step 5 and b arrived at step 5; at step 6 each has waited 1 "
        "step, below the bound of 2, so upstream's order holds: b (priority 0) first. "
        f"Got {got}: a preempted request's wait starts again when it re-enters the queue."
    )


@pytest.mark.points(2)
def test_removed_requests_never_come_back(impl):
    q = impl.aging.AgingRequestQueue(1)
    a, b, c = request("a", 0, 0.0), request("b", 0, 1.0), request("c", 0, 2.0)
    for r in (a, b, c):
        q.add_request(r)
    q.remove_request(b)
    q.remove_requests([c])
    q.step_done()
    assert len(q) == 1 and q.pop_request() is a and not q, (
        "b and c were removed (aborted): only a is left"
    )
    q.add_request(b)
    q.prepend_request(b)  # the same request entering twice counts once, from now
    q.step_done()
    q.add_request(c)
    q.step_done()
    assert len(q) == 2, f"two requests wait (b, c), len says {len(q)}"
    assert drain(q) == ["b", "c"], "b waited longest (past the bound of 1)"
    with pytest.raises(IndexError):
        q.peek_request()


@pytest.mark.points(2)
def test_the_scheduler_waits_in_the_aging_queue(impl):
    cls = impl.aging.AgingScheduler
    sched = mini.create_scheduler(scheduler_cls=cls, policy="priority")
    assert isinstance(sched.waiting, impl.aging.AgingRequestQueue), (
        f"a PRIORITY AgingScheduler must wait in an AgingRequestQueue, not {type(sched.waiting)}"
    )
    assert sched.waiting.max_wait_steps == cls.max_wait_steps
    eight = mini.create_scheduler(scheduler_cls=with_bound(cls, 8), policy="priority")
    assert eight.waiting.max_wait_steps == 8, "the queue must take the class's stated bound"
    fcfs = mini.create_scheduler(scheduler_cls=cls, policy="fcfs")
    assert isinstance(fcfs.waiting, FCFSRequestQueue), "FCFS must keep upstream's queue"


# ------------------------------------------------------------------ the scheduler


def starving_workload() -> Workload:
    """One seat; `low` (priority 5) and r0 arrive at step 0, then a priority-0
    request every step. Each request takes 6 steps (a one-step prefill that
    samples the first token, then 5 decode steps)."""
    requests = [RequestSpec("low", [9] * 8, max_tokens=6, arrive_step=0, priority=5)]
    requests += [
        RequestSpec(f"r{i}", [i + 1] * 8, max_tokens=6, arrive_step=i, priority=0)
        for i in range(30)
    ]
    config = dict(
        max_num_seqs=1, policy="priority", block_size=4, num_blocks=100, max_num_batched_tokens=64
    )
    return Workload("starving", config, requests)


@pytest.mark.points(3)
def test_a_starving_request_is_admitted_at_the_bound(aging):
    workload = starving_workload()
    sched = mini.create_scheduler(
        scheduler_cls=watching(with_bound(aging.AgingScheduler, 4)), **workload.config
    )
    run_workload(mini, workload, scheduler=sched)
    # r0 holds the only seat for steps 0-5; at step 6 low has waited 6 >= 4 steps.
    assert sched.admitted_at["low"] == [6], (
        f"low was admitted at steps {sched.admitted_at['low']}: r0 holds the seat for steps "
        "0-5, and by step 6 low has waited past the bound of 4, so it takes the seat at "
        "step 6 (upstream's PRIORITY admits it only after all 30 others)"
    )


def run_watched(cls, workload) -> None:
    try:
        run_workload(
            mini, workload, scheduler=mini.create_scheduler(scheduler_cls=cls, **workload.config)
        )
    except Stalled as e:
        pytest.fail(f"{e}: some request is never admitted again.", pytrace=False)


@pytest.mark.points(5)
@pytest.mark.timeout(90)
@PROPERTY
@given(contended_workloads(), st.sampled_from([None, 1, 2, 5]))
def test_both_promises_on_generated_workloads(aging, workload, bound):
    cls = aging.AgingScheduler
    stated = cls.max_wait_steps
    assert isinstance(stated, int) and stated >= 1, (
        f"state your bound as a positive int class attribute max_wait_steps, not {stated!r}"
    )
    run_watched(watching(cls if bound is None else with_bound(cls, bound)), workload)


@pytest.mark.points(3)
@pytest.mark.timeout(90)
@PROPERTY
@given(strategies.workloads())
def test_never_promoted_is_upstream(aging, workload):
    """With a bound nobody reaches (and always under FCFS), the schedule is upstream's."""
    message = checks.reference_mismatch(with_bound(aging.AgingScheduler, NEVER), workload)
    assert message is None, message


PRIORITY_SCENARIOS = [
    name
    for name in checks.snapshot_names()
    if snapshots.load(snapshots.SNAPSHOT_DIR / f"{name}.json")[0].config.get("policy") == "priority"
]


@pytest.mark.points(1)
@pytest.mark.parametrize("name", PRIORITY_SCENARIOS)
def test_upstream_recorded_priority_scenarios(aging, name):
    message = checks.snapshot_mismatch(with_bound(aging.AgingScheduler, NEVER), name)
    assert message is None, message
