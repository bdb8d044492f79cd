"""Lab 15.2 — a request's states with asynchronous loads and failures.

Graded: the ``LAB 15.2`` regions of ``labs/phase_15/scheduler.py``: in
``schedule()``, a request whose KV loads asynchronously holds its blocks and
waits in ``WAITING_FOR_REMOTE_KVS`` (in ``skipped_waiting``);
``_update_from_kv_xfer_finished`` (the workers' ``finished_recving`` and
``finished_sending``), ``_try_promote_remote_kv_request`` and
``_update_waiting_for_remote_kv`` (back to WAITING, the loaded blocks cached,
a full hit recomputing its last token), and
``_update_requests_with_invalid_blocks`` (blocks that failed to load: the
request is cut back to its last good block and recomputes, or fails alone
under ``kv_load_failure_policy="fail"``).

First the rules, on your Scheduler driven by hand with the fake connector
(phase15_sched_helpers.py). Then, marked ``upstream``, generated connector
workloads through your Scheduler and the pinned upstream's in lockstep
(vllm/v1/core/sched/scheduler.py:64), every state and connector call equal.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from phase15_sched_helpers import (
    add,
    calls_named,
    describe,
    free_blocks,
    lockstep,
    make,
    prompt,
    step,
)

from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.connector_strategies import connector_workloads

LOCKSTEP = lab_settings(40)
REMOTE = "WAITING_FOR_REMOTE_KVS"


def ids(queue) -> list[str]:
    return [r.request_id for r in queue]


@pytest.mark.points(4)
def test_an_async_load_waits_in_waiting_for_remote_kvs(impl):
    sched = make(impl, {"a": {"hit": 20, "async": True, "delay": 2}})
    total = free_blocks(sched)
    a = add(sched, "a", prompt(1, 30))
    add(sched, "b", prompt(50, 8))
    out, _, _, calls = step(sched, 0)
    assert "a" not in out.num_scheduled_tokens and "b" in out.num_scheduled_tokens, (
        f"step 0: a's 20 external tokens load asynchronously: a does not run this step (b "
        f"does); scheduled {dict(out.num_scheduled_tokens)}."
    )
    assert a.status.name == REMOTE and ids(sched.skipped_waiting) == ["a"], (
        f"step 0: a waits for its KV in {REMOTE}, passed over into skipped_waiting; status "
        f"{a.status.name}, skipped_waiting {ids(sched.skipped_waiting)}, waiting "
        f"{ids(sched.waiting)}."
    )
    assert a.num_computed_tokens == 20, (
        f"step 0: the 20 tokens coming count as computed already (num_computed_tokens), got "
        f"{a.num_computed_tokens}."
    )
    assert free_blocks(sched) == total - 5 - 2, (
        f"a holds the 5 blocks its 20 tokens load into (b holds 2): free blocks "
        f"{free_blocks(sched)}, want {total - 7}."
    )
    assert calls_named(calls, "build_connector_meta")[0][1] == [["a", [1, 2, 3, 4, 5], True]]


@pytest.mark.points(5)
def test_finished_recving_promotes_it_and_caches_the_loaded_blocks(impl):
    sched = make(impl, {"a": {"hit": 20, "async": True, "delay": 2}, "c": {"hit": 20}})
    a = add(sched, "a", prompt(1, 30))
    for n in (0, 1, 2):
        out, _, report, _ = step(sched, n)
        assert "a" not in out.num_scheduled_tokens and a.status.name == REMOTE, (
            f"step {n}: a's load is not done before step {n}'s report: it keeps waiting in "
            f"{REMOTE}; status {a.status.name}, scheduled {dict(out.num_scheduled_tokens)}."
        )
    assert report[1] == {"a"}, f"the fake workers report a's load done in step 2: {report}"
    add(sched, "c", prompt(1, 20) + prompt(500, 6))
    out, _, _, calls = step(sched, 3)
    assert out.num_scheduled_tokens.get("a") == 10 and a.status.name == "RUNNING", (
        f"step 3: a's load ended in step 2's report: a is promoted (WAITING) and admitted, "
        f"its 20 loaded tokens computed, so 10 are scheduled; scheduled "
        f"{dict(out.num_scheduled_tokens)}, status {a.status.name}."
    )
    assert [d.req_id for d in out.scheduled_new_reqs][:1] == ["a"], (
        "a never ran before: it is sent as a NEW request (status WAITING after promotion)"
    )
    asked = [x for x in calls_named(calls, "get_num_new_matched_tokens") if x[1] == "c"]
    assert asked and asked[0][2] == 20, (
        "step 3: c shares a's first 20 tokens. Once a's load ended its loaded blocks must be "
        "cached (cache_blocks up to num_computed_tokens), so c's local hit is 20; the "
        f"connector was asked about c with {asked[0][2] if asked else None}."
    )


@pytest.mark.points(3)
def test_a_full_hit_recomputes_its_last_token(impl):
    sched = make(impl, {"a": {"hit": 12, "async": True, "delay": 0}})
    a = add(sched, "a", prompt(1, 12))
    step(sched, 0)
    out, _, _, _ = step(sched, 1)
    assert out.num_scheduled_tokens.get("a") == 1 and a.num_output_tokens == 1, (
        f"step 1: all 12 of a's tokens were loaded; its first output token needs the logits "
        f"of its last prompt token, so num_computed_tokens goes back to 11 and 1 token is "
        f"scheduled; scheduled {dict(out.num_scheduled_tokens)}, outputs {a.num_output_tokens}."
    )


@pytest.mark.points(4)
def test_an_abort_while_loading_keeps_the_blocks_until_the_load_ends(impl):
    sched = make(impl, {"a": {"hit": 20, "async": True, "delay": 2}})
    total = free_blocks(sched)
    a = add(sched, "a", prompt(1, 30))
    step(sched, 0)
    sched.finish_requests("a", type(a.status).FINISHED_ABORTED)
    assert a.is_finished() and "a" in sched.requests and free_blocks(sched) == total - 5, (
        "a was aborted while its KV loads: the workers may still write into its 5 blocks, so "
        "they stay allocated (and a in scheduler.requests) until the load is reported; free "
        f"blocks {free_blocks(sched)}, want {total - 5}."
    )
    step(sched, 1)
    _, _, report, _ = step(sched, 2)
    assert report[1] == {"a"} and "a" not in sched.requests and free_blocks(sched) == total, (
        f"step 2 reports a's load done (finished_recving {report[1]}): a is finished, so its "
        f"blocks are freed now; free blocks {free_blocks(sched)} of {total}, requests "
        f"{sorted(sched.requests)}."
    )


@pytest.mark.points(5)
def test_a_failed_sync_load_is_recomputed(impl):
    sched = make(impl, {"a": {"hit": 20, "fail": 1}})
    a = add(sched, "a", prompt(1, 30), max_tokens=2)
    out, result, report, _ = step(sched, 0)
    assert report[2] == {2}, f"block 2 (a's second) fails to load in step 0: {report}"
    assert a.num_computed_tokens == 4 and a.num_output_tokens == 0, (
        f"step 0: a's second block (tokens 4-7) failed to load, so everything a computed on "
        f"top of it is wrong: num_computed_tokens goes back to the start of the first bad "
        f"block (4) and the token sampled this step is dropped; got num_computed_tokens "
        f"{a.num_computed_tokens}, outputs {a.output_token_ids}."
    )
    assert not [o for o in result.outputs if o.request_id == "a"], (
        "a's step computed on bad KV: update_from_output reports nothing for it"
    )
    out, _, _, _ = step(sched, 1)
    assert out.num_scheduled_tokens.get("a") == 26 and a.num_output_tokens == 1, (
        f"step 1: a recomputes from token 4 (26 tokens) and samples its first token; "
        f"scheduled {dict(out.num_scheduled_tokens)}, outputs {a.num_output_tokens}."
    )


@pytest.mark.points(4)
def test_the_fail_policy_fails_that_request_alone(impl):
    sched = make(impl, {"a": {"hit": 20, "fail": 0}}, policy="fail")
    a = add(sched, "a", prompt(1, 30))
    b = add(sched, "b", prompt(50, 10))
    _, result, _, _ = step(sched, 0)
    got = [(o.request_id, list(o.new_token_ids), str(o.finish_reason)) for o in result.outputs]
    assert a.status.name == "FINISHED_ERROR" and ("a", [], "error") in got, (
        f"kv_load_failure_policy='fail': a's load failed, so a ends with FINISHED_ERROR and "
        f"an output with no tokens and finish reason error; status {a.status.name}, outputs "
        f"{got}."
    )
    assert b.status.name == "RUNNING" and ("b", [1234], "None") in got, (
        f"b did not read the failed block: it goes on; status {b.status.name}, outputs {got}."
    )


@pytest.mark.points(4)
def test_a_failed_async_load_is_cut_back_before_it_runs(impl):
    sched = make(impl, {"a": {"hit": 20, "async": True, "delay": 1, "fail": 2}})
    a = add(sched, "a", prompt(1, 30))
    step(sched, 0)
    _, _, report, _ = step(sched, 1)
    assert report[1] == {"a"} and report[2] == {3}, f"step 1's report: {report}"
    assert a.num_computed_tokens == 8 and a.status.name == REMOTE, (
        f"step 1: a's third loaded block (block 3, tokens 8-11) failed: a, still in {REMOTE}, "
        f"is cut back to 8 computed tokens; got {a.num_computed_tokens}, {a.status.name}."
    )
    out, _, _, _ = step(sched, 2)
    assert out.num_scheduled_tokens.get("a") == 22, (
        f"step 2: a is promoted and computes from token 8: 22 tokens; scheduled "
        f"{dict(out.num_scheduled_tokens)}."
    )


# ------------------------------------------------------------------ against upstream


@pytest.mark.upstream
@pytest.mark.points(8)
@pytest.mark.timeout(300)
def test_lockstep_with_upstreams_scheduler(impl, up):
    seen = {"waited for remote KV": 0, "failed blocks": 0, "errors": 0}

    @LOCKSTEP
    @given(workload=connector_workloads())
    def run(workload):
        expected, diff = lockstep(impl, up, workload)
        assert diff is None, (
            f"Your Scheduler and upstream's differ on a connector workload:\n{diff}\n"
            f"{describe(workload)}"
        )
        states = {st[1] for s in expected["steps"] for st in s["states"]}
        seen["waited for remote KV"] += REMOTE in states
        seen["failed blocks"] += any(s["kv_output"][2] for s in expected["steps"])
        seen["errors"] += "FINISHED_ERROR" in states

    run()
    assert all(seen.values()), f"the generated workloads missed a path: {seen}"
