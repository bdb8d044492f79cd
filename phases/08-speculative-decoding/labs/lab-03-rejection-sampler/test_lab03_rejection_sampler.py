"""Lab 08.3 — the rejection sampler.

Graded: the four ``LAB 08.3`` regions of ``labs/phase_08/rejection_sampler.py``:
greedy verification (accept a draft while it is the target's argmax), the
random accept test ``p(draft) / q(draft) >= u``, ``_write_row`` (accepted
drafts, then the first rejected position's replacement, or the bonus
token), and what a rejected position draws from, ``max(p - q, 0)``.

First the rules on batches built by hand; then, marked ``upstream``,
generated greedy, random and mixed batches through your ``rejection_sample``
and the pinned upstream's (vllm/v1/sample/rejection_sampler.py:392, its
Triton kernels run by Triton's interpreter on a CPU; mini_vllm/oracle/spec_workload.py)
with the same seeds: the same tokens, and every random stream advanced alike;
then a chi-square test that verifying n-gram drafts leaves each output
position distributed exactly as the target model's.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from phase08_helpers import chi2_sf, written

from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.spec_workload import (
    mini_sampling_metadata,
    rejection_cases,
    run_rejection_sample,
)
from mini_vllm.spec_decode.metadata import SpecDecodeMetadata

LOCKSTEP = lab_settings(25)
P = -1  # PLACEHOLDER_TOKEN_ID

pytestmark = pytest.mark.timeout(120)


def verify(impl, drafts, target_logits, bonus, temperature, draft_probs=None, seeds=None):
    """Your rejection_sample on one batch: drafts per request, flat target rows."""
    meta = SpecDecodeMetadata.make_dummy(drafts)
    sampling = mini_sampling_metadata(temperature, seeds or [None] * len(drafts))
    out = written(
        impl.rejection_sampler.rejection_sample,
        meta.draft_token_ids,
        meta.num_draft_tokens,
        meta.max_spec_len,
        meta.cu_num_draft_tokens,
        draft_probs,
        target_logits,
        torch.tensor(bonus, dtype=torch.int32).view(-1, 1),  # [batch, 1]
        sampling,
    )
    return out.tolist()


def one_hot_logits(ids, vocab=8, high=5.0):
    """Target rows, each with its argmax at the given id."""
    logits = torch.zeros(len(ids), vocab)  # [num_tokens, vocab]
    logits[torch.arange(len(ids)), torch.tensor(ids)] = high
    return logits


# ------------------------------------------------------------------ the rules


@pytest.mark.points(5)
def test_greedy_accepts_while_the_draft_is_the_argmax(impl):
    # Request 0: drafts 3, 4, 5; the target's argmax 3, 6, 5 -> 3 accepted, 6 replaces 4.
    # Request 1: drafts 1, 2 both the argmax -> accepted, then its bonus 7.
    # Request 2: no drafts -> its bonus alone.
    got = verify(
        impl,
        [[3, 4, 5], [1, 2], []],
        one_hot_logits([3, 6, 5, 1, 2]),
        bonus=[0, 7, 2],
        temperature=[0.0, 0.0, 0.0],
    )
    want = [[3, 6, P, P], [1, 2, 7, P], [2, P, P, P]]
    assert got == want, (
        f"greedy rows: got {got}, want {want}. Row 0: draft 3 is the argmax (kept), draft 4 is "
        "not (the argmax 6 takes its place and the row STOPS: draft 5 is never looked at, "
        "even though it matches). Row 1: every draft kept, then the bonus token. Row 2: no "
        "drafts, only the bonus. The rest is -1 (PLACEHOLDER_TOKEN_ID)."
    )


@pytest.mark.points(4)
def test_write_row(impl):
    row = torch.full((4,), P, dtype=torch.int32)
    written(impl.rejection_sampler._write_row, row, [5, 6, 7], [True, False, True], [8, 9, 10], 11)
    assert row.tolist() == [5, 9, P, P], (
        f"_write_row(drafts [5, 6, 7], accepted [True, False, True], on_reject [8, 9, 10], "
        f"bonus 11) wrote {row.tolist()}; want [5, 9, -1, -1]: draft 5 kept, position 1 "
        "takes its replacement 9 and the row stops (no bonus after a rejection; position 2's "
        "acceptance no longer matters)."
    )
    row = torch.full((4,), P, dtype=torch.int32)
    written(impl.rejection_sampler._write_row, row, [5, 6, 7], [True] * 3, [8, 9, 10], 11)
    assert row.tolist() == [5, 6, 7, 11], f"all accepted: want [5, 6, 7, 11], got {row.tolist()}"
    row = torch.full((4,), P, dtype=torch.int32)
    written(impl.rejection_sampler._write_row, row, [], [], [], 11)
    assert row.tolist() == [11, P, P, P], f"no drafts: want [11, -1, -1, -1], got {row.tolist()}"


@pytest.mark.points(4)
def test_random_accepts_a_sure_draft_and_rejects_an_impossible_one(impl):
    # n-gram drafts (no draft_probs): q(draft) = 1, so accept iff p(draft) >= u.
    # Row 0 puts all its mass on the draft (p = 1 >= any u); row 1 none (p = 0 < u
    # unless u is exactly 0) and all of it on token 6.
    logits = torch.full((2, 8), -1e9)  # [2, 8]
    logits[0, 3] = 0.0
    logits[1, 6] = 0.0
    for seed in range(5):
        got = verify(impl, [[3, 4]], logits, bonus=[7], temperature=[1.0], seeds=[seed])
        assert got == [[3, 6, P]], (
            f"random row, n-gram drafts [3, 4]: the target gives draft 3 probability 1 and "
            f"draft 4 probability 0 (all on 6). Want [3, 6, -1] (3 accepted; 4 rejected, "
            f"replaced by a draw from max(p - q, 0), which is token 6 alone); got {got}."
        )
    # With draft probabilities: q(draft) = 0 is rejected, not divided by (p / 0 would
    # accept it). max(p - q, 0) is then positive on the draft token alone.
    q = torch.full((1, 8), 1 / 7)  # [1, 8]
    q[0, 2] = 0.0
    logits = torch.zeros(1, 8)  # uniform target
    got = verify(impl, [[2]], logits, bonus=[7], temperature=[1.0], draft_probs=q, seeds=[0])
    assert got == [[2, P]], (
        f"draft 2, whose drafter gave it probability 0, must be rejected (p / q would divide "
        f"by zero and accept it, then add the bonus 7); its replacement, drawn from max(p - q, "
        f"0), can only be token 2 itself. Want [[2, -1]], got {got}."
    )


@pytest.mark.points(4)
def test_recovered_tokens_come_from_p_minus_q(impl):
    srt = impl.rejection_sampler.sample_recovered_tokens
    target = torch.tensor([[0.6, 0.4, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])  # [2, 4]
    sampling = mini_sampling_metadata([1.0], [None])
    drafts = torch.tensor([0, 2], dtype=torch.int32)
    for _ in range(5):
        got = written(srt, [2], drafts, None, target.clone(), sampling).tolist()
        assert got[0] == 1, (
            f"n-gram draft 0 over target [0.6, 0.4, 0, 0]: q is 1 on the draft, so max(p - q, 0) "
            f"is [0, 0.4, 0, 0] and a rejected position can only take token 1; got {got[0]}."
        )
        assert got[1] != 2, f"draft 2 has p - q <= 0, it can never be the recovered token: {got}"
    q = torch.tensor([[0.6, 0.1, 0.3, 0.0], [0.1, 0.4, 0.25, 0.25]])  # [2, 4]
    target = torch.tensor([[0.2, 0.1, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]])  # [2, 4]
    got = written(srt, [2], drafts, q, target.clone(), sampling).tolist()
    assert got == [3, 2] or got == [3, 3], (
        f"with draft probabilities q, a rejected position draws from max(p - q, 0): row 0 "
        f"[0, 0, 0, 0.4] (only token 3), row 1 [0, 0, 0.05, 0.15] (token 2 or 3); got {got}."
    )


# ------------------------------------------------------------------ against upstream


@pytest.mark.upstream
@pytest.mark.points(4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["greedy", "random", "mixed"])
def test_equal_to_upstreams_rejection_sample(impl, mode):
    @LOCKSTEP
    @given(case=rejection_cases(mode))
    def check(case):
        got, expected, problem = run_rejection_sample(case, impl.rejection_sampler.rejection_sample)
        num_draft_tokens, _, draft_ids, draft_probs, temperature, seeds, bonus, _ = case
        where = (
            f"{mode} batch: drafts per request {num_draft_tokens}, draft ids "
            f"{draft_ids.tolist()}, temperatures {temperature}, seeds {seeds}, draft_probs "
            f"{'given' if draft_probs is not None else 'None (n-gram)'}, bonus "
            f"{bonus.view(-1).tolist()}"
        )
        assert torch.equal(got, expected), (
            f"{where}:\n  upstream {expected.tolist()}\n  yours    {got.tolist()}"
        )
        assert problem is None, f"{where}: {problem} (draw in upstream's order, with its calls)"

    written(check)


# ------------------------------------------------------------------ the distribution

DRAWS = 20000  # requests with the same target rows and drafts: one verification each
P_FAIL = 1e-6  # a correct sampler fails with about this probability (fixed seed: never, here)
MIN_EXPECTED = 100  # every token's expected count; the chi-square law holds well above 5
# Two n-gram drafts per request, and the target's three rows (two to verify the
# drafts, one for the bonus token): every token has probability >= 0.05.
TARGET = torch.tensor(
    [
        [0.50, 0.20, 0.15, 0.10, 0.05],
        [0.10, 0.30, 0.35, 0.20, 0.05],
        [0.20, 0.20, 0.20, 0.20, 0.20],
    ]
)
DRAFTS = [0, 2]


def fit(counts: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    n = float(counts.sum())
    expected = probs.double() * n
    assert float(expected.min()) >= MIN_EXPECTED, f"the test's case is too thin ({what})"
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(probs) - 1
    p_value = chi2_sf(stat, df)
    assert p_value >= P_FAIL, (
        f"{what}: {int(n)} draws do not fit the target's distribution: chi-square {stat:.1f} "
        f"with {df} degrees of freedom, p = {p_value:.3g} < {P_FAIL}. Counts per token "
        f"{counts.long().tolist()}, expected {[round(float(e)) for e in expected]}. Verifying "
        "a draft must leave each position distributed as the target: accept the draft with "
        "probability min(1, p/q), and on rejection draw from max(p - q, 0)."
    )


@pytest.mark.points(6)
@pytest.mark.timeout(180)
def test_verified_tokens_are_distributed_as_the_target(impl):
    """DRAWS requests, each verifying the n-gram drafts [0, 2] against the same
    target rows at temperature 1. Position 0 must be distributed as row 0;
    among the requests that kept draft 0, position 1 as row 1 (then the
    bonus, drawn here from row 2, follows only where both were kept).

    Fails when a chi-square statistic has a p-value below 1e-6 (every
    expected count >= 100). Fixed seed: a correct sampler passes every time.
    Drawing a rejected position's token from p itself (the draft not removed)
    puts 0.75 of position 0 on token 0 instead of 0.5: a statistic in the
    thousands."""
    torch.manual_seed(8)
    logits = TARGET.log().repeat(DRAWS, 1)  # [3 * DRAWS, 5]: rows 0, 1, 2 of each request
    draft_rows = torch.arange(3 * DRAWS).view(DRAWS, 3)[:, :2].reshape(-1)  # [2 * DRAWS]
    bonus = torch.multinomial(TARGET[2], DRAWS, replacement=True).int()  # [DRAWS]
    meta = SpecDecodeMetadata.make_dummy([DRAFTS] * DRAWS)
    out = written(
        impl.rejection_sampler.rejection_sample,
        meta.draft_token_ids,
        meta.num_draft_tokens,
        meta.max_spec_len,
        meta.cu_num_draft_tokens,
        None,
        logits[draft_rows],
        bonus.view(-1, 1),
        mini_sampling_metadata([1.0] * DRAWS, [None] * DRAWS),
    )  # [DRAWS, 3]
    vocab = TARGET.shape[1]
    first = out[:, 0].long()
    assert bool((first >= 0).all()), "every request must output at least one token"
    fit(torch.bincount(first, minlength=vocab).double(), TARGET[0], "position 0")
    kept = out[first == DRAFTS[0]]  # the requests that accepted draft 0
    second = kept[:, 1].long()
    assert bool((second >= 0).all()), "a request that kept draft 0 outputs a second token"
    fit(
        torch.bincount(second, minlength=vocab).double(),
        TARGET[1],
        f"position 1, among the {len(kept)} requests that kept draft 0",
    )
