"""Random-mode speculation leaves the output distributed exactly as the
target model's (mini_vllm/sample/rejection_sampler.py), checked by a
chi-square test on the first output token; plus the output layout and the
input errors. Upstream equality is in tests/upstream/test_spec_decode_lockstep.py.

Each check verifies one draft per request for many identical requests in
one call, with fixed seeds, so the counts are reproducible. The p-value
comes from the chi-square survival function, ``gammaincc(dof / 2, x / 2)``.
"""

from __future__ import annotations

import pytest
import torch

from mini_vllm.sample.logits_processor import LogitsProcessors
from mini_vllm.sample.metadata import SamplingMetadata
from mini_vllm.sample.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    RejectionSampler,
    rejection_sample,
)
from mini_vllm.sample.sampler import Sampler
from mini_vllm.spec_decode.metadata import SpecDecodeMetadata
from mini_vllm.spec_decode.ngram_proposer import NgramProposer

VOCAB = 6
NUM_REQUESTS = 20_000
TARGET_LOGITS = torch.tensor([1.5, 0.2, -0.7, 0.9, -2.0, 0.4])  # [vocab]


def _random_metadata(batch: int, temperature: float = 1.0) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((batch,), temperature),
        all_greedy=False,
        all_random=True,
        top_k=None,
        top_p=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
        min_tokens_blocked={},
    )


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()  # [vocab]
    statistic = ((counts.double() - expected) ** 2 / expected).sum()
    dof = torch.tensor(counts.numel() - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


def _first_tokens(draft_token_ids, draft_probs, temperature: float = 1.0) -> torch.Tensor:
    """The first output token of each of NUM_REQUESTS one-draft requests."""
    torch.manual_seed(0)
    meta = SpecDecodeMetadata.make_dummy([[int(t)] for t in draft_token_ids])
    target_logits = (TARGET_LOGITS / temperature).repeat(NUM_REQUESTS, 1)  # [requests, vocab]
    bonus = torch.zeros(NUM_REQUESTS, dtype=torch.int32)  # [requests]
    out = rejection_sample(
        meta.draft_token_ids,
        meta.num_draft_tokens,
        meta.max_spec_len,
        meta.cu_num_draft_tokens,
        draft_probs,
        target_logits,
        bonus,
        _random_metadata(NUM_REQUESTS, temperature),
    )  # [requests, 2]
    return out[:, 0]


def test_ngram_draft_keeps_the_target_distribution():
    # An n-gram draft has no probabilities: the same token every time.
    target = TARGET_LOGITS.softmax(dim=-1)  # [vocab]
    for draft in (0, 4):  # the most likely token, and an unlikely one
        first = _first_tokens(torch.full((NUM_REQUESTS,), draft), None)
        counts = torch.bincount(first.long(), minlength=VOCAB)  # [vocab]
        assert _chi_square_p_value(counts, target) > 1e-3, (draft, counts)
        # The draft alone would be far from the target: the test can tell.
        assert (
            _chi_square_p_value(
                torch.bincount(torch.full((NUM_REQUESTS,), draft), minlength=VOCAB), target
            )
            < 1e-9
        )


def test_draft_model_probabilities_keep_the_target_distribution():
    g = torch.Generator().manual_seed(1)
    q = torch.tensor([0.05, 0.4, 0.3, 0.05, 0.15, 0.05])  # [vocab], far from the target
    drafts = torch.multinomial(q, NUM_REQUESTS, replacement=True, generator=g)  # [requests]
    draft_probs = q.repeat(NUM_REQUESTS, 1)  # [requests, vocab]
    first = _first_tokens(drafts, draft_probs, temperature=0.7)
    counts = torch.bincount(first.long(), minlength=VOCAB)  # [vocab]
    target = (TARGET_LOGITS / 0.7).softmax(dim=-1)  # [vocab]
    assert _chi_square_p_value(counts, target) > 1e-3, counts
    assert _chi_square_p_value(torch.bincount(drafts, minlength=VOCAB), target) < 1e-9


def test_output_layout_and_parse_output():
    # Request 0: both drafts match the argmax (token 0) -> drafts + bonus.
    # Request 1: first draft wrong -> the argmax, then placeholders.
    # Request 2: no drafts -> the bonus token alone.
    meta = SpecDecodeMetadata.make_dummy([[0, 0], [3, 0], []])
    logits = torch.zeros(4 + 3, VOCAB)  # [num_tokens + batch, vocab]
    logits[:, 0] = 5.0
    meta.target_logits_indices = torch.tensor([0, 1, 3, 4], dtype=torch.int32)
    meta.bonus_logits_indices = torch.tensor([2, 5, 6], dtype=torch.int32)
    logits[2, 5] = 9.0  # request 0's bonus row prefers token 5
    greedy = _random_metadata(3, temperature=0.0)
    greedy.all_greedy, greedy.all_random = True, False
    out = RejectionSampler(Sampler())(meta, None, logits, greedy).sampled_token_ids
    assert out.dtype == torch.int32 and out.shape == (3, 3)
    assert out.tolist() == [[0, 0, 5], [0, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID], [0, -1, -1]]
    assert RejectionSampler.parse_output(out, VOCAB) == [[0, 0, 5], [0], [0]]
    assert RejectionSampler.parse_output(out, VOCAB, discard_req_indices=[1]) == [
        [0, 0, 5],
        [],
        [0],
    ]
    assert RejectionSampler.parse_output(out, 5) == [[0, 0], [0], [0]]  # ids >= vocab dropped


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2, 1, 16)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(0, 2, 1, 16)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(1, 2, 0, 16)
    meta = SpecDecodeMetadata.make_dummy([[1, 2]])
    with pytest.raises(ValueError, match="must agree"):
        rejection_sample(
            meta.draft_token_ids,
            meta.num_draft_tokens,
            meta.max_spec_len,
            meta.cu_num_draft_tokens,
            None,
            torch.zeros(3, VOCAB),
            torch.zeros(1, dtype=torch.int32),
            _random_metadata(1),
        )
