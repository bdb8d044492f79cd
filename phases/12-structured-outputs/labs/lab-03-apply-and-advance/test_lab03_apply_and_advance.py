"""Lab 12.3 — applying the bitmask to the logits, and advancing the grammar.

Graded: the ``LAB 12.3`` regions. In ``labs/phase_12/utils.py``,
``unpack_bitmask`` (one bool per token out of the int32 words) and
``apply_grammar_bitmask`` (each bitmask row, in scheduled order, onto its
request's logits rows, in the batch's order, drafts pushing rows down); in
``labs/phase_12/scheduler.py``, the block of ``Scheduler.update_from_output``
that feeds the kept tokens to the request's grammar.

The oracles: xgrammar's own reading of the bits
(``xgr.apply_token_bitmask_inplace`` on a logits tensor) and, marked
``upstream``, the pinned upstream's ``apply_grammar_bitmask``
(vllm/v1/structured_output/utils.py:44), called on a CPU, and its
``Scheduler.update_from_output`` driven through the same steps as yours. The
grammar of the scheduler tests is a stand-in that records what it is fed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import xgrammar as xgr
from hypothesis import example, given
from hypothesis import strategies as st

import mini_vllm.testing as mini
from mini_vllm.core.sched.output import GrammarOutput, SchedulerOutput
from mini_vllm.grading.checks import crash_message, lab_settings, written

INT32 = st.integers(-(2**31), 2**31 - 1)
# Words whose bits are easy to get wrong: none, all, the sign bit alone, bit 0, bit 30.
SPECIAL_WORDS = st.sampled_from([0, -1, -(2**31), 1, 2**30, 2**31 - 1, -2])


def xgrammar_apply(logits: torch.Tensor, bitmask: torch.Tensor, indices=None) -> None:
    """xgrammar's kernel on ``logits``, in place. xgrammar 0.2.8's CPU kernel
    writes a whole last word per row, past the row's end when the width is not
    a multiple of 32 (into the next row; past the last, out of bounds): it runs
    here on a copy widened to ``32 * words`` columns, of which the first are kept."""
    wide = torch.zeros(logits.shape[0], 32 * bitmask.shape[1], dtype=logits.dtype)
    wide[:, : logits.shape[1]] = logits
    xgr.apply_token_bitmask_inplace(wide, bitmask, indices=indices)
    logits.copy_(wide[:, : logits.shape[1]])


def xgrammar_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: the tokens xgrammar's kernel leaves finite."""
    logits = torch.zeros(bitmask.shape[0], vocab_size)
    xgrammar_apply(logits, bitmask)
    return torch.isfinite(logits)


def tokens(row: torch.Tensor) -> list[int]:
    return torch.nonzero(row).flatten().tolist()


def where_bit(token: int) -> str:
    return f"token {token} is bit {token % 32} of word {token // 32}"


# ------------------------------------------------------------------ unpack_bitmask


@pytest.mark.points(2)
def test_unpack_a_worked_example(impl):
    # Row 0: word 0 has bits 0 and 31 (the sign bit) set, word 1 has bit 8,
    # word 2 is all ones; row 1: only the sign bit of word 1, bit 1 of word 2.
    bitmask = torch.tensor([[-(2**31) + 1, 1 << 8, -1], [0, -(2**31), 2]], dtype=torch.int32)
    vocab_size = 70  # the last word's bits 6-31 are past the vocabulary
    got = written(impl.utils.unpack_bitmask, bitmask.clone(), vocab_size)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bool, (
        f"unpack_bitmask must return a bool tensor; got {type(got).__name__} "
        f"{getattr(got, 'dtype', '')}"
    )
    assert tuple(got.shape) == (2, vocab_size), (
        f"shape {tuple(got.shape)}, want (rows, vocab_size) = (2, {vocab_size}): cut the last "
        "word's bits that lie past the vocabulary."
    )
    want = [[0, 31, 40, *range(64, 70)], [63, 65]]
    for r in range(2):
        assert tokens(got[r]) == want[r], (
            f"words {bitmask[r].tolist()}, vocab_size {vocab_size}: row {r} allows tokens "
            f"{tokens(got[r])}, want {want[r]}. Token j is bit j % 32 of word j // 32, bits "
            "counted from the lowest (bit 0 = value 1; bit 31, the sign bit, is token 31 of its "
            "word), so 1 << 8 in word 1 is token 40 and the sign bit of word 1 is token 63."
        )


@st.composite
def bitmasks(draw):
    """(int32 bitmask [rows, words], vocab_size): vocab sizes mostly not multiples of 32."""
    rows = draw(st.integers(1, 4))
    words = draw(st.integers(1, 6))
    vocab_size = 32 * words - draw(st.integers(0, 31))
    values = draw(st.lists(INT32 | SPECIAL_WORDS, min_size=rows * words, max_size=rows * words))
    return torch.tensor(values, dtype=torch.int32).view(rows, words), vocab_size


@pytest.mark.points(4)
@pytest.mark.timeout(60)
@example(case=(torch.tensor([[-(2**31), 1]], dtype=torch.int32), 33))
@lab_settings(60, shrink=True)
@given(case=bitmasks())
def test_unpack_reads_the_bits_as_xgrammar_does(impl, case):
    bitmask, vocab_size = case
    before = bitmask.clone()
    got = written(impl.utils.unpack_bitmask, bitmask, vocab_size)
    assert torch.equal(bitmask, before), "unpack_bitmask changed the bitmask it was given"
    want = xgrammar_allowed(bitmask, vocab_size)
    assert got.dtype == torch.bool and tuple(got.shape) == tuple(want.shape), (
        f"got {got.dtype} {tuple(got.shape)}, want torch.bool {tuple(want.shape)} "
        "(rows, vocab_size)"
    )
    if not torch.equal(got, want):
        r, j = (int(x) for x in torch.nonzero(got != want)[0])
        word = int(bitmask[r, j // 32])
        pytest.fail(
            f"bitmask {bitmask.tolist()}, vocab_size {vocab_size}: row {r}, {where_bit(j)} "
            f"(word = {word}, {word & 0xFFFFFFFF:032b} as bits, highest first): xgrammar says "
            f"{'allowed' if want[r, j] else 'disallowed'}, yours "
            f"{'allowed' if got[r, j] else 'disallowed'}. Read each word's bits lowest first; "
            "the sign bit is bit 31, a token like the others."
        )


# ------------------------------------------------------------ apply_grammar_bitmask


def logits_rows(batch_order: list[str], spec: dict[str, list[int]]) -> dict[str, list[int]]:
    """The hand-derived rule: each request of the batch, in the batch's order,
    owns 1 + (its scheduled drafts) consecutive logits rows."""
    rows, start = {}, 0
    for req_id in batch_order:
        n = 1 + len(spec.get(req_id, ()))
        rows[req_id] = list(range(start, start + n))
        start += n
    return rows


def bitmask_rows(scheduled_order: list[str], spec: dict[str, list[int]]) -> dict[str, list[int]]:
    """The same rule for the bitmask: requests in the grammar output's order."""
    return logits_rows(scheduled_order, spec)


def placement(batch_order, scheduled_order, spec) -> dict[int, int]:
    """{logits row: the bitmask row it must get} for the structured requests in this batch."""
    lr, br = logits_rows(batch_order, spec), bitmask_rows(scheduled_order, spec)
    return {
        logit_row: bitmask_row
        for req_id in scheduled_order
        if req_id in lr
        for logit_row, bitmask_row in zip(lr[req_id], br[req_id], strict=True)
    }


def run_apply(impl, batch_order, scheduled_order, spec, bitmask: np.ndarray, logits):
    """Your apply_grammar_bitmask on a stand-in batch (it reads only ``req_ids``)."""
    scheduler_output = SchedulerOutput.make_empty()
    scheduler_output.scheduled_spec_decode_tokens = {r: list(d) for r, d in spec.items()}
    grammar_output = GrammarOutput(list(scheduled_order), bitmask)
    batch = SimpleNamespace(req_ids=list(batch_order))
    return written(
        impl.utils.apply_grammar_bitmask, scheduler_output, grammar_output, batch, logits
    )


def row_owner(order, spec) -> dict[int, str]:
    """{row: "request r1, its draft row 1"} for messages."""
    names = {}
    for req_id, rows in logits_rows(order, spec).items():
        for i, row in enumerate(rows):
            names[row] = f"request {req_id!r}" + (
                f" (row {i} of {len(rows)})" if len(rows) > 1 else ""
            )
    return names


def signature_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """Bitmask row i allows every token but i and 40 + i: each row's -inf pattern names it."""
    words = (vocab_size + 31) // 32
    bitmask = np.full((num_rows, words), -1, dtype=np.int32)
    for i in range(num_rows):
        for token in (i, 40 + i):
            word = bitmask[i, token // 32].view(np.uint32)
            bitmask[i, token // 32] = np.uint32(word & ~np.uint32(1 << (token % 32))).view(np.int32)
    return bitmask


def check_placement(impl, batch_order, scheduled_order, spec):
    vocab_size = 100  # 4 words, the last one partly past the vocabulary
    num_bitmask_rows = sum(1 + len(spec.get(r, ())) for r in scheduled_order)
    bitmask = signature_bitmask(num_bitmask_rows, vocab_size)
    num_logits = sum(1 + len(spec.get(r, ())) for r in batch_order)
    logits = torch.zeros(num_logits, vocab_size)
    run_apply(impl, batch_order, scheduled_order, spec, bitmask.copy(), logits)
    want = placement(batch_order, scheduled_order, spec)
    patterns = {i: [i, 40 + i] for i in range(num_bitmask_rows)}
    owners, bitmask_owners = row_owner(batch_order, spec), row_owner(scheduled_order, spec)
    setup = (
        f"batch order {batch_order}, grammar output's order {scheduled_order}, scheduled drafts "
        f"{spec}; bitmask row i disallows tokens i and 40 + i"
    )
    for row in range(num_logits):
        got = tokens(torch.isinf(logits[row]))
        matches = [i for i, p in patterns.items() if p == got]
        if row not in want:
            assert not got, (
                f"{setup}: logits row {row} ({owners[row]}, no grammar row of its own) has -inf "
                f"at tokens {got}; a request without a bitmask row in this step is not touched."
            )
            continue
        b = want[row]
        if got != patterns[b]:
            seen = (
                f"bitmask row {matches[0]}'s pattern ({bitmask_owners[matches[0]]})"
                if matches
                else "no bitmask row's pattern: check unpack_bitmask (Lab 12.3's tests above)"
                if got
                else "no -inf at all"
            )
            pytest.fail(
                f"{setup}.\nlogits row {row} ({owners[row]}) must get bitmask row {b} "
                f"({bitmask_owners[b]}): -inf at tokens {patterns[b]}; it has -inf at {got}, "
                f"which is {seen}. Logits rows follow the batch's order, each request's drafts "
                "pushing the later rows down; bitmask rows follow the grammar output's order, "
                "one per draft plus one."
            )


@pytest.mark.points(4)
def test_each_bitmask_row_lands_on_its_requests_logits_rows(impl):
    # r1 verifies 2 drafts (3 logits rows); r2 (no grammar) verifies 1, pushing r3 down;
    # the scheduler listed r3 before r1.
    check_placement(
        impl,
        batch_order=["r0", "r1", "r2", "r3"],
        scheduled_order=["r3", "r1"],
        spec={"r1": [5, 6], "r2": [7]},
    )


@pytest.mark.points(2)
def test_a_request_with_rows_but_not_in_this_batch_is_skipped(impl):
    # "gone" has 3 bitmask rows (2 drafts) but no logits rows here: its rows are
    # skipped, and the rows after them still belong to r1 and r3.
    check_placement(
        impl,
        batch_order=["r3", "r0", "r1"],
        scheduled_order=["gone", "r1", "r3"],
        spec={"gone": [1, 2], "r1": [5]},
    )


@pytest.mark.points(3)
def test_only_disallowed_logits_change_and_in_place(impl):
    gen = torch.Generator().manual_seed(12)
    vocab_size = 49152 - 5  # SmolLM2's vocabulary, less a few: the last word is cut
    words = (vocab_size + 31) // 32
    batch_order, scheduled_order = ["a", "b", "c", "d"], ["d", "b"]
    spec = {"b": [11], "c": [12, 13]}
    num_rows = sum(1 + len(spec.get(r, ())) for r in scheduled_order)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (num_rows, words), generator=gen, dtype=torch.int32
    )
    logits = torch.randn(7, vocab_size, generator=gen)  # rows: a, b x2, c x3, d
    original = logits.clone()
    # xgrammar's kernel on the rows the rule gives (the bitmask sorted into batch order).
    want = placement(batch_order, scheduled_order, spec)
    sorted_bitmask = torch.full((logits.shape[0], words), -1, dtype=torch.int32)
    sorted_bitmask[list(want.keys())] = bitmask[list(want.values())]
    expected = logits.clone()
    xgrammar_apply(expected, sorted_bitmask, indices=list(want.keys()))
    result = run_apply(impl, batch_order, scheduled_order, spec, bitmask.numpy().copy(), logits)
    assert result is None, "apply_grammar_bitmask returns None: it changes `logits` in place"
    assert not torch.equal(logits, original), (
        "the logits tensor passed in is unchanged: apply_grammar_bitmask must write -inf into "
        "it in place (masked_fill_, index assignment), not into a copy"
    )
    owners = row_owner(batch_order, spec)
    for row in range(logits.shape[0]):
        if torch.equal(logits[row], expected[row]):
            continue
        j = int(torch.nonzero(logits[row] != expected[row])[0])
        if row not in want:
            why = "this request has no bitmask row: its logits stay exactly as they were"
        elif torch.isinf(expected[row, j]):
            why = f"xgrammar disallows it ({where_bit(j)}): its logit must be -inf"
        else:
            why = "an allowed token keeps its logit exactly (no shift, no renormalization)"
        pytest.fail(
            f"logits row {row} ({owners[row]}), token {j}: was {original[row, j].item()}, "
            f"yours {logits[row, j].item()}, want {expected[row, j].item()}: {why}."
        )


# ---------------------------------------------------------- against upstream


@st.composite
def apply_cases(draw):
    """A batch in some order; some requests structured; drafts on any request;
    the grammar output's order another; 0-2 structured requests not in this batch."""
    n = draw(st.integers(1, 6))
    batch_order = draw(st.permutations([f"r{i}" for i in range(n)]))
    structured = [r for r in batch_order if draw(st.booleans())]
    absent = [f"gone{i}" for i in range(draw(st.integers(0, 2)))]
    if not structured and not absent:
        structured = [batch_order[0]]
    scheduled_order = draw(st.permutations(structured + absent))
    spec = {}
    for req_id in batch_order + absent:
        d = draw(st.integers(0, 3))
        if d:
            spec[req_id] = list(range(100, 100 + d))
    # A multiple of 32: on a CPU upstream calls xgrammar's kernel, which writes past
    # the end of a row that is not (see xgrammar_apply).
    vocab_size = 32 * draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**16))
    return batch_order, scheduled_order, spec, vocab_size, seed


@pytest.mark.upstream
@pytest.mark.points(5)
@pytest.mark.timeout(120)
@lab_settings(40)
@given(case=apply_cases())
def test_apply_equals_upstreams(impl, up, case):
    from vllm.v1.core.sched.output import GrammarOutput as UpstreamGrammarOutput
    from vllm.v1.core.sched.output import SchedulerOutput as UpstreamSchedulerOutput
    from vllm.v1.structured_output.utils import apply_grammar_bitmask as upstream_apply

    batch_order, scheduled_order, spec, vocab_size, seed = case
    rng = np.random.default_rng(seed)
    words = (vocab_size + 31) // 32
    num_rows = sum(1 + len(spec.get(r, ())) for r in scheduled_order)
    bitmask = rng.integers(-(2**31), 2**31, size=(num_rows, words)).astype(np.int32)
    bitmask[rng.random(bitmask.shape) < 0.2] = -1  # some words allow all 32 tokens
    num_logits = sum(1 + len(spec.get(r, ())) for r in batch_order)
    logits = torch.from_numpy(rng.standard_normal((num_logits, vocab_size)).astype(np.float32))

    expected = logits.clone()
    upstream_output = UpstreamSchedulerOutput.make_empty()
    upstream_output.scheduled_spec_decode_tokens = {r: list(d) for r, d in spec.items()}
    upstream_apply(
        upstream_output,
        UpstreamGrammarOutput(list(scheduled_order), bitmask.copy()),
        SimpleNamespace(req_ids=list(batch_order)),  # upstream reads only req_ids
        expected,
    )
    got = logits.clone()
    run_apply(impl, batch_order, scheduled_order, spec, bitmask.copy(), got)
    if not torch.equal(got, expected):
        row, j = (int(x) for x in torch.nonzero(got != expected)[0])
        pytest.fail(
            f"batch order {batch_order}, grammar output's order {scheduled_order}, drafts "
            f"{spec}, vocab_size {vocab_size}: logits row {row} "
            f"({row_owner(batch_order, spec)[row]}), token {j}: upstream "
            f"{expected[row, j].item()}, yours {got[row, j].item()} (before: "
            f"{logits[row, j].item()})."
        )


# ------------------------------------------------------------ advancing the grammar


WRONG_DRAFT = 999  # a draft the stand-in model never samples: verification rejects it
STOP = 42  # a stop token (``stop_token_ids``) some requests' streams hold
REFUSED = 13  # the token a refusing grammar refuses
NUM_SPEC = 3


@dataclass
class Plan:
    """One request of a scripted run: the tokens its stand-in model samples
    (``stream``, from the first), its ``max_tokens``, whether it has a
    grammar (refusing REFUSED when ``refuses``), and, step by step (cycled),
    which of its 3 drafts is wrong (3: none)."""

    req_id: str
    stream: list[int]
    max_tokens: int
    structured: bool = True
    refuses: bool = False
    wrong: list[int] = field(default_factory=lambda: [NUM_SPEC])


@dataclass
class Step:
    """What one request saw in one step."""

    sampled: list[int]  # what the model returned (accepted drafts + 1)
    kept: list[int]  # what the request appended (cut at a stop / max_tokens)
    fed: list[list[int]]  # the grammar's accept_tokens calls this step
    status: str  # after update_from_output
    finish_reason: str | None


def drive(backend, scheduler, plans: list[Plan], max_steps: int = 40):
    """schedule() -> a greedy stand-in model -> update_from_output() ->
    update_draft_token_ids(), until every request finishes.

    Request r samples ``stream[n], stream[n + 1], ...`` (n: tokens it has so
    far), as many as its scheduled drafts that equal its stream, plus one; its
    next drafts are the next 3 stream tokens, the plan's wrong one replaced by
    WRONG_DRAFT. Returns ([{req_id: Step}] per step, {req_id: grammar}, {req_id: request})."""
    requests, grammars = {}, {}
    for plan in plans:
        (request,) = backend.create_requests(
            1,
            req_ids=[plan.req_id],
            prompt_token_ids=[[1, 2, 3, 4]],
            max_tokens=plan.max_tokens,
            stop_token_ids=[STOP],
            structured_outputs={"regex": "[a-z]+"} if plan.structured else None,
        )
        if plan.structured:
            grammars[plan.req_id] = mini.RecordingGrammar({REFUSED} if plan.refuses else ())
            request.structured_output_request.grammar = grammars[plan.req_id]
        requests[plan.req_id] = request
        scheduler.add_request(request)
    by_id = {p.req_id: p for p in plans}
    trace: list[dict[str, Step]] = []
    for step in range(max_steps):
        if all(r.is_finished() for r in requests.values()):
            break
        out = written(scheduler.schedule)
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in ids:
            stream, n = by_id[req_id].stream, len(requests[req_id].output_token_ids)
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            k = 0
            while k < len(drafts) and drafts[k] == stream[n + k]:
                k += 1
            sampled.append(stream[n : n + k + 1])
        before = {r: len(requests[r].output_token_ids) for r in ids}
        calls = {r: len(g.fed) for r, g in grammars.items()}
        runner_output = backend.ModelRunnerOutput(  # copies: upstream cuts them in place
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[list(t) for t in sampled],
        )
        result = written(scheduler.update_from_output, out, runner_output)
        if isinstance(result, dict):  # upstream: {client index: EngineCoreOutputs}
            outputs = [o for outs in result.values() for o in outs.outputs]
        else:
            outputs = result.outputs
        finish = {o.request_id: o.finish_reason for o in outputs if o.finish_reason is not None}
        trace.append(
            {
                r: Step(
                    sampled=s,
                    kept=list(requests[r].output_token_ids[before[r] :]),
                    fed=[list(c) for c in grammars[r].fed[calls[r] :]] if r in grammars else [],
                    status=requests[r].status.name,
                    finish_reason=None if r not in finish else finish[r].name.lower(),
                )
                for r, s in zip(ids, sampled, strict=True)
            }
        )
        drafts = {}
        for req_id in ids:
            request, plan = requests[req_id], by_id[req_id]
            if request.is_finished():
                continue
            n = len(request.output_token_ids)
            guess = list(plan.stream[n : n + NUM_SPEC])
            wrong = plan.wrong[step % len(plan.wrong)]
            if wrong < len(guess):
                guess[wrong] = WRONG_DRAFT
            drafts[req_id] = guess
        if drafts:
            scheduler.update_draft_token_ids(
                backend.DraftTokenIds(list(drafts), list(drafts.values()))
            )
    return trace, grammars, requests


def run_plans(backend, scheduler_cls, plans):
    kwargs = {} if scheduler_cls is None else {"scheduler_cls": scheduler_cls}
    scheduler = backend.create_scheduler(num_speculative_tokens=NUM_SPEC, **kwargs)
    try:
        return drive(backend, scheduler, plans)
    except Exception as e:  # noqa: BLE001 - a bug in the code under grade, told in words
        if backend is not mini:
            raise
        pytest.fail(
            f"{crash_message(e)} (a run of requests {[p.req_id for p in plans]}; the plans: "
            "test_lab03_apply_and_advance.py's PLANS or the failing example below)",
            pytrace=False,
        )


def stream(*tokens, length: int = 24) -> list[int]:
    """``tokens``, then 20, 21, ... up to ``length`` tokens."""
    return [*tokens, *range(20, 20 + length - len(tokens))]


# A scripted run, every rule in view: "stop" samples STOP in the middle of an
# accepted run of drafts (the tokens after it are discarded), "capped" samples
# past its max_tokens (cut), "refused" samples the token its grammar refuses
# (as the bonus token: update_draft_token_ids cut it from the drafts), "plain"
# has no grammar, "steady" decodes with drafts rejected at varying places.
PLANS = [
    Plan("stop", stream(50, 51, 52, 53, 54, STOP, 55, 56), max_tokens=16),
    Plan("capped", stream(60, 61, 62, 63, 64, 65), max_tokens=3),
    Plan("refused", stream(70, 71, 72, REFUSED, 73), max_tokens=16, refuses=True),
    Plan("plain", stream(80, 81, 82), max_tokens=6, structured=False, wrong=[1, 3]),
    Plan("steady", stream(90, 91), max_tokens=9, wrong=[0, 2, 3, 1]),
]


def describe(trace, req_id) -> str:
    lines = [
        f"  step {i}: sampled {s[req_id].sampled}, kept {s[req_id].kept}, grammar fed "
        f"{s[req_id].fed}, {s[req_id].status}"
        for i, s in enumerate(trace)
        if req_id in s
    ]
    return f"request {req_id!r}, step by step:\n" + "\n".join(lines)


@pytest.mark.points(4)
def test_the_grammar_takes_exactly_the_kept_tokens(impl):
    trace, grammars, requests = run_plans(mini, impl.scheduler.Scheduler, PLANS)
    for req_id in ("stop", "capped", "steady"):
        for i, step in enumerate(trace):
            s = step.get(req_id)
            if s is None or s.fed == ([s.kept] if s.kept else []):
                continue
            pytest.fail(
                f"request {req_id!r}, step {i}: the model sampled {s.sampled}, the request kept "
                f"{s.kept}, and its grammar was fed {s.fed} (one accept_tokens call per "
                "step). The grammar takes exactly the kept tokens, once: the ones "
                "_update_request_with_output returns, cut after a stop token or at "
                "max_tokens, never the discarded ones after them (the next bitmask would be "
                f"built for tokens the request does not have).\n{describe(trace, req_id)}"
            )
        g, output = grammars[req_id].accepted, list(requests[req_id].output_token_ids)
        assert g == output, (
            f"request {req_id!r}: its grammar accepted {g}, its output is {output}: they must "
            f"be the same tokens.\n{describe(trace, req_id)}"
        )
    # The run did reach the cuts this test is about (the reference's scheduling).
    assert any(len(s["stop"].sampled) > len(s["stop"].kept) for s in trace if "stop" in s)
    assert any(len(s["capped"].sampled) > len(s["capped"].kept) for s in trace if "capped" in s)


def plan(req_id: str) -> Plan:
    return next(p for p in PLANS if p.req_id == req_id)


@pytest.mark.points(4)
def test_a_refused_token_ends_that_request_with_an_error(impl):
    trace, _, requests = run_plans(mini, impl.scheduler.Scheduler, PLANS)
    at = next(i for i, s in enumerate(trace) if "refused" in s and REFUSED in s["refused"].sampled)
    s = trace[at]["refused"]
    assert s.status == "FINISHED_ERROR" and s.finish_reason == "error", (
        f"request 'refused', step {at}: the model sampled {s.sampled}; its grammar refused "
        f"them (accept_tokens returned False), yet after update_from_output the request is "
        f"{s.status} with finish reason {s.finish_reason}. A token the grammar refuses ends "
        "the request at once: status FINISHED_ERROR and stopped, so it is freed and its "
        f"output carries finish_reason error.\n{describe(trace, 'refused')}"
    )
    later = [i for i, step in enumerate(trace) if i > at and "refused" in step]
    assert not later, (
        f"request 'refused' ended at step {at} but was scheduled again at step {later[0]}: "
        "a request stopped with an error is freed and leaves the running queue."
    )
    for req_id, want in (("stop", "FINISHED_STOPPED"), ("capped", "FINISHED_LENGTH_CAPPED")):
        got = requests[req_id].status.name
        assert got == want, (
            f"request {req_id!r} ends {got}, want {want}: a refusal ends only the request "
            f"whose grammar refused.\n{describe(trace, req_id)}"
        )
    r, want = requests["steady"], plan("steady").stream[: plan("steady").max_tokens]
    assert r.status.name == "FINISHED_LENGTH_CAPPED" and list(r.output_token_ids) == want, (
        f"request 'steady' ends {r.status.name} with {list(r.output_token_ids)}, want "
        f"FINISHED_LENGTH_CAPPED with {want}.\n{describe(trace, 'steady')}"
    )


@pytest.mark.points(1)
def test_a_request_without_a_grammar_is_left_alone(impl):
    trace, grammars, requests = run_plans(mini, impl.scheduler.Scheduler, PLANS)
    r, want = requests["plain"], plan("plain").stream[: plan("plain").max_tokens]
    assert "plain" not in grammars
    assert r.status.name == "FINISHED_LENGTH_CAPPED" and list(r.output_token_ids) == want, (
        f"request 'plain' (no structured output) ends {r.status.name} with "
        f"{list(r.output_token_ids)}, want FINISHED_LENGTH_CAPPED with {want}: only a request "
        "the manager says should_advance has a grammar to feed.\n"
        f"{describe(trace, 'plain')}"
    )


# ----------------------------------------------- advancing, against upstream


@st.composite
def plan_sets(draw):
    """2-4 requests; streams over a small alphabet (so drafts often match),
    STOP and REFUSED placed at drawn positions in some; max_tokens 2-10;
    wrong-draft positions drawn per step."""
    plans = []
    for i in range(draw(st.integers(2, 4))):
        s = draw(st.lists(st.integers(20, 24), min_size=24, max_size=24))
        structured = draw(st.booleans())
        refuses = structured and draw(st.booleans())
        if draw(st.booleans()):
            s[draw(st.integers(0, 9))] = STOP
        if refuses:
            s[draw(st.integers(0, 9))] = REFUSED
        wrong = draw(st.lists(st.integers(0, NUM_SPEC), min_size=1, max_size=4))
        plans.append(Plan(f"q{i}", s, draw(st.integers(2, 10)), structured, refuses, wrong))
    return plans


@pytest.mark.upstream
@pytest.mark.points(5)
@pytest.mark.timeout(120)
@example(plans=PLANS)
@lab_settings(15)
@given(plans=plan_sets())
def test_advancing_equals_upstreams(impl, up, plans):
    want, _, _ = run_plans(up, None, plans)
    got, _, _ = run_plans(mini, impl.scheduler.Scheduler, plans)
    for i, (w, g) in enumerate(zip(want, got, strict=False)):
        for req_id in list(w) + [r for r in g if r not in w]:
            if w.get(req_id) != g.get(req_id):
                pytest.fail(
                    f"step {i}, request {req_id!r}: upstream {w.get(req_id)}, yours "
                    f"{g.get(req_id)} (sampled: what the model returned; kept: what the "
                    "request appended; fed: the grammar's accept_tokens calls).\n"
                    f"Plans: {plans}\nyours, {describe(got, req_id)}"
                )
    assert len(want) == len(got), (
        f"upstream's run took {len(want)} steps, yours {len(got)}. Plans: {plans}"
    )
