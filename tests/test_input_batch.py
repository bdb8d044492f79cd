"""mini_vllm's persistent batch on its own (the lockstep against upstream is
tests/upstream/test_input_batch_lockstep.py): its sampling metadata drives
mini's Sampler, and misuse fails loudly."""

from __future__ import annotations

import pytest
import torch

from mini_vllm.sample.sampler import Sampler
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.worker.gpu_input_batch import CachedRequestState, InputBatch

VOCAB = 32


def _batch(max_num_reqs: int = 4) -> InputBatch:
    return InputBatch(max_num_reqs, 64, 64, torch.device("cpu"), False, VOCAB, [4])


def _state(req_id: str, seed: int | None = None, **params) -> CachedRequestState:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return CachedRequestState(
        req_id, [1, 2, 3], SamplingParams(seed=seed, **params), gen, ([5],), 3
    )


def test_sampling_metadata_drives_the_sampler():
    batch = _batch()
    states = [
        _state("greedy", temperature=0.0),
        _state("top1", temperature=1.0, top_k=1),
        _state("min", temperature=0.0, min_tokens=2, stop_token_ids=[7]),
        _state("seeded", seed=3, temperature=1.0, top_p=0.9),
    ]
    for s in states:
        batch.add_request(s)
    batch.refresh_metadata()
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[2, 7] = 100.0  # the stop token would win without min_tokens
    tokens = Sampler()(logits, batch.sampling_metadata).sampled_token_ids.tolist()
    assert tokens[0] == logits[0].argmax() and tokens[1] == logits[1].argmax()
    assert tokens[2] != 7 and tokens[2] == logits[2, :7].argmax()

    # The min_tokens block lifts once the request has enough output tokens.
    states[2].output_token_ids.extend([1, 1])
    batch.refresh_metadata()
    assert Sampler()(logits, batch.sampling_metadata).sampled_token_ids[2] == 7

    # A seeded row draws the same token wherever it sits in the batch.
    states[3].generator.manual_seed(3)
    batch.swap_states(0, 3)
    batch.refresh_metadata()
    swapped = logits[[3, 1, 2, 0]]
    assert Sampler()(swapped, batch.sampling_metadata).sampled_token_ids[0] == tokens[3]


def test_a_full_batch_and_a_late_removal_are_refused():
    batch = _batch(max_num_reqs=1)
    batch.add_request(_state("a"))
    with pytest.raises(ValueError, match="at most 1"):
        batch.add_request(_state("b"))
    batch.remove_request("a")
    batch.add_request(_state("c"))  # fills the hole, reading the removed rows
    with pytest.raises(RuntimeError, match="removed"):
        batch.remove_request("c")
