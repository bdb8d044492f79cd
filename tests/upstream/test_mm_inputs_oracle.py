"""PlaceholderRange, MultiModalFeatureSpec and a request's encoder inputs against upstream.

mini_vllm.multimodal.inputs mirrors vllm/multimodal/inputs.py: a placeholder's
embedding count and the encoder-output rows a slice of its positions holds
(``is_embed`` masks included) equal upstream's; a Request built with the same
features reports the same encoder inputs (vllm/v1/request.py:250-279).
"""

from __future__ import annotations

import random

import pytest
import torch

from mini_vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from mini_vllm.request import Request
from mini_vllm.sampling_params import SamplingParams

pytestmark = pytest.mark.upstream


@pytest.fixture(scope="module")
def upstream_inputs():
    import importlib

    # mini_vllm.oracle.upstream sets vllm's environment before vllm is imported.
    importlib.import_module("mini_vllm.oracle.upstream")
    return importlib.import_module("vllm.multimodal.inputs")


def _ranges(seed: int):
    rng = random.Random(seed)
    for _ in range(40):
        length = rng.randint(1, 9)
        mask = None
        if rng.random() < 0.7:
            mask = torch.tensor([rng.random() < 0.6 for _ in range(length)])
        yield rng.randint(0, 50), length, mask


def test_placeholder_range_counts_as_upstream(upstream_inputs):
    for offset, length, mask in _ranges(0):
        ours = PlaceholderRange(offset, length, mask)
        theirs = upstream_inputs.PlaceholderRange(offset, length, mask)
        assert ours.get_num_embeds() == theirs.get_num_embeds(), (length, mask)
        for start in range(length + 1):
            for end in range(start, length + 1):
                got = ours.get_embeds_indices_in_range(start, end)
                want = theirs.get_embeds_indices_in_range(start, end)
                assert got == want, (mask, start, end)


def test_request_encoder_inputs_as_upstream(upstream_inputs):
    from mini_vllm.oracle import upstream

    mask = torch.tensor([False, True, True, False, True])
    positions = [(2, 4, None), (8, 5, mask)]
    ours = [
        MultiModalFeatureSpec(None, "image", f"img{i}", PlaceholderRange(o, n, m))
        for i, (o, n, m) in enumerate(positions)
    ]
    theirs = [
        upstream_inputs.MultiModalFeatureSpec(
            None, "image", f"img{i}", upstream_inputs.PlaceholderRange(o, n, m)
        )
        for i, (o, n, m) in enumerate(positions)
    ]
    mine = Request("r", list(range(16)), SamplingParams(max_tokens=4), mm_features=ours)
    (up,) = upstream.create_requests(1, num_tokens=16)
    up.mm_features = theirs
    assert mine.num_encoder_inputs == up.num_encoder_inputs == 2
    assert mine.has_encoder_inputs and up.has_encoder_inputs
    for i in range(2):
        assert mine.get_num_encoder_embeds(i) == up.get_num_encoder_embeds(i)
    assert not Request("t", [1, 2], SamplingParams(max_tokens=1)).has_encoder_inputs
