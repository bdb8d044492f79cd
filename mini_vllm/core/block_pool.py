"""The pool of KV-cache blocks: allocate, free, touch, and the prefix cache.

Mirrors upstream ``vllm/v1/core/block_pool.py`` at v0.22.1 (``BlockPool`` at
:130, ``BlockHashToBlockMap`` at :34). Every KV-cache group allocates from
this one pool; the prefix cache is keyed by block hash *and* group id
(``make_block_hash_with_group_id``), so a block cached by one group is never
a hit for another.
What is left out, and every deliberate difference: UPSTREAM_PIN.md.

Invariants kept:
- block 0 is the null block: never allocated, never freed, never cached;
- ``ref_cnt`` of a block equals the number of requests holding it;
- a cached block stays in the prefix cache after its last holder frees it
  (it sits in the free queue, ``ref_cnt == 0``) until it is reused, which
  evicts it;
- several blocks may carry the same hash (no de-duplication, so a running
  request's block table is append-only); lookups return the oldest.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from mini_vllm.core.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    make_block_hash_with_group_id,
)

if TYPE_CHECKING:
    from mini_vllm.request import Request


class BlockPool:
    def __init__(self, num_gpu_blocks: int, enable_caching: bool) -> None:
        assert isinstance(num_gpu_blocks, int) and num_gpu_blocks > 0
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # (hash + group id) -> {block_id: block}, oldest insertion first.
        # Upstream stores a bare block when there is one and switches to a
        # dict on the second; a dict always gives the same lookups with one
        # code path.
        self.cached_block_hash_to_block: dict[BlockHashWithGroupId, dict[int, KVCacheBlock]] = {}
        # BEGIN LAB 02.2: the block pool: reserve the null block (block 0)
        # HINT: receives self.free_block_queue; leaves self.null_block set.
        # HINT: block 0 is a placeholder that is never handed out, freed or cached:
        # HINT: take it out of the free queue for good and mark it (is_null).
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # END LAB 02.2

    # BEGIN LAB 02.3: prefix cache: look a block hash up
    # mirrors vllm/v1/core/block_pool.py:184-209
    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """For each group in ``kv_cache_group_ids``, a block cached under
        ``block_hash`` in that group; ``None`` if any group misses.

        When several blocks carry the hash in a group (two requests computed
        the same prefix), take the one cached first.
        """
        # HINT: the key is make_block_hash_with_group_id(block_hash, group_id);
        # HINT: a plain dict keeps insertion order.
        cached_blocks = []
        for group_id in kv_cache_group_ids:
            key = make_block_hash_with_group_id(block_hash, group_id)
            blocks = self.cached_block_hash_to_block.get(key)
            if not blocks:
                return None
            cached_blocks.append(next(iter(blocks.values())))
        return cached_blocks

    # END LAB 02.3

    # BEGIN LAB 02.3: register newly full blocks in the prefix cache
    # mirrors vllm/v1/core/block_pool.py:211-331
    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        kv_cache_group_id: int = 0,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` by hash.

        ``blocks`` is the request's whole block table in group
        ``kv_cache_group_id``; block ``i`` holds the tokens hashed in
        ``request.block_hashes[i]``. Each block gets the key of that hash in
        this group (``make_block_hash_with_group_id``) as its ``block_hash``
        and joins ``cached_block_hash_to_block[key]`` under its block id.
        The null block (a sliding window's placeholder) is never cached.
        Blocks with equal keys are all kept.
        """
        # HINT: the blocks before num_cached_blocks were registered by an earlier call.
        if num_cached_blocks >= num_full_blocks:
            return
        assert len(request.block_hashes) >= num_full_blocks
        for i in range(num_cached_blocks, num_full_blocks):
            blk = blocks[i]
            if blk.is_null:
                continue
            key = make_block_hash_with_group_id(request.block_hashes[i], kv_cache_group_id)
            blk.block_hash = key
            self.cached_block_hash_to_block.setdefault(key, {})[blk.block_id] = blk

    # END LAB 02.3

    # BEGIN LAB 02.2: allocate blocks from the front of the free queue
    # mirrors vllm/v1/core/block_pool.py:333-363
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks off the front of the free queue.

        Raises ``ValueError`` (and takes nothing) when fewer are free. Each
        block returned has ``ref_cnt == 1``. A block that still carries a
        prefix-cache hash is evicted first: reusing it overwrites its KV, so
        its hash must no longer lead anyone to it.
        """
        # HINT: one popleft_n; then, for each block, evict it if caching is on, and
        # HINT: take the first reference.
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        for block in ret:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
        return ret

    # END LAB 02.2

    # BEGIN LAB 02.2: evict a block from the prefix cache
    # mirrors vllm/v1/core/block_pool.py:365-400
    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop ``block`` from the prefix cache if it is in it; True if it was.

        Removes only this block id from ``cached_block_hash_to_block[hash]``
        (other blocks may share the hash), drops the hash's entry once it
        is empty, and clears the block's hash.
        """
        # HINT: block.block_hash (the key: hash + group id) is None for a block
        # HINT: that was never cached.
        block_hash = block.block_hash
        if block_hash is None:
            return False
        blocks = self.cached_block_hash_to_block.get(block_hash)
        if blocks is None or blocks.pop(block.block_id, None) is None:
            return False
        if not blocks:
            del self.cached_block_hash_to_block[block_hash]
        block.reset_hash()
        return True

    # END LAB 02.2

    # BEGIN LAB 02.2: take a reference on blocks another request cached
    # mirrors vllm/v1/core/block_pool.py:402-417
    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue.

        A hit block with ``ref_cnt == 0`` sits in the free queue (an eviction
        candidate): it leaves the queue before its count goes up. The null
        block is never in the queue.
        """
        # HINT: FreeKVCacheBlockQueue.remove unlinks a block from the middle in O(1).
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    # END LAB 02.2

    # BEGIN LAB 02.2: release blocks, keeping their eviction order
    # mirrors vllm/v1/core/block_pool.py:419-433
    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero join the
        back of the free queue in the given order (first = evicted first).

        A freed block keeps its hash: it stays a prefix-cache hit until it is
        reused. Blocks still held by another request, and the null block,
        stay out of the queue.
        """
        # HINT: ordered_blocks may be a one-shot iterator (reversed(...)): make a list.
        # HINT: one append_n for the blocks that reached zero, in the order given.
        blocks = list(ordered_blocks)
        for block in blocks:
            block.ref_cnt -= 1
        self.free_block_queue.append_n([b for b in blocks if b.ref_cnt == 0 and not b.is_null])

    # END LAB 02.2

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop these blocks from the prefix cache (held or free, they stay
        where they are). Upstream (:435) uses it for blocks whose KV failed to
        load; mini_vllm for the blocks of requests whose step raised."""
        for block_id in block_ids:
            self._maybe_evict_cached_block(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if self.num_gpu_blocks - self.get_num_free_blocks() != 1:
            return False
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.reset_hash()
        return True

    # mirrors vllm/v1/core/block_pool.py:489-495
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        total = self.num_gpu_blocks - 1  # the null block is never usable
        return 1.0 - self.get_num_free_blocks() / total if total else 0.0
