"""Lab 03.6 — prefix caching in the scheduler: a head start for free.

Graded: the ``LAB 03.6`` region of ``labs/phase_03/scheduler.py``: before a
WAITING request is admitted, ask the KV cache manager for its longest
cached prefix (``get_computed_blocks``). Those tokens count as computed
before the step begins: they cost no budget and no new blocks. Every other
region holds the reference's code while this lab is graded.

Read the tests top to bottom: rule tests on tiny hand-built situations; a
measurement of what the cache saves on a shared-prefix workload (your
scheduler with caching on and off, against the reference run in the same
test); then properties (hits are real cached blocks and cost no budget;
with caching off nothing is ever saved; your scheduler against the
reference), then upstream's own recorded traces.
"""

from __future__ import annotations

import dataclasses
import traceback

import pytest
from hypothesis import given
from hypothesis import strategies as st

import mini_vllm.testing as mini
from mini_vllm.grading import checks
from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle import strategies
from mini_vllm.oracle.workload import Progress, RequestSpec, Workload, fake_token, make_request
from mini_vllm.request import RequestStatus
from mini_vllm.testing import cache_key

# What the finished_lab fixture (labs/conftest.py) runs first.
FAIL_FAST_SCENARIO = "prefix_cache_hits"
PROPERTY = lab_settings(150, shrink=True)

SHARED = [7] * 32  # two full blocks of 16


# ------------------------------------------------------------------ helpers


def make(impl, **config):
    return mini.create_scheduler(scheduler_cls=impl.scheduler.Scheduler, **config)


def req(req_id, prompt, block_size=16, **kwargs):
    (r,) = mini.create_requests(
        1, req_ids=[req_id], prompt_token_ids=[prompt], block_size=block_size, **kwargs
    )
    return r


def schedule(sched, label: str):
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


def step(sched, label: str):
    """One engine step with a fake model; returns (SchedulerOutput, EngineCoreOutputs)."""
    out = schedule(sched, label)
    result = sched.update_from_output(
        out, mini.make_model_runner_output(sched, out, lambda r: 1000 + r.num_output_tokens)
    )
    return out, result


def table(sched, req_id):
    return list(sched.kv_cache_manager.get_block_ids(req_id)[0])


def with_caching(workload: Workload, on: bool) -> Workload:
    return dataclasses.replace(workload, config={**workload.config, "enable_prefix_caching": on})


@st.composite
def shared_prefix_workloads(draw) -> Workload:
    """strategies.workloads() with caching on, every prompt behind one shared
    prefix (at least a block), and a budget cut to at most a quarter: hits
    happen often, and so do steps where the budget runs out."""
    w = draw(strategies.workloads())
    c = dict(w.config, enable_prefix_caching=True)
    low = max(c["max_num_seqs"], 1 if c["enable_chunked_prefill"] else c["max_model_len"])
    c["max_num_batched_tokens"] = draw(
        st.integers(low, max(low, c["max_num_batched_tokens"] // 4)), label="budget"
    )
    shared = draw(
        st.lists(st.integers(1, 999), min_size=c["block_size"], max_size=64), label="shared prefix"
    )
    reqs = []
    for s in w.requests:
        prompt = (shared + s.prompt_token_ids)[: c["max_model_len"] - 1]
        reqs.append(
            dataclasses.replace(
                s,
                prompt_token_ids=prompt,
                min_tokens=min(s.min_tokens, c["max_model_len"] - len(prompt)),
            )
        )
    return dataclasses.replace(w, config=c, requests=reqs)


# ------------------------------------------- 1. the head start, by hand


def cache_shared_prefix(impl, **config):
    """A scheduler in which `a` (SHARED + 4 tokens, 1 output) has run and
    finished: its two SHARED blocks stay in the prefix cache (freed, not
    erased). Returns the scheduler and a's block table."""
    sched = make(impl, max_model_len=256, **config)
    a = req("a", SHARED + [1] * 4, max_tokens=1)
    sched.add_request(a)
    out, _ = step(sched, "step 0 (a computes its 36 tokens)")
    a_table = list(out.scheduled_new_reqs[0].block_ids[0])
    progress = Progress()
    while sched.has_requests():
        step(sched, "a finishing")
        progress.after_step(sched, 1)
    assert a.is_finished(), "setup: a should have finished"
    return sched, a_table


@pytest.mark.points(3)
def test_cached_prefix_counts_as_computed(impl):
    sched, a_table = cache_shared_prefix(impl)
    b = req("b", SHARED + [2] * 5)
    sched.add_request(b)
    out = schedule(sched, "b's first step")
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 32, (
        f"b's first 32 tokens are the 2 full blocks a left in the prefix cache. "
        f"get_computed_blocks(b) finds them, and they count as computed BEFORE the step: "
        f"num_computed_tokens = num_new_local_computed_tokens = 32. The workers were told "
        f"b starts at {new.num_computed_tokens}."
    )
    assert out.num_scheduled_tokens.get("b") == 5, (
        f"b has 37 tokens, 32 of them cached: only the 5 uncached ones are computed this step "
        f"(num_new_tokens = num_tokens - num_computed_tokens). Expected 5 scheduled, got "
        f"{out.num_scheduled_tokens.get('b')}."
    )
    assert table(sched, "b")[:2] == a_table[:2], (
        f"A hit REUSES the cached blocks themselves (pass new_computed_blocks to "
        f"allocate_slots): b's table must start with a's blocks {a_table[:2]}; got "
        f"{table(sched, 'b')}."
    )
    assert len(table(sched, "b")) == 3, (
        f"b's 37 tokens need 3 blocks of 16: the 2 cached ones plus 1 new one for tokens "
        f"32..36. allocate_slots must be told both the hit blocks (new_computed_blocks) and how "
        f"many tokens they cover (num_new_computed_tokens) to count the slots right; b holds "
        f"{table(sched, 'b')}."
    )


@pytest.mark.points(2)
def test_cached_tokens_cost_no_budget(impl):
    sched, _ = cache_shared_prefix(impl, max_num_batched_tokens=24)
    b = req("b", SHARED + [2] * 8)
    c = req("c", [3] * 16)
    sched.add_request(b)
    sched.add_request(c)
    out = schedule(sched, "b and c arrive (budget 24)")
    got = dict(out.num_scheduled_tokens)
    assert got == {"b": 8, "c": 16}, (
        f"Budget 24. b has 40 tokens, 32 of them cached: it costs 8. c (16 tokens, nothing "
        f"cached) gets the 16 left. Expected {{'b': 8, 'c': 16}} (both prompts done in one "
        f"step), got {got}. Cached tokens are not computed, so they are never charged to "
        f"token_budget and never counted in num_new_tokens."
    )


@pytest.mark.points(1)
def test_the_last_token_is_always_computed(impl):
    sched, _ = cache_shared_prefix(impl)
    d = req("d", list(SHARED))
    sched.add_request(d)
    out = schedule(sched, "d's first step")
    (new,) = out.scheduled_new_reqs
    assert (new.num_computed_tokens, out.num_scheduled_tokens.get("d")) == (16, 16), (
        f"d's prompt is exactly SHARED, 2 full cached blocks. The model needs the logits of "
        f"d's LAST prompt token to sample its first output, so at most num_tokens - 1 tokens "
        f"may hit: only the first block counts (get_computed_blocks already applies this "
        f"rule). Expected 16 computed + 16 scheduled, got {new.num_computed_tokens} computed "
        f"+ {out.num_scheduled_tokens.get('d')} scheduled."
    )


@pytest.mark.points(2)
def test_a_preempted_request_hits_its_own_freed_blocks(impl):
    # FCFS, 7 usable blocks of 4 tokens. c is preempted at step 5 and comes
    # back at step 6; its first block (its prompt) is still in the cache.
    sched = make(
        impl,
        block_size=4,
        num_blocks=8,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=24,
    )
    reqs = [
        req(x, [10 * (i + 1) + j for j in range(4)], block_size=4, max_tokens=n, ignore_eos=True)
        for i, (x, n) in enumerate([("a", 16), ("b", 6), ("c", 10)])
    ]
    for r in reqs:
        sched.add_request(r)
    for i in range(6):
        out, _ = step(sched, f"step {i}")
    c = reqs[2]
    assert out.preempted_req_ids == {"c"}, (
        f"setup: step 5 should preempt c; got {out.preempted_req_ids}"
    )
    out, result = step(sched, "step 6 (c comes back)")
    cached = out.scheduled_cached_reqs
    assert "c" in cached.resumed_req_ids, f"setup: c should be resumed at step 6: {cached}"
    computed = cached.num_computed_tokens[cached.req_ids.index("c")]
    assert (computed, out.num_scheduled_tokens.get("c")) == (4, 5), (
        f"Step 6: c (9 tokens: prompt 4 + 5 outputs) is admitted again after preemption. Its "
        f"freed blocks stay in the prefix cache until reused, and its first block (the prompt) "
        f"still is: the lookup runs for EVERY waiting request, resumed ones too, so c restarts "
        f"from 4 computed tokens and recomputes 5. Got {computed} computed, "
        f"{out.num_scheduled_tokens.get('c')} scheduled."
    )
    stats = result.scheduler_stats.prefix_cache_stats
    assert (stats.preempted_requests, stats.preempted_hits) == (1, 4), (
        f"Step 6: the lookup for a preempted request is counted apart (preempted_requests, "
        f"preempted_hits), so it does not flatter the hit rate: expected (1, 4), got "
        f"({stats.preempted_requests}, {stats.preempted_hits})."
    )
    assert c.num_preemptions == 1


# --------------------------------------- 2. measure what the cache saves

SYSTEM = [(7 * i) % 97 + 1 for i in range(64)]  # a 64-token "system prompt": 4 blocks


def shared_prefix_workload(caching: bool) -> Workload:
    """8 requests: the same 64-token system prompt + 16 tokens of their own,
    4 output tokens each; four arrive at step 0, four at step 3."""
    specs = [
        RequestSpec(
            f"r{i}",
            SYSTEM + [200 + 16 * i + j for j in range(16)],
            max_tokens=4,
            ignore_eos=True,
            arrive_step=0 if i < 4 else 3,
        )
        for i in range(8)
    ]
    return Workload(
        "shared_prefix",
        dict(
            block_size=16,
            num_blocks=64,
            max_num_batched_tokens=512,
            max_num_seqs=8,
            max_model_len=256,
            enable_prefix_caching=caching,
        ),
        specs,
    )


def drive(scheduler_cls, workload: Workload, on_step=None) -> dict:
    """Run a workload (the loop of mini_vllm.oracle.workload) and total what
    was computed and what the prefix cache reported."""
    sched = mini.create_scheduler(**workload.config, scheduler_cls=scheduler_cls)
    block_size = workload.config.get("block_size", 16)
    specs = {s.req_id: s for s in workload.requests}
    arrivals = sorted(workload.requests, key=lambda s: s.arrive_step)
    t = dict(computed=0, hits=0, queries=0, requests=0, preempted_hits=0, steps=0)
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
            return t
        waiting_before = {r.request_id for r in sched.waiting}
        out = schedule(sched, f"step {i}")
        runner = mini.make_model_runner_output(
            sched,
            out,
            lambda r: fake_token(specs[r.request_id], r.num_output_tokens, mini.EOS_TOKEN_ID),
        )
        if on_step is not None:
            on_step(i, sched, out, waiting_before)
        result = sched.update_from_output(out, runner)
        progress.after_step(sched, i)
        stats = result.scheduler_stats.prefix_cache_stats
        t["computed"] += out.total_num_scheduled_tokens
        t["hits"] += stats.hits
        t["queries"] += stats.queries
        t["requests"] += stats.requests
        t["preempted_hits"] += stats.preempted_hits
        t["steps"] += 1
    raise AssertionError(f"workload {workload.name!r} did not finish")


@pytest.mark.points(4)
def test_measure_the_prefix_cache_savings(impl):
    cls = impl.scheduler.Scheduler
    ref_on = drive(None, shared_prefix_workload(True))
    ref_off = drive(None, shared_prefix_workload(False))
    yours_on = drive(cls, shared_prefix_workload(True))
    yours_off = drive(cls, shared_prefix_workload(False))
    ref_saved = ref_off["computed"] - ref_on["computed"]
    saved = yours_off["computed"] - yours_on["computed"]
    story = (
        f"8 requests share a 64-token system prompt (+16 tokens each, 4 outputs; 4 arrive at "
        f"step 0, 4 at step 3). The reference computes {ref_off['computed']} tokens with "
        f"caching off and {ref_on['computed']} with it on: the cache saves {ref_saved} "
        f"tokens ({100 * ref_saved / ref_off['computed']:.0f}% of the work), exactly the "
        f"{ref_on['hits']} hit tokens of {ref_on['queries']} looked up. Yours computes "
        f"{yours_off['computed']} off and {yours_on['computed']} on (saves {saved}); your "
        f"cache reports {yours_on['hits']} hit tokens of {yours_on['queries']} looked up "
        f"in {yours_on['requests']} lookups. "
    )
    assert ref_saved > 0 and ref_saved == ref_on["hits"], "the reference must save (sanity)"
    assert (
        yours_on["requests"] == ref_on["requests"] and yours_on["queries"] == ref_on["queries"]
    ), (
        story + "Every waiting request considered for admission is looked up once with "
        "kv_cache_manager.get_computed_blocks(request), which also records the lookup in the "
        "prefix-cache stats; your lookups do not match."
    )
    assert yours_on["hits"] == ref_on["hits"], (
        story + "Your lookups found a different number of cached tokens."
    )
    assert saved == yours_on["hits"], (
        story + "Your cache FOUND the hits but your scheduler still computed them: every hit "
        "token must count as computed (num_computed_tokens starts at the hit length), so it "
        "is never scheduled."
    )
    assert yours_on["computed"] == ref_on["computed"] and saved == ref_saved, (
        story + "With caching on you must compute exactly what the reference computes."
    )
    assert yours_off["hits"] == 0 and yours_off["computed"] == ref_off["computed"], (
        story + "With caching off nothing can hit: every token is computed."
    )


# ---------------------------------------------------------------- properties


def admissions(out, waiting_before):
    """(req_id, num_computed_tokens at admission) of the requests admitted this step."""
    got = [(d.req_id, d.num_computed_tokens) for d in out.scheduled_new_reqs]
    c = out.scheduled_cached_reqs
    got += [
        (r, n) for r, n in zip(c.req_ids, c.num_computed_tokens, strict=True) if r in waiting_before
    ]
    return got


def check_hits(i, sched, out, waiting_before):
    bs = sched.block_size
    cfg = sched.scheduler_config
    budget = sched.max_num_scheduled_tokens
    for req_id, computed in admissions(out, waiting_before):
        r = sched.requests[req_id]
        n = out.num_scheduled_tokens[req_id]
        where = (
            f"step {i}: {req_id} ({r.num_tokens} tokens, block_size {bs}) was admitted "
            f"with {computed} cached tokens and {n} scheduled"
        )
        assert computed % bs == 0 and computed <= r.num_tokens - 1, (
            f"{where}: a hit is whole blocks and never the last token (at most num_tokens - 1 "
            f"tokens may hit)."
        )
        if not sched.cache_config.enable_prefix_caching:
            assert computed == 0, f"{where}, but prefix caching is OFF: nothing can hit."
        blocks = sched.kv_cache_manager.req_to_blocks[req_id]
        for j in range(computed // bs):
            assert blocks[j].block_hash == cache_key(r.block_hashes[j]), (
                f"{where}: its block {j} (id {blocks[j].block_id}) is not a cached block "
                f"holding its own tokens {j * bs}..{(j + 1) * bs - 1}: hits must be the blocks "
                f"get_computed_blocks returned."
            )
        assert computed + n <= r.num_tokens, f"{where}: more than its {r.num_tokens} tokens."
        if computed + n < r.num_tokens:
            threshold = cfg.long_prefill_token_threshold
            assert n == threshold or out.total_num_scheduled_tokens == budget, (
                f"{where}, so its prefill was cut short; only the long-prefill threshold "
                f"({threshold}) or a spent budget may do that, but the step scheduled "
                f"{out.total_num_scheduled_tokens} of {budget} tokens. Were the cached tokens "
                f"charged to the budget?"
            )


@pytest.mark.timeout(60)
@pytest.mark.points(3)
@PROPERTY
@given(workload=shared_prefix_workloads())
def test_property_hits_are_cached_blocks_and_cost_no_budget(finished_lab, workload):
    drive(finished_lab.scheduler.Scheduler, workload, on_step=check_hits)


@pytest.mark.timeout(60)
@pytest.mark.points(2)
@PROPERTY
@given(workload=strategies.workloads().map(lambda w: with_caching(w, False)))
def test_property_caching_off_never_saves(finished_lab, workload):
    t = drive(finished_lab.scheduler.Scheduler, workload, on_step=check_hits)
    assert t["hits"] == t["preempted_hits"] == 0, (
        f"Prefix caching is OFF, yet the stats report {t['hits']} hit tokens "
        f"(+{t['preempted_hits']} for preempted requests)."
    )


@pytest.mark.timeout(60)
@pytest.mark.points(3)
@PROPERTY
@given(workload=shared_prefix_workloads())
def test_property_same_trace_as_the_reference(finished_lab, workload):
    mismatch = checks.reference_mismatch(finished_lab.scheduler.Scheduler, workload)
    assert mismatch is None, "Your scheduler and the reference differ:\n" + mismatch


# ------------------------------------------------- upstream's recorded traces


@pytest.mark.points(1)
@pytest.mark.parametrize("scenario", ["prefix_cache_hits", "prefix_cache_off"])
def test_snapshot(impl, scenario):
    mismatch = checks.snapshot_mismatch(impl.scheduler.Scheduler, scenario)
    assert mismatch is None, mismatch
