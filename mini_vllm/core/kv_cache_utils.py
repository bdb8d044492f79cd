"""KV-cache block metadata, the free-block queue, and prefix block hashing.

Mirrors upstream ``vllm/v1/core/kv_cache_utils.py`` at v0.22.1:
``KVCacheBlock`` (:116), ``FreeKVCacheBlockQueue`` (:164),
``hash_block_tokens`` (:541), ``get_request_block_hasher`` (:637),
``init_none_hash`` (:97). Left out: KV-cache group ids packed into the hash
key (mini_vllm has one group), extra hash keys (LoRA, multimodal, cache
salt), the KV-cache sizing helpers, CBOR/xxhash hash functions.

Invariants kept:
- a block is in the free queue exactly when ``ref_cnt == 0`` and it is not
  the null block;
- the free queue is a doubly linked list threaded through the blocks
  themselves, so removing a block from the middle is O(1);
- a block hash chains its parent's hash, so equal hashes mean equal prefixes.

Difference: upstream seeds the chain with ``os.urandom`` unless
PYTHONHASHSEED is set; mini_vllm always seeds it with ``sha256("0")``, so
its hashes are reproducible and equal upstream's run with PYTHONHASHSEED=0.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NewType

if TYPE_CHECKING:
    from mini_vllm.request import Request

BlockHash = NewType("BlockHash", bytes)


def sha256(obj: Any) -> bytes:
    """SHA-256 of the pickled object, as upstream's ``vllm.utils.hashing.sha256``."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


# The hash every chain starts from (the "parent" of block 0).
NONE_HASH = BlockHash(sha256("0"))


def init_none_hash(hash_fn: Callable[[Any], bytes], seed: str = "0") -> None:
    """Re-seed the chain (for example with another hash function)."""
    global NONE_HASH
    NONE_HASH = BlockHash(hash_fn(seed))


class KVCacheBlock:
    """Metadata of one KV-cache block (the tensors live in the model runner)."""

    __slots__ = ("block_id", "ref_cnt", "_block_hash", "prev_free_block",
                 "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set only while the block is full and registered in the prefix cache.
        self._block_hash: BlockHash | None = None
        # Links used only by FreeKVCacheBlockQueue.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    @property
    def block_hash(self) -> BlockHash | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHash) -> None:
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

    def popleft(self) -> KVCacheBlock:
        first = self.fake_free_list_head.next_free_block
        if first is self.fake_free_list_tail:
            raise ValueError("No free blocks available")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
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

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on a block not in the queue: {block}")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        if not blocks:
            return
        last = self.fake_free_list_tail.prev_free_block
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, front (next to evict) first. For tests and plots."""
        ret = []
        curr = self.fake_free_list_head.next_free_block
        while curr is not self.fake_free_list_tail:
            ret.append(curr)
            curr = curr.next_free_block
        return ret


def hash_block_tokens(
    hash_function: Callable[[Any], bytes],
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash of one full block, chained on the hash of the block before it."""
    if not parent_block_hash:
        parent_block_hash = NONE_HASH
    return BlockHash(hash_function((parent_block_hash, tuple(curr_block_token_ids), extra_keys)))


def get_request_block_hasher(
    block_size: int, caching_hash_fn: Callable[[Any], bytes] = sha256
) -> Callable[[Request], list[BlockHash]]:
    """A function that returns the hashes of a request's newly full blocks."""

    def request_block_hasher(request: Request) -> list[BlockHash]:
        start = len(request.block_hashes) * block_size
        tokens = request.all_token_ids
        parent = request.block_hashes[-1] if request.block_hashes else None
        new_hashes: list[BlockHash] = []
        while start + block_size <= len(tokens):
            parent = hash_block_tokens(caching_hash_fn, parent, tokens[start:start + block_size])
            new_hashes.append(parent)
            start += block_size
        return new_hashes

    return request_block_hasher
