"""Live lockstep with multimodal requests under async scheduling.

The async scheduler (Phase 14) with the workloads of test_mm_lockstep.py
(``mm_workloads``: several images per request, shared images, tight encoder
budgets and caches): mini_vllm's ``AsyncScheduler`` and the pinned upstream's,
driven by ``run_workload_async`` (a batch queue of two, outputs delivered a
step late), must agree on every step, the images sent to the encoder and
evicted from its cache and the cache's bookkeeping included.

MINI_VLLM_ASYNC_MM_LOCKSTEP_EXAMPLES sets the number of generated cases.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

import mini_vllm.testing as mini
from mini_vllm.oracle.async_workload import run_workload_async
from mini_vllm.oracle.strategies import mm_workloads
from mini_vllm.oracle.workload import first_difference
from mini_vllm.tiers import examples

pytestmark = pytest.mark.upstream

ASYNC_MM_EXAMPLES = examples(200, 20, "MINI_VLLM_ASYNC_MM_LOCKSTEP_EXAMPLES")
KEY = "async mm lockstep"


@pytest.fixture(scope="module")
def upstream():
    from mini_vllm.oracle import upstream as up

    return up


@pytest.mark.xdist_group("async-mm-lockstep")
@settings(
    max_examples=ASYNC_MM_EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workload=mm_workloads())
def test_async_mm_lockstep_with_upstream(upstream, counts, workload):
    expected = run_workload_async(upstream, workload)
    got = run_workload_async(mini, workload)
    steps = expected["steps"]
    counts[f"{KEY} examples"] = counts.get(f"{KEY} examples", 0) + 1
    for name, n in (
        ("images encoded", sum(len(ids) for s in steps for _, ids in s.get("encoder_inputs", []))),
        ("evictions", sum(len(s.get("freed_mm_hashes", [])) for s in steps)),
        ("steps with a batch in flight", sum("delivered" not in s for s in steps)),
    ):
        counts[f"{KEY} {name}"] = counts.get(f"{KEY} {name}", 0) + n
    diff = first_difference(expected, got)
    assert diff is None, f"{diff}\nconfig: {workload.config}"


@pytest.mark.xdist_group("async-mm-lockstep")
def test_async_mm_workloads_reach_the_encoder_events(counts):
    """The async multimodal workloads must encode images, evict from the
    encoder cache and schedule while a batch is in flight. Runs after the
    test above."""
    if counts.get(f"{KEY} examples", 0) < 20:
        pytest.skip("too few async multimodal lockstep examples ran to judge coverage")
    missing = [k for k, v in counts.items() if k.startswith(KEY) and v == 0]
    assert not missing, counts
