"""An image's hash (the encoder cache's key), and a prompt-embeds block hash, against upstream.

mini_vllm.multimodal.hasher mirrors vllm/multimodal/hasher.py: for the same
keywords, ``hash_kwargs`` gives the same hex digest as upstream's (its
default blake3), on images of every PIL mode a prompt may carry (RGB, RGBA,
grayscale, a palette image), numpy arrays and tensors, called as upstream's
processor calls it (``model_id=..., image=...``). A prompt given as
embeddings has upstream's block hashes (its placeholder zeros plus each
block's sha256 of its rows).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mini_vllm.multimodal.hasher import MultiModalHasher

pytestmark = pytest.mark.upstream


@pytest.fixture(scope="module")
def upstream_hasher():
    import importlib

    # mini_vllm.oracle.upstream sets vllm's environment before vllm is imported.
    importlib.import_module("mini_vllm.oracle.upstream")
    return importlib.import_module("vllm.multimodal.hasher").MultiModalHasher


def _images():
    rng = np.random.RandomState(0)
    rgb = Image.fromarray(rng.randint(0, 256, (12, 9, 3), dtype=np.uint8))
    yield rgb
    yield rgb.convert("RGBA")
    yield rgb.convert("L")
    yield rgb.convert("P")  # a palette image: its palette enters the hash
    yield Image.fromarray(rng.randint(0, 256, (5, 7, 3), dtype=np.uint8))


@pytest.mark.parametrize("index", range(5))
def test_image_hash_equals_upstream(upstream_hasher, index):
    image = list(_images())[index]
    kwargs = {"model_id": "/models/tiny-llava", "image": image}
    assert MultiModalHasher.hash_kwargs(**kwargs) == upstream_hasher.hash_kwargs(**kwargs)


def test_other_items_hash_equal_upstream(upstream_hasher):
    items = [
        {"data": np.arange(12, dtype=np.float32).reshape(3, 4)},
        {"data": np.arange(12, dtype=np.int64).reshape(3, 4).T},  # not contiguous
        {"data": torch.arange(6, dtype=torch.float32)},
        {"a": 3, "b": 2.5, "c": "text", "d": [1, (2, "x")], "e": None},
    ]
    for kwargs in items:
        assert MultiModalHasher.hash_kwargs(**kwargs) == upstream_hasher.hash_kwargs(**kwargs)


def test_hash_follows_pixels_not_the_object():
    a = Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8))
    b = Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8))
    c = Image.fromarray(np.ones((4, 4, 3), dtype=np.uint8))
    h = MultiModalHasher.hash_kwargs
    assert h(model_id="m", image=a) == h(model_id="m", image=b) != h(model_id="m", image=c)
    assert h(model_id="m", image=a) != h(model_id="other", image=a)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prompt_embeds_block_hashes_equal_upstream(block_size):
    """A prompt given as embeddings: its blocks' hashes (placeholder zeros plus
    each block's sha256 of its rows, upstream's _gen_prompt_embeds_extra_hash_keys)
    equal upstream's, before and after output tokens fill more blocks."""
    import importlib

    upstream = importlib.import_module("mini_vllm.oracle.upstream")  # sets vllm's env first
    from vllm.sampling_params import SamplingParams as UpstreamParams
    from vllm.v1.core import kv_cache_utils as up_utils
    from vllm.v1.request import Request as UpstreamRequest

    from mini_vllm.core.kv_cache_utils import get_request_block_hasher, sha256
    from mini_vllm.request import Request
    from mini_vllm.sampling_params import SamplingParams

    for seed in range(3):
        embeds = torch.randn(2 * block_size + 3, 8, generator=torch.Generator().manual_seed(seed))
        ours = Request(
            "r",
            [0] * len(embeds),
            SamplingParams(max_tokens=4),
            block_hasher=get_request_block_hasher(block_size, sha256),
            prompt_embeds=embeds,
        )
        theirs = UpstreamRequest(
            "r",
            None,
            UpstreamParams(max_tokens=4),
            None,
            prompt_embeds=embeds,
            block_hasher=up_utils.get_request_block_hasher(block_size, upstream.sha256),
        )
        assert ours.block_hashes and ours.block_hashes == theirs.block_hashes
        for token in range(block_size + 1):
            ours.append_output_token_ids(5 + token)
            theirs.append_output_token_ids(5 + token)
        assert ours.block_hashes == theirs.block_hashes
