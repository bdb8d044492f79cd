"""Lab 15.1 — the scheduler side of a KV connector.

Graded: the ``LAB 15.1`` regions of ``labs/phase_15/scheduler.py``: in
``schedule()``'s waiting loop, the connector's answer about the tokens it
holds past the local prefix hit (``get_num_new_matched_tokens``; ``None``
passes the request over for the step), ``update_state_after_alloc`` with the
request's blocks once they are allocated, ``build_connector_meta`` once a
step; and ``_connector_finished`` (``request_finished``, whose True keeps a
finished request's blocks until the workers report the save done).

First the rules, on your Scheduler driven by hand with the fake connector
(mini_vllm/oracle/fake_connector.py; phase15_sched_helpers.py). Then, marked
``upstream``, generated workloads with connector plans
(mini_vllm/oracle/connector_strategies.py: external hits, sync and async
loads, "ask again" answers, failed blocks, delayed saves, both failure
policies) through your Scheduler and the pinned upstream's
(vllm/v1/core/sched/scheduler.py:64), each loading the same fake connector
through ``kv_connector_module_path``: every step's output, every connector
call with its arguments and answer, and the workers' report must be equal.
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


@pytest.mark.points(4)
def test_an_external_hit_is_computed_without_being_scheduled(impl):
    sched = make(impl, {"a": {"hit": 20}})
    a = add(sched, "a", prompt(1, 30))
    out, _, _, calls = step(sched, 0)
    asked = calls_named(calls, "get_num_new_matched_tokens")
    assert asked == [["get_num_new_matched_tokens", "a", 0, 20, False]], (
        "step 0: a (30 tokens, nothing in the local prefix cache) must be asked about once, "
        "with num_computed_tokens = its local hit (0); the fake store answers (20, False): 20 "
        f"tokens, loaded synchronously. Calls recorded: {asked}."
    )
    assert out.num_scheduled_tokens.get("a") == 10, (
        f"step 0: the connector holds 20 of a's 30 tokens, so only 10 are scheduled (they "
        f"count as computed and cost no budget); scheduled {dict(out.num_scheduled_tokens)}."
    )
    assert a.num_computed_tokens == 30 and a.num_output_tokens == 1, (
        f"after step 0 a has computed all 30 tokens (20 external + 10 scheduled) and sampled "
        f"its first token; num_computed_tokens {a.num_computed_tokens}, outputs "
        f"{a.num_output_tokens}."
    )


@pytest.mark.points(3)
def test_the_connector_is_asked_past_the_local_hit(impl):
    sched = make(impl, {"b": {"hit": 24}})
    shared = prompt(1, 16)
    add(sched, "a", shared + prompt(100, 14))
    step(sched, 0)
    add(sched, "b", shared + prompt(200, 14))
    out, _, _, calls = step(sched, 1)
    asked = calls_named(calls, "get_num_new_matched_tokens")
    assert asked == [["get_num_new_matched_tokens", "b", 16, 8, False]], (
        "step 1: b shares a's first 16 tokens (4 whole blocks, cached): the connector is asked "
        "with num_computed_tokens=16 (the LOCAL hit, num_new_local_computed_tokens) and answers "
        f"the 8 tokens it holds beyond it (24 - 16). Calls recorded: {asked}."
    )
    assert out.num_scheduled_tokens.get("b") == 30 - 24, (
        f"step 1: b's 30 tokens minus 16 local and 8 external leave 6 to schedule; scheduled "
        f"{dict(out.num_scheduled_tokens)}."
    )


@pytest.mark.points(4)
def test_ask_again_passes_the_request_over_without_blocking(impl):
    sched = make(impl, {"a": {"hit": 8, "unknown": 2}})
    a = add(sched, "a", prompt(1, 12))
    add(sched, "b", prompt(50, 12))
    for n in range(2):
        out, _, _, calls = step(sched, n)
        assert "a" not in out.num_scheduled_tokens and "b" in out.num_scheduled_tokens, (
            f"step {n}: the connector answered None for a (not known yet): a is passed over "
            f"this step and b, behind it, still runs; scheduled {dict(out.num_scheduled_tokens)}."
        )
        assert a.status.name == "WAITING" and a.num_computed_tokens == 0, (
            f"step {n}: a stays WAITING with nothing computed; got {a.status.name}, "
            f"{a.num_computed_tokens}."
        )
        assert all(c[1] != "a" for c in calls_named(calls, "update_state_after_alloc")), (
            f"step {n}: a was given no blocks, so update_state_after_alloc is not called for it"
        )
    out, _, _, calls = step(sched, 2)
    assert out.num_scheduled_tokens.get("a") == 4, (
        f"step 2: the third answer is (8, False): a runs its last 4 tokens; scheduled "
        f"{dict(out.num_scheduled_tokens)}."
    )
    assert len([c for c in calls_named(calls, "get_num_new_matched_tokens") if c[1] == "a"]) == 1


@pytest.mark.points(4)
def test_update_state_after_alloc_gets_every_block(impl):
    sched = make(impl, {"a": {"hit": 8}})
    shared = prompt(1, 8)
    add(sched, "p", shared + prompt(300, 3))
    step(sched, 0)
    a = add(sched, "a", shared + prompt(400, 13))  # 21 tokens: 6 blocks, 2 of them cached
    b = add(sched, "b", prompt(90, 9))
    out, _, _, calls = step(sched, 1)
    alloc = {c[1]: c for c in calls_named(calls, "update_state_after_alloc")}
    blocks = {
        r.request_id: list(sched.kv_cache_manager.get_block_ids(r.request_id)[0]) for r in (a, b)
    }
    assert set(alloc) == {"a", "b"}, (
        "step 1: update_state_after_alloc is called for EVERY request admitted (with a "
        f"connector), also one with nothing external (b); called for {sorted(alloc)}."
    )
    assert alloc["a"][2] == blocks["a"] and len(blocks["a"]) == 6, (
        f"a's call must carry ALL its blocks (the 2 cached ones first, then the new ones: "
        f"kv_cache_manager.get_blocks), {blocks['a']}; got {alloc['a'][2]}."
    )
    assert alloc["a"][3] == 0 and alloc["b"][3] == 0, (
        "a's local hit is 8 tokens and the store holds 8: nothing external; b has no plan: "
        f"num_external_tokens must be 0 for both; got {alloc['a'][3]}, {alloc['b'][3]}."
    )
    sched2 = make(impl, {"c": {"hit": 12}})
    add(sched2, "c", prompt(1, 20))
    _, _, _, calls = step(sched2, 0)
    (call,) = calls_named(calls, "update_state_after_alloc")
    assert call[3] == 12, f"c: 12 tokens external, so num_external_tokens=12; got {call}"


@pytest.mark.points(4)
def test_build_connector_meta_once_a_step(impl):
    sched = make(impl, {"a": {"hit": 8}})
    add(sched, "a", prompt(1, 12), max_tokens=2)
    seen = 0
    for n in range(4):
        out, _, _, calls = step(sched, n)
        built = calls_named(calls, "build_connector_meta")
        assert len(built) == 1, (
            f"step {n}: build_connector_meta is called exactly once per schedule(), even when "
            f"nothing is scheduled; called {len(built)} times."
        )
        assert out.kv_connector_metadata is not None, (
            f"step {n}: the metadata goes into scheduler_output.kv_connector_metadata, for the "
            "workers"
        )
        seen += bool(built[0][1])
        if n == 0:
            assert built[0][1] == [["a", [1, 2], False]], (
                f"step 0: a's load (blocks 1 and 2, the 8 external tokens) is in step 0's "
                f"metadata: the connector packs it AFTER update_state_after_alloc; got {built}."
            )
    assert seen == 1


@pytest.mark.points(5)
def test_request_finished_holds_the_blocks_of_a_save(impl):
    sched = make(impl, {"a": {"save": 2}})
    total = free_blocks(sched)
    a = add(sched, "a", prompt(1, 10), max_tokens=1)
    add(sched, "b", prompt(50, 10), max_tokens=1)
    _, _, _, calls = step(sched, 0)
    finished = {c[1]: c for c in calls_named(calls, "request_finished")}
    a_blocks = list(sched.kv_cache_manager.get_block_ids("a")[0]) if "a" in sched.requests else []
    assert set(finished) == {"a", "b"}, (
        "step 0: a and b each sample their one token and finish: request_finished is called "
        f"once for each, before their blocks are freed; called for {sorted(finished)}."
    )
    assert finished["a"][2] == a_blocks and len(a_blocks) == 3, (
        f"request_finished gets the request's block ids (3 blocks for 10 tokens), "
        f"{a_blocks}; got {finished['a'][2]}."
    )
    assert finished["a"][3] is True and finished["b"][3] is False
    assert "a" in sched.requests and "b" not in sched.requests, (
        "the connector answered True for a (it still reads a's blocks: a save in flight): a's "
        "blocks stay allocated and a stays in scheduler.requests until the workers report it "
        "in finished_sending; b (False) is freed at once. requests now "
        f"{sorted(sched.requests)}."
    )
    assert a.is_finished() and free_blocks(sched) == total - 3, (
        f"only a's 3 blocks are still held: free blocks {free_blocks(sched)}, want {total - 3}."
    )
    assert sched.has_finished_requests(), (
        "a finished request whose blocks a save holds keeps the scheduler busy"
    )
    # The save rides in step 1's metadata (request_finished ran after step 0's
    # build_connector_meta); the fake workers report it done 2 steps later.
    for n in (1, 2, 3):
        _, _, report, _ = step(sched, n)
        if n < 3:
            assert "a" in sched.requests and free_blocks(sched) == total - 3, (
                f"step {n}: a's save is not reported done yet: its blocks stay held; free "
                f"blocks {free_blocks(sched)}, want {total - 3}."
            )
    assert report[0] == {"a"} and "a" not in sched.requests and free_blocks(sched) == total, (
        f"step 3 reports a's save done (finished_sending {report[0]}): a's blocks are freed "
        f"now; free blocks {free_blocks(sched)} of {total}, requests {sorted(sched.requests)}."
    )


@pytest.mark.points(2)
def test_the_transfer_parameters_go_out_with_the_last_output(impl, monkeypatch):
    sched = make(impl, {})
    add(sched, "a", prompt(1, 10), max_tokens=1)
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3]}
    answer = sched.connector.request_finished
    monkeypatch.setattr(
        sched.connector, "request_finished", lambda req, blocks: (answer(req, blocks)[0], params)
    )
    _, result, _, _ = step(sched, 0)
    (out,) = [o for o in result.outputs if o.request_id == "a"]
    assert out.kv_transfer_params == params, (
        "a network connector's request_finished returns, besides the delay, the parameters a "
        "decode engine needs to pull the KV (remote engine, blocks...): keep them in "
        "finished_kv_transfer_params, and they go out with the request's last output; got "
        f"kv_transfer_params {out.kv_transfer_params!r}."
    )


@pytest.mark.points(2)
def test_an_aborted_request_is_reported_to_the_connector(impl):
    sched = make(impl, {})
    add(sched, "a", prompt(1, 10), max_tokens=5)
    step(sched, 0)
    sched.finish_requests("a", type(sched.requests["a"].status).FINISHED_ABORTED)
    calls = sched.connector.take_calls()
    assert [c[:2] for c in calls_named(calls, "request_finished")] == [["request_finished", "a"]], (
        f"an abort finishes the request too: request_finished once for a; calls {calls}."
    )


# ------------------------------------------------------------------ against upstream


@pytest.mark.upstream
@pytest.mark.points(8)
@pytest.mark.timeout(300)
def test_lockstep_with_upstreams_scheduler(impl, up):
    seen = {"sync": 0, "ask again": 0, "held by a save": 0}

    @LOCKSTEP
    @given(workload=connector_workloads())
    def run(workload):
        expected, diff = lockstep(impl, up, workload)
        assert diff is None, (
            f"Your Scheduler and upstream's differ on a connector workload:\n{diff}\n"
            f"{describe(workload)}"
        )
        calls = [c for s in expected["steps"] for c in s["connector"]]
        seen["sync"] += any(
            c[0] == "get_num_new_matched_tokens" and c[3] and not c[4] for c in calls
        )
        seen["ask again"] += any(
            c[0] == "get_num_new_matched_tokens" and c[3] is None for c in calls
        )
        seen["held by a save"] += any(c[0] == "request_finished" and c[3] for c in calls)

    run()
    assert all(seen.values()), f"the generated workloads missed a path: {seen}"
