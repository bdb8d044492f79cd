"""Serving: throughput, TTFT and TPOT against the OpenAI server, with LLM.generate as the ceiling.

``python -m mini_vllm.benchmarks.serve [--model PATH] [--num-requests N]
[--concurrency 1 4 16 32] [--out DIR]``

One process, one loaded model (SmolLM2-135M by default). The workload: N
requests whose prompts are seeded random token ids (lengths uniform in
32-128) and whose outputs are ``--output-len`` tokens (EOS ignored, greedy);
prefix caching is off, so that every run prefills every prompt.
After a short untimed warm-up, ``LLM.generate`` runs all N at once (the ceiling: no HTTP, no event
loop, one batch). Then the same engine is served (``ServerThread``:
uvicorn in a thread, loopback) and, for each concurrency level, the
``openai`` async client streams all N requests with at most that many in
flight (``stream_options.include_usage`` gives each request's token count).

Per level: output tokens/s over the level's wall time, and the percentiles
(p50, p90, p99) of time to first token (request sent -> first chunk with
text) and time per output token ((last chunk - first chunk) / (tokens - 1)).
Prints a markdown table; writes ``OUT/serve.json``. Compares mini_vllm with
itself only (no upstream server runs on CPU: vllm._C does not load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.entrypoints.openai.api_server import ServerThread
from mini_vllm.sampling_params import SamplingParams

MODEL_NAME = "bench"


def make_prompts(num_requests: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(vocab_size) for _ in range(rng.randint(32, 128))]
        for _ in range(num_requests)
    ]


def percentiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        value = values[0] if values else float("nan")
        return {"p50": value, "p90": value, "p99": value}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98]}


async def _one(client, prompt: list[int], output_len: int) -> dict:
    start = time.perf_counter()
    first = last = None
    num_tokens = 0
    stream = await client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=output_len,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            last = time.perf_counter()
            first = first or last
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
    ttft = (first or time.perf_counter()) - start
    tpot = (last - first) / (num_tokens - 1) if first and num_tokens > 1 else None
    return {"ttft": ttft, "tpot": tpot, "tokens": num_tokens}


async def run_level(url: str, prompts, output_len: int, concurrency: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt):
        async with gate:
            return await _one(client, prompt, output_len)

    start = time.perf_counter()
    results = await asyncio.gather(*(gated(p) for p in prompts))
    wall = time.perf_counter() - start
    await client.close()
    tokens = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "tokens": tokens,
        "ttft_s": percentiles([r["ttft"] for r in results]),
        "tpot_s": percentiles([r["tpot"] for r in results if r["tpot"] is not None]),
    }


def run_benchmark(
    model: str, num_requests: int, output_len: int, levels: list[int], **llm_kwargs
) -> dict:
    llm = LLM(model, **llm_kwargs)
    engine = llm.llm_engine
    prompts = make_prompts(num_requests, engine.hf_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    # Warm-up (first calls pay one-off costs), not timed.
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    ceiling_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    report = {
        "model": model,
        "num_requests": num_requests,
        "output_len": output_len,
        # The conditions: torch's threads and the load average before the run.
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0],
        "llm_generate": {"wall_s": wall, "output_tok_s": ceiling_tokens / wall},
        "server": [],
    }
    server = ServerThread(AsyncLLM(engine, MODEL_NAME), model, MODEL_NAME)
    try:
        for level in levels:
            result = asyncio.run(run_level(server.url, prompts, output_len, level))
            if result["tokens"] != ceiling_tokens:
                raise RuntimeError(
                    f"concurrency {level}: {result['tokens']} tokens, expected {ceiling_tokens}"
                )
            report["server"].append(result)
    finally:
        server.stop()
    return report


def markdown(report: dict) -> str:
    ceiling = report["llm_generate"]["output_tok_s"]
    lines = [
        "| concurrency | output tok/s | of LLM.generate | TTFT p50 / p90 / p99 (s) | "
        "TPOT p50 / p90 / p99 (ms) |",
        "| --- | --- | --- | --- | --- |",
        f"| LLM.generate (all at once) | {ceiling:.1f} | 100% | | |",
    ]
    for r in report["server"]:
        ttft, tpot = r["ttft_s"], r["tpot_s"]
        lines.append(
            f"| {r['concurrency']} | {r['output_tok_s']:.1f} | "
            f"{100 * r['output_tok_s'] / ceiling:.0f}% | "
            f"{ttft['p50']:.2f} / {ttft['p90']:.2f} / {ttft['p99']:.2f} | "
            f"{1e3 * tpot['p50']:.0f} / {1e3 * tpot['p90']:.0f} / {1e3 * tpot['p99']:.0f} |"
        )
    lines.append(
        f"\n{report['num_requests']} requests, {report['output_len']} output tokens each; "
        f"torch threads {report['torch_threads']}, load average {report['load_average_1m']:.2f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--out", type=Path, default=Path("build/bench"))
    args = parser.parse_args(argv)
    report = run_benchmark(
        args.model or str(smollm2_gguf_path()),
        args.num_requests,
        args.output_len,
        args.concurrency,
        max_model_len=512,
        max_num_seqs=max(args.concurrency),
        kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=False,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve.json").write_text(json.dumps(report, indent=2))
    print(markdown(report))


if __name__ == "__main__":
    main()
