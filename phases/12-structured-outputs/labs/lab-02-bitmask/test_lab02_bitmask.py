"""Lab 12.2 — the bitmask for a batch.

Graded: the ``LAB 12.2`` regions: ``Scheduler.get_grammar_bitmask``
(``labs/phase_12/scheduler.py``: which requests get rows, in scheduled
order) and, in ``labs/phase_12/structured_output.py``,
``StructuredOutputManager._fill_bitmasks`` (a row: the grammar's allowed
tokens, or all ones) and the row loop of ``grammar_bitmask`` (one row per
draft, then one; draft row i is the mask after drafts 0..i-1; the grammar
left as it was found).

Every grammar is compiled against SmolLM2's tokenizer (49152 tokens, 1536
int32 words a row). A row's expected value is the row a brand-new xgrammar
matcher on the same compiled grammar fills after the same tokens
(``fresh_row`` in mini_vllm/oracle/structured_workload.py), or all ones
(-1 words) for a grammar that terminated. Then, marked ``upstream``, your
manager against upstream's ``StructuredOutputManager.grammar_bitmask``
(vllm/v1/structured_output/__init__.py:204) on the workload of
tests/upstream/test_structured_output_lockstep.py, and your scheduler's
``get_grammar_bitmask`` against upstream's Scheduler's, step by step, bit
for bit.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import mini_vllm.testing as mini
from mini_vllm.grading.checks import written
from mini_vllm.oracle.structured_workload import (
    CONSTRAINTS,
    NUM_SPEC,
    STEPS,
    bitmask_steps,
    compiled,
    fresh_row,
    walk,
)

REGEX = {"regex": "[a-c]{4,12}"}
# For the scheduler scenario: languages a walk never ends within its length.
LONG = {
    "letters": {"regex": "[a-c]{12,60}"},
    "sum": {"grammar": 'root ::= [0-9]+ ("+" [0-9]+)*'},
    "json": {
        "json": {
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 60}},
            "required": ["text"],
        }
    },
}


def call(where: str, hint: str, fn, *args):
    """``fn(*args)`` (your code); an exception it raises fails the test with
    ``where`` and ``hint`` (an unwritten region fails as not written)."""
    try:
        return written(fn, *args)
    except (AssertionError, AttributeError, IndexError, KeyError, RuntimeError, TypeError) as e:
        pytest.fail(f"{where}: {fn.__name__} raised {type(e).__name__}: {e}. {hint}", pytrace=False)


TERMINATED_HINT = (
    "A grammar that terminated gets a row of all ones (xgrammar will not fill a row for it) "
    "and takes no more drafts."
)


DRAFT_HINT = (
    "Row i of a request's drafts is the mask after its drafts 0..i-1 (fill, then accept the "
    "draft); afterwards roll the grammar back by the drafts it accepted."
)


def manager(tokenizer, num_spec: int | None = None, manager_cls=None):
    """A StructuredOutputManager (the reference's, or ``manager_cls``) over
    SmolLM2's vocabulary, room for 8 requests."""
    return mini.create_structured_output_manager(
        tokenizer, max_num_seqs=8, num_speculative_tokens=num_spec, manager_cls=manager_cls
    )


def yours(impl, tokenizer, num_spec=None):
    return manager(tokenizer, num_spec, impl.structured_output.StructuredOutputManager)


def ctx_of(request):
    return request.structured_output_request.grammar.ctx


def grammar_of(request):
    return request.structured_output_request.grammar


def row_problem(got: np.ndarray, want: np.ndarray, what: str) -> str | None:
    """None if the rows are equal, else a sentence saying how they differ."""
    if np.array_equal(got, want):
        return None
    if (want == -1).all():
        return (
            f"{what} should be all ones (-1 in every word); {int((got != -1).sum())} words aren't"
        )
    if (got == -1).all():
        return f"{what} is all ones, but the grammar allows only some tokens there"
    words = int((got != want).sum())
    return f"{what} differs from a fresh xgrammar matcher's row in {words} of {want.size} words"


def terminated_choice(mgr, tokenizer, req_id="done"):
    """A request whose grammar (the choice "no") has taken "no" and EOS."""
    request = compiled(mini, mgr, req_id, {"choice": ["no"]})
    assert grammar_of(request).accept_tokens(req_id, tokenizer.encode("no"))
    assert grammar_of(request).accept_tokens(req_id, [tokenizer.eos_token_id])
    assert grammar_of(request).is_terminated()
    return request


# ------------------------------------------------------------------ the manager


@pytest.mark.points(4)
def test_fill_bitmasks_writes_the_grammars_row_or_all_ones(impl, tokenizer):
    mgr = yours(impl, tokenizer)
    live = compiled(mini, mgr, "live", REGEX)
    done = terminated_choice(mgr, tokenizer)
    bitmask = mgr.backend.allocate_token_bitmask(4)
    bitmask.fill_(0)  # a row left alone stays 0
    mgr._grammar_bitmask = bitmask
    batch = [(grammar_of(live), 2, True), (grammar_of(done), 0, True), (grammar_of(live), 1, False)]
    call(
        "_fill_bitmasks, a batch with a terminated grammar",
        TERMINATED_HINT,
        mgr._fill_bitmasks,
        batch,
    )
    rows = bitmask.numpy()
    for index, want, what in [
        (2, fresh_row(ctx_of(live), len(tokenizer)), "row 2 (a live grammar, apply True)"),
        (0, np.full_like(rows[0], -1), "row 0 (a terminated grammar, apply True)"),
        (1, np.full_like(rows[1], -1), "row 1 (a live grammar, apply False: not to constrain)"),
        (3, np.zeros_like(rows[3]), "row 3 (not in the batch: left alone)"),
    ]:
        problem = row_problem(rows[index], want, what)
        assert problem is None, (
            f"_fill_bitmasks({[(g.__class__.__name__, i, a) for g, i, a in batch]}): {problem}. "
            "Each (grammar, row, apply) writes row `row`: the grammar's fill_bitmask when apply "
            "is True and the grammar has not terminated, else all ones (self._full_mask)."
        )


@pytest.mark.points(3)
def test_one_row_per_request_in_the_order_given(impl, tokenizer):
    mgr = yours(impl, tokenizer)
    rng = random.Random(3)
    requests, prefixes = {}, {}
    for name in ("regex", "choice", "grammar"):
        requests[name] = compiled(mini, mgr, name, CONSTRAINTS[name])
        prefixes[name] = walk(ctx_of(requests[name]), len(tokenizer), rng, 2)
        assert grammar_of(requests[name]).accept_tokens(name, prefixes[name])
    order = ["grammar", "regex", "choice"]
    got = call(f"order {order}", TERMINATED_HINT, mgr.grammar_bitmask, requests, order, {})
    assert got.dtype == np.int32 and got.shape == (3, (len(tokenizer) + 31) // 32), (
        f"three requests, no drafts: want an int32 array of 3 rows of 1536 words, got "
        f"{got.dtype} {got.shape}."
    )
    for i, name in enumerate(order):
        want = fresh_row(ctx_of(requests[name]), len(tokenizer), prefixes[name])
        problem = row_problem(
            got[i], want, f"row {i} ({name!r}, after its tokens {prefixes[name]})"
        )
        assert problem is None, (
            f"grammar_bitmask(order {order}, no drafts): {problem}. Rows follow "
            "structured_output_request_ids, one per request."
        )


@pytest.mark.points(4)
def test_draft_rows_are_the_masks_after_the_drafts_before_them(impl, tokenizer):
    mgr = yours(impl, tokenizer, num_spec=NUM_SPEC)
    rng = random.Random(5)
    a = compiled(mini, mgr, "a", CONSTRAINTS["grammar"])
    b = compiled(mini, mgr, "b", REGEX)
    history = walk(ctx_of(a), len(tokenizer), rng, 3)
    assert grammar_of(a).accept_tokens("a", history[:1])
    drafts = history[1:3]
    got = call(
        f"a's drafts {drafts}",
        DRAFT_HINT,
        mgr.grammar_bitmask,
        {"a": a, "b": b},
        ["a", "b"],
        {"a": drafts},
    )
    assert got.shape[0] == 4, (
        f"a verifies {len(drafts)} drafts (3 rows: one per draft, then one), b none (1 row): "
        f"want 4 rows, got {got.shape[0]}."
    )
    expected = [
        (history[:1], "row 0 (checks a's first draft: the mask after a's own token)"),
        (history[:2], "row 1 (checks a's second draft: the mask after the first draft)"),
        (history[:3], "row 2 (the token after both drafts: the mask after both)"),
    ]
    for i, (prefix, what) in enumerate(expected):
        problem = row_problem(got[i], fresh_row(ctx_of(a), len(tokenizer), prefix), what)
        assert problem is None, (
            f"a has taken {history[:1]} and verifies drafts {drafts}: {problem}. Fill the row, "
            "THEN accept the draft into the grammar, so row i is the mask after drafts 0..i-1."
        )
    problem = row_problem(got[3], fresh_row(ctx_of(b), len(tokenizer)), "row 3 (b, no drafts)")
    assert problem is None, f"{problem}: b's row follows a's three."


@pytest.mark.points(4)
def test_the_grammar_is_left_as_it_was(impl, tokenizer):
    mgr = yours(impl, tokenizer, num_spec=NUM_SPEC)
    rng = random.Random(7)
    a = compiled(mini, mgr, "a", CONSTRAINTS["json"])
    history = walk(ctx_of(a), len(tokenizer), rng, 4)
    assert grammar_of(a).accept_tokens("a", history[:2])
    first = call(
        "a with 2 drafts", DRAFT_HINT, mgr.grammar_bitmask, {"a": a}, ["a"], {"a": history[2:4]}
    )
    first = first.copy()
    grammar = grammar_of(a)
    assert grammar.num_processed_tokens == 2, (
        f"a's grammar had taken 2 tokens; after grammar_bitmask walked its 2 drafts it has "
        f"taken {grammar.num_processed_tokens}. Roll the grammar back by as many drafts as it "
        "accepted, so that the tokens the model really samples go in from where it was."
    )
    again = call(
        "a again, the same 2 drafts",
        DRAFT_HINT,
        mgr.grammar_bitmask,
        {"a": a},
        ["a"],
        {"a": history[2:4]},
    )
    assert np.array_equal(first, again), (
        "the same call twice gave different rows: the first left the grammar moved"
    )
    row = fresh_row(ctx_of(a), len(tokenizer), history[:2])
    alone = call("a without drafts", DRAFT_HINT, mgr.grammar_bitmask, {"a": a}, ["a"], {})
    assert np.array_equal(alone[0], row), (
        "after a call with drafts, a call without them must give the row after a's own 2 tokens"
    )


@pytest.mark.points(3)
def test_a_draft_that_ends_the_grammar(impl, tokenizer):
    mgr = yours(impl, tokenizer, num_spec=NUM_SPEC)
    a = compiled(mini, mgr, "a", {"choice": ["no"]})
    done = terminated_choice(mgr, tokenizer)
    no = tokenizer.encode("no")
    assert len(no) == 1, no
    drafts = [no[0], tokenizer.eos_token_id]  # "no", then the end
    got = call(
        "grammar_bitmask(order ['done', 'a'], a's drafts ['no', EOS])",
        TERMINATED_HINT,
        mgr.grammar_bitmask,
        {"a": a, "done": done},
        ["done", "a"],
        {"a": drafts},
    )
    ones = np.full(got.shape[1], -1, np.int32)
    walk_hint = "Row i of a's drafts is the mask after drafts 0..i-1: fill, then accept."
    expected = [
        (ones, "row 0 (done: its grammar already terminated)", TERMINATED_HINT),
        (fresh_row(ctx_of(a), len(tokenizer)), "row 1 (a, checks the draft 'no')", walk_hint),
        (fresh_row(ctx_of(a), len(tokenizer), no), "row 2 (a after 'no': EOS only)", walk_hint),
        (ones, "row 3 (a after the draft EOS ended its grammar)", TERMINATED_HINT),
    ]
    assert got.shape[0] == len(expected), f"want {len(expected)} rows, got {got.shape[0]}"
    for i, (want, what, hint) in enumerate(expected):
        problem = row_problem(got[i], want, what)
        assert problem is None, f"order ['done', 'a'], a's drafts ['no', EOS]: {problem}. {hint}"
    assert not grammar_of(a).is_terminated() and grammar_of(a).num_processed_tokens == 0, (
        "a's drafts ended its grammar while the rows were built; afterwards it must be back "
        "where it was (not terminated, no token taken)."
    )
    # A draft after the one that ends the grammar: a takes "no" (now only EOS is
    # allowed) and verifies the drafts [EOS, "no"]. EOS ends the grammar; "no" is not
    # fed to it (a terminated grammar refuses every token), so its row and the bonus
    # row are all ones, and the rollback undoes EOS alone.
    assert grammar_of(a).accept_tokens("a", no)
    where = "grammar_bitmask(order ['a'], a has taken 'no', its drafts [EOS, 'no'])"
    got = call(
        where,
        TERMINATED_HINT,
        mgr.grammar_bitmask,
        {"a": a},
        ["a"],
        {"a": [tokenizer.eos_token_id, no[0]]},
    )
    expected = [
        (fresh_row(ctx_of(a), len(tokenizer), no), "row 0 (checks the draft EOS)", walk_hint),
        (ones, "row 1 (checks the draft 'no': EOS ended the grammar)", TERMINATED_HINT),
        (ones, "row 2 (the token after both drafts)", TERMINATED_HINT),
    ]
    assert got.shape[0] == len(expected), f"{where}: want 3 rows, got {got.shape[0]}"
    for i, (want, what, hint) in enumerate(expected):
        problem = row_problem(got[i], want, what)
        assert problem is None, f"{where}: {problem}. {hint}"
    assert not grammar_of(a).is_terminated() and grammar_of(a).num_processed_tokens == 1, (
        f"{where}: afterwards the grammar must be where it was (not terminated, 1 token "
        f"taken); it has taken {grammar_of(a).num_processed_tokens} (terminated: "
        f"{grammar_of(a).is_terminated()}). A draft after the grammar terminated is neither "
        "accepted nor counted for the rollback."
    )


# ------------------------------------------------------------------ the scheduler


class Scenario:
    """A PRIORITY scheduler with five requests, driven step by step with
    valid tokens: x (priority 2), m (0), b (1), structured, 3-token prompts;
    p (0), plain; long (3), structured with a 30-token prompt the 16-token
    budget cuts into chunks. Structured requests sample from their walk and
    get its next tokens as 2 drafts; the runner accepts every draft.

    Admission order (priority, then arrival) m, p, b, x, long differs from
    arrival order x, m, b, p, long and from sorted ids b, long, m, p, x."""

    SPECS = [
        ("x", 2, "letters", 3),
        ("m", 0, "sum", 3),
        ("b", 1, "json", 3),
        ("p", 0, None, 3),
        ("long", 3, "letters", 30),
    ]
    CONFIG = dict(
        block_size=4,
        num_blocks=64,
        max_num_batched_tokens=16,
        max_model_len=64,
        max_num_seqs=8,
        policy="priority",
        num_speculative_tokens=NUM_SPEC,
    )

    def __init__(self, backend, sched, mgr, tokenizer):
        self.backend, self.sched = backend, sched
        sched.structured_output_manager = mgr
        rng = random.Random(11)
        self.histories = {}
        for i, (req_id, priority, kind, length) in enumerate(self.SPECS):
            prompt = [100 + 10 * i + j for j in range(length)]
            extra = dict(
                priorities=[priority], arrival_times=[float(i)], max_tokens=5, block_size=4
            )
            if kind is None:
                (request,) = backend.create_requests(
                    1, req_ids=[req_id], prompt_token_ids=[prompt], **extra
                )
            else:
                request = compiled(backend, mgr, req_id, LONG[kind], prompt=prompt, **extra)
                self.histories[req_id] = walk(
                    ctx_of(request), len(tokenizer), rng, 12, avoid={tokenizer.eos_token_id}
                )
            sched.add_request(request)

    def structured_rows(self, out) -> tuple[list[str], list[tuple[str, list[int]]]]:
        """By the rule: the structured requests scheduled this step that sample
        (not mid-prefill), in scheduled order; and for each row, whose it is
        and the tokens its grammar has taken before it."""
        ids, rows = [], []
        for req_id in out.num_scheduled_tokens:
            request = self.sched.requests[req_id]
            if req_id not in self.histories or request.is_prefill_chunk:
                continue
            ids.append(req_id)
            taken = self.histories[req_id][: request.num_output_tokens]
            drafts = list(out.scheduled_spec_decode_tokens.get(req_id, []))
            rows += [(req_id, taken + drafts[:i]) for i in range(len(drafts) + 1)]
        return ids, rows

    def finish_step(self, out) -> None:
        """The runner's tokens (drafts all accepted), then fresh drafts."""
        sched, req_ids, sampled = self.sched, list(out.num_scheduled_tokens), []
        for req_id in req_ids:
            request = sched.requests[req_id]
            if request.num_computed_tokens < request.num_tokens:
                sampled.append([])
                continue
            n = len(out.scheduled_spec_decode_tokens.get(req_id, [])) + 1
            history = self.histories.get(req_id, [7] * 20)
            sampled.append(history[request.num_output_tokens : request.num_output_tokens + n])
        sched.update_from_output(
            out,
            self.backend.ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
            ),
        )
        drafts = {}
        for req_id in req_ids:
            request = sched.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            n = request.num_output_tokens
            drafts[req_id] = self.histories.get(req_id, [7] * 20)[n : n + NUM_SPEC]
        sched.update_draft_token_ids(
            self.backend.DraftTokenIds(list(drafts), list(drafts.values()))
        )


ROWS_HINT = (
    "Rows go to the structured requests (use_structured_output: a plain request has no "
    "grammar) scheduled this step that sample (not is_prefill_chunk), in scheduled order."
)


def your_scenario(impl, mgr, tokenizer) -> Scenario:
    sched = mini.create_scheduler(scheduler_cls=impl.scheduler.Scheduler, **Scenario.CONFIG)
    return Scenario(mini, sched, mgr, tokenizer)


@pytest.mark.points(4)
def test_get_grammar_bitmask_rows_follow_the_scheduled_order(impl, tokenizer):
    # The reference's manager fills the rows: only your get_grammar_bitmask is graded here.
    scenario = your_scenario(impl, manager(tokenizer, NUM_SPEC), tokenizer)
    sched, seen = scenario.sched, {"chunk": 0, "drafts": 0}
    for step in range(8):
        if not sched.has_requests():
            break
        out = sched.schedule()
        want_ids, want_rows = scenario.structured_rows(out)
        scheduled = list(out.num_scheduled_tokens)
        chunked = [r for r in scheduled if sched.requests[r].is_prefill_chunk]
        where = f"step {step} (scheduled in order {scheduled}; still mid-prefill: {chunked})"
        got = call(where, ROWS_HINT, sched.get_grammar_bitmask, out)
        if not want_ids:
            assert got is None, f"{where}: no structured request samples: want None, got rows"
        else:
            got_ids = None if got is None else list(got.structured_output_request_ids)
            assert got_ids == want_ids, (
                f"{where}: rows belong to {got_ids}, want {want_ids}. {ROWS_HINT}"
            )
            assert got.grammar_bitmask.shape[0] == len(want_rows), (
                f"{where}: {got.grammar_bitmask.shape[0]} rows, want {len(want_rows)}"
            )
            for i, (req_id, prefix) in enumerate(want_rows):
                request = sched.requests[req_id]
                want = fresh_row(ctx_of(request), len(tokenizer), prefix)
                problem = row_problem(got.grammar_bitmask[i], want, f"row {i} ({req_id!r})")
                assert problem is None, f"{where}: {problem}."
        seen["chunk"] += bool(chunked and [r for r in chunked if r in scenario.histories])
        seen["drafts"] += bool(out.scheduled_spec_decode_tokens)
        scenario.finish_step(out)
    assert seen["chunk"] and seen["drafts"], seen  # the scenario reached both cases


@pytest.mark.points(2)
def test_get_grammar_bitmask_is_none_when_no_structured_request_samples(impl, tokenizer):
    config = {**Scenario.CONFIG, "num_speculative_tokens": None, "long_prefill_token_threshold": 8}
    sched = mini.create_scheduler(scheduler_cls=impl.scheduler.Scheduler, **config)
    mgr = manager(tokenizer)
    sched.structured_output_manager = mgr
    (plain,) = mini.create_requests(1, req_ids=["plain"], prompt_token_ids=[[1, 2, 3]])
    long = compiled(mini, mgr, "long", REGEX, prompt=list(range(1, 41)), block_size=4)
    sched.add_request(plain)
    sched.add_request(long)
    out = sched.schedule()
    assert long.is_prefill_chunk and "plain" in out.num_scheduled_tokens
    got = call("step 0", ROWS_HINT, sched.get_grammar_bitmask, out)
    assert got is None, (
        "step 0: the plain request samples, the structured one is mid-prefill (8 of 40 prompt "
        f"tokens): no row for either, so get_grammar_bitmask returns None; got {got}."
    )


# ------------------------------------------------------------------ against upstream


@pytest.mark.upstream
@pytest.mark.points(3)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [0, 1])
def test_grammar_bitmask_equals_upstreams_bit_for_bit(impl, up, tokenizer, up_manager, seed):
    rng = random.Random(seed)
    mgr = yours(impl, tokenizer, num_spec=NUM_SPEC)
    mine, theirs, histories = {}, {}, {}
    for name, constraint in CONSTRAINTS.items():
        mine[name] = compiled(mini, mgr, f"{name}", constraint)
        theirs[name] = compiled(up, up_manager, f"{name}", constraint)
        histories[name] = walk(ctx_of(mine[name]), len(tokenizer), rng, STEPS + NUM_SPEC)
    for step, order, drafts in bitmask_steps(mine, theirs, histories, rng):
        got = call(f"step {step}", TERMINATED_HINT, mgr.grammar_bitmask, mine, order, drafts)
        want = up_manager.grammar_bitmask(theirs, order, drafts)
        assert got.shape == want.shape, (
            f"step {step}: order {order}, drafts {drafts}: {got.shape[0]} rows, upstream "
            f"{want.shape[0]} (one per draft, then one, for each request)"
        )
        if not np.array_equal(got, want):
            row = int(np.flatnonzero((got != want).any(axis=1))[0])
            owners = [n for n in order for _ in range(len(drafts.get(n, [])) + 1)]
            terminated = grammar_of(mine[owners[row]]).is_terminated()
            pytest.fail(
                f"step {step}: row {row} (request {owners[row]!r}, "
                f"{'terminated' if terminated else 'live'}) differs from upstream's in "
                f"{int((got[row] != want[row]).sum())} of {got.shape[1]} words. Order {order}, "
                f"drafts {drafts}.",
                pytrace=False,
            )


@pytest.mark.upstream
@pytest.mark.points(5)
@pytest.mark.timeout(60)
def test_get_grammar_bitmask_equals_upstreams_scheduler(impl, up, tokenizer, up_manager):
    mine = your_scenario(impl, yours(impl, tokenizer, NUM_SPEC), tokenizer)
    theirs = Scenario(up, up.create_scheduler(**Scenario.CONFIG), up_manager, tokenizer)
    step = 0
    while theirs.sched.has_requests() and step < 12:
        out_u, out_m = theirs.sched.schedule(), mine.sched.schedule()
        assert list(out_m.num_scheduled_tokens.items()) == list(
            out_u.num_scheduled_tokens.items()
        ), f"step {step}: the two schedulers scheduled differently (outside this lab's regions)"
        want = theirs.sched.get_grammar_bitmask(out_u)
        where = f"step {step} (scheduled {list(out_u.num_scheduled_tokens)})"
        got = call(where, ROWS_HINT, mine.sched.get_grammar_bitmask, out_m)
        if want is None:
            assert got is None, f"{where}: upstream returns None, yours returned rows"
        else:
            assert got is not None, (
                f"{where}: yours returned None, upstream's rows are for "
                f"{want.structured_output_request_ids}"
            )
            assert list(got.structured_output_request_ids) == list(
                want.structured_output_request_ids
            ), (
                f"{where}: rows for {got.structured_output_request_ids}, upstream "
                f"{want.structured_output_request_ids}"
            )
            g, w = got.grammar_bitmask, want.grammar_bitmask
            assert g.shape == w.shape and np.array_equal(g, w), (
                f"{where}: the bitmask differs from upstream's (shape {g.shape} vs {w.shape}; "
                f"rows differing: "
                f"{np.flatnonzero((g != w).any(axis=1)).tolist() if g.shape == w.shape else '?'})"
            )
        theirs.finish_step(out_u)
        mine.finish_step(out_m)
        step += 1
