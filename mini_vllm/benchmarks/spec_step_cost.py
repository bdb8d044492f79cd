"""What a verification step costs: the model runner's time for a step that
computes ``1 + k`` tokens per request (``k`` drafts verified) against a
plain decode step (1 token per request), in the same run.

``python -m mini_vllm.benchmarks.spec_step_cost [--k 3] [--batch 1 4] [--repeats 3]
[--threads N] [--out DIR]``

Speculation pays when a step that verifies ``k`` drafts costs much less than
``1 + k`` plain steps: a step then yields ``1 + accepted`` tokens for little
more than the price of one. This measures that price on SmolLM2-135M
(float32, the shipped GGUF), greedy, EOS ignored. Each batch size ``b`` runs
``b`` copies of a prompt the model continues by repeating it ("red, green,
blue, ..."), so with ``{"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_min": 1, "prompt_lookup_max": 3}`` every decode step verifies
``k`` drafts per request and accepts them all. Two engines, built once; runs
alternate (plain, speculative) ``--repeats`` times after an untimed warm-up
each. The runner's ``execute_model`` is timed per step (the persistent
batch's update, input preparation, the forward, sampling or verification,
bookkeeping and, with speculation, the n-gram proposer); the steps kept are
the decode steps, ``b`` tokens (plain) or ``b * (1 + k)`` (speculative), and
the report gives their medians, the ratio, and the model forward plus
sampling alone (the runner's ``forward_time``), with the thread count and the
1-minute load average. Writes ``OUT/spec_step_cost_cpu.json`` (``cuda`` on a
GPU). mini_vllm's own benchmark; it has no upstream counterpart.
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

import torch

from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader import smollm2_gguf_path
from mini_vllm.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results"
PROMPT = "red, green, blue, red, green, blue, red, green, blue, red, green,"


def timed_steps(llm: LLM, prompt_ids: list[int], batch: int, max_tokens: int) -> list[dict]:
    """One generate() of ``batch`` copies of the prompt; per runner step: the
    tokens it computed, its seconds, and the forward + sampling seconds."""
    runner = llm.llm_engine.engine_core.model_runner
    steps: list[dict] = []
    execute = runner.execute_model

    def timed(scheduler_output, *args):
        forward_before, start = runner.forward_time, time.perf_counter()
        out = execute(scheduler_output, *args)
        steps.append(
            {
                "tokens": scheduler_output.total_num_scheduled_tokens,
                "seconds": time.perf_counter() - start,
                "forward_seconds": runner.forward_time - forward_before,
            }
        )
        return out

    runner.execute_model = timed  # an instance attribute: removed below
    try:
        llm.llm_engine.engine_core.scheduler.reset_prefix_cache()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompt_ids}] * batch, params, use_tqdm=False)
    finally:
        del runner.execute_model
    return steps


def measure(plain: LLM, spec: LLM, prompt_ids: list[int], batch: int, k: int, args) -> dict:
    want = {"plain": batch, "spec": batch * (1 + k)}
    kept: dict[str, list[dict]] = {"plain": [], "spec": []}
    loads = []
    for llm in (plain, spec):  # warm-up, not timed
        timed_steps(llm, prompt_ids, batch, 4)
    for _ in range(args.repeats):
        for name, llm in (("plain", plain), ("spec", spec)):
            steps = timed_steps(llm, prompt_ids, batch, args.max_tokens)
            kept[name] += [s for s in steps if s["tokens"] == want[name]]
            loads.append(os.getloadavg()[0])
    med = statistics.median
    result = {"batch": batch, "tokens_per_step": want, "loadavg_1m": med(loads)}
    for name, steps in kept.items():
        if not steps:
            raise RuntimeError(f"no {name} step computed {want[name]} tokens: nothing to time")
        result[name] = {
            "steps_timed": len(steps),
            "step_ms": 1000 * med(s["seconds"] for s in steps),
            "forward_ms": 1000 * med(s["forward_seconds"] for s in steps),
        }
    result["step_ratio"] = result["spec"]["step_ms"] / result["plain"]["step_ms"]
    result["forward_ratio"] = result["spec"]["forward_ms"] / result["plain"]["forward_ms"]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm.benchmarks.spec_step_cost")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = str(smollm2_gguf_path())
    common = dict(max_model_len=512, kv_cache_memory_bytes=64 << 20)
    spec_config = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    plain = LLM(path, **common)
    spec = LLM(path, speculative_config=spec_config, **common)
    prompt_ids = plain.get_tokenizer().encode(PROMPT)
    device = plain.llm_engine.engine_core.model_runner.device
    result = {
        "model": "SmolLM2-135M-Instruct (GGUF, float32)",
        "device": torch.device(device).type,
        "speculative_config": spec_config,
        "prompt": PROMPT,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "batches": [measure(plain, spec, prompt_ids, b, args.k, args) for b in args.batch],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"spec_step_cost_{result['device']}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"\nrunner step cost, SmolLM2 fp32, k={args.k}, {result['threads']} threads "
        f"(medians over {args.repeats} alternating runs)\n"
    )
    print(
        "| batch | plain step | tokens | verify step | tokens | step ratio | forward ratio | load |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in result["batches"]:
        print(
            f"| {r['batch']} | {r['plain']['step_ms']:.1f} ms | {r['tokens_per_step']['plain']} "
            f"| {r['spec']['step_ms']:.1f} ms | {r['tokens_per_step']['spec']} "
            f"| {r['step_ratio']:.2f}x | {r['forward_ratio']:.2f}x | {r['loadavg_1m']:.1f} |"
        )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
