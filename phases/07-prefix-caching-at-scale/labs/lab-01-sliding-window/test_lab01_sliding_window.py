"""Lab 07.1 — the sliding-window manager: what is skipped, what is freed, the hit.

Graded: the three ``LAB 07.1`` regions of
``labs/phase_07/single_type_kv_cache_manager.py``:
``SlidingWindowManager.get_num_skipped_tokens`` (the tokens before the next
token's window), ``SingleTypeKVCacheManager.remove_skipped_blocks`` (free
the blocks that slid out, the null block in their place) and
``SlidingWindowManager.find_longest_cache_hit`` (the hit, searched from the
right). The other Phase 07 regions hold the reference's code.

Every check runs the pinned upstream beside your code on a CPU
(``vllm.v1.core.single_type_kv_cache_manager.SlidingWindowManager``,
reached through upstream's own ``KVCacheManager``): first each method on
its own, then whole generated workloads in lockstep (full attention and
windows of several sizes, prefix caching on and off, pools run dry), every
group's block table, the free queue and the hits compared after every
operation.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from phase07_helpers import (
    Backend,
    cached_pools,
    describe,
    hashes,
    hybrid_workloads,
    ids,
    managers,
    upstream_mismatch,
    written,
    your_keys,
)

from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.kv_workload import walk_free_queue

pytestmark = [pytest.mark.upstream, pytest.mark.timeout(300)]

PROPERTY = lab_settings(200)
LOCKSTEP = lab_settings(300)


def window_managers(impl, up, window: int, block_size: int, num_blocks: int = 64):
    """(upstream's window-group manager, yours): group 0 of a window group
    beside a full-attention group, over pools of ``num_blocks`` blocks."""
    config = dict(
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=1024,
        enable_caching=True,
        groups=[window, None],
    )
    theirs = up.create_kv_cache_manager(**config).coordinator.single_type_managers[0]
    yours = Backend(impl).create_kv_cache_manager(**config).coordinator.single_type_managers[0]
    return theirs, yours


@pytest.mark.points(3)
def test_skipped_tokens_equal_upstreams(impl, up):
    for window in range(1, 18):
        theirs, yours = window_managers(impl, up, window, block_size=4)
        for computed in range(0, 41):
            want = theirs.get_num_skipped_tokens(computed)
            got = written(yours.get_num_skipped_tokens, computed)
            assert got == want, (
                f"window {window}, {computed} tokens computed: get_num_skipped_tokens gives "
                f"{got}, upstream {want}. The next token is token number {computed}; it "
                f"attends to itself and the {window - 1} tokens before it, so every token "
                "before those is skipped (and never fewer than 0)."
            )


@st.composite
def sliding_requests(draw):
    """(window, block size, tokens allocated, computed-token counts, rising)."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    window = draw(st.integers(1, 4 * block_size + 3))
    num_tokens = draw(st.integers(1, 12 * block_size))
    counts = draw(st.lists(st.integers(0, num_tokens + 2 * block_size), min_size=1, max_size=8))
    return window, block_size, num_tokens, sorted(counts)


@pytest.mark.points(4)
@PROPERTY
@given(case=sliding_requests())
def test_remove_skipped_blocks_equals_upstreams(impl, up, case):
    window, block_size, num_tokens, counts = case
    theirs, yours = window_managers(impl, up, window, block_size)
    for manager in (theirs, yours):
        manager.req_to_blocks["r"] = []
    theirs.allocate_new_blocks("r", num_tokens, num_tokens)
    yours.allocate_new_blocks("r", num_tokens)
    for step, computed in enumerate(counts):
        theirs.remove_skipped_blocks("r", computed)
        written(yours.remove_skipped_blocks, "r", computed)
        want = [b.block_id for b in theirs.req_to_blocks["r"]]
        got = [b.block_id for b in yours.req_to_blocks["r"]]
        where = (
            f"window {window}, block size {block_size}, a request holding blocks for "
            f"{num_tokens} tokens; remove_skipped_blocks called with total_computed_tokens "
            f"{counts[: step + 1]} (this is call {step + 1})"
        )
        assert got == want, (
            f"{where}: the block table is {got}, upstream's {want} (0 is the null block). "
            "Every whole block before the next token's window is freed and replaced by the "
            "null block; the walk goes back from the last skipped block and stops at the "
            "first null (the calls before freed the rest); a window can reach past the "
            "blocks the request holds."
        )
        want_queue = walk_free_queue(theirs.block_pool.free_block_queue, 200)
        got_queue = walk_free_queue(yours.block_pool.free_block_queue, 200)
        assert got_queue == want_queue, (
            f"{where}: the free queue (front first) is {got_queue}, upstream's {want_queue}. "
            "The skipped blocks go back to the pool in one free_blocks call, last skipped "
            "block first (the order of the backward walk)."
        )


@pytest.mark.points(5)
@PROPERTY
@given(case=cached_pools("window"))
def test_hit_search_equals_upstreams(impl, up, case):
    with your_keys(impl):
        theirs, yours = managers(impl, up, case)
        group_ids = [i for i, g in enumerate(case.groups) if g is not None]
        their_manager = theirs.coordinator.single_type_managers[0]
        your_manager = yours.coordinator.single_type_managers[0]
        want = type(their_manager).find_longest_cache_hit(
            hashes(len(case.cached[0])),
            case.max_length,
            group_ids,
            theirs.block_pool,
            their_manager.kv_cache_spec,
            use_eagle=False,
            alignment_tokens=case.block_size,
        )
        got = written(
            type(your_manager).find_longest_cache_hit,
            hashes(len(case.cached[0])),
            case.max_length,
            group_ids,
            yours.block_pool,
            your_manager.kv_cache_spec,
        )
    assert ids(got) == ids(want), (
        f"find_longest_cache_hit for window group(s) {group_ids}, {describe(case)}\n"
        f"  upstream: {ids(want)}\n  yours:    {ids(got)}\n"
        "A window hit needs a run of cdiv(window - 1, block_size) cached blocks (in every "
        "group searched) just before its end; search from the right and stop at the first "
        "such run; the blocks before it are null blocks (0) and nothing after it is kept. "
        "With no run that long, the blocks cached from block 0 onwards are the hit."
    )


@pytest.mark.points(8)
@LOCKSTEP
@given(workload=hybrid_workloads)
def test_window_groups_in_lockstep_with_upstream(impl, up, workload):
    message = upstream_mismatch(impl, up, workload)
    assert message is None, message
