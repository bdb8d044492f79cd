"""EncoderCacheManager and compute_mm_encoder_budget against the pinned upstream.

Random sequences of the calls the scheduler makes (check_and_update_cache,
can_allocate with budgets, allocate, free_encoder_input, free,
get_freed_mm_hashes) on mini_vllm's manager and upstream's
(vllm/v1/core/encoder_cache_manager.py:17) return the same answers and leave
the same bookkeeping after every call: free and freeable slots, which
requests reference which entry, the eviction order and the evicted hashes.
The budgets (:269) agree too, including the refusal with
``disable_chunked_mm_input``.
"""

from __future__ import annotations

import random

import pytest

import mini_vllm.testing as mini
from mini_vllm.config import SchedulerConfig
from mini_vllm.core.encoder_cache_manager import EncoderCacheManager, compute_mm_encoder_budget
from mini_vllm.oracle.workload import encoder_cache_state

pytestmark = pytest.mark.upstream


@pytest.fixture(scope="module")
def upstream():
    from mini_vllm.oracle import upstream as up

    return up


# Images: identifier -> (placeholder length, is_embed mask); an identifier
# always has the same embeddings, as one image does.
IMAGES = {
    "a": (4, None),
    "b": (6, [True, False, True, True, False, True]),
    "c": (3, None),
    "d": (8, None),
    "e": (5, [False, True, True, True, True]),
}


def _requests(backend, rng: random.Random, n: int):
    out = []
    for r in range(n):
        items, offset = [], 0
        for ident in rng.sample(sorted(IMAGES), rng.randint(1, 3)):
            length, mask = IMAGES[ident]
            items.append([offset, length, ident, mask])
            offset += length + 1
        out.append((f"r{r}", offset + 1, items))
    return [
        backend.create_requests(
            1, req_ids=[rid], prompt_token_ids=[[5] * length], mm_items=[items]
        )[0]
        for rid, length, items in out
    ]


@pytest.mark.parametrize("seed", range(8))
def test_encoder_cache_manager_matches_upstream(upstream, seed):
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager as UpstreamManager

    rng = random.Random(seed)
    cache_size = rng.choice([8, 12, 20])
    ours, theirs = EncoderCacheManager(cache_size), UpstreamManager(cache_size)
    state = random.Random(seed + 1000)
    mine_reqs = _requests(mini, state, 5)
    up_reqs = _requests(upstream, random.Random(seed + 1000), 5)
    for step in range(200):
        k = rng.randrange(5)
        a, b = mine_reqs[k], up_reqs[k]
        i = rng.randrange(len(a.mm_features))
        op = rng.choice(["check", "can", "can", "alloc", "free_one", "free", "freed"])
        if op == "check":
            got, want = ours.check_and_update_cache(a, i), theirs.check_and_update_cache(b, i)
        elif op == "can":
            budget, pending = rng.randint(0, 10), rng.randint(0, 6)
            got, want = (
                ours.can_allocate(a, i, budget, pending),
                theirs.can_allocate(b, i, budget, pending),
            )
        elif op == "alloc":
            # As the scheduler does: allocate only what can_allocate accepted
            # and is not cached already.
            if a.mm_features[i].identifier in ours.cached or not ours.can_allocate(a, i, 99, 0):
                continue
            assert theirs.can_allocate(b, i, 99, 0)
            got, want = ours.allocate(a, i), theirs.allocate(b, i)
        elif op == "free_one":
            got, want = ours.free_encoder_input(a, i), theirs.free_encoder_input(b, i)
        elif op == "free":
            got, want = ours.free(a), theirs.free(b)
        else:
            got, want = ours.get_freed_mm_hashes(), theirs.get_freed_mm_hashes()
        assert got == want, (seed, step, op)
        assert encoder_cache_state(ours) == encoder_cache_state(theirs), (seed, step, op)
        assert ours.get_cached_input_ids(a) == theirs.get_cached_input_ids(b)


@pytest.mark.parametrize(
    ("batched", "encoder", "cache", "max_item", "no_chunking"),
    [
        (64, 16, 24, 8, False),
        (64, 4, 2, 8, False),
        (64, None, None, 8, False),
        (8, 16, 16, 12, True),
        (16, 16, 16, 12, True),
    ],
)
def test_encoder_budget_matches_upstream(upstream, batched, encoder, cache, max_item, no_chunking):
    from vllm.config import SchedulerConfig as UpstreamConfig
    from vllm.v1.core.encoder_cache_manager import compute_mm_encoder_budget as upstream_budget

    theirs = UpstreamConfig(
        max_num_batched_tokens=batched,
        max_num_seqs=4,
        max_model_len=batched,
        is_encoder_decoder=False,
        disable_chunked_mm_input=no_chunking,
    )
    if encoder is not None:
        theirs.max_num_encoder_input_tokens = encoder
    if cache is not None:
        theirs.encoder_cache_size = cache
    ours = SchedulerConfig(
        max_num_batched_tokens=batched,
        max_num_seqs=4,
        max_num_encoder_input_tokens=encoder,
        encoder_cache_size=cache,
        disable_chunked_mm_input=no_chunking,
    )
    assert ours.max_num_encoder_input_tokens == theirs.max_num_encoder_input_tokens
    assert ours.encoder_cache_size == theirs.encoder_cache_size

    def run(fn, config, items):
        try:
            return fn(config, items)
        except ValueError:
            return "ValueError"

    for items in ({"image": max_item}, {}):
        assert run(compute_mm_encoder_budget, ours, items) == run(upstream_budget, theirs, items)


def test_an_image_the_encoder_can_never_take_is_refused(upstream):
    """Upstream's input processor refuses an item with more embeddings than
    the encoder cache (vllm/v1/engine/input_processor.py:451); mini_vllm's
    scheduler refuses it at add_request with one line naming the item, and
    queues nothing. A text model (no encoder cache) refuses any image."""
    sched = mini.create_scheduler(
        mm_max_tokens_per_item=8, max_num_encoder_input_tokens=8, encoder_cache_size=8
    )
    (big,) = mini.create_requests(1, num_tokens=20, mm_items=[[[2, 9, "huge", None]]])
    with pytest.raises(ValueError, match=r"image item 0 has 9 encoder embeddings"):
        sched.add_request(big)
    assert not sched.requests and not sched.waiting
    # Nine placeholders but eight embeddings (a mask): it fits.
    (masked,) = mini.create_requests(
        1, num_tokens=20, mm_items=[[[2, 9, "ok", [True] * 8 + [False]]]]
    )
    sched.add_request(masked)
    text_model = mini.create_scheduler()
    (image,) = mini.create_requests(1, num_tokens=20, mm_items=[[[2, 4, "small", None]]])
    with pytest.raises(ValueError, match="encoder_cache_size 0"):
        text_model.add_request(image)
