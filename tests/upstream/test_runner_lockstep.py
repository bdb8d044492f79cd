"""Live lockstep: mini_vllm's model runner applies the pinned upstream
scheduler's outputs to its persistent batch as upstream's runner does.

Scheduler workloads (generated ones and the named scenarios: chunked
prefill, prefix caching, preemption and resumption, aborts, stop tokens) run
on upstream's Scheduler (mini_vllm/oracle/runner_workload.py). Each
SchedulerOutput goes to mini's ``GPUModelRunner._update_states`` /
``_prepare_inputs`` / ``_bookkeeping_sync`` and to a replay of upstream's
``_update_states`` and ``_bookkeeping_sync`` on upstream's ``InputBatch``.
After every stage both must hold the same rows (request, token ids, counts,
block ids), the same request states (preempted requests included), the same
input ids, positions and discard mask, and keep the same sampled tokens;
with the decode-first reorder on and off. A failure names the first stage
and field that differ.

MINI_VLLM_RUNNER_LOCKSTEP_EXAMPLES sets the number of generated cases (default 30).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from mini_vllm.oracle.runner_workload import (
    MiniRunnerSide,
    UpstreamRunnerSide,
    first_runner_difference,
    run_runner_workload,
)
from mini_vllm.oracle.scenarios import SCENARIOS
from mini_vllm.oracle.strategies import workloads
from mini_vllm.tiers import examples

pytestmark = pytest.mark.upstream

EXAMPLES = examples(30, 15, "MINI_VLLM_RUNNER_LOCKSTEP_EXAMPLES")


def _check(workload, threshold, counts) -> None:
    expected = run_runner_workload(workload, UpstreamRunnerSide, threshold)
    got = run_runner_workload(workload, MiniRunnerSide, threshold)
    counts["runner lockstep examples"] = counts.get("runner lockstep examples", 0) + 1
    for stage, obs in expected:
        if stage.endswith("_update_states"):
            states, rows = obs["states"], obs["rows"]
            in_batch = {row["req_id"] for row in rows.values()}
            if set(states) - in_batch:
                counts["runner lockstep: states kept outside the batch"] = (
                    counts.get("runner lockstep: states kept outside the batch", 0) + 1
                )
        if stage.endswith("_prepare_inputs") and any(obs["discard"]):
            counts["runner lockstep: rows discarded"] = (
                counts.get("runner lockstep: rows discarded", 0) + 1
            )
    diff = first_runner_difference(expected, got)
    assert diff is None, f"{diff}\nreorder threshold: {threshold}\nworkload: {workload.to_dict()}"


@pytest.mark.xdist_group("runner-lockstep")
@pytest.mark.parametrize("threshold", [None, 1])
@pytest.mark.parametrize("workload", SCENARIOS, ids=[w.name for w in SCENARIOS])
def test_runner_lockstep_on_named_scenarios(workload, threshold, counts):
    _check(workload, threshold, counts)


# No shrinking: the message already names the first stage and field that differ.
@pytest.mark.xdist_group("runner-lockstep")
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workload=workloads(), threshold=st.sampled_from([None, 1]))
def test_runner_lockstep_with_upstream(workload, threshold, counts):
    _check(workload, threshold, counts)


@pytest.mark.xdist_group("runner-lockstep")
def test_runner_lockstep_reached_preemption_and_discards(counts):
    """The lockstep proves little unless requests sit outside the batch
    (preempted or unscheduled) and mid-prefill rows discard their token.
    Runs after the tests above in this module."""
    if counts.get("runner lockstep examples", 0) < 10:
        pytest.skip("too few runner lockstep examples ran to judge coverage")
    assert counts.get("runner lockstep: states kept outside the batch", 0) > 0, counts
    assert counts.get("runner lockstep: rows discarded", 0) > 0, counts
