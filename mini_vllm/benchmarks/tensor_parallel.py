"""Tensor parallelism measured on this CPU, then modelled for a GPU node, in one run.

    python -m mini_vllm.benchmarks.tensor_parallel [--model PATH] [--tp 1 3]
        [--small-model PATH] [--small-tp 1 2] [--batch 4] [--prompt-len 64]
        [--output-len 32] [--out DIR]

A course module (Phase 17); no upstream counterpart. ``--model`` (SmolLM2
by default: 9 query heads, 3 KV heads, so it splits at TP=1 and TP=3) and
``--small-model`` (the tiny seeded Llama, written to a temporary folder by
default: 4 query heads, 2 KV heads, so TP=1 and TP=2) each run at every TP
size asked, with ``distributed_executor_backend="mp"``. Each run: one
untimed warm-up generate, then ``--batch`` requests of ``--prompt-len``
seeded random token ids, ``--output-len`` greedy tokens each (EOS ignored),
driven by ``LLMEngine.step()``. The first step prefills every prompt, the
first decode step is untimed (at TP=1 it is the step whose FLOPs are
counted), and each later step is a decode step of ``--batch`` tokens, timed
on the wall clock around ``step()``. Per run it reports:

- the median decode step time, and its ratio to the same model's TP=1;
- all-reduces, all-gathers and their bytes per step, from the workers'
  ``comm_stats`` (GroupCoordinator's counters) before and after the timed
  steps;
- the communication share: the seconds each rank spent inside those
  collectives (GroupCoordinator times them; this includes waiting for the
  slowest rank) over the timed steps' wall time, mean and max over ranks;
- torch threads per worker (each worker runs 1; TP=1 runs in the engine
  process with ``--threads``, 1 by default, so that every process computes
  alike) and the 1-minute load average around the run.

Then a model, not a measurement: the same decode step predicted for a GPU
node (``GPU``: an H100 SXM's published bf16 dense peak, HBM bandwidth and
NVLink bandwidth per direction, plus an assumed all-reduce latency) from
the step's FLOPs (counted at TP=1 with torch's ``FlopCounterMode``), the
bytes it must read (every weight once, as bf16, plus the KV cache of the
batch's contexts) and the all-reduce bytes measured above. Each rank does
1/TP of the FLOPs and reads 1/TP of the bytes; a step takes the larger of
compute time and memory time, plus the all-reduces: ``calls x latency + 2
(TP-1)/TP x bytes / NVLink`` (a ring all-reduce). Kernel launches, the
all-gather of the logits, sampling and the scheduler are left out.

Why TP is slower here: the TP ranks are processes on the same 2 cores,
which other jobs share too: a split gains a core only when one is idle, and
on a busy machine none is, so the ranks take turns on the cores. The
collectives go through gloo over loopback TCP (copies and system calls
through the kernel), ``1 + 2 x layers`` of them a step, and each waits for
the slowest rank, which may be waiting for a core. The ranks share one
memory bus, so reading 1/TP of the weights each buys no bandwidth. On a
GPU node each rank brings its own HBM bandwidth and FLOPs, and NVLink
all-reduces a few kilobytes in microseconds.

Writes ``OUT/tensor_parallel_cpu.json`` (``OUT`` defaults to this folder's
``results/``) and prints two tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")  # before torch imports tqdm: no GGUF load bars

import torch
from torch.utils.flop_counter import FlopCounterMode

from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader import smollm2_gguf_path
from mini_vllm.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results"

# Assumed GPU numbers (H100 SXM, published): bf16 dense FLOP/s, HBM bytes/s,
# NVLink bytes/s per direction; the all-reduce latency is an assumption.
GPU = {
    "name": "H100 SXM (assumed)",
    "bf16_flops": 990e12,
    "hbm_bytes_s": 3.35e12,
    "nvlink_bytes_s": 450e9,
    "all_reduce_latency_s": 10e-6,
}
BF16_BYTES = 2


def comm_totals(llm: LLM) -> list[dict]:
    """Every rank's collective counters so far ([] at TP=1: no collectives)."""
    executor = llm.llm_engine.engine_core.model_executor
    return [] if executor is None else executor.collective_rpc("comm_stats")


def delta(after: dict, before: dict, field: str, name: str) -> float:
    return after[field].get(name, 0) - before[field].get(name, 0)


def run_one(model: str, tp: int, args: argparse.Namespace) -> dict:
    llm = LLM(
        model,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp",
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_model_len=args.prompt_len + args.output_len + 16,
    )
    try:
        engine = llm.llm_engine
        core = engine.engine_core
        vocab = llm.llm_engine.hf_config.vocab_size
        rng = random.Random(0)
        prompts = [
            {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.prompt_len)]}
            for _ in range(args.batch)
        ]
        warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:1], warm, use_tqdm=False)  # untimed: one-off costs
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        load_before = os.getloadavg()[0]
        for i, prompt in enumerate(prompts):
            engine.add_request(f"tp{tp}-{i}", prompt, params)
        engine.step()  # the prefill of every prompt (one first token each)
        flops = None
        if tp == 1:
            with FlopCounterMode(display=False) as counter:
                engine.step()
            flops = counter.get_total_flops()
        else:
            engine.step()  # untimed, as at TP=1
        before = comm_totals(llm)
        step_s, tokens, outputs = [], [], {}
        while engine.has_unfinished_requests():
            scheduled = core.num_scheduled_tokens
            start = time.perf_counter()
            for out in engine.step():
                outputs[out.request_id] = out
            step_s.append(time.perf_counter() - start)
            tokens.append(core.num_scheduled_tokens - scheduled)
        after = comm_totals(llm)
        load_after = os.getloadavg()[0]
        if set(tokens) != {args.batch}:
            raise RuntimeError(f"expected decode steps of {args.batch} tokens, got {tokens}")
        steps, wall = len(step_s), sum(step_s)
        result = {
            "tp": tp,
            "steps_timed": steps,
            "step_ms_median": 1000 * statistics.median(step_s),
            "step_ms": [1000 * s for s in step_s],
            "threads_per_worker": (
                [a["threads"] for a in after] if after else [torch.get_num_threads()]
            ),
            "loadavg_1m": [load_before, load_after],
            "bytes_per_token_kv": core.bytes_per_block // core.kv_cache_spec.block_size,
            # the whole model, as the engine process loaded it (every rank holds 1/TP)
            "weight_bytes": sum(p.numel() * p.element_size() for p in engine.model.parameters()),
            "num_weights": sum(p.numel() for p in engine.model.parameters()),
            "flops_per_step": flops,
            "tokens": [
                list(outputs[f"tp{tp}-{i}"].outputs[0].token_ids) for i in range(args.batch)
            ],
        }
        if after:
            for name in ("all_reduce", "all_gather"):
                result[f"{name}_per_step"] = delta(after[0], before[0], "calls", name) / steps
                result[f"{name}_bytes_per_step"] = delta(after[0], before[0], "bytes", name) / steps
            shares = [
                sum(delta(a, b, "seconds", n) for n in ("all_reduce", "all_gather")) / wall
                for a, b in zip(after, before, strict=True)
            ]
            result["comm_share_mean"] = statistics.mean(shares)
            result["comm_share_max"] = max(shares)
            result["comm_share_by_rank"] = shares
        return result
    finally:
        llm.llm_engine.engine_core.shutdown()


def predict_gpu(base: dict, run: dict, context_tokens: float, batch: int) -> dict:
    """The model's decode step on ``run['tp']`` GPUs (see the module docstring)."""
    tp = run["tp"]
    # Bytes as measured (in the run's dtype, float32 here), rescaled to bf16.
    to_bf16 = BF16_BYTES / (base["weight_bytes"] / base["num_weights"])
    weights = base["num_weights"] * BF16_BYTES
    kv = batch * context_tokens * base["bytes_per_token_kv"] * to_bf16
    compute_s = base["flops_per_step"] / tp / GPU["bf16_flops"]
    memory_s = (weights + kv) / tp / GPU["hbm_bytes_s"]
    comm_s = 0.0
    if tp > 1:
        ar_bytes = run["all_reduce_bytes_per_step"] * to_bf16
        comm_s = run["all_reduce_per_step"] * GPU["all_reduce_latency_s"]
        comm_s += 2 * (tp - 1) / tp * ar_bytes / GPU["nvlink_bytes_s"]
    return {
        "tp": tp,
        "weights_bytes_bf16": weights,
        "kv_read_bytes_bf16": kv,
        "compute_us": 1e6 * compute_s,
        "memory_us": 1e6 * memory_s,
        "all_reduce_us": 1e6 * comm_s,
        "step_us": 1e6 * (max(compute_s, memory_s) + comm_s),
    }


def run_model(name: str, model: str, tps: list[int], args: argparse.Namespace) -> dict:
    runs = [run_one(model, tp, args) for tp in tps]
    base = next((r for r in runs if r["tp"] == 1), None)
    for r in runs:
        r["ratio_to_tp1"] = r["step_ms_median"] / base["step_ms_median"] if base else None
        r["same_tokens_as_tp1"] = r["tokens"] == base["tokens"] if base else None
    context = args.prompt_len + args.output_len / 2  # the mean context of a decode step
    gpu = [predict_gpu(base, r, context, args.batch) for r in runs] if base else []
    return {"name": name, "model": Path(model).name, "runs": runs, "gpu_model": gpu}


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2's GGUF")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--small-model", default=None, help="default: the tiny seeded Llama")
    parser.add_argument(
        "--small-tp", type=int, nargs="*", default=[1, 2], help="none: skip the small model"
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=64 << 20)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of the TP=1 engine (workers: 1)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.output_len < 3:
        parser.error("--output-len must be at least 3 (prefill, an untimed step, a timed one)")
    report = {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "gpu_assumed": GPU,
        "models": [],
    }
    with tempfile.TemporaryDirectory(prefix="mini_vllm_tp_bench_") as tmp:
        model = args.model or str(smollm2_gguf_path())
        report["models"].append(run_model("model", model, args.tp, args))
        if args.small_tp:
            small = args.small_model
            if small is None:
                from mini_vllm.model_executor.model_loader.tiny import make_tiny_model

                small = str(make_tiny_model(Path(tmp) / "tiny-llama", arch="llama", seed=0))
            report["models"].append(run_model("small", small, args.small_tp, args))

    print(
        f"{args.batch} requests x {args.prompt_len} prompt tokens, {args.output_len} greedy "
        f"tokens each; {report['cpu_count']} CPUs; decode steps timed around LLMEngine.step()"
    )
    print(
        "| model | TP | step ms (median) | x TP=1 | all-reduces/step | all-reduce kB/step "
        "| all-gathers/step | comm share (mean, max rank) | threads/worker | load 1m "
        "| same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m in report["models"]:
        for r in m["runs"]:
            kb = r.get("all_reduce_bytes_per_step")
            share = (
                f"{r['comm_share_mean']:.0%}, {r['comm_share_max']:.0%}"
                if "comm_share_mean" in r
                else "-"
            )
            print(
                f"| {m['model']} | {r['tp']} | {r['step_ms_median']:.1f} "
                f"| {fmt(r['ratio_to_tp1'], '.2f')} | {fmt(r.get('all_reduce_per_step'), '.0f')} "
                f"| {fmt(kb and kb / 1e3, '.1f')} | {fmt(r.get('all_gather_per_step'), '.0f')} "
                f"| {share} | {r['threads_per_worker']} "
                f"| {r['loadavg_1m'][0]:.1f}-{r['loadavg_1m'][1]:.1f} | {r['same_tokens_as_tp1']} |"
            )
    print(
        f"\nPREDICTED (a model, not a measurement) for {GPU['name']}: "
        f"{GPU['bf16_flops'] / 1e12:.0f} TFLOP/s bf16, {GPU['hbm_bytes_s'] / 1e12:.2f} TB/s HBM, "
        f"NVLink {GPU['nvlink_bytes_s'] / 1e9:.0f} GB/s a direction, "
        f"{GPU['all_reduce_latency_s'] * 1e6:.0f} us an all-reduce"
    )
    print(
        "| model | TP | GFLOP/step | weights MB (bf16) | KV read MB | compute us | memory us "
        "| all-reduce us | step us |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for m in report["models"]:
        base = next(r for r in m["runs"] if r["tp"] == 1)
        for g in m["gpu_model"]:
            print(
                f"| {m['model']} | {g['tp']} | {base['flops_per_step'] / 1e9:.3f} "
                f"| {g['weights_bytes_bf16'] / 1e6:.1f} | {g['kv_read_bytes_bf16'] / 1e6:.2f} "
                f"| {g['compute_us']:.2f} | {g['memory_us']:.1f} | {g['all_reduce_us']:.1f} "
                f"| {g['step_us']:.1f} |"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "tensor_parallel_cpu.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
