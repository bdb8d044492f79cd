"""Quantized runs against float32, in one run: memory, speed and quality.

    python -m mini_vllm.benchmarks.quantization [--model PATH] [--tokens 32]
                                                [--kv-cache-memory-bytes N]
                                                [--threads N] [--out DIR]

A course module (Phase 10); no upstream counterpart. For each configuration
(float32, bfloat16, a GGUF kept quantized in memory, fp8 weights per tensor
and per channel, int8 weight-only, an fp8 KV cache) it builds an ``LLM`` on
the same model (SmolLM2 by default) and prints:

- weight bytes (every parameter of the model, scales included);
- KV bytes per block (all layers), the blocks the KV budget holds, and
  upstream's "maximum concurrency" for ``max_model_len`` requests;
- tokens per second of a greedy run (``len(PROMPTS)`` prompts, ``--tokens``
  each, ``ignore_eos``), the process's CPU time a token (less sensitive to
  other jobs on the machine than the wall clock) and, for each prompt, how many tokens it produced
  before its first difference from float32 (the run is free: after a
  difference the contexts differ);
- perplexity of a fixed text (``TEXT``), teacher-forced in one forward, and
  on that text: at how many positions the most likely next token is float32's
  (teacher-forced, so one difference does not change the later positions),
  and the largest and mean absolute error of the log-probability float32
  gives the text's next token.

The conditions go with the numbers: thread count, the 1-minute load average
before and after each configuration, torch's version. Each configuration
first runs one short untimed generate (first calls pay one-off costs).
Writes ``OUT/quantization_cpu.json`` (``OUT`` defaults to this folder's
``results/``) and prints a table.

Run it quiet: tokens per second on a busy machine mean little.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")  # before torch imports tqdm: no GGUF load bars

import torch

from mini_vllm.attention.backend import AttentionMetadata
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.forward_context import set_forward_context
from mini_vllm.kv_cache_interface import cdiv, get_max_concurrency_for_kv_cache_config
from mini_vllm.model_executor.model_loader import smollm2_gguf_path
from mini_vllm.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results"

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
]
TEXT = (
    "The history of the printing press begins in the fifteenth century, when "
    "Johannes Gutenberg combined movable metal type, oil-based ink and a wooden "
    "press. Books became cheaper, literacy spread, and ideas travelled faster "
    "across Europe than ever before."
)
# (name, LLM keyword arguments); "gguf" needs a .gguf model.
CONFIGS = [
    ("float32", {}),
    ("bfloat16", {"dtype": "bfloat16"}),
    ("gguf (in memory)", {"quantization": "gguf"}),
    ("fp8", {"quantization": "fp8"}),
    ("fp8_per_channel", {"quantization": "fp8_per_channel"}),
    ("int8_per_channel", {"quantization": "int8_per_channel"}),
    ("fp8 KV cache", {"kv_cache_dtype": "fp8"}),
]


def text_scores(llm: LLM, token_ids: list[int]) -> tuple[list[float], list[int]]:
    """For each position of ``token_ids`` but the last, teacher-forced in one
    forward: log p(next token | the tokens before it), and the most likely
    next token.

    Writes the text's keys and values into blocks 1, 2, ...: call it last, on
    an LLM that runs nothing afterwards."""
    engine = llm.llm_engine
    core = engine.engine_core
    block_size = core.kv_cache_spec.block_size
    n = len(token_ids)
    blocks = torch.arange(1, cdiv(n, block_size) + 1, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=n,
        max_query_len=n,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        max_seq_len=n,
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_table=blocks[None],
        slot_mapping=torch.arange(block_size, block_size + n, dtype=torch.int64),
    )
    ids = torch.tensor(token_ids, device=engine.device)
    with torch.no_grad(), set_forward_context(metadata):
        hidden = engine.model(ids, torch.arange(n, device=engine.device))
        logprobs = engine.model.compute_logits(hidden).float().log_softmax(dim=-1)
    picked = logprobs[:-1].gather(1, ids[1:, None]).squeeze(1)
    return picked.tolist(), logprobs[:-1].argmax(dim=-1).tolist()


def measure(model: str, kwargs: dict, tokens: int, kv_bytes: int, max_model_len: int) -> dict:
    llm = LLM(model, kv_cache_memory_bytes=kv_bytes, max_model_len=max_model_len, **kwargs)
    engine, core = llm.llm_engine, llm.llm_engine.engine_core
    tok = llm.get_tokenizer()
    blocks = engine.vllm_config.cache_config.num_gpu_blocks
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": tok.encode(p)} for p in PROMPTS]
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], warm, use_tqdm=False)  # untimed: one-off costs
    load_before = os.getloadavg()[0]
    cpu_start, start = time.process_time(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    logprobs, argmax = text_scores(llm, tok.encode(TEXT))
    return {
        "weight_bytes": sum(p.numel() * p.element_size() for p in engine.model.parameters()),
        "kv_bytes_per_block": core.bytes_per_block,
        "blocks": blocks,
        "concurrency": get_max_concurrency_for_kv_cache_config(
            blocks, core.kv_cache_spec, core.num_layers, max_model_len
        ),
        "tok_s": len(PROMPTS) * tokens / seconds,
        # CPU time of this process (all its threads) a token: less sensitive to
        # other jobs than tokens per second, which counts the waits too
        "cpu_ms_per_token": 1000 * cpu_seconds / (len(PROMPTS) * tokens),
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "perplexity": math.exp(-sum(logprobs) / len(logprobs)),
        "text_logprobs": logprobs,
        "text_argmax": argmax,
        "loadavg_1m": [load_before, os.getloadavg()[0]],
    }


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2's GGUF")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or str(smollm2_gguf_path())
    result = {
        "model": Path(model).name,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "prompts": len(PROMPTS),
        "tokens": args.tokens,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "max_model_len": args.max_model_len,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "configs": {},
    }
    print(
        f"model {result['model']}; {len(PROMPTS)} prompts x {args.tokens} greedy tokens; "
        f"KV budget {args.kv_cache_memory_bytes} bytes; {result['threads']} threads"
    )
    print(
        f"{'config':18} {'weights MB':>10} {'KV B/block':>10} {'blocks':>6} {'conc.':>6} "
        f"{'tok/s':>6} {'cpu ms/tok':>10} {'ppl':>7} {'top1':>5} {'max|dlp|':>8} {'load':>9}  "
        "same as float32 until token"
    )
    ref = None
    for name, kwargs in CONFIGS:
        if kwargs.get("quantization") == "gguf" and not model.endswith(".gguf"):
            continue
        r = measure(model, kwargs, args.tokens, args.kv_cache_memory_bytes, args.max_model_len)
        ref = ref or r
        r["same_until"] = [
            first_difference(a, b) for a, b in zip(r["tokens"], ref["tokens"], strict=True)
        ]
        r["top1_agree"] = sum(
            a == b for a, b in zip(r["text_argmax"], ref["text_argmax"], strict=True)
        )
        errors = [abs(a - b) for a, b in zip(r["text_logprobs"], ref["text_logprobs"], strict=True)]
        r["logprob_err_max"], r["logprob_err_mean"] = max(errors), sum(errors) / len(errors)
        result["configs"][name] = {"kwargs": kwargs, **r}
        positions = len(r["text_argmax"])
        print(
            f"{name:18} {r['weight_bytes'] / 1e6:10.1f} {r['kv_bytes_per_block']:10d} "
            f"{r['blocks']:6d} {r['concurrency']:6.2f} {r['tok_s']:6.1f} "
            f"{r['cpu_ms_per_token']:10.1f} "
            f"{r['perplexity']:7.3f} {r['top1_agree']:2d}/{positions:<2d} "
            f"{r['logprob_err_max']:8.4f} {r['loadavg_1m'][0]:4.1f}-{r['loadavg_1m'][1]:<4.1f}  "
            f"{r['same_until']} of {args.tokens}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "quantization_cpu.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
