"""The scheduler's only window onto KV-cache memory.

Mirrors upstream ``vllm/v1/core/kv_cache_manager.py`` at v0.22.1
(``KVCacheBlocks`` at :26, ``KVCacheManager`` at :110,
``get_computed_blocks`` at :194, ``allocate_slots`` at :236, ``free`` at
:429).

Two paths, one class. With one full-attention KV-cache group (every model
Phases 02 and 03 run), the two layers upstream puts beneath the manager are
folded into it: ``UnitaryKVCacheCoordinator`` (kv_cache_coordinator.py:324)
and ``FullAttentionManager`` (single_type_kv_cache_manager.py:481); this is
the code Phase 02's labs build. Any other ``KVCacheConfig`` (sliding
windows, several groups) goes through a coordinator
(``mini_vllm/core/kv_cache_coordinator.py``) exactly as upstream's manager
does; so does prefix caching off with several groups. Both paths give the
same blocks for one full-attention group.
What is left out, and every deliberate difference: UPSTREAM_PIN.md.

Invariants kept:
- ``allocate_slots`` either allocates everything the step needs or returns
  ``None`` and changes nothing that matters (the scheduler then preempts);
- the count of blocks it needs includes prefix hits that sit in the free
  queue, because touching them takes them out of it;
- full blocks are registered in the prefix cache as soon as they are
  allocated, capped at ``request.num_tokens`` (tokens that really exist);
- a hit never covers the whole prompt: the last token is always recomputed
  so the model produces logits for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mini_vllm.core.block_pool import BlockPool
from mini_vllm.core.kv_cache_coordinator import KVCacheCoordinator, get_kv_cache_coordinator
from mini_vllm.core.kv_cache_utils import KVCacheBlock
from mini_vllm.kv_cache_interface import FullAttentionSpec, KVCacheConfig, cdiv
from mini_vllm.metrics.stats import PrefixCacheStats
from mini_vllm.request import Request


@dataclass
class KVCacheBlocks:
    """Blocks handed to the scheduler, one sequence per KV-cache group
    (``blocks[i][j]``: group i, block j of the request's tokens)."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        if allow_none and not any(self.blocks):  # every group empty
            return None
        return tuple([blk.block_id for blk in group] for group in self.blocks)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        *,
        kv_cache_config: KVCacheConfig | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        """``kv_cache_config``: the model's groups (default: one full-attention
        group of ``num_blocks`` blocks of ``block_size`` tokens, which must
        agree with a config given). ``max_num_batched_tokens`` sets a window
        group's admission cap (default ``max_model_len``, as upstream)."""
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        if kv_cache_config is not None:
            assert kv_cache_config.num_blocks == num_blocks, "num_blocks differs from the config"
            for group in kv_cache_config.kv_cache_groups:
                assert group.kv_cache_spec.block_size == block_size, "block sizes differ"
        # None: one full-attention group, folded into this class (Phase 02).
        self.coordinator: KVCacheCoordinator | None = None
        self.num_kv_cache_groups = 1
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        one_full_group = len(groups) == 1 and type(groups[0].kv_cache_spec) is FullAttentionSpec
        if kv_cache_config is not None and not one_full_group:
            self.coordinator = get_kv_cache_coordinator(
                kv_cache_config,
                max_model_len,
                max_num_batched_tokens or max_model_len,
                enable_caching,
            )
            self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
            self.block_pool = self.coordinator.block_pool
        else:
            self.block_pool = BlockPool(num_blocks, enable_caching)
        # request id -> its blocks, in token order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many of its leading blocks are in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # One shared empty result, so "no hit" is cheap and recognisable.
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    # mirrors vllm/v1/core/kv_cache_manager.py:182-192
    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Return the stats gathered since the last call, and start afresh."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # BEGIN LAB 02.3: prefix cache: the longest cached prefix of a request
    # mirrors vllm/v1/core/kv_cache_manager.py:194-234
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest run of cached full blocks that starts the request's tokens.

        Returns the blocks and the number of tokens they cover. At most
        ``num_tokens - 1`` tokens can hit, so the last prompt token is always
        computed (its logits sample the first output token). With caching
        off: no hits. Otherwise every lookup is recorded in
        ``self.prefix_cache_stats`` (tokens asked, tokens hit, and whether
        the request was preempted before), and "no hit" returns the shared
        ``self.empty_kv_cache_blocks``.
        """
        # HINT: walk request.block_hashes in order and stop at the first miss: a hash
        # HINT: chains every block before it, so nothing after a miss can hit.
        # HINT: the prefix cache's keys carry the group: look up in group [0].
        if self.coordinator is not None:
            return self._get_computed_blocks_by_group(request)
        if not self.enable_caching:
            return self.empty_kv_cache_blocks, 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_num_blocks]:
            cached = self.block_pool.get_cached_block(block_hash, [0])
            if cached is None:
                break  # hashes chain: after one miss nothing later can hit
            hits.append(cached[0])
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hit_tokens,
            preempted=request.num_preemptions > 0,
        )
        if not hits:
            return self.empty_kv_cache_blocks, 0
        return KVCacheBlocks((hits,)), num_hit_tokens

    # END LAB 02.3

    # BEGIN LAB 02.4: allocate_slots: how many free blocks a request needs
    def _get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free blocks needed so the request has slots for ``num_tokens`` tokens.

        The request already holds some blocks and is about to take
        ``new_computed_blocks`` (prefix hits) too; only the rest must come
        from the free queue. A hit that no request holds (``ref_cnt == 0``)
        sits in the free queue, and taking it removes it from there, so it
        costs free capacity as well.
        """
        # HINT: cdiv(num_tokens, self.block_size) blocks in all; never a negative count.
        num_required = cdiv(num_tokens, self.block_size)
        num_held = len(self.req_to_blocks.get(request_id, ()))
        num_new = max(num_required - num_held - len(new_computed_blocks), 0)
        # Hits with no holder sit in the free queue; touching them removes
        # them from it, so they cost free capacity too.
        if new_computed_blocks:
            num_new += sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new

    # END LAB 02.4

    # BEGIN LAB 02.4: give a request slots for its next tokens, or None
    # mirrors vllm/v1/core/kv_cache_manager.py:236-427
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
    ) -> KVCacheBlocks | None:
        """Give the request slots for ``num_new_tokens`` more tokens.

        Token layout of the request::

            | computed | new hits (new_computed_blocks) | external | new (to compute) |

        ``num_external_computed_tokens``: tokens a KV connector will load
        (Phase 15): they get fresh blocks, after the hits, and count as
        computed. ``delay_cache_blocks``: register nothing in the prefix
        cache yet (the load is asynchronous; the scheduler caches the blocks
        once it is done).

        Returns the newly allocated blocks (possibly none), or ``None`` when
        the free pool cannot cover them, in which case nothing is changed.
        With ``full_sequence_must_fit`` (the admission gate the scheduler
        uses for waiting requests) it also returns ``None`` unless the
        *whole* request, not just this chunk, would fit right now.

        On success, in this order: touch the hits and put them at the start
        of the request's block table, append the new blocks, then (caching
        on) register every block that is full once this step's tokens are
        computed, counting only tokens that exist (``request.num_tokens``).
        ``num_new_tokens == 0`` is a ``ValueError`` unless external tokens
        are coming (an asynchronous load schedules nothing to compute).
        """
        # HINT: the slots needed cover computed + hit + new (+ lookahead) tokens, capped
        # HINT: at max_model_len. Check every way to fail BEFORE changing anything.
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no external computed tokens"
            )
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        # Shaped for speed (mini only; the general path below gives the same
        # result): a running request whose blocks already hold every slot it
        # needs (most decode steps) takes no new block, so it cannot fail;
        # only the blocks this step fills are cached.
        if (
            req_blocks
            and new_computed_blocks is None
            and num_external_computed_tokens == 0
            and not full_sequence_must_fit
            and self.coordinator is None
            and request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
            <= len(req_blocks) * self.block_size
        ):
            if self.enable_caching and not delay_cache_blocks:
                num_tokens_to_cache = request.num_computed_tokens + num_new_tokens
                if num_tokens_to_cache > request.num_tokens:  # drafts are not tokens yet
                    num_tokens_to_cache = request.num_tokens
                self.cache_blocks(request, num_tokens_to_cache)
            return self.empty_kv_cache_blocks

        if self.coordinator is not None:
            if num_external_computed_tokens or delay_cache_blocks:
                raise ValueError("KV connectors need one full-attention KV-cache group.")
            return self._allocate_slots_by_group(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                new_computed_blocks,
                num_lookahead_tokens,
                full_sequence_must_fit,
            )
        new_computed = new_computed_blocks.blocks[0] if new_computed_blocks else ()
        num_local_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        total_computed_tokens = min(
            num_local_computed_tokens + num_external_computed_tokens, self.max_model_len
        )
        num_tokens_need_slot = min(
            total_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )

        free = self.block_pool.get_num_free_blocks()
        if full_sequence_must_fit:
            full_num_tokens = min(request.num_tokens, self.max_model_len)
            if self._get_num_blocks_to_allocate(request_id, full_num_tokens, new_computed) > free:
                return None

        if self._get_num_blocks_to_allocate(request_id, num_tokens_need_slot, new_computed) > free:
            return None

        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        if new_computed or num_external_computed_tokens > 0:
            # Only a request with no blocks yet can have prefix hits.
            assert not req_blocks
            if self.enable_caching:
                self.block_pool.touch(new_computed)
            req_blocks.extend(new_computed)
            self.num_cached_block[request_id] = len(req_blocks)
            if num_external_computed_tokens > 0:
                # Fresh blocks for the connector to load into (not returned
                # as new: the scheduler sends the whole table of a new request).
                num_loaded_blocks = cdiv(
                    num_local_computed_tokens + num_external_computed_tokens, self.block_size
                ) - len(req_blocks)
                req_blocks.extend(self.block_pool.get_new_blocks(num_loaded_blocks))

        num_new_blocks = cdiv(num_tokens_need_slot, self.block_size) - len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)

        if self.enable_caching and not delay_cache_blocks:
            # Cache every block that will be full once this step runs, but
            # never count tokens that do not exist yet (lookahead slots).
            self.cache_blocks(
                request, min(total_computed_tokens + num_new_tokens, request.num_tokens)
            )
        return KVCacheBlocks((new_blocks,)) if new_blocks else self.empty_kv_cache_blocks

    # END LAB 02.4

    # BEGIN LAB 02.3: cache the request's blocks that are full
    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that ``num_computed_tokens`` tokens fill.

        ``self.num_cached_block[request_id]`` counts the leading blocks of the
        request already in the prefix cache; only the blocks after those and
        up to the last full one are handed to ``BlockPool.cache_full_blocks``.
        """
        # HINT: a block is full when all block_size of its tokens are computed.
        if self.coordinator is not None:
            self.coordinator.cache_blocks(request, num_computed_tokens)
            return
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = num_computed_tokens // self.block_size
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[request_id], num_cached, num_full
        )
        self.num_cached_block[request_id] = num_full

    # END LAB 02.3

    # BEGIN LAB 02.4: release a request's blocks, tail first
    # mirrors vllm/v1/core/kv_cache_manager.py:429-437
    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so that the end of a
        prefix is evicted before its beginning.

        Forgets the request (its block table and cached-block count). Freeing
        a request that holds no blocks (aborted before it got any) is fine.
        """
        # HINT: BlockPool.free_blocks puts blocks that reach zero at the back of the
        # HINT: free queue in the order given: the first one given is evicted first.
        if self.coordinator is not None:
            self.coordinator.free(request.request_id)
            return
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request.request_id, None)

    # END LAB 02.4

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, the leading blocks shared by every request that holds
        blocks (cascade attention's input; 0 for a window group)."""
        if self.coordinator is not None:
            return self.coordinator.get_num_common_prefix_blocks(running_request_id)
        if not self.enable_caching:
            return [0]
        num_holders = len(self.req_to_blocks)
        count = 0
        for block in self.req_to_blocks.get(running_request_id, ()):
            if block.ref_cnt != num_holders:
                break
            count += 1
        return [count]

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        if self.coordinator is not None:
            return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))
        blocks = self.req_to_blocks.get(request_id)
        return KVCacheBlocks((blocks,)) if blocks else self.empty_kv_cache_blocks

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop these blocks from the prefix cache (BlockPool.evict_blocks)."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        """Blocks per group, or the shared empty result when every group has none."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    # ------------------------------------------------- through the coordinator

    # mirrors vllm/v1/core/kv_cache_manager.py:194-234
    def _get_computed_blocks_by_group(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest prefix every group can serve (the coordinator's search),
        never the whole prompt; recorded in the prefix-cache stats."""
        assert self.coordinator is not None
        if not self.enable_caching:
            return self.empty_kv_cache_blocks, 0
        blocks, num_hit_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hit_tokens,
            preempted=request.num_preemptions > 0,
        )
        return self.create_kv_cache_blocks(blocks), num_hit_tokens

    # mirrors vllm/v1/core/kv_cache_manager.py:236-427
    def _allocate_slots_by_group(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
        full_sequence_must_fit: bool,
    ) -> KVCacheBlocks | None:
        """``allocate_slots`` for any groups: first free the blocks every
        window has left behind (even if the request then does not fit), then
        count what all groups need, then take hits and new blocks, then cache."""
        coordinator = self.coordinator
        assert coordinator is not None
        hits = (new_computed_blocks or self.empty_kv_cache_blocks).blocks
        request_id = request.request_id
        num_local_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        total_computed_tokens = min(num_local_computed_tokens, self.max_model_len)
        if full_sequence_must_fit:
            full_num_tokens = min(request.num_tokens, self.max_model_len)
            needed = coordinator.get_num_blocks_to_allocate(
                request_id, full_num_tokens, hits, total_computed_tokens, apply_admission_cap=True
            )
            if needed > self.block_pool.get_num_free_blocks():
                return None
        num_tokens_need_slot = min(
            total_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        coordinator.remove_skipped_blocks(request_id, total_computed_tokens)
        needed = coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, hits, num_local_computed_tokens
        )
        if needed > self.block_pool.get_num_free_blocks():
            return None
        if hits is not self.empty_kv_cache_blocks.blocks:
            coordinator.allocate_new_computed_blocks(request_id, hits, num_local_computed_tokens)
        new_blocks = coordinator.allocate_new_blocks(request_id, num_tokens_need_slot)
        if self.enable_caching:
            coordinator.cache_blocks(
                request, min(total_computed_tokens + num_new_tokens, request.num_tokens)
            )
        return self.create_kv_cache_blocks(new_blocks)
