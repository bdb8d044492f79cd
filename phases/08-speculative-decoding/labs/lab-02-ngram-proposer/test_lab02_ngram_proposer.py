"""Lab 08.2 — the n-gram proposer.

Graded: the two ``LAB 08.2`` regions of ``labs/phase_08/ngram_proposer.py``:
``NgramProposer.propose_one`` (the longest n-gram at the context's end that
also occurs earlier, its earliest occurrence, then up to k tokens after it)
and, in ``propose``, the rows that get no draft at all.

First one rule per test on hand-made contexts; then, marked ``upstream``,
generated batches of token histories (small alphabets, so repeats and ties
between equally long matches are common; mini_vllm/oracle/spec_workload.py
``ngram_cases``) through your ``propose`` and the pinned upstream's
``NgramProposer.propose`` (vllm/v1/spec_decode/ngram_proposer.py:131): the
same drafts for every row.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given
from phase08_helpers import written

from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.spec_workload import ngram_cases, ngram_inputs, upstream_ngram

LOCKSTEP = lab_settings(150)

pytestmark = pytest.mark.timeout(60)


def one(impl, tokens, min_n, max_n, k, max_model_len=64) -> list[int]:
    """Your draft for one decoding row whose context is ``tokens``."""
    proposer = impl.ngram_proposer.NgramProposer(min_n, max_n, k, max_model_len)
    sampled, num_tokens, token_ids = ngram_inputs(max(max_model_len, len(tokens)), [tokens], [True])
    (got,) = written(proposer.propose, sampled, num_tokens, token_ids)
    return list(got)


def case(tokens, min_n, max_n, k, max_model_len=64) -> str:
    return (
        f"context {tokens}, prompt_lookup_min={min_n}, prompt_lookup_max={max_n}, "
        f"num_speculative_tokens={k}, max_model_len={max_model_len}"
    )


@pytest.mark.points(3)
def test_the_longest_match_wins(impl):
    tokens = [2, 7, 1, 2, 9, 1, 2]
    got = one(impl, tokens, 1, 3, 2)
    assert got == [9, 1], (
        f"{case(tokens, 1, 3, 2)}: the ending [1, 2] (n = 2) occurs at position 2, so the draft "
        f"is what follows it, [9, 1]; got {got}. Try n from prompt_lookup_max DOWN: the "
        "1-gram [2] also occurs earlier (position 0, followed by [7, 1]), but a longer match "
        "is the better guess."
    )


@pytest.mark.points(3)
def test_the_earliest_occurrence_wins(impl):
    tokens = [1, 2, 8, 1, 2, 9, 1, 2]
    got = one(impl, tokens, 2, 2, 1)
    assert got == [8], (
        f"{case(tokens, 2, 2, 1)}: [1, 2] occurs at positions 0 and 3; upstream takes the "
        f"EARLIEST, position 0, followed by [8]; got {got}."
    )


@pytest.mark.points(3)
def test_k_is_capped_by_max_model_len_and_by_the_context(impl):
    tokens = [1, 2, 3, 4, 5, 1, 2, 3]
    got = one(impl, tokens, 3, 3, 5, max_model_len=10)
    assert got == [4, 5], (
        f"{case(tokens, 3, 3, 5, 10)}: the context holds 8 tokens and may grow to 10, so at "
        f"most 2 drafts: [4, 5]; got {got}. k = min(num_speculative_tokens, max_model_len - "
        "len(context))."
    )
    tokens = [5, 5, 5]
    got = one(impl, tokens, 1, 2, 3)
    assert got == [5], (
        f"{case(tokens, 1, 2, 3)}: [5, 5] occurs at position 0 (overlapping the ending is "
        f"fine); what follows it is the context's last token, [5], and the context ends "
        f"there: a shorter draft; got {got}."
    )
    tokens = [4, 4]
    got = one(impl, tokens, 1, 5, 3)
    assert got == [4], (
        f"{case(tokens, 1, 5, 3)}: an ending can be at most len(context) - 1 long (it must "
        f"also start earlier); the 1-gram [4] at position 0 gives [4]; got {got}."
    )


@pytest.mark.points(3)
def test_no_match_of_min_n_means_no_draft(impl):
    tokens = [1, 2, 3, 1, 2]
    got = one(impl, tokens, 3, 4, 2)
    assert got == [], (
        f"{case(tokens, 3, 4, 2)}: the ending's 3- and 4-grams occur nowhere earlier: no "
        f"draft (an empty list); got {got}. A shorter match ([1, 2]) is below prompt_lookup_min."
    )
    got = one(impl, tokens, 2, 4, 2)
    assert got == [3, 1], f"{case(tokens, 2, 4, 2)}: [1, 2] at position 0 gives [3, 1]; got {got}"
    got = one(impl, [6], 1, 2, 2)
    assert got == [], f"a 1-token context has no earlier occurrence of anything; got {got}"


@pytest.mark.points(3)
def test_rows_that_get_no_draft(impl):
    proposer = impl.ngram_proposer.NgramProposer(1, 2, 2, 8)
    histories = [[3, 3, 3, 3], [3, 3, 3, 3], [1, 2, 1, 2, 1, 2, 1, 2]]
    sampled, num_tokens, token_ids = ngram_inputs(8, histories, [True, False, True])
    got = written(proposer.propose, sampled, num_tokens, token_ids)
    assert got == [[3, 3], [], []], (
        f"rows: [3, 3, 3, 3] decoding, the same still prefilling (it sampled nothing this "
        f"step), and a context already at max_model_len (8): drafts [[3, 3], [], []], one list "
        f"per row in order; got {got}."
    )
    assert all(isinstance(t, int) for d in got for t in d), "drafts are lists of Python ints"


# ------------------------------------------------------------------ against upstream


@pytest.mark.upstream
@pytest.mark.points(10)
@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore::numba.core.errors.NumbaPendingDeprecationWarning")
@example((2, 3, 3, 16, [[1, 2, 9, 1, 2, 8, 1, 2]], [True]))
@example((2, 2, 5, 9, [[1, 2, 3, 4, 1, 2, 3, 1, 2]], [True]))
@example((1, 5, 5, 12, [[3, 1, 2, 3, 1, 2, 3, 4, 0, 1, 2, 3]], [True]))
@LOCKSTEP
@given(case=ngram_cases())
def test_drafts_equal_upstreams(impl, case):
    min_n, max_n, k, max_model_len, histories, sampled = case
    inputs = ngram_inputs(max_model_len, histories, sampled)
    expected = upstream_ngram(min_n, max_n, k, max_model_len).propose(*inputs)
    proposer = impl.ngram_proposer.NgramProposer(min_n, max_n, k, max_model_len)
    got = written(proposer.propose, *inputs)
    assert len(got) == len(expected), f"one draft per row: {len(got)} for {len(expected)} rows"
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert list(g) == list(e), (
            f"row {i}: context {histories[i]} (sampled this step: {sampled[i]}), "
            f"prompt_lookup_min={min_n}, prompt_lookup_max={max_n}, "
            f"num_speculative_tokens={k}, max_model_len={max_model_len}: upstream drafts "
            f"{list(e)}, yours {list(g)}."
        )
