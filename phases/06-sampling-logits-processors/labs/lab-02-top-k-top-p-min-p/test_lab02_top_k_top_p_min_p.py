"""Lab 06.2 — top-k, top-p and min-p: which tokens may still be drawn.

Graded: the ``LAB 06.2`` regions of ``labs/phase_06/topk_topp_sampler.py``
(``apply_top_k_top_p``'s sort-based path and ``apply_top_k_only``) and of
``labs/phase_06/builtin.py`` (``MinPLogitsProcessor.apply``).

First the rules on one row, each expected mask computed here from the
definition; then generated batches (ties included) whose masked logits must
equal the pinned upstream's bit for bit: ``apply_top_k_top_p_pytorch``
(vllm/v1/sample/ops/topk_topp_sampler.py:328, the path a CPU takes) and
upstream's ``MinPLogitsProcessor.apply``; then a chi-square test: 20000
draws through the reference's ``TopKTopPSampler.forward_native`` with your
masks in it must fit the exact distribution (the softmax of upstream's
masked logits).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from phase06_helpers import chi2_sf, processor, written

from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.sampler_workload import CONFIG
from mini_vllm.sample.logits_processor import BatchUpdate
from mini_vllm.sample.ops import topk_topp_sampler as reference_topk_topp
from mini_vllm.sampling_params import SamplingParams

LOCKSTEP = lab_settings(80)
ROW = torch.tensor([2.0, 1.6, 1.3, 1.1, 0.9, 0.5, 0.2, -0.3, -1.0, -2.0])  # float32 [10]
V = ROW.numel()
NEG_INF = float("-inf")


def kept(logits: torch.Tensor) -> list[int]:
    return [i for i, x in enumerate(logits.tolist()) if x != NEG_INF]


def top_k_top_p(impl, logits, k=None, p=None):
    """Your apply_top_k_top_p on a copy; k, p: one value per row, or None."""
    rows = logits.shape[0]
    k = None if k is None else torch.tensor(k, dtype=torch.int64).view(rows)
    p = None if p is None else torch.tensor(p, dtype=torch.float32).view(rows)
    return written(impl.topk_topp_sampler.apply_top_k_top_p, logits.clone(), k, p)


def min_p_processor(impl, min_ps):
    proc = processor(impl.builtin.MinPLogitsProcessor)
    added = [(i, SamplingParams(min_p=m), [0], []) for i, m in enumerate(min_ps)]
    proc.update_state(BatchUpdate(batch_size=len(min_ps), removed=[], added=added, moved=[]))
    return proc


def upstream_min_p(up, min_ps):
    """Upstream's MinPLogitsProcessor holding one row per min_p."""
    proc = up.lp.MinPLogitsProcessor(CONFIG, torch.device("cpu"), False)
    added = [(i, up.SamplingParams(min_p=m), [0], []) for i, m in enumerate(min_ps)]
    proc.update_state(up.lp.BatchUpdate(batch_size=len(min_ps), removed=[], added=added, moved=[]))
    return proc


# ------------------------------------------------------------------ the rules


@pytest.mark.points(2)
def test_top_k_keeps_the_k_largest_and_every_tie(impl):
    got = top_k_top_p(impl, ROW.view(1, V), k=[3])[0]
    assert kept(got) == [0, 1, 2], f"top_k=3 on {ROW.tolist()}: kept {kept(got)}, want [0, 1, 2]"
    assert torch.equal(got[:3], ROW[:3]), "top-k must leave the kept logits as they were"
    tied = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0, 2.0]])
    got = top_k_top_p(impl, tied, k=[2])[0]
    assert kept(got) == [1, 2, 3, 5], (
        f"top_k=2 on {tied[0].tolist()}: kept {kept(got)}, want [1, 2, 3, 5]. Top-k keeps every "
        "logit >= the k-th largest (2.0 here), so tokens tied at the boundary all stay."
    )
    both = torch.stack([ROW, ROW])
    got = top_k_top_p(impl, both, k=[2, V])
    assert kept(got[0]) == [0, 1] and torch.equal(got[1], ROW), (
        f"rows with k = 2 and k = vocab size ({V}, the batch's 'off'): kept {kept(got[0])} and "
        f"{kept(got[1])}; the 'off' row must keep everything."
    )


@pytest.mark.points(2)
def test_top_p_keeps_the_smallest_nucleus_reaching_p(impl):
    probs = ROW.softmax(-1)
    for p in (0.3, 0.5, 0.75, 0.9):
        got = top_k_top_p(impl, ROW.view(1, V), p=[p])[0]
        # The definition: sorted descending, keep tokens until their mass reaches p.
        mass, want = 0.0, []
        for i in probs.argsort(descending=True).tolist():
            want.append(i)
            mass += float(probs[i])
            if mass >= p:
                break
        assert kept(got) == sorted(want), (
            f"top_p={p} on probabilities {[round(float(x), 4) for x in probs]}: kept "
            f"{kept(got)}, want {sorted(want)}, the fewest most likely tokens whose mass "
            "reaches p (drop a token when the mass of it and everything less likely is "
            "<= 1 - p)."
        )
    equal = torch.zeros(1, 4)  # probabilities exactly 0.25 each, sums exactly 0.25, 0.5, ...
    for p in (0.5, 0.75):
        got = top_k_top_p(impl, equal, p=[p])[0]
        assert len(kept(got)) == round(4 * p), (
            f"top_p={p} on four equal logits (probability exactly 0.25 each): kept {kept(got)}, "
            f"want {round(4 * p)} tokens. The mass from the least likely up reaches exactly "
            f"1 - p = {1 - p} at a boundary token: a token is dropped when that sum is <= 1 - p "
            "(not < 1 - p), so the nucleus is exactly p."
        )
    for p in (1e-6, 1e-8):  # in float32, 1 - 1e-8 is 1.0: every cumulative sum is <= 1 - p
        got = top_k_top_p(impl, ROW.view(1, V), p=[p])[0]
        assert kept(got) == [0], (
            f"top_p={p}: kept {kept(got)}; the most likely token always stays, even when its "
            "cumulative sum (1.0, or a hair below) is <= 1 - p."
        )
    got = top_k_top_p(impl, torch.stack([ROW, ROW]), p=[0.5, 1.0])[1]
    assert torch.equal(got, ROW), "a row with top_p = 1.0 ('off') must keep every token"


@pytest.mark.points(2)
def test_top_p_applies_to_what_top_k_left(impl):
    got = top_k_top_p(impl, ROW.view(1, V), k=[4], p=[0.6])[0]
    probs = ROW[:4].softmax(-1)  # the distribution after top-k
    mass, want = 0.0, []
    for i in range(4):
        want.append(i)
        mass += float(probs[i])
        if mass >= 0.6:
            break
    assert kept(got) == want, (
        f"top_k=4 then top_p=0.6: kept {kept(got)}, want {want}. Top-p measures mass in the "
        "softmax of what top-k left (renormalised over 4 tokens), not of the whole row."
    )


@pytest.mark.points(2)
def test_min_p_drops_below_min_p_times_the_best(impl):
    logits = torch.stack([ROW, ROW * 0.5, ROW])
    proc = min_p_processor(impl, [0.2, 0.2, 0.0])
    got = written(proc.apply, logits.clone())
    for row in range(2):
        probs = logits[row].softmax(-1)
        want = [i for i in range(V) if probs[i] >= 0.2 * probs.max()]
        assert kept(got[row]) == want, (
            f"min_p=0.2, row {row} with probabilities {[round(float(x), 4) for x in probs]}: "
            f"kept {kept(got[row])}, want {want}: a token stays when its probability is at least "
            "min_p times the row's LARGEST probability (a relative threshold, not 0.2 itself)."
        )
    assert torch.equal(got[2], logits[2]), "a row with min_p = 0 must keep every token"
    assert torch.equal(got[0, kept(got[0])], logits[0, kept(got[0])]), (
        "min_p masks logits to -inf and leaves the kept ones as they were (not probabilities)"
    )


# ------------------------------------------------------------------ against upstream


@st.composite
def masked_batches(draw):
    vocab = draw(st.integers(2, 40))
    rows = draw(st.integers(1, 6))
    values = st.sampled_from([0.0, 1.0, 1.0, -1.0, 2.5]) | st.floats(-8, 8, width=32)
    logits = torch.tensor(draw(st.lists(values, min_size=rows * vocab, max_size=rows * vocab)))
    k = draw(st.none() | st.lists(st.integers(1, vocab), min_size=rows, max_size=rows))
    edges = [1.0, 1e-8, 0.05, 0.3, 0.5, 0.75, 0.9, 0.99]
    ps = st.sampled_from(edges) | st.floats(0.015625, 1.0, width=32)
    p = draw(st.none() | st.lists(ps, min_size=rows, max_size=rows))
    min_ps = st.sampled_from([0.0, 0.05, 0.2, 0.5, 1.0])
    min_p = draw(st.lists(min_ps, min_size=rows, max_size=rows))
    return logits.view(rows, vocab), k, p, min_p


@pytest.mark.upstream
@pytest.mark.points(8)
@pytest.mark.timeout(120)
@LOCKSTEP
@given(batch=masked_batches())
def test_masks_equal_upstreams_on_generated_batches(impl, up, batch):
    logits, k, p, min_p = batch
    # Drawn batches may use neither filter: an unwritten region fails here instead, on a
    # row with p = 1.0 (off), before upstream's modules are imported.
    written(impl.topk_topp_sampler.apply_top_k_top_p, logits[:1].clone(), None, torch.ones(1))
    kt = None if k is None else torch.tensor(k, dtype=torch.int64)
    pt = None if p is None else torch.tensor(p, dtype=torch.float32)
    got = written(impl.topk_topp_sampler.apply_top_k_top_p, logits.clone(), kt, pt)
    want = up.topk_topp.apply_top_k_top_p_pytorch(logits.clone(), kt, pt, allow_cpu_sync=True)
    assert torch.equal(got, want), (
        f"top-k {k}, top-p {p} on logits\n{logits}\nyours\n{got}\nupstream\n{want}\n"
        "(None: no row uses the filter; k = vocab size and p = 1.0 are 'off' rows)"
    )
    got = written(min_p_processor(impl, min_p).apply, logits.clone())
    want = upstream_min_p(up, min_p).apply(logits.clone())
    assert torch.equal(got, want), (
        f"min_p {min_p} on logits\n{logits}\nyours\n{got}\nupstream\n{want}"
    )


# ------------------------------------------------------------------ chi-square

DRAWS = 20000  # rows of the same logits: one draw each
P_FAIL = 1e-6  # a correct mask fails with about this probability (fixed seed: never, here)
MIN_EXPECTED = 100  # every kept token's expected count; the chi-square law holds well above 5
CASES = {
    # name: (temperature, top_k, top_p, min_p)
    "top_k=4": (1.0, 4, None, 0.0),
    "top_p=0.8": (1.0, None, 0.8, 0.0),
    "top_k=6, top_p=0.7": (1.0, 6, 0.7, 0.0),
    "temperature 0.7, min_p=0.2": (0.7, None, None, 0.2),
}


@pytest.mark.upstream
@pytest.mark.points(3)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CASES))
def test_sampled_frequencies_fit_the_exact_distribution(impl, up, name, monkeypatch):
    """20000 draws from one row through the reference's forward_native with your
    masks; the exact distribution is the softmax of upstream's masked logits.

    Fails when a draw lands on a token upstream's mask removes, or when the
    chi-square statistic over the kept tokens has a p-value below 1e-6 (with
    every expected count >= 100). Fixed seeds: a correct mask passes every
    time; a mask one token too wide draws the extra token hundreds of times,
    and one token too narrow leaves a token expected >= 100 times at 0 (a
    statistic >= 100: p < 1e-17 at these degrees of freedom)."""
    temperature, k, p, min_p = CASES[name]
    for fn in ("apply_top_k_top_p", "apply_top_k_only"):
        monkeypatch.setattr(reference_topk_topp, fn, getattr(impl.topk_topp_sampler, fn))
    logits = (ROW / temperature).repeat(DRAWS, 1)  # float32 [DRAWS, V]
    kt = None if k is None else torch.full((DRAWS,), k, dtype=torch.int64)
    pt = None if p is None else torch.full((DRAWS,), p, dtype=torch.float32)

    exact = logits[:1].clone()  # float32 [1, V]
    if min_p:
        # Every row is the same: your min_p on one row, then copied to all.
        row = written(min_p_processor(impl, [min_p]).apply, logits[:1].clone())
        exact = upstream_min_p(up, [min_p]).apply(exact)
        logits = row.repeat(DRAWS, 1)
    torch.manual_seed(1234)
    sampler = reference_topk_topp.TopKTopPSampler("raw_logprobs")
    tokens, _ = written(sampler.forward_native, logits, {}, kt, pt)
    counts = torch.bincount(tokens, minlength=V).double()

    # Upstream's masks after your draws: an unwritten region fails without the import.
    k1 = None if kt is None else kt[:1]
    p1 = None if pt is None else pt[:1]
    exact = up.topk_topp.apply_top_k_top_p_pytorch(exact, k1, p1, allow_cpu_sync=True)
    probs = exact[0].softmax(-1)
    keep = probs > 0
    expected = probs * DRAWS
    assert float(expected[keep].min()) >= MIN_EXPECTED, "the test's case is too thin"
    outside = {i: int(counts[i]) for i in range(V) if not keep[i] and counts[i]}
    assert not outside, (
        f"{name}: tokens {outside} (token: times drawn) were drawn, but upstream's mask "
        f"removes them: the kept set is {keep.nonzero().view(-1).tolist()}. Your mask keeps "
        "too many tokens."
    )
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - 1
    p_value = chi2_sf(stat, df) if df else 1.0
    assert p_value >= P_FAIL, (
        f"{name}: {DRAWS} draws do not fit the exact distribution: chi-square {stat:.1f} with "
        f"{df} degrees of freedom, p = {p_value:.3g} < {P_FAIL}. Counts per kept token "
        f"{counts[keep].long().tolist()}, expected {[round(float(e)) for e in expected[keep]]}."
        " A kept token drawn far too rarely (or never) means your mask drops it or shifts mass."
    )
