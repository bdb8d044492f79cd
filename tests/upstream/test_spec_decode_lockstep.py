"""Live lockstep: mini_vllm's n-gram proposer and rejection sampler against
the pinned upstream's, on generated inputs.

- ``NgramProposer.propose`` against upstream's (numba compiled, built from a
  duck-typed config): the same drafts for every request of generated token
  histories, over small alphabets so that repeats (and ties between equally
  long matches) are common.
- ``rejection_sample`` against upstream's Triton kernels run under the
  interpreter (vllm.v1.sample.rejection_sampler reloaded with the real
  Triton): greedy, random and mixed batches, with and without draft
  probabilities, with and without per-request seeds. Both sides get the same
  global seed and fresh generators with the same seeds, so the random draws
  line up and the outputs must be equal token for token.
- ``apply_sampling_constraints`` (temperature, top-k, top-p per target row)
  and ``parse_output`` against upstream's.

MINI_VLLM_SPEC_LOCKSTEP_EXAMPLES sets the number of generated cases (default 40).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mini_vllm.oracle.spec_workload import (
    mini_sampling_metadata,
    ngram_cases,
    ngram_inputs,
    rejection_cases,
    run_rejection_sample,
    upstream_ngram,
    upstream_rejection_sampler,
)
from mini_vllm.sample.rejection_sampler import (
    RejectionSampler,
    apply_sampling_constraints,
    rejection_sample,
)
from mini_vllm.spec_decode.metadata import SpecDecodeMetadata
from mini_vllm.spec_decode.ngram_proposer import NgramProposer
from mini_vllm.tiers import examples

pytestmark = [
    pytest.mark.upstream,
    # Upstream's numba kernel takes a Python list; numba warns that it will
    # stop reflecting lists one day.
    pytest.mark.filterwarnings("ignore::numba.core.errors.NumbaPendingDeprecationWarning"),
]

EXAMPLES = examples(40, 20, "MINI_VLLM_SPEC_LOCKSTEP_EXAMPLES")
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ------------------------------------------------------------------ n-gram


# Hand-picked edges: ties between equally long matches, a match longer than
# max_n, an overlapping occurrence, k capped by max_model_len and by the end,
# a context of exactly max_model_len, one shorter than min_n.
@example((2, 3, 3, 16, [[1, 2, 9, 1, 2, 8, 1, 2]], [True]))
@example((1, 2, 4, 16, [[5, 5, 5, 5, 5]], [True]))
@example((2, 2, 5, 9, [[1, 2, 3, 4, 1, 2, 3, 1, 2]], [True]))
@example((1, 5, 5, 12, [[3, 1, 2, 3, 1, 2, 3, 4, 0, 1, 2, 3]], [True]))
@example((2, 4, 3, 6, [[1, 2, 1, 2, 1, 2], [1, 2, 1, 2, 1]], [True, True]))
@example((3, 4, 2, 8, [[1, 1], [4, 1, 2, 3, 1, 2, 3]], [True, False]))
@SETTINGS
@given(case=ngram_cases())
def test_ngram_proposer_lockstep_with_upstream(counts, case):
    min_n, max_n, k, max_model_len, histories, sampled = case
    inputs = ngram_inputs(max_model_len, histories, sampled)
    expected = upstream_ngram(min_n, max_n, k, max_model_len).propose(*inputs)
    got = NgramProposer(min_n, max_n, k, max_model_len).propose(*inputs)
    assert got == expected, (case, got, expected)
    counts["spec lockstep ngram examples"] = counts.get("spec lockstep ngram examples", 0) + 1
    drafted = sum(1 for d in expected if d)
    counts["spec lockstep ngram drafts"] = counts.get("spec lockstep ngram drafts", 0) + drafted


# ------------------------------------------------------------------ rejection sampling


@pytest.mark.parametrize("mode", ["greedy", "random", "mixed"])
def test_rejection_sample_lockstep_with_upstream(counts, mode):
    @SETTINGS
    @given(case=rejection_cases(mode))
    def check(case):
        got, expected, problem = run_rejection_sample(case, rejection_sample)
        assert problem is None, problem
        assert got.dtype == expected.dtype == torch.int32
        assert torch.equal(got, expected), (case, got, expected)
        vocab = case[1].shape[-1]
        assert (
            RejectionSampler.parse_output(got, vocab)
            == (upstream_rejection_sampler().RejectionSampler.parse_output(expected, vocab)[0])
        )
        key = f"spec lockstep rejection {mode} examples"
        counts[key] = counts.get(key, 0) + 1
        num_out = (got != -1).sum(dim=1)  # [batch]
        rejected = int((num_out <= torch.tensor(case[0])).sum())
        counts[f"spec lockstep rejection {mode} rows with a rejection"] = (
            counts.get(f"spec lockstep rejection {mode} rows with a rejection", 0) + rejected
        )

    check()


@st.composite
def constraint_cases(draw):
    batch = draw(st.integers(1, 3))
    vocab = draw(st.integers(2, 12))
    num_draft_tokens = draw(st.lists(st.integers(0, 3), min_size=batch, max_size=batch))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    logits = torch.randn(sum(num_draft_tokens), vocab, generator=g)  # [num_tokens, vocab]
    temperature = draw(st.lists(st.sampled_from([0.0, 0.5, 2.0]), min_size=batch, max_size=batch))
    top_k = draw(st.none() | st.lists(st.integers(1, vocab), min_size=batch, max_size=batch))
    top_p = draw(st.none() | st.lists(st.floats(0.1, 1.0), min_size=batch, max_size=batch))
    return num_draft_tokens, logits, temperature, top_k, top_p


@SETTINGS
@given(case=constraint_cases())
def test_apply_sampling_constraints_lockstep_with_upstream(case):
    num_draft_tokens, logits, temperature, top_k, top_p = case
    meta = SpecDecodeMetadata.make_dummy([[0] * n for n in num_draft_tokens])
    temp = torch.tensor(temperature, dtype=torch.float32)  # [batch]
    k = None if top_k is None else torch.tensor(top_k)  # [batch]
    p = None if top_p is None else torch.tensor(top_p, dtype=torch.float32)  # [batch]
    all_greedy = all(t == 0 for t in temperature)
    upstream_meta = SimpleNamespace(temperature=temp, all_greedy=all_greedy, top_k=k, top_p=p)
    expected = upstream_rejection_sampler().apply_sampling_constraints(
        logits.clone(), meta.cu_num_draft_tokens, upstream_meta
    )
    mini_meta = mini_sampling_metadata(temperature, [None] * len(temperature))
    mini_meta.top_k, mini_meta.top_p = k, p
    got = apply_sampling_constraints(logits.clone(), meta.num_draft_tokens, mini_meta)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "logprobs_mode", ["raw_logprobs", "raw_logits", "processed_logits", "processed_logprobs"]
)
def test_logprobs_of_every_output_position_lockstep_with_upstream(logprobs_mode):
    """A greedy batch through mini's RejectionSampler with logprobs asked,
    against upstream's ``_get_logprobs_tensors`` on the same logits and the
    same output tokens: every draft position of every request (accepted, or
    rejected and scored for token 0) and every kept bonus position equals
    upstream's (token ids, values, rank)."""
    import dataclasses

    from vllm.v1.sample.rejection_sampler import RejectionSampler as UpstreamRejectionSampler
    from vllm.v1.sample.sampler import Sampler as UpstreamSampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata as UpstreamMetadata

    from mini_vllm.sample.sampler import Sampler

    vocab, lengths, num_logprobs = 12, [3, 0, 2, 1], 3
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(sum(lengths) + len(lengths), vocab, generator=g)  # [rows, vocab]
    # Each request's rows: one per draft, then its bonus row (make_dummy leaves them 0).
    starts = [sum(lengths[:r]) + r for r in range(len(lengths))]
    rows = {
        "target_logits_indices": torch.tensor(
            [s + i for s, n in zip(starts, lengths, strict=True) for i in range(n)],
            dtype=torch.int32,
        ),
        "bonus_logits_indices": torch.tensor(
            [s + n for s, n in zip(starts, lengths, strict=True)], dtype=torch.int32
        ),
    }
    argmax = logits[rows["target_logits_indices"]].argmax(dim=-1).tolist()  # [num_tokens]
    # Request 0 all accepted (its bonus kept), 2 rejected at its second draft, 3 at its first.
    agree = [True, True, True, True, False, False]
    flat = [a if ok else (a + 1) % vocab for a, ok in zip(argmax, agree, strict=True)]
    drafts = [flat[0:3], [], flat[3:5], flat[5:6]]
    meta = dataclasses.replace(SpecDecodeMetadata.make_dummy(drafts), **rows)
    sampling = dataclasses.replace(
        mini_sampling_metadata([0.0] * len(lengths), [None] * len(lengths)),
        max_num_logprobs=num_logprobs,
    )
    out = RejectionSampler(Sampler(logprobs_mode))(meta, None, logits.clone(), sampling)
    tokens = out.sampled_token_ids  # [batch, max_spec_len + 1]
    assert (tokens >= 0).sum(dim=1).tolist() == [4, 1, 2, 1]

    up_meta = dataclasses.replace(UpstreamMetadata.make_dummy(drafts, torch.device("cpu")), **rows)
    expected = UpstreamRejectionSampler(UpstreamSampler(logprobs_mode))._get_logprobs_tensors(
        num_logprobs,
        up_meta,
        logits,
        logits[up_meta.target_logits_indices].float(),
        logits[up_meta.bonus_logits_indices].float(),  # all greedy: processed is raw
        tokens,
    )
    width = tokens.shape[1]
    for req, n in enumerate(lengths):
        assert len(out.logprobs[req]) == n + 1
        for pos, (ids, vals, rank) in enumerate(out.logprobs[req]):
            if pos == n and tokens[req, n] < 0:
                continue  # no bonus token: mini's entry is the bonus row's, upstream's token 0's
            i = req * width + pos
            assert ids == expected.logprob_token_ids[i].tolist(), (req, pos)
            assert vals == pytest.approx(expected.logprobs[i].tolist(), abs=1e-5), (req, pos)
            assert rank == int(expected.selected_token_ranks[i]), (req, pos)
