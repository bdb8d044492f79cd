"""Helpers shared by Phase 07's graded suites: generated hybrid workloads,
pools with a chosen prefix cache on both sides, and the engine with your
Phase 07 pieces plugged in.

(Imported by name from the suites: this folder is on sys.path because pytest
puts the folder of ``conftest.py`` there.)
"""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import strategies as st

from mini_vllm.grading.checks import written  # noqa: F401 (the lab tests import it from here)
from mini_vllm.grading.hybrid_checks import Backend, upstream_mismatch, your_keys  # noqa: F401
from mini_vllm.oracle.kv_strategies import kv_workloads

# Lab 07.4's prompts: a shared prefix (5 blocks of 4 tokens, then 1), a short
# prompt and a long one; every prompt plus its output passes the window (8).
SHARED = [(5 * j + 3) % 509 + 3 for j in range(21)]
PROMPTS = [SHARED + [11, 12], SHARED + [13], [(7 * j) % 500 + 3 for j in range(5)]]
PROMPTS.append([(3 * j) % 500 + 3 for j in range(30)])
MAX_TOKENS = 16


def several_kinds(workload) -> bool:
    """Prefix caching on, and at least two kinds of groups (the hybrid coordinator)."""
    groups = workload.config["groups"]
    return workload.config["enable_caching"] and len(set(groups)) > 1


hybrid_workloads = kv_workloads(hybrid=True)
hybrid_hit_workloads = kv_workloads(hybrid=True).filter(several_kinds)


@st.composite
def cached_pools(draw, kinds: str = "window"):
    """A prefix cache to search: groups (``None``: full attention, an int: a
    window), a block size, one hash per block, for each group the blocks it
    holds in its cache (True) or misses (False), and the hit's length limit."""
    block_size = draw(st.sampled_from([1, 2, 4]))
    window = st.integers(1, 5 * block_size + 1)
    if kinds == "window":
        # One or two groups of one window (searched together), and a full-attention
        # group beside them (so that the pool is a hybrid one, as on a real model).
        groups = [draw(window)] * draw(st.integers(1, 2)) + [None]
    else:
        w1 = draw(window)
        shape = draw(st.sampled_from(["full+window", "full+window", "two windows", "all"]))
        if shape == "full+window":
            groups = draw(st.permutations([None, w1]))
        else:
            w2 = draw(window.filter(lambda w: w != w1))
            groups = [w1, w2] if shape == "two windows" else [None, w1, w2]
    num_blocks = draw(st.integers(1, 12))
    shared = draw(st.lists(st.booleans(), min_size=num_blocks, max_size=num_blocks))
    cached = []
    for _ in groups:
        # Mostly what the other groups hold, with some differences.
        flips = draw(st.sets(st.integers(0, num_blocks - 1), max_size=3))
        cached.append([c != (i in flips) for i, c in enumerate(shared)])
    max_length = draw(st.integers(0, num_blocks * block_size))
    return SimpleNamespace(
        groups=groups, block_size=block_size, cached=cached, max_length=max_length
    )


def hashes(n: int) -> list[bytes]:
    return [bytes([i + 1]) * 32 for i in range(n)]


def fill_cache(manager, case, upstream: bool) -> None:
    """Cache, in each group in turn, one fresh block under block i's hash for
    every i the group holds; the same calls on both sides give the same ids."""
    pool = manager.block_pool
    request = SimpleNamespace(block_hashes=hashes(len(case.cached[0])), request_id="stub")
    for group_id, held in enumerate(case.cached):
        blocks = pool.get_new_blocks(len(held))
        for i, is_cached in enumerate(held):
            if not is_cached:
                continue
            if upstream:
                pool.cache_full_blocks(
                    request,
                    blocks,
                    i,
                    i + 1,
                    block_size=case.block_size,
                    kv_cache_group_id=group_id,
                )
            else:
                pool.cache_full_blocks(request, blocks, i, i + 1, kv_cache_group_id=group_id)


def managers(impl, up, case):
    """(upstream's KV-cache manager, yours), each over a pool with ``case``'s cache."""
    config = dict(
        block_size=case.block_size,
        num_blocks=len(case.groups) * len(case.cached[0]) + 1,
        max_model_len=256,
        enable_caching=True,
        groups=case.groups,
    )
    theirs = up.create_kv_cache_manager(**config)
    yours = Backend(impl).create_kv_cache_manager(**config)
    fill_cache(theirs, case, upstream=True)
    fill_cache(yours, case, upstream=False)
    return theirs, yours


def ids(blocks_per_group) -> list[list[int]]:
    return [[b.block_id for b in group] for group in blocks_per_group]


def describe(case) -> str:
    kinds = ["full attention" if g is None else f"window {g}" for g in case.groups]
    rows = [
        f"    group {i} ({k}): " + "".join("X" if c else "." for c in held)
        for i, (k, held) in enumerate(zip(kinds, case.cached, strict=True))
    ]
    return (
        f"block size {case.block_size}, max_length {case.max_length}; which blocks each "
        "group holds in its prefix cache (X: cached under that block's hash, .: a miss):\n"
        + "\n".join(rows)
    )


def plug_into_engine(impl, monkeypatch) -> None:
    """Make the engine run your Phase 07 pieces: the worker groups the layers
    with your ``_get_kv_cache_groups_uniform_page_size``; the KV-cache manager
    builds your coordinator and managers; the block pool keys its prefix cache
    with your ``make_block_hash_with_group_id``."""
    from mini_vllm.core import block_pool, kv_cache_manager, kv_cache_utils
    from mini_vllm.grading.hybrid_checks import your_coordinator

    monkeypatch.setattr(
        kv_cache_utils,
        "_get_kv_cache_groups_uniform_page_size",
        impl.kv_cache_utils._get_kv_cache_groups_uniform_page_size,
    )
    monkeypatch.setattr(
        kv_cache_manager,
        "get_kv_cache_coordinator",
        lambda *args: your_coordinator(impl, *args),
    )
    monkeypatch.setattr(
        block_pool,
        "make_block_hash_with_group_id",
        impl.kv_cache_utils.make_block_hash_with_group_id,
    )
