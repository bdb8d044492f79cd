"""N-gram speculative decoding against plain decoding, in one run.

``python -m mini_vllm.benchmarks.spec_decode [--quick] [--repeats N] [--k K] [--out DIR]``

SmolLM2-135M (float32, the shipped GGUF), greedy, EOS ignored, two
workloads of four prompts each, every workload run as one ``LLM.generate``:

- ``repetitive``: prompts whose continuation repeats text already in the
  context (lists, a repeated sentence, code with repeated lines): what
  prompt-lookup drafting is for;
- ``plain``: ordinary prompts, where the context rarely predicts the
  next tokens.

Two engines are built once: without speculation, and with
``{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
"prompt_lookup_max": 3}``. Runs alternate (plain engine, speculative engine)
``--repeats`` times per workload after one short untimed warm-up run each,
and the report gives medians of the time
per output token, the ratio, the engine steps, the output tokens per engine
step, and the drafts' acceptance rate per position (accepted at position i /
drafts verified) from the engine's spec-decode stats, with the thread count
and the 1-minute load average. Greedy tokens are checked equal between the
two engines. Writes ``OUT/spec_decode_cpu.json``; prints a markdown table.
This is mini_vllm's own benchmark (upstream's is vllm/benchmarks/).
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

WORKLOADS = {
    "repetitive": [
        "red, green, blue, red, green, blue, red, green, blue, red, green,",
        "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat",
        "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in",
        "Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday, Monday, Tuesday,",
    ],
    "plain": [
        "The capital of France is",
        "Once upon a time, in a small village by the sea, there lived",
        "The three primary colors are",
        "In computer science, a linked list is a data structure that",
    ],
}


def run_once(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """One generate() over the prompts; wall time, tokens and this run's stats."""
    engine = llm.llm_engine
    before = engine.get_stats()
    llm.llm_engine.engine_core.scheduler.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = engine.get_stats()
    tokens = [o.outputs[0].token_ids for o in outputs]
    num_out = sum(len(t) for t in tokens)
    per_pos = [
        a - b
        for a, b in zip(
            after["spec_num_accepted_tokens_per_pos"],
            before["spec_num_accepted_tokens_per_pos"],
            strict=True,
        )
    ]
    return {
        "tokens": tokens,
        "wall_s": wall,
        "ms_per_output_token": 1000 * wall / num_out,
        "num_steps": after["num_steps"] - before["num_steps"],
        "num_output_tokens": num_out,
        "num_drafts": after["spec_num_drafts"] - before["spec_num_drafts"],
        "num_draft_tokens": after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"],
        "num_accepted_tokens": after["spec_num_accepted_tokens"]
        - before["spec_num_accepted_tokens"],
        "accepted_per_pos": per_pos,
        "loadavg_1m": os.getloadavg()[0],
    }


def compare(plain: LLM, spec: LLM, prompts: list[list[int]], max_tokens: int, repeats: int):
    runs: dict[str, list[dict]] = {"plain": [], "spec": []}
    for _ in range(repeats):
        for name, llm in (("plain", plain), ("spec", spec)):
            runs[name].append(run_once(llm, prompts, max_tokens))
    identical = all(r["tokens"] == runs["plain"][0]["tokens"] for r in runs["plain"] + runs["spec"])
    med = statistics.median
    last = runs["spec"][-1]  # greedy: every spec run drafts and accepts the same
    plain_ms = med(r["ms_per_output_token"] for r in runs["plain"])
    spec_ms = med(r["ms_per_output_token"] for r in runs["spec"])
    return {
        "identical_tokens": identical,
        "plain_ms_per_token": plain_ms,
        "spec_ms_per_token": spec_ms,
        "speedup": plain_ms / spec_ms,
        "plain_steps": runs["plain"][-1]["num_steps"],
        "spec_steps": last["num_steps"],
        "plain_tokens_per_step": runs["plain"][-1]["num_output_tokens"]
        / runs["plain"][-1]["num_steps"],
        "spec_tokens_per_step": last["num_output_tokens"] / last["num_steps"],
        "num_drafts": last["num_drafts"],
        "num_draft_tokens": last["num_draft_tokens"],
        "num_accepted_tokens": last["num_accepted_tokens"],
        "acceptance_rate": last["num_accepted_tokens"] / max(1, last["num_draft_tokens"]),
        "acceptance_by_position": [
            a / max(1, last["num_drafts"]) for a in last["accepted_per_pos"]
        ],
        "loadavg_1m": med(r["loadavg_1m"] for r in runs["plain"] + runs["spec"]),
        "runs": {
            k: [{x: y for x, y in r.items() if x != "tokens"} for r in v] for k, v in runs.items()
        },
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm.benchmarks.spec_decode")
    parser.add_argument("--quick", action="store_true", help="24 output tokens, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.max_tokens = 1, 24
    torch.set_num_threads(args.threads)
    path = str(smollm2_gguf_path())
    common = dict(max_model_len=512, kv_cache_memory_bytes=64 << 20)
    plain = LLM(path, **common)
    spec_config = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    spec = LLM(path, speculative_config=spec_config, **common)
    tok = plain.get_tokenizer()
    result = {
        "model": "SmolLM2-135M-Instruct (GGUF, float32)",
        "speculative_config": spec_config,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "workloads": {},
    }
    for name, texts in WORKLOADS.items():
        prompts = [tok.encode(t) for t in texts]
        for llm in (plain, spec):  # warm-up, not timed (first calls pay one-off costs)
            run_once(llm, prompts, 4)
        result["workloads"][name] = compare(plain, spec, prompts, args.max_tokens, args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "spec_decode_cpu.json"
    out.write_text(json.dumps(result, indent=1) + "\n")

    print(
        f"\nn-gram speculation, k={args.k}, SmolLM2 fp32, {result['threads']} threads, "
        f"{args.max_tokens} tokens x 4 prompts, medians of {args.repeats}\n"
    )
    print(
        "| workload | ms/token plain | ms/token spec | speedup | steps plain | steps spec "
        "| tokens/step spec | acceptance | by position | same tokens | load |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in result["workloads"].items():
        by_pos = ", ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
        print(
            f"| {name} | {r['plain_ms_per_token']:.1f} | {r['spec_ms_per_token']:.1f} "
            f"| {r['speedup']:.2f}x | {r['plain_steps']} | {r['spec_steps']} "
            f"| {r['spec_tokens_per_step']:.2f} | {r['acceptance_rate']:.2f} | {by_pos} "
            f"| {r['identical_tokens']} | {r['loadavg_1m']:.1f} |"
        )
    print(f"\nwrote {out}")
    return 0 if all(r["identical_tokens"] for r in result["workloads"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
