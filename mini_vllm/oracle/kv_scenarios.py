"""Named KV-cache workloads, recorded from the pinned upstream as snapshots.

Each one drives ``KVCacheManager`` through a short story that isolates a
rule of Phase 02: the free queue's LRU order, eviction, prefix hits on
blocks that are held or free, duplicate hashes, the last-token rule,
running out of blocks, the full-sequence admission gate, decode growth
with lookahead slots, chunked prefill, caching off, and resetting the
cache. Blocks hold 4 tokens, so a reader can follow the block ids in the
recorded JSON (tests/snapshots/kv_cache/) by hand.
"""

from __future__ import annotations

from mini_vllm.oracle.kv_workload import KVWorkload, sampled_token


def _prompt(tag: int, n: int) -> list[int]:
    return [100 * tag + (i % 100) for i in range(n)]


def admit(req_id: str, num_tokens: int, **opts) -> list[list]:
    """What the scheduler does for a waiting request: look its prefix up,
    then ask for slots for ``num_tokens`` more tokens."""
    op = ["allocate", req_id, num_tokens]
    if opts:
        op.append(opts)
    return [["lookup", req_id], op]


def decode(req_id: str, steps: int = 1, **opts) -> list[list]:
    """``steps`` decode steps: sample one token, then make room for it."""
    op = ["allocate", req_id, 1]
    if opts:
        op.append(opts)
    return [x for _ in range(steps) for x in (["append", req_id, 1], list(op))]


def _cfg(num_blocks: int, max_model_len: int = 64, enable_caching: bool = True) -> dict:
    return dict(
        block_size=4,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        enable_caching=enable_caching,
    )


SHARED = _prompt(7, 8)  # two full blocks of 4

# a's prompt followed by the 6 tokens a samples in "decode_and_lookahead".
A_OUTPUT = _prompt(1, 6) + [sampled_token("a", i) for i in range(6)]

PREFIX_SHARING_REQUESTS = [
    ["a", SHARED + _prompt(1, 5)],  # 13 tokens, 4 blocks
    ["b", SHARED + _prompt(2, 3)],  # 11 tokens: hits a's 2 shared blocks
    ["c", list(SHARED)],  # exactly 2 full blocks: only 1 may hit
    ["d", SHARED + [9]],  # 2 full blocks + 1 token: both may hit
]
PREFIX_SHARING_OPS = [
    *admit("a", 13),
    *admit("b", 3),
    *decode("a", 3),
    *admit("c", 4),
    ["free", "a"],
    ["free", "b"],
    *admit("d", 1),
    ["free", "c"],
    ["free", "d"],
]

KV_SCENARIOS: list[KVWorkload] = [
    KVWorkload(
        # Never-used blocks go first; freed blocks join the back tail-first;
        # reusing a cached block evicts it, and the chain breaks there: a2
        # (a's prompt again) hits only a's first block, which touch() pulls
        # out of the queue before the new blocks are popped.
        "lru_reuse_and_eviction",
        _cfg(12),
        [
            ["a", _prompt(1, 10)],
            ["b", _prompt(2, 6)],
            ["c", _prompt(3, 24)],
            ["d", _prompt(4, 8)],
            ["a2", _prompt(1, 10)],
        ],
        [
            *admit("a", 10),
            *admit("b", 6),
            ["free", "a"],
            *admit("c", 24),
            *admit("d", 8),
            ["free", "b"],
            *admit("a2", 6),
            ["free", "c"],
            ["free", "d"],
            ["free", "a2"],
        ],
    ),
    KVWorkload(
        # Hits on blocks a running request holds (ref counts > 1), on free
        # cached blocks (touch pulls them out of the middle of the queue),
        # and the rule that the last prompt token is never a hit.
        "prefix_sharing",
        _cfg(16),
        PREFIX_SHARING_REQUESTS,
        PREFIX_SHARING_OPS,
    ),
    KVWorkload(
        # The same ops with prefix caching off: no hits, nothing cached.
        "caching_off",
        _cfg(16, enable_caching=False),
        PREFIX_SHARING_REQUESTS,
        PREFIX_SHARING_OPS,
    ),
    KVWorkload(
        # a and b look up before either is allocated, so both compute the
        # same prefix: two blocks per hash. Lookups return the oldest; when
        # a's copy of the second block is evicted, c hits a's first block
        # and b's second.
        "duplicate_hashes",
        _cfg(9),
        [["a", _prompt(1, 9)], ["b", _prompt(1, 9)], ["c", _prompt(1, 9)], ["e", _prompt(5, 16)]],
        [
            ["lookup", "a"],
            ["lookup", "b"],
            ["allocate", "a", 9],
            ["allocate", "b", 9],
            ["lookup", "c"],
            ["free", "a"],
            *admit("e", 16),
            *admit("c", 1),
            ["free", "b"],
            ["free", "c"],
            ["free", "e"],
        ],
    ),
    KVWorkload(
        # 12 cached tokens (3 full blocks): the same 12 tokens hit 2 blocks,
        # 13 tokens hit all 3, and a prompt shorter than a block has no hash.
        "last_token_is_recomputed",
        _cfg(16),
        [["a", _prompt(1, 12)], ["b", _prompt(1, 12)], ["c", _prompt(1, 13)], ["d", _prompt(1, 3)]],
        [
            *admit("a", 12),
            *admit("b", 4),
            *admit("c", 1),
            *admit("d", 3),
            ["free", "a"],
            ["free", "b"],
            ["free", "c"],
            ["free", "d"],
        ],
    ),
    KVWorkload(
        # 5 usable blocks. b's whole prompt does not fit (None, nothing
        # changes) but a chunk does; a cannot grow until b is preempted;
        # b comes back and hits what is left of its own freed blocks.
        "out_of_blocks_and_preemption",
        _cfg(6, max_model_len=32),
        [["a", _prompt(1, 12)], ["b", _prompt(2, 12)]],
        [
            *admit("a", 12),
            *admit("b", 12),
            *admit("b", 8),
            *decode("a"),
            ["preempt", "b"],
            ["allocate", "a", 1],
            *decode("a", 3),
            *admit("b", 8),
            ["free", "a"],
            *admit("b", 8),
            ["free", "b"],
        ],
    ),
    KVWorkload(
        # full_sequence_must_fit: a chunk would fit, the whole prompt does
        # not. Hits held by a running request cost nothing; once a is freed
        # the same hits sit in the free queue and cost a free block each.
        "full_sequence_must_fit",
        _cfg(8),
        [["a", _prompt(1, 16)], ["b", _prompt(2, 20)], ["c", _prompt(1, 12) + _prompt(3, 8)]],
        [
            *admit("a", 16),
            *admit("b", 8, must_fit=True),
            *admit("b", 8),
            *admit("c", 8, must_fit=True),
            ["free", "a"],
            *admit("c", 8, must_fit=True),
            ["free", "b"],
            ["free", "c"],
        ],
    ),
    KVWorkload(
        # Hits that no one holds are taken out of the free queue, so they
        # count against free capacity: 1 new + 4 hits > 4 free blocks.
        "hits_cost_free_capacity",
        _cfg(7),
        [["a", _prompt(1, 16)], ["b", _prompt(2, 8)], ["c", _prompt(1, 16) + _prompt(3, 4)]],
        [
            *admit("a", 16),
            ["free", "a"],
            *admit("b", 8),
            *admit("c", 4),
            ["free", "b"],
            *admit("c", 4),
            ["free", "c"],
        ],
    ),
    KVWorkload(
        # Decode: a block is cached once its last token is computed;
        # lookahead slots get blocks but are never cached, and stop at
        # max_model_len. Sampled tokens are cached like prompt tokens.
        "decode_and_lookahead",
        _cfg(12, max_model_len=20),
        [["a", _prompt(1, 6)], ["b", A_OUTPUT + [5]]],
        [
            *admit("a", 6),
            *decode("a", 2),
            *decode("a", 1, lookahead=3),
            *decode("a", 3),
            *admit("b", 1),
            *decode("a", 4),
            *decode("a", 1, lookahead=4),
            ["free", "b"],
            ["free", "a"],
        ],
    ),
    KVWorkload(
        # Chunked prefill caches blocks as they fill, so b hits a's first two
        # blocks while a is mid-prefill; b then caches its own copy of the
        # third block before a does, and c's lookup finds b's copy first.
        "chunked_prefill",
        _cfg(16),
        [["a", _prompt(1, 22)], ["b", _prompt(1, 16) + [1, 2]], ["c", _prompt(1, 16) + [3, 4]]],
        [
            *admit("a", 5),
            ["allocate", "a", 5],
            *admit("b", 10),
            ["allocate", "a", 12],
            *admit("c", 2),
            ["free", "a"],
            ["free", "b"],
            ["free", "c"],
        ],
    ),
    KVWorkload(
        # reset_prefix_cache is refused while any block is held, then
        # forgets every hash: the same prompt no longer hits.
        "reset_prefix_cache",
        _cfg(8),
        [["a", _prompt(1, 9)], ["b", _prompt(2, 5)], ["c", _prompt(1, 9)]],
        [
            *admit("a", 9),
            ["free", "a"],
            *admit("b", 5),
            ["reset_prefix_cache"],
            ["free", "b"],
            ["reset_prefix_cache"],
            *admit("c", 9),
            ["free", "c"],
        ],
    ),
]


def get_kv_scenario(name: str) -> KVWorkload:
    for workload in KV_SCENARIOS:
        if workload.name == name:
            return workload
    raise KeyError(f"no KV scenario named {name!r}; known: {[w.name for w in KV_SCENARIOS]}")
