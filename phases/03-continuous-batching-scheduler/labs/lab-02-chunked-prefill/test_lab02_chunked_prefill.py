"""Lab 03.2 — chunked prefill.

Graded: the two ``LAB 03.2`` regions of ``labs/phase_03/scheduler.py``:
how many of a WAITING request's tokens to prefill this step (inside
``schedule()``), and ``_update_after_schedule``. Every other region holds
the reference's code while this lab is graded.

Read the tests top to bottom: each builds a tiny situation by hand, runs
a few steps and says, when it fails, which rule broke, at which step, what
was expected and what your code did. Then come properties (hypothesis:
invariants on generated workloads, and your scheduler against the
reference), then upstream's own recorded traces.
"""

from __future__ import annotations

import traceback

import pytest
from hypothesis import given

import mini_vllm.testing as mini
from mini_vllm.grading import checks
from mini_vllm.oracle import strategies

import phase03_helpers as helpers
from phase03_helpers import (
    KV_CACHE_MANAGER,
    PROPERTY,
    SCHEDULER,
    TOKEN,
    Stepper,
    ids,
    reference_text,
)

# The reference finishes every generated workload in a few hundred steps.
MAX_STEPS = 2000

# A hand-built test runs in milliseconds: past this, a loop in schedule() never ends.
pytestmark = pytest.mark.timeout(15)


# ------------------------------------------------------------------ helpers


def make(impl, **config):
    """A scheduler of the class under grade (``create_scheduler`` keywords)."""
    return mini.create_scheduler(scheduler_cls=impl.scheduler.Scheduler, **config)


def requests(ids, lengths, block_size=16, **kwargs):
    """One request per id; the prompt of id i is ``[i + 1] * lengths[i]``."""
    return mini.create_requests(
        len(ids),
        req_ids=list(ids),
        block_size=block_size,
        prompt_token_ids=[[i + 1] * n for i, n in enumerate(lengths)],
        **kwargs,
    )


# The reference's text explain() keys on (checked when the suite is collected).
TOTAL_TOKENS = reference_text("assert total_num_scheduled_tokens", SCHEDULER)
BUDGET = reference_text("assert token_budget >= 0", SCHEDULER)
NO_TOKENS = reference_text("num_new_tokens must be greater than 0", KV_CACHE_MANAGER)


def explain(error: BaseException) -> str | None:
    """A teaching sentence for the errors a broken step trips inside the
    reference's own code (its end-of-step asserts, allocate_slots)."""
    line = traceback.extract_tb(error.__traceback__)[-1].line or ""
    if isinstance(error, AssertionError) and TOTAL_TOKENS in line:
        hint = (
            "the step handed out more tokens than max_num_batched_tokens: a waiting "
            "request's chunk is at most the budget left (min(num_new_tokens, "
            "token_budget))"
        )
    elif isinstance(error, AssertionError) and BUDGET in line:
        hint = "token_budget went negative: a chunk was larger than the budget left"
    elif isinstance(error, ValueError) and NO_TOKENS in str(error):
        hint = (
            "allocate_slots was asked for 0 (or fewer) tokens: a waiting request's "
            "num_new_tokens must be num_tokens - num_computed_tokens, capped"
        )
    elif isinstance(error, KeyError) and "self.requests[" in line:  # your region's line
        hint = "_update_after_schedule met an id that is not a live request"
    else:
        return None
    detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return f"schedule() tripped `{line}` ({detail}): {hint}."


ENDLESS = (
    "the reference finishes every workload here in a few hundred steps at most. Some "
    "request is never scheduled again or never finishes: look for a count that stops "
    "advancing."
)
STEPPER = Stepper(explain, (AssertionError, ValueError, KeyError))
explained, schedule, step = STEPPER.explained, STEPPER.schedule, STEPPER.step


def finish_step(sched, out):
    """The model runs and update_from_output() takes in its tokens."""
    sched.update_from_output(out, mini.make_model_runner_output(sched, out, lambda r: TOKEN))


def bounded(workload):
    return helpers.bounded(workload, MAX_STEPS)


def run_checked(cls, workload) -> None:
    helpers.run_checked(cls, workload, ENDLESS)


# ------------------------------------- 1. a waiting request's first chunk


@pytest.mark.points(1)
def test_a_long_prompt_is_prefilled_in_budget_sized_chunks(impl):
    sched = make(impl, max_num_batched_tokens=32, max_model_len=256)
    (a,) = requests("a", [80])
    sched.add_request(a)
    out = schedule(sched, "step 0")
    assert dict(out.num_scheduled_tokens) == {"a": 32}, (
        f"Step 0: a's prompt is 80 tokens and the budget 32. With chunked prefill the "
        f"first chunk is min(80, 32) = 32; got {dict(out.num_scheduled_tokens)}."
    )
    finish_step(sched, out)
    chunks = [32]
    for i in range(1, 6):
        if a.output_token_ids:
            break
        chunks.append(step(sched, f"step {i}").num_scheduled_tokens.get("a"))
    assert chunks == [32, 32, 16], (
        f"An 80-token prompt under a budget of 32 is prefilled as 32 + 32 + 16 and samples "
        f"its first token after the last chunk; a's chunks were {chunks}."
    )


@pytest.mark.points(1)
def test_a_waiting_request_gets_the_budget_left(impl):
    sched = make(impl, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=256)
    a, b = requests("ab", [10, 50])
    sched.add_request(a)
    step(sched, "step 0 (a prefills)")
    sched.add_request(b)
    out = schedule(sched, "step 1")
    assert dict(out.num_scheduled_tokens) == {"a": 1, "b": 15}, (
        f"Step 1, budget 16: the running request a takes 1 token first, so waiting b "
        f"(50 tokens) gets the 15 left: num_new_tokens = min(num_new_tokens, token_budget). "
        f"Expected {{'a': 1, 'b': 15}}, got {dict(out.num_scheduled_tokens)}."
    )


@pytest.mark.points(2)
def test_long_prefill_threshold_caps_a_waiting_request(impl):
    sched = make(
        impl,
        block_size=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        long_prefill_token_threshold=12,
    )
    for r in requests("abc", [50, 9, 30], block_size=8):
        sched.add_request(r)
    out = schedule(sched, "step 0")
    assert dict(out.num_scheduled_tokens) == {"a": 12, "b": 9, "c": 12}, (
        f"Step 0, long_prefill_token_threshold=12, budget 64: no request takes more than "
        f"12 tokens in a step, so a (50) gets 12, b (9) all 9, c (30) 12. Expected "
        f"{{'a': 12, 'b': 9, 'c': 12}}, got {dict(out.num_scheduled_tokens)}. The threshold "
        f"applies when 0 < threshold < num_new_tokens, before the budget."
    )


@pytest.mark.points(2)
def test_prefix_cache_hits_are_not_prefilled_again(impl):
    shared = [7] * 32  # two full blocks of 16
    sched = make(impl, max_model_len=256, enable_prefix_caching=True)
    (a,) = mini.create_requests(
        1, req_ids=["a"], prompt_token_ids=[shared + [1] * 10], max_tokens=1
    )
    sched.add_request(a)
    step(sched, "step 0 (a computes and caches the shared 32 tokens, then finishes)")
    (b,) = mini.create_requests(1, req_ids=["b"], prompt_token_ids=[shared + [2] * 5])
    sched.add_request(b)
    out = schedule(sched, "step 1")
    assert out.num_scheduled_tokens.get("b") == 5, (
        f"Step 1: b is 37 tokens and its first 32 are cached (num_computed_tokens = 32 from "
        f"the prefix cache), so it prefills num_tokens - num_computed_tokens = 5; got "
        f"{out.num_scheduled_tokens.get('b')}."
    )


@pytest.mark.points(2)
def test_a_resumed_request_recomputes_its_outputs_too(impl):
    # 6 usable blocks of 4: three 7-token prompts fill them and preemption follows.
    sched = make(
        impl,
        num_blocks=7,
        block_size=4,
        max_model_len=24,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
    )
    for r in requests("abc", [7, 7, 7], block_size=4, max_tokens=10, ignore_eos=True):
        sched.add_request(r)
    for i in range(30):
        out = schedule(sched, f"step {i}")
        resumed = out.scheduled_cached_reqs.resumed_req_ids
        if resumed:
            break
        finish_step(sched, out)
    else:
        pytest.fail("No preempted request was resumed within 30 steps: expected one to be.")
    rid = sorted(resumed)[0]
    req = sched.requests[rid]
    assert out.num_scheduled_tokens[rid] == req.num_tokens, (
        f"Step {i}: {rid!r} was preempted (its KV freed, num_computed_tokens = 0) after "
        f"sampling {req.num_output_tokens} tokens; resuming it recomputes its prompt AND "
        f"its outputs: num_new_tokens = request.num_tokens ({req.num_tokens}) - "
        f"num_computed_tokens (0), not num_prompt_tokens ({req.num_prompt_tokens}). "
        f"Got {out.num_scheduled_tokens[rid]}."
    )


@pytest.mark.points(2)
def test_without_chunked_prefill_a_prompt_goes_whole_or_waits(impl):
    sched = make(impl, max_num_batched_tokens=100, max_model_len=100, enable_chunked_prefill=False)
    a, b, c = requests("abc", [60, 60, 20])
    for r in (a, b, c):
        sched.add_request(r)
    out = step(sched, "step 0")
    assert dict(out.num_scheduled_tokens) == {"a": 60}, (
        f"Step 0, chunked prefill off, budget 100: a's 60 tokens go whole; b needs 60 but "
        f"only 40 are left, so b waits whole (no chunk) and admission STOPS there: c (20) "
        f"may not jump the queue (`break`, not skip). Expected {{'a': 60}}, got "
        f"{dict(out.num_scheduled_tokens)}."
    )
    assert ids(sched.waiting) == ["b", "c"], (
        f"Step 0: b and c must still wait, in order; waiting = {ids(sched.waiting)}."
    )
    out = schedule(sched, "step 1")
    assert dict(out.num_scheduled_tokens) == {"a": 1, "b": 60, "c": 20}, (
        f"Step 1: a decodes 1 token, 99 are left: b (60) and c (20) both fit whole. "
        f"Expected {{'a': 1, 'b': 60, 'c': 20}}, got {dict(out.num_scheduled_tokens)}."
    )


@pytest.mark.points(1)
def test_without_chunked_prefill_the_threshold_still_applies_first(impl):
    sched = make(
        impl,
        max_num_batched_tokens=40,
        max_model_len=40,
        enable_chunked_prefill=False,
        long_prefill_token_threshold=16,
    )
    for r in requests("ab", [30, 30]):
        sched.add_request(r)
    out = schedule(sched, "step 0")
    assert dict(out.num_scheduled_tokens) == {"a": 16, "b": 16}, (
        f"Step 0, chunked prefill off, threshold 16, budget 40: the threshold cuts each "
        f"request's tokens to 16 FIRST, then the whole-or-wait check compares 16 with the "
        f"budget left (24): b fits. Expected {{'a': 16, 'b': 16}}, got "
        f"{dict(out.num_scheduled_tokens)}. Order: num_tokens - computed, threshold, "
        f"whole-or-wait, budget."
    )


# --------------------------------------------- 2. _update_after_schedule


@pytest.mark.points(2)
def test_num_computed_tokens_advances_when_the_step_is_scheduled(impl):
    sched = make(impl, max_num_batched_tokens=32, max_model_len=256)
    (a,) = requests("a", [50])
    sched.add_request(a)
    out = schedule(sched, "step 0")
    assert (a.num_computed_tokens, a.is_prefill_chunk) == (32, True), (
        f"Right after schedule() of step 0 (before the model runs), a's 32-token chunk "
        f"already counts: num_computed_tokens 0 -> 32, and is_prefill_chunk is True "
        f"(32 < 50 tokens). Got num_computed_tokens={a.num_computed_tokens}, "
        f"is_prefill_chunk={a.is_prefill_chunk}."
    )
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 0, (
        f"The output already recorded the pre-step count the runner needs (0); got "
        f"{new.num_computed_tokens}."
    )
    finish_step(sched, out)
    schedule(sched, "step 1")
    assert (a.num_computed_tokens, a.is_prefill_chunk) == (50, False), (
        f"After schedule() of step 1 (the last 18 tokens): num_computed_tokens 32 -> 50 and "
        f"is_prefill_chunk False (50 == num_tokens: this chunk ends the prompt and samples). "
        f"Got num_computed_tokens={a.num_computed_tokens}, "
        f"is_prefill_chunk={a.is_prefill_chunk}."
    )


@pytest.mark.points(2)
def test_finished_ids_are_reported_once_in_a_new_set(impl):
    sched = make(impl)
    a, b = requests("ab", [10, 10], max_tokens=1)
    sched.add_request(a)
    step(sched, "step 0 (a prefills, samples its one token, finishes)")
    sched.add_request(b)
    out1 = step(sched, "step 1")
    assert out1.finished_req_ids == {"a"}, (
        f"Step 1's output tells the workers which requests finished since the last "
        f"schedule(): expected {{'a'}}, got {out1.finished_req_ids}. (_update_after_schedule "
        f"runs after the output was built: replace self.finished_req_ids with a NEW set; "
        f"`.clear()` would empty the set this output holds.)"
    )
    out2 = schedule(sched, "step 2")
    assert out2.finished_req_ids == {"b"}, (
        f"Step 2 reports only b (finished in step 1); a was already reported in step 1. "
        f"Got {out2.finished_req_ids}: start a new set after every schedule()."
    )
    assert out1.finished_req_ids == {"a"}, (
        f"Step 1's output must keep its finished set {{'a'}} after later steps (the workers "
        f"may still read it); it is now {out1.finished_req_ids}. Assign a new set, do not "
        f"clear the old one."
    )


# ---------------------------------------------------------------- properties


def chunk_checker(cls):
    """The class under grade, checking chunked-prefill rules after every schedule()."""

    class Checked(explained(cls)):
        def schedule(self):
            out = super().schedule()
            cfg = self.scheduler_config
            scheduled = dict(out.num_scheduled_tokens)
            where = f"a step that scheduled {scheduled}"
            before = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
            cached = out.scheduled_cached_reqs
            before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            admitted = {d.req_id for d in out.scheduled_new_reqs} | set(cached.resumed_req_ids)
            used = 0
            for req_id, n in scheduled.items():
                req = self.requests[req_id]
                if req_id in admitted:
                    need = req.num_tokens - before[req_id]
                    threshold = cfg.long_prefill_token_threshold
                    if 0 < threshold < need:
                        need = threshold
                    left = self.max_num_scheduled_tokens - used
                    if cfg.enable_chunked_prefill:
                        assert n == min(need, left), (
                            f"{req_id} admitted with {n} tokens in {where}: expected "
                            f"min(num_tokens {req.num_tokens} - computed {before[req_id]}, "
                            f"threshold {threshold or 'none'}, budget left {left}) = "
                            f"{min(need, left)}."
                        )
                    else:
                        assert n == need <= left, (
                            f"{req_id} admitted with {n} tokens in {where}, chunked prefill "
                            f"off: it must get all {need} of its (thresholded) tokens, and "
                            f"only if they fit the {left} left."
                        )
                used += n
                assert req.num_computed_tokens == before[req_id] + n, (
                    f"_update_after_schedule: {req_id} had {before[req_id]} computed and "
                    f"{n} scheduled in {where}, so it must have {before[req_id] + n} after "
                    f"schedule(); it has {req.num_computed_tokens}."
                )
                assert req.is_prefill_chunk == (req.num_computed_tokens < req.num_tokens), (
                    f"_update_after_schedule: {req_id} has {req.num_computed_tokens} of "
                    f"{req.num_tokens} computed after {where}, so is_prefill_chunk must be "
                    f"{req.num_computed_tokens < req.num_tokens}; it is {req.is_prefill_chunk}."
                )
            same = self.finished_req_ids is out.finished_req_ids
            assert self.finished_req_ids == set() and not same, (
                f"After schedule(), self.finished_req_ids must be a NEW empty set (the output "
                f"keeps the old one); it is {self.finished_req_ids!r}, "
                f"{'the same object as' if same else 'not'} the output's."
            )
            return out

    return Checked


@pytest.mark.points(3)
@pytest.mark.timeout(30)
@PROPERTY
@given(workload=strategies.workloads())
def test_property_chunk_sizes_and_computed_counts(impl, workload):
    run_checked(chunk_checker(impl.scheduler.Scheduler), bounded(workload))


@pytest.mark.points(3)
@pytest.mark.timeout(30)
@PROPERTY
@given(workload=strategies.workloads())
def test_property_same_trace_as_the_reference(impl, workload):
    mismatch = checks.reference_mismatch(
        explained(impl.scheduler.Scheduler), workload, max_steps=MAX_STEPS
    )
    assert mismatch is None, "Your scheduler and the reference differ:\n" + mismatch


# ------------------------------------------------- upstream's recorded traces


@pytest.mark.points(1)
@pytest.mark.parametrize(
    "scenario", ["chunked_prefill", "long_prefill_threshold", "no_chunked_prefill"]
)
def test_snapshot(impl, scenario):
    mismatch = checks.snapshot_mismatch(explained(impl.scheduler.Scheduler), scenario)
    assert mismatch is None, mismatch
