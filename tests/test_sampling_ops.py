"""Properties of the sampling building blocks, without upstream.

Each test states a rule from the definitions the modules' docstrings give
(top-p's smallest prefix, min_p's threshold, what each penalty reads, bad
words matching the output's end, the exponential race's distribution and
seeding) and checks mini_vllm.sample's code against an independent
computation of it. tests/upstream/test_sampling_ops_lockstep.py checks the
same code against upstream's functions.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_vllm.sample import logits_processor as lp
from mini_vllm.sample.ops.allowed_token_ids import allowed_token_ids_mask, apply_allowed_token_ids
from mini_vllm.sample.ops.bad_words import apply_bad_words
from mini_vllm.sample.ops.penalties import apply_all_penalties
from mini_vllm.sample.ops.topk_topp_sampler import apply_top_k_top_p, random_sample

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)
NEG_INF = float("-inf")


@st.composite
def rows_of_logits(draw, max_vocab=16):
    vocab = draw(st.integers(2, max_vocab))
    values = st.one_of(st.sampled_from([0.0, 1.0, 1.0, 2.5]), st.floats(-6, 6, width=32))
    return torch.tensor(draw(st.lists(values, min_size=vocab, max_size=vocab))).view(1, vocab)


# ---------------------------------------------------------------- top-k / top-p


@SETTINGS
@given(logits=rows_of_logits(), p=st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_prefix_reaching_p(logits, p):
    kept = apply_top_k_top_p(logits.clone(), None, torch.tensor([p]))[0] > NEG_INF  # bool [V]
    probs = logits[0].double().softmax(dim=0)  # float64 [V]
    # A most likely token survives (ties are split by the sort's order).
    assert probs[kept].max() == probs.max()
    # The kept tokens are a prefix of the descending order: none dropped outranks a kept one.
    if (~kept).any():
        assert probs[~kept].max() <= probs[kept].min()
    mass = float(probs[kept].sum())
    assert mass >= p - 1e-5, (mass, p)
    if kept.sum() > 1:  # without its least likely token the prefix falls short of p
        assert mass - float(probs[kept].min()) < p + 1e-5, (mass, p)


@SETTINGS
@given(logits=rows_of_logits(), data=st.data())
def test_top_k_keeps_every_logit_at_least_the_kth_largest(logits, data):
    vocab = logits.shape[1]
    k = data.draw(st.integers(1, vocab))
    for p in (None, torch.tensor([1.0])):  # the top-k-only path and the sorted one
        out = apply_top_k_top_p(logits.clone(), torch.tensor([k]), p)[0]
        kth = logits[0].sort(descending=True).values[k - 1]
        assert torch.equal(out > NEG_INF, logits[0] >= kth)
        assert torch.equal(out[out > NEG_INF], logits[0][logits[0] >= kth])


def test_filters_off_leave_logits_unchanged():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    out = apply_top_k_top_p(logits.clone(), torch.full((3,), 10), torch.ones(3))
    assert torch.equal(out, logits)


# ---------------------------------------------------------------- min_p


def _config(max_num_seqs=4):
    return SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))


def _params(min_p=0.0, logit_bias=None, min_tokens=0, stop=()):
    return SimpleNamespace(
        min_p=min_p, logit_bias=logit_bias, min_tokens=min_tokens, all_stop_token_ids=set(stop)
    )


@SETTINGS
@given(logits=rows_of_logits(), min_p=st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0)))
def test_min_p_keeps_tokens_at_least_min_p_times_the_top(logits, min_p):
    proc = lp.MinPLogitsProcessor(_config(), torch.device("cpu"), False)
    proc.update_state(lp.BatchUpdate(1, removed=[], added=[(0, _params(min_p), [], [])], moved=[]))
    out = proc.apply(logits.clone())[0]
    probs = logits[0].softmax(dim=0)  # float32 [V]
    assert torch.equal(out > NEG_INF, probs >= min_p * probs.max())
    assert out[logits[0].argmax()] > NEG_INF
    assert proc.is_argmax_invariant()


# ---------------------------------------------------------------- penalties


@SETTINGS
@given(data=st.data())
def test_penalties_follow_their_definitions(data):
    vocab = data.draw(st.integers(2, 8))
    logits = data.draw(rows_of_logits(max_vocab=8).filter(lambda t: t.shape[1] == vocab))
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
    output = data.draw(st.lists(st.integers(-1, vocab - 1), max_size=6))
    rep, freq, pres = 1.5, 0.25, 0.5
    out = apply_all_penalties(
        logits.clone(),
        torch.tensor([prompt]),
        torch.tensor([pres]),
        torch.tensor([freq]),
        torch.tensor([rep]),
        [output],
    )[0]
    for token in range(vocab):
        value = float(logits[0, token])
        if token in prompt or token in output:  # repetition: prompt and output
            value = value / rep if value > 0 else value * rep
        count = output.count(token)  # frequency and presence: output only, -1 ignored
        value -= freq * count + (pres if count else 0.0)
        assert math.isclose(float(out[token]), value, rel_tol=1e-6, abs_tol=1e-6), token


def test_prompt_padding_with_vocab_size_counts_for_nothing():
    logits = torch.ones(2, 4)
    prompts = torch.tensor([[2, 4, 4], [1, 3, 4]])  # rows padded with vocab_size 4
    no_penalty = torch.zeros(2)
    out = apply_all_penalties(
        logits, prompts, no_penalty, no_penalty, torch.full((2,), 2.0), [[], []]
    )
    assert out.tolist() == [[1.0, 1.0, 0.5, 1.0], [1.0, 0.5, 1.0, 0.5]]


# ---------------------------------------------------------------- bad words, allowed ids


def test_bad_words_match_the_end_of_the_output_only():
    logits = torch.zeros(3, 6)
    bad = {0: [[5]], 1: [[2, 3]], 2: [[2, 3], [1, 4, 0]]}
    # Row 2's output ends with 1, 4 but row 1's ends with 3, not 2.
    apply_bad_words(logits, bad, [[], [2, 3], [2, 1, 4]])
    banned = (logits == NEG_INF).nonzero().tolist()
    assert banned == [[0, 5], [2, 0]]


@SETTINGS
@given(data=st.data())
def test_allowed_token_ids_leave_only_those_tokens(data):
    rows, vocab = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 10))
    allowed = {
        row: data.draw(st.lists(st.integers(0, vocab - 1), min_size=1))
        for row in range(rows)
        if data.draw(st.booleans())
    }
    mask = allowed_token_ids_mask(allowed, rows, vocab)
    out = apply_allowed_token_ids(torch.zeros(rows, vocab), mask)
    for row in range(rows):
        finite = set((out[row] > NEG_INF).nonzero().flatten().tolist())
        assert finite == set(allowed.get(row, range(vocab)))


# ---------------------------------------------------------------- random sampling


def test_exponential_race_draws_with_the_given_probabilities():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draws = 4000
    gen = torch.Generator().manual_seed(1234)
    tokens = [int(random_sample(probs.view(1, 4).clone(), {0: gen})) for _ in range(draws)]
    observed = torch.bincount(torch.tensor(tokens), minlength=4).double()
    expected = probs.double() * draws
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (chi2, observed.tolist())  # chi-square, 3 degrees of freedom, p = 0.001


def test_seeded_row_draws_the_same_token_in_any_batch():
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    alone = random_sample(probs[2:3].clone(), {0: torch.Generator().manual_seed(7)})
    torch.manual_seed(99)  # the unseeded rows draw from the global generator
    batched = random_sample(probs.clone(), {2: torch.Generator().manual_seed(7)})
    assert batched[2] == alone[0]


def test_all_rows_seeded_leave_the_global_generator_alone():
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    random_sample(torch.full((2, 3), 1 / 3), {0: torch.Generator(), 1: torch.Generator()})
    assert torch.equal(torch.random.get_rng_state(), before)


# ---------------------------------------------------------------- batch updates


def test_batch_update_builder_orders_removals_and_resets():
    builder = lp.BatchUpdateBuilder()
    assert builder.get_and_reset(0) is None
    for row in (1, 4, 2):
        builder.removed_append(row)
    assert builder.removed == [4, 2, 1]
    with pytest.raises(RuntimeError, match="removed"):
        builder.removed_append(0)
    assert builder.pop_removed() == 1
    update = builder.get_and_reset(3)
    assert (update.batch_size, list(update.removed)) == (3, [4, 2])
    assert builder.get_and_reset(3) is None


def test_min_tokens_blocks_stop_tokens_until_the_output_is_long_enough():
    proc = lp.MinTokensLogitsProcessor(_config(), torch.device("cpu"), False)
    output: list[int] = []
    params = _params(min_tokens=2, stop=(0, 3))
    proc.update_state(lp.BatchUpdate(2, removed=[], added=[(1, params, [], output)], moved=[]))
    blocked = proc.apply(torch.zeros(2, 4)) == NEG_INF
    assert blocked.nonzero().tolist() == [[1, 0], [1, 3]]
    output += [2, 2]  # the live list grows; no batch change
    proc.update_state(None)
    assert not (proc.apply(torch.zeros(2, 4)) == NEG_INF).any()


def test_state_follows_swaps_and_one_way_moves():
    bias = lp.LogitBiasLogitsProcessor(_config(), torch.device("cpu"), False)
    min_p = lp.MinPLogitsProcessor(_config(), torch.device("cpu"), False)
    added = [(0, _params(0.5, {1: 1.0}), [], []), (2, _params(0.25, {3: -1.0}), [], [])]
    steps = [
        lp.BatchUpdate(3, removed=[], added=added, moved=[]),
        lp.BatchUpdate(3, removed=[], added=[], moved=[(0, 2, lp.MoveDirectionality.SWAP)]),
        # Row 1 left; the batch condenses row 2 into it.
        lp.BatchUpdate(
            2, removed=[1], added=[], moved=[(2, 1, lp.MoveDirectionality.UNIDIRECTIONAL)]
        ),
    ]
    for step in steps:
        bias.update_state(step)
        min_p.update_state(step)
    assert bias.biases == {0: {3: -1.0}, 1: {1: 1.0}}
    assert [min_p.get_min_p_by_index(i) for i in range(4)] == [0.25, 0.5, 0.0, 0.0]
    assert min_p.min_p_count == 2
    assert min_p.min_p.shape == (2, 1)
