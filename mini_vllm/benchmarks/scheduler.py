"""Time the whole scheduling loop of mini_vllm against the pinned upstream.

``python -m mini_vllm.benchmarks.scheduler`` (``make bench``). The workload
has nano-vllm's shape: 256 requests, prompt and output lengths uniform in
100-1024 tokens (outputs forced with ignore_eos), block size 16, prefix
caching on, a budget of 8192 tokens. It runs once with ample KV blocks and
once under memory pressure (a quarter of the blocks the whole workload
needs, so preemption is frequent). Timed: schedule() + the fake model's
output + update_from_output(), until every request has finished; building
the requests is not timed. Runs alternate between the two schedulers and
the medians are reported, with mini_vllm's time as a ratio of upstream's.
``--clock process`` times the loop in CPU seconds of this process
(``time.process_time``) instead of wall-clock seconds: on a machine other
jobs share, the wall clock also counts the time the loop waited for a core.
``--out FILE`` also writes the run (conditions, every time, medians,
ratios) as JSON; the committed one is ``results/scheduler_cpu.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mini_vllm.testing as mini
from mini_vllm.kv_cache_interface import cdiv

NUM_REQUESTS = 256
BLOCK_SIZE = 16
BUDGET = 8192
MAX_MODEL_LEN = 2048


def make_workload(seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randint(0, 30000) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024))
        for _ in range(NUM_REQUESTS)
    ]


def run_once(backend, workload, num_blocks: int, clock=time.perf_counter) -> tuple[float, int, int]:
    """Seconds for the loop (by ``clock``), number of steps, number of preemptions."""
    sched = backend.create_scheduler(
        max_num_seqs=NUM_REQUESTS,
        max_num_batched_tokens=BUDGET,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=True,
    )
    requests = []
    for i, (prompt, max_tokens) in enumerate(workload):
        requests += backend.create_requests(
            1,
            prompt_token_ids=[prompt],
            max_tokens=max_tokens,
            ignore_eos=True,
            block_size=BLOCK_SIZE,
            req_ids=[str(i)],
            arrival_times=[float(i)],
        )
    output_cls = backend.ModelRunnerOutput
    next_token = lambda r: 1000 + r.num_output_tokens % 20000  # noqa: E731
    steps = 0
    start = clock()
    for request in requests:
        sched.add_request(request)
    while sched.has_requests():
        out = sched.schedule()
        sched.update_from_output(
            out, mini.make_model_runner_output(sched, out, next_token, output_cls)
        )
        steps += 1
    elapsed = clock() - start
    return elapsed, steps, sum(r.num_preemptions for r in requests)


def git_commit() -> str | None:
    """The checkout's commit, for the results file (None outside a git checkout)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return None
    return done.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm.benchmarks.scheduler")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--clock",
        choices=("wall", "process"),
        default="wall",
        help="wall-clock seconds (default), or this process's CPU seconds",
    )
    parser.add_argument("--out", type=Path, help="also write the run as JSON to this file")
    args = parser.parse_args(argv)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    from mini_vllm.oracle import upstream

    workload = make_workload()
    need = sum(cdiv(len(p) + n, BLOCK_SIZE) for p, n in workload) + 1
    cases = {"ample blocks": need, "memory pressure": need // 4}
    print(
        f"{NUM_REQUESTS} requests, prompts/outputs uniform in 100-1024, block {BLOCK_SIZE}, "
        f"budget {BUDGET}, prefix caching on, {args.repeats} runs each (medians, "
        f"{args.clock} clock)"
    )
    print(
        f"{'case':<16} {'blocks':>7} {'steps':>6} {'preempt':>8} {'upstream s':>11} "
        f"{'mini_vllm s':>12} {'ratio':>6}"
    )
    report = {
        "command": "python -m mini_vllm.benchmarks.scheduler " + " ".join(argv or sys.argv[1:]),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "commit": git_commit(),
        "clock": args.clock,
        "repeats": args.repeats,
        "loadavg_before": os.getloadavg(),
        "cases": {},
    }
    for case, num_blocks in cases.items():
        times = {"upstream": [], "mini": []}
        info = {}
        for r in range(args.repeats):
            order = [("upstream", upstream), ("mini", mini)]
            for name, backend in order if r % 2 == 0 else order[::-1]:
                elapsed, steps, preemptions = run_once(backend, workload, num_blocks, clock)
                times[name].append(elapsed)
                info[name] = (steps, preemptions)
        if info["upstream"] != info["mini"]:
            print(f"  warning: steps/preemptions differ: {info}", file=sys.stderr)
        up, mv = statistics.median(times["upstream"]), statistics.median(times["mini"])
        steps, pre = info["mini"]
        print(
            f"{case:<16} {num_blocks:>7} {steps:>6} {pre:>8} {up:>11.3f} {mv:>12.3f} "
            f"{mv / up:>5.2f}x"
        )
        report["cases"][case] = {
            "num_blocks": num_blocks,
            "steps": steps,
            "preemptions": pre,
            "upstream_s": times["upstream"],
            "mini_vllm_s": times["mini"],
            "upstream_median_s": up,
            "mini_vllm_median_s": mv,
            "ratio": mv / up,
        }
    report["loadavg_after"] = os.getloadavg()
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
