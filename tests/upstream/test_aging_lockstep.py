"""The aging scheduler with a bound no request reaches is upstream's PRIORITY
scheduler (and, under FCFS, upstream's FCFS scheduler), live, step for step."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

import mini_vllm.testing as mini
from mini_vllm.core.sched.aging import AgingScheduler
from mini_vllm.grading.aging_checks import with_bound
from mini_vllm.oracle.strategies import workloads
from mini_vllm.oracle.workload import first_difference, run_workload

pytestmark = pytest.mark.upstream


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workload=workloads())
def test_never_promoted_aging_is_upstream(workload):
    from mini_vllm.oracle import upstream

    expected = run_workload(upstream, workload)
    sched = mini.create_scheduler(
        scheduler_cls=with_bound(AgingScheduler, 10**9), **workload.config
    )
    diff = first_difference(expected, run_workload(mini, workload, scheduler=sched))
    assert diff is None, f"{diff}\nconfig: {workload.config}"
