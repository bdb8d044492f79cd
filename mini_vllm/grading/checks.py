"""Checks the graded suites share: a scheduler against upstream's snapshots,
and against the reference on generated workloads.

Both run the loop upstream's EngineCore runs (``schedule()`` -> fake model
-> ``update_from_output()``) and compare every step; a failure names the
first step and field that differ, upstream's (or the reference's) value and
the student's.
"""

from __future__ import annotations

import mini_vllm.testing as testing
from mini_vllm.oracle import snapshots
from mini_vllm.oracle.workload import Workload, first_difference, run_workload

YOURS = "your scheduler"


def snapshot_names() -> list[str]:
    return sorted(p.stem for p in snapshots.SNAPSHOT_DIR.glob("*.json"))


def snapshot_mismatch(scheduler_cls: type, name: str) -> str | None:
    """None if ``scheduler_cls`` reproduces the snapshot recorded from the
    pinned upstream, else what differs first."""
    workload, header, expected = snapshots.load(snapshots.SNAPSHOT_DIR / f"{name}.json")
    scheduler = testing.create_scheduler(**workload.config, scheduler_cls=scheduler_cls)
    got = run_workload(testing, workload, scheduler=scheduler)
    upstream = f"upstream vLLM {header['vllm_version']}"
    diff = first_difference(expected, got, labels=(upstream, YOURS))
    if diff is None:
        return None
    return (f"Scenario {name!r} (scheduler config {workload.config}) as recorded from "
            f"{upstream}, against {YOURS}:\n{diff}\n"
            f"Replay it: mini_vllm/oracle/scenarios.py defines the workload; "
            f"`make scheduler-demo` shows a trace step by step.")


def reference_mismatch(scheduler_cls: type, workload: Workload) -> str | None:
    """None if ``scheduler_cls`` and the reference Scheduler produce the same
    trace on ``workload`` (the reference equals upstream step for step:
    tests/upstream/test_lockstep.py)."""
    expected = run_workload(testing, workload)
    scheduler = testing.create_scheduler(**workload.config, scheduler_cls=scheduler_cls)
    got = run_workload(testing, workload, scheduler=scheduler)
    diff = first_difference(expected, got, labels=("reference", YOURS))
    if diff is None:
        return None
    requests = [(s.req_id, len(s.prompt_token_ids), s.max_tokens) for s in workload.requests]
    return (f"{diff}\nscheduler config: {workload.config}\n"
            f"requests (id, prompt length, max_tokens): {requests}")
