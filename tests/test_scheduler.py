"""Scheduler rules, one at a time, and its handling of bad input.

Each test builds a small situation by hand so the rule is visible; the
lockstep and snapshot suites check the same rules against upstream at scale.
"""

from __future__ import annotations

import pytest

import mini_vllm.testing as mini
from mini_vllm.request import RequestStatus
from mini_vllm.sampling_params import SamplingParams


def run_step(sched, token=1000):
    out = sched.schedule()
    result = sched.update_from_output(
        out, mini.make_model_runner_output(sched, out, lambda r: token)
    )
    return out, result


# ----------------------------------------------------------------- the rules


def test_clamp_new_tokens_applies_threshold_budget_and_model_length():
    sched = mini.create_scheduler(max_model_len=100, long_prefill_token_threshold=10)
    (req,) = mini.create_requests(1, num_tokens=50)
    assert sched._clamp_new_tokens(req, 50, token_budget=1000) == 10  # threshold
    assert sched._clamp_new_tokens(req, 50, token_budget=7) == 7  # budget
    req.num_computed_tokens = 95
    assert sched._clamp_new_tokens(req, 5, token_budget=1000) == 4  # 100 - 1 - 95


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    sched = mini.create_scheduler(max_num_batched_tokens=32, max_model_len=256)
    (req,) = mini.create_requests(1, num_tokens=80)
    sched.add_request(req)
    chunks = []
    while not req.output_token_ids:
        out, _ = run_step(sched)
        chunks.append(out.num_scheduled_tokens[req.request_id])
    assert chunks == [32, 32, 16], "a prefill takes the whole budget until the prompt is done"


def test_without_chunked_prefill_a_prompt_larger_than_the_budget_left_waits():
    sched = mini.create_scheduler(
        max_num_batched_tokens=100, max_model_len=100, enable_chunked_prefill=False
    )
    a, b = mini.create_requests(2, num_tokens=60)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 60}, "b needs 60 but only 40 are left: it waits whole"


def test_max_num_seqs_caps_the_running_batch():
    sched = mini.create_scheduler(max_num_seqs=2)
    for req in mini.create_requests(3):
        sched.add_request(req)
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["0", "1"]
    assert len(sched.waiting) == 1


def test_running_requests_are_scheduled_before_waiting_ones():
    sched = mini.create_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    a, b = mini.create_requests(2, num_tokens=10)
    sched.add_request(a)
    run_step(sched)  # a prefilled, sampled one token
    sched.add_request(b)
    out = sched.schedule()
    assert list(out.num_scheduled_tokens.items()) == [("0", 1), ("1", 10)]


def tight_cache(num_requests, **kwargs):
    """6 usable blocks of 4 tokens; each 7-token prompt takes 2 blocks, so
    three requests fill the cache and their 9th token forces a preemption."""
    priorities = kwargs.pop("priorities", None)
    sched = mini.create_scheduler(
        num_blocks=7, block_size=4, max_model_len=24, max_num_batched_tokens=64, **kwargs
    )
    reqs = mini.create_requests(
        num_requests,
        num_tokens=7,
        max_tokens=10,
        ignore_eos=True,
        block_size=4,
        priorities=priorities,
    )
    for req in reqs:
        sched.add_request(req)
    return sched, reqs


def test_fcfs_preempts_the_most_recently_admitted_and_admits_nobody_that_step():
    sched, reqs = tight_cache(4)
    run_step(sched)  # 0,1,2 admitted; 3 waits (no memory)
    run_step(sched)  # each reaches 8 tokens = 2 full blocks
    out, _ = run_step(sched)  # token 9 needs a 3rd block: 0 gets it, then...
    assert out.preempted_req_ids == {"2"}, "FCFS victim is the tail of running"
    assert not out.scheduled_new_reqs, "no admissions in a step that preempted"
    assert reqs[2].status == RequestStatus.PREEMPTED and reqs[2].num_computed_tokens == 0
    assert sched.waiting.peek_request() is reqs[2], "the victim goes back to the front"


def test_priority_preempts_the_worst_priority_even_if_already_scheduled():
    sched, reqs = tight_cache(3, policy="priority", priorities=[5, 0, 1])
    run_step(sched)
    run_step(sched)
    out, _ = run_step(sched)
    assert "0" in out.preempted_req_ids, "priority 5 is the worst: it goes first"
    assert "0" not in out.num_scheduled_tokens, "its tokens this step are handed back"


def test_resumed_request_gets_its_whole_block_table_and_tokens_resent():
    sched, _ = tight_cache(3)
    for _ in range(40):
        out = sched.schedule()
        cached = out.scheduled_cached_reqs
        if cached.resumed_req_ids:
            break
        sched.update_from_output(out, mini.make_model_runner_output(sched, out, lambda r: 1000))
    else:
        pytest.fail("expected a preempted request to resume")
    (rid,) = cached.resumed_req_ids
    i = cached.req_ids.index(rid)
    # Its blocks were freed at preemption: the list replaces the old table.
    assert cached.new_block_ids[i][0] == sched.kv_cache_manager.get_block_ids(rid)[0]
    # Workers dropped its state: every token (prompt + outputs so far) is resent.
    assert cached.all_token_ids[rid] == list(sched.requests[rid].all_token_ids)
    assert sched.requests[rid].num_output_tokens > 0


def test_finished_ids_are_reported_in_the_next_schedule_output():
    sched = mini.create_scheduler()
    (req,) = mini.create_requests(1, max_tokens=1)
    sched.add_request(req)
    _, result = run_step(sched)
    assert result.outputs[0].finish_reason is not None
    out = sched.schedule()
    assert out.finished_req_ids == {"0"} and out.total_num_scheduled_tokens == 0
    assert not sched.has_requests()


def test_eos_stops_unless_ignore_eos():
    sched = mini.create_scheduler()
    (a,) = mini.create_requests(1, max_tokens=5, req_ids=["a"])
    (b,) = mini.create_requests(1, max_tokens=5, req_ids=["b"], ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched, token=mini.EOS_TOKEN_ID)
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert b.status == RequestStatus.RUNNING


# ----------------------------------------------------------------- bad input


def _state(sched):
    return (
        sorted(sched.requests),
        len(sched.waiting),
        len(sched.running),
        sched.kv_cache_manager.block_pool.get_num_free_blocks(),
    )


def test_duplicate_request_id_is_rejected_and_changes_nothing():
    sched = mini.create_scheduler()
    (req,) = mini.create_requests(1)
    sched.add_request(req)
    before = _state(sched)
    (dup,) = mini.create_requests(1)
    with pytest.raises(ValueError, match="Duplicate request id"):
        sched.add_request(dup)
    assert _state(sched) == before


@pytest.mark.parametrize(
    "prompt_len, min_tokens, match",
    [
        (0, 0, "empty prompt"),
        (64, 0, "shorter than max_model_len"),
        (100, 0, "shorter than max_model_len"),
        (60, 5, "min_tokens could never be met"),
    ],
)
def test_bad_prompts_are_rejected_and_change_nothing(prompt_len, min_tokens, match):
    sched = mini.create_scheduler(max_model_len=64)
    (req,) = mini.create_requests(1, num_tokens=prompt_len, min_tokens=min_tokens)
    before = _state(sched)
    with pytest.raises(ValueError, match=match):
        sched.add_request(req)
    assert _state(sched) == before


def test_scheduler_accepts_a_cache_smaller_than_one_max_model_len_request():
    """As upstream: capacity is checked once, at engine start-up
    (tests/test_entrypoints.py), so a scheduler over 3 usable blocks of 16
    tokens with max_model_len=64 builds and serves what fits."""
    sched = mini.create_scheduler(num_blocks=4, block_size=16, max_model_len=64)
    (req,) = mini.create_requests(1, num_tokens=20)
    sched.add_request(req)
    assert sched.schedule().num_scheduled_tokens == {req.request_id: 20}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_num_batched_tokens=8, max_num_seqs=16), "max_num_batched_tokens"),
        (
            dict(max_num_batched_tokens=32, max_model_len=64, enable_chunked_prefill=False),
            "max_num_batched_tokens",
        ),
        (dict(policy="lifo"), "policy"),
        (dict(block_size=0), "block_size"),
    ],
)
def test_bad_scheduler_config_is_rejected(kwargs, field):
    with pytest.raises(ValueError, match=field):
        mini.create_scheduler(**kwargs)


def test_invalid_sampling_params_raise_value_error():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_aborting_unknown_or_finished_requests_is_a_no_op():
    sched = mini.create_scheduler()
    (req,) = mini.create_requests(1, max_tokens=1)
    sched.add_request(req)
    assert sched.finish_requests("nope", RequestStatus.FINISHED_ABORTED) == []
    run_step(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    before = _state(sched)
    assert sched.finish_requests(["0"], RequestStatus.FINISHED_ABORTED) == []
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and _state(sched) == before
    with pytest.raises(ValueError, match="not a finished status"):
        sched.finish_requests("0", RequestStatus.RUNNING)


def test_engine_keeps_serving_after_a_rejected_and_an_aborted_request():
    sched = mini.create_scheduler(max_model_len=64)
    good, bad, doomed = mini.create_requests(3, num_tokens=8, max_tokens=3)
    sched.add_request(good)
    bad.prompt_token_ids.clear()
    (bad,) = mini.create_requests(1, num_tokens=0, req_ids=["bad"])
    with pytest.raises(ValueError):
        sched.add_request(bad)
    sched.add_request(doomed)
    run_step(sched)
    sched.finish_requests(doomed.request_id, RequestStatus.FINISHED_ABORTED)
    while sched.has_requests():
        run_step(sched)
    assert good.status == RequestStatus.FINISHED_LENGTH_CAPPED and good.num_output_tokens == 3
    assert doomed.status == RequestStatus.FINISHED_ABORTED
