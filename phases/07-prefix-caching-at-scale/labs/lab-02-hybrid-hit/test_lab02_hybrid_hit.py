"""Lab 07.2 — the hybrid coordinator's prefix-cache hit: a fixed point across groups.

Graded: the ``LAB 07.2`` region of ``labs/phase_07/kv_cache_coordinator.py``,
``HybridKVCacheCoordinator.find_longest_cache_hit``: the longest prefix
every KV-cache group can serve. Full attention looks first (its hit is a
prefix of cached blocks); each window group then looks for a hit no longer
than the candidate, which can only shrink it; when a round shrinks it, every
kind looks again, until a round changes nothing. The sliding-window search
itself (Lab 07.1) and the other Phase 07 regions hold the reference's code.

Every check runs the pinned upstream's ``HybridKVCacheCoordinator``
(vllm/v1/core/kv_cache_coordinator.py:392) beside yours on a CPU: first the
search alone, on prefix caches where the groups hold different blocks (full
attention and one window, two windows, full attention and two windows), then
generated workloads in lockstep, the hits of every lookup and everything
the KV cache holds compared after every operation.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from phase07_helpers import (
    cached_pools,
    describe,
    hashes,
    hybrid_hit_workloads,
    ids,
    managers,
    upstream_mismatch,
    written,
    your_keys,
)

from mini_vllm.grading.checks import lab_settings

pytestmark = [pytest.mark.upstream, pytest.mark.timeout(300)]

PROPERTY = lab_settings(300)
LOCKSTEP = lab_settings(300)


@pytest.mark.points(7)
@PROPERTY
@given(case=cached_pools("hybrid"))
def test_hybrid_hit_equals_upstreams(impl, up, case):
    with your_keys(impl):
        theirs, yours = managers(impl, up, case)
        block_hashes = hashes(len(case.cached[0]))
        want_blocks, want_length = theirs.coordinator.find_longest_cache_hit(
            block_hashes, case.max_length
        )
        got_blocks, got_length = written(
            yours.coordinator.find_longest_cache_hit, block_hashes, case.max_length
        )
    assert (ids(got_blocks), got_length) == (ids(want_blocks), want_length), (
        f"find_longest_cache_hit(max_cache_hit_length={case.max_length}), {describe(case)}\n"
        f"  upstream: {want_length} tokens, blocks per group {ids(want_blocks)}\n"
        f"  yours:    {got_length} tokens, blocks per group {ids(got_blocks)}\n"
        "The hit is the longest prefix every group can serve: full attention first, then "
        "each window kind searching no further than the current candidate; when a round "
        "shrinks the candidate, search again with every kind until a round changes nothing "
        "(full attention's blocks are then cut to the final length, not looked up again)."
    )


@pytest.mark.points(8)
@LOCKSTEP
@given(workload=hybrid_hit_workloads)
def test_hybrid_hits_in_lockstep_with_upstream(impl, up, workload):
    message = upstream_mismatch(impl, up, workload)
    assert message is None, message
