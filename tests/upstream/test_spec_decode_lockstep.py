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

import importlib
import os
import types

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mini_vllm.sample.logits_processor import LogitsProcessors
from mini_vllm.sample.metadata import SamplingMetadata
from mini_vllm.sample.rejection_sampler import (
    RejectionSampler,
    apply_sampling_constraints,
    rejection_sample,
)
from mini_vllm.spec_decode.metadata import SpecDecodeMetadata
from mini_vllm.spec_decode.ngram_proposer import NgramProposer

pytestmark = [
    pytest.mark.upstream,
    # Upstream's numba kernel takes a Python list; numba warns that it will
    # stop reflecting lists one day.
    pytest.mark.filterwarnings("ignore::numba.core.errors.NumbaPendingDeprecationWarning"),
]

EXAMPLES = int(os.environ.get("MINI_VLLM_SPEC_LOCKSTEP_EXAMPLES", "40"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MAX_NUM_SEQS = 4

_upstream_rs = None


def upstream_rejection_sampler():
    """vllm.v1.sample.rejection_sampler reloaded with the real Triton, so its
    kernels run (under TRITON_INTERPRET=1 on a CPU, set by tests/conftest.py).
    vLLM put placeholders in vllm.triton_utils when it found no GPU driver."""
    global _upstream_rs
    if _upstream_rs is None:
        import triton
        import triton.language as tl
        import vllm.triton_utils as tu

        if not torch.cuda.is_available():
            assert os.environ.get("TRITON_INTERPRET") == "1"
        saved = tu.triton, tu.tl
        tu.triton, tu.tl = triton, tl
        try:
            _upstream_rs = importlib.reload(
                importlib.import_module("vllm.v1.sample.rejection_sampler")
            )
        finally:
            tu.triton, tu.tl = saved
    return _upstream_rs


# ------------------------------------------------------------------ n-gram


def upstream_ngram(min_n: int, max_n: int, k: int, max_model_len: int):
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer as UpstreamNgramProposer

    ns = types.SimpleNamespace
    config = ns(
        speculative_config=ns(
            prompt_lookup_min=min_n, prompt_lookup_max=max_n, num_speculative_tokens=k
        ),
        model_config=ns(max_model_len=max_model_len),
        scheduler_config=ns(max_num_seqs=MAX_NUM_SEQS),
        parallel_config=ns(tensor_parallel_size=1),
    )
    return UpstreamNgramProposer(config)


@st.composite
def ngram_cases(draw):
    min_n = draw(st.integers(1, 4))
    max_n = draw(st.integers(min_n, 6))
    k = draw(st.integers(1, 5))
    max_model_len = draw(st.integers(4, 32))
    alphabet = draw(st.integers(1, 4))
    histories = []
    for _ in range(draw(st.integers(1, MAX_NUM_SEQS))):
        length = max_model_len - draw(st.integers(0, max_model_len))
        token = st.integers(0, alphabet - 1)
        if draw(st.booleans()):
            # Repetitive text: a motif repeated, some tokens changed.
            motif = draw(st.lists(token, min_size=1, max_size=5))
            history = (motif * length)[:length]
            for pos in draw(st.lists(st.integers(0, max(length - 1, 0)), max_size=3)):
                if length:
                    history[pos] = draw(token)
        else:
            history = draw(st.lists(token, min_size=length, max_size=length))
        histories.append(history)
    # Mostly decoding requests (a prefill chunk samples nothing and gets no draft).
    sampled = [draw(st.sampled_from([True, True, True, False])) for _ in histories]
    return min_n, max_n, k, max_model_len, histories, sampled


def _ngram_inputs(max_model_len, histories, sampled):
    token_ids = np.zeros((len(histories), max_model_len), dtype=np.int32)  # [batch, max_model_len]
    for i, history in enumerate(histories):
        token_ids[i, : len(history)] = history
    num_tokens = np.array([len(h) for h in histories], dtype=np.int32)  # [batch]
    sampled_ids = [[7] if s else [] for s in sampled]
    return sampled_ids, num_tokens, token_ids


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
    inputs = _ngram_inputs(max_model_len, histories, sampled)
    expected = upstream_ngram(min_n, max_n, k, max_model_len).propose(*inputs)
    got = NgramProposer(min_n, max_n, k, max_model_len).propose(*inputs)
    assert got == expected, (case, got, expected)
    counts["spec lockstep ngram examples"] = counts.get("spec lockstep ngram examples", 0) + 1
    drafted = sum(1 for d in expected if d)
    counts["spec lockstep ngram drafts"] = counts.get("spec lockstep ngram drafts", 0) + drafted


# ------------------------------------------------------------------ rejection sampling


@st.composite
def rejection_cases(draw, mode: str):
    batch = draw(st.integers(1, 3))
    vocab = draw(st.integers(2, 12))
    num_draft_tokens = draw(st.lists(st.integers(0, 3), min_size=batch, max_size=batch))
    num_tokens = sum(num_draft_tokens)
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    # Coarse logits: argmax ties happen, and drafts often agree with the target.
    target_logits = torch.randint(-3, 4, (num_tokens, vocab), generator=g).float()
    target_logits *= draw(st.sampled_from([0.5, 1.0, 3.0]))  # [num_tokens, vocab]
    argmax = target_logits.argmax(dim=-1)  # [num_tokens]
    random_ids = torch.randint(0, vocab, (num_tokens,), generator=g)  # [num_tokens]
    agree = torch.rand(num_tokens, generator=g) < 0.6  # [num_tokens]
    draft_token_ids = torch.where(agree, argmax, random_ids).int()  # [num_tokens]
    draft_probs = None
    if mode != "greedy" and draw(st.booleans()):
        draft_probs = torch.rand(num_tokens, vocab, generator=g)  # [num_tokens, vocab]
        draft_probs[torch.rand(num_tokens, vocab, generator=g) < 0.2] = 0.0
        draft_probs[torch.arange(num_tokens), draft_token_ids.long()] += 0.05
        draft_probs /= draft_probs.sum(dim=-1, keepdim=True)
    if mode == "greedy":
        temperature = [0.0] * batch
    elif mode == "random":
        temperature = draw(st.lists(st.sampled_from([0.5, 1.0]), min_size=batch, max_size=batch))
    else:
        temperature = draw(
            st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=batch, max_size=batch)
        )
    seeds = draw(st.lists(st.none() | st.integers(0, 99), min_size=batch, max_size=batch))
    bonus = torch.randint(0, vocab, (batch, 1), generator=g).int()  # [batch, 1]
    global_seed = draw(st.integers(0, 2**16))
    return (
        num_draft_tokens,
        target_logits,
        draft_token_ids,
        draft_probs,
        temperature,
        seeds,
        bonus,
        global_seed,
    )


def _mini_metadata(temperature, seeds) -> SamplingMetadata:
    temp = torch.tensor(temperature, dtype=torch.float32)  # [batch]
    batch = len(temperature)
    return SamplingMetadata(
        temperature=temp,
        all_greedy=all(t == 0 for t in temperature),
        all_random=all(t != 0 for t in temperature),
        top_k=None,
        top_p=None,
        generators={
            i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds) if s is not None
        },
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


def _upstream_metadata(temperature, seeds):
    """The fields upstream's rejection_sample reads; generators keyed by row."""
    temp = torch.tensor(temperature, dtype=torch.float32)  # [batch]
    return types.SimpleNamespace(
        temperature=temp,
        all_greedy=all(t == 0 for t in temperature),
        all_random=all(t != 0 for t in temperature),
        generators={
            i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds) if s is not None
        },
    )


def _run_both(case):
    num_draft_tokens, target_logits, draft_ids, draft_probs, temperature, seeds, bonus, gseed = case
    meta = SpecDecodeMetadata.make_dummy(
        [draft_ids[s - n : s].tolist() for s, n in _ends(num_draft_tokens)]
    )
    up = upstream_rejection_sampler()
    upstream_meta = _upstream_metadata(temperature, seeds)
    mini_meta = _mini_metadata(temperature, seeds)
    torch.manual_seed(gseed)
    expected = up.rejection_sample(
        meta.draft_token_ids,
        meta.num_draft_tokens,
        meta.max_spec_len,
        meta.cu_num_draft_tokens,
        draft_probs,
        target_logits.clone(),
        bonus,
        upstream_meta,
    )
    upstream_global_state = torch.get_rng_state()
    torch.manual_seed(gseed)
    got = rejection_sample(
        meta.draft_token_ids,
        meta.num_draft_tokens,
        meta.max_spec_len,
        meta.cu_num_draft_tokens,
        draft_probs,
        target_logits.clone(),
        bonus,
        mini_meta,
    )
    # Each seeded request's generator must have advanced the same way (a
    # request without drafts draws nothing), and so must the global one.
    for i, generator in upstream_meta.generators.items():
        assert torch.equal(mini_meta.generators[i].get_state(), generator.get_state()), i
    assert torch.equal(torch.get_rng_state(), upstream_global_state)
    return got, expected


def _ends(num_draft_tokens):
    end = 0
    for n in num_draft_tokens:
        end += n
        yield end, n


@pytest.mark.parametrize("mode", ["greedy", "random", "mixed"])
def test_rejection_sample_lockstep_with_upstream(counts, mode):
    @SETTINGS
    @given(case=rejection_cases(mode))
    def check(case):
        got, expected = _run_both(case)
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
    upstream_meta = types.SimpleNamespace(temperature=temp, all_greedy=all_greedy, top_k=k, top_p=p)
    expected = upstream_rejection_sampler().apply_sampling_constraints(
        logits.clone(), meta.cu_num_draft_tokens, upstream_meta
    )
    mini_meta = _mini_metadata(temperature, [None] * len(temperature))
    mini_meta.top_k, mini_meta.top_p = k, p
    got = apply_sampling_constraints(logits.clone(), meta.num_draft_tokens, mini_meta)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
