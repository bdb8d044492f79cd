"""The KV-cache groups of a model, managed together over one block pool.

Mirrors upstream ``vllm/v1/core/kv_cache_coordinator.py`` at v0.22.1:
``KVCacheCoordinator`` (:28), ``KVCacheCoordinatorNoPrefixCache`` (:276),
``UnitaryKVCacheCoordinator`` (:324), ``HybridKVCacheCoordinator`` (:392)
and ``get_kv_cache_coordinator`` (:610), which picks one as upstream does:
no prefix caching -> no-prefix-cache; one group -> unitary; else hybrid.

Left out: EAGLE groups, cross-attention, KV events and the metrics
collector, decode/prefill context parallelism, KV connectors' external
tokens, and groups of different block sizes (every group here has the
cache's block size, so upstream's ``lcm_block_size`` is that block size and
the hybrid ``cache_blocks`` rounding it adds changes nothing).

Invariants kept:
- every group's block table covers the same tokens (nulls where a window
  skipped them), and all groups draw from one free queue;
- the hybrid hit is the longest prefix every group can serve: each kind of
  group in turn may only shorten the candidate, full attention first, until
  no kind shortens it (a fixed point; one round for full + one other kind).
"""

from __future__ import annotations

from collections.abc import Sequence

from mini_vllm.core.block_pool import BlockPool
from mini_vllm.core.kv_cache_utils import BlockHash, KVCacheBlock
from mini_vllm.core.single_type_kv_cache_manager import (
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
)
from mini_vllm.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheConfig
from mini_vllm.request import Request


class KVCacheCoordinator:
    """Hands each call to the manager of every KV-cache group."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        enable_caching: bool,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching)
        self.single_type_managers = tuple(
            get_manager_for_kv_cache_spec(
                group.kv_cache_spec,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                block_pool=self.block_pool,
                enable_caching=enable_caching,
                kv_cache_group_id=i,
            )
            for i, group in enumerate(kv_cache_config.kv_cache_groups)
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Free blocks all groups together need (they share one pool)."""
        return sum(
            manager.get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                new_computed_blocks[i],
                total_computed_tokens,
                apply_admission_cap=apply_admission_cap,
            )
            for i, manager in enumerate(self.single_type_managers)
        )

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_local_computed_tokens: int,
    ) -> None:
        for i, manager in enumerate(self.single_type_managers):
            manager.allocate_new_computed_blocks(
                request_id, new_computed_blocks[i], num_local_computed_tokens
            )

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            manager.allocate_new_blocks(request_id, num_tokens)
            for manager in self.single_type_managers
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [
            manager.get_num_common_prefix_blocks(running_request_id)
            for manager in self.single_type_managers
        ]

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, total_computed_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            manager.req_to_blocks.get(request_id) or [] for manager in self.single_type_managers
        )

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """(hit blocks per group, hit tokens)."""
        raise NotImplementedError


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: any number of groups, never a hit."""

    def __init__(
        self, kv_cache_config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int
    ) -> None:
        super().__init__(kv_cache_config, max_model_len, max_num_batched_tokens, False)
        self.num_single_type_manager = len(self.single_type_managers)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_single_type_manager

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        return tuple([] for _ in range(self.num_single_type_manager)), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One group (all layers full attention, or all one window)."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        enable_caching: bool,
    ) -> None:
        super().__init__(kv_cache_config, max_model_len, max_num_batched_tokens, enable_caching)
        assert len(kv_cache_config.kv_cache_groups) == 1, "a unitary coordinator has one group"
        self.kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = self.kv_cache_spec.block_size

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        hit_blocks = self.single_type_managers[0].find_longest_cache_hit(
            block_hashes, max_cache_hit_length, [0], self.block_pool, self.kv_cache_spec
        )
        return hit_blocks, len(hit_blocks[0]) * self.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups of different kinds (full attention and windows)."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        enable_caching: bool,
    ) -> None:
        super().__init__(kv_cache_config, max_model_len, max_num_batched_tokens, enable_caching)
        block_sizes = {g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups}
        assert len(block_sizes) == 1, "mini_vllm's KV-cache groups share one block size"
        self.verify_and_split_kv_cache_groups()

    # mirrors vllm/v1/core/kv_cache_coordinator.py:436-479
    def verify_and_split_kv_cache_groups(self) -> None:
        """Gather groups of equal specs (one lookup serves them all), full
        attention first: its left-to-right scan bounds the others."""
        attention_groups: list[tuple[AttentionSpec, list[int], type[SingleTypeKVCacheManager]]] = []
        for i, group in enumerate(self.kv_cache_config.kv_cache_groups):
            manager_cls = type(self.single_type_managers[i])
            for spec, group_ids, _ in attention_groups:
                if spec == group.kv_cache_spec:
                    group_ids.append(i)
                    break
            else:
                attention_groups.append((group.kv_cache_spec, [i], manager_cls))
        assert len(attention_groups) > 1, "a hybrid coordinator needs two kinds of groups"
        self.attention_groups = sorted(
            attention_groups, key=lambda g: not isinstance(g[0], FullAttentionSpec)
        )

    # BEGIN LAB 07.2: the hybrid prefix-cache hit: a fixed point across groups
    # mirrors vllm/v1/core/kv_cache_coordinator.py:503-607
    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest prefix every group can serve, by a fixed point.

        Each kind of group in turn looks for a hit no longer than the
        current candidate, and its hit becomes the candidate (it can only
        shrink). When a round shrinks it, every kind looks again, since a
        window's hit at the shorter length may be shorter still. Full
        attention looks up once: its hits are a prefix, so a shorter
        candidate just truncates them.
        """
        # HINT: self.attention_groups: (spec, group ids, manager class), full attention
        # HINT: first; manager_cls.find_longest_cache_hit(block_hashes, length, group_ids,
        # HINT: self.block_pool, spec) gives one block list per group id.
        # HINT: loop until a whole round leaves the candidate length unchanged.
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        hit_length = max_cache_hit_length
        hit_blocks_by_group: list[list[KVCacheBlock] | None] = [None] * num_groups
        # Full attention plus one other kind: one round is enough.
        is_simple_hybrid = len(self.attention_groups) == 2 and isinstance(
            self.attention_groups[0][0], FullAttentionSpec
        )
        while True:
            curr_hit_length = hit_length
            for spec, group_ids, manager_cls in self.attention_groups:
                if (
                    isinstance(spec, FullAttentionSpec)
                    and hit_blocks_by_group[group_ids[0]] is not None
                ):
                    curr_hit_length = curr_hit_length // spec.block_size * spec.block_size
                    continue
                hit_blocks = manager_cls.find_longest_cache_hit(
                    block_hashes, curr_hit_length, group_ids, self.block_pool, spec
                )
                curr_hit_length = len(hit_blocks[0]) * spec.block_size
                for group_id, blocks in zip(group_ids, hit_blocks, strict=True):
                    hit_blocks_by_group[group_id] = blocks
            if curr_hit_length >= hit_length:
                break
            hit_length = curr_hit_length
            if is_simple_hybrid:
                break
        spec, group_ids, _ = self.attention_groups[0]
        if isinstance(spec, FullAttentionSpec):
            for group_id in group_ids:
                blocks = hit_blocks_by_group[group_id]
                if blocks is not None:
                    del blocks[hit_length // spec.block_size :]
        return tuple(b if b is not None else [] for b in hit_blocks_by_group), hit_length

    # END LAB 07.2


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    max_num_batched_tokens: int,
    enable_caching: bool,
) -> KVCacheCoordinator:
    """Upstream's choice: no prefix caching, one group, or several."""
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(
            kv_cache_config, max_model_len, max_num_batched_tokens
        )
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(
            kv_cache_config, max_model_len, max_num_batched_tokens, enable_caching
        )
    return HybridKVCacheCoordinator(
        kv_cache_config, max_model_len, max_num_batched_tokens, enable_caching
    )
