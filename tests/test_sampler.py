"""The sampler on hand-made logits: greedy, temperature, top-k, top-p,
min_tokens, seeded generators, the sampled distribution, and logprobs.

Each expectation is computed independently of the code under test (a
Python reference loop, exact probabilities chosen by hand, or a chi-square
bound), so a wrong filter, a wrong order of steps or a shared random stream
makes a test fail. Random draws are seeded: the suite is deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch

from mini_vllm.sample.logits_processor import LogitsProcessors
from mini_vllm.sample.metadata import SamplingMetadata
from mini_vllm.sample.ops.topk_topp_sampler import apply_top_k_top_p
from mini_vllm.sample.sampler import Sampler

NEG_INF = float("-inf")


def make_metadata(
    temperature,
    *,
    top_k=None,
    top_p=None,
    generators=None,
    logprobs=None,
    blocked=None,
    vocab=None,
) -> SamplingMetadata:
    """Metadata as the persistent batch builds it (InputBatch._make_sampling_metadata).

    A top_k of 0 is stored as ``vocab`` ("off"), as the batch does; the
    generators come as one per row (None: unseeded) and are kept by row.
    """
    temperature = [float(t) for t in temperature]
    n = len(temperature)
    if top_k is not None:
        top_k = [vocab if k == 0 else k for k in top_k]
    gens = {i: g for i, g in enumerate(generators or []) if g is not None}
    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        all_greedy=all(t < 1e-5 for t in temperature),
        all_random=all(t >= 1e-5 for t in temperature),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int64),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        generators=gens,
        max_num_logprobs=logprobs,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n),
        output_token_ids=[],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
        min_tokens_blocked=dict(blocked or {}),
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def kept(row: torch.Tensor) -> set[int]:
    """Token ids a filter left finite."""
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def ref_top_k(logits: list[float], k: int) -> set[int]:
    """Tokens whose logit is at least the k-th largest (ties at the edge stay)."""
    if k <= 0 or k >= len(logits):
        return set(range(len(logits)))
    kth = sorted(logits, reverse=True)[k - 1]
    return {i for i, x in enumerate(logits) if x >= kth}


def ref_top_p(logits: list[float], p: float) -> set[int]:
    """The smallest set of most likely tokens with mass >= p (float64)."""
    m = max(logits)
    weights = [math.exp(x - m) if x != NEG_INF else 0.0 for x in logits]
    total = sum(weights)
    order = sorted(range(len(logits)), key=lambda i: -weights[i])
    keep, mass = set(), 0.0
    for i in order:
        if weights[i] == 0.0:
            break
        keep.add(i)
        mass += weights[i] / total
        if mass >= p:
            break
    return keep


def counts_of(tokens: torch.Tensor, vocab: int) -> list[int]:
    return torch.bincount(tokens, minlength=vocab).tolist()


def chi_square(observed: list[int], expected_probs: list[float]) -> float:
    n = sum(observed)
    stat = 0.0
    for o, p in zip(observed, expected_probs, strict=True):
        if p == 0.0:
            assert o == 0, f"a token of probability 0 was drawn {o} times"
            continue
        stat += (o - n * p) ** 2 / (n * p)
    return stat


# Upper 0.1% points of the chi-square distribution (a seeded run either
# passes or fails for good; a 1-in-1000 bound keeps a correct sampler from
# landing on a failing seed by bad luck when the test is edited).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


# ------------------------------------------------------------------ greedy


def test_greedy_is_argmax():
    logits = torch.randn(6, 100, generator=seeded(0))
    out = Sampler()(logits.clone(), make_metadata([0.0] * 6))
    assert out.sampled_token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None


@pytest.mark.parametrize("vocab", [64, 1000, 3072, 32000, 49152, 151936])
@pytest.mark.parametrize("special", [None, "nan", "-inf", "inf"])
def test_greedy_sample_in_chunks_is_argmax(vocab, special):
    # greedy_sample finds the argmax through chunk maxima on a CPU (chunks of
    # gcd(vocab, 1024) logits; 1000 has none that large): its index must be
    # torch.argmax's, the first maximum, with ties (rounded logits), NaN (argmax
    # takes the first NaN), infinities, and a row that is -inf throughout.
    gen = seeded(vocab)
    logits = torch.randn(7, vocab, generator=gen).mul(2).round()  # many ties
    if special is not None:
        logits[torch.rand(7, vocab, generator=gen) < 0.002] = float(special)
        logits[3, vocab // 2 :] = float(special)
    logits[5] = NEG_INF
    assert torch.equal(Sampler.greedy_sample(logits), logits.argmax(dim=-1))


def test_greedy_rows_stay_argmax_in_a_random_batch():
    # Rows with temperature 0 next to random rows (all_greedy False): the
    # greedy rows must still take the argmax whatever the random stream, and
    # the top-k/top-p values of other rows must not touch them.
    logits = torch.randn(4, 50, generator=seeded(1))
    argmax = logits.argmax(dim=-1).tolist()
    for seed in range(20):
        md = make_metadata(
            [0.0, 1.0, 0.0, 1.5],
            top_k=[0, 5, 0, 0],
            vocab=50,
            top_p=[1.0, 1.0, 1.0, 0.5],
            generators=[seeded(seed)] * 4,
        )
        out = Sampler()(logits.clone(), md).sampled_token_ids.tolist()
        assert out[0] == argmax[0] and out[2] == argmax[2]


def test_temperature_towards_zero_is_greedy():
    # SamplingParams raises a tiny temperature to 1e-2: with logit gaps of
    # at least 1, the runner-up's weight is e^-100 of the top one's.
    vocab = 40
    logits = torch.stack([torch.randperm(vocab, generator=seeded(r)).float() for r in range(8)])
    argmax = logits.argmax(dim=-1).tolist()
    for seed in range(10):
        md = make_metadata([1e-2] * 8, generators=[seeded(100 * seed + r) for r in range(8)])
        assert Sampler()(logits.clone(), md).sampled_token_ids.tolist() == argmax
    # ...while at temperature 1 the same rows do not all follow the argmax.
    hot = logits / 4  # gaps of 0.25: plenty of mass off the top token
    drawn = [
        Sampler()(
            hot.clone(), make_metadata([1.0] * 8, generators=[seeded(s)] * 8)
        ).sampled_token_ids.tolist()
        for s in range(5)
    ]
    assert any(d != argmax for d in drawn)


# ----------------------------------------------------------- top-k / top-p


def test_top_k_keeps_exactly_the_k_largest_and_vocab_disables():
    vocab = 30
    logits = torch.randn(5, vocab, generator=seeded(2))  # distinct values
    ks = [1, 3, 7, vocab - 1, vocab]  # the batch stores vocab_size for "off"
    out = apply_top_k_top_p(logits.clone(), torch.tensor(ks), None)
    for row, k in enumerate(ks):
        expected = ref_top_k(logits[row].tolist(), k)
        assert kept(out[row]) == expected, f"k={k}"
        if 0 < k < vocab:
            assert len(expected) == k
        # Survivors keep their values; the others are -inf.
        mask = torch.isfinite(out[row])
        assert torch.equal(out[row][mask], logits[row][mask])
        assert (out[row][~mask] == NEG_INF).all()


def test_top_k_keeps_ties_at_the_edge():
    # Ties with the k-th largest value are kept (upstream compares < threshold).
    logits = torch.tensor([[5.0, 3.0, 3.0, 1.0, 0.0]])
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2]), None)
    assert kept(out[0]) == {0, 1, 2}


def _from_probs(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log().float()


def test_top_p_keeps_the_smallest_set_reaching_p():
    # One distribution, shuffled so that the filter cannot rely on index order.
    probs = [0.10, 0.50, 0.15, 0.25]  # sorted: 0.50 (1), 0.25 (3), 0.15 (2), 0.10 (0)
    cases = {
        0.30: {1},  # 0.50 alone reaches 0.30
        0.70: {1, 3},  # 0.50 < 0.70 <= 0.75
        0.74: {1, 3},
        0.80: {1, 3, 2},  # 0.75 < 0.80 <= 0.90
        0.95: {0, 1, 2, 3},
        1.00: {0, 1, 2, 3},  # 1.0 switches the filter off
    }
    ps = list(cases)
    logits = _from_probs(*[probs] * len(ps))
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor(ps))
    for row, p in enumerate(ps):
        assert kept(out[row]) == cases[p], f"top_p={p}"
    assert torch.equal(out[-1], logits[-1])


def test_top_p_always_keeps_the_top_token():
    # A flat distribution (top probability 1/20) and top_p values down to
    # where 1 - top_p rounds to 1.0 in float32: the top token must survive.
    logits = torch.randn(3, 20, generator=seeded(3)) * 0.01
    ps = [0.01, 1e-6, 1e-9]
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor(ps))
    for row in range(3):
        assert kept(out[row]) == {int(logits[row].argmax())}


def test_top_p_matches_a_reference_on_random_rows():
    vocab = 64
    gen = seeded(4)
    logits = torch.randn(40, vocab, generator=gen) * 2
    ps = (torch.rand(40, generator=gen) * 0.98 + 0.01).tolist()
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor(ps))
    for row, p in enumerate(ps):
        assert kept(out[row]) == ref_top_p(logits[row].tolist(), p), f"row {row}, top_p={p}"


def test_top_k_then_top_p_on_the_renormalised_top_k():
    probs = [0.1, 0.4, 0.2, 0.3]
    logits = _from_probs(probs, probs, probs, probs)
    # Row 0: top_k=2 leaves {0.4, 0.3}, renormalised {4/7, 3/7}; top_p=0.5 is
    #        reached by 4/7 alone. (On the raw probabilities it would keep
    #        two tokens: 0.4 < 0.5.) Upstream's order: top-k first.
    # Row 1: top_k only (top_p 1.0 is off in this row).
    # Row 2: top_p only (top_k 4 = vocab is off in this row): 0.4+0.3 >= 0.65.
    # Row 3: both off.
    out = apply_top_k_top_p(
        logits.clone(), torch.tensor([2, 3, 4, 4]), torch.tensor([0.5, 1.0, 0.65, 1.0])
    )
    assert kept(out[0]) == {1}
    assert kept(out[1]) == {1, 3, 2}
    assert kept(out[2]) == {1, 3}
    assert kept(out[3]) == {0, 1, 2, 3}


def test_random_rows_never_draw_outside_top_k_top_p():
    vocab = 50
    logits = torch.randn(1, vocab, generator=seeded(5)).expand(400, vocab).clone()
    md = make_metadata(
        [1.0] * 200 + [2.0] * 200,
        top_k=[4] * 200 + [0] * 200,
        top_p=[1.0] * 200 + [0.3] * 200,
        vocab=vocab,
    )
    torch.manual_seed(0)
    drawn = Sampler()(logits.clone(), md).sampled_token_ids
    assert set(drawn[:200].tolist()) <= ref_top_k(logits[0].tolist(), 4)
    assert len(set(drawn[:200].tolist())) > 1 and len(set(drawn[200:].tolist())) > 1
    assert set(drawn[200:].tolist()) <= ref_top_p((logits[0] / 2.0).tolist(), 0.3)


# -------------------------------------------------------------- min_tokens


def test_min_tokens_masks_exactly_the_given_ids():
    logits = torch.randn(3, 20, generator=seeded(6))
    blocked = {0: [int(logits[0].argmax()), 7], 2: [3]}
    out = Sampler.apply_logits_processors(logits.clone(), make_metadata([0.0] * 3, blocked=blocked))
    for row in range(3):
        masked = set((out[row] == NEG_INF).nonzero().flatten().tolist())
        assert masked == set(blocked.get(row, []))
        keep = out[row] != NEG_INF
        assert torch.equal(out[row][keep], logits[row][keep])


def test_min_tokens_blocks_the_sampled_token_greedy_and_random():
    vocab = 20
    logits = torch.randn(2, vocab, generator=seeded(7))
    logits[:, 5] = 10.0  # token 5 (a stop token) would win
    logits[:, 9] = 9.0  # the runner-up
    blocked = {0: [5, 11]}
    out = Sampler()(logits.clone(), make_metadata([0.0, 0.0], blocked=blocked))
    assert out.sampled_token_ids.tolist() == [9, 5]  # row 1 is not blocked
    big = logits[0:1].expand(500, vocab).clone()
    md = make_metadata([1.0] * 500, blocked={r: [5, 11] for r in range(500)})
    torch.manual_seed(1)
    drawn = set(Sampler()(big, md).sampled_token_ids.tolist())
    assert 5 not in drawn and 11 not in drawn and 9 in drawn


# ------------------------------------------------------------------- seeds


def test_same_seed_same_draws_different_seed_different_draws():
    vocab = 1000
    logits = torch.zeros(1, vocab)  # uniform: every draw is pure randomness

    def run(seed):
        gen = seeded(seed)
        return [
            int(
                Sampler()(logits.clone(), make_metadata([1.0], generators=[gen])).sampled_token_ids[
                    0
                ]
            )
            for _ in range(20)
        ]

    a, b, c = run(42), run(42), run(43)
    assert a == b
    assert a != c
    assert len(set(a)) > 10  # the generator advances between steps


def test_a_seeded_row_ignores_the_rest_of_the_batch():
    vocab = 200
    row_logits = torch.randn(1, vocab, generator=seeded(8))
    alone_gen = seeded(7)
    alone = [
        int(
            Sampler()(
                row_logits.clone(), make_metadata([0.8], generators=[alone_gen])
            ).sampled_token_ids[0]
        )
        for _ in range(15)
    ]
    batch_gen = seeded(7)
    in_batch = []
    for step in range(15):
        # Different company every step, the seeded row in a different place.
        others = torch.randn(4, vocab, generator=seeded(1000 + step))
        pos = step % 5
        logits = torch.cat([others[:pos], row_logits, others[pos:]])
        gens = [None, seeded(step), None, None]
        gens.insert(pos, batch_gen)
        temps = [1.0, 0.0, 1.3, 1.0]
        temps.insert(pos, 0.8)
        md = make_metadata(temps, generators=gens)
        in_batch.append(int(Sampler()(logits, md).sampled_token_ids[pos]))
    assert in_batch == alone


# ------------------------------------------------------------ distribution


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_random_sampling_follows_softmax_of_logits_over_t(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.5])
    n = 20000
    torch.manual_seed(1234)
    md = make_metadata([temperature] * n)
    drawn = Sampler()(logits.expand(n, -1).clone(), md).sampled_token_ids
    expected = torch.softmax(logits.double() / temperature, dim=-1).tolist()
    stat = chi_square(counts_of(drawn, 6), expected)
    assert stat < CHI2_999[5], (temperature, counts_of(drawn, 6), expected, stat)


def test_seeded_draws_follow_the_distribution_too():
    # One seeded generator stepping n times (the per-request path).
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    gen = seeded(99)
    drawn = torch.tensor(
        [
            int(
                Sampler()(logits.clone(), make_metadata([1.0], generators=[gen])).sampled_token_ids[
                    0
                ]
            )
            for _ in range(4000)
        ]
    )
    expected = torch.softmax(logits[0].double(), dim=-1).tolist()
    assert chi_square(counts_of(drawn, 4), expected) < CHI2_999[3]


def test_top_k_top_p_sampling_follows_the_renormalised_distribution():
    logits = torch.tensor([1.5, 1.0, 0.8, 0.2, 0.0, -0.3, -2.0])
    temperature, top_k, top_p = 0.8, 5, 0.8
    scaled = (logits.double() / temperature).tolist()
    keep = ref_top_k(scaled, top_k)
    restricted = [x if i in keep else NEG_INF for i, x in enumerate(scaled)]
    keep = ref_top_p(restricted, top_p)
    assert 2 < len(keep) < top_k  # both filters matter
    weights = [math.exp(x) if i in keep else 0.0 for i, x in enumerate(scaled)]
    expected = [w / sum(weights) for w in weights]
    n = 20000
    torch.manual_seed(4321)
    md = make_metadata([temperature] * n, top_k=[top_k] * n, top_p=[top_p] * n)
    drawn = Sampler()(logits.expand(n, -1).clone(), md).sampled_token_ids
    stat = chi_square(counts_of(drawn, 7), expected)
    assert stat < CHI2_999[len(keep) - 1], (counts_of(drawn, 7), expected, stat)


# ---------------------------------------------------------------- logprobs


def test_logprobs_sampled_first_then_top_n_with_rank():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0], [4.0, 0.5, 0.0, 1.0, 2.0]])
    raw = torch.log_softmax(logits, dim=-1)
    # Row 0 greedy; row 1 is forced off its argmax by min_tokens (token 0
    # blocked) and runs at temperature 0.5: logprobs stay those of the raw
    # logits, before masking and temperature.
    md = make_metadata(
        [0.0, 0.5],
        top_k=[0, 1],
        logprobs=3,
        blocked={1: [0]},
        generators=[None, seeded(0)],
        vocab=5,
    )
    out = Sampler()(logits.clone(), md)
    assert out.sampled_token_ids.tolist() == [1, 4]  # top_k=1 after blocking 0: token 4
    (ids0, vals0, rank0), (ids1, vals1, rank1) = out.logprobs
    assert ids0 == [1, 1, 3, 2] and rank0 == 1
    assert ids1 == [4, 0, 4, 3] and rank1 == 2
    for row, (ids, vals) in enumerate([(ids0, vals0), (ids1, vals1)]):
        assert vals == pytest.approx(raw[row, ids].tolist(), abs=1e-6)
        assert vals[1:] == sorted(vals[1:], reverse=True)


def test_logprobs_zero_gives_only_the_sampled_token():
    logits = torch.randn(3, 30, generator=seeded(9))
    md = make_metadata([1.0, 1.0, 0.0], logprobs=0, generators=[seeded(1), seeded(2), None])
    out = Sampler()(logits.clone(), md)
    raw = torch.log_softmax(logits, dim=-1)
    for row, (ids, vals, rank) in enumerate(out.logprobs):
        tok = int(out.sampled_token_ids[row])
        assert ids == [tok]
        assert vals == pytest.approx([float(raw[row, tok])], abs=1e-6)
        assert rank == 1 + int((raw[row] > raw[row, tok]).sum())


def test_logprob_rank_of_a_random_draw():
    vocab = 100
    logits = torch.randn(1, vocab, generator=seeded(10))
    raw = torch.log_softmax(logits[0], dim=-1)
    order = raw.argsort(descending=True).tolist()
    ranks = set()
    for seed in range(30):
        md = make_metadata([3.0], logprobs=2, generators=[seeded(seed)])
        out = Sampler()(logits.clone(), md)
        tok = int(out.sampled_token_ids[0])
        ids, vals, rank = out.logprobs[0]
        assert ids[0] == tok and rank == order.index(tok) + 1
        assert ids[1:] == order[:2]
        assert vals[0] == pytest.approx(float(raw[tok]), abs=1e-6)
        ranks.add(rank)
    assert len(ranks) > 3  # a hot temperature reaches past the top tokens


def test_rank_counts_ties_as_upstream_does():
    """Two tokens share the top logprob; greedy picks the first. Upstream's
    rank counts every token at least as likely as the sampled one (itself
    included), so the sampled token's rank is 2, not 1."""
    logits = torch.tensor([[2.0, 2.0, 0.0]])
    out = Sampler()(logits.clone(), make_metadata([0.0], logprobs=1))
    ((ids, _vals, rank),) = out.logprobs
    assert ids[0] == 0 and rank == 2


def test_min_tokens_does_not_modify_the_callers_logits():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    before = logits.clone()
    Sampler()(logits, make_metadata([0.0], blocked={0: [1]}))
    assert torch.equal(logits, before)
