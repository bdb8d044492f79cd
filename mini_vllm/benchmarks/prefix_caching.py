"""KV blocks a request holds with and without a sliding window, the concurrency
that buys at a fixed memory, and the prefix-cache hit rate against cache size.

``python -m mini_vllm.benchmarks.prefix_caching [--requests N] [--out DIR]``

Everything runs the reference scheduler (``mini_vllm/core/sched/scheduler.py``)
with a fake model (each request's next token is a fixed function of its id and
output index), on the step clock: the numbers are counts of blocks, requests
and tokens, exact and machine-independent. The tests compare this scheduler's
blocks with upstream's, group by group, step by step
(tests/upstream/test_lockstep.py, ``hybrid_workloads``).

The model: six attention layers, five with a 1024-token window and one full
(the 5:1 pattern upstream's grouping comment names), block size 16, each layer
8 KV heads of 128 values in bfloat16, so a block of one layer (a page) is
64 KiB. Two ways to cache it, built by ``get_kv_cache_groups`` and
``get_kv_cache_config_from_groups`` from the same per-layer specs:

- *window*: the hybrid KV-cache manager, six groups of one layer (five
  ``SlidingWindowSpec`` groups, one ``FullAttentionSpec``): a block id is one
  page, and a window group frees the blocks that slide out;
- *no window*: ``disable_hybrid_kv_cache_manager``, one group of six layers,
  all managed as full attention: a block id is six pages, kept to the end.

1. One request alone (prompt of 2048, 8192 or 32768 seeded random tokens, 128
   output tokens, budget 2048): pages held at the end of each step, their peak
   and at the end, per group.
2. A fixed memory of 65536 pages (4 GiB): 512 requests of 4096 prompt tokens
   and 256 output tokens, all at step 0, max_num_seqs 512, max_model_len 8192,
   budget 2048 (upstream's default) and 8192 (a window group's admission cap
   grows with the budget). Reported: the most requests
   running at once, their mean, steps to finish all, preemptions.
3. Prefix-cache hit rate against cache size: ``--requests`` requests (default
   3000), all at step 0 in a seeded random order, each a system prompt (one of
   16, 1000 tokens each, the k-th chosen with weight 1/(k+1)) followed by a
   user part of 32-512 tokens and 16-128 output tokens; max_num_seqs 64, budget
   2048. The hit rate is prefix-cache hits over queries, in tokens, of
   first-time lookups (``PrefixCacheStats``; preempted requests' re-lookups are
   counted apart, as upstream). Swept over cache sizes, for both caches at the
   same memory (pages). The ideal, with a cache that never evicts, is
   computed from the workload alone: every request after the first of its
   system prompt hits the prompt's whole blocks.

Prints markdown tables; writes ``OUT/prefix_caching.json`` with the
conditions (threads, load average, wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
import zlib
from pathlib import Path

import torch

import mini_vllm.testing as mini
from mini_vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from mini_vllm.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
)
from mini_vllm.request import Request

DEFAULT_OUT = Path(__file__).parent / "results"
BLOCK_SIZE = 16
WINDOW = 1024
NUM_LAYERS = 6  # layers 0-4 windowed, layer 5 full: 5:1
PAGE = dict(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
PAGE_BYTES = FullAttentionSpec(**PAGE).page_size_bytes  # 64 KiB


def layer_specs() -> dict[str, AttentionSpec]:
    """The model's layers as the worker describes them (name -> spec)."""
    return {
        f"model.layers.{i}.self_attn.attn": FullAttentionSpec(**PAGE)
        if i % NUM_LAYERS == NUM_LAYERS - 1
        else SlidingWindowSpec(sliding_window=WINDOW, **PAGE)
        for i in range(NUM_LAYERS)
    }


def kv_cache_config(window: bool, num_pages: int) -> KVCacheConfig:
    """The KV cache ``num_pages`` pages of memory hold, with the hybrid
    manager (``window``) or with it disabled."""
    groups = get_kv_cache_groups(layer_specs(), disable_hybrid_kv_cache_manager=not window)
    return get_kv_cache_config_from_groups(groups, num_pages * PAGE_BYTES)


def pages_per_block(config: KVCacheConfig) -> int:
    """Pages one block id costs: one per layer of the largest group."""
    return max(len(g.layer_names) for g in config.kv_cache_groups)


def make_scheduler(config: KVCacheConfig, log_stats: bool = False, **sched) -> Scheduler:
    vllm_config = VllmConfig(
        model_config=ModelConfig(max_model_len=sched.pop("max_model_len")),
        cache_config=CacheConfig(
            block_size=BLOCK_SIZE, enable_prefix_caching=True, num_gpu_blocks=config.num_blocks
        ),
        scheduler_config=SchedulerConfig(**sched),
    )
    return Scheduler(vllm_config, log_stats=log_stats, kv_cache_config=config)


def make_request(req_id: str, prompt: list[int], max_tokens: int) -> Request:
    (request,) = mini.create_requests(
        1,
        max_tokens=max_tokens,
        ignore_eos=True,
        block_size=BLOCK_SIZE,
        req_ids=[req_id],
        prompt_token_ids=[prompt],
    )
    return request


def fake_token(request: Request) -> int:
    return 1000 + zlib.crc32(f"{request.request_id}:{request.num_output_tokens}".encode()) % 29000


def step(sched: Scheduler) -> None:
    out = sched.schedule()
    sched.update_from_output(out, mini.make_model_runner_output(sched, out, fake_token))


def held_blocks(sched: Scheduler, request_id: str) -> list[int]:
    """Blocks (not the null block) the request holds, per group."""
    manager = sched.kv_cache_manager
    tables = manager.get_blocks(request_id).blocks
    return [sum(1 for b in table if not b.is_null) for table in tables]


# --------------------------------------------------------- 1. one request


def one_request(prompt_len: int, window: bool, seed: int = 0) -> dict:
    rng = random.Random(seed)
    config = kv_cache_config(window, num_pages=NUM_LAYERS * 4096)
    sched = make_scheduler(
        config, max_num_seqs=1, max_num_batched_tokens=2048, max_model_len=prompt_len + 128
    )
    prompt = [rng.randrange(1000, 30000) for _ in range(prompt_len)]
    sched.add_request(make_request("r", prompt, 128))
    per_step = []
    while sched.has_requests():
        step(sched)
        if "r" in sched.requests:
            per_step.append(held_blocks(sched, "r"))
    ppb = pages_per_block(config)
    totals = [sum(groups) * ppb for groups in per_step]
    return dict(
        prompt_len=prompt_len,
        window=window,
        num_groups=len(config.kv_cache_groups),
        pages_per_block=ppb,
        steps=len(per_step),
        peak_pages=max(totals),
        final_pages=totals[-1],
        final_blocks_per_group=per_step[-1],
        peak_blocks_per_group=[max(s[g] for s in per_step) for g in range(len(per_step[0]))],
    )


# ---------------------------------------------- 2. concurrency at fixed memory


def fixed_memory(
    window: bool, budget: int = 2048, num_pages: int = 65536, num_requests: int = 512
) -> dict:
    rng = random.Random(1)
    config = kv_cache_config(window, num_pages)
    sched = make_scheduler(
        config, max_num_seqs=512, max_num_batched_tokens=budget, max_model_len=8192
    )
    requests = [
        make_request(f"r{i}", [rng.randrange(1000, 30000) for _ in range(4096)], 256)
        for i in range(num_requests)
    ]
    for request in requests:
        sched.add_request(request)
    running, steps = [], 0
    t0 = time.perf_counter()
    while sched.has_requests():
        step(sched)
        running.append(len(sched.running))
        steps += 1
    return dict(
        window=window,
        budget=budget,
        num_blocks=config.num_blocks,
        pages_per_block=pages_per_block(config),
        max_running=max(running),
        mean_running=round(statistics.fmean(running), 1),
        steps=steps,
        preemptions=sum(r.num_preemptions for r in requests),
        wall_s=round(time.perf_counter() - t0, 2),
    )


# ------------------------------------------------------- 3. prefix-cache hits


def shared_prompt_workload(num_requests: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) per request, in arrival order."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000, 30000) for _ in range(1000)] for _ in range(16)]
    weights = [1 / (k + 1) for k in range(len(systems))]
    work = []
    for _ in range(num_requests):
        (system,) = rng.choices(range(len(systems)), weights)
        user = [rng.randrange(1000, 30000) for _ in range(rng.randint(32, 512))]
        work.append((systems[system] + user, rng.randint(16, 128), system))
    return work


def ideal_hit_rate(work) -> float:
    """Hits over queries with a cache that never evicts: every request after
    the first of its system prompt hits that prompt's whole blocks."""
    seen, hits, queries = set(), 0, 0
    for prompt, _, system in work:
        queries += len(prompt)
        if system in seen:
            hits += 1000 // BLOCK_SIZE * BLOCK_SIZE
        seen.add(system)
    return hits / queries


def prefix_stats(result) -> tuple[int, int]:
    """(queries, hits) of first-time lookups in one step's outputs."""
    outputs = list(result.values()) if isinstance(result, dict) else [result]
    for eco in outputs:
        if eco.scheduler_stats is not None:
            stats = eco.scheduler_stats.prefix_cache_stats
            return stats.queries, stats.hits
    return 0, 0


def hit_rate(work, window: bool, num_pages: int, upstream: bool = False) -> dict:
    """Run the workload through mini_vllm's scheduler (or, with ``upstream``,
    the pinned upstream's, on the same one-layer-per-group config)."""
    config = kv_cache_config(window, num_pages)
    sched_args = dict(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048)
    if upstream:
        from mini_vllm.oracle import upstream as backend

        groups = [g.kv_cache_spec.sliding_window for g in config.kv_cache_groups]
        sched = backend.create_scheduler(
            num_blocks=config.num_blocks,
            block_size=BLOCK_SIZE,
            kv_groups=groups if window else None,
            **sched_args,
        )
    else:
        backend = mini
        sched = make_scheduler(config, log_stats=True, **sched_args)
    requests = [
        backend.create_requests(
            1,
            max_tokens=n,
            ignore_eos=True,
            block_size=BLOCK_SIZE,
            req_ids=[f"r{i}"],
            prompt_token_ids=[prompt],
        )[0]
        for i, (prompt, n, _) in enumerate(work)
    ]
    for request in requests:
        sched.add_request(request)
    steps = queries = hits = prompt_tokens = hit_tokens = 0
    t0 = time.perf_counter()
    while sched.has_requests():
        out = sched.schedule()
        for new in out.scheduled_new_reqs:  # first admissions (resumed ones come back as cached)
            prompt_tokens += len(new.prompt_token_ids)
            hit_tokens += new.num_computed_tokens
        runner = mini.make_model_runner_output(sched, out, fake_token, backend.ModelRunnerOutput)
        q, h = prefix_stats(sched.update_from_output(out, runner))
        queries, hits, steps = queries + q, hits + h, steps + 1
    return dict(
        window=window,
        num_pages=num_pages,
        num_blocks=config.num_blocks,
        hit_rate=round(hit_tokens / prompt_tokens, 4),
        hit_tokens=hit_tokens,
        prompt_tokens=prompt_tokens,
        lookup_hit_rate=round(hits / queries, 4),
        lookup_hits=hits,
        lookup_queries=queries,
        steps=steps,
        preemptions=sum(r.num_preemptions for r in requests),
        wall_s=round(time.perf_counter() - t0, 2),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument(
        "--pages", type=int, nargs="+", default=[1536, 3072, 6144, 12288, 24576, 49152, 98304]
    )
    parser.add_argument(
        "--no-upstream", action="store_true", help="skip the check against upstream's scheduler"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    result: dict = dict(
        command="python -m mini_vllm.benchmarks.prefix_caching "
        f"--requests {args.requests} --pages {' '.join(map(str, args.pages))}",
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        threads="one Python thread (no model: the scheduler and a fake model)",
        layers=f"{NUM_LAYERS} ({NUM_LAYERS - 1} window {WINDOW}, 1 full)",
        page_bytes=PAGE_BYTES,
        loadavg_1m_before=load_before,
    )

    print(f"## 1. One request: pages held (a page: one layer's block, {PAGE_BYTES} bytes)\n")
    print(
        "| prompt | no window: peak = end | window: peak | window: end | end, blocks per group "
        "| end ratio |"
    )
    print("| ---: | ---: | ---: | ---: | --- | ---: |")
    result["one_request"] = []
    for prompt_len in (2048, 8192, 32768):
        full, win = one_request(prompt_len, False), one_request(prompt_len, True)
        result["one_request"] += [full, win]
        print(
            f"| {prompt_len} | {full['peak_pages']} | {win['peak_pages']} | {win['final_pages']} | "
            f"{win['final_blocks_per_group']} | {full['final_pages'] / win['final_pages']:.2f}x |"
        )

    print("\n## 2. 65536 pages (4 GiB): 512 requests of 4096 + 256 tokens\n")
    print(
        "| budget | cache | blocks | pages/block | most running | mean running | steps "
        "| preemptions |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    result["fixed_memory"] = []
    for budget, window in ((2048, False), (2048, True), (8192, False), (8192, True)):
        r = fixed_memory(window, budget)
        result["fixed_memory"].append(r)
        print(
            f"| {budget} | {'window' if window else 'no window'} | {r['num_blocks']} | "
            f"{r['pages_per_block']} | {r['max_running']} | {r['mean_running']} | "
            f"{r['steps']} | {r['preemptions']} |"
        )

    work = shared_prompt_workload(args.requests)
    ideal = ideal_hit_rate(work)
    result["ideal_hit_rate"] = round(ideal, 4)
    print(f"\n## 3. Prefix-cache hit rate, {args.requests} requests (ideal {ideal:.3f})\n")
    print("| pages | no window: blocks | hit rate | window: blocks | hit rate |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    result["hit_rate"] = []
    for pages in args.pages:
        full, win = hit_rate(work, False, pages), hit_rate(work, True, pages)
        result["hit_rate"] += [full, win]
        print(
            f"| {pages} | {full['num_blocks']} | {full['hit_rate']:.3f} | "
            f"{win['num_blocks']} | {win['hit_rate']:.3f} |"
        )

    if not args.no_upstream:
        # The same workload (its first 500 requests) through upstream's Scheduler.
        check = []
        for window in (False, True):
            ours, theirs = (hit_rate(work[:500], window, 6144, upstream=u) for u in (False, True))
            keys = ("hit_tokens", "lookup_hits", "lookup_queries", "steps", "preemptions")
            same = all(ours[k] == theirs[k] for k in keys)
            check.append(dict(window=window, mini=ours, upstream=theirs, identical=same))
            print(
                f"upstream check ({'window' if window else 'no window'}, 6144 pages, 500 "
                f"requests): hit rate {theirs['hit_rate']:.4f}, {theirs['steps']} steps; "
                f"{'identical' if same else 'DIFFERENT'} hits, lookups, steps and preemptions"
            )
        result["upstream_check"] = check

    result["loadavg_1m_after"] = os.getloadavg()[0]
    result["wall_s"] = round(time.perf_counter() - start, 1)
    print(
        f"\n{result['threads']}; load average {load_before:.1f} before, "
        f"{result['loadavg_1m_after']:.1f} after; {result['wall_s']} s"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_caching.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
