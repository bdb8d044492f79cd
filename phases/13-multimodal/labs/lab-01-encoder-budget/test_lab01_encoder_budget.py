"""Lab 13.1 — the encoder budget in the scheduler.

Graded: the ``LAB 13.1`` regions of ``labs/phase_13/scheduler.py``:
``_try_schedule_encoder_inputs`` (which images a prefill chunk encodes: those
its tokens reach that are neither in the KV cache already nor in the encoder
cache; the first one the encoder budget or cache cannot take ends the chunk
right before its placeholders), the two places in ``schedule()`` that record a
scheduled request's images in ``scheduled_encoder_inputs``, reserve their
encoder-cache entries and charge the step's encoder budget, and
``_free_encoder_inputs`` (an image's reference is dropped once all its
placeholders are computed).

Every test runs your Scheduler and the pinned upstream's
(vllm/v1/core/sched/scheduler.py:64) in lockstep on the same requests with
fake images and the same fake model tokens, and demands equal steps: tokens
scheduled, images sent to the encoder, evicted hashes, the encoder cache's
bookkeeping, outputs, free blocks. First three small workloads, one rule
each (the test first checks that upstream's trace shows the rule); then
generated workloads (mini_vllm/oracle/strategies.py ``mm_workloads``: several
images per request, images shared across requests, masks, tight budgets and
caches, chunked prefill, prefix caching, ``disable_chunked_mm_input``).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from phase13_helpers import encoder_events, image, lockstep, text, workload

import mini_vllm.testing as mini
from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.strategies import mm_workloads
from mini_vllm.oracle.workload import RequestSpec

pytestmark = pytest.mark.upstream
LOCKSTEP = lab_settings(30)


def yours(impl, w):
    return mini.create_scheduler(scheduler_cls=impl.scheduler.Scheduler, **w.config)


def encoded(trace: dict, step: int) -> list:
    return trace["steps"][step].get("encoder_inputs", [])


@pytest.mark.points(5)
def test_a_chunk_stops_before_an_image_the_budget_cannot_take(impl, up):
    # a: 4 text, images A, B, C (8 embeddings each) with 2 text tokens
    # between, 4 text = 36 tokens; the token budget (64) covers them all, the
    # encoder budget (16) two images.
    prompt = text(4) + image(8) + text(2, 50) + image(8) + text(2, 55) + image(8) + text(4, 60)
    items = [[4, 8, "A", None], [14, 8, "B", None], [24, 8, "C", None]]
    w = workload(
        "budget-stops-a-chunk",
        [RequestSpec("a", prompt, max_tokens=2, mm_items=items)],
        max_num_encoder_input_tokens=16,
        encoder_cache_size=24,
    )
    expected = lockstep(up, w, yours(impl, w))
    # What upstream did, which your scheduler matched: step 0 encodes A and B
    # and stops the chunk at C's first placeholder (24); step 1 encodes C.
    assert expected["steps"][0]["scheduled"] == [["a", 24]], expected["steps"][0]
    assert encoded(expected, 0) == [["a", [0, 1]]] and encoded(expected, 1) == [["a", [2]]]


@pytest.mark.points(5)
def test_a_cached_image_costs_nothing(impl, up):
    # a encodes "cat" at step 0. b arrives at step 1 with "cat" and "dog": cat
    # is in the encoder cache (a released it, nobody evicted it), so it takes
    # none of the 8-embedding budget, and dog fits in the same step.
    a = text(4) + image(8) + text(4, 50)
    b = text(2, 70) + image(8) + text(2, 80) + image(8) + text(2, 90)
    w = workload(
        "cached-image-is-free",
        [
            RequestSpec("a", a, max_tokens=3, mm_items=[[4, 8, "cat", None]]),
            RequestSpec(
                "b",
                b,
                max_tokens=2,
                arrive_step=1,
                mm_items=[[2, 8, "cat", None], [12, 8, "dog", None]],
            ),
        ],
        max_num_encoder_input_tokens=8,
        encoder_cache_size=16,
    )
    expected = lockstep(up, w, yours(impl, w))
    assert encoded(expected, 1) == [["b", [1]]], encoded(expected, 1)
    assert ["b", len(b)] in expected["steps"][1]["scheduled"], expected["steps"][1]


@pytest.mark.points(5)
def test_images_are_released_when_consumed_and_evicted_when_space_is_needed(impl, up):
    # A cache of 8 embeddings: one image at a time, and 6 tokens a step, so
    # every prefill cuts its image in two. a's "x" is released once its last
    # placeholder is computed (not its first) but stays cached; b's "y" needs
    # the room, so "x" is evicted (reported once in free_encoder_mm_hashes); c
    # brings "x" back: encoded again.
    def req(name, ident, step):
        prompt = text(2) + image(8) + text(2, 40)
        return RequestSpec(
            name, prompt, max_tokens=2, arrive_step=step, mm_items=[[2, 8, ident, None]]
        )

    w = workload(
        "release-then-evict",
        [req("a", "x", 0), req("b", "y", 2), req("c", "x", 5)],
        max_num_batched_tokens=6,
        max_num_encoder_input_tokens=8,
        encoder_cache_size=8,
    )
    expected = lockstep(up, w, yours(impl, w))
    freed = [h for s in expected["steps"] for h in s.get("freed_mm_hashes", [])]
    assert freed == ["x", "y"], freed
    assert [r for s in expected["steps"] for r, _ in s.get("encoder_inputs", [])] == ["a", "b", "c"]


@pytest.mark.points(15)
@pytest.mark.timeout(300)
def test_lockstep_with_upstreams_scheduler_on_generated_workloads(impl, up):
    seen = Counter()

    @LOCKSTEP
    @given(w=mm_workloads())
    def run(w):
        expected = lockstep(up, w, yours(impl, w))
        seen.update(encoder_events(w, expected))

    run()
    wanted = [
        "images encoded",
        "chunks ending right before an image",
        "images taken from the cache",
        "evictions",
    ]
    missing = [k for k in wanted if not seen[k]]
    assert not missing, (
        f"the generated workloads never reached {missing} (counts {dict(seen)}): the lockstep "
        "proved too little"
    )
