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


def _mm_request_pair(seed: int, block_size: int):
    """The same random multimodal request built by mini_vllm and by upstream,
    and its items."""
    import mini_vllm.testing as mini
    from mini_vllm.oracle import upstream

    rng = random.Random(seed)
    prompt: list[int] = []
    items = []
    for _ in range(rng.randint(1, 4)):
        prompt += [rng.randint(1, 50) for _ in range(rng.randint(0, 7))]
        length = rng.randint(1, 9)
        mask = [rng.random() < 0.7 for _ in range(length)] if rng.random() < 0.3 else None
        items.append([len(prompt), length, f"img{rng.randint(0, 2)}-{length}", mask])
        prompt += [999] * length
    prompt += [rng.randint(1, 50) for _ in range(rng.randint(0, 7))]
    kwargs = dict(block_size=block_size, prompt_token_ids=[prompt], mm_items=[items])
    (ours,) = mini.create_requests(1, **kwargs)
    (theirs,) = upstream.create_requests(1, **kwargs)
    return ours, theirs, items


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_mm_block_hashes_equal_upstream(upstream_inputs, block_size):
    """Block hashes of multimodal requests (images across block edges, two in
    one block, masks) equal upstream's byte for byte, before and after output
    tokens fill more blocks; and so do the extra keys of any block range."""
    from vllm.v1.core import kv_cache_utils as up_utils

    from mini_vllm.core.kv_cache_utils import generate_block_hash_extra_keys

    for seed in range(12):
        ours, theirs, _ = _mm_request_pair(seed, block_size)
        assert ours.block_hashes == theirs.block_hashes, (seed, block_size)
        for token in range(3 * block_size):
            ours.append_output_token_ids(7 + token)
            theirs.append_output_token_ids(7 + token)
        assert ours.block_hashes == theirs.block_hashes, (seed, block_size)
        if block_size != 4:
            continue
        n = ours.num_prompt_tokens
        for start in range(0, n, 3):
            for end in range(start + 1, n + 1, 4):
                for mm_idx in (0, -1):
                    want = up_utils.generate_block_hash_extra_keys(theirs, start, end, mm_idx)
                    got = generate_block_hash_extra_keys(ours, start, end, mm_idx)
                    assert got == want, (seed, start, end, mm_idx)


def test_same_placeholder_tokens_different_images_never_share_a_block_hash(upstream_inputs):
    """Two prompts equal token for token whose images differ share the hashes
    of the blocks before the image only; the same image gives equal hashes;
    the same image at another offset within the block does not (its offset
    is part of the key). Upstream's hashes say the same."""
    import mini_vllm.testing as mini
    from mini_vllm.oracle import upstream

    prompt = [1, 2, 3, 4, 5, 6] + [999] * 6 + [7, 8, 9, 10, 11, 12]

    def hashes(backend, ident, offset=6):
        items = [[[offset, 6, ident, None]]]
        shifted = prompt if offset == 6 else prompt[:offset] + [999] * 6 + prompt[offset + 6 :]
        (request,) = backend.create_requests(
            1, block_size=4, prompt_token_ids=[shifted], mm_items=items
        )
        return request.block_hashes

    for backend in (mini, upstream):
        cat, dog, cat_again = hashes(backend, "cat"), hashes(backend, "dog"), hashes(backend, "cat")
        assert len(cat) == 4
        assert cat[0] == dog[0]  # tokens 0-3: before the image
        assert all(c != d for c, d in zip(cat[1:], dog[1:], strict=True))
        assert cat == cat_again
        assert hashes(backend, "cat", offset=5)[1] != cat[1]
    assert hashes(mini, "dog") == hashes(upstream, "dog")
