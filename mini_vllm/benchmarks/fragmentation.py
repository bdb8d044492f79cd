"""Paged KV blocks against contiguous ``max_model_len`` reservations, measured.

``python -m mini_vllm.benchmarks.fragmentation``. Before paging, a serving
system reserved one contiguous KV region of ``max_model_len`` slots for
each request at admission, because it could not know how long the request
would grow. Paging hands out ``block_size`` slots at a time, as tokens
arrive. This module measures both on one workload with mini_vllm's own
scheduler and KV cache manager and a fake model.

The contiguous allocator needs no separate implementation: it *is* the
paged one with ``block_size = max_model_len``. Each request then takes one
block at admission, big enough for any length it may reach, and keeps it
until it finishes, which is exactly a per-request reservation.

The workload: 48 requests, prompts of 32-512 tokens and 32-256 output
tokens (uniform, seeded, ``ignore_eos``), all arriving at once;
``max_model_len`` 1024; a KV budget of 16,384 token slots (16 contiguous
reservations); 2,048 tokens a step; prefix caching off, so every request
stores its own KV. Reported per allocator: steps to finish the workload,
the peak and mean number of running requests, and how much of the
allocated KV holds tokens (the rest is fragmentation: slots reserved but
never written, or not yet).
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass, field

import mini_vllm.testing as mini
from mini_vllm.kv_cache_interface import cdiv

NUM_REQUESTS = 48
MAX_MODEL_LEN = 1024
KV_SLOTS = 16 * 1024
BUDGET = 2048


def make_workload(seed: int = 0, n: int = NUM_REQUESTS) -> list[tuple[int, int]]:
    """(prompt length, output length) of each request."""
    rng = random.Random(seed)
    return [(rng.randint(32, 512), rng.randint(32, 256)) for _ in range(n)]


@dataclass
class Result:
    allocator: str
    block_size: int
    steps: int
    peak_running: int
    mean_running: float
    # Over all steps: tokens stored in the KV cache / slots allocated to requests.
    kv_utilisation: float
    # The same at the peak of allocation, when memory is the bottleneck.
    utilisation_at_peak: float
    # Per step: (running requests, tokens stored, slots allocated to them).
    history: list[tuple[int, int, int]] = field(default_factory=list, repr=False)


def run(
    workload: list[tuple[int, int]],
    block_size: int,
    allocator: str,
    kv_slots: int = KV_SLOTS,
    max_model_len: int = MAX_MODEL_LEN,
) -> Result:
    """Run the workload to the end with KV blocks of ``block_size`` slots."""
    sched = mini.create_scheduler(
        block_size=block_size,
        num_blocks=kv_slots // block_size + 1,  # + the null block
        max_num_batched_tokens=BUDGET,
        max_num_seqs=256,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
    )
    for i, (prompt_len, output_len) in enumerate(workload):
        (request,) = mini.create_requests(
            1,
            req_ids=[f"r{i}"],
            prompt_token_ids=[[1 + (i + j) % 500 for j in range(prompt_len)]],
            max_tokens=output_len,
            ignore_eos=True,
            block_size=block_size,
        )
        sched.add_request(request)
    manager = sched.kv_cache_manager
    steps = running_sum = stored_sum = allocated_sum = peak = 0
    peak_allocated, peak_stored = 0, 0
    history = []
    while sched.has_requests():
        out = sched.schedule()
        sched.update_from_output(out, mini.make_model_runner_output(sched, out, lambda r: 7))
        running = [r for r in sched.running]
        stored = sum(r.num_computed_tokens for r in running)
        allocated = (
            sum(len(manager.req_to_blocks.get(r.request_id, ())) for r in running) * block_size
        )
        history.append((len(running), stored, allocated))
        steps += 1
        running_sum += len(running)
        stored_sum += stored
        allocated_sum += allocated
        peak = max(peak, len(running))
        if allocated > peak_allocated:
            peak_allocated, peak_stored = allocated, stored
    return Result(
        allocator=allocator,
        block_size=block_size,
        steps=steps,
        peak_running=peak,
        mean_running=running_sum / steps,
        kv_utilisation=stored_sum / allocated_sum,
        utilisation_at_peak=peak_stored / peak_allocated,
        history=history,
    )


def static_waste(
    workload: list[tuple[int, int]], block_size: int = 16, max_model_len: int = MAX_MODEL_LEN
) -> dict:
    """Slots each scheme sets aside for the finished requests, and the share wasted."""
    tokens = sum(p + o for p, o in workload)
    paged = sum(cdiv(p + o, block_size) * block_size for p, o in workload)
    contiguous = len(workload) * max_model_len
    return {
        "tokens": tokens,
        "paged_slots": paged,
        "contiguous_slots": contiguous,
        "paged_waste": 1 - tokens / paged,
        "contiguous_waste": 1 - tokens / contiguous,
    }


def compare(seed: int = 0) -> list[Result]:
    workload = make_workload(seed)
    return [
        run(workload, 16, "paged (block 16)"),
        run(workload, MAX_MODEL_LEN, "contiguous (max_model_len)"),
    ]


def table(results: list[Result]) -> str:
    lines = [
        f"{'allocator':<28}{'steps':>6}{'peak run':>9}{'mean run':>9}{'KV used':>9}{'at peak':>9}"
    ]
    for r in results:
        lines.append(
            f"{r.allocator:<28}{r.steps:>6}{r.peak_running:>9}{r.mean_running:>9.1f}"
            f"{r.kv_utilisation:>9.0%}{r.utilisation_at_peak:>9.0%}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mini_vllm.benchmarks.fragmentation", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(table(compare(args.seed)))
    w = static_waste(make_workload(args.seed))
    print(
        f"finished requests: {w['tokens']} tokens; paged sets aside {w['paged_slots']} slots "
        f"({w['paged_waste']:.1%} wasted), contiguous {w['contiguous_slots']} "
        f"({w['contiguous_waste']:.1%} wasted)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
