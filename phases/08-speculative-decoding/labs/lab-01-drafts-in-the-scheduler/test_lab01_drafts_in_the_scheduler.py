"""Lab 08.1 — drafts in the scheduler.

Graded: the four ``LAB 08.1`` regions of ``labs/phase_08/scheduler.py``: in
``schedule()``, a running request's new tokens count its drafts (so the
budget pays for them) and the drafts that fit go into
``scheduled_spec_decode_tokens``; in ``update_from_output``, the rejected
drafts are taken back off ``num_computed_tokens`` and counted in the
spec-decode stats; ``update_draft_token_ids`` hands each request its fresh
drafts, none to a request still prefilling.

First the rules, on a scheduler driven by hand; then, marked ``upstream``,
generated workloads with n-gram speculation (1-5 draft tokens, fake drafts
and acceptance counts, chunked prefill, prefix caching, preemption, FCFS
and PRIORITY; mini_vllm/oracle/strategies.py ``spec_workloads``) run
through your Scheduler and the pinned upstream's (vllm/v1/core/sched/scheduler.py:64)
in lockstep; then the four speculative scenarios recorded from upstream.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from phase08_helpers import lockstep_difference, written

import mini_vllm.testing as mini
from mini_vllm.grading import checks
from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.strategies import spec_workloads
from mini_vllm.oracle.workload import run_workload
from mini_vllm.outputs import DraftTokenIds, ModelRunnerOutput

LOCKSTEP = lab_settings(40)
SPEC_SNAPSHOTS = [n for n in checks.snapshot_names() if n.startswith("spec_")]
SMALL = dict(
    block_size=4, num_blocks=40, max_num_batched_tokens=64, max_model_len=64, max_num_seqs=4
)

pytestmark = pytest.mark.timeout(60)


def make(impl, **config):
    return mini.create_scheduler(
        scheduler_cls=impl.scheduler.Scheduler, num_speculative_tokens=3, **{**SMALL, **config}
    )


def add(sched, req_ids, prompts):
    reqs = mini.create_requests(
        len(req_ids), req_ids=req_ids, prompt_token_ids=prompts, max_tokens=30, block_size=4
    )
    for r in reqs:
        sched.add_request(r)
    return reqs


def step(sched, tokens: dict[str, list[int]]):
    """schedule(), then update_from_output() with ``tokens`` per request."""
    out = written(sched.schedule)
    req_ids = list(out.num_scheduled_tokens)
    result = written(
        sched.update_from_output,
        out,
        ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[tokens.get(r, []) for r in req_ids],
        ),
    )
    return out, result


def draft(sched, drafts: dict[str, list[int]]) -> None:
    written(sched.update_draft_token_ids, DraftTokenIds(list(drafts), list(drafts.values())))


def decoding(impl, n: int = 1, budget: int = 64):
    """A scheduler whose requests a, b, ... have each prefilled a 3-token
    prompt and sampled token 50 + i (one step)."""
    sched = make(impl, max_num_batched_tokens=budget)
    ids = [chr(ord("a") + i) for i in range(n)]
    reqs = add(sched, ids, [[10 * (i + 1) + j for j in range(3)] for i in range(n)])
    step(sched, {r: [50 + i] for i, r in enumerate(ids)})
    return sched, reqs


# ------------------------------------------------------------------ the rules


@pytest.mark.points(4)
def test_drafts_are_scheduled_as_extra_tokens(impl):
    sched, (a,) = decoding(impl)
    draft(sched, {"a": [11, 12, 13]})
    out = written(sched.schedule)
    assert out.num_scheduled_tokens == {"a": 4}, (
        f"a has 1 token to compute (its sampled token) and 3 drafts to verify: it should be "
        f"scheduled for 4 tokens, got {out.num_scheduled_tokens}. A running request asks for "
        "num_tokens_with_spec - num_computed_tokens."
    )
    assert out.scheduled_spec_decode_tokens == {"a": [11, 12, 13]}, (
        f"scheduled_spec_decode_tokens should be {{'a': [11, 12, 13]}}, got "
        f"{out.scheduled_spec_decode_tokens}."
    )
    assert a.spec_token_ids == [], (
        f"once scheduled, the request's drafts are cleared (fresh ones come from the next "
        f"update_draft_token_ids); a.spec_token_ids is {a.spec_token_ids}."
    )
    assert out.total_num_scheduled_tokens == 4 and a.num_computed_tokens == 7, (
        f"total scheduled {out.total_num_scheduled_tokens} (want 4), a.num_computed_tokens "
        f"{a.num_computed_tokens} (want 3 + 4 = 7: the drafts count as computed until verified)."
    )


@pytest.mark.points(5)
def test_the_budget_pays_for_drafts_and_cuts_them(impl):
    # Budget 6: a takes 1 + 3 drafts, b what is left: 1 + 1 draft.
    sched, _ = decoding(impl, n=2, budget=6)
    draft(sched, {"a": [11, 12, 13], "b": [21, 22, 23]})
    out = written(sched.schedule)
    assert out.num_scheduled_tokens == {"a": 4, "b": 2}, (
        f"budget 6, a and b each with 1 token and 3 drafts: a (first) takes 4 tokens, b the "
        f"2 left; got {out.num_scheduled_tokens}. Drafts count in a request's new tokens, so "
        "the token budget pays for them."
    )
    assert out.scheduled_spec_decode_tokens == {"a": [11, 12, 13], "b": [21]}, (
        f"b was scheduled for 2 tokens: its own and ONE draft, so only [21] is verified; "
        f"got {out.scheduled_spec_decode_tokens}. Cut the drafts to num_new_tokens + "
        "num_computed_tokens - num_tokens."
    )
    # A request whose budget covers only its own token verifies no draft at all.
    sched, _ = decoding(impl, n=2, budget=5)
    draft(sched, {"a": [11, 12, 13], "b": [21, 22, 23]})
    out = written(sched.schedule)
    assert out.num_scheduled_tokens == {"a": 4, "b": 1} and out.scheduled_spec_decode_tokens == {
        "a": [11, 12, 13]
    }, (
        f"budget 5: a takes 4, b 1 (its own token, no draft): got "
        f"{out.num_scheduled_tokens} and drafts {out.scheduled_spec_decode_tokens}. A request "
        "with no draft scheduled has no entry in scheduled_spec_decode_tokens."
    )


@pytest.mark.points(6)
def test_rejected_drafts_are_rolled_back_and_counted(impl):
    sched, (a,) = decoding(impl)
    draft(sched, {"a": [11, 12, 13]})
    # The target agrees with 11, not with 12: the runner returns 11 and its own 99.
    _, result = step(sched, {"a": [11, 99]})
    assert list(a.output_token_ids) == [50, 11, 99]
    assert a.num_computed_tokens == 5, (
        f"a: 3 prompt tokens + 50 computed, then drafts 11, 12, 13 scheduled (computed 7). "
        f"One draft was accepted and two rejected: the 2 rejected positions must be taken "
        f"back (7 - 2 = 5: 99 is the next token to compute); got {a.num_computed_tokens}."
    )
    stats = result.scheduler_stats.spec_decoding_stats
    assert stats is not None, "the step verified drafts: its SchedulerStats must carry them"
    got = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    assert got == (1, 3, 1) and stats.num_accepted_tokens_per_pos == [1, 0, 0], (
        f"stats (drafts, draft tokens, accepted) {got}, per position "
        f"{stats.num_accepted_tokens_per_pos}; want (1, 3, 1) and [1, 0, 0]."
    )
    # All three accepted: nothing to take back; the runner returns 3 drafts + 1.
    draft(sched, {"a": [31, 32, 33]})
    _, result = step(sched, {"a": [31, 32, 33, 34]})
    assert a.num_computed_tokens == 9 and a.num_tokens == 10, (
        f"every draft accepted: computed should stay at 5 + 4 = 9 (num_tokens 10), got "
        f"computed {a.num_computed_tokens}, num_tokens {a.num_tokens}."
    )
    stats = result.scheduler_stats.spec_decoding_stats
    assert stats.num_accepted_tokens_per_pos == [1, 1, 1], stats
    # No drafts this step: no stats at all.
    _, result = step(sched, {"a": [35]})
    assert result.scheduler_stats.spec_decoding_stats is None, (
        "a step that verified no draft carries no spec-decode stats (None)."
    )


@pytest.mark.points(4)
def test_a_prefilling_request_gets_no_drafts(impl):
    sched = make(impl, max_num_batched_tokens=4)
    (a,) = add(sched, ["a"], [list(range(1, 11))])
    step(sched, {})  # 4 of the 10 prompt tokens
    assert a.is_prefill_chunk
    draft(sched, {"a": [7, 8]})
    assert a.spec_token_ids == [], (
        f"a is still prefilling (4 of 10 prompt tokens computed): its next tokens are prompt "
        f"tokens, not guesses, so it keeps no draft; a.spec_token_ids is {a.spec_token_ids}."
    )
    sched, (a,) = decoding(impl)
    draft(sched, {"a": [1, 2], "gone": [3]})  # an id the scheduler no longer holds
    assert a.spec_token_ids == [1, 2], (
        f"a decodes: it takes the drafts [1, 2] (a request no longer in the scheduler is "
        f"skipped); got {a.spec_token_ids}."
    )
    draft(sched, {"a": [4]})
    assert a.spec_token_ids == [4], f"new drafts replace the old: got {a.spec_token_ids}"


# ------------------------------------------------------------------ against upstream


@pytest.mark.upstream
@pytest.mark.points(8)
@pytest.mark.timeout(240)
@LOCKSTEP
@given(workload=spec_workloads())
def test_lockstep_with_upstreams_scheduler(impl, up, workload):
    mine = mini.create_scheduler(scheduler_cls=impl.scheduler.Scheduler, **workload.config)
    expected = run_workload(up, workload)
    got = written(run_workload, mini, workload, scheduler=mine)
    diff = lockstep_difference(expected, got)
    requests = [
        (s.req_id, len(s.prompt_token_ids), s.max_tokens, s.draft_lens, s.accepted)
        for s in workload.requests
    ]
    assert diff is None, (
        f"Your Scheduler and upstream's differ with n-gram speculation:\n{diff}\n"
        f"config: {workload.config}\n"
        f"requests (id, prompt length, max_tokens, draft lengths, accepted): {requests}"
    )


@pytest.mark.points(3)
@pytest.mark.parametrize("name", SPEC_SNAPSHOTS)
def test_recorded_spec_scenarios(impl, name):
    problem = written(checks.snapshot_mismatch, impl.scheduler.Scheduler, name)
    assert problem is None, problem
