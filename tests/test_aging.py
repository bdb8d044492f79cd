"""The aging rule (mini_vllm/core/sched/aging.py) and the checker Lab 09.2 grades with.

The checker must be able to fail: upstream's PRIORITY policy (the reference
Scheduler, equal to upstream step for step) starves a low-priority request
on a workload where better-priority requests keep arriving, and the checker
says so; the aging scheduler keeps both promises on the same workload and on
generated ones.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mini_vllm.testing as mini
from mini_vllm.core.sched.aging import AgingScheduler
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.grading.aging_checks import contended_workloads, watching, with_bound
from mini_vllm.oracle.workload import RequestSpec, Workload, run_workload


def starving() -> Workload:
    requests = [RequestSpec("low", [9] * 8, max_tokens=6, arrive_step=0, priority=5)]
    requests += [
        RequestSpec(f"r{i}", [i + 1] * 8, max_tokens=6, arrive_step=i, priority=0)
        for i in range(30)
    ]
    config = dict(
        max_num_seqs=1, policy="priority", block_size=4, num_blocks=100, max_num_batched_tokens=64
    )
    return Workload("starving", config, requests)


def run(cls, workload):
    sched = mini.create_scheduler(scheduler_cls=watching(cls), **workload.config)
    run_workload(mini, workload, scheduler=sched)
    return sched


def test_the_checker_catches_upstream_priority_starving_a_request():
    with pytest.raises(AssertionError, match=r"step 6: low had waited 6 steps"):
        run(with_bound(Scheduler, 4), starving())


def test_upstream_priority_admits_the_low_request_last():
    sched = mini.create_scheduler(scheduler_cls=with_bound(Scheduler, 4), **starving().config)
    trace = run_workload(mini, starving(), scheduler=sched)
    admitted = [r for step in trace["steps"] for r, *_ in step["new"]]
    assert admitted[-1] == "low" and len(admitted) == 31


def test_aging_admits_it_at_the_first_free_seat_past_the_bound():
    assert run(with_bound(AgingScheduler, 4), starving()).admitted_at["low"] == [6]


@settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(contended_workloads(), st.sampled_from([1, 3, AgingScheduler.max_wait_steps]))
def test_aging_keeps_both_promises(workload, bound):
    run(with_bound(AgingScheduler, bound), workload)
