"""Lab 03.1 — one scheduling step by hand.

Graded: the four ``LAB 03.1`` regions of ``labs/phase_03/scheduler.py``:
``_clamp_new_tokens``; scheduling a RUNNING request (Phase 1) and charging
the budget; the three admission gates; admitting a WAITING request (Phase 2).
Every other region holds the reference's code while this lab is graded.

Read the tests top to bottom: each builds a tiny situation by hand, runs one
``schedule()`` (or calls a method directly) and says, when it fails, which
rule broke, at which step, what was expected and what your code did. Then
come properties (hypothesis: invariants on generated workloads, and your
scheduler against the reference), then upstream's own recorded traces.
"""

from __future__ import annotations

import dataclasses
import traceback

import pytest
from hypothesis import given
from hypothesis import strategies as st

import mini_vllm.testing as mini
from mini_vllm.grading import checks
from mini_vllm.kv_cache_interface import cdiv
from mini_vllm.oracle import strategies
from mini_vllm.request import RequestStatus

import phase03_helpers as helpers
from phase03_helpers import (
    KV_CACHE_MANAGER,
    PROPERTY,
    SCHEDULER,
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
MAX_RUNNING = reference_text("assert len(self.running) <= self.max_num_running_reqs", SCHEDULER)
BUDGET = reference_text("assert token_budget >= 0", SCHEDULER)
ONLY_RUNNING = reference_text("Only running requests can be preempted", SCHEDULER)
NO_TOKENS = reference_text("num_new_tokens must be greater than 0", KV_CACHE_MANAGER)


def explain(error: BaseException) -> str | None:
    """A teaching sentence for the errors a broken step trips inside the
    reference's own code (its end-of-step asserts, allocate_slots)."""
    line = traceback.extract_tb(error.__traceback__)[-1].line
    if isinstance(error, AssertionError) and TOTAL_TOKENS in (line or ""):
        hint = (
            "the step handed out more tokens than max_num_batched_tokens: every "
            "scheduled request (running or admitted) must charge token_budget"
        )
    elif isinstance(error, AssertionError) and MAX_RUNNING in (line or ""):
        hint = "more requests are running than max_num_seqs: look at gate 3"
    elif isinstance(error, AssertionError) and BUDGET in (line or ""):
        hint = "token_budget went negative: something was scheduled past the budget"
    elif isinstance(error, AssertionError) and ONLY_RUNNING in str(error):
        hint = (
            "a request in self.running is not RUNNING, so it cannot be preempted: an "
            "admitted request must be marked RUNNING (request.status)"
        )
    elif isinstance(error, ValueError) and NO_TOKENS in str(error):
        hint = (
            "allocate_slots was asked for 0 tokens: a request was admitted with no "
            "token budget left (gate 2 must stop admissions when token_budget <= 0)"
        )
    else:
        return None
    detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return f"schedule() tripped `{line}` ({detail}): {hint}."


ENDLESS = (
    "the reference finishes every workload here in a few hundred steps at most. Some "
    "request is never scheduled again or never finishes: look for a count that stops "
    "advancing."
)
STEPPER = Stepper(explain)
explained, schedule, step = STEPPER.explained, STEPPER.schedule, STEPPER.step


def bounded(workload):
    return helpers.bounded(workload, MAX_STEPS)


def run_checked(cls, workload) -> None:
    helpers.run_checked(cls, workload, ENDLESS)


# ------------------------------------------------- 1. _clamp_new_tokens


@pytest.mark.points(1)
def test_clamp_threshold_caps_a_long_request(impl):
    sched = make(impl, max_model_len=100, long_prefill_token_threshold=10)
    (req,) = requests(["r"], [60])
    got = sched._clamp_new_tokens(req, 50, 1000)
    assert got == 10, (
        f"Cap 1 (long_prefill_token_threshold): threshold=10, the request wants 50 tokens, "
        f"budget 1000, nothing computed yet: expected 10, got {got}."
    )
    got = sched._clamp_new_tokens(req, 8, 1000)
    assert got == 8, (
        f"A threshold only lowers: threshold=10 and the request wants 8 tokens: "
        f"expected 8, got {got}."
    )
    no_threshold = make(impl, max_model_len=100, long_prefill_token_threshold=0)
    got = no_threshold._clamp_new_tokens(req, 50, 1000)
    assert got == 50, (
        f"long_prefill_token_threshold=0 means NO threshold (upstream: `if 0 < threshold "
        f"< num_new_tokens`): a request wanting 50 with budget 1000 gets 50, got {got}."
    )


@pytest.mark.points(1)
def test_clamp_budget_caps_the_step(impl):
    sched = make(impl, max_model_len=100, long_prefill_token_threshold=10)
    (req,) = requests(["r"], [60])
    got = sched._clamp_new_tokens(req, 50, 7)
    assert got == 7, (
        f"Cap 2 (token budget): 7 tokens of budget are left this step, the request "
        f"wants 50 (threshold 10): expected 7, got {got}."
    )
    got = sched._clamp_new_tokens(req, 5, 7)
    assert got == 5, (
        f"The budget only lowers: the request wants 5 and 7 are left: expected 5, got {got}."
    )


@pytest.mark.points(2)
def test_clamp_never_reaches_max_model_len(impl):
    sched = make(impl, max_model_len=100)
    (req,) = requests(["r"], [99])
    for computed, wanted, expected in [(95, 5, 4), (90, 3, 3), (98, 2, 1), (99, 1, 0)]:
        req.num_computed_tokens = computed
        got = sched._clamp_new_tokens(req, wanted, 1000)
        assert got == expected, (
            f"Cap 3 (model length): max_model_len=100, num_computed_tokens={computed}, "
            f"the request wants {wanted}, budget 1000: at most max_model_len - 1 - "
            f"num_computed_tokens = {100 - 1 - computed} may be computed, so expected "
            f"{expected}, got {got}. (The `- 1`: the token that would sit at position "
            f"max_model_len - 1 is never fed to the model; 0 means 'skip this request'.)"
        )


@pytest.mark.points(1)
@PROPERTY
@given(
    threshold=st.sampled_from([0, 1, 3, 8, 32]), max_model_len=st.integers(8, 200), data=st.data()
)
def test_clamp_is_the_minimum_of_the_three_caps(impl, threshold, max_model_len, data):
    computed = data.draw(st.integers(0, max_model_len - 1), label="num_computed_tokens")
    wanted = data.draw(st.integers(1, 300), label="num_new_tokens")
    budget = data.draw(st.integers(1, 300), label="token_budget")
    sched = make(
        impl,
        max_model_len=max_model_len,
        long_prefill_token_threshold=threshold,
        block_size=16,
        num_blocks=cdiv(max_model_len, 16) + 1,
        max_num_seqs=1,
        max_num_batched_tokens=max_model_len,
    )
    (req,) = requests(["r"], [max_model_len - 1])
    req.num_computed_tokens = computed
    expected = min(
        wanted, threshold if threshold > 0 else wanted, budget, max_model_len - 1 - computed
    )
    got = sched._clamp_new_tokens(req, wanted, budget)
    assert got == expected, (
        f"_clamp_new_tokens(num_new_tokens={wanted}, token_budget={budget}) with "
        f"threshold={threshold}, max_model_len={max_model_len}, num_computed_tokens="
        f"{computed}: expected min(wanted, threshold if > 0, budget, max_model_len - 1 - "
        f"computed) = {expected}, got {got}."
    )


# ------------------------------- 2. Phase 1: schedule RUNNING requests


@pytest.mark.points(2)
def test_running_requests_are_scheduled_in_order_and_charged(impl):
    sched = make(impl, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=256)
    a, b, c = requests("abc", [10, 4, 20])
    sched.add_request(a)
    sched.add_request(b)
    step(sched, "step 0 (a and b prefill)")
    sched.add_request(c)
    out = schedule(sched, "step 1")
    got = dict(out.num_scheduled_tokens)
    assert list(got)[:2] == ["a", "b"] and got.get("a") == 1 and got.get("b") == 1, (
        f"Step 1: a and b are RUNNING, each one token behind (its sampled token), so "
        f"Phase 1 must schedule both, in running order, 1 token each: expected "
        f"{{'a': 1, 'b': 1, ...}}, got {got}. Each scheduled running request is recorded "
        f"(scheduled_running_reqs, req_to_new_blocks, num_scheduled_tokens) and then "
        f"req_index moves on to the next one."
    )
    assert out.scheduled_cached_reqs.req_ids[:2] == ["a", "b"], (
        f"Step 1: a and b must be listed in scheduled_running_reqs (they become "
        f"scheduled_cached_reqs): got {out.scheduled_cached_reqs.req_ids}."
    )
    assert got.get("c") == 14, (
        f"Step 1: the budget is 16 and Phase 1 spent 1 + 1 on a and b, so c's first chunk "
        f"is the 14 tokens left: expected c=14, got {got.get('c')} (scheduled: {got}). "
        f"Phase 1 must charge the budget: token_budget -= num_new_tokens."
    )


@pytest.mark.points(1)
def test_running_request_memory_is_recorded(impl):
    sched = make(impl, max_num_batched_tokens=64, block_size=4, max_model_len=64)
    (a,) = requests("a", [8], block_size=4)
    sched.add_request(a)
    step(sched, "step 0 (a's 8-token prompt fills 2 blocks of 4)")
    out = schedule(sched, "step 1")
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["a"], (
        f"Step 1: a is running and must be scheduled; got {cached.req_ids}."
    )
    held = sched.kv_cache_manager.get_block_ids("a")[0]
    assert cached.new_block_ids[0] is not None, (
        f"Step 1: a's 9th token needs a third block; the workers learn it from "
        f"req_to_new_blocks[a] (the blocks allocate_slots returned): expected new block ids "
        f"{held[2:]}, got {cached.new_block_ids[0]}."
    )
    assert list(cached.new_block_ids[0][0]) == held[2:], (
        f"Step 1: a's 9th token needs a third block; the workers learn it from "
        f"req_to_new_blocks[a] (the blocks allocate_slots returned): expected new block ids "
        f"{held[2:]}, got {cached.new_block_ids[0]}."
    )


# ---------------------------------------------- 3. the three admission gates


@pytest.mark.points(1)
def test_gate_max_num_seqs(impl):
    sched = make(impl, max_num_seqs=2)
    reqs = requests("abc", [10, 10, 10])
    for r in reqs:
        sched.add_request(r)
    out = step(sched, "step 0")
    assert list(out.num_scheduled_tokens) == ["a", "b"], (
        f"Gate 3 (max_num_seqs=2): a and b fill the batch, c must wait. Scheduled in "
        f"step 0: {list(out.num_scheduled_tokens)}; expected ['a', 'b']."
    )
    out = step(sched, "step 1")
    assert "c" not in out.num_scheduled_tokens, (
        f"Gate 3 (max_num_seqs=2): step 1 still has a and b running, so c stays waiting; "
        f"scheduled {dict(out.num_scheduled_tokens)}, waiting {ids(sched.waiting)}."
    )
    assert ids(sched.waiting) == ["c"], (
        f"Gate 3 (max_num_seqs=2): step 1 still has a and b running, so c stays waiting; "
        f"scheduled {dict(out.num_scheduled_tokens)}, waiting {ids(sched.waiting)}."
    )


@pytest.mark.points(1)
def test_gate_no_admission_without_budget(impl):
    sched = make(impl, max_num_batched_tokens=10, max_model_len=64, max_num_seqs=4)
    a, b = requests("ab", [10, 5])
    sched.add_request(a)
    sched.add_request(b)
    out = schedule(sched, "step 0")
    assert dict(out.num_scheduled_tokens) == {"a": 10}, (
        f"Gate 2 (token budget): a's 10 tokens use the whole budget of 10, so b may not be "
        f"admitted this step (not even with 0 tokens). Expected {{'a': 10}}, got "
        f"{dict(out.num_scheduled_tokens)}."
    )
    assert b.status == RequestStatus.WAITING and ids(sched.waiting) == ["b"], (
        f"Gate 2: b must still be WAITING at the head of the queue; status {b.status.name}, "
        f"waiting {ids(sched.waiting)}."
    )


@pytest.mark.points(2)
def test_gate_no_admission_in_a_step_that_preempted(impl):
    # PRIORITY policy, 7 usable blocks of 4 tokens, at most 3 running.
    sched = make(
        impl,
        num_blocks=8,
        block_size=4,
        max_model_len=28,
        max_num_batched_tokens=64,
        max_num_seqs=3,
        policy="priority",
    )
    a, b, c, d = requests(
        "abcd", [7, 7, 11, 3], block_size=4, priorities=[0, 0, 2, 1], max_tokens=10, ignore_eos=True
    )
    for r in (a, b, c):
        sched.add_request(r)
    step(sched, "step 0 (a, b, c prefill: 2 + 2 + 3 blocks = the whole cache)")
    sched.add_request(d)
    step(sched, "step 1 (d waits: max_num_seqs=3)")
    out = step(sched, "step 2")
    assert out.preempted_req_ids == {"c"}, (
        f"Step 2: a's 9th token needs a block and none is free, so c (worst priority) is "
        f"preempted (lab 03.3's code, the reference here). Expected preempted {{'c'}}, got "
        f"{out.preempted_req_ids}: a running request was not scheduled as expected."
    )
    assert "d" not in out.num_scheduled_tokens, (
        f"Gate 1 (no admissions in a step that preempted): c's preemption freed a block "
        f"and a seat, and d (3 tokens, 1 block) would fit, but a step that had to preempt "
        f"is under memory pressure: admitting now would only thrash. Expected d to wait, "
        f"got scheduled {dict(out.num_scheduled_tokens)} (d is {d.status.name})."
    )
    assert d.status == RequestStatus.WAITING, (
        f"Gate 1 (no admissions in a step that preempted): c's preemption freed a block "
        f"and a seat, and d (3 tokens, 1 block) would fit, but a step that had to preempt "
        f"is under memory pressure: admitting now would only thrash. Expected d to wait, "
        f"got scheduled {dict(out.num_scheduled_tokens)} (d is {d.status.name})."
    )
    out = step(sched, "step 3")
    assert out.num_scheduled_tokens.get("d") == 3, (
        f"Step 3: no preemption, a free block and a free seat: d is admitted with its 3 "
        f"tokens; got {dict(out.num_scheduled_tokens)}."
    )


# ------------------------------------- 4. Phase 2: admit WAITING requests


@pytest.mark.points(1)
def test_admitted_request_is_running_with_its_blocks(impl):
    sched = make(impl, max_model_len=256)
    (a,) = requests("a", [20])
    sched.add_request(a)
    out = schedule(sched, "step 0")
    assert dict(out.num_scheduled_tokens) == {"a": 20}, (
        f"Step 0: a (20-token prompt) fits the budget: expected {{'a': 20}}, got "
        f"{dict(out.num_scheduled_tokens)}."
    )
    assert a.status == RequestStatus.RUNNING and ids(sched.running) == ["a"], (
        f"An admitted request is marked RUNNING (request.status = RequestStatus.RUNNING); "
        f"a is {a.status.name}, running = {ids(sched.running)}."
    )
    (new,) = out.scheduled_new_reqs
    held = sched.kv_cache_manager.get_block_ids("a")[0]
    assert list(new.block_ids[0]) == held and len(held) == 2, (
        f"A new request's workers need its whole block table: req_to_new_blocks[a] = "
        f"kv_cache_manager.get_blocks(a) (2 blocks of 16 for 20 tokens {held}); "
        f"scheduled_new_reqs[0].block_ids = {new.block_ids}."
    )


@pytest.mark.points(1)
def test_admission_charges_the_budget(impl):
    sched = make(impl, max_num_batched_tokens=32, max_model_len=64)
    a, b = requests("ab", [20, 20])
    sched.add_request(a)
    sched.add_request(b)
    out = schedule(sched, "step 0")
    assert dict(out.num_scheduled_tokens) == {"a": 20, "b": 12}, (
        f"Step 0, budget 32: a is admitted with 20 tokens, leaving 12 for b's first chunk. "
        f"Expected {{'a': 20, 'b': 12}}, got {dict(out.num_scheduled_tokens)}. After "
        f"admitting, token_budget -= num_new_tokens."
    )


@pytest.mark.points(2)
def test_prefix_cache_hits_count_as_computed(impl):
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
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 32, (
        f"Step 1: b's first 32 tokens are two cached blocks (prefix hit), so b starts with "
        f"num_computed_tokens = 32 (request.num_computed_tokens = num_computed_tokens at "
        f"admission); the workers were told {new.num_computed_tokens}."
    )
    held = sched.kv_cache_manager.get_block_ids("b")[0]
    assert list(new.block_ids[0]) == held and len(held) == 3, (
        f"Step 1: the workers get b's WHOLE block table, its 2 cached blocks included: "
        f"req_to_new_blocks[b] = kv_cache_manager.get_blocks(b) = {held}, not only the "
        f"block allocate_slots just added. Got {list(new.block_ids[0])}."
    )
    assert out.num_scheduled_tokens.get("b") == 5, (
        f"Step 1: only b's 5 uncached tokens are computed: expected 5 scheduled and "
        f"num_computed_tokens 37 after the step, got {out.num_scheduled_tokens.get('b')} and "
        f"{b.num_computed_tokens}."
    )
    assert b.num_computed_tokens == 37, (
        f"Step 1: only b's 5 uncached tokens are computed: expected 5 scheduled and "
        f"num_computed_tokens 37 after the step, got {out.num_scheduled_tokens.get('b')} and "
        f"{b.num_computed_tokens}."
    )


# ---------------------------------------------------------------- properties


def invariant_checker(cls):
    """The class under grade, checking one-step rules after every schedule()."""

    class Checked(explained(cls)):
        def schedule(self):
            running_before = len(self.running)
            out = super().schedule()
            cfg = self.scheduler_config
            scheduled = dict(out.num_scheduled_tokens)
            where = f"a step with {running_before} running before it, scheduled {scheduled}"
            assert (
                sum(scheduled.values())
                == out.total_num_scheduled_tokens
                <= self.max_num_scheduled_tokens
            ), (
                f"Budget: {where}: total {out.total_num_scheduled_tokens} must equal the sum "
                f"and stay <= max_num_batched_tokens={self.max_num_scheduled_tokens}."
            )
            assert len(self.running) <= self.max_num_running_reqs, (
                f"max_num_seqs={self.max_num_running_reqs}: {len(self.running)} running "
                f"after {where}."
            )
            assert all(n > 0 for n in scheduled.values()), (
                f"A request is scheduled with 0 tokens in {where}: a request the clamp gives "
                f"0 is skipped, and no admission happens without budget."
            )
            threshold = cfg.long_prefill_token_threshold
            for req_id, n in scheduled.items():
                req = self.requests[req_id]
                assert threshold == 0 or n <= threshold, (
                    f"{req_id} got {n} tokens > long_prefill_token_threshold={threshold} "
                    f"in {where}."
                )
                assert req.num_computed_tokens <= min(req.num_tokens, self.max_model_len - 1), (
                    f"{req_id}: after {where} it has {req.num_computed_tokens} computed of "
                    f"{req.num_tokens} tokens (max_model_len={self.max_model_len}): "
                    f"never past its tokens, never at position max_model_len - 1."
                )
            if out.preempted_req_ids:
                admitted = [d.req_id for d in out.scheduled_new_reqs] + sorted(
                    out.scheduled_cached_reqs.resumed_req_ids
                )
                assert not admitted, (
                    f"Gate 1: {where} preempted {sorted(out.preempted_req_ids)} and still "
                    f"admitted {admitted}."
                )
            for d in out.scheduled_new_reqs:
                assert self.requests[d.req_id].status == RequestStatus.RUNNING, (
                    f"{d.req_id} was admitted in {where} but is "
                    f"{self.requests[d.req_id].status.name}, not RUNNING."
                )
            return out

    return Checked


def tight_cache(workload):
    """The same workload with the smallest cache its config allows (one
    max_model_len request): preemptions, and so gate 1, come into play."""
    config = workload.config
    num_blocks = cdiv(config["max_model_len"], config["block_size"]) + 1
    return dataclasses.replace(workload, config=dict(config, num_blocks=num_blocks))


@pytest.mark.points(2)
@pytest.mark.timeout(30)
@PROPERTY
@given(workload=st.one_of(strategies.workloads(), strategies.workloads().map(tight_cache)))
def test_property_one_step_invariants(impl, workload):
    run_checked(invariant_checker(impl.scheduler.Scheduler), bounded(workload))


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


@pytest.mark.points(2)
@pytest.mark.parametrize("scenario", ["admission_gates", "admission_without_full_prompt_gate"])
def test_snapshot(impl, scenario):
    mismatch = checks.snapshot_mismatch(explained(impl.scheduler.Scheduler), scenario)
    assert mismatch is None, mismatch
