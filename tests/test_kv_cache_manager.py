"""Unit tests for mini_vllm.core.kv_cache_manager.KVCacheManager.

The scheduler talks to KV memory only through this class:
- get_computed_blocks(request): the prefix-cache hit (never the whole prompt);
- allocate_slots(request, ...): new blocks for this step, or None when memory
  is short (and then nothing has changed);
- free(request): give the request's blocks back, tail first.

Every test uses a block size of 4 tokens (BS). With a pool of N blocks only
N - 1 are usable, because block 0 is the null block.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_vllm.core.kv_cache_manager import KVCacheManager
from mini_vllm.kv_cache_interface import cdiv
from mini_vllm.testing import cache_key, create_requests, first_hit

BS = 4


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def make_manager(
    num_blocks: int, max_model_len: int = 1024, enable_caching: bool = True, block_size: int = BS
) -> KVCacheManager:
    return KVCacheManager(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        enable_caching=enable_caching,
    )


def make_request(prompt: list[int], request_id: str, block_size: int = BS):
    (req,) = create_requests(
        1, block_size=block_size, req_ids=[request_id], prompt_token_ids=[prompt]
    )
    return req


def admit(mgr: KVCacheManager, req):
    """What the scheduler does to admit a waiting request in one step: look up
    the prefix hit, then ask for slots for the rest of the prompt. On success
    the whole prompt counts as computed (as if the model step ran)."""
    hits, num_hit_tokens = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, req.num_tokens - num_hit_tokens, num_hit_tokens, hits)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return hits, num_hit_tokens, new


def decode_step(mgr: KVCacheManager, req, token: int = 1):
    """One decode step: the model sampled ``token``; ask for a slot for it."""
    req.append_output_token_ids(token)
    new = mgr.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    return new


def free_ids(mgr: KVCacheManager) -> list[int]:
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def block_ids(mgr: KVCacheManager, request_id: str) -> list[int]:
    return [b.block_id for b in mgr.req_to_blocks[request_id]]


def snapshot(mgr: KVCacheManager):
    """Everything allocate_slots could change."""
    pool = mgr.block_pool
    return (
        free_ids(mgr),
        pool.get_num_free_blocks(),
        {rid: [b.block_id for b in blks] for rid, blks in mgr.req_to_blocks.items()},
        dict(mgr.num_cached_block),
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        {h: list(d) for h, d in pool.cached_block_hash_to_block.items()},
    )


# --------------------------------------------------------------------------
# get_computed_blocks
# --------------------------------------------------------------------------


def test_first_request_has_no_hits():
    """With an empty cache the hit is empty and covers 0 tokens."""
    mgr = make_manager(10)
    hits, n = mgr.get_computed_blocks(make_request([1] * 10, "a"))
    assert n == 0
    assert hits.get_block_ids() == ([],)
    assert hits.get_block_ids(allow_none=True) is None


def test_identical_prompt_hits_the_same_blocks():
    """A second request with the same 10-token prompt hits the 2 full blocks
    the first one cached, as the very same block objects."""
    mgr = make_manager(10)
    a = make_request([1] * 10, "a")
    admit(mgr, a)
    hits, n = mgr.get_computed_blocks(make_request([1] * 10, "b"))
    assert n == 2 * BS
    assert list(hits.blocks[0]) == mgr.req_to_blocks["a"][:2]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_prompt_of_exactly_k_full_blocks_hits_at_most_k_minus_1(k):
    """Even if all k blocks are cached, the last prompt token must be computed
    (its logits give the first output token), so at most k - 1 blocks hit."""
    mgr = make_manager(10)
    a = make_request([1] * (k * BS), "a")
    admit(mgr, a)
    # all k blocks of "a" are cached ...
    assert all(first_hit(mgr.block_pool, h) is not None for h in a.block_hashes)
    assert len(a.block_hashes) == k
    # ... yet the same prompt hits only k - 1 of them
    _, n = mgr.get_computed_blocks(make_request([1] * (k * BS), "b"))
    assert n == (k - 1) * BS


def test_one_extra_token_lets_all_full_blocks_hit():
    """With k full blocks plus one token, all k cached blocks can hit."""
    mgr = make_manager(10)
    admit(mgr, make_request([1] * (3 * BS), "a"))
    _, n = mgr.get_computed_blocks(make_request([1] * (3 * BS) + [2], "b"))
    assert n == 3 * BS


def test_hit_stops_at_the_first_different_block():
    """Prompts equal for one block then different hit exactly one block."""
    mgr = make_manager(10)
    admit(mgr, make_request([1] * BS + [2] * BS + [0], "a"))
    _, n = mgr.get_computed_blocks(make_request([1] * BS + [3] * BS + [0], "b"))
    assert n == BS


def test_equal_later_block_after_a_different_first_block_does_not_hit():
    """Hashes chain, so a matching second block after a different first block
    is no hit at all."""
    mgr = make_manager(10)
    admit(mgr, make_request([1] * BS + [2] * BS + [0], "a"))
    _, n = mgr.get_computed_blocks(make_request([9] * BS + [2] * BS + [0], "b"))
    assert n == 0


def test_hit_is_a_contiguous_prefix_even_if_later_blocks_are_cached():
    """If block 0's hash is gone but block 1's is still cached, nothing hits:
    a hit must start at the first block and stop at the first miss.

    The state is built with the pool's own operations: someone takes a
    reference on the h1 block, every other free block is reused (which
    evicts h0), then the h1 block is freed again, still cached."""
    mgr = make_manager(5)  # 4 usable
    pool = mgr.block_pool
    a = make_request([1] * 9, "a")
    admit(mgr, a)  # blocks 1, 2 cached (h0, h1), block 3 partial
    first, second, _ = mgr.req_to_blocks["a"]
    mgr.free(a)
    pool.touch([second])  # someone holds the h1 block
    pool.get_new_blocks(pool.get_num_free_blocks())  # evicts h0 (block 1)
    pool.free_blocks([second])
    assert first_hit(pool, a.block_hashes[0]) is None
    assert first_hit(pool, a.block_hashes[1]) is second

    hits, n = mgr.get_computed_blocks(make_request([1] * 9, "b"))
    assert n == 0 and hits.get_block_ids() == ([],)


def test_no_hits_when_caching_is_disabled():
    """enable_caching=False: no block is hashed and nothing ever hits."""
    mgr = make_manager(10, enable_caching=False)
    admit(mgr, make_request([1] * 12, "a"))
    assert all(b.block_hash is None for b in mgr.block_pool.blocks)
    hits, n = mgr.get_computed_blocks(make_request([1] * 12, "b"))
    assert n == 0 and hits.get_block_ids() == ([],)


def _expected_hit_blocks(cached_prompt: list[int], prompt: list[int], bs: int) -> int:
    """Reference for the property test below, straight from the rules: count
    leading full blocks of ``prompt`` equal to full blocks of ``cached_prompt``
    (a block's hash covers its whole prefix), capped so at least the last
    prompt token is left to compute."""
    cap = (len(prompt) - 1) // bs
    n = 0
    while (
        n < cap
        and (n + 1) * bs <= len(cached_prompt)
        and prompt[: (n + 1) * bs] == cached_prompt[: (n + 1) * bs]
    ):
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(
    bs=st.integers(min_value=1, max_value=3),
    cached_prompt=st.lists(st.integers(0, 1), min_size=1, max_size=12),
    prompt=st.lists(st.integers(0, 1), min_size=1, max_size=12),
)
def test_hit_length_property(bs, cached_prompt, prompt):
    """For any two prompts, the second one's hit is the longest run of
    matching full blocks, never reaching its last token."""
    mgr = make_manager(20, block_size=bs)
    admit(mgr, make_request(cached_prompt, "a", block_size=bs))
    hits, n = mgr.get_computed_blocks(make_request(prompt, "b", block_size=bs))
    assert n < len(prompt)
    assert n == len(hits.blocks[0]) * bs
    assert len(hits.blocks[0]) == _expected_hit_blocks(cached_prompt, prompt, bs)


# --------------------------------------------------------------------------
# allocate_slots: what it hands out
# --------------------------------------------------------------------------


def test_allocate_gives_enough_blocks_for_the_prompt():
    """A 10-token prompt needs ceil(10/4) = 3 blocks, taken from the queue front."""
    mgr = make_manager(10)
    a = make_request([1] * 10, "a")
    _, _, new = admit(mgr, a)
    assert new.get_block_ids() == ([1, 2, 3],)
    assert block_ids(mgr, "a") == [1, 2, 3]
    assert mgr.block_pool.get_num_free_blocks() == 9 - 3


def test_allocate_returns_only_new_blocks_and_empty_when_none_needed():
    """Decode steps that still fit in the last block get an empty (not None)
    result; the step that crosses a block boundary gets exactly one block."""
    mgr = make_manager(10)
    a = make_request([1] * 10, "a")
    admit(mgr, a)  # 10 tokens in 3 blocks: room for 12
    for _ in range(2):  # tokens 11 and 12
        new = decode_step(mgr, a)
        assert new is not None and new.get_block_ids() == ([],)
    new = decode_step(mgr, a)  # token 13 needs block 4
    assert new.get_block_ids() == ([4],)
    assert block_ids(mgr, "a") == [1, 2, 3, 4]


def test_allocate_with_hits_adds_them_before_the_new_blocks():
    """A request with a prefix hit holds the hit blocks first, then new ones;
    only the new ones are returned, and the hits gain a holder."""
    mgr = make_manager(10)
    admit(mgr, make_request([1] * 10, "a"))  # blocks 1, 2, 3
    b = make_request([1] * 8 + [5] * 6, "b")  # shares blocks 1, 2
    hits, n, new = admit(mgr, b)
    assert n == 8
    assert new.get_block_ids() == ([4, 5],)
    assert block_ids(mgr, "b") == [1, 2, 4, 5]
    # blocks 1, 2: held by a and b; block 3: only a; blocks 4, 5: only b
    assert [blk.ref_cnt for blk in mgr.block_pool.blocks[1:6]] == [2, 2, 1, 1, 1]


def test_zero_new_tokens_is_an_error():
    """allocate_slots must be asked for at least one token."""
    mgr = make_manager(10)
    with pytest.raises(ValueError):
        mgr.allocate_slots(make_request([1] * 4, "a"), 0)


def test_lookahead_slots_are_allocated_but_capped_by_max_model_len():
    """Lookahead tokens get slots too, but never past max_model_len."""
    mgr = make_manager(10, max_model_len=1024)
    a = make_request([1] * 8, "a")
    assert len(mgr.allocate_slots(a, 8, num_lookahead_tokens=4).blocks[0]) == 3
    mgr = make_manager(10, max_model_len=8)
    a = make_request([1] * 8, "a")
    assert len(mgr.allocate_slots(a, 8, num_lookahead_tokens=4).blocks[0]) == 2


def test_full_blocks_are_cached_as_soon_as_allocated():
    """The blocks that are full after this step get their hashes right away;
    a partly filled block is cached when a later token fills it."""
    mgr = make_manager(10)
    a = make_request([1] * 10, "a")
    admit(mgr, a)
    blocks = mgr.req_to_blocks["a"]
    assert [blk.block_hash for blk in blocks] == [cache_key(h) for h in a.block_hashes] + [None]
    decode_step(mgr, a)  # 11 tokens: block 3 not yet full
    assert blocks[2].block_hash is None
    decode_step(mgr, a)  # 12 tokens: block 3 full
    assert blocks[2].block_hash == cache_key(a.block_hashes[2])
    assert first_hit(mgr.block_pool, a.block_hashes[2]) is blocks[2]


def test_lookahead_slots_are_not_cached():
    """Caching is capped at request.num_tokens, so a block that is full only
    counting lookahead slots keeps no hash."""
    mgr = make_manager(10)
    a = make_request([1] * 6, "a")
    mgr.allocate_slots(a, 6, num_lookahead_tokens=2)  # 8 slots, 6 real tokens
    blocks = mgr.req_to_blocks["a"]
    assert len(blocks) == 2
    assert blocks[0].block_hash == cache_key(a.block_hashes[0])
    assert blocks[1].block_hash is None


# --------------------------------------------------------------------------
# allocate_slots: running out of memory
# --------------------------------------------------------------------------


def test_new_request_that_does_not_fit_gets_none_and_changes_nothing():
    """3 of 4 usable blocks are held; an 8-token prompt needs 2, so None, and
    the free queue, block tables, ref counts and cache are as before."""
    mgr = make_manager(5)
    admit(mgr, make_request([1] * 12, "a"))
    assert mgr.block_pool.get_num_free_blocks() == 1
    before = snapshot(mgr)
    b = make_request([2] * 8, "b")
    hits, n, new = admit(mgr, b)
    assert new is None
    assert "b" not in mgr.req_to_blocks
    assert snapshot(mgr) == before


def test_running_request_that_cannot_grow_gets_none_and_keeps_its_blocks():
    """A decode step that needs a new block when none is free returns None;
    the request keeps the blocks it had."""
    mgr = make_manager(4)  # 3 usable
    a = make_request([1] * 12, "a")
    admit(mgr, a)
    before = snapshot(mgr)
    assert decode_step(mgr, a) is None  # 13th token needs a 4th block
    assert snapshot(mgr) == before
    assert block_ids(mgr, "a") == [1, 2, 3]


def test_hits_in_the_free_queue_count_against_free_capacity():
    """Touching a hit that has no holder takes it out of the free queue, so
    it costs one free block like a new block does.

    3 usable blocks, all free, 2 of them a cached prefix. A 13-token prompt
    with that 2-block hit needs 2 new blocks: 2 <= 3 free, but with the 2
    hits also leaving the queue it needs 4 > 3, so it must get None."""
    mgr = make_manager(4)
    a = make_request([1] * 8 + [2], "a")
    admit(mgr, a)
    mgr.free(a)
    assert mgr.block_pool.get_num_free_blocks() == 3

    b = make_request([1] * 8 + [3] * 5, "b")
    hits, n = mgr.get_computed_blocks(b)
    assert n == 8 and all(blk.ref_cnt == 0 for blk in hits.blocks[0])
    before = snapshot(mgr)
    assert mgr.allocate_slots(b, b.num_tokens - n, n, hits) is None
    assert snapshot(mgr) == before  # the hits are still free and unheld


def test_free_queue_hits_plus_new_blocks_that_exactly_fit_succeed():
    """Same setup; a 9-token prompt needs 1 new block + 2 revived hits = 3,
    which is exactly what is free."""
    mgr = make_manager(4)
    a = make_request([1] * 8 + [2], "a")
    admit(mgr, a)
    mgr.free(a)
    b = make_request([1] * 8 + [3], "b")
    hits, n, new = admit(mgr, b)
    assert n == 8 and new is not None
    assert mgr.block_pool.get_num_free_blocks() == 0
    assert all(blk.ref_cnt == 1 for blk in mgr.req_to_blocks["b"])


def test_hits_held_by_a_running_request_cost_no_free_capacity():
    """A hit that another request holds is not in the free queue, so only new
    blocks count: 2 new blocks fit in exactly 2 free ones."""
    mgr = make_manager(6)  # 5 usable
    admit(mgr, make_request([1] * 8 + [2], "a"))  # holds 3, 2 free
    b = make_request([1] * 8 + [3] * 5, "b")  # 4 blocks: 2 hits + 2 new
    hits, n, new = admit(mgr, b)
    assert n == 8 and new is not None
    assert mgr.block_pool.get_num_free_blocks() == 0


def test_full_sequence_must_fit_gates_on_the_whole_prompt():
    """With full_sequence_must_fit a first chunk is refused unless the whole
    prompt fits now; without it the chunk alone is checked."""
    mgr = make_manager(5)  # 4 usable
    admit(mgr, make_request([9] * 4, "c"))  # 3 free left
    b = make_request([1] * 16, "b")  # 16 tokens = 4 blocks > 3
    before = snapshot(mgr)
    assert mgr.allocate_slots(b, 4, full_sequence_must_fit=True) is None
    assert snapshot(mgr) == before
    new = mgr.allocate_slots(b, 4)  # just the first 4-token chunk: 1 block
    assert new.get_block_ids() == ([2],)


def test_full_sequence_must_fit_passes_when_the_prompt_fits():
    """The gate lets a chunk through when the whole prompt would fit."""
    mgr = make_manager(6)  # 5 usable
    admit(mgr, make_request([9] * 4, "c"))  # 4 free left
    b = make_request([1] * 16, "b")
    new = mgr.allocate_slots(b, 4, full_sequence_must_fit=True)
    assert new.get_block_ids() == ([2],)  # only this chunk's block is taken


def test_full_sequence_must_fit_subtracts_held_prefix_hits():
    """Held prefix hits need no new memory, so a 16-token prompt with a
    2-block hit needs only 2 free blocks to pass the gate."""
    mgr = make_manager(6)  # 5 usable
    admit(mgr, make_request([1] * 8 + [2], "a"))  # holds 3, 2 free
    b = make_request([1] * 8 + [3] * 8, "b")
    hits, n = mgr.get_computed_blocks(b)
    new = mgr.allocate_slots(b, 4, n, hits, full_sequence_must_fit=True)
    assert n == 8 and new is not None and len(new.blocks[0]) == 1


# --------------------------------------------------------------------------
# free
# --------------------------------------------------------------------------


def test_free_returns_blocks_tail_first():
    """free() appends the request's blocks last-to-first, so its tail block is
    evicted before its head."""
    mgr = make_manager(10)
    a = make_request([1] * 12, "a")
    admit(mgr, a)
    assert block_ids(mgr, "a") == [1, 2, 3]
    mgr.free(a)
    assert free_ids(mgr) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    assert "a" not in mgr.req_to_blocks and "a" not in mgr.num_cached_block


def test_free_keeps_blocks_other_requests_still_hold():
    """Freeing a request only frees blocks no one else holds."""
    mgr = make_manager(10)
    a = make_request([1] * 10, "a")
    b = make_request([1] * 10, "b")
    admit(mgr, a)  # 1, 2, 3
    admit(mgr, b)  # hits 1, 2; new 4
    mgr.free(a)  # only block 3 has no other holder
    assert free_ids(mgr)[-1:] == [3]
    assert 1 not in free_ids(mgr) and 2 not in free_ids(mgr)
    mgr.free(b)  # b holds [1, 2, 4]: tail first gives 4, 2, 1
    assert free_ids(mgr)[-3:] == [4, 2, 1]


def test_tail_first_free_keeps_the_prefix_head_cached_longest():
    """Because the tail is evicted first, a newcomer that needs some memory
    eats a freed request's last blocks and leaves its first blocks hit-able."""
    mgr = make_manager(5)  # 4 usable
    a = make_request([1] * 12, "a")
    admit(mgr, a)  # blocks 1, 2, 3 all cached
    mgr.free(a)  # queue: 4, 3, 2, 1
    admit(mgr, make_request([7] * 8, "c"))  # takes 4 and 3
    _, n = mgr.get_computed_blocks(make_request([1] * 12, "a2"))
    assert n == 2 * BS  # blocks 1 and 2 still hit


def test_free_of_unknown_request_is_harmless():
    """Freeing a request that holds nothing changes nothing."""
    mgr = make_manager(5)
    before = snapshot(mgr)
    mgr.free(make_request([1] * 4, "ghost"))
    assert snapshot(mgr) == before


# --------------------------------------------------------------------------
# prefix-cache statistics
# --------------------------------------------------------------------------


def test_prefix_cache_stats_count_queries_and_hits_in_tokens():
    """Each lookup adds its prompt length to queries and its hit to hits."""
    mgr = make_manager(10)
    admit(mgr, make_request([1] * 10, "a"))  # query 10, hit 0
    admit(mgr, make_request([1] * 10, "b"))  # query 10, hit 8
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    assert stats.hit_rate == pytest.approx(8 / 20)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (0, 0, 0)


def test_prefix_cache_stats_count_preempted_requests_apart():
    """A request that was preempted before is counted in preempted_* only, so
    its re-admission does not inflate the hit rate."""
    mgr = make_manager(10)
    admit(mgr, make_request([1] * 10, "a"))
    again = make_request([1] * 10, "b")
    again.num_preemptions = 1
    admit(mgr, again)
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 10, 0)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 10, 8)


def test_make_prefix_cache_stats_starts_afresh():
    """make_prefix_cache_stats() hands over the counts and resets them."""
    mgr = make_manager(10)
    mgr.get_computed_blocks(make_request([1] * 10, "a"))
    assert mgr.make_prefix_cache_stats().queries == 10
    assert mgr.make_prefix_cache_stats().queries == 0


def test_no_stats_when_caching_is_disabled():
    """Without prefix caching there is no lookup, so nothing is recorded."""
    mgr = make_manager(10, enable_caching=False)
    mgr.get_computed_blocks(make_request([1] * 10, "a"))
    assert mgr.make_prefix_cache_stats().requests == 0


# --------------------------------------------------------------------------
# property test: a random admit / decode / free workload
# --------------------------------------------------------------------------


def _check_invariants(mgr: KVCacheManager, live: dict) -> None:
    pool = mgr.block_pool
    holders: dict[int, int] = {}
    for rid, blocks in mgr.req_to_blocks.items():
        assert not any(b.is_null for b in blocks)
        # enough slots for every token the request has
        assert len(blocks) == cdiv(live[rid].num_tokens, mgr.block_size)
        for b in blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for b in pool.blocks[1:]:
        assert b.ref_cnt == holders.get(b.block_id, 0), b
    queued = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    assert queued == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
    assert pool.get_num_free_blocks() == len(queued)
    # every hashed block is findable under its hash, and only under it
    for h, by_id in pool.cached_block_hash_to_block.items():
        assert by_id and all(b.block_hash == h for b in by_id.values())
    for b in pool.blocks:
        if b.block_hash is not None:
            assert b.block_id in pool.cached_block_hash_to_block[b.block_hash]


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(min_value=2, max_value=12),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("admit"), st.lists(st.integers(0, 1), min_size=1, max_size=14)),
            st.tuples(st.just("decode"), st.integers(0, 50)),
            st.tuples(st.just("free"), st.integers(0, 50)),
        ),
        max_size=30,
    ),
)
def test_random_workload_keeps_the_books_straight(num_blocks, ops):
    """Under any admit/decode/free sequence: ref counts equal the number of
    holders, the free queue is exactly the unheld blocks, allocate_slots
    returns None exactly when the blocks it needs exceed the free ones (and
    then changes nothing), and a hit never covers a whole prompt."""
    bs = 2  # small blocks over a 2-letter alphabet give many shared prefixes
    mgr = make_manager(num_blocks, block_size=bs)
    live: dict = {}
    next_id = 0

    for op, arg in ops:
        if op == "admit":
            req = make_request(arg, f"r{next_id}", block_size=bs)
            next_id += 1
            hits, n = mgr.get_computed_blocks(req)
            assert n < req.num_tokens and n == len(hits.blocks[0]) * bs
            hit_blocks = hits.blocks[0]
            # blocks needed: the new ones, plus hits that must leave the queue
            need = (
                cdiv(req.num_tokens, bs)
                - len(hit_blocks)
                + sum(1 for b in hit_blocks if b.ref_cnt == 0)
            )
            free_before = mgr.block_pool.get_num_free_blocks()
            before = snapshot(mgr)
            new = mgr.allocate_slots(req, req.num_tokens - n, n, hits)
            assert (new is None) == (need > free_before)
            if new is None:
                assert snapshot(mgr) == before
            else:
                req.num_computed_tokens = req.num_tokens
                live[req.request_id] = req
        elif op == "decode" and live:
            req = list(live.values())[arg % len(live)]
            before = snapshot(mgr)
            new = decode_step(mgr, req, token=arg % 2)
            if new is None:  # out of memory: the scheduler would preempt
                assert snapshot(mgr) == before
                mgr.free(req)
                del live[req.request_id]
        elif op == "free" and live:
            req = live.pop(list(live)[arg % len(live)])
            mgr.free(req)
        _check_invariants(mgr, live)
