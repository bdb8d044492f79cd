"""Lab 12.1 — the grammar wait state.

Graded: the ``LAB 12.1`` regions of ``labs/phase_12/scheduler.py``: in
``schedule()``'s waiting loop, a request whose grammar is still compiling is
passed over for the step (into ``step_skipped_waiting``) without blocking
the requests behind it, and the requests passed over go back to
``skipped_waiting`` ahead of the older ones; ``_enqueue_waiting_request``
(which queue a new request joins), ``_select_waiting_queue_for_scheduling``
(FCFS: ``skipped_waiting`` first; PRIORITY: whichever head orders first) and
``_try_promote_blocked_waiting_request`` (WAITING once the grammar is
compiled; a compile that raised fails that request alone).

First the rules, on a scheduler driven by hand: the test holds each
grammar's future and completes it (or sets an exception) at the step it
chooses. Then, marked ``upstream``, generated structured workloads
(mini_vllm/oracle/strategies.py ``structured_workloads``: compiles finishing
0-6 steps after arrival, chunked prefill, prefix caching, preemption,
speculation) through your Scheduler and the pinned upstream's
(vllm/v1/core/sched/scheduler.py:64) in lockstep, once under FCFS and once
under PRIORITY.

A schedule() that never returns (a compiling request left at the head of its
queue, for one) is stopped by the grader's time limit, which names the line
it was stuck on.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import given
from phase12_sched_helpers import add, ids, lockstep_difference, make, scheduled, step, written

import mini_vllm.testing as mini
from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.strategies import structured_workloads
from mini_vllm.oracle.workload import run_workload

LOCKSTEP = lab_settings(30)
WAIT = "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"


# ------------------------------------------------------------------ the rules


@pytest.mark.points(2)
def test_a_new_request_joins_the_queue_its_status_says(impl):
    sched = make(impl)
    a, _ = add(sched, "a", 0, compiling=True)
    b, _ = add(sched, "b", 1)
    assert a.status.name == WAIT, a.status
    assert ids(sched.skipped_waiting) == ["a"] and ids(sched.waiting) == ["b"], (
        f"a request created waiting for its grammar ({WAIT}) joins skipped_waiting, a plain "
        f"one joins waiting; got waiting {ids(sched.waiting)}, skipped_waiting "
        f"{ids(sched.skipped_waiting)}."
    )
    # Its compile already finished: the status still says it waits (the
    # scheduler finds out when it next looks), so it still joins skipped_waiting.
    c, job = add(sched, "c", 2, compiling=True)
    job.done()
    assert ids(sched.skipped_waiting) == ["a", "c"], (
        f"c's compile finished before add_request, but its status is still {c.status.name}: "
        f"it joins skipped_waiting behind a; got skipped_waiting {ids(sched.skipped_waiting)}."
    )


@pytest.mark.points(4)
def test_a_compiling_request_is_passed_over_without_blocking_the_queue(impl):
    sched = make(impl)
    a, _ = add(sched, "a", 0, compiling=True)
    add(sched, "b", 1)
    add(sched, "c", 2)
    for n in range(3):
        out, _ = step(sched, n)
        if n == 0:
            assert scheduled(out) == ["b", "c"], (
                f"step 0: a (first in line) is still compiling: it is passed over and b, c "
                f"behind it are admitted; scheduled {scheduled(out)}, want ['b', 'c']. A "
                "compiling request must not block the queue (pop it, `continue`)."
            )
        assert "a" not in out.num_scheduled_tokens, f"step {n}: a ran before its grammar was ready"
        assert a.status.name == WAIT, (
            f"step {n}: a is still compiling: its status stays {WAIT}, got {a.status.name}."
        )
        assert ids(sched.skipped_waiting) == ["a"] and not sched.waiting, (
            f"step {n}: after the step a is back in skipped_waiting (and waiting is empty); got "
            f"skipped_waiting {ids(sched.skipped_waiting)}, waiting {ids(sched.waiting)}."
        )
    assert sched.get_num_unfinished_requests() == 3


@pytest.mark.points(3)
def test_promotion_sets_waiting_once_the_grammar_is_ready(impl):
    sched = make(impl)
    a, job = add(sched, "a", 0, compiling=True)
    promoted = written(sched._try_promote_blocked_waiting_request, a)
    assert promoted is False and a.status.name == WAIT, (
        f"while a's compile runs (grammar None), _try_promote_blocked_waiting_request returns "
        f"False and leaves the status {WAIT}; got {promoted!r}, {a.status.name}."
    )
    job.done()
    promoted = written(sched._try_promote_blocked_waiting_request, a)
    assert promoted is True and a.status.name == "WAITING", (
        f"a's grammar is compiled: promotion returns True and sets a WAITING (the status the "
        f"admission code expects of a new request); got {promoted!r}, {a.status.name}."
    )


@pytest.mark.points(3)
def test_it_runs_the_step_after_its_compile_finishes(impl):
    sched = make(impl)
    a, job = add(sched, "a", 0, compiling=True)
    add(sched, "b", 1)
    step(sched, 0)
    step(sched, 1)
    job.done()
    out, _ = step(sched, 2)
    new = [d.req_id for d in out.scheduled_new_reqs]
    assert new == ["a"], (
        f"step 2: a's compile finished before it: a is admitted as a new request; new requests "
        f"scheduled {new}, scheduled {scheduled(out)}."
    )
    assert a.status.name == "RUNNING" and not sched.skipped_waiting, (
        f"a now runs (status {a.status.name}) and skipped_waiting is empty (got "
        f"{ids(sched.skipped_waiting)})."
    )
    assert out.has_structured_output_requests


@pytest.mark.points(3)
def test_fcfs_takes_skipped_waiting_first(impl):
    # One seat. b (plain) arrived first, c's compile is already done: FCFS
    # looks at skipped_waiting first, so c gets the seat.
    sched = make(impl, max_num_seqs=1)
    add(sched, "b", 0)
    _, job = add(sched, "c", 1, compiling=True)
    job.done()
    out, _ = step(sched, 0)
    assert scheduled(out) == ["c"], (
        f"FCFS, one seat: b waits in waiting, c (compiled) in skipped_waiting; FCFS takes from "
        f"skipped_waiting first (its requests were passed over before), so c runs; scheduled "
        f"{scheduled(out)}, want ['c']."
    )
    assert written(sched._select_waiting_queue_for_scheduling) is sched.waiting
    sched = make(impl)
    assert written(sched._select_waiting_queue_for_scheduling) is None, (
        "with both queues empty there is no queue to take from: None"
    )


@pytest.mark.points(1)
@pytest.mark.parametrize(
    "w_priority, s_priority, w_arrival, s_arrival, winner",
    [(0, 1, 0, 1, "w"), (2, 1, 0, 1, "s"), (1, 1, 1, 0, "s"), (1, 1, 0, 1, "w")],
)
def test_priority_takes_whichever_head_orders_first(
    impl, w_priority, s_priority, w_arrival, s_arrival, winner
):
    sched = make(impl, max_num_seqs=1, policy="priority")
    add(sched, "w", w_arrival, priority=w_priority)
    _, job = add(sched, "s", s_arrival, priority=s_priority, compiling=True)
    job.done()
    out, _ = step(sched, 0)
    assert scheduled(out) == [winner], (
        f"PRIORITY, one seat: w (waiting: priority {w_priority}, arrival {w_arrival}) and s "
        f"(skipped_waiting, compiled: priority {s_priority}, arrival {s_arrival}). The queue "
        f"whose head orders first (smaller priority, then earlier arrival: Request's `<`) "
        f"gives the request; want {winner} scheduled, got {scheduled(out)}."
    )


@pytest.mark.points(4)
def test_skipped_requests_keep_their_order(impl):
    sched = make(impl)
    for i, r in enumerate("abc"):
        add(sched, r, i, compiling=True)
    add(sched, "d", 3)
    for n in range(3):
        step(sched, n)
        assert ids(sched.skipped_waiting) == ["a", "b", "c"], (
            f"step {n}: a, b, c (all compiling) were passed over in that order; they must come "
            f"back in that order, got {ids(sched.skipped_waiting)}. Each one goes to the FRONT "
            "of step_skipped_waiting, and the step's lot goes back to the FRONT of "
            "skipped_waiting (prepend_requests reverses as it prepends)."
        )
    # One seat: a is passed over, c (compiled) takes the seat, the loop stops
    # before e. a goes back AHEAD of e, which this step never reached.
    sched = make(impl, max_num_seqs=1)
    add(sched, "a", 0, compiling=True)
    _, job = add(sched, "c", 1, compiling=True)
    add(sched, "e", 2, compiling=True)
    job.done()
    out, _ = step(sched, 0)
    assert scheduled(out) == ["c"], f"want c (compiled) scheduled, got {scheduled(out)}"
    assert ids(sched.skipped_waiting) == ["a", "e"], (
        f"a was passed over this step and e was not reached: a goes back ahead of e (the "
        f"requests skipped this step go to the front of skipped_waiting); got "
        f"{ids(sched.skipped_waiting)}."
    )


@pytest.mark.points(4)
def test_a_compile_that_raised_fails_that_request_only(impl):
    sched = make(impl)
    a, job_a = add(sched, "a", 0, compiling=True)
    add(sched, "b", 1)
    c, job_c = add(sched, "c", 2, compiling=True)
    job_a.fail("the regex would not compile")
    out, result = step(sched, 0)
    assert scheduled(out) == ["b"], f"step 0: only b can run; scheduled {scheduled(out)}"
    assert a.status.name == "FINISHED_ERROR", (
        f"a's compile raised: a finishes with FINISHED_ERROR, got {a.status.name}."
    )
    assert "a" not in sched.requests and "a" in out.finished_req_ids, (
        "a failed: it is freed (_free_request: gone from the scheduler's requests, its id in "
        f"the step's finished_req_ids for the workers); requests {list(sched.requests)}, "
        f"finished_req_ids {sorted(out.finished_req_ids)}."
    )
    errors = [(o.request_id, list(o.new_token_ids), str(o.finish_reason)) for o in result.outputs]
    assert [e for e in errors if e[0] == "a"] == [("a", [], "error")], (
        f"update_from_output reports a once, with no tokens and finish reason error (its id "
        f"goes into failed_grammar_reqs); outputs {errors}."
    )
    assert ids(sched.skipped_waiting) == ["c"] and c.status.name == WAIT, (
        f"a finished: it must not go back to skipped_waiting (c, still compiling, does); got "
        f"{ids(sched.skipped_waiting)}."
    )
    job_c.done()
    out, result = step(sched, 1)
    assert scheduled(out) == ["b", "c"] and sched.get_num_unfinished_requests() == 2, (
        f"step 1: b runs on and c (compiled) joins: scheduled {scheduled(out)}; unfinished "
        f"{sched.get_num_unfinished_requests()} (want 2)."
    )
    assert not [o for o in result.outputs if o.request_id == "a"], "a was reported twice"


# ------------------------------------------------------------------ against upstream


def with_policy(policy: str):
    def set_policy(workload):
        return dataclasses.replace(workload, config={**workload.config, "policy": policy})

    return set_policy


@pytest.mark.upstream
@pytest.mark.points(4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_lockstep_with_upstreams_scheduler(impl, up, policy):
    seen = Counter()

    @LOCKSTEP
    @given(workload=structured_workloads().map(with_policy(policy)))
    def run(workload):
        mine = mini.create_scheduler(scheduler_cls=impl.scheduler.Scheduler, **workload.config)
        expected = run_workload(up, workload)
        got = written(run_workload, mini, workload, scheduler=mine)
        diff = lockstep_difference(expected, got)
        requests = [
            (s.req_id, s.arrive_step, s.grammar_ready_step, len(s.prompt_token_ids), s.priority)
            for s in workload.requests
        ]
        assert diff is None, (
            f"Your Scheduler and upstream's differ on a structured workload ({policy}):\n{diff}\n"
            f"config: {workload.config}\nrequests (id, arrival step, step its grammar is ready, "
            f"prompt length, priority): {requests}"
        )
        for s in expected["steps"]:
            if "structured" in s:
                sampled, skipped = s["structured"]
                seen["skipped while others ran"] += bool(skipped and s["scheduled"])
                seen["sampled a structured request"] += bool(sampled)

    run()
    assert seen["skipped while others ran"] and seen["sampled a structured request"], (
        f"the generated workloads did not reach the wait (counts {dict(seen)}): the lockstep "
        "proved too little"
    )
