"""Unit tests for mini_vllm.core.kv_cache_utils.

Two topics:
- FreeKVCacheBlockQueue: a doubly linked list of free blocks, kept in
  eviction order (front = evicted first);
- block hashing: each full block's hash chains on the hash of the block
  before it, so equal hashes mean equal *prefixes*, not just equal blocks.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_vllm.core import kv_cache_utils
from mini_vllm.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_request_block_hasher,
    hash_block_tokens,
    sha256,
)
from mini_vllm.request import Request
from mini_vllm.sampling_params import SamplingParams

# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def make_queue(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def walk_backwards(queue: FreeKVCacheBlockQueue) -> list[KVCacheBlock]:
    """Follow prev_free_block from the tail sentinel to the head sentinel.

    get_all_free_blocks() only follows the *next* links; walking the *prev*
    links too checks that both directions of the list agree."""
    out = []
    curr = queue.fake_free_list_tail.prev_free_block
    while curr is not queue.fake_free_list_head:
        out.append(curr)
        curr = curr.prev_free_block
    return out[::-1]


def assert_queue_is(
    queue: FreeKVCacheBlockQueue, expected: list[KVCacheBlock], all_blocks: list[KVCacheBlock]
) -> None:
    """The queue holds exactly ``expected``, in that order, and is well linked."""
    assert queue.get_all_free_blocks() == expected
    assert walk_backwards(queue) == expected
    assert queue.num_free_blocks == len(expected)
    # A block that is not in the queue must not keep stale links into it.
    in_queue = {id(b) for b in expected}
    for b in all_blocks:
        if id(b) not in in_queue:
            assert b.prev_free_block is None and b.next_free_block is None, b


def make_request(prompt: list[int], block_size: int, request_id: str = "r") -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=100),
        arrival_time=0.0,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def hashes_from_scratch(tokens: list[int], block_size: int) -> list[bytes]:
    """Reference: hash every full block of ``tokens``, chaining by hand."""
    out: list[bytes] = []
    parent = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(sha256, parent, tokens[start : start + block_size])
        out.append(parent)
    return out


# --------------------------------------------------------------------------
# KVCacheBlock
# --------------------------------------------------------------------------


def test_new_block_is_unreferenced_unhashed_and_unlinked():
    """A fresh block: ref_cnt 0, no hash, not linked, not the null block."""
    b = KVCacheBlock(7)
    assert (b.block_id, b.ref_cnt, b.block_hash, b.is_null) == (7, 0, None, False)
    assert b.prev_free_block is None and b.next_free_block is None


def test_block_hash_can_only_be_set_once_until_reset():
    """Setting a hash on an already-hashed block is a bug; reset_hash() allows a new one."""
    b = KVCacheBlock(1)
    b.block_hash = b"h1"
    with pytest.raises(AssertionError):
        b.block_hash = b"h2"
    assert b.block_hash == b"h1"
    b.reset_hash()
    assert b.block_hash is None
    b.block_hash = b"h2"
    assert b.block_hash == b"h2"


# --------------------------------------------------------------------------
# FreeKVCacheBlockQueue: single operations
# --------------------------------------------------------------------------


def test_queue_starts_in_block_id_order():
    """A new queue holds every block it was given, ordered by id."""
    blocks, q = make_queue(5)
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    assert_queue_is(q, blocks, blocks)


def test_empty_queue():
    """An empty queue has no blocks and popleft() raises ValueError."""
    _, q = make_queue(0)
    assert q.num_free_blocks == 0
    assert q.get_all_free_blocks() == []
    with pytest.raises(ValueError):
        q.popleft()


def test_popleft_takes_the_front_block_and_unlinks_it():
    """popleft() returns the front (lowest id at start) and detaches it."""
    blocks, q = make_queue(3)
    first = q.popleft()
    assert first is blocks[0]
    assert_queue_is(q, blocks[1:], blocks)


def test_popleft_until_empty_then_raises():
    """Popping every block returns them in order; one more pop raises."""
    blocks, q = make_queue(3)
    assert [q.popleft() for _ in range(3)] == blocks
    assert_queue_is(q, [], blocks)
    with pytest.raises(ValueError):
        q.popleft()


def test_popleft_n_takes_n_from_the_front_in_order():
    """popleft_n(n) returns the first n blocks in queue order."""
    blocks, q = make_queue(5)
    popped = q.popleft_n(3)
    assert popped == blocks[:3]
    assert_queue_is(q, blocks[3:], blocks)


def test_popleft_n_all_and_zero():
    """popleft_n(0) changes nothing; popleft_n(all) empties the queue."""
    blocks, q = make_queue(4)
    assert q.popleft_n(0) == []
    assert_queue_is(q, blocks, blocks)
    assert q.popleft_n(4) == blocks
    assert_queue_is(q, [], blocks)
    # The emptied queue still works: appending brings a block back.
    q.append(blocks[2])
    assert_queue_is(q, [blocks[2]], blocks)


def test_popleft_n_too_many_raises_and_changes_nothing():
    """Asking for more blocks than are free raises ValueError, queue untouched."""
    blocks, q = make_queue(3)
    with pytest.raises(ValueError):
        q.popleft_n(4)
    assert_queue_is(q, blocks, blocks)


def test_remove_from_the_middle_relinks_only_the_neighbours():
    """remove() unlinks one block in O(1): only it and its two neighbours'
    links change, no other block in the list is touched (no walk)."""
    blocks, q = make_queue(6)

    def links():
        return {b.block_id: (b.prev_free_block, b.next_free_block) for b in blocks}

    before = links()
    q.remove(blocks[3])
    after = links()

    changed = {bid for bid in before if before[bid] != after[bid]}
    assert changed == {2, 3, 4}
    assert blocks[2].next_free_block is blocks[4]
    assert blocks[4].prev_free_block is blocks[2]
    assert_queue_is(q, [blocks[i] for i in (0, 1, 2, 4, 5)], blocks)


def test_remove_first_and_last():
    """Removing the front or back block works like removing a middle one."""
    blocks, q = make_queue(4)
    q.remove(blocks[0])
    q.remove(blocks[3])
    assert_queue_is(q, blocks[1:3], blocks)


def test_remove_a_block_that_is_not_queued_raises():
    """remove() of a block outside the queue is a caller bug: RuntimeError, count kept."""
    blocks, q = make_queue(3)
    popped = q.popleft()
    with pytest.raises(RuntimeError):
        q.remove(popped)
    assert_queue_is(q, blocks[1:], blocks)


def test_append_and_append_n_go_to_the_back_in_order():
    """Appended blocks join the back, in the order given."""
    blocks, q = make_queue(5)
    taken = q.popleft_n(4)  # queue: [4]
    q.append_n([taken[2], taken[0]])
    q.append(taken[3])
    assert ids(q.get_all_free_blocks()) == [4, 2, 0, 3]
    assert_queue_is(q, [blocks[i] for i in (4, 2, 0, 3)], blocks)


def test_append_n_empty_is_a_no_op():
    """append_n([]) leaves the queue as it was."""
    blocks, q = make_queue(3)
    q.append_n([])
    assert_queue_is(q, blocks, blocks)


# --------------------------------------------------------------------------
# FreeKVCacheBlockQueue against a plain Python list model
# --------------------------------------------------------------------------

# Each op is (name, argument). The argument picks a block or a count; it is
# reduced modulo the current size so every generated op is meaningful.
_ops = st.lists(
    st.tuples(
        st.sampled_from(["popleft", "popleft_n", "remove", "append", "append_n"]),
        st.integers(min_value=0, max_value=1000),
        st.integers(min_value=0, max_value=1000),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(min_value=0, max_value=12), ops=_ops)
def test_queue_matches_a_list_model(num_blocks, ops):
    """Under any sequence of operations the queue holds the same blocks, in
    the same order, as a plain list that does the obvious thing."""
    blocks, q = make_queue(num_blocks)
    model = list(blocks)  # model[0] is the front of the queue

    for name, a, b in ops:
        outside = [blk for blk in blocks if blk not in model]  # not queued
        if name == "popleft":
            if model:
                assert q.popleft() is model.pop(0)
            else:
                with pytest.raises(ValueError):
                    q.popleft()
        elif name == "popleft_n":
            n = a % (len(model) + 2)  # sometimes one more than is free
            if n <= len(model):
                assert q.popleft_n(n) == model[:n]
                del model[:n]
            else:
                with pytest.raises(ValueError):
                    q.popleft_n(n)
        elif name == "remove" and model:
            q.remove(model.pop(a % len(model)))
        elif name == "append" and outside:
            blk = outside[a % len(outside)]
            q.append(blk)
            model.append(blk)
        elif name == "append_n" and outside:
            # a rotated slice of the outside blocks, so the order varies
            k = 1 + b % len(outside)
            chosen = [outside[(a + i) % len(outside)] for i in range(k)]
            q.append_n(chosen)
            model.extend(chosen)
        assert_queue_is(q, model, blocks)


# --------------------------------------------------------------------------
# Hashing
# --------------------------------------------------------------------------


def test_none_hash_seeds_from_pythonhashseed_else_zero(monkeypatch):
    """Seeded with hash_fn(PYTHONHASHSEED) as upstream; with the variable unset,
    hash_fn("0") (upstream: random), so hashes are reproducible across processes."""
    monkeypatch.setenv("PYTHONHASHSEED", "python hash seed")
    kv_cache_utils.init_none_hash(sha256)
    assert kv_cache_utils.NONE_HASH == sha256("python hash seed")
    monkeypatch.delenv("PYTHONHASHSEED")
    kv_cache_utils.init_none_hash(sha256)
    assert kv_cache_utils.NONE_HASH == sha256("0")


def test_first_block_chains_on_none_hash():
    """A block with no parent is hashed as if its parent were NONE_HASH."""
    toks = [1, 2, 3, 4]
    assert hash_block_tokens(sha256, None, toks) == hash_block_tokens(
        sha256, kv_cache_utils.NONE_HASH, toks
    )


def test_hash_depends_on_tokens_not_container_type():
    """Equal token contents give equal hashes (list or tuple); any change differs."""
    h = hash_block_tokens(sha256, None, [1, 2, 3, 4])
    assert h == hash_block_tokens(sha256, None, (1, 2, 3, 4))
    assert h != hash_block_tokens(sha256, None, [1, 2, 3, 5])
    assert h != hash_block_tokens(sha256, None, [4, 3, 2, 1])


def test_extra_keys_change_the_hash():
    """Extra keys (e.g. a LoRA id upstream) are part of the hash key."""
    toks = [1, 2, 3, 4]
    assert hash_block_tokens(sha256, None, toks) != hash_block_tokens(
        sha256, None, toks, extra_keys=("lora-1",)
    )


def test_same_tokens_after_different_prefixes_hash_differently():
    """Chaining: block B after prefix A1 differs from block B after prefix A2,
    so a prefix-cache hit on B implies the whole prefix matched."""
    parent1 = hash_block_tokens(sha256, None, [1, 1, 1, 1])
    parent2 = hash_block_tokens(sha256, None, [2, 2, 2, 2])
    same_block = [9, 9, 9, 9]
    assert hash_block_tokens(sha256, parent1, same_block) != hash_block_tokens(
        sha256, parent2, same_block
    )


def test_request_hashes_only_full_blocks():
    """A request gets one hash per *full* block; a partial tail block has none."""
    bs = 4
    for n_tokens, n_full in [(0, 0), (3, 0), (4, 1), (7, 1), (8, 2), (10, 2)]:
        req = make_request(list(range(n_tokens)), bs)
        assert len(req.block_hashes) == n_full, n_tokens


def test_request_hashes_chain_block_by_block():
    """Hash i of a request is hash(hash i-1, tokens of block i)."""
    bs = 4
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    req = make_request(prompt, bs)
    h0 = hash_block_tokens(sha256, None, prompt[0:4])
    h1 = hash_block_tokens(sha256, h0, prompt[4:8])
    assert req.block_hashes == [h0, h1]


def test_changing_an_early_token_changes_every_later_hash():
    """One different token in block 0 makes every following block hash differ."""
    bs = 4
    a = make_request([1] * 12, bs)
    b = make_request([2] + [1] * 11, bs)
    assert all(x != y for x, y in zip(a.block_hashes, b.block_hashes, strict=True))


def test_shared_prefix_shares_leading_hashes_only():
    """Two prompts equal for one block then different: first hash equal, second not."""
    bs = 4
    a = make_request([5, 5, 5, 5, 1, 1, 1, 1], bs)
    b = make_request([5, 5, 5, 5, 2, 2, 2, 2], bs)
    assert a.block_hashes[0] == b.block_hashes[0]
    assert a.block_hashes[1] != b.block_hashes[1]


def test_request_without_hasher_has_no_hashes():
    """With no block_hasher (prefix caching off) block_hashes stays empty."""
    req = Request("r", [1] * 32, SamplingParams(), arrival_time=0.0)
    req.append_output_token_ids([2] * 16)
    assert req.block_hashes == []


def test_hasher_hashes_several_blocks_at_once():
    """Appending enough tokens to fill several blocks hashes all of them."""
    bs = 4
    req = make_request([1, 2, 3], bs)
    assert req.block_hashes == []
    req.append_output_token_ids([4, 5, 6, 7, 8, 9, 10, 11, 12])  # 12 tokens
    assert req.block_hashes == hashes_from_scratch(list(range(1, 13)), bs)


@settings(max_examples=200, deadline=None)
@given(
    block_size=st.integers(min_value=1, max_value=5),
    prompt=st.lists(st.integers(min_value=0, max_value=3), max_size=12),
    appends=st.lists(
        st.one_of(
            st.integers(min_value=0, max_value=3),
            st.lists(st.integers(min_value=0, max_value=3), max_size=7),
        ),
        max_size=10,
    ),
)
def test_incremental_hashing_equals_hashing_from_scratch(block_size, prompt, appends):
    """After every append of output tokens, the request's hashes equal those
    of a fresh request whose prompt is all its tokens so far."""
    req = make_request(prompt, block_size)
    assert req.block_hashes == hashes_from_scratch(prompt, block_size)
    for chunk in appends:
        req.append_output_token_ids(chunk)
        tokens = list(req.all_token_ids)
        assert req.block_hashes == hashes_from_scratch(tokens, block_size)
        assert req.block_hashes == make_request(tokens, block_size).block_hashes
