"""Hypothesis strategies for scheduler configurations and workloads.

Shared by the live lockstep test against upstream (tests/upstream/) and the
Phase 03 graders, which run a student's scheduler against the reference on
the same generated workloads. Every configuration is one upstream accepts,
and every workload terminates on upstream (see ``min_tokens`` below).
"""

from __future__ import annotations

from hypothesis import strategies as st

from mini_vllm.kv_cache_interface import cdiv
from mini_vllm.oracle.kv_strategies import kv_groups
from mini_vllm.oracle.workload import RequestSpec, Workload


@st.composite
def scheduler_configs(draw) -> dict:
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.integers(8, 200))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.sampled_from([1, 2, 4, 8, 12, 16]))
    # Upstream's SchedulerConfig demands budget >= max_num_seqs, and budget >=
    # max_model_len when chunked prefill is off.
    low = max(max_num_seqs, 1 if chunked else max_model_len)
    budget = draw(st.integers(low, max(low, 320)))
    # From "exactly one max_model_len request fits" to plenty, weighted
    # toward tight caches so that preemption is common.
    min_blocks = cdiv(max_model_len, block_size) + 1
    num_blocks = draw(
        st.integers(min_blocks, min_blocks + 3)
        | st.integers(min_blocks, 2 * min_blocks)
        | st.integers(min_blocks, 6 * min_blocks)
    )
    return {
        "block_size": block_size,
        "max_model_len": max_model_len,
        "enable_chunked_prefill": chunked,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": budget,
        "num_blocks": num_blocks,
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 1, 3, 8, 32])),
        "enable_prefix_caching": draw(st.booleans()),
        "policy": draw(st.sampled_from(["fcfs", "priority"])),
        "scheduler_reserve_full_isl": draw(st.booleans()),
    }


@st.composite
def workloads(draw) -> Workload:
    config = draw(scheduler_configs())
    max_model_len = config["max_model_len"]
    prefixes = draw(
        st.lists(st.lists(st.integers(1, 999), min_size=1, max_size=48), min_size=0, max_size=3)
    )
    n = draw(st.integers(1, 4) | st.integers(4, 20))
    requests = []
    for i in range(n):
        prefix = draw(st.sampled_from(prefixes)) if prefixes and draw(st.booleans()) else []
        suffix = draw(st.lists(st.integers(1, 999), min_size=0, max_size=64))
        prompt = (prefix + suffix)[: max_model_len - 1] or [draw(st.integers(1, 999))]
        max_tokens = draw(st.integers(1, 64))
        stop = draw(st.sampled_from([[], [], [7], [7, 9]]))
        requests.append(
            RequestSpec(
                req_id=f"req-{i}",
                prompt_token_ids=prompt,
                max_tokens=max_tokens,
                arrive_step=draw(st.sampled_from([0, 0, 0, 1, 2, 5, 12])),
                priority=draw(st.integers(0, 3)),
                # min_tokens must fit: len(prompt) + min_tokens <= max_model_len
                # (upstream livelocks otherwise; see the test below).
                min_tokens=min(
                    draw(st.sampled_from([0, 0, 0, 1, 4])), max_tokens, max_model_len - len(prompt)
                ),
                ignore_eos=draw(st.booleans()),
                stop_token_ids=stop,
                eos_at=draw(st.sampled_from([None, None, None, 0, 1, 5, 20])),
                stop_at=draw(st.sampled_from([None, None, 0, 3, 15])) if stop else None,
                abort_step=draw(st.none() | st.none() | st.none() | st.integers(0, 20)),
            )
        )
    return Workload(name="generated", config=config, requests=requests)


@st.composite
def spec_workloads(draw) -> Workload:
    """A workload from ``workloads()`` run with n-gram speculation: 1-5
    speculative tokens, and per request a cycle of fake draft lengths (0 up
    to past the cap, which the driver clips) and of accepted-draft counts
    (0 up to past the drafts, clipped too)."""
    workload = draw(workloads())
    k = draw(st.integers(1, 5))
    workload.config["num_speculative_tokens"] = k
    for spec in workload.requests:
        spec.draft_lens = draw(st.lists(st.integers(0, k + 1), min_size=1, max_size=4))
        spec.accepted = draw(st.lists(st.integers(0, k + 1), min_size=1, max_size=4))
    workload.name = "generated-spec"
    return workload


@st.composite
def structured_workloads(draw) -> Workload:
    """A workload from ``workloads()`` (or ``spec_workloads()``) in which some
    requests carry a structured-output constraint whose grammar compile
    finishes 0-6 steps after they arrive (so it may finish at once, before
    the first schedule, or while other requests run)."""
    workload = draw(spec_workloads() | workloads())
    for spec in workload.requests:
        if draw(st.booleans()):
            spec.grammar_ready_step = spec.arrive_step + draw(st.sampled_from([0, 1, 2, 3, 6]))
    workload.name = workload.name + "-structured"
    return workload


@st.composite
def hybrid_workloads(draw) -> Workload:
    """A workload from ``workloads()`` on a hybrid model's KV cache: two
    groups (full attention + a sliding window) or three (full + two window
    sizes), or windows alone (``kv_groups`` of kv_strategies.py). Some
    requests start with a system prompt longer than the windows, so a hit
    skips blocks in a window group. All groups take blocks from one pool,
    sized from "the longest request fits in every group" up, weighted toward
    tight (every group takes blocks for a whole prefill chunk before its
    window frees any)."""
    workload = draw(workloads())
    config = workload.config
    bs, max_model_len = config["block_size"], config["max_model_len"]
    groups = draw(kv_groups(bs), label="kv groups")
    system = draw(
        st.lists(st.integers(1, 999), min_size=bs, max_size=6 * bs + 3), label="system prompt"
    )
    for spec in workload.requests:
        if draw(st.booleans(), label="starts with the system prompt"):
            spec.prompt_token_ids = (system + spec.prompt_token_ids)[: max_model_len - 1]
            spec.min_tokens = min(spec.min_tokens, max_model_len - len(spec.prompt_token_ids))
    longest = max(
        min(max_model_len, len(r.prompt_token_ids) + r.max_tokens) for r in workload.requests
    )
    min_blocks = len(groups) * cdiv(longest, bs) + 1
    config["kv_groups"] = groups
    config["num_blocks"] = draw(
        st.integers(min_blocks, min_blocks + 2)
        | st.integers(min_blocks, min_blocks + 2)
        | st.integers(min_blocks, 2 * min_blocks),
        label="hybrid num_blocks",
    )
    workload.name = "generated-hybrid"
    return workload


@st.composite
def lora_workloads(draw) -> Workload:
    """A workload from ``workloads()`` served with LoRA: ``max_loras`` 1-3
    adapters a step, and each request on the base model or on one of up to
    four adapters (more adapters than slots, so the limit holds requests
    back). Prefix caching and chunked prefill vary as ``workloads()`` draws
    them; shared prefixes across adapters must not hit each other's blocks."""
    workload = draw(workloads())
    max_loras = draw(st.sampled_from([1, 1, 2, 2, 3]), label="max_loras")
    num_adapters = draw(st.integers(1, max_loras + 2), label="adapters")
    workload.config["max_loras"] = max_loras
    for spec in workload.requests:
        spec.lora_id = draw(st.none() | st.integers(1, num_adapters), label="lora id")
    workload.name = "generated-lora"
    return workload


# The token every image placeholder carries: two requests with the same
# placeholder tokens differ only in their images' identifiers.
IMAGE_TOKEN = 999


@st.composite
def mm_workloads(draw) -> Workload:
    """A workload from ``workloads()`` for a multimodal model: images of at
    most ``mm_max_tokens_per_item`` embeddings, tight encoder budgets and
    caches (upstream raises both to at least one item), some placeholders
    with ``is_embed`` masks, sometimes ``disable_chunked_mm_input``. A pool
    of up to four images is shared across requests (same identifier, same
    placeholder length and mask); each request gets 0-3 of them between text
    chunks, after an optional shared start (text, then an image, so that
    prefix-cache hits cover image blocks and two requests with equal
    placeholder tokens but different images must not hit each other)."""
    workload = draw(workloads())
    config = workload.config
    max_model_len = config["max_model_len"]
    max_item = draw(
        st.integers(1, max(1, min(24, config["max_num_batched_tokens"], max_model_len - 1))),
        label="mm_max_tokens_per_item",
    )
    config["mm_max_tokens_per_item"] = max_item
    config["max_num_encoder_input_tokens"] = draw(
        st.integers(0, 3 * max_item) | st.just(max_item), label="encoder budget"
    )
    config["encoder_cache_size"] = draw(
        st.integers(0, 4 * max_item) | st.just(max_item), label="encoder cache size"
    )
    config["disable_chunked_mm_input"] = draw(
        st.sampled_from([False, False, True]), label="disable_chunked_mm_input"
    )
    pool = []
    for j in range(draw(st.integers(1, 4), label="images")):
        length = draw(st.integers(1, max_item), label="placeholder length")
        mask = None
        if draw(st.booleans(), label="masked"):
            # A mask never has more embeddings than the length, so the
            # item's embeddings stay within max_item.
            mask = draw(st.lists(st.booleans(), min_size=length, max_size=length), label="mask")
        pool.append((f"img{j}", length, mask))
    start_text = draw(st.lists(st.integers(1, 998), max_size=12), label="shared text")
    start_image = draw(st.integers(0, len(pool) - 1), label="shared image")
    for spec in workload.requests:
        prompt: list[int] = []
        items: list = []
        if draw(st.booleans(), label="shared start"):
            # The shared text, then an image (one of two, so that equal
            # placeholders with different images happen).
            ident, length, mask = pool[start_image if draw(st.booleans()) else 0]
            prompt = list(start_text)
            items.append([len(prompt), length, ident, mask])
            prompt += [IMAGE_TOKEN] * length
        for _ in range(draw(st.integers(0, 3), label="images in the request")):
            text = draw(st.lists(st.integers(1, 998), max_size=10), label="text")
            ident, length, mask = draw(st.sampled_from(pool), label="image")
            prompt += text
            items.append([len(prompt), length, ident, mask])
            prompt += [IMAGE_TOKEN] * length
        prompt += draw(st.lists(st.integers(1, 998), max_size=10), label="tail text")
        # Keep what fits (a prompt is shorter than max_model_len) and the
        # images wholly inside it.
        prompt = prompt[: max_model_len - 1] or spec.prompt_token_ids
        items = [it for it in items if it[0] + it[1] <= len(prompt)]
        spec.prompt_token_ids = prompt
        spec.min_tokens = min(spec.min_tokens, max_model_len - len(prompt))
        spec.mm_items = items or None
    workload.name = "generated-mm"
    return workload
