"""Live lockstep with multimodal requests: mini_vllm's scheduler and the pinned upstream's.

Hypothesis draws workloads from ``mm_workloads`` (mini_vllm/oracle/
strategies.py): fake image features (no data; identifier, placeholder range,
sometimes an ``is_embed`` mask), several images per request, images shared
across requests, tight encoder budgets and caches, chunked prefill and
prefix caching on or off, sometimes ``disable_chunked_mm_input``. Upstream's
scheduler is built for a text stand-in model, so its encoder budgets are set
from its own ``compute_mm_encoder_budget`` (mini_vllm/oracle/upstream.py).
Both schedulers get the same requests and fake-model tokens; every step's
SchedulerOutput (the images sent to the encoder, ``scheduled_encoder_inputs``,
and the evicted ones, ``free_encoder_mm_hashes``, included), the encoder
cache's bookkeeping, the outputs, free blocks and final states must be equal.

MINI_VLLM_MM_LOCKSTEP_EXAMPLES sets the number of generated cases.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

import mini_vllm.testing as mini
from mini_vllm.oracle.strategies import IMAGE_TOKEN, mm_workloads
from mini_vllm.oracle.workload import RequestSpec, Workload, first_difference, run_workload
from mini_vllm.tiers import examples

pytestmark = pytest.mark.upstream

MM_EXAMPLES = examples(400, 40, "MINI_VLLM_MM_LOCKSTEP_EXAMPLES")
KEY = "mm lockstep"


@pytest.fixture(scope="module")
def upstream():
    from mini_vllm.oracle import upstream as up

    return up


def _events(workload: Workload, trace: dict) -> dict[str, int]:
    """What happened in an upstream trace that the multimodal lockstep must cover."""
    specs = {s.req_id: s for s in workload.requests}
    budget = workload.config["max_num_batched_tokens"]
    threshold = workload.config["long_prefill_token_threshold"]
    computed: dict[str, int] = {}
    events = dict.fromkeys(
        (
            "examples",
            "images encoded",
            "several images in one request's step",
            "images shared by two requests at once",
            "evictions",
            "chunks stopped before an image",
            "prefix hits over an image",
        ),
        0,
    )
    events["examples"] = 1
    for step in trace["steps"]:
        encoded = {r: ids for r, ids in step.get("encoder_inputs", [])}
        events["images encoded"] += sum(len(ids) for ids in encoded.values())
        events["several images in one request's step"] += any(
            len(ids) > 1 for ids in encoded.values()
        )
        events["images shared by two requests at once"] += any(
            len(ids) > 1 for _, ids in step["encoder_cache"][2]
        )
        events["evictions"] += len(step.get("freed_mm_hashes", []))
        for req_id, _, num_computed in step["new"]:
            items = specs[req_id].mm_items or []
            events["prefix hits over an image"] += any(o < num_computed for o, *_ in items)
            computed[req_id] = num_computed
        for req_id, _, num_computed, _ in step["cached"]:
            computed[req_id] = num_computed
        total = sum(n for _, n in step["scheduled"])
        for req_id, n in step["scheduled"]:
            spec = specs[req_id]
            end = computed.get(req_id, 0) + n
            # Cut at an image's first placeholder, with token budget to spare
            # and not by the long-prefill threshold.
            if end < len(spec.prompt_token_ids) and total < budget and n != threshold:
                events["chunks stopped before an image"] += any(
                    o == end and i not in encoded.get(req_id, [])
                    for i, (o, *_) in enumerate(spec.mm_items or [])
                )
            computed[req_id] = end
    return events


@pytest.mark.xdist_group("mm-lockstep")
@settings(
    max_examples=MM_EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workload=mm_workloads())
def test_mm_lockstep_with_upstream(upstream, counts, workload):
    expected = run_workload(upstream, workload)
    got = run_workload(mini, workload)
    for name, n in _events(workload, expected).items():
        counts[f"{KEY} {name}"] = counts.get(f"{KEY} {name}", 0) + n
    diff = first_difference(expected, got)
    assert diff is None, f"{diff}\nconfig: {workload.config}"


@pytest.mark.xdist_group("mm-lockstep")
def test_mm_workloads_reach_the_encoder_events(counts):
    """The generated workloads must encode several images in one step, share
    an image between requests, evict from the encoder cache, stop a chunk
    before an image it cannot afford and hit the prefix cache over an image.
    Runs after the test above."""
    if counts.get(f"{KEY} examples", 0) < 20:
        pytest.skip("too few multimodal lockstep examples ran to judge coverage")
    missing = [k for k, v in counts.items() if k.startswith(KEY) and v == 0]
    assert not missing, counts


def _same_tokens_two_images() -> Workload:
    """Two requests with identical prompts (text, 8 placeholders, text) but
    different images, then a third with the first one's image."""
    prompt = [1, 2, 3, 4] + [IMAGE_TOKEN] * 8 + [5, 6, 7, 8]
    return Workload(
        name="mm-same-tokens",
        config={
            "block_size": 4,
            "num_blocks": 64,
            "max_num_batched_tokens": 64,
            "max_model_len": 64,
            "mm_max_tokens_per_item": 8,
        },
        requests=[
            RequestSpec("a", prompt, max_tokens=2, mm_items=[[4, 8, "cat", None]]),
            RequestSpec("b", prompt, max_tokens=2, arrive_step=2, mm_items=[[4, 8, "dog", None]]),
            RequestSpec("c", prompt, max_tokens=2, arrive_step=4, mm_items=[[4, 8, "cat", None]]),
        ],
    )


@pytest.mark.xdist_group("mm-lockstep")
def test_same_placeholders_different_image_never_share_kv(upstream):
    """b's prompt equals a's token for token, but its image differs: only the
    block before the image is a hit. c has a's image: it hits every full
    block but the last (whose token must be computed), and needs no encoder
    run. mini_vllm does the same, step for step."""
    workload = _same_tokens_two_images()
    expected = run_workload(upstream, workload)
    hits = {r: c for step in expected["steps"] for r, _, c in step["new"]}
    assert hits == {"a": 0, "b": 4, "c": 12}, hits
    encoded = [ids for step in expected["steps"] for ids in step.get("encoder_inputs", [])]
    assert encoded == [["a", [0]], ["b", [0]]], encoded
    got = run_workload(mini, workload)
    diff = first_difference(expected, got)
    assert diff is None, diff
