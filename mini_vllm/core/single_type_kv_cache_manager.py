"""One KV-cache group's block tables: what it allocates, frees and hits.

Mirrors upstream ``vllm/v1/core/single_type_kv_cache_manager.py`` at v0.22.1:
``SingleTypeKVCacheManager`` (:31), ``FullAttentionManager`` (:481),
``SlidingWindowManager`` (:542) and ``get_manager_for_kv_cache_spec``
(:1214, with the spec-to-manager map just above it). The coordinator
(``kv_cache_coordinator.py``) holds one manager per group; all of them
allocate from the one ``BlockPool``.

Left out: the chunked-local, Mamba, cross-attention and sink managers;
EAGLE's dropped last block; decode/prefill context parallelism; KV
connectors' external tokens; groups of different block sizes (every group
here has the cache's block size, so upstream's ``alignment_tokens`` is
always one block and its SWA cache mask never applies); ``new_block_ids``
(zeroing, for Mamba).

Invariants kept:
- a request's block table covers its tokens from position 0; a block that
  slid out of a window is the null block in the table, never freed twice;
- ``num_cached_block[req]`` exists exactly while the request is running,
  and counts its leading blocks already registered (nulls included);
- a hit for a window group is a run of cached blocks just before the hit's
  end, long enough to cover the window; blocks before the run are nulls.
"""

from __future__ import annotations

from collections.abc import Sequence

from mini_vllm.core.block_pool import BlockPool
from mini_vllm.core.kv_cache_utils import BlockHash, KVCacheBlock
from mini_vllm.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)
from mini_vllm.request import Request


class SingleTypeKVCacheManager:
    """The block tables of one KV-cache group (one kind of attention)."""

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:
        self.block_size = kv_cache_spec.block_size
        self.kv_cache_spec = kv_cache_spec
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        # The most blocks a window group's request holds at once (None: no cap).
        self._max_admission_blocks_per_request = max_admission_blocks_per_request
        # request id -> its blocks in token order (null blocks for skipped ones).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> leading blocks already in the prefix cache (running only).
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Free blocks this group needs so the request has ``num_tokens`` slots.

        A running request has no new hits: it needs what its table lacks. A
        new one needs blocks past its hits and past what the window skips;
        hits that sit in the free queue cost free capacity too (touching them
        takes them out), except those the window skips. With
        ``apply_admission_cap`` (the full-sequence gate) a window group never
        counts more than it can hold at once.
        """
        num_required_blocks = cdiv(num_tokens, self.block_size)
        if apply_admission_cap and self._max_admission_blocks_per_request is not None:
            num_required_blocks = min(num_required_blocks, self._max_admission_blocks_per_request)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            assert not new_computed_blocks, "a running request has no new prefix hits"
            return max(num_required_blocks - num_req_blocks, 0)

        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local_computed_blocks = len(new_computed_blocks) + num_req_blocks
        num_new_blocks = max(
            num_required_blocks - max(num_skipped_blocks, num_local_computed_blocks), 0
        )
        num_skipped_hits = max(0, num_skipped_blocks - num_req_blocks)
        num_evictable = sum(
            1 for b in new_computed_blocks[num_skipped_hits:] if b.ref_cnt == 0 and not b.is_null
        )
        return num_new_blocks + num_evictable

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
    ) -> None:
        """Give a new request its prefix hits: touch them, put nulls where the
        window skips, and count them all as cached."""
        if request_id in self.num_cached_block:
            assert not new_computed_blocks, "a running request has no new prefix hits"
            return
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not req_blocks, "only a request with no blocks can take prefix hits"
        num_skipped = self.get_num_skipped_tokens(num_local_computed_tokens) // self.block_size
        new_computed_blocks = new_computed_blocks[num_skipped:]
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        else:
            assert not new_computed_blocks, "no prefix hits when prefix caching is off"
        req_blocks.extend([self._null_block] * num_skipped)
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Blocks from the pool so the request has ``num_tokens`` slots; the new ones."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    # BEGIN LAB 07.3: register one group's full blocks under that group's keys
    # mirrors vllm/v1/core/single_type_kv_cache_manager.py:278-321
    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that ``num_tokens`` tokens fill, in this group.

        ``self.num_cached_block[request_id]`` counts the leading blocks already
        registered; the blocks after them, up to the last full one, go to
        ``BlockPool.cache_full_blocks`` with this manager's group id, so each
        group's blocks are cached under keys of their own group.
        """
        # HINT: a block is full when all block_size of its tokens are computed.
        # HINT: cache_full_blocks takes kv_cache_group_id: pass self.kv_cache_group_id.
        num_cached_blocks = self.num_cached_block.get(request.request_id, 0)
        num_full_blocks = num_tokens // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request.request_id],
            num_cached_blocks,
            num_full_blocks,
            kv_cache_group_id=self.kv_cache_group_id,
        )
        self.num_cached_block[request.request_id] = num_full_blocks

    # END LAB 07.3

    # BEGIN LAB 07.3: free one group's blocks, tail first
    # mirrors vllm/v1/core/single_type_kv_cache_manager.py:338-354
    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (the end of a prefix is
        evicted before its start); nulls in the table are skipped by the pool.
        Forgets the request here (its table and cached-block count); a request
        that holds no blocks (aborted before it got any) is fine."""
        # HINT: BlockPool.free_blocks queues blocks that reach zero in the order given.
        req_blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(req_blocks))
        self.num_cached_block.pop(request_id, None)

    # END LAB 07.3

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        raise NotImplementedError

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: list[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: AttentionSpec,
    ) -> tuple[list[KVCacheBlock], ...]:
        """The longest hit of at most ``max_length`` tokens that every group in
        ``kv_cache_group_ids`` (all of this kind and spec) can serve: one block
        list per group, nulls where the group needs no block."""
        raise NotImplementedError

    # BEGIN LAB 07.1: free the blocks a window has left behind
    # mirrors vllm/v1/core/single_type_kv_cache_manager.py:420-461
    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Free the blocks no later token will attend to, putting the null
        block in their place; walks back from the last skipped block and
        stops at the first null (everything before it was freed earlier)."""
        # HINT: get_num_skipped_tokens(total_computed_tokens) // block_size leading
        # HINT: blocks are out of the window; free them with one free_blocks call.
        num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks.get(request_id, [])
        num_skipped_blocks = min(num_skipped_tokens // self.block_size, len(blocks))
        removed: list[KVCacheBlock] = []
        for i in range(num_skipped_blocks - 1, -1, -1):
            if blocks[i] is self._null_block:
                break
            removed.append(blocks[i])
            blocks[i] = self._null_block
        self.block_pool.free_blocks(removed)

    # END LAB 07.1

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no later token attends to (none by default)."""
        return 0


class FullAttentionManager(SingleTypeKVCacheManager):
    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: list[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: AttentionSpec,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Walk the hashes left to right and stop at the first miss: a hash
        chains every block before it, so nothing after a miss can hit."""
        assert isinstance(kv_cache_spec, FullAttentionSpec)
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        for block_hash in block_hashes[: max_length // kv_cache_spec.block_size]:
            cached = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
            if cached is None:
                break
            for blocks, block in zip(computed, cached, strict=True):
                blocks.append(block)
        return computed

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks every request holding blocks shares (cascade attention)."""
        count = 0
        for block in self.req_to_blocks.get(running_request_id, ()):
            if block.ref_cnt != len(self.req_to_blocks):
                break
            count += 1
        return count


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(self, kv_cache_spec: SlidingWindowSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.sliding_window = kv_cache_spec.sliding_window

    # BEGIN LAB 07.1: a window group's prefix-cache hit, searched from the right
    # mirrors vllm/v1/core/single_type_kv_cache_manager.py:547-639
    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: list[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: AttentionSpec,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Search from the right for a run of cached blocks that covers the
        window before the hit's end (``cdiv(sliding_window - 1, block_size)``
        blocks: the next token is in its own window); the blocks before the
        run are nulls. Without such a run, only a run starting at block 0 is
        a hit (the blocks of a short prefix are all in the window)."""
        # HINT: block_pool.get_cached_block(hash, kv_cache_group_ids) gives one block
        # HINT: per group, or None on a miss; a miss resets the run.
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        block_size = kv_cache_spec.block_size
        num_contiguous_needed = cdiv(kv_cache_spec.sliding_window - 1, block_size)
        max_num_blocks = max_length // block_size
        computed = tuple([block_pool.null_block] * max_num_blocks for _ in kv_cache_group_ids)
        num_contiguous = 0
        for i in range(max_num_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                num_contiguous = 0
                continue
            for blocks, block in zip(computed, cached, strict=True):
                blocks[i] = block
            num_contiguous += 1
            if num_contiguous >= num_contiguous_needed:
                # Drop what lies past the run: [NULL, 8, 3, NULL, 9] -> [NULL, 8, 3].
                for blocks in computed:
                    del blocks[i + num_contiguous :]
                return computed
        # No run long enough: the leading run (from block 0) is still a hit.
        for blocks in computed:
            del blocks[num_contiguous:]
        return computed

    # END LAB 07.1

    # BEGIN LAB 07.1: the tokens before the next token's window
    # mirrors vllm/v1/core/single_type_kv_cache_manager.py:654-680
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the next token's window: with window 4 and 7 tokens
        computed, token 7 sees tokens 4-7, so tokens 0-3 (4 of them) are skipped."""
        # HINT: the next token (number num_computed_tokens) sees sliding_window tokens,
        # HINT: itself included; never a negative count.
        return max(0, num_computed_tokens - self.sliding_window + 1)

    # END LAB 07.1

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """0: a window group's leading blocks are nulls, so counting shared
        references as full attention does would be wrong (upstream too)."""
        return 0


spec_manager_map: dict[type[AttentionSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def get_manager_for_kv_cache_spec(
    kv_cache_spec: AttentionSpec, max_num_batched_tokens: int, max_model_len: int, **kwargs
) -> SingleTypeKVCacheManager:
    """The manager of a group of ``kv_cache_spec``; a window group gets the
    admission cap the start-up sizing assumed (one source of truth)."""
    manager_class = spec_manager_map[type(kv_cache_spec)]
    if isinstance(kv_cache_spec, SlidingWindowSpec):
        kwargs["max_admission_blocks_per_request"] = kv_cache_spec.max_admission_blocks_per_request(
            max_num_batched_tokens, max_model_len
        )
    return manager_class(kv_cache_spec, **kwargs)
