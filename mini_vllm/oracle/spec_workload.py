"""Speculative decoding's pieces run beside the pinned upstream's, on a CPU.

Builds, from the same generated inputs, what mini_vllm's and upstream's
n-gram proposer, rejection sampler and runner metadata take, and runs
upstream's side:

- ``upstream_ngram``: upstream's ``NgramProposer`` (numba compiled) from a
  duck-typed config; ``ngram_cases`` draws token histories over small
  alphabets (repeats and ties between equally long matches are common) and
  ``ngram_inputs`` lays them out as ``propose`` takes them;
- ``upstream_rejection_sampler``: vllm.v1.sample.rejection_sampler reloaded
  with the real Triton, so its kernels run (under ``TRITON_INTERPRET=1`` on a
  CPU); ``rejection_cases`` draws greedy, random or mixed batches and
  ``run_rejection_sample`` runs one through upstream's ``rejection_sample``
  and a given one with the same seeds, checking that the random streams
  advanced alike;
- ``upstream_spec_decode_metadata``: upstream's
  ``GPUModelRunner._calc_spec_decode_metadata`` called on a stand-in that
  holds only what it reads (the aranges, the device, ``input_ids``).

Used by tests/upstream/test_spec_decode_lockstep.py and the Phase 08 graders
(phases/08-speculative-decoding/labs/).
"""

from __future__ import annotations

import importlib
import os
import types

import numpy as np
import torch
from hypothesis import strategies as st

from mini_vllm.sample.logits_processor import LogitsProcessors
from mini_vllm.sample.metadata import SamplingMetadata
from mini_vllm.spec_decode.metadata import SpecDecodeMetadata

MAX_NUM_SEQS = 4

# ------------------------------------------------------------------ n-gram


def upstream_ngram(min_n: int, max_n: int, k: int, max_model_len: int):
    """Upstream's NgramProposer, built from the four settings it reads."""
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
    """(min_n, max_n, k, max_model_len, histories, sampled): up to
    MAX_NUM_SEQS token histories, mostly repetitive, and whether each row
    sampled a token this step."""
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


def ngram_inputs(max_model_len: int, histories: list[list[int]], sampled: list[bool]):
    """``propose``'s arguments: sampled ids per row (one token or none),
    each row's length, the token table."""
    token_ids = np.zeros((len(histories), max_model_len), dtype=np.int32)  # [batch, max_model_len]
    for i, history in enumerate(histories):
        token_ids[i, : len(history)] = history
    num_tokens = np.array([len(h) for h in histories], dtype=np.int32)  # [batch]
    sampled_ids = [[7] if s else [] for s in sampled]
    return sampled_ids, num_tokens, token_ids


# ------------------------------------------------------------------ rejection sampling

_upstream_rs = None


def upstream_rejection_sampler():
    """vllm.v1.sample.rejection_sampler reloaded with the real Triton, so its
    kernels run (under TRITON_INTERPRET=1 on a CPU, which the caller sets
    before Triton is first imported). vLLM put placeholders in
    vllm.triton_utils when it found no GPU driver."""
    global _upstream_rs
    if _upstream_rs is None:
        import triton
        import triton.language as tl
        import vllm.triton_utils as tu

        if not torch.cuda.is_available():
            assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 first"
        saved = tu.triton, tu.tl
        tu.triton, tu.tl = triton, tl
        try:
            _upstream_rs = importlib.reload(
                importlib.import_module("vllm.v1.sample.rejection_sampler")
            )
        finally:
            tu.triton, tu.tl = saved
    return _upstream_rs


@st.composite
def rejection_cases(draw, mode: str):
    """A batch of 1-3 requests with 0-3 drafts each over a vocabulary of
    2-12, in ``mode`` greedy, random or mixed: (num_draft_tokens,
    target_logits, draft_token_ids, draft_probs or None, temperature, seeds,
    bonus, global_seed)."""
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


def mini_sampling_metadata(temperature: list[float], seeds: list[int | None]) -> SamplingMetadata:
    """mini_vllm's SamplingMetadata for rows with these temperatures and
    seeds, nothing else switched on."""
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


def upstream_sampling_metadata(temperature: list[float], seeds: list[int | None]):
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


def drafts_per_request(num_draft_tokens: list[int], draft_token_ids: torch.Tensor):
    """The flat drafts cut back into one list per request."""
    out, end = [], 0
    for n in num_draft_tokens:
        out.append(draft_token_ids[end : end + n].tolist())
        end += n
    return out


def run_rejection_sample(case, rejection_sample) -> tuple[torch.Tensor, torch.Tensor, str | None]:
    """(got, expected, problem): ``rejection_sample`` (mini_vllm's signature)
    and upstream's on ``case`` with the same global seed and fresh
    generators of the same seeds. ``problem`` names a random stream (the
    global one, or a seeded request's) that advanced differently, or is None."""
    num_draft_tokens, target_logits, draft_ids, draft_probs, temperature, seeds, bonus, gseed = case
    meta = SpecDecodeMetadata.make_dummy(drafts_per_request(num_draft_tokens, draft_ids))
    up = upstream_rejection_sampler()
    upstream_meta = upstream_sampling_metadata(temperature, seeds)
    mini_meta = mini_sampling_metadata(temperature, seeds)
    args = (meta.draft_token_ids, meta.num_draft_tokens, meta.max_spec_len)
    args += (meta.cu_num_draft_tokens, draft_probs)
    torch.manual_seed(gseed)
    expected = up.rejection_sample(*args, target_logits.clone(), bonus, upstream_meta)
    upstream_global_state = torch.get_rng_state()
    torch.manual_seed(gseed)
    got = rejection_sample(*args, target_logits.clone(), bonus, mini_meta)
    problem = None
    for i, generator in upstream_meta.generators.items():
        if not torch.equal(mini_meta.generators[i].get_state(), generator.get_state()):
            problem = f"request {i}'s seeded generator advanced differently from upstream's"
    if not torch.equal(torch.get_rng_state(), upstream_global_state):
        problem = "the global torch generator advanced differently from upstream's"
    return got, expected, problem


# ------------------------------------------------------------------ runner metadata


def upstream_spec_decode_metadata(
    num_draft_tokens: np.ndarray,  # int32 [num_reqs]
    cu_num_scheduled_tokens: np.ndarray,  # int32 [num_reqs]
    input_ids: torch.Tensor,  # int32 [>= total tokens]
):
    """Upstream's ``GPUModelRunner._calc_spec_decode_metadata`` on a CPU,
    called on a stand-in runner holding only what it reads."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as UpstreamRunner

    size = max(int(cu_num_scheduled_tokens[-1]), 1) + 1
    runner = types.SimpleNamespace(
        arange_np=np.arange(size, dtype=np.int64),
        _arange_scratch=np.empty(size, dtype=np.int64),
        device=torch.device("cpu"),
        input_ids=types.SimpleNamespace(gpu=input_ids),
    )
    runner._get_cumsum_and_arange = types.MethodType(UpstreamRunner._get_cumsum_and_arange, runner)
    return UpstreamRunner._calc_spec_decode_metadata(
        runner, num_draft_tokens, cu_num_scheduled_tokens
    )
