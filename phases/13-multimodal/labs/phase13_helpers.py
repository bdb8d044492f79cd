"""Helpers for Phase 13's graded suites: multimodal workloads run through your
scheduler (or the reference's with your encoder cache) and upstream's in
lockstep, and a message that names the step, the request and the field.

A workload's requests carry fake images (mini_vllm/oracle/workload.py
``RequestSpec.mm_items``: offset, placeholder length, identifier, optional
``is_embed`` mask): the scheduler and the encoder cache read only where an
image sits, how many embeddings it has and its hash, never pixels.

(Imported by name from the suites: this folder is on sys.path because pytest
puts the folder of ``conftest.py`` there.)
"""

from __future__ import annotations

from collections import Counter

import mini_vllm.testing as mini
from mini_vllm.grading.checks import written
from mini_vllm.oracle.strategies import IMAGE_TOKEN
from mini_vllm.oracle.workload import RequestSpec, Workload, lockstep_difference, run_workload

# A small multimodal scheduler: images of up to 8 embeddings.
SMALL = dict(
    block_size=4,
    num_blocks=64,
    max_num_batched_tokens=64,
    max_model_len=64,
    max_num_seqs=4,
    mm_max_tokens_per_item=8,
)


def text(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def image(n: int) -> list[int]:
    return [IMAGE_TOKEN] * n


def workload(name: str, requests: list[RequestSpec], **config) -> Workload:
    return Workload(name=name, config={**SMALL, **config}, requests=requests)


def describe(w: Workload) -> str:
    """The workload in words, for a failure message."""
    reqs = "; ".join(
        f"{s.req_id}: {len(s.prompt_token_ids)} prompt tokens, arrives at step "
        f"{s.arrive_step}, images (offset, placeholders, identifier, is_embed) "
        f"{s.mm_items}"
        for s in w.requests
    )
    return f"config {w.config}\nrequests: {reqs}"


def lockstep(up, w: Workload, scheduler, who: str = "your Scheduler") -> dict:
    """Run ``w`` through upstream's scheduler and through ``scheduler``; fail
    with the first step, request and field that differ. Returns upstream's trace."""
    expected = run_workload(up, w)
    got = written(run_workload, mini, w, scheduler=scheduler)
    diff = lockstep_difference(expected, got)
    assert diff is None, (
        f"{who} and upstream's differ on workload {w.name!r}:\n{diff}\n{describe(w)}"
    )
    return expected


def encoder_events(w: Workload, trace: dict) -> Counter:
    """What an upstream trace did with images: encoded, two or more in one
    request's step, a chunk ending right before an image it did not encode,
    a cache hit (an image a request needed but did not encode, another
    request having encoded it), evictions."""
    specs = {s.req_id: s for s in w.requests}
    seen = Counter()
    computed: dict[str, int] = {}
    encoded_ids: set[str] = set()
    for step in trace["steps"]:
        encoded = {r: ids for r, ids in step.get("encoder_inputs", [])}
        for req_id, _, num_computed in step["new"]:
            computed[req_id] = num_computed
        for req_id, _, num_computed, _ in step["cached"]:
            computed[req_id] = num_computed
        for ids in encoded.values():
            seen["images encoded"] += len(ids)
            seen["several images in one request's step"] += len(ids) > 1
        for req_id, n in step["scheduled"]:
            items = specs[req_id].mm_items or []
            start, end = computed.get(req_id, 0), computed.get(req_id, 0) + n
            for i, (offset, _, ident, _) in enumerate(items):
                if i in encoded.get(req_id, []):
                    encoded_ids.add(ident)
                elif start <= offset < end and ident in encoded_ids:
                    seen["images taken from the cache"] += 1
                if offset == end and end < len(specs[req_id].prompt_token_ids):
                    seen["chunks ending right before an image"] += 1
            computed[req_id] = end
        seen["evictions"] += len(step.get("freed_mm_hashes", []))
    return seen
