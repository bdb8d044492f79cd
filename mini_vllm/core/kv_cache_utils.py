"""KV-cache block metadata, the free-block queue, prefix block hashing, and
the grouping of layers into KV-cache groups.

Mirrors upstream ``vllm/v1/core/kv_cache_utils.py`` at v0.22.1:
``make_block_hash_with_group_id`` (:55), ``KVCacheBlock`` (:116),
``FreeKVCacheBlockQueue`` (:164), ``hash_block_tokens`` (:541),
``get_request_block_hasher`` (:637), ``generate_block_hash_extra_keys``
(:503, LoRA's, multimodal and prompt-embedding keys:
``_gen_mm_extra_hash_keys`` :395, ``_gen_prompt_embeds_extra_hash_keys`` :477),
``init_none_hash`` (:97); the grouping:
``create_kv_cache_group_specs`` (:822), ``is_kv_cache_spec_uniform`` (:852),
``_get_kv_cache_groups_uniform_page_size`` (:1057),
``get_kv_cache_config_from_groups`` (:1236), ``unify_hybrid_kv_cache_specs``
(:1324), ``get_kv_cache_groups`` (:1618). The hash functions are in
``mini_vllm/utils/hashing.py``.
What is left out, and every deliberate difference: UPSTREAM_PIN.md.

Invariants kept:
- a block is in the free queue exactly when ``ref_cnt == 0`` and it is not
  the null block;
- the free queue is a doubly linked list threaded through the blocks
  themselves, so removing a block from the middle is O(1);
- a block hash chains its parent's hash, so equal hashes mean equal prefixes;
  the chain starts from ``hash_fn(PYTHONHASHSEED)``, or ``hash_fn("0")`` when
  the variable is unset (upstream then draws random bytes).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NewType

import torch

from mini_vllm.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    cdiv,
    get_num_blocks,
)
from mini_vllm.utils.hashing import sha256

if TYPE_CHECKING:
    from mini_vllm.request import Request

BlockHash = NewType("BlockHash", bytes)
# A BlockHash with its KV-cache group id appended (4 bytes, big-endian): the
# key of the prefix cache, so each group caches its own blocks.
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)


# BEGIN LAB 07.3: the prefix cache's key: a block hash and its group id
# mirrors vllm/v1/core/kv_cache_utils.py:55-64
def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """The prefix-cache key of ``block_hash`` in KV-cache group ``group_id``:
    the hash's bytes, then the group id as 4 unsigned big-endian bytes (one
    ``bytes`` object, not a tuple: cheap to hash and compare)."""
    # HINT: int.to_bytes(length, byteorder, signed=...) turns the id into bytes.
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big", signed=False))


# END LAB 07.3


# BEGIN LAB 07.3: the block hash inside a key
# mirrors vllm/v1/core/kv_cache_utils.py:67-69
def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    """The ``BlockHash`` inside a prefix-cache key (all but its last 4 bytes)."""
    # HINT: the inverse of make_block_hash_with_group_id's first part.
    return BlockHash(key[:-4])


# END LAB 07.3


# BEGIN LAB 07.3: the group id inside a key
# mirrors vllm/v1/core/kv_cache_utils.py:72-74
def get_group_id(key: BlockHashWithGroupId) -> int:
    """The KV-cache group id inside a prefix-cache key (its last 4 bytes)."""
    # HINT: int.from_bytes reads what int.to_bytes wrote, with the same byte order.
    return int.from_bytes(key[-4:], "big", signed=False)


# END LAB 07.3


def init_none_hash(hash_fn: Callable[[Any], bytes]) -> None:
    """Seed the chain: ``hash_fn(PYTHONHASHSEED)``, or ``hash_fn("0")`` when the
    variable is unset (where upstream draws ``os.urandom(32)``)."""
    global NONE_HASH
    NONE_HASH = BlockHash(hash_fn(os.getenv("PYTHONHASHSEED", "0")))


# The hash every chain starts from (the "parent" of block 0): what
# init_none_hash(sha256) sets, so block hashes work before anyone calls it.
NONE_HASH = BlockHash(sha256(os.getenv("PYTHONHASHSEED", "0")))


class KVCacheBlock:
    """Metadata of one KV-cache block (the tensors live in the model runner)."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "_block_hash",
        "prev_free_block",
        "next_free_block",
        "is_null",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set only while the block is full and registered in the prefix cache:
        # its key there, the block hash with the group id appended.
        self._block_hash: BlockHashWithGroupId | None = None
        # Links used only by FreeKVCacheBlockQueue.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        assert self._block_hash is None, "block already has a hash"
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        self._block_hash = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the front is evicted (reused) first.

    Starts ordered by block id. Freed blocks go to the back, so the front is
    the least recently used. Callers free a request's blocks tail-first, so
    among blocks freed together the tail of a prefix is evicted first.
    Two sentinel blocks (id -1) bracket the list so no operation branches on
    emptiness.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(-1)
        self.fake_free_list_tail = KVCacheBlock(-1)
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    # BEGIN LAB 02.1: the free-block queue: a doubly linked list in eviction order
    # mirrors vllm/v1/core/kv_cache_utils.py:216-251
    def popleft(self) -> KVCacheBlock:
        """Take the front block (the next to evict) out of the queue and return it.

        Raises ``ValueError`` when the queue is empty. The returned block is
        unlinked (both of its links are ``None``) and ``num_free_blocks``
        drops by one.
        """
        # HINT: the front block is fake_free_list_head.next_free_block; the queue is
        # HINT: empty when that is the fake tail. Unlinking a block is remove()'s job.
        first = self.fake_free_list_head.next_free_block
        if first is self.fake_free_list_tail:
            raise ValueError("No free blocks available")
        self.remove(first)
        return first

    # END LAB 02.1

    # BEGIN LAB 02.1: pop n blocks at once
    # mirrors vllm/v1/core/kv_cache_utils.py:253-284
    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the ``n`` front blocks out of the queue, front first.

        ``n == 0`` returns ``[]``; more than ``num_free_blocks`` raises
        ``ValueError`` and leaves the queue as it was. Every returned block
        is unlinked. One pass: the head is re-linked once, after the loop.
        """
        # HINT: walk n blocks from the head, clearing each one's links as you go,
        # HINT: then join the fake head to the first block you did not take.
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} free")
        ret = []
        curr = self.fake_free_list_head.next_free_block
        for _ in range(n):
            ret.append(curr)
            nxt = curr.next_free_block
            curr.prev_free_block = curr.next_free_block = None
            curr = nxt
        self.fake_free_list_head.next_free_block = curr
        curr.prev_free_block = self.fake_free_list_head
        self.num_free_blocks -= n
        return ret

    # END LAB 02.1

    # BEGIN LAB 02.1: remove a block from the middle in O(1)
    # mirrors vllm/v1/core/kv_cache_utils.py:286-304
    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it sits in the queue, in O(1).

        A prefix-cache hit on a free block takes it out of the middle of the
        queue this way. A block that is not in the queue (both links
        ``None``) raises ``RuntimeError`` and changes nothing.
        """
        # HINT: join the block's two neighbours to each other, then clear its links.
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on a block not in the queue: {block}")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    # END LAB 02.1

    # BEGIN LAB 02.1: append one block at the back
    # mirrors vllm/v1/core/kv_cache_utils.py:306-327
    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back of the queue (the last to be evicted)."""
        self.append_n([block])

    # END LAB 02.1

    # BEGIN LAB 02.1: append blocks at the back, in order
    # mirrors vllm/v1/core/kv_cache_utils.py:329-352
    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` at the back of the queue, keeping their order:
        ``blocks[0]`` will be evicted before ``blocks[1]``, and all of them
        after every block already in the queue."""
        # HINT: the current last block is fake_free_list_tail.prev_free_block.
        if not blocks:
            return
        last = self.fake_free_list_tail.prev_free_block
        # The tail sentinel always has a predecessor (the head, when empty);
        # None means the list is corrupt, and upstream asserts on it too.
        assert last is not None, "the free list's tail sentinel lost its predecessor"
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    # END LAB 02.1

    # mirrors vllm/v1/core/kv_cache_utils.py:354-372
    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, front (next to evict) first. For tests and plots."""
        ret = []
        curr = self.fake_free_list_head.next_free_block
        while curr is not self.fake_free_list_tail:
            ret.append(curr)
            curr = curr.next_free_block
        return ret


# BEGIN LAB 02.3: prefix cache: hash one full block, chained on its parent's hash
# mirrors vllm/v1/core/kv_cache_utils.py:541-568
def hash_block_tokens(
    hash_function: Callable[[Any], bytes],
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash of one full block, chained on the hash of the block before it.

    The key hashed is the triple ``(parent hash, the block's token ids as a
    tuple, extra_keys)``; the first block of a request has no parent and
    chains on ``NONE_HASH`` instead. Upstream builds the same triple, so the
    bytes equal upstream's (run with ``PYTHONHASHSEED=0``).
    """
    # HINT: a tuple, not a list: sha256() pickles the key, and the two pickle differently.
    if not parent_block_hash:
        parent_block_hash = NONE_HASH
    return BlockHash(hash_function((parent_block_hash, tuple(curr_block_token_ids), extra_keys)))


# END LAB 02.3


# mirrors vllm/v1/core/kv_cache_utils.py:395-460
def _gen_mm_extra_hash_keys(
    request: Request, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[list[Any], int]:
    """(identifier, offset of the item relative to the block's start) for every
    multimodal item whose placeholders the block ``[start_token_idx,
    end_token_idx)`` overlaps, and the index of the item the next block should
    start looking at. Two requests with the same placeholder tokens but
    different images then never share a block; the same image at another
    offset in the block does not either. ``start_mm_idx`` -1 means the last item.
    Items are in prompt order (by offset)."""
    extra_keys: list[Any] = []
    mm_features = request.mm_features
    if not mm_features:
        return extra_keys, start_mm_idx
    last = mm_features[-1].mm_position
    if last.offset + last.length <= start_token_idx:
        return extra_keys, start_mm_idx  # past every item (late prefill, decode)
    if start_mm_idx < 0:
        start_mm_idx += len(mm_features)
    mm_idx = start_mm_idx
    while mm_idx < len(mm_features):
        feature = mm_features[mm_idx]
        offset, length = feature.mm_position.offset, feature.mm_position.length
        if end_token_idx <= offset:
            break  # the block ends before this item
        if start_token_idx >= offset + length:
            mm_idx += 1  # the block starts after this item
            continue
        extra_keys.append((feature.identifier, offset - start_token_idx))
        if end_token_idx < offset + length:
            break  # the item runs on into the next block
        mm_idx += 1  # the item ends here; the next one may start in this block
    return extra_keys, mm_idx


# mirrors vllm/v1/utils.py:666 (upstream's kv_cache_utils imports it, and tests patch it here)
def tensor_data(tensor: torch.Tensor) -> memoryview:
    """A tensor's raw bytes, read as uint8: what a hash of its values reads."""
    return tensor.flatten().cpu().contiguous().view(torch.uint8).numpy().data


# mirrors vllm/v1/core/kv_cache_utils.py:477-500
def _gen_prompt_embeds_extra_hash_keys(
    request: Request, start_token_idx: int, end_token_idx: int
) -> list[bytes]:
    """For a prompt given as embeddings, the sha256 of the block's rows (its
    token ids are placeholder zeros, the same for every such prompt); [] else.
    Each block range is hashed once per request."""
    prompt_embeds = getattr(request, "prompt_embeds", None)
    if prompt_embeds is None:
        return []
    block_range = (start_token_idx, end_token_idx)
    embeds_hash = request._prompt_embeds_per_block_hashes.get(block_range)
    if embeds_hash is None:
        rows = prompt_embeds[start_token_idx:end_token_idx]
        embeds_hash = hashlib.sha256(tensor_data(rows)).digest()
        request._prompt_embeds_per_block_hashes[block_range] = embeds_hash
    return [embeds_hash]


# mirrors vllm/v1/core/kv_cache_utils.py:503-538 (and _gen_lora_extra_hash_keys, :462)
def generate_block_hash_extra_keys(
    request: Request, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[tuple[Any, ...] | None, int]:
    """What the block ``[start_token_idx, end_token_idx)``'s hash carries
    besides its tokens, and the next multimodal index: the adapter's name for
    a LoRA request (so two adapters never share cached KV), then the
    multimodal items it overlaps (``_gen_mm_extra_hash_keys``), then, for a
    prompt given as embeddings, the hash of the block's rows; None if none.
    Upstream also adds a cache salt, which mini_vllm does not have."""
    mm_keys, next_mm_idx = _gen_mm_extra_hash_keys(
        request, start_token_idx, end_token_idx, start_mm_idx
    )
    lora_request = getattr(request, "lora_request", None)
    lora_keys = [] if lora_request is None else [lora_request.lora_name]
    embeds_keys = _gen_prompt_embeds_extra_hash_keys(request, start_token_idx, end_token_idx)
    extra_keys = lora_keys + mm_keys + embeds_keys  # upstream's order (no cache salt)
    return (tuple(extra_keys) if extra_keys else None), next_mm_idx


# mirrors vllm/v1/core/kv_cache_utils.py:637-688
def get_request_block_hasher(
    block_size: int, caching_hash_fn: Callable[[Any], bytes] = sha256
) -> Callable[[Request], list[BlockHash]]:
    """A function that returns the hashes of a request's newly full blocks."""

    def request_block_hasher(request: Request) -> list[BlockHash]:
        # BEGIN LAB 02.3: hash the blocks that became full since the last call
        # HINT: receives request, block_size, caching_hash_fn; returns the new hashes.
        # HINT: request.block_hashes already holds one hash per block hashed before;
        # HINT: hash only whole blocks of request.all_token_ids after those, each
        # HINT: chained on the previous one (the last known hash, or None at the start).
        # HINT: each block's extra_keys come from generate_block_hash_extra_keys(request,
        # HINT: start, end, mm_idx), which also returns the mm_idx for the next block
        # HINT: (start at 0 for the first block, -1 (the last image) past it: only
        # HINT: output tokens fill later blocks). A LoRA request's blocks carry its
        # HINT: adapter's name (Phase 11), an image's blocks its hash (Phase 13).
        start = len(request.block_hashes) * block_size
        tokens = request.all_token_ids
        if start + block_size > len(tokens):
            return []  # no block became full (most calls: one token was added)
        parent = request.block_hashes[-1] if request.block_hashes else None
        mm_idx = 0 if start == 0 else -1
        new_hashes: list[BlockHash] = []
        while start + block_size <= len(tokens):
            extra_keys, mm_idx = generate_block_hash_extra_keys(
                request, start, start + block_size, mm_idx
            )
            block = tokens[start : start + block_size]
            parent = hash_block_tokens(caching_hash_fn, parent, block, extra_keys)
            new_hashes.append(parent)
            start += block_size
        return new_hashes
        # END LAB 02.3

    return request_block_hasher


# ---------------------------------------------------------------- KV-cache groups


def create_kv_cache_group_specs(
    kv_cache_spec: dict[str, AttentionSpec], grouped_layer_names: list[list[str]]
) -> list[KVCacheGroupSpec]:
    """One ``KVCacheGroupSpec`` per list of layer names, its spec merged from
    the layers' specs (which must agree)."""
    groups = []
    for layer_names in grouped_layer_names:
        specs = [kv_cache_spec[name] for name in layer_names]
        groups.append(KVCacheGroupSpec(layer_names, specs[0].merge(specs)))
    return groups


def is_kv_cache_spec_uniform(kv_cache_spec: dict[str, AttentionSpec]) -> bool:
    """Whether every layer's spec merges into one (full attention with and
    without a recorded window counts as one)."""
    if not kv_cache_spec:
        return True
    specs = list(kv_cache_spec.values())
    try:
        specs[0].merge(specs)
    except AssertionError:
        return False
    return True


def unify_hybrid_kv_cache_specs(kv_cache_spec: dict[str, AttentionSpec]) -> None:
    """With the hybrid manager off: turn every sliding-window layer of a model
    that also has full-attention layers into full attention (keeping the
    window on the spec), in place, so the model gets one group."""
    if is_kv_cache_spec_uniform(kv_cache_spec):
        return
    has_full = any(isinstance(s, FullAttentionSpec) for s in kv_cache_spec.values())
    if has_full:
        for name, spec in kv_cache_spec.items():
            if isinstance(spec, SlidingWindowSpec):
                kv_cache_spec[name] = FullAttentionSpec(
                    block_size=spec.block_size,
                    num_kv_heads=spec.num_kv_heads,
                    head_size=spec.head_size,
                    dtype=spec.dtype,
                    sliding_window=spec.sliding_window,
                )
    if not is_kv_cache_spec_uniform(kv_cache_spec):
        raise ValueError(
            "the hybrid KV-cache manager is disabled but the layers' KV-cache specs "
            "cannot be unified into one"
        )


# BEGIN LAB 07.4: split a hybrid model's layers into KV-cache groups
# mirrors vllm/v1/core/kv_cache_utils.py:1057-1120
def _get_kv_cache_groups_uniform_page_size(
    kv_cache_spec: dict[str, AttentionSpec],
) -> list[KVCacheGroupSpec]:
    """Groups for a model with several kinds of layers of one page size.

    Layers with equal specs are gathered; each kind is cut into groups of
    the same number of layers (the smallest kind's count, or the largest's
    when no kind has 1.5 times the layers of another), so every group's
    block costs the same memory. Layer ``i`` of a kind goes to group
    ``i % num_groups`` of that kind (upstream's stride, kept for pipeline
    parallelism). A kind whose count does not divide evenly leaves its last
    group short (upstream logs the padding it implies).
    """
    # HINT: gather layer names by spec (specs are hashable; a dict keeps first-seen
    # HINT: order), then create_kv_cache_group_specs(kv_cache_spec, grouped).
    same_type_layers: dict[AttentionSpec, list[str]] = {}
    for name, spec in kv_cache_spec.items():
        same_type_layers.setdefault(spec, []).append(name)
    counts = [len(layers) for layers in same_type_layers.values()]
    group_size = min(counts)
    if max(counts) < min(counts) * 1.5:
        group_size = max(counts)
    grouped: list[list[str]] = []
    for layers in same_type_layers.values():
        num_groups = cdiv(len(layers), group_size)
        grouped.extend(layers[i::num_groups] for i in range(num_groups))
    return create_kv_cache_group_specs(kv_cache_spec, grouped)


# END LAB 07.4


def get_kv_cache_groups(
    kv_cache_spec: dict[str, AttentionSpec], disable_hybrid_kv_cache_manager: bool = False
) -> list[KVCacheGroupSpec]:
    """Split the model's layers (name -> spec) into KV-cache groups.

    One group when every layer's spec is the same (most models); otherwise
    one group per kind of layer and per ``group_size`` layers of it. With
    ``disable_hybrid_kv_cache_manager`` sliding-window layers are managed
    as full attention, so a hybrid model gets one group.
    """
    if disable_hybrid_kv_cache_manager:
        unify_hybrid_kv_cache_specs(kv_cache_spec)
    if not kv_cache_spec:
        return []
    if is_kv_cache_spec_uniform(kv_cache_spec):
        return create_kv_cache_group_specs(kv_cache_spec, [list(kv_cache_spec)])
    if len({spec.page_size_bytes for spec in kv_cache_spec.values()}) != 1:
        raise ValueError("mini_vllm groups layers of one page size only (no page unification)")
    return _get_kv_cache_groups_uniform_page_size(kv_cache_spec)


def get_kv_cache_config_from_groups(
    kv_cache_groups: list[KVCacheGroupSpec],
    available_memory: int,
    num_gpu_blocks_override: int | None = None,
) -> KVCacheConfig:
    """How many blocks ``available_memory`` bytes hold, and the tensors.

    Every group shares one pool of blocks: there are ``group_size`` (the
    largest group's layer count) tensors, tensor ``i`` shared by layer ``i``
    of every group, each ``num_blocks`` pages. A block id therefore costs
    ``group_size`` pages, whichever group holds it.
    """
    if not kv_cache_groups:
        return KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
    group_size = max(len(group.layer_names) for group in kv_cache_groups)
    page_sizes = {group.kv_cache_spec.page_size_bytes for group in kv_cache_groups}
    assert len(page_sizes) == 1, "every KV-cache group must have the same page size"
    page_size = page_sizes.pop()
    num_blocks = get_num_blocks(group_size, available_memory, page_size, num_gpu_blocks_override)
    tensors = [
        KVCacheTensor(
            size=page_size * num_blocks,
            shared_by=[g.layer_names[i] for g in kv_cache_groups if i < len(g.layer_names)],
        )
        for i in range(group_size)
    ]
    return KVCacheConfig(num_blocks, tensors, kv_cache_groups)
