"""Lab 03.3 — preemption.

Graded: the two ``LAB 03.3`` regions of ``labs/phase_03/scheduler.py``: the
``allocate_slots -> None -> preempt a victim -> retry`` loop inside
``schedule()``, and ``_preempt_request``. Every other region holds the
reference's code while this lab is graded.

Read the tests top to bottom: each builds a tiny KV cache by hand (a few
blocks of 2 or 4 tokens) so that you can count the blocks yourself, runs a
few steps and says, when it fails, which rule broke, at which step, what
was expected and what your code did. Then come properties (hypothesis:
invariants on generated workloads, and your scheduler against the
reference), then upstream's own recorded traces.
"""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

import mini_vllm.testing as mini
from mini_vllm.core.sched.request_queue import SchedulingPolicy
from mini_vllm.grading import checks
from mini_vllm.kv_cache_interface import cdiv
from mini_vllm.oracle import strategies
from mini_vllm.oracle.workload import RequestSpec, Workload
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

# The reference finishes every generated workload in under 2,000 steps.
MAX_STEPS = 10_000

# A hand-built test runs in milliseconds: past this, a loop in schedule() never ends.
pytestmark = pytest.mark.timeout(15)


# ------------------------------------------------------------------ helpers


def make(impl, **config):
    """A scheduler of the class under grade (``create_scheduler`` keywords);
    prefix caching off unless asked, so freed blocks are plainly free."""
    config.setdefault("enable_prefix_caching", False)
    return mini.create_scheduler(scheduler_cls=impl.scheduler.Scheduler, **config)


def requests(ids, lengths, block_size, **kwargs):
    """One request per id; the prompt of id i is ``[i + 1] * lengths[i]``;
    they never stop on their own before 20 tokens."""
    kwargs.setdefault("max_tokens", 20)
    return mini.create_requests(
        len(ids),
        req_ids=list(ids),
        block_size=block_size,
        ignore_eos=True,
        prompt_token_ids=[[i + 1] * n for i, n in enumerate(lengths)],
        **kwargs,
    )


# The reference's text explain() keys on (checked when the suite is collected).
ONLY_RUNNING = reference_text("Only running requests can be preempted", SCHEDULER)
TOTAL_TOKENS = reference_text("assert total_num_scheduled_tokens", SCHEDULER)
MAX_RUNNING = reference_text("assert len(self.running) <= self.max_num_running_reqs", SCHEDULER)
NEW_BLOCKS = reference_text("req_to_new_blocks[", SCHEDULER)
HOLDS_BLOCKS = reference_text("assert not req_blocks", KV_CACHE_MANAGER)


def explain(error: BaseException) -> str | None:
    """A teaching sentence for the errors a broken step trips inside the
    reference's own code (its asserts, the KV cache manager)."""
    line = traceback.extract_tb(error.__traceback__)[-1].line or ""
    if isinstance(error, AssertionError) and ONLY_RUNNING in str(error):
        hint = (
            "a request was preempted twice, or after it was already taken out of "
            "running: a victim leaves self.running exactly once, and once the victim "
            "is the request itself the loop must stop (it has nothing left to free)"
        )
    elif isinstance(error, AssertionError) and TOTAL_TOKENS in line:
        hint = (
            "the step handed out more tokens than max_num_batched_tokens: when a victim "
            "already scheduled this step is preempted, its tokens go back to token_budget"
        )
    elif isinstance(error, AssertionError) and MAX_RUNNING in line:
        hint = "more requests are running than max_num_seqs"
    elif isinstance(error, KeyError) and NEW_BLOCKS in line:
        hint = (
            "a request listed as scheduled has no new blocks: a victim that was already "
            "scheduled this step must leave scheduled_running_reqs, num_scheduled_tokens "
            "and req_to_new_blocks together"
        )
    elif isinstance(error, AssertionError) and HOLDS_BLOCKS in line:
        hint = (
            "allocate_slots met a request coming back from waiting that still holds KV "
            "blocks: _preempt_request must free them (kv_cache_manager.free), and a "
            "request that was its own victim must not be given blocks afterwards"
        )
    elif isinstance(error, IndexError) and "pop" in line:  # your region's line
        hint = (
            "pop from an empty running list: the request itself was already the "
            "victim, so the loop had to give up (break) instead of picking another"
        )
    else:
        return None
    detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return f"schedule() tripped `{line}` ({detail}): {hint}."


ERRORS = (AssertionError, KeyError, IndexError)


ENDLESS = (
    "the reference finishes every workload here in under 2,000 steps. Some request is "
    "never scheduled again or never finishes (a preempted request that never comes "
    "back?)."
)
STEPPER = Stepper(explain, ERRORS)
explained, schedule, step = STEPPER.explained, STEPPER.schedule, STEPPER.step


def held(sched, req_id) -> list[int]:
    return [b.block_id for b in sched.kv_cache_manager.req_to_blocks.get(req_id, ())]


def bounded(workload):
    return helpers.bounded(workload, MAX_STEPS)


def run_checked(cls, workload) -> None:
    helpers.run_checked(cls, workload, ENDLESS)


# ------------------------------------------------ 1. _preempt_request


def one_running_one_waiting(impl):
    """a runs (10-token prompt + 1 sampled token: 3 blocks of 4), x waits
    (max_num_seqs=1). 15 usable blocks."""
    sched = make(impl, num_blocks=16, block_size=4, max_model_len=32, max_num_seqs=1)
    a, x = requests("ax", [10, 10], 4)
    sched.add_request(a)
    sched.add_request(x)
    step(sched, "step 0 (a prefills and samples a token; x waits for a seat)")
    assert ids(sched.running) == ["a"] and ids(sched.waiting) == ["x"]
    return sched, a


def preempt(sched, request):
    """What schedule() does: take the victim out of running, then preempt it."""
    sched.running.remove(request)
    sched._preempt_request(request)


@pytest.mark.points(1)
def test_preempt_request_frees_its_kv_cache(impl):
    sched, a = one_running_one_waiting(impl)
    blocks = held(sched, "a")
    preempt(sched, a)
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    assert held(sched, "a") == [] and free == 15, (
        f"_preempt_request(a): a held blocks {blocks}; preemption frees them all "
        f"(self.kv_cache_manager.free(request)), so the 15 usable blocks are free again. "
        f"a still holds {held(sched, 'a')}, {free} blocks are free."
    )


@pytest.mark.points(1)
def test_preempt_request_resets_what_was_computed(impl):
    sched, a = one_running_one_waiting(impl)
    outputs = list(a.output_token_ids)
    preempt(sched, a)
    assert a.status == RequestStatus.PREEMPTED, (
        f"_preempt_request(a): a must become PREEMPTED (admission tells a resumed request "
        f"from a new one by it); it is {a.status.name}."
    )
    assert a.num_computed_tokens == 0, (
        f"_preempt_request(a): its KV is gone, so nothing counts as computed: "
        f"num_computed_tokens must be 0 (it will be recomputed on resume); it is "
        f"{a.num_computed_tokens}."
    )
    assert a.output_token_ids == outputs, (
        f"_preempt_request(a): a keeps the tokens it sampled ({outputs}); only the KV is "
        f"dropped. They are now {a.output_token_ids}."
    )


@pytest.mark.points(1)
def test_preempt_request_counts_the_preemption(impl):
    sched, a = one_running_one_waiting(impl)
    preempt(sched, a)
    assert a.num_preemptions == 1, (
        f"_preempt_request(a): request.num_preemptions += 1 (stats, and the prefix cache's "
        f"'preempted' counters, read it); after one preemption it is {a.num_preemptions}."
    )


@pytest.mark.points(2)
def test_preempt_request_goes_to_the_front_of_the_queue(impl):
    sched, a = one_running_one_waiting(impl)
    preempt(sched, a)
    assert ids(sched.waiting) == ["a", "x"], (
        f"_preempt_request(a): x was waiting; the victim goes back to the FRONT "
        f"(self.waiting.prepend_request), ahead of requests that never ran, so it resumes "
        f"first. Expected waiting ['a', 'x'], got {ids(sched.waiting)}."
    )


# ----------------------------------- 2. FCFS: the victim is running's tail


@pytest.mark.points(2)
def test_fcfs_preempts_the_tail_of_running(impl):
    # 6 usable blocks of 4; three 7-token prompts take 2 each.
    sched = make(impl, num_blocks=7, block_size=4, max_model_len=24)
    for r in requests("abc", [7, 7, 7], 4):
        sched.add_request(r)
    step(sched, "step 0 (a, b, c prefill: the cache is full)")
    step(sched, "step 1 (each computes its 8th token: still 2 blocks)")
    out = step(sched, "step 2")
    assert out.preempted_req_ids == {"c"}, (
        f"Step 2: a's 9th token needs a 3rd block and none is free. FCFS preempts the "
        f"request admitted LAST, the tail of running (self.running.pop()): c. Expected "
        f"preempted {{'c'}}, got {sorted(out.preempted_req_ids)}."
    )
    assert dict(out.num_scheduled_tokens) == {"a": 1, "b": 1}, (
        f"Step 2: c's 2 freed blocks go to a, then to b (its 9th token needs one too): "
        f"expected {{'a': 1, 'b': 1}}, got {dict(out.num_scheduled_tokens)}."
    )


@pytest.mark.points(2)
def test_preemption_repeats_until_the_request_fits(impl):
    # 5 usable blocks of 2; a's prompt goes in chunks of 4 (2 blocks each).
    sched = make(impl, num_blocks=6, block_size=2, max_model_len=10, long_prefill_token_threshold=4)
    for r in requests("abcd", [8, 1, 1, 2], 2):
        sched.add_request(r)
    step(sched, "step 0 (a: 4 tokens, 2 blocks; b, c, d: 1 block each; the cache is full)")
    out = step(sched, "step 1")
    assert out.preempted_req_ids == {"c", "d"}, (
        f"Step 1: a's next chunk (4 tokens) needs 2 more blocks, none is free. The loop "
        f"preempts d (the tail: frees 1 block), asks allocate_slots again, still None, so "
        f"it preempts c too, and then a fits. Expected preempted ['c', 'd'] and a "
        f"scheduled with 4, got preempted {sorted(out.preempted_req_ids)} and scheduled "
        f"{dict(out.num_scheduled_tokens)}. (A `while True` loop, not one `if`.)"
    )
    assert out.num_scheduled_tokens.get("a") == 4, (
        f"Step 1: a's next chunk (4 tokens) needs 2 more blocks, none is free. The loop "
        f"preempts d (the tail: frees 1 block), asks allocate_slots again, still None, so "
        f"it preempts c too, and then a fits. Expected preempted ['c', 'd'] and a "
        f"scheduled with 4, got preempted {sorted(out.preempted_req_ids)} and scheduled "
        f"{dict(out.num_scheduled_tokens)}. (A `while True` loop, not one `if`.)"
    )
    assert out.num_scheduled_tokens.get("b") == 1, (
        f"Step 1: b still runs (its 2nd token fits its block); c and d wait at the front, "
        f"in their old order (d was prepended first, then c). Got scheduled "
        f"{dict(out.num_scheduled_tokens)}, waiting {ids(sched.waiting)}."
    )
    assert ids(sched.waiting) == ["c", "d"], (
        f"Step 1: b still runs (its 2nd token fits its block); c and d wait at the front, "
        f"in their old order (d was prepended first, then c). Got scheduled "
        f"{dict(out.num_scheduled_tokens)}, waiting {ids(sched.waiting)}."
    )


@pytest.mark.points(2)
def test_fcfs_gives_up_when_the_victim_is_the_request_itself(impl):
    # 4 usable blocks of 4; a (6 tokens) and b (8 tokens) take 2 each.
    sched = make(impl, num_blocks=5, block_size=4, max_model_len=16)
    a, b = requests("ab", [6, 8], 4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, "step 0 (a and b prefill: the cache is full)")
    out = step(sched, "step 1")
    assert out.preempted_req_ids == {"b"}, (
        f"Step 1: a's 7th token fits its 2nd block; b's 9th needs a 3rd block, none is "
        f"free, and the tail of running is b itself. Preempting b frees its blocks but "
        f"there is nothing left to make room FOR b: the loop stops (`if preempted_req is "
        f"request: break`) and b is not scheduled. Expected preempted ['b'] and b not "
        f"scheduled; got preempted {sorted(out.preempted_req_ids)}, scheduled "
        f"{dict(out.num_scheduled_tokens)}."
    )
    assert "b" not in out.num_scheduled_tokens, (
        f"Step 1: a's 7th token fits its 2nd block; b's 9th needs a 3rd block, none is "
        f"free, and the tail of running is b itself. Preempting b frees its blocks but "
        f"there is nothing left to make room FOR b: the loop stops (`if preempted_req is "
        f"request: break`) and b is not scheduled. Expected preempted ['b'] and b not "
        f"scheduled; got preempted {sorted(out.preempted_req_ids)}, scheduled "
        f"{dict(out.num_scheduled_tokens)}."
    )
    assert dict(out.num_scheduled_tokens) == {"a": 1}, (
        f"Step 1: only a runs; b is PREEMPTED and waits. Got scheduled "
        f"{dict(out.num_scheduled_tokens)}, b {b.status.name}."
    )
    assert b.status == RequestStatus.PREEMPTED, (
        f"Step 1: only a runs; b is PREEMPTED and waits. Got scheduled "
        f"{dict(out.num_scheduled_tokens)}, b {b.status.name}."
    )


# ----------------------- 3. PRIORITY: the victim is the worst (priority, arrival)


@pytest.mark.points(2)
def test_priority_victim_already_scheduled_is_undone(impl):
    # 5 usable blocks of 4. w (priority 5, the worst) runs first; x (0) and y (1) join.
    sched = make(impl, num_blocks=6, block_size=4, max_model_len=20, policy="priority")
    w, x, y = requests("wxy", [5, 7, 2], 4, priorities=[5, 0, 1])
    sched.add_request(w)
    step(sched, "step 0 (w prefills)")
    sched.add_request(x)
    sched.add_request(y)
    step(sched, "step 1 (x and y join: 2 + 2 + 1 blocks, the cache is full)")
    step(sched, "step 2 (everyone's next token fits)")
    out = step(sched, "step 3")
    assert out.preempted_req_ids == {"w"}, (
        f"Step 3: running is [w, x, y]; w's token is scheduled first, then x's 9th token "
        f"needs a block and none is free. PRIORITY preempts max(running, key=(priority, "
        f"arrival_time)): w (priority 5), even though it was scheduled a moment ago. Got "
        f"preempted {sorted(out.preempted_req_ids)}."
    )
    assert dict(out.num_scheduled_tokens) == {"x": 1, "y": 1}, (
        f"Step 3: w's scheduling this step is undone (out of scheduled_running_reqs, "
        f"num_scheduled_tokens and req_to_new_blocks, its tokens back in token_budget), and "
        f"req_index steps back one because running lost an entry before it, so y is not "
        f"skipped. Expected {{'x': 1, 'y': 1}}, got {dict(out.num_scheduled_tokens)}."
    )
    assert out.total_num_scheduled_tokens == 2, (
        f"Step 3: the total must count x and y only: 2, got {out.total_num_scheduled_tokens}."
    )


@pytest.mark.points(1)
def test_priority_undo_gives_the_budget_back(impl):
    # 5 usable blocks of 4, a budget of 6 tokens a step. w has the worst priority.
    sched = make(
        impl,
        num_blocks=6,
        block_size=4,
        max_model_len=14,
        max_num_batched_tokens=6,
        max_num_seqs=4,
        policy="priority",
    )
    w, a, b = requests("wab", [2, 8, 8], 4, priorities=[2, 1, 1], max_tokens=14)
    for i, r in enumerate((w, a, b)):
        sched.add_request(r)
        step(sched, f"step {i} ({r.request_id} joins)")
    out = step(sched, "step 3")
    assert out.preempted_req_ids == {"w"}, (
        f"Step 3: running is [w, a, b]. w takes the last free block and 1 token; then a's "
        f"9th token needs a block, none is free, and w (priority 2) is the worst: it is "
        f"preempted and its scheduling undone. Got preempted {sorted(out.preempted_req_ids)}, "
        f"scheduled {dict(out.num_scheduled_tokens)}."
    )
    assert "w" not in out.num_scheduled_tokens, (
        f"Step 3: running is [w, a, b]. w takes the last free block and 1 token; then a's "
        f"9th token needs a block, none is free, and w (priority 2) is the worst: it is "
        f"preempted and its scheduling undone. Got preempted {sorted(out.preempted_req_ids)}, "
        f"scheduled {dict(out.num_scheduled_tokens)}."
    )
    assert dict(out.num_scheduled_tokens) == {"a": 1, "b": 5}, (
        f"Step 3, budget 6: w's token goes back to token_budget when its scheduling is undone "
        f"(token_budget += num_scheduled_tokens.pop(w)), so after a's 1 token, b (mid-"
        f"prefill, 6 tokens to go) gets the 5 left. Expected {{'a': 1, 'b': 5}}, got "
        f"{dict(out.num_scheduled_tokens)}."
    )


@pytest.mark.points(1)
def test_priority_ties_go_to_the_latest_arrival(impl):
    sched = make(impl, num_blocks=7, block_size=4, max_model_len=24, policy="priority")
    for r in requests("abc", [7, 7, 7], 4, priorities=[1, 1, 1]):
        sched.add_request(r)
    step(sched, "step 0")
    step(sched, "step 1")
    out = step(sched, "step 2")
    assert out.preempted_req_ids == {"c"}, (
        f"Step 2: a, b, c share priority 1, so the key (priority, arrival_time) breaks the "
        f"tie: the LATEST arrival (c, arrival_time 2.0) is the victim. Got "
        f"{sorted(out.preempted_req_ids)}."
    )


@pytest.mark.points(1)
def test_priority_gives_up_when_the_victim_is_the_request_itself(impl):
    # 6 usable blocks of 4. b (priority 5) is the worst.
    sched = make(impl, num_blocks=7, block_size=4, max_model_len=24, policy="priority")
    a, b, c = requests("abc", [6, 7, 5], 4, priorities=[0, 5, 1])
    sched.add_request(a)
    sched.add_request(b)
    step(sched, "step 0 (a and b prefill)")
    sched.add_request(c)
    step(sched, "step 1 (c joins: the cache is full)")
    out = step(sched, "step 2")
    assert out.preempted_req_ids == {"b"}, (
        f"Step 2: running is [a, b, c]. a's token fits; b's 9th needs a block, none is "
        f"free, and the worst-priority request is b itself: preempt it and give up. "
        f"Giving up ends Phase 1 (`if new_blocks is None: break`), so c is not scheduled "
        f"this step although its token would fit. Expected preempted ['b'] and scheduled "
        f"{{'a': 1}}; got preempted {sorted(out.preempted_req_ids)}, scheduled "
        f"{dict(out.num_scheduled_tokens)}."
    )
    assert dict(out.num_scheduled_tokens) == {"a": 1}, (
        f"Step 2: running is [a, b, c]. a's token fits; b's 9th needs a block, none is "
        f"free, and the worst-priority request is b itself: preempt it and give up. "
        f"Giving up ends Phase 1 (`if new_blocks is None: break`), so c is not scheduled "
        f"this step although its token would fit. Expected preempted ['b'] and scheduled "
        f"{{'a': 1}}; got preempted {sorted(out.preempted_req_ids)}, scheduled "
        f"{dict(out.num_scheduled_tokens)}."
    )


# ---------------------------------------------------------------- properties


@st.composite
def pressure_workloads(draw) -> Workload:
    """Workloads under memory pressure: a cache that holds one max_model_len
    request (plus up to 3 blocks), at least two seats, and 3-10 long requests
    that ignore EOS. About three in four preempt at least once."""
    config = draw(strategies.scheduler_configs())
    max_model_len, block_size = config["max_model_len"], config["block_size"]
    config["num_blocks"] = cdiv(max_model_len, block_size) + 1 + draw(st.integers(0, 3))
    config["max_num_seqs"] = max(2, config["max_num_seqs"])
    config["max_num_batched_tokens"] = max(2, config["max_num_batched_tokens"])
    specs = []
    for i in range(draw(st.integers(3, 10))):
        n = draw(st.integers(max(1, max_model_len // 4), max_model_len - 1))
        specs.append(
            RequestSpec(
                req_id=f"req-{i}",
                prompt_token_ids=draw(st.lists(st.integers(1, 999), min_size=n, max_size=n)),
                max_tokens=draw(st.integers(max_model_len // 4 + 1, max_model_len)),
                arrive_step=draw(st.sampled_from([0, 0, 1, 3])),
                priority=draw(st.integers(0, 3)),
                ignore_eos=True,
            )
        )
    return Workload(name="pressure", config=config, requests=specs)


def preemption_checker(cls):
    """The class under grade, checking preemption rules after every schedule()."""

    class Checked(explained(cls)):
        preemptions: Counter

        def schedule(self):
            if not hasattr(self, "preemptions"):
                self.preemptions = Counter()
            before = list(self.running)
            out = super().schedule()
            victims = set(out.preempted_req_ids)
            self.preemptions.update(victims)
            where = (
                f"a step with running {ids(before)} before it, which preempted "
                f"{sorted(victims)} and scheduled {dict(out.num_scheduled_tokens)}"
            )
            assert victims <= set(ids(before)), f"Only running requests can be victims: {where}."
            survivors = [r for r in before if r.request_id not in victims]
            assert ids(self.running)[: len(survivors)] == ids(survivors), (
                f"Preemption removes victims only: the survivors keep their order at the "
                f"front of running; running is {ids(self.running)} after {where}."
            )
            if victims and self.policy == SchedulingPolicy.FCFS:
                tail = ids(before)[len(before) - len(victims) :]
                assert victims == set(tail), (
                    f"FCFS victims are the tail of running {tail}: {where}."
                )
                assert ids(self.waiting)[: len(tail)] == tail, (
                    f"FCFS victims go back to the FRONT of waiting, in their old order "
                    f"{tail}; waiting is {ids(self.waiting)} after {where}."
                )
            if victims and self.policy == SchedulingPolicy.PRIORITY:

                def key(r):
                    return (r.priority, r.arrival_time)

                worst_kept = max(map(key, survivors), default=None)
                best_victim = min(key(r) for r in before if r.request_id in victims)
                assert worst_kept is None or best_victim >= worst_kept, (
                    f"PRIORITY victims have the largest (priority, arrival_time): a victim "
                    f"with key {best_victim} was preempted while a request with key "
                    f"{worst_kept} kept running, in {where}."
                )
            for r in before:
                if r.request_id in victims:
                    assert r.request_id not in out.num_scheduled_tokens, (
                        f"{r.request_id} was preempted and still scheduled in {where}."
                    )
                    assert (r.status, r.num_computed_tokens, held(self, r.request_id)) == (
                        RequestStatus.PREEMPTED,
                        0,
                        [],
                    ), (
                        f"A victim is PREEMPTED with 0 computed and no blocks; "
                        f"{r.request_id} is {r.status.name}, computed "
                        f"{r.num_computed_tokens}, holds {held(self, r.request_id)} after "
                        f"{where}."
                    )
                    assert r in list(self.waiting), (
                        f"{r.request_id} was preempted but is not waiting after {where}."
                    )
                assert r.num_preemptions == self.preemptions[r.request_id], (
                    f"{r.request_id} was preempted {self.preemptions[r.request_id]} times "
                    f"so far but num_preemptions is {r.num_preemptions} (after {where})."
                )
            kv = self.kv_cache_manager
            pool = kv.block_pool
            holders = Counter(b.block_id for bs in kv.req_to_blocks.values() for b in bs)
            free = pool.get_num_free_blocks()
            assert free + len(holders) == len(pool.blocks) - 1, (
                f"Blocks lost: {free} free + {len(holders)} held != {len(pool.blocks) - 1} "
                f"usable after {where}."
            )
            return out

    return Checked


@pytest.mark.points(2)
@pytest.mark.timeout(30)
@PROPERTY
@given(workload=pressure_workloads())
def test_property_victims_and_their_state(impl, workload):
    run_checked(preemption_checker(impl.scheduler.Scheduler), bounded(workload))


@pytest.mark.points(3)
@pytest.mark.timeout(30)
@PROPERTY
@given(workload=st.one_of(pressure_workloads(), strategies.workloads()))
def test_property_same_trace_as_the_reference(impl, workload):
    mismatch = checks.reference_mismatch(
        explained(impl.scheduler.Scheduler), workload, max_steps=MAX_STEPS
    )
    assert mismatch is None, "Your scheduler and the reference differ:\n" + mismatch


# ------------------------------------------------- upstream's recorded traces


@pytest.mark.points(2)
@pytest.mark.parametrize("scenario", ["preemption_fcfs", "preemption_priority"])
def test_snapshot(impl, scenario):
    mismatch = checks.snapshot_mismatch(explained(impl.scheduler.Scheduler), scenario)
    assert mismatch is None, mismatch
