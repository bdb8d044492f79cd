"""Lab 03.4 — what the workers are told: ``SchedulerOutput`` as deltas.

Graded: the two ``LAB 03.4`` regions of ``labs/phase_03/scheduler.py``: in
``schedule()``, whether an admitted request is *new* or *resumed*; and
``_make_cached_request_data``, which packs the running and resumed requests
into one ``CachedRequestData``. Every other region holds the reference's
code while this lab is graded.

The model runner (the "workers") keeps every request it has been sent. So a
request travels in full once (``NewRequestData``: prompt, sampling params,
whole block table) and after that only as a delta (``CachedRequestData``:
its new block ids and two counters). Two exceptions: a request resumed
after preemption lost its blocks, so its new block ids *replace* its table;
and a request the workers did not see last step gets its whole token list
again (``all_token_ids``).

Read the tests top to bottom: rule tests on tiny hand-built situations,
a measurement of what deltas save, then properties (a simulated worker that
must stay in sync with the scheduler by replaying only your deltas; your
scheduler against the reference), then upstream's own recorded traces.
"""

from __future__ import annotations

import traceback

import pytest
from hypothesis import given

import mini_vllm.testing as mini
from mini_vllm.grading import checks
from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle import strategies
from mini_vllm.oracle.workload import Progress, fake_token, make_request
from mini_vllm.request import RequestStatus

PROPERTY = lab_settings(150, shrink=True)


# ------------------------------------------------------------------ helpers


def make(impl, **config):
    """A scheduler of the class under grade (``create_scheduler`` keywords)."""
    return mini.create_scheduler(scheduler_cls=impl.scheduler.Scheduler, **config)


def requests(ids, prompts, block_size=16, **kwargs):
    """One request per id, with the given prompts (lists of token ids)."""
    return mini.create_requests(
        len(ids), req_ids=list(ids), block_size=block_size, prompt_token_ids=prompts, **kwargs
    )


def prompt(tag: int, n: int) -> list[int]:
    return [100 * tag + i % 100 for i in range(n)]


def schedule(sched, label: str):
    """``sched.schedule()``; a crash inside it is reported with the step."""
    try:
        return sched.schedule()
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - turned into a message
        where = traceback.extract_tb(e.__traceback__)[-1]
        pytest.fail(
            f"{label}: schedule() raised {type(e).__name__}: {e} (at `{where.line}`, "
            f"line {where.lineno} of {where.filename}).",
            pytrace=False,
        )


def sample(request) -> int:
    """The fake model: output number k of any request is 1000 + k."""
    return 1000 + request.num_output_tokens


def step(sched, label: str):
    """One engine step: schedule(), the fake model, update_from_output()."""
    out = schedule(sched, label)
    sched.update_from_output(out, mini.make_model_runner_output(sched, out, sample))
    return out


def table(sched, req_id: str) -> list[int]:
    return list(sched.kv_cache_manager.get_block_ids(req_id)[0])


def group0(block_ids):
    return None if block_ids is None else list(block_ids[0])


def cached_rows(out) -> dict:
    """req_id -> (new block ids, num_computed_tokens, num_output_tokens)."""
    c = out.scheduled_cached_reqs
    return {
        r: (group0(b), n, o)
        for r, b, n, o in zip(
            c.req_ids, c.new_block_ids, c.num_computed_tokens, c.num_output_tokens, strict=True
        )
    }


# --------------------------------------- 1. first time: a NEW request, in full


@pytest.mark.points(1)
def test_first_admission_is_a_new_request_sent_in_full(impl):
    sched = make(impl, max_model_len=256)
    a, b = requests("ab", [prompt(1, 20), prompt(2, 5)])
    sched.add_request(a)
    sched.add_request(b)
    out = schedule(sched, "step 0")
    new = {d.req_id: d for d in out.scheduled_new_reqs}
    assert list(new) == ["a", "b"], (
        f"Step 0: a and b were WAITING and are admitted for the first time (status WAITING, "
        f"not PREEMPTED), so both belong in scheduled_new_reqs, in admission order. Expected "
        f"['a', 'b'], got {list(new)} (cached: {out.scheduled_cached_reqs.req_ids})."
    )
    for r in (a, b):
        d = new[r.request_id]
        assert (
            d.prompt_token_ids == r.prompt_token_ids
            and list(d.block_ids[0]) == table(sched, r.request_id)
            and d.num_computed_tokens == 0
        ), (
            f"Step 0: NewRequestData for {r.request_id} carries the whole prompt, the whole "
            f"block table {table(sched, r.request_id)} and num_computed_tokens 0; got prompt "
            f"of {len(d.prompt_token_ids)} tokens, block_ids {d.block_ids}, computed "
            f"{d.num_computed_tokens}."
        )
    assert out.scheduled_cached_reqs.req_ids == [], (
        f"Step 0: nothing was running before, so CachedRequestData must be empty; got "
        f"req_ids {out.scheduled_cached_reqs.req_ids}."
    )


# ---------------------------------- 2. after that: deltas (CachedRequestData)


@pytest.mark.points(2)
def test_running_requests_travel_as_deltas(impl):
    # a's prompt fills its block exactly; b's leaves room in its block.
    sched = make(impl, max_model_len=256)
    a, b = requests("ab", [prompt(1, 16), prompt(2, 5)])
    sched.add_request(a)
    sched.add_request(b)
    step(sched, "step 0 (a and b prefill and sample their first token)")
    out = schedule(sched, "step 1")
    c = out.scheduled_cached_reqs
    assert out.scheduled_new_reqs == [], (
        f"Step 1: a and b were scheduled last step; the workers already hold them, so they "
        f"travel as CachedRequestData (running requests, in scheduling order), never as new "
        f"requests again. Expected cached ['a', 'b'] and no new; got cached {c.req_ids}, "
        f"new {[d.req_id for d in out.scheduled_new_reqs]}."
    )
    assert c.req_ids == ["a", "b"], (
        f"Step 1: a and b were scheduled last step; the workers already hold them, so they "
        f"travel as CachedRequestData (running requests, in scheduling order), never as new "
        f"requests again. Expected cached ['a', 'b'] and no new; got cached {c.req_ids}, "
        f"new {[d.req_id for d in out.scheduled_new_reqs]}."
    )
    n = len(c.req_ids)
    lengths = {
        "new_block_ids": len(c.new_block_ids),
        "num_computed_tokens": len(c.num_computed_tokens),
        "num_output_tokens": len(c.num_output_tokens),
    }
    assert all(v == n for v in lengths.values()), (
        f"CachedRequestData holds PARALLEL lists: entry i of every list describes req_ids[i]. "
        f"req_ids has {n} entries but {lengths}."
    )
    rows = cached_rows(out)
    assert rows["a"][0] == table(sched, "a")[1:], (
        f"Step 1: a's 17th token (position 16) needs a second block, which allocate_slots "
        f"returned this step: the workers must get exactly that new block, "
        f"{table(sched, 'a')[1:]} (req_to_new_blocks[a].get_block_ids(allow_none=True)); got "
        f"new_block_ids {rows['a'][0]}."
    )
    assert rows["b"][0] is None, (
        f"Step 1: b's 6th token still fits its first block, so it got no new block: its "
        f"new_block_ids entry must be None (get_block_ids(allow_none=True) turns 'no blocks' "
        f"into None, as upstream sends), not {c.new_block_ids[1]!r}."
    )
    assert (rows["a"][1:], rows["b"][1:]) == ((16, 1), (5, 1)), (
        f"Step 1: num_computed_tokens / num_output_tokens are the counts BEFORE this step "
        f"runs (the method is called before _update_after_schedule): a has 16 computed and "
        f"1 output token, b has 5 and 1. Expected a=(16, 1), b=(5, 1); got "
        f"a={rows['a'][1:]}, b={rows['b'][1:]}."
    )
    assert c.all_token_ids == {}, (
        f"Step 1: the workers saw a and b last step, so no token list is resent "
        f"(all_token_ids must be {{}}, got keys {sorted(c.all_token_ids)}) and nothing is "
        f"resumed (resumed_req_ids must be empty, got {c.resumed_req_ids})."
    )
    assert c.resumed_req_ids == set(), (
        f"Step 1: the workers saw a and b last step, so no token list is resent "
        f"(all_token_ids must be {{}}, got keys {sorted(c.all_token_ids)}) and nothing is "
        f"resumed (resumed_req_ids must be empty, got {c.resumed_req_ids})."
    )
    assert c.new_token_ids == [], (
        f"new_token_ids stays empty (upstream fills it only under pipeline parallelism); got "
        f"{c.new_token_ids}."
    )


# ---------------------- 3. preempted, then admitted again: RESUMED, not new


def preempt_and_resume(impl):
    """FCFS, 7 usable blocks of 4 tokens, caching off. a, b, c (4-token prompts,
    16, 6 and 10 output tokens) run together; at step 5 all three cross into
    a third block, a takes the last free one and c (the tail) is preempted so
    that b gets one. b finishes at step 5 (its 6th token), so at step 6 c
    comes back while a keeps running."""
    sched = make(
        impl,
        block_size=4,
        num_blocks=8,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=24,
        enable_prefix_caching=False,
    )
    a, b, c = (
        requests(x, [prompt(i + 1, 4)], block_size=4, max_tokens=n, ignore_eos=True)[0]
        for i, (x, n) in enumerate([("a", 16), ("b", 6), ("c", 10)])
    )
    for r in (a, b, c):
        sched.add_request(r)
    for i in range(6):
        out = step(sched, f"step {i}")
    assert out.preempted_req_ids == {"c"}, (
        f"Setup: step 5 should preempt c (lab 03.3's code, the reference here) and finish b; "
        f"got preempted {out.preempted_req_ids}, b {b.status.name}. Scheduled: "
        f"{dict(out.num_scheduled_tokens)}."
    )
    assert b.is_finished(), (
        f"Setup: step 5 should preempt c (lab 03.3's code, the reference here) and finish b; "
        f"got preempted {out.preempted_req_ids}, b {b.status.name}. Scheduled: "
        f"{dict(out.num_scheduled_tokens)}."
    )
    assert c.status == RequestStatus.PREEMPTED
    return sched, a, c


@pytest.mark.points(3)
def test_preempted_request_comes_back_resumed_with_everything_resent(impl):
    sched, a, c = preempt_and_resume(impl)
    c_tokens = list(c.all_token_ids)
    out = schedule(sched, "step 6 (c is admitted again)")
    cached = out.scheduled_cached_reqs
    new_ids = [d.req_id for d in out.scheduled_new_reqs]
    assert "c" not in new_ids, (
        f"Step 6: c was PREEMPTED (it ran before, the workers still hold its state), so it "
        f"is RESUMED, not new: it goes to scheduled_resumed_reqs and travels in "
        f"CachedRequestData. Your schedule() put it in scheduled_new_reqs ({new_ids}); "
        f"check request.status: WAITING -> new, PREEMPTED -> resumed."
    )
    assert "c" in cached.req_ids, (
        f"Step 6: c is resumed, so it is listed in CachedRequestData and its id is in "
        f"resumed_req_ids (that is how the workers know its new_block_ids REPLACE its old "
        f"table). Expected resumed_req_ids {{'c'}}; got req_ids {cached.req_ids}, "
        f"resumed_req_ids {cached.resumed_req_ids}."
    )
    assert cached.resumed_req_ids == {"c"}, (
        f"Step 6: c is resumed, so it is listed in CachedRequestData and its id is in "
        f"resumed_req_ids (that is how the workers know its new_block_ids REPLACE its old "
        f"table). Expected resumed_req_ids {{'c'}}; got req_ids {cached.req_ids}, "
        f"resumed_req_ids {cached.resumed_req_ids}."
    )
    rows = cached_rows(out)
    assert rows["c"][0] == table(sched, "c"), (
        f"Step 6: a resumed request lost all its blocks when it was preempted; its "
        f"new_block_ids entry is its WHOLE new block table {table(sched, 'c')} (schedule() "
        f"put get_blocks(c) in req_to_new_blocks); got {rows['c'][0]}."
    )
    assert cached.all_token_ids.get("c") == c_tokens, (
        f"Step 6: c was not scheduled last step, so its whole token list (prompt + the "
        f"{c.num_output_tokens} outputs so far = {len(c_tokens)} tokens) goes in "
        f"all_token_ids['c']; got {cached.all_token_ids.get('c')}."
    )
    assert cached.all_token_ids["c"] is not c.all_token_ids, (
        "all_token_ids['c'] is the request's own list object: the scheduler keeps appending "
        "to request.all_token_ids, so the workers would see tokens change under them. Send "
        "a copy (req.all_token_ids.copy())."
    )
    assert rows["c"][1:] == (0, 5), (
        f"Step 6: c restarts from 0 computed tokens (recompute, caching off) and has 5 output "
        f"tokens: expected (num_computed_tokens, num_output_tokens) = (0, 5), got "
        f"{rows['c'][1:]}."
    )


@pytest.mark.points(2)
def test_running_requests_come_first_then_resumed(impl):
    sched, a, c = preempt_and_resume(impl)
    out = schedule(sched, "step 6 (a keeps running, c is admitted again)")
    got = out.scheduled_cached_reqs.req_ids
    assert got == ["a", "c"], (
        f"Step 6: a is a running request scheduled in Phase 1, c a resumed request admitted "
        f"in Phase 2. CachedRequestData lists the running ones first, then the resumed ones "
        f"(upstream: itertools.chain(running_reqs, resumed_reqs)), whatever their ids. "
        f"Expected ['a', 'c'], got {got}."
    )
    rows = cached_rows(out)
    assert rows["a"] == (None, 9, 6) and rows["c"][1:] == (0, 5), (
        f"Step 6: each list entry must stay with its request: a = (no new block, 9 computed, "
        f"6 outputs), c = (its table, 0 computed, 5 outputs). Got a={rows['a']}, "
        f"c={rows['c']}."
    )


@pytest.mark.points(2)
def test_running_request_skipped_for_a_step_gets_its_tokens_resent(impl):
    # PRIORITY, 4 usable blocks of 4 tokens. `low` (priority 1) runs first,
    # `high` (priority 0) joins at step 1; both fill their second block.
    sched = make(
        impl,
        block_size=4,
        num_blocks=5,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=16,
        policy="priority",
    )
    low, high = requests(
        ["low", "high"],
        [prompt(1, 4), prompt(2, 5)],
        block_size=4,
        priorities=[1, 0],
        max_tokens=10,
        ignore_eos=True,
    )
    high.max_tokens = 8
    sched.add_request(low)
    step(sched, "step 0")
    sched.add_request(high)
    for i in range(1, 5):
        step(sched, f"step {i}")
    out = step(sched, "step 5")
    assert out.preempted_req_ids == {"low"}, (
        f"Setup: at step 5 low needs a third block, none is free, and the PRIORITY victim is "
        f"low itself, so the step ends (lab 03.3's code, the reference here): high, still "
        f"RUNNING, is skipped. Got preempted {out.preempted_req_ids}, scheduled "
        f"{dict(out.num_scheduled_tokens)}."
    )
    assert out.num_scheduled_tokens == {}, (
        f"Setup: at step 5 low needs a third block, none is free, and the PRIORITY victim is "
        f"low itself, so the step ends (lab 03.3's code, the reference here): high, still "
        f"RUNNING, is skipped. Got preempted {out.preempted_req_ids}, scheduled "
        f"{dict(out.num_scheduled_tokens)}."
    )
    out = schedule(sched, "step 6")
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["high"], (
        f"Step 6: high was RUNNING all along (skipped, not preempted): it is a running "
        f"request, not a resumed one. Got req_ids {cached.req_ids}, resumed "
        f"{cached.resumed_req_ids}."
    )
    assert cached.resumed_req_ids == set(), (
        f"Step 6: high was RUNNING all along (skipped, not preempted): it is a running "
        f"request, not a resumed one. Got req_ids {cached.req_ids}, resumed "
        f"{cached.resumed_req_ids}."
    )
    assert cached.all_token_ids.get("high") == list(high.all_token_ids), (
        f"Step 6: high was not scheduled in step 5, so the workers dropped it from their "
        f"batch: like a resumed request, it needs its whole token list in all_token_ids. "
        f"The rule is 'not in self.prev_step_scheduled_req_ids', not 'resumed'. Got "
        f"all_token_ids keys {sorted(cached.all_token_ids)}."
    )


# --------------------------------------------- 4. what the deltas save: measure


def traffic(sched) -> dict:
    """Token ids and block ids sent to the workers over a whole run, with
    deltas and as if every scheduled request were resent in full each step."""
    reqs = requests(
        [f"r{i}" for i in range(8)],
        [prompt(i + 1, 30 + 10 * i) for i in range(8)],
        max_tokens=40,
        ignore_eos=True,
    )
    for r in reqs:
        sched.add_request(r)
    t = dict(tokens=0, blocks=0, full_tokens=0, full_blocks=0, steps=0, preemptions=0)
    progress = Progress()
    while sched.has_requests() and t["steps"] < 500:
        out = schedule(sched, f"step {t['steps']}")
        c = out.scheduled_cached_reqs
        t["tokens"] += sum(len(d.prompt_token_ids) for d in out.scheduled_new_reqs)
        t["tokens"] += sum(len(v) for v in c.all_token_ids.values())
        t["blocks"] += sum(len(d.block_ids[0]) for d in out.scheduled_new_reqs)
        t["blocks"] += sum(len(b[0]) for b in c.new_block_ids if b is not None)
        for r in out.num_scheduled_tokens:
            t["full_tokens"] += sched.requests[r].num_tokens
            t["full_blocks"] += len(table(sched, r))
        t["preemptions"] += len(out.preempted_req_ids)
        sched.update_from_output(out, mini.make_model_runner_output(sched, out, sample))
        progress.after_step(sched, t["steps"])
        t["steps"] += 1
    return t


@pytest.mark.points(2)
def test_deltas_send_a_fraction_of_the_tokens(impl):
    config = dict(
        block_size=16, num_blocks=24, max_num_batched_tokens=128, max_num_seqs=8, max_model_len=256
    )
    ref = traffic(mini.create_scheduler(**config))
    yours = traffic(make(impl, **config))
    story = (
        f"8 requests (prompts 30..100 tokens, 40 outputs each, {ref['preemptions']} "
        f"preemptions) over {ref['steps']} steps. Resending every scheduled request in full "
        f"each step would send {ref['full_tokens']} token ids and {ref['full_blocks']} block "
        f"ids; the reference's deltas send {ref['tokens']} token ids "
        f"({ref['full_tokens'] / ref['tokens']:.0f}x fewer) and {ref['blocks']} block ids. "
    )
    assert yours["tokens"] == ref["tokens"], (
        story + f"Yours sent {yours['tokens']} token ids. Token lists travel only in "
        f"NewRequestData (once) and in all_token_ids, which holds ONLY the requests not "
        f"scheduled in the previous step (self.prev_step_scheduled_req_ids)."
    )
    assert yours["blocks"] == ref["blocks"], (
        story + f"Yours sent {yours['blocks']} block ids. A running request gets only the "
        f"blocks allocated this step (req_to_new_blocks[req_id]); only new and resumed "
        f"requests get a whole table."
    )


# ---------------------------------------------------------------- properties


class Worker:
    """A model runner's memory, rebuilt ONLY from what SchedulerOutput says.

    Like upstream's runner it keeps a block table for every request it was
    sent (until finished), and the token list of the requests in its last
    batch; it appends its own sampled tokens. A request not in its last
    batch must come with all_token_ids.
    """

    def __init__(self):
        self.blocks: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.last_batch: set[str] = set()
        self.running_before: set[str] = set()

    def apply(self, out, sched, label):
        for r in out.finished_req_ids:
            self.blocks.pop(r, None)
            self.tokens.pop(r, None)
        scheduled = set(out.num_scheduled_tokens)
        for r in list(self.tokens):
            if r not in self.last_batch or r not in scheduled:
                del self.tokens[r]  # not in this batch: the worker forgets its tokens
        new_ids = [d.req_id for d in out.scheduled_new_reqs]
        c = out.scheduled_cached_reqs
        assert (
            set(new_ids).isdisjoint(c.req_ids)
            and set(new_ids) | set(c.req_ids) == scheduled
            and len(c.req_ids) == len(set(c.req_ids))
        ), (
            f"{label}: every scheduled request is described exactly once, as new or as "
            f"cached: scheduled {sorted(scheduled)}, new {new_ids}, cached {c.req_ids}."
        )
        n = len(c.req_ids)
        assert (
            len(c.new_block_ids) == len(c.num_computed_tokens) == len(c.num_output_tokens) == n
        ), (
            f"{label}: CachedRequestData's lists are parallel to req_ids ({n} entries): "
            f"new_block_ids {len(c.new_block_ids)}, num_computed_tokens "
            f"{len(c.num_computed_tokens)}, num_output_tokens {len(c.num_output_tokens)}."
        )
        for d in out.scheduled_new_reqs:
            assert d.req_id not in self.blocks, (
                f"{label}: {d.req_id} is sent as a NEW request, but the workers already "
                f"hold it (it ran before and was preempted): it must be RESUMED."
            )
            self.blocks[d.req_id] = list(d.block_ids[0])
            self.tokens[d.req_id] = list(d.prompt_token_ids)
        resumed_seen = False
        for i, r in enumerate(c.req_ids):
            request = sched.requests[r]
            resumed = r in c.resumed_req_ids
            assert not resumed_seen or resumed, (
                f"{label}: CachedRequestData lists running requests first, then resumed ones; "
                f"got req_ids {c.req_ids} with resumed {sorted(c.resumed_req_ids)}."
            )
            resumed_seen = resumed
            was_running = r in self.running_before
            assert resumed == (not was_running), (
                f"{label}: {r} is {'in' if resumed else 'not in'} resumed_req_ids, but it "
                f"{'was' if was_running else 'was not'} running before this step (preempted "
                f"{request.num_preemptions} times). A cached entry is either a running "
                f"request or one resumed (admitted from the waiting queue as PREEMPTED)."
            )
            expected_resent = r not in self.last_batch
            assert (r in c.all_token_ids) == expected_resent, (
                f"{label}: {r} was {'not ' if expected_resent else ''}scheduled in the "
                f"previous step, so it must {'' if expected_resent else 'NOT '}be in "
                f"all_token_ids (keys: {sorted(c.all_token_ids)})."
            )
            if expected_resent:
                self.tokens[r] = list(c.all_token_ids[r])
            new_blocks = group0(c.new_block_ids[i])
            if resumed:
                assert new_blocks, f"{label}: resumed {r} must get its whole block table."
                self.blocks[r] = new_blocks
            else:
                assert new_blocks is None or new_blocks, (
                    f"{label}: {r}'s new_block_ids is {c.new_block_ids[i]!r}: 'no new blocks' "
                    f"is sent as None (get_block_ids(allow_none=True))."
                )
                self.blocks.setdefault(r, [])
                self.blocks[r] += new_blocks or []
            pre_step = request.num_computed_tokens - out.num_scheduled_tokens[r]
            assert (c.num_computed_tokens[i], c.num_output_tokens[i]) == (
                pre_step,
                request.num_output_tokens,
            ), (
                f"{label}: {r}: (num_computed_tokens, num_output_tokens) must be the counts "
                f"before this step, ({pre_step}, {request.num_output_tokens}); got "
                f"({c.num_computed_tokens[i]}, {c.num_output_tokens[i]})."
            )
        for r in scheduled:
            assert self.blocks.get(r) == table(sched, r), (
                f"{label}: a worker that applied your deltas holds block table "
                f"{self.blocks.get(r)} for {r}, but the scheduler gave it {table(sched, r)}."
            )
            assert self.tokens.get(r) == list(sched.requests[r].all_token_ids), (
                f"{label}: a worker that applied your deltas cannot rebuild {r}'s tokens: it "
                f"has {self.tokens.get(r)}, the request has "
                f"{list(sched.requests[r].all_token_ids)}."
            )
        self.last_batch = scheduled

    def sampled(self, runner_output):
        for r, toks in zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True):
            if r in self.tokens:
                self.tokens[r] += toks


def replay(impl, workload):
    """Run a generated workload through the class under grade with a Worker
    checking every step (the same loop as mini_vllm.oracle.workload)."""
    sched = make(impl, **workload.config)
    block_size = workload.config.get("block_size", 16)
    specs = {s.req_id: s for s in workload.requests}
    arrivals = sorted(workload.requests, key=lambda s: s.arrive_step)
    worker = Worker()
    progress = Progress()
    nxt = 0
    for i in range(workload.max_steps):
        while nxt < len(arrivals) and arrivals[nxt].arrive_step <= i:
            s = arrivals[nxt]
            r = make_request(mini, s, float(workload.requests.index(s)), block_size)
            sched.add_request(r)
            nxt += 1
        aborts = sorted(s.req_id for s in workload.requests if s.abort_step == i)
        if aborts:
            sched.finish_requests(aborts, RequestStatus.FINISHED_ABORTED)
        if nxt == len(arrivals) and not sched.has_requests():
            return
        worker.running_before = {r.request_id for r in sched.running}
        out = schedule(sched, f"step {i}")
        worker.apply(out, sched, f"step {i}")
        runner = mini.make_model_runner_output(
            sched,
            out,
            lambda req: fake_token(specs[req.request_id], req.num_output_tokens, mini.EOS_TOKEN_ID),
        )
        worker.sampled(runner)
        sched.update_from_output(out, runner)
        progress.after_step(sched, i)
    raise AssertionError("the workload did not finish")


@pytest.mark.timeout(60)
@pytest.mark.points(3)
@PROPERTY
@given(workload=strategies.workloads())
def test_property_a_worker_replaying_your_deltas_stays_in_sync(finished_lab, workload):
    replay(finished_lab, workload)


@pytest.mark.timeout(60)
@pytest.mark.points(3)
@PROPERTY
@given(workload=strategies.workloads())
def test_property_same_trace_as_the_reference(finished_lab, workload):
    mismatch = checks.reference_mismatch(finished_lab.scheduler.Scheduler, workload)
    assert mismatch is None, "Your scheduler and the reference differ:\n" + mismatch


# ------------------------------------------------- upstream's recorded traces


@pytest.mark.points(1)
@pytest.mark.parametrize("scenario", ["preemption_fcfs", "preemption_priority", "chunked_prefill"])
def test_snapshot(impl, scenario):
    mismatch = checks.snapshot_mismatch(impl.scheduler.Scheduler, scenario)
    assert mismatch is None, mismatch
