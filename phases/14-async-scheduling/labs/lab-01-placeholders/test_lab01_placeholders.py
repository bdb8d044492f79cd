"""Lab 14.1 — output placeholders: scheduling before the tokens are back.

Graded: the ``LAB 14.1`` regions of ``labs/phase_14/async_scheduler.py``:
in ``_update_after_schedule``, one placeholder per request that samples in
the step just scheduled; in ``_update_request_with_output``, a late token
fills a placeholder and the blocks it completes join the prefix cache; in
``update_from_output``, a request that a late token stopped while it sat
preempted leaves the waiting queue.

First the rules, on a scheduler driven by hand (two steps in flight, as
``EngineCore.step_with_batch_queue`` keeps them); then, marked ``upstream``,
generated workloads run through your AsyncScheduler and the pinned
upstream's (vllm/v1/core/sched/async_scheduler.py:12) with outputs delivered
one step late (mini_vllm/oracle/async_workload.py): every engine step's
batch, the delivered output, the placeholders, the prefix-cached blocks and
each request's counts must be equal.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from phase14_helpers import async_scheduler, runner_output, written

import mini_vllm.testing as mini
from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.async_workload import ASYNC_FIELD_WORDS, run_workload_async
from mini_vllm.oracle.strategies import spec_workloads, workloads
from mini_vllm.oracle.workload import RequestSpec, Workload, first_difference
from mini_vllm.request import RequestStatus

LOCKSTEP = lab_settings(60)
LOCKSTEP_SPEC = lab_settings(30)
EOS = mini.EOS_TOKEN_ID
SMALL = dict(block_size=4, num_blocks=20, max_num_batched_tokens=64, max_model_len=32)


def one_request(impl, prompt, max_tokens=8, **config):
    sched = async_scheduler(impl.async_scheduler.AsyncScheduler, **{**SMALL, **config})
    (req,) = mini.create_requests(
        1, req_ids=["a"], prompt_token_ids=[prompt], max_tokens=max_tokens, block_size=4
    )
    sched.add_request(req)
    return sched, req


def counts(req) -> tuple[int, int, int]:
    return req.num_output_placeholders, req.num_computed_tokens, req.num_tokens


# ------------------------------------------------------------------ the rules


@pytest.mark.points(5)
def test_placeholders_go_1_2_1(impl):
    sched, req = one_request(impl, list(range(1, 10)))
    s1 = written(sched.schedule)
    assert req.num_output_placeholders == 1, (
        f"Step 1 runs the whole 9-token prompt, so it samples a token that is not back yet: "
        f"placeholders should be 1, got {req.num_output_placeholders}."
    )
    s2 = written(sched.schedule)
    assert s2.num_scheduled_tokens == {"a": 1}, s2.num_scheduled_tokens
    assert counts(req) == (2, 10, 9), (
        f"Step 2 is scheduled before step 1's token is back: (placeholders, computed, tokens) "
        f"should be (2, 10, 9), got {counts(req)}. Each step that samples adds one "
        "placeholder; num_computed_tokens runs ahead of num_tokens."
    )
    written(sched.update_from_output, s1, runner_output(s1, {"a": [7]}))
    assert counts(req) == (1, 10, 10), (
        f"Step 1's token came back: (placeholders, computed, tokens) should be (1, 10, 10), "
        f"got {counts(req)}: the token fills one placeholder."
    )
    seen = []
    for k in range(3):
        s1, s2 = s2, written(sched.schedule)
        seen.append(req.num_output_placeholders)
        written(sched.update_from_output, s1, runner_output(s1, {"a": [8 + k]}))
        seen.append(req.num_output_placeholders)
    assert seen == [2, 1] * 3, (
        f"A steady decode: schedule, take one token in, again. Placeholders after each call: "
        f"got {seen}, want [2, 1, 2, 1, 2, 1]."
    )


@pytest.mark.points(3)
def test_a_prefill_chunk_gets_no_placeholder(impl):
    sched, req = one_request(impl, list(range(1, 13)), max_num_batched_tokens=8, max_num_seqs=4)
    s1 = written(sched.schedule)
    assert s1.num_scheduled_tokens == {"a": 8}
    assert req.num_output_placeholders == 0, (
        f"Step 1 runs 8 of the 12 prompt tokens (chunked prefill): it samples nothing, so no "
        f"placeholder; got {req.num_output_placeholders}. Skip a request still mid-prefill "
        "(request.is_prefill_chunk)."
    )
    written(sched.schedule)
    assert req.num_output_placeholders == 1, (
        f"Step 2 runs the last 4 prompt tokens and samples the first output: 1 placeholder, "
        f"got {req.num_output_placeholders}."
    )
    written(sched.update_from_output, s1, runner_output(s1, {}))
    assert counts(req) == (1, 12, 12), (
        f"Step 1's output (no token: it was a prefill chunk) leaves (placeholders, computed, "
        f"tokens) at (1, 12, 12); got {counts(req)}."
    )


@pytest.mark.points(4)
def test_the_late_token_fills_a_placeholder_and_a_late_stop_stops(impl):
    sched, req = one_request(impl, [1, 2, 3, 4, 5])
    s1, s2 = written(sched.schedule), written(sched.schedule)
    written(sched.update_from_output, s1, runner_output(s1, {"a": [9]}))
    assert req.output_token_ids == [9] and counts(req) == (1, 6, 6), (
        f"After step 1's token 9 came back: output {list(req.output_token_ids)}, "
        f"(placeholders, computed, tokens) {counts(req)}; want [9] and (1, 6, 6)."
    )
    s3 = written(sched.schedule)
    result = written(sched.update_from_output, s2, runner_output(s2, {"a": [EOS]}))
    assert req.status == RequestStatus.FINISHED_STOPPED, (
        f"Step 2's token is EOS, with step 3 already scheduled: the request must stop "
        f"(FINISHED_STOPPED), got {req.status.name}."
    )
    assert req.output_token_ids == [9, EOS] and req.num_output_placeholders == 1, (
        f"Output {list(req.output_token_ids)}, placeholders {req.num_output_placeholders}: "
        f"want [9, {EOS}] and 1 (step 3's token is still in flight)."
    )
    (out,) = result.outputs
    assert out.new_token_ids == [EOS] and out.finish_reason is not None
    written(sched.update_from_output, s3, runner_output(s3, {"a": [11]}))
    assert req.output_token_ids == [9, EOS], (
        f"Step 3's token came back for a request that already stopped: it must be dropped; "
        f"output is {list(req.output_token_ids)}."
    )
    assert "a" not in sched.requests, "the stopped request should be gone from the scheduler"


@pytest.mark.points(5)
def test_a_request_stopped_while_preempted_leaves_the_waiting_queue(impl):
    # 2 usable blocks of 4: two 4-token prompts fill them; b's next token needs
    # a block, so scheduling step 2 preempts b (the newest) with its token in flight.
    sched = async_scheduler(impl.async_scheduler.AsyncScheduler, **{**SMALL, "num_blocks": 3})
    a, b = mini.create_requests(
        2, req_ids=["a", "b"], prompt_token_ids=[[1, 2, 3, 4], [5, 6, 7, 8]], block_size=4
    )
    sched.add_request(a)
    sched.add_request(b)
    s1 = written(sched.schedule)
    s2 = written(sched.schedule)
    assert s2.preempted_req_ids == {"b"} and b.status == RequestStatus.PREEMPTED
    written(sched.update_from_output, s1, runner_output(s1, {"a": [11], "b": [EOS]}))
    assert b.status == RequestStatus.FINISHED_STOPPED, b.status
    waiting = [r.request_id for r in sched.waiting]
    assert "b" not in waiting, (
        f"b was preempted (it sits in the waiting queue) when step 1's token for it, EOS, came "
        f"back and stopped it. A finished request must leave the waiting queue, or the next "
        f"schedule() would run it again; waiting holds {waiting}. Only async scheduling can "
        "stop a preempted request."
    )
    assert counts(a) == (1, 5, 5), f"a: (placeholders, computed, tokens) {counts(a)}"
    for k in range(3):  # the rest runs; b never comes back
        s1, s2 = s2, written(sched.schedule)
        assert "b" not in s2.num_scheduled_tokens, "b finished; it was scheduled again"
        written(sched.update_from_output, s1, runner_output(s1, {"a": [12 + k]}))

    # The same, but b's late token does not stop it: b stays preempted and waits.
    sched = async_scheduler(impl.async_scheduler.AsyncScheduler, **{**SMALL, "num_blocks": 3})
    a, b = mini.create_requests(
        2, req_ids=["a", "b"], prompt_token_ids=[[1, 2, 3, 4], [5, 6, 7, 8]], block_size=4
    )
    sched.add_request(a)
    sched.add_request(b)
    s1, _ = written(sched.schedule), written(sched.schedule)
    written(sched.update_from_output, s1, runner_output(s1, {"a": [11], "b": [12]}))
    waiting = [r.request_id for r in sched.waiting]
    assert b.status == RequestStatus.PREEMPTED and waiting == ["b"], (
        f"b was preempted and its late token 12 does not stop it: b must stay PREEMPTED in the "
        f"waiting queue (got status {b.status.name}, waiting {waiting}). Remove only the "
        "preempted requests that the update finished."
    )
    assert b.output_token_ids == [12], f"b's late token is still its output: {b.output_token_ids}"


@pytest.mark.points(4)
def test_a_request_length_capped_while_preempted_leaves_the_waiting_queue(impl):
    # As above, but b's late token is an ordinary one that reaches its
    # max_tokens (1): b finishes FINISHED_LENGTH_CAPPED, not by a stop token.
    sched = async_scheduler(impl.async_scheduler.AsyncScheduler, **{**SMALL, "num_blocks": 3})
    a = mini.create_requests(1, req_ids=["a"], prompt_token_ids=[[1, 2, 3, 4]], block_size=4)[0]
    (b,) = mini.create_requests(
        1, req_ids=["b"], prompt_token_ids=[[5, 6, 7, 8]], max_tokens=1, block_size=4
    )
    sched.add_request(a)
    sched.add_request(b)
    s1 = written(sched.schedule)
    s2 = written(sched.schedule)
    assert s2.preempted_req_ids == {"b"} and b.status == RequestStatus.PREEMPTED
    result = written(sched.update_from_output, s1, runner_output(s1, {"a": [11], "b": [12]}))
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED, (
        f"b (max_tokens=1) was preempted when step 1's token for it, 12, came back: that "
        f"token is its last, so b must finish FINISHED_LENGTH_CAPPED; got {b.status.name}."
    )
    waiting = [r.request_id for r in sched.waiting]
    assert "b" not in waiting, (
        f"b was preempted (it sits in the waiting queue) when its late token reached "
        f"max_tokens and finished it (length, not a stop token). Every request the update "
        f"finished leaves the waiting queue, whatever ended it; waiting holds {waiting}."
    )
    finished = [(o.request_id, o.finish_reason) for o in result.outputs if o.finish_reason]
    assert [r for r, _ in finished] == ["b"], f"finished outputs: {finished}"
    for k in range(3):  # the rest runs; b never comes back
        s1, s2 = s2, written(sched.schedule)
        assert "b" not in s2.num_scheduled_tokens, "b finished; it was scheduled again"
        written(sched.update_from_output, s1, runner_output(s1, {"a": [13 + k]}))
    assert "b" not in sched.requests, "the finished request should be gone from the scheduler"


@pytest.mark.points(4)
def test_drafts_hold_placeholders_until_the_late_output(impl):
    # k = 3 drafts, proposed in the worker (EAGLE/MTP): the scheduler only
    # ever holds -1 placeholders for their ids.
    sched, req = one_request(impl, list(range(1, 10)), max_tokens=20, num_speculative_tokens=3)
    s1 = written(sched.schedule)
    assert req.num_output_placeholders == 1 and list(req.spec_token_ids) == [-1, -1, -1], (
        f"Step 1 runs the prompt and samples a token (1 placeholder), and the request's next "
        f"step verifies 3 drafts the worker proposes meanwhile: spec_token_ids should be "
        f"[-1, -1, -1] (self._spec_token_placeholders); got placeholders "
        f"{req.num_output_placeholders}, spec_token_ids {list(req.spec_token_ids)}."
    )
    s2 = written(sched.schedule)
    assert s2.num_scheduled_tokens == {"a": 4}, (
        f"Step 2 is a decode with 3 drafts: 1 + 3 tokens; got {s2.num_scheduled_tokens}."
    )
    assert counts(req) == (5, 13, 9), (
        f"After step 2 is scheduled, (placeholders, computed, tokens) should be (5, 13, 9): "
        f"step 1's token, and step 2's token and its 3 drafts, all still in flight; got "
        f"{counts(req)}. Add 1 + the drafts scheduled for it per step."
    )
    written(sched.update_from_output, s1, runner_output(s1, {"a": [7]}))
    s3 = written(sched.schedule)
    assert s3.num_scheduled_tokens == {"a": 4} and counts(req) == (8, 17, 10), (
        f"Step 1's token is back, step 3 scheduled: (placeholders, computed, tokens) should be "
        f"(8, 17, 10); got {counts(req)}."
    )
    # Step 2's output: 1 draft accepted and one token more; 2 drafts rejected.
    written(sched.update_from_output, s2, runner_output(s2, {"a": [8, 9]}))
    assert counts(req) == (4, 15, 12), (
        f"Step 2 verified 3 drafts and 1 was accepted: its output is 2 tokens, 2 drafts were "
        f"rejected. (placeholders, computed, tokens) should be (4, 15, 12): the base takes the "
        f"rejected drafts off the computed tokens and the placeholders, and the 2 tokens kept "
        f"fill 2 placeholders (step 3's 4 stay); got {counts(req)}."
    )


@pytest.mark.points(5)
def test_blocks_are_cached_when_the_late_token_completes_them(impl):
    # A 3-token prompt in blocks of 4: block 0's last slot is the first output.
    sched, req = one_request(impl, [1, 2, 3])
    manager = sched.kv_cache_manager
    outs = [written(sched.schedule), written(sched.schedule)]
    cached = []
    for k in range(3):
        out = outs.pop(0)
        written(sched.update_from_output, out, runner_output(out, {"a": [20 + k]}))
        cached.append(manager.num_cached_block.get("a", 0))
        outs.append(written(sched.schedule))
    assert cached == [0, 1, 1], (
        f"Cached blocks of the request after each late token: got {cached}, want [0, 1, 1]. "
        "Block 0 holds the 3 prompt tokens and the first output (position 3). When step 1's "
        "token arrives its id is known, but step 2, which writes position 3's KV, is still "
        "in flight: cache up to num_computed_tokens - num_output_placeholders (4 - 1 = 3), not "
        "num_computed_tokens. When step 2's token arrives, 5 - 1 = 4 fills block 0."
    )


# ------------------------------------------------------------------ against upstream


@pytest.mark.upstream
@pytest.mark.points(8)
@pytest.mark.timeout(240)
@LOCKSTEP
@given(workload=workloads())
def test_lockstep_with_upstreams_async_scheduler(impl, up, workload):
    steady = Workload("steady", SMALL, [RequestSpec("a", list(range(1, 10)), max_tokens=4)])
    written(run_workload_async, mini, steady, async_scheduler(impl.async_scheduler.AsyncScheduler))
    expected = run_workload_async(up, workload)
    mine = async_scheduler(impl.async_scheduler.AsyncScheduler, **workload.config)
    got = run_workload_async(mini, workload, scheduler=mine)
    diff = first_difference(expected, got, field_words=ASYNC_FIELD_WORDS)
    assert diff is None, (
        f"Your AsyncScheduler and upstream's differ with outputs delivered one step late:\n"
        f"{diff}\nconfig: {workload.config}"
    )


@pytest.mark.upstream
@pytest.mark.points(4)
@pytest.mark.timeout(240)
@LOCKSTEP_SPEC
@given(workload=spec_workloads())
def test_lockstep_with_upstreams_async_scheduler_and_drafts(impl, up, workload):
    expected = run_workload_async(up, workload)
    mine = async_scheduler(impl.async_scheduler.AsyncScheduler, **workload.config)
    got = run_workload_async(mini, workload, scheduler=mine)
    diff = first_difference(expected, got, field_words=ASYNC_FIELD_WORDS)
    assert diff is None, (
        f"Your AsyncScheduler and upstream's differ with 1-5 drafts per step (proposed in the "
        f"worker, so the schedulers hold -1 placeholders; the fake model accepts some) and "
        f"outputs delivered one step late:\n{diff}\nconfig: {workload.config}"
    )
