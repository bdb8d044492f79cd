"""Who waits: TTFT, TPOT and queue time per priority class under FCFS, PRIORITY and aging.

``python -m mini_vllm.benchmarks.fairness [--requests N] [--skip-real] [--out DIR]``

1. Fake model, step clock (time = engine steps; every step costs the same,
   which a real model's steps do not). One seeded arrival trace (seed 0):
   ``--requests`` requests (default 3000) arriving as a Poisson process of
   0.8 a step (queues form, then drain); priority 0 (20%), 1 (30%) or 2
   (50%), lower is better; prompts uniform in 32-256 tokens, except 5% "long"
   ones uniform in 2048-3500; outputs uniform in 16-128 (EOS never comes).
   Scheduler: block size 16, 2048 KV blocks, max_num_seqs 64, budget 1024,
   max_model_len 4096, prefix caching on. The same trace runs under FCFS,
   PRIORITY, PRIORITY with aging (``AgingScheduler``, bounds 32 and 8), FCFS
   with ``long_prefill_token_threshold`` 512, FCFS with a 4096 budget with
   chunked prefill on and off (off needs budget >= max_model_len), and FCFS,
   PRIORITY and aging 32 with 1024 KV blocks (memory pressure: preemptions).
   Reported per class: TTFT p50, p90, p99, TPOT p50 and p99, queue time p99
   and max; per case, the short prompts' (<= 256 tokens) TTFT p99, steps and
   preemptions.
2. SmolLM2-135M on this CPU (fp32, real seconds, ``--threads``, default 1):
   24 requests, 3 classes in turn, two arriving before each engine step;
   prompts of 16-48 seeded random token ids, two of them 384 tokens; outputs
   8-16 tokens, greedy, EOS ignored; max_num_seqs 4, budget 256. FCFS,
   PRIORITY and aging (bound 8 steps), one run each (the model loaded for each).

Prints markdown tables; writes ``OUT/fairness.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import mini_vllm.testing as mini
from mini_vllm.core.sched.aging import AgingScheduler
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.metrics.fairness import TimedScheduler, class_percentiles, percentile
from mini_vllm.oracle.workload import RequestSpec, Workload, run_workload

DEFAULT_OUT = Path(__file__).parent / "results"
FAKE_CONFIG = dict(
    block_size=16,
    num_blocks=2048,
    max_num_seqs=64,
    max_num_batched_tokens=1024,
    max_model_len=4096,
    enable_prefix_caching=True,
)
SHORT_PROMPT = 256  # prompts up to this long are "short" in the head-of-line column


def timed(cls: type = Scheduler, max_wait_steps: int | None = None, clock="steps") -> type:
    """``cls`` with per-request timestamps on ``clock`` (and a stated aging bound)."""
    attrs = {"clock": clock}
    if max_wait_steps is not None:
        attrs["max_wait_steps"] = max_wait_steps
    return type(f"Timed{cls.__name__}", (TimedScheduler, cls), attrs)


def arrival_trace(n: int, seed: int = 0, rate: float = 0.8) -> list[RequestSpec]:
    rng = random.Random(seed)
    t, specs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        long = rng.random() < 0.05
        length = rng.randint(2048, 3500) if long else rng.randint(32, 256)
        specs.append(
            RequestSpec(
                req_id=f"req-{i}",
                prompt_token_ids=[rng.randint(1, 999) for _ in range(length)],
                max_tokens=rng.randint(16, 128),
                arrive_step=int(t),
                priority=rng.choices([0, 1, 2], weights=[2, 3, 5])[0],
                ignore_eos=True,
            )
        )
    return specs


FAKE_CASES = {
    "FCFS": (TimedScheduler, {"policy": "fcfs"}),
    "PRIORITY": (TimedScheduler, {"policy": "priority"}),
    "PRIORITY + aging 32": (timed(AgingScheduler, 32), {"policy": "priority"}),
    "PRIORITY + aging 8": (timed(AgingScheduler, 8), {"policy": "priority"}),
    "FCFS, threshold 512": (
        TimedScheduler,
        {"policy": "fcfs", "long_prefill_token_threshold": 512},
    ),
    # Without chunked prefill upstream demands a budget of max_model_len at least.
    "FCFS, no chunked prefill, budget 4096": (
        TimedScheduler,
        {"policy": "fcfs", "enable_chunked_prefill": False, "max_num_batched_tokens": 4096},
    ),
    "FCFS, budget 4096": (TimedScheduler, {"policy": "fcfs", "max_num_batched_tokens": 4096}),
    # Memory pressure: half the KV blocks, so preemption (and its victim choice) matters.
    "FCFS, 1024 blocks": (TimedScheduler, {"policy": "fcfs", "num_blocks": 1024}),
    "PRIORITY, 1024 blocks": (TimedScheduler, {"policy": "priority", "num_blocks": 1024}),
    "PRIORITY + aging 32, 1024 blocks": (
        timed(AgingScheduler, 32),
        {"policy": "priority", "num_blocks": 1024},
    ),
}


def run_fake(specs: list[RequestSpec], cls: type, extra: dict) -> dict:
    config = {**FAKE_CONFIG, **extra}
    sched = mini.create_scheduler(scheduler_cls=cls, **config)
    start = time.perf_counter()
    trace = run_workload(
        mini, Workload("fairness", config, specs, max_steps=10**6), scheduler=sched
    )
    seconds = time.perf_counter() - start
    return summarize(sched.finished_stats, specs) | {
        "steps": len(trace["steps"]),
        "preemptions": sum(len(s["preempted"]) for s in trace["steps"]),
        "seconds": round(seconds, 2),
    }


def summarize(finished, specs) -> dict:
    prompt = {s.req_id: len(s.prompt_token_ids) for s in specs}
    short = [f.first_token_latency for f in finished if prompt[f.request_id] <= SHORT_PROMPT]
    by_class = class_percentiles(finished)
    for priority, row in by_class.items():
        queue = [f.queued_time for f in finished if f.priority == priority]
        row["queue"]["max"] = max(queue)
    return {
        "classes": {str(p): row for p, row in by_class.items()},
        "short_prompt_ttft_p99": percentile(short, 99),
    }


def fake_tables(results: dict, unit: str) -> str:
    lines = [
        "| case | class | TTFT p50 | p90 | p99 | TPOT p50 | p99 | queue p99 | queue max |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for case, r in results.items():
        for p, row in r["classes"].items():
            t, d, q = row["ttft"], row["tpot"], row["queue"]
            lines.append(
                f"| {case} | {p} | {t[50]:.1f} | {t[90]:.1f} | {t[99]:.1f} | {d[50]:.2f} | "
                f"{d[99]:.2f} | {q[99]:.1f} | {q['max']:.1f} |"
            )
    lines += [
        "",
        f"| case | short-prompt TTFT p99 ({unit}) | steps | preemptions |",
        "| --- | ---: | ---: | ---: |",
    ]
    for case, r in results.items():
        lines.append(
            f"| {case} | {r['short_prompt_ttft_p99']:.1f} | {r['steps']} | {r['preemptions']} |"
        )
    return "\n".join(lines)


REAL_CASES = {
    "FCFS": (timed(clock="seconds"), "fcfs"),
    "PRIORITY": (timed(clock="seconds"), "priority"),
    "PRIORITY + aging 8": (timed(AgingScheduler, 8, clock="seconds"), "priority"),
}


def real_trace(seed: int = 0) -> list[RequestSpec]:
    rng = random.Random(seed)
    specs = []
    for i in range(24):
        length = 384 if i in (4, 13) else rng.randint(16, 48)
        specs.append(
            RequestSpec(
                req_id=f"req-{i}",
                prompt_token_ids=[rng.randint(100, 40000) for _ in range(length)],
                max_tokens=rng.randint(8, 16),
                arrive_step=i // 2,
                priority=i % 3,
                ignore_eos=True,
            )
        )
    return specs


def run_real(specs: list[RequestSpec], cls: type, policy: str) -> dict:
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.model_executor.model_loader import smollm2_gguf_path
    from mini_vllm.sampling_params import SamplingParams

    llm = LLM(
        str(smollm2_gguf_path()),
        max_model_len=1024,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        scheduler_cls=cls,
        policy=policy,
        dtype="float32",
        device="cpu",
    )
    engine = llm.llm_engine
    start, step = time.perf_counter(), 0
    pending = sorted(specs, key=lambda s: s.arrive_step)
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrive_step <= step:
            spec = pending.pop(0)
            params = SamplingParams(max_tokens=spec.max_tokens, temperature=0, ignore_eos=True)
            engine.add_request(
                spec.req_id,
                {"prompt_token_ids": spec.prompt_token_ids},
                params,
                priority=spec.priority,
            )
        engine.step()
        step += 1
    seconds = time.perf_counter() - start
    sched = engine.engine_core.scheduler
    return summarize(sched.finished_stats, specs) | {
        "steps": step,
        "preemptions": sum(f.num_preemptions for f in sched.finished_stats),
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    print(f"threads {args.threads}; load average before: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    specs = arrival_trace(args.requests)
    fake = {case: run_fake(specs, cls, extra) for case, (cls, extra) in FAKE_CASES.items()}
    print(f"\nFake model, {args.requests} requests, step clock (times in steps)\n")
    print(fake_tables(fake, "steps"))
    report = {"threads": args.threads, "loadavg_before": load, "fake": fake}
    if not args.skip_real:
        rspecs = real_trace()
        real = {case: run_real(rspecs, cls, policy) for case, (cls, policy) in REAL_CASES.items()}
        print("\nSmolLM2-135M on this CPU, 24 requests (times in seconds)\n")
        print(fake_tables(real, "s"))
        print("wall seconds: " + ", ".join(f"{c} {r['seconds']}" for c, r in real.items()))
        report["real"] = real
    report["loadavg_after"] = os.getloadavg()
    print(f"load average after: {report['loadavg_after'][0]:.1f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fairness.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
