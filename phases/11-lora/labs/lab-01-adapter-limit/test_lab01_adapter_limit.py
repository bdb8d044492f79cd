"""Lab 11.1 — the scheduler's adapter limit.

Graded: the ``LAB 11.1`` regions of ``labs/phase_11/scheduler.py``, in
``schedule()``: the set of adapters the running requests scheduled this step
use; a waiting request whose adapter is not in that set when it already holds
``max_loras`` ids is passed over for the step (into ``step_skipped_waiting``)
without blocking the requests behind it; an admitted request's adapter joins
the set.

Every test runs your Scheduler and the pinned upstream's
(vllm/v1/core/sched/scheduler.py:534-542, :571-581, :796-797) on the same
workload, with the same fake-model tokens, and demands the same step for step
(scheduled tokens, new and cached requests with their adapters, block ids,
free blocks, outputs). The fixed workloads below each isolate one rule (and
check first that upstream's trace shows it, or they would prove nothing);
then generated LoRA workloads (mini_vllm/oracle/strategies.py
``lora_workloads``: max_loras 1-3, base-model requests mixed in, prefix
caching and chunked prefill on or off), each crowded so that its first
requests arrive together on one or two more adapters than ``max_loras``
(phase11_helpers.crowded_lora_workloads: the limit then holds some back).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from phase11_helpers import crowded_lora_workloads, describe, scheduler_difference

from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.workload import RequestSpec, Workload, run_workload

pytestmark = pytest.mark.upstream

LOCKSTEP = lab_settings(40)
PROMPT = list(range(1, 33))


def workload(name: str, max_loras: int, *requests: tuple, **config) -> Workload:
    """requests: (id, adapter id or None, arrival step, max_tokens)."""
    return Workload(
        name=name,
        config={
            "max_loras": max_loras,
            "block_size": 4,
            "num_blocks": 100,
            "max_model_len": 64,
            **config,
        },
        requests=[
            RequestSpec(r, [n + 1 for n in PROMPT], max_tokens=t, arrive_step=s, lora_id=lora)
            for n, (r, lora, s, t) in enumerate(requests)
        ],
    )


def first_scheduled(trace: dict, req_id: str) -> int:
    """The first step that schedules ``req_id`` (in upstream's trace)."""
    return next(i for i, s in enumerate(trace["steps"]) if req_id in dict(s["scheduled"]))


def check(impl, up, w: Workload, rule: str) -> None:
    diff = scheduler_difference(impl, up, w)
    assert diff is None, f"{rule}\nYour Scheduler and upstream's part ways: {diff}\n{describe(w)}"


@pytest.mark.points(3)
def test_a_second_adapter_waits_while_one_slot_is_taken(impl, up):
    w = workload("one-slot", 1, ("a1", 1, 0, 3), ("b", 2, 0, 3), ("a2", 1, 0, 3))
    trace = run_workload(up, w)
    assert first_scheduled(trace, "b") > first_scheduled(trace, "a2") == 0  # upstream holds b
    check(
        impl,
        up,
        w,
        "With max_loras=1, a1 takes the step's one adapter; b (adapter 2) must wait until no "
        "request of adapter 1 runs, while a2 (adapter 1 again) is admitted in the same step.",
    )


@pytest.mark.points(3)
def test_a_held_back_request_does_not_block_the_queue(impl, up):
    w = workload(
        "no-block", 1, ("a", 1, 0, 4), ("b", 2, 1, 3), ("base", None, 1, 3), ("a2", 1, 1, 3)
    )
    trace = run_workload(up, w)
    assert first_scheduled(trace, "base") == first_scheduled(trace, "a2") == 1
    assert first_scheduled(trace, "b") > 1
    check(
        impl,
        up,
        w,
        "b (adapter 2) arrives first at step 1 while a (adapter 1) is running with max_loras=1: "
        "b is passed over for the step (out of its queue, into step_skipped_waiting), and the "
        "requests behind it, one on the base model and one on adapter 1, are admitted.",
    )


@pytest.mark.points(3)
def test_running_requests_count_toward_the_limit(impl, up):
    w = workload("running", 2, ("a", 1, 0, 6), ("b", 2, 0, 6), ("c", 3, 1, 3), ("b2", 2, 1, 3))
    trace = run_workload(up, w)
    assert first_scheduled(trace, "b2") == 1 < first_scheduled(trace, "c")
    check(
        impl,
        up,
        w,
        "With max_loras=2, a and b (adapters 1 and 2) keep running: at step 1 their adapters "
        "fill the step's set before any waiting request is looked at, so c (adapter 3) waits "
        "and b2 (adapter 2) is admitted.",
    )


@pytest.mark.points(2)
def test_base_model_requests_never_wait_for_a_slot(impl, up):
    w = workload("base", 1, ("a", 1, 0, 3), ("b", 2, 0, 3), ("n1", None, 0, 3), ("n2", None, 0, 3))
    trace = run_workload(up, w)
    assert first_scheduled(trace, "n1") == first_scheduled(trace, "n2") == 0
    check(
        impl,
        up,
        w,
        "A request on the base model (lora_request None) uses no adapter slot: it is admitted "
        "whatever the step's adapters are, and it adds nothing to the set.",
    )


@pytest.mark.points(2)
def test_held_back_requests_keep_their_order(impl, up):
    w = workload("order", 1, ("a", 1, 0, 4), ("b1", 2, 0, 3), ("c", 3, 0, 3), ("b2", 2, 0, 3))
    check(
        impl,
        up,
        w,
        "Requests passed over go back to the front of the waiting line in the order they "
        "had (prepend each into step_skipped_waiting as you pass it): when a finishes, b1 "
        "(the oldest held back) takes the slot, and b2 joins it.",
    )


@pytest.mark.points(8)
@pytest.mark.timeout(240)
def test_lockstep_with_upstream_on_generated_lora_workloads(impl, up):
    held_back = []

    @LOCKSTEP
    @given(w=crowded_lora_workloads())
    def run(w):
        trace = run_workload(up, w)
        diff = scheduler_difference(impl, up, w, trace)
        assert diff is None, (
            f"Your Scheduler and upstream's part ways on a LoRA workload:\n{diff}\n{describe(w)}"
        )
        adapters = {s.req_id: s.lora_id for s in w.requests}
        for step in trace["steps"]:
            ids = {adapters[r] for r, _ in step["scheduled"]} - {None}
            held_back.append(len(ids) == w.config["max_loras"])

    run()
    assert any(held_back), (
        "the generated workloads never filled the slots: the lockstep proved too little"
    )
