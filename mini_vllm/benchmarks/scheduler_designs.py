"""Three scheduling designs on the same workloads: v1, v0's swapping, nano-vllm's prefill-first.

``python -m mini_vllm.benchmarks.scheduler_designs [--repeats N] [--out DIR] [--tiny-only]``

The designs (Phase 19), each an engine built with its ``scheduler_cls``:
- ``v1``: mini_vllm's ``Scheduler`` (upstream v1's policy: one token budget,
  steps mix decodes and prefill chunks, preemption by recompute);
- ``swap``: ``SwapScheduler`` (vLLM v0's preemption by swapping to a CPU
  swap space of ``NUM_CPU_BLOCKS`` blocks);
- ``prefill_first``: ``PrefillFirstScheduler`` (nano-vllm: a step is all
  prefill or all decode).

Two workloads of ``NUM_REQUESTS`` requests (seeded random prompts of
``PROMPT_LENS`` tokens, outputs of ``OUTPUT_LENS``, greedy, EOS ignored),
all queued at once and run step by step through ``LLMEngine.step``:
``ample`` has KV blocks for every request at once; ``pressure`` has
``PRESSURE_BLOCKS`` blocks of 16 tokens, so requests are preempted.

Measured per run: throughput (output tokens / wall time), TTFT (queueing
to first token) and TPOT ((last token - first token) / (tokens - 1)) per
request, as p50 / p90 / p99 over the requests; preemptions, swaps out and
in, blocks and bytes copied and the seconds the runner spent copying
(``GPUModelRunner.swap_time``), and the prompt and output tokens computed
again (scheduled tokens beyond each request's prompt + outputs - 1: what
recompute costs). The swap cost is set against recompute on the
``pressure`` workload: swap's copy seconds beside v1's recomputed tokens and
the difference in wall time. Medians over ``--repeats`` runs, the designs
in rotating order. Conditions (torch threads, CPU count, 1-minute load
average) are recorded with each run. SmolLM2-135M (GGUF dequantized to
float32) on 1 thread; ``--tiny-only`` runs the tiny seeded Qwen3 instead (a
quick check that it runs). Writes ``OUT/scheduler_designs_cpu.json`` (or
``scheduler_designs_tiny.json``) and prints a markdown table.

What a CPU shows and a GPU would not: here the "GPU" KV cache and the swap
space are both host memory, so a swap is a memcpy between two host tensors
(no PCIe), and recompute costs CPU matmuls: the ratio between them is not a
GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")  # before torch imports tqdm: no GGUF load bars
import numpy as np  # noqa: E402
import torch  # noqa: E402

from mini_vllm.benchmarks.throughput import make_workload  # noqa: E402
from mini_vllm.core.sched.prefill_first_scheduler import PrefillFirstScheduler  # noqa: E402
from mini_vllm.core.sched.scheduler import Scheduler  # noqa: E402
from mini_vllm.core.sched.swap_scheduler import SwapScheduler  # noqa: E402

DEFAULT_OUT = Path(__file__).parent / "results"
DESIGNS = {"v1": Scheduler, "swap": SwapScheduler, "prefill_first": PrefillFirstScheduler}
NUM_REQUESTS = 8
PROMPT_LENS = (32, 96)
OUTPUT_LENS = (24, 64)
BLOCK_SIZE = 16
AMPLE_BLOCKS = 128  # 2048 tokens: more than the workload's ~1300
PRESSURE_BLOCKS = 20  # 304 usable tokens (block 0 is the null block)
NUM_CPU_BLOCKS = 64
med = statistics.median


def make_llm(model: str, design: str, num_blocks: int):
    from mini_vllm.entrypoints.llm import LLM

    return LLM(
        model,
        max_model_len=256,
        max_num_seqs=NUM_REQUESTS,
        max_num_batched_tokens=512,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=num_blocks,
        num_cpu_blocks=NUM_CPU_BLOCKS if design == "swap" else None,
        scheduler_cls=DESIGNS[design],
        device="cpu",
        dtype="float32",
    )


def percentiles(values: list[float]) -> dict:
    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)}


def run_once(llm, workload, tag: str) -> dict:
    """Queue every request at once, step to the end; per-request times."""
    from mini_vllm.sampling_params import SamplingParams

    engine = llm.llm_engine
    sched = engine.engine_core.scheduler
    runner = engine.engine_core.model_runner
    sched.reset_prefix_cache()
    scheduled = []
    schedule = sched.schedule

    def counting_schedule():
        out = schedule()
        scheduled.append(out.total_num_scheduled_tokens)
        return out

    sched.schedule = counting_schedule
    counters = dict(
        swapped_out=getattr(sched, "num_swapped_out", 0),
        swapped_in=getattr(sched, "num_swapped_in", 0),
        blocks=getattr(sched, "num_blocks_swapped", 0),
        swap_s=getattr(runner, "swap_time", 0.0),
        preemptions=engine.get_stats()["num_preemptions"],
    )
    load, t0 = os.getloadavg()[0], time.perf_counter()
    for i, (prompt, n) in enumerate(workload):
        params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    first, last, tokens = {}, {}, {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter() - t0
        for o in outs:
            if o.outputs and o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = now
            if o.finished:
                last[o.request_id] = now
                tokens[o.request_id] = list(o.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    sched.schedule = schedule
    ids = [f"{tag}-{i}" for i in range(len(workload))]
    n_out = sum(len(tokens[r]) for r in ids)
    ideal = sum(len(p) + n - 1 for p, n in workload)
    kv = [layer.kv_cache for layer in runner.model.attention_layers()]
    bytes_per_block = sum(t[0].numel() * t.element_size() for t in kv)
    blocks = getattr(sched, "num_blocks_swapped", 0) - counters["blocks"]
    swapped_in = getattr(sched, "num_swapped_in", 0) - counters["swapped_in"]
    return dict(
        wall_s=wall,
        tokens_per_s=n_out / wall,
        ttft_s=percentiles([first[r] for r in ids]),
        tpot_s=percentiles([(last[r] - first[r]) / max(1, len(tokens[r]) - 1) for r in ids]),
        preemptions=engine.get_stats()["num_preemptions"] - counters["preemptions"],
        swapped_out=getattr(sched, "num_swapped_out", 0) - counters["swapped_out"],
        swapped_in=swapped_in,
        # Every block swapped out comes back in once its request resumes.
        bytes_swapped=2 * blocks * bytes_per_block,
        swap_copy_s=getattr(runner, "swap_time", 0.0) - counters["swap_s"],
        recomputed_tokens=sum(scheduled) - ideal,
        steps=len(scheduled),
        loadavg_1m=load,
        tokens=[tokens[r] for r in ids],
    )


def summarize(runs: list[dict]) -> dict:
    s = {
        k: med(r[k] for r in runs)
        for k in (
            "wall_s",
            "tokens_per_s",
            "preemptions",
            "swapped_out",
            "swapped_in",
            "bytes_swapped",
            "swap_copy_s",
            "recomputed_tokens",
            "steps",
            "loadavg_1m",
        )
    }
    for key in ("ttft_s", "tpot_s"):
        s[key] = {p: med(r[key][p] for r in runs) for p in ("p50", "p90", "p99")}
    return s


def compare(model: str, repeats: int) -> dict:
    sections, workload = {}, None
    for name, num_blocks in (("ample", AMPLE_BLOCKS), ("pressure", PRESSURE_BLOCKS)):
        llms = {d: make_llm(model, d, num_blocks) for d in DESIGNS}
        if workload is None:
            vocab = llms["v1"].llm_engine.hf_config.vocab_size
            workload = make_workload(NUM_REQUESTS, PROMPT_LENS, OUTPUT_LENS, vocab)
        for d, llm in llms.items():  # warm-up: two short requests
            run_once(llm, [(p, 2) for p, _ in workload[:2]], f"warm-{d}")
        runs: dict[str, list[dict]] = {d: [] for d in DESIGNS}
        order = list(DESIGNS)
        for r in range(repeats):
            for d in order[r % 3 :] + order[: r % 3]:
                res = run_once(llms[d], workload, f"{name}-{d}-{r}")
                runs[d].append(res)
                print(
                    f"  {name} run {r + 1} {d}: {res['tokens_per_s']:.1f} tok/s in "
                    f"{res['wall_s']:.1f}s, {res['preemptions']} preemptions, "
                    f"{res['swapped_out']} swaps (load avg {res['loadavg_1m']:.1f})",
                    file=sys.stderr,
                )
        want = runs["v1"][-1]["tokens"]
        same = {
            d: sum(a == b for a, b in zip(want, runs[d][-1]["tokens"], strict=True)) for d in runs
        }
        for rs in runs.values():
            for r in rs:
                del r["tokens"]
        sections[name] = {
            "summary": {d: summarize(rs) for d, rs in runs.items()},
            "same_tokens_as_v1": {d: f"{n}/{len(workload)}" for d, n in same.items()},
            "runs": runs,
        }
    p = sections["pressure"]["summary"]
    sections["swap_vs_recompute"] = dict(
        swap_copy_s=p["swap"]["swap_copy_s"],
        bytes_swapped=p["swap"]["bytes_swapped"],
        v1_recomputed_tokens=p["v1"]["recomputed_tokens"],
        swap_recomputed_tokens=p["swap"]["recomputed_tokens"],
        wall_s_v1_minus_swap=p["v1"]["wall_s"] - p["swap"]["wall_s"],
    )
    return sections


def table(sections: dict) -> str:
    lines = [
        "| workload | design | tok/s | TTFT p50/p90/p99 s | TPOT p50/p90/p99 ms | steps "
        "| preemptions | swaps out/in | MB swapped | copy s | recomputed tokens | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("ample", "pressure"):
        sec = sections[name]
        for d, s in sec["summary"].items():
            ttft = "/".join(f"{s['ttft_s'][p]:.2f}" for p in ("p50", "p90", "p99"))
            tpot = "/".join(f"{1000 * s['tpot_s'][p]:.0f}" for p in ("p50", "p90", "p99"))
            lines.append(
                f"| {name} | {d} | {s['tokens_per_s']:.1f} | {ttft} | {tpot} | {s['steps']:.0f} "
                f"| {s['preemptions']:.0f} | {s['swapped_out']:.0f}/{s['swapped_in']:.0f} "
                f"| {s['bytes_swapped'] / 1e6:.1f} | {s['swap_copy_s']:.3f} "
                f"| {s['recomputed_tokens']:.0f} | {sec['same_tokens_as_v1'][d]} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from mini_vllm.model_executor.model_loader.tiny import make_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--tiny-only", action="store_true", help="the tiny Qwen3 (a quick run)")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if args.tiny_only:
            with tempfile.TemporaryDirectory() as folder:
                make_tiny_model(folder, arch="qwen3", seed=0)
                sections = compare(folder, args.repeats)
            model, out_name = "tiny seeded Qwen3 (fp32)", "scheduler_designs_tiny.json"
        else:
            from mini_vllm.model_executor.model_loader import smollm2_gguf_path

            sections = compare(str(smollm2_gguf_path()), args.repeats)
            model, out_name = "SmolLM2-135M (GGUF -> fp32)", "scheduler_designs_cpu.json"
    finally:
        torch.set_num_threads(threads)
    meta = dict(
        model=model,
        device=f"CPU, {os.cpu_count()} cores, torch 1 thread",
        torch=torch.__version__,
        workload=f"{NUM_REQUESTS} req queued at once, prompt {PROMPT_LENS[0]}-{PROMPT_LENS[1]}, "
        f"output {OUTPUT_LENS[0]}-{OUTPUT_LENS[1]}, greedy, EOS ignored, budget 512, "
        f"blocks of {BLOCK_SIZE}: ample {AMPLE_BLOCKS}, pressure {PRESSURE_BLOCKS}; "
        f"swap space {NUM_CPU_BLOCKS} blocks",
        repeats=args.repeats,
        command="python -m mini_vllm.benchmarks.scheduler_designs"
        + (" --tiny-only" if args.tiny_only else "")
        + f" --repeats {args.repeats}",
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / out_name).write_text(json.dumps({"meta": meta, **sections}, indent=1))
    print(f"\n{meta['model']}; {meta['device']}; {meta['workload']}; medians of {args.repeats}\n")
    print(table(sections))
    svr = sections["swap_vs_recompute"]
    print(
        f"\nUnder pressure: swap copied {svr['bytes_swapped'] / 1e6:.1f} MB in "
        f"{svr['swap_copy_s']:.3f} s; v1 recomputed {svr['v1_recomputed_tokens']:.0f} tokens "
        f"(swap: {svr['swap_recomputed_tokens']:.0f}); wall time v1 - swap = "
        f"{svr['wall_s_v1_minus_swap']:.2f} s."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
