"""Live lockstep with LoRA requests: mini_vllm's scheduler and the pinned upstream's.

Hypothesis draws workloads from ``lora_workloads`` (mini_vllm/oracle/
strategies.py): ``max_loras`` 1-3 adapters a step, up to two more adapters
than slots, requests on the base model mixed in, with prefix caching and
chunked prefill on or off as the base workloads draw them. Both schedulers
get the same requests (with their LoRARequests) and the same fake-model
tokens; every step's SchedulerOutput (which requests the adapter limit held
back shows in what is scheduled; the adapters new requests carry), the
update_from_output results, free blocks and final states must be equal.
Block hashes carry the adapter's name (upstream's extra keys), so a shared
prefix hits only within one adapter, and the block ids show it.

MINI_VLLM_LORA_LOCKSTEP_EXAMPLES sets the number of generated cases.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

import mini_vllm.testing as mini
from mini_vllm.oracle.strategies import lora_workloads
from mini_vllm.oracle.workload import RequestSpec, Workload, first_difference, run_workload
from mini_vllm.tiers import examples

pytestmark = pytest.mark.upstream

LORA_EXAMPLES = examples(400, 40, "MINI_VLLM_LORA_LOCKSTEP_EXAMPLES")


@pytest.fixture(scope="module")
def upstream():
    from mini_vllm.oracle import upstream as up

    return up


@pytest.mark.xdist_group("lora-lockstep")
@settings(
    max_examples=LORA_EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workload=lora_workloads())
def test_lora_lockstep_with_upstream(upstream, workload):
    expected = run_workload(upstream, workload)
    got = run_workload(mini, workload)
    diff = first_difference(expected, got)
    assert diff is None, f"{diff}\nconfig: {workload.config}"


def _two_adapters_one_slot() -> Workload:
    """Three requests arrive together: adapter 1, adapter 2, adapter 1 again.
    With one slot, the second waits until adapter 1's requests are done."""
    prompt = list(range(1, 33))
    return Workload(
        name="lora-one-slot",
        config={"max_loras": 1, "block_size": 4, "num_blocks": 100, "max_model_len": 64},
        requests=[
            RequestSpec("a1", prompt, max_tokens=3, lora_id=1),
            RequestSpec("b", prompt, max_tokens=3, lora_id=2),
            RequestSpec("a2", prompt, max_tokens=3, lora_id=1),
            RequestSpec("base", prompt, max_tokens=3),
        ],
    )


@pytest.mark.xdist_group("lora-lockstep")
def test_max_loras_holds_back_a_second_adapter(upstream):
    """Upstream itself holds adapter 2's request back while adapter 1 runs,
    and mini_vllm does the same, step for step. Same prompt everywhere: only
    requests of one adapter share cached blocks (a1 -> a2), never across
    adapters or with the base model."""
    workload = _two_adapters_one_slot()
    expected = run_workload(upstream, workload)
    first = expected["steps"][0]
    assert [r for r, _ in first["scheduled"]] == ["a1", "a2", "base"], first["scheduled"]
    hits = {r: c for step in expected["steps"] for r, _, c in step["new"]}
    # a2 reuses a1's blocks but the last (its last token must be computed).
    assert hits == {"a1": 0, "a2": 32 - 4, "base": 0, "b": 0}, hits
    got = run_workload(mini, workload)
    diff = first_difference(expected, got)
    assert diff is None, diff
