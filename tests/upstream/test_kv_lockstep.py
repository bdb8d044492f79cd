"""Live KV lockstep: mini_vllm's KVCacheManager and the pinned upstream's,
operation for operation.

Hypothesis generates pools (block size, tight to roomy, caching on or off)
and operation sequences the way a scheduler issues them: prefix lookups,
allocate_slots for prefill chunks and decode tokens (some with lookahead
slots or the full-sequence gate), finishing, preemption and prefix-cache
resets, on requests that share prefixes. After every operation the two
managers must return the same blocks and hold the same state: free queue
order, reference counts, cached blocks, block tables, cached-block counts
and prefix-cache stats; at the end every request's block hashes must be
byte-equal. A failure names the first operation and field that differ.

MINI_VLLM_KV_LOCKSTEP_EXAMPLES sets the number of generated cases (default 1000).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

import mini_vllm.testing as mini
from mini_vllm.oracle.kv_strategies import kv_workloads
from mini_vllm.oracle.kv_workload import first_kv_difference, run_kv_workload
from mini_vllm.tiers import examples

pytestmark = pytest.mark.upstream

EXAMPLES = examples(1000, 200, "MINI_VLLM_KV_LOCKSTEP_EXAMPLES")


@pytest.fixture(scope="module")
def upstream():
    from mini_vllm.oracle import upstream as up

    return up


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workload=kv_workloads())
def test_kv_lockstep_with_upstream(upstream, counts, workload):
    expected = run_kv_workload(upstream, workload)
    got = run_kv_workload(mini, workload)
    counts["kv lockstep examples"] = counts.get("kv lockstep examples", 0) + 1
    counts["kv lockstep operations"] = counts.get("kv lockstep operations", 0) + len(workload.ops)
    failed = sum(r["op"][0] == "allocate" and r["result"] is None for r in expected["ops"])
    hits = sum(r["op"][0] == "lookup" and r["result"][1] > 0 for r in expected["ops"])
    counts["kv lockstep failed allocations"] = (
        counts.get("kv lockstep failed allocations", 0) + failed
    )
    counts["kv lockstep lookups with hits"] = counts.get("kv lockstep lookups with hits", 0) + hits
    diff = first_kv_difference(expected, got)
    assert diff is None, f"{diff}\nconfig: {workload.config}\nops: {workload.ops}"


def test_generated_kv_workloads_reach_failures_and_hits(counts):
    """The generator must run pools dry and hit the prefix cache, or the
    lockstep proves little. Runs after the lockstep test in this module."""
    if counts.get("kv lockstep examples", 0) < 50:
        pytest.skip("too few KV lockstep examples ran to judge coverage")
    assert counts["kv lockstep failed allocations"] > 0, counts
    assert counts["kv lockstep lookups with hits"] > 0, counts


def _has_null(table: list) -> bool:
    """Whether a block table (or one of a request's tables per group) holds
    the null block, block 0: a window slid past the blocks it replaced."""
    if table and isinstance(table[0], list):
        return any(_has_null(t) for t in table)
    return 0 in table


HYBRID_EXAMPLES = examples(600, 120, "MINI_VLLM_KV_HYBRID_LOCKSTEP_EXAMPLES")


@settings(
    max_examples=HYBRID_EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workload=kv_workloads(hybrid=True))
def test_hybrid_kv_lockstep_with_upstream(upstream, counts, workload):
    """KV-cache groups (full attention and sliding windows: one window, full +
    one window, two windows, full + two windows), caching on and off, through
    upstream's coordinators and mini_vllm's: every group's block table, the
    blocks each call returns per group, the shared free queue, reference
    counts, cached blocks and hits equal after every operation."""
    expected = run_kv_workload(upstream, workload)
    got = run_kv_workload(mini, workload)
    key = "kv hybrid lockstep"
    counts[f"{key} examples"] = counts.get(f"{key} examples", 0) + 1
    failed = sum(r["op"][0] == "allocate" and r["result"] is None for r in expected["ops"])
    hits = sum(r["op"][0] == "lookup" and r["result"][1] > 0 for r in expected["ops"])
    nulls = sum(_has_null(t) for r in expected["ops"] for t in r["tables"].values())
    for name, n in [("failed allocations", failed), ("hits", hits), ("nulls", nulls)]:
        counts[f"{key} {name}"] = counts.get(f"{key} {name}", 0) + n
    diff = first_kv_difference(expected, got)
    assert diff is None, f"{diff}\nconfig: {workload.config}\nops: {workload.ops}"


def test_generated_hybrid_workloads_reach_failures_hits_and_windows(counts):
    """The hybrid generator must run pools dry, hit the prefix cache and slide
    blocks out of windows (nulls in a window group's table), or the lockstep
    proves little. Runs after the hybrid lockstep test in this module."""
    key = "kv hybrid lockstep"
    if counts.get(f"{key} examples", 0) < 50:
        pytest.skip("too few hybrid KV lockstep examples ran to judge coverage")
    for name in ("failed allocations", "hits", "nulls"):
        assert counts[f"{key} {name}"] > 0, counts
