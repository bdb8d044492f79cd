"""Lab 02 (19.2) — nano-vllm's prefill-first policy on v1's scheduler.

Graded: the ``LAB 19.2`` regions of ``labs/phase_19/prefill_first_scheduler.py``.

Your ``PrefillFirstScheduler`` runs generated workloads with a fake model
and a fake KV cache (``mini_vllm/grading/variant_checks.py``). Graded: never
a step that mixes prefills with decodes, nothing lost, every block back;
every step's kind equal to the one the policy's rule, written out again in
this file (``expected_kind``), names from the scheduler's state just before
the step; a prefill stalled mid-prompt that a decode step must leave out;
and on a tiny real model under memory pressure, greedy tokens equal to v1's
own scheduler's.
"""

from __future__ import annotations

import pytest
from hypothesis import given

from mini_vllm.grading import variant_checks as V
from mini_vllm.grading.checks import lab_settings
from mini_vllm.kv_cache_interface import cdiv

pytestmark = pytest.mark.timeout(60)

PROPERTY = lab_settings(40)


def prefill_first_class(impl):
    return impl.prefill_first_scheduler.PrefillFirstScheduler


def never_mixed(step, kinds, out, seen):
    assert len(kinds) <= 1, (
        f"step {step} ran prefills and decodes together: under prefill-first a step "
        "is all prefill or all decode"
    )


@pytest.mark.points(5)
@PROPERTY
@given(w=V.workloads)
def test_never_a_mixed_step_and_nothing_lost(impl, w):
    sched, requests, arrivals, num_blocks = V.build(prefill_first_class(impl), w)
    result = V.drive(sched, requests, arrivals, never_mixed)
    V.check_end(sched, requests, result, num_blocks)
    counted = sched.num_prefill_steps + sched.num_decode_steps
    assert counted == result["steps"], (
        f"{result['steps']} steps ran but num_prefill_steps + num_decode_steps = {counted}: "
        "count every step once"
    )


def expected_kind(sched) -> str:
    """The policy's rule, read off the scheduler's state before a step:
    a request decodes when all its tokens but the last are computed (and it
    has its prompt); the step prefills when nothing decodes, or when a
    running request mid-prefill, or the waiting head while there is a seat
    under max_num_seqs, has every block it still lacks free."""
    pool = sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def decodes(r):
        return r.num_computed_tokens >= max(r.num_prompt_tokens, r.num_tokens - 1)

    def fits(r):
        held = len(sched.kv_cache_manager.get_block_ids(r.request_id)[0])
        return cdiv(r.num_tokens, sched.block_size) - held <= pool

    running = list(sched.running)
    if not any(decodes(r) for r in running):
        return "prefill"
    candidates = [r for r in running if not decodes(r)]
    if sched.waiting and len(running) < sched.scheduler_config.max_num_seqs:
        candidates.append(sched.waiting.peek_request())
    return "prefill" if any(fits(r) for r in candidates) else "decode"


@pytest.mark.points(5)
@PROPERTY
@given(w=V.workloads)
def test_every_step_follows_the_policys_rule(impl, w):
    sched, requests, arrivals, num_blocks = V.build(prefill_first_class(impl), w)
    counts = {"prefill": 0, "decode": 0}

    def before(step):
        return expected_kind(sched), (sched.num_prefill_steps, sched.num_decode_steps)

    def check(step, kinds, out, seen):
        want, (prefills, decodes) = seen
        counts[want] += 1
        got = {True: "decode", False: "prefill"}
        ran = sorted(got[k] for k in kinds)
        assert ran in ([], [want]), (
            f"step {step}: the rule makes it a {want} step (the state before it: "
            f"{len(sched.running)} running), but it ran {ran}"
        )
        if want == "decode":
            assert not out.scheduled_new_reqs, (
                f"step {step} is a decode step, yet admitted "
                f"{[r.req_id for r in out.scheduled_new_reqs]}"
            )
        step_counts = (sched.num_prefill_steps - prefills, sched.num_decode_steps - decodes)
        want_counts = (1, 0) if want == "prefill" else (0, 1)
        assert step_counts == want_counts, (
            f"step {step}, a {want} step, moved (num_prefill_steps, num_decode_steps) "
            f"by {step_counts}, want {want_counts}"
        )

    result = V.drive(sched, requests, arrivals, check, before)
    V.check_end(sched, requests, result, num_blocks)


@pytest.mark.points(2)
def test_a_decode_step_leaves_a_stalled_prefill_out(impl):
    """Without the full-prompt reservation a prefill can stall mid-prompt for
    want of blocks while others decode: a decode step must not run its chunk."""
    w = {
        "block_size": 2,
        "max_num_seqs": 2,
        "budget": 8,
        "chunked": True,
        "caching": False,
        "extra_blocks": 0,
        "reqs": [(17, 2, 0), (15, 1, 0)],
        "shared_prefix": False,
        "reserve_full_isl": False,
    }
    sched, requests, arrivals, num_blocks = V.build(prefill_first_class(impl), w)
    result = V.drive(sched, requests, arrivals, never_mixed)
    V.check_end(sched, requests, result, num_blocks)


@pytest.mark.points(5)
@pytest.mark.timeout(240)
def test_greedy_tokens_equal_the_default_schedulers(
    impl, request, tiny_qwen3_folder, pressure_prompts
):
    got, sched = V.greedy(tiny_qwen3_folder, prefill_first_class(impl), pressure_prompts)
    want = request.getfixturevalue("default_greedy")
    assert sched.num_prefill_steps > 0 and sched.num_decode_steps > 0, (
        f"{sched.num_prefill_steps} prefill steps, {sched.num_decode_steps} decode steps"
    )
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"prompt {i}: greedy tokens {g} differ from v1's scheduler's {w}"
