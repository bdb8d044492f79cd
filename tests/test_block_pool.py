"""Unit tests for mini_vllm.core.block_pool.BlockPool.

The pool owns every KV block. Rules checked here:
- block 0 is the null block: never handed out, never put in the free queue;
- ref_cnt counts holders; a block is in the free queue exactly when
  ref_cnt == 0 (and it is not the null block);
- free_blocks() appends to the back of the free queue in the order given,
  and the front is reused first, so that order is the eviction order;
- a cached (hashed) block keeps its hash while free, so it can still be a
  prefix-cache hit, until get_new_blocks() reuses it and evicts the hash.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_vllm.core.block_pool import BlockPool
from mini_vllm.testing import cache_key, create_requests, first_hit

BS = 4  # block size used for the requests whose hashes we cache


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def cached_request(num_tokens: int, request_id: str = "0", token: int = 7):
    """A request whose prompt is ``num_tokens`` copies of ``token``, hashed with BS."""
    (req,) = create_requests(
        1, block_size=BS, req_ids=[request_id], prompt_token_ids=[[token] * num_tokens]
    )
    return req


# --------------------------------------------------------------------------
# the null block
# --------------------------------------------------------------------------


def test_null_block_is_block_zero_and_not_free():
    """Block 0 is reserved as the null block, so n blocks give n - 1 free ones."""
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert not any(b.is_null for b in pool.blocks[1:])
    assert pool.get_num_free_blocks() == 4
    assert free_ids(pool) == [1, 2, 3, 4]


def test_get_new_blocks_never_returns_the_null_block():
    """Allocating every free block yields ids 1..n-1; one more raises ValueError."""
    pool = BlockPool(5, enable_caching=True)
    got = pool.get_new_blocks(4)
    assert [b.block_id for b in got] == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_freeing_the_null_block_never_puts_it_in_the_queue():
    """free_blocks() skips the null block even when its count drops to 0."""
    pool = BlockPool(3, enable_caching=True)
    pool.touch([pool.null_block])  # would raise if touch tried to dequeue it
    pool.free_blocks([pool.null_block])
    pool.free_blocks([pool.null_block])
    assert free_ids(pool) == [1, 2]
    assert pool.get_num_free_blocks() == 2


# --------------------------------------------------------------------------
# reference counts
# --------------------------------------------------------------------------


def test_new_blocks_have_one_reference_and_leave_the_queue():
    """get_new_blocks() takes blocks off the front with ref_cnt 1."""
    pool = BlockPool(5, enable_caching=True)
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [1, 2]
    assert all(b.ref_cnt == 1 for b in got)
    assert free_ids(pool) == [3, 4]


def test_shared_block_is_freed_only_by_its_last_holder():
    """touch() adds a holder; the block returns to the queue only at ref_cnt 0."""
    pool = BlockPool(4, enable_caching=True)  # free: [1, 2, 3]
    (blk,) = pool.get_new_blocks(1)  # block 1; free: [2, 3]
    pool.touch([blk])  # a second request shares it
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1
    assert blk.block_id not in free_ids(pool)
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0
    assert free_ids(pool) == [2, 3, 1]  # back of the queue


def test_touch_pulls_a_free_block_out_of_the_middle_of_the_queue():
    """touch() on a ref_cnt 0 block removes it from the free queue, wherever it is."""
    pool = BlockPool(6, enable_caching=True)
    b1, b2, b3 = pool.get_new_blocks(3)
    pool.free_blocks([b1, b2, b3])
    assert free_ids(pool) == [4, 5, 1, 2, 3]
    pool.touch([b2])
    assert b2.ref_cnt == 1
    assert free_ids(pool) == [4, 5, 1, 3]
    assert pool.get_num_free_blocks() == 4


def test_touch_on_a_held_block_does_not_change_the_queue():
    """A block with holders is not in the queue, so touch() only bumps ref_cnt."""
    pool = BlockPool(4, enable_caching=True)
    (blk,) = pool.get_new_blocks(1)
    before = free_ids(pool)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    assert free_ids(pool) == before


# --------------------------------------------------------------------------
# eviction order
# --------------------------------------------------------------------------


def test_freed_blocks_join_the_back_in_the_given_order():
    """free_blocks([a, b]) appends a then b behind the blocks already free."""
    pool = BlockPool(6, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    assert free_ids(pool) == [3, 4, 5]
    pool.free_blocks([b2, b1])
    assert free_ids(pool) == [3, 4, 5, 2, 1]


def test_free_order_is_reuse_order():
    """Blocks come back out of get_new_blocks() in the order they were freed
    (least recently freed first), not in id order."""
    pool = BlockPool(5, enable_caching=True)
    b1, b2, b3, b4 = pool.get_new_blocks(4)
    pool.free_blocks([b3, b1])
    pool.free_blocks([b4, b2])
    assert free_ids(pool) == [3, 1, 4, 2]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 1]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [4, 2]


# --------------------------------------------------------------------------
# the prefix cache
# --------------------------------------------------------------------------


def test_cache_full_blocks_registers_each_block_under_its_hash():
    """cache_full_blocks(req, blocks, 0, n) gives blocks[i] hash i and makes it a hit."""
    pool = BlockPool(5, enable_caching=True)
    req = cached_request(2 * BS)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    for blk, h in zip(blocks, req.block_hashes, strict=True):
        assert blk.block_hash == cache_key(h)
        assert first_hit(pool, h) is blk


def test_cache_full_blocks_only_touches_the_requested_range():
    """Blocks before num_cached_blocks and from num_full_blocks on are left alone."""
    pool = BlockPool(6, enable_caching=True)
    req = cached_request(3 * BS)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(req, blocks, 1, 2)
    assert [b.block_hash for b in blocks] == [None, cache_key(req.block_hashes[1]), None, None]
    assert first_hit(pool, req.block_hashes[0]) is None
    pool.cache_full_blocks(req, blocks, 2, 2)  # empty range: no-op
    assert blocks[2].block_hash is None


def test_uncached_hash_misses():
    """A hash nobody registered is not a hit."""
    pool = BlockPool(4, enable_caching=True)
    assert first_hit(pool, cached_request(BS).block_hashes[0]) is None


def test_freed_cached_blocks_stay_hits_until_reused():
    """Freeing a cached block keeps its hash; reusing it evicts exactly that hash."""
    pool = BlockPool(4, enable_caching=True)  # free: [1, 2, 3]
    req = cached_request(2 * BS)
    h0, h1 = req.block_hashes
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, [b1, b2], 0, 2)
    pool.free_blocks([b2, b1])  # tail first, as the manager does
    assert free_ids(pool) == [3, 2, 1]
    # Still hits while sitting in the free queue with no holder.
    assert first_hit(pool, h0) is b1 and b1.ref_cnt == 0
    assert first_hit(pool, h1) is b2 and b2.ref_cnt == 0

    # Block 3 was never cached: reusing it evicts nothing.
    pool.get_new_blocks(1)
    assert first_hit(pool, h0) is b1 and first_hit(pool, h1) is b2

    # Block 2 is next: reusing it evicts h1 (and only h1).
    (reused,) = pool.get_new_blocks(1)
    assert reused is b2
    assert b2.block_hash is None
    assert first_hit(pool, h1) is None
    assert first_hit(pool, h0) is b1


def test_a_free_cached_hit_can_be_revived_with_touch():
    """A hit found in the free queue is taken back by touch(): still cached,
    held again, and no longer a candidate for reuse."""
    pool = BlockPool(4, enable_caching=True)
    req = cached_request(BS)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [blk], 0, 1)
    pool.free_blocks([blk])
    hit = first_hit(pool, req.block_hashes[0])
    pool.touch([hit])
    assert hit is blk and blk.ref_cnt == 1
    assert blk.block_id not in free_ids(pool)
    # Allocating everything else cannot evict it any more.
    pool.get_new_blocks(pool.get_num_free_blocks())
    assert first_hit(pool, req.block_hashes[0]) is blk


def test_duplicate_hashes_lookup_returns_the_oldest():
    """Two blocks may carry the same hash (no de-duplication). A lookup returns
    the one cached first (not the lowest id); when it is evicted, the other."""
    pool = BlockPool(5, enable_caching=True)  # free: [1, 2, 3, 4]
    req_a = cached_request(BS, "a")
    req_b = cached_request(BS, "b")  # same prompt, so same hash
    (h,) = req_a.block_hashes
    assert req_b.block_hashes == [h]
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_blocks(req_a, [b2], 0, 1)  # block 2 cached first
    pool.cache_full_blocks(req_b, [b1], 0, 1)
    assert b1.block_hash == b2.block_hash == cache_key(h)
    assert first_hit(pool, h) is b2

    pool.free_blocks([b2])  # queue: [3, 4, 2]
    pool.get_new_blocks(3)  # reuses 3, 4, then 2: evicts block 2's entry
    assert b2.block_hash is None
    assert first_hit(pool, h) is b1


def test_reset_prefix_cache_refused_while_blocks_are_in_use():
    """reset_prefix_cache() returns False and keeps the cache if any block is held."""
    pool = BlockPool(4, enable_caching=True)
    req = cached_request(BS)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [blk], 0, 1)
    assert pool.reset_prefix_cache() is False
    assert first_hit(pool, req.block_hashes[0]) is blk
    assert blk.block_hash == cache_key(req.block_hashes[0])


def test_reset_prefix_cache_forgets_every_hash_when_all_blocks_are_free():
    """With every block free, reset_prefix_cache() succeeds and nothing hits."""
    pool = BlockPool(4, enable_caching=True)
    req = cached_request(2 * BS)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    pool.free_blocks(reversed(blocks))
    order_before = free_ids(pool)
    assert pool.reset_prefix_cache() is True
    assert all(first_hit(pool, h) is None for h in req.block_hashes)
    assert all(b.block_hash is None for b in pool.blocks)
    assert free_ids(pool) == order_before  # the free queue itself is untouched


def test_usage_counts_held_blocks_out_of_the_usable_ones():
    """usage = held / (num_gpu_blocks - 1), because the null block is unusable."""
    pool = BlockPool(5, enable_caching=False)  # 4 usable blocks
    assert pool.get_usage() == 0.0
    got = pool.get_new_blocks(2)
    assert pool.get_usage() == pytest.approx(2 / 4)
    pool.get_new_blocks(2)
    assert pool.get_usage() == pytest.approx(1.0)
    pool.free_blocks(got)
    assert pool.get_usage() == pytest.approx(2 / 4)


# --------------------------------------------------------------------------
# property test: ref counts and the free queue always agree
# --------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(min_value=1, max_value=10),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["alloc", "free", "touch"]), st.integers(min_value=0, max_value=100)
        ),
        max_size=50,
    ),
)
def test_free_queue_holds_exactly_the_unreferenced_blocks(num_blocks, ops):
    """After any mix of get_new_blocks / free_blocks / touch, the free queue is
    exactly the non-null blocks with ref_cnt 0, and each ref_cnt equals the
    number of references handed out and not yet returned."""
    pool = BlockPool(num_blocks, enable_caching=True)
    held: list = []  # one entry per outstanding reference

    for op, arg in ops:
        if op == "alloc":
            n = arg % (pool.get_num_free_blocks() + 1)
            got = pool.get_new_blocks(n)
            assert not any(b.is_null for b in got)
            held.extend(got)
        elif op == "free" and held:
            pool.free_blocks([held.pop(arg % len(held))])
        elif op == "touch":
            # touch any real block: held ones gain a holder, free ones revive
            blk = pool.blocks[1 + arg % (num_blocks - 1)] if num_blocks > 1 else None
            if blk is not None:
                pool.touch([blk])
                held.append(blk)

        queued = pool.free_block_queue.get_all_free_blocks()
        assert len(queued) == pool.get_num_free_blocks()
        expected_free = {b.block_id for b in pool.blocks if not b.is_null and held.count(b) == 0}
        assert {b.block_id for b in queued} == expected_free
        assert len(queued) == len(expected_free)  # no block queued twice
        for b in pool.blocks[1:]:
            assert b.ref_cnt == held.count(b)
