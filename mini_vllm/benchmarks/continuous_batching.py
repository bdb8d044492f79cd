"""Continuous batching against static batching on a CPU, in one run.

``python -m mini_vllm.benchmarks.continuous_batching [--dtype float32|bfloat16] [--quick]``
``[--repeats N] [--out DIR] [--note TEXT]``

The workload users have, in the shape of nano-vllm's benchmark (its bench.py:
256 sequences, prompt and output lengths each uniform in 100-1024, all
submitted at once) scaled to a 2-core CPU: SmolLM2-135M in float32 (the
shipped Q4_1 GGUF dequantized; same weights on both sides), 128 requests
(half of nano-vllm's 256), prompts of seeded random token ids with lengths
uniform in 4-40 and outputs uniform in 4-40 (nano-vllm's lengths divided by
25.6, so max/min stays 10x), greedy, EOS ignored (seed 0). The shape is what
matters: with output lengths spread 10x, a static batch runs every member to
its longest one, and its prompts are padded to the longest prompt; that is
the waste continuous batching removes. The scale is what fits: every run
below goes through the whole workload (mini_vllm 5 times, transformers 7;
8 in bfloat16, where the float32 tokens are computed too),
and the lot must stay near 15 minutes on this machine while other jobs
share it (measured: 6 minutes quiet, 16 minutes with ``--repeats 2`` at
load average 10). ``--quick``: 32 requests, the same lengths, for development.

``--dtype bfloat16`` runs both sides in bfloat16 (weights, activations and KV
cache; mini_vllm's sampler still computes in float32, as upstream's does), with
transformers swept over batches of 8 to 128 since its best batch may move (a
bfloat16 matmul's rate grows with its rows much more than a float32 one's on a
CPU with AMX), and the matmul-rate table in bfloat16. The tokens of the two
sides then need not be equal (different kernels round differently): for every
request whose tokens differ, the script finds the first position where they
do and measures, with transformers in float32 on the common prefix, the gap
in log-probability between the two tokens chosen there, against bfloat16's own
error there (the largest |bf16 - fp32| of transformers' logits at that
position); a difference that starts at a near tie has a gap below that error.

- mini_vllm: one ``LLM.generate`` over all of them (max_num_seqs = all,
  2048-token budget, the default CPU attention backend, prefix cache reset
  before each run).
- transformers: ``generate`` in static left-padded batches of 8, 16, 32 and
  64 (default sdpa attention), each batch run to its longest output, swept
  once after mini_vllm's first run; the best batch size of the sweep is the
  baseline (at 1 thread, best by tokens per CPU second). Tokens are compared
  with mini_vllm's for every batch size.

Every run also records its CPU time (``time.process_time``); per CPU second
is the useful tokens over it. At 1 thread on a machine other jobs share, it
counts only the time the run held a core (its wall time also counts the
waits for one), so its ratio is the steadier one there; on a quiet machine
the two agree. Other jobs still share the caches and memory bandwidth.

The timed comparison at the first thread count (``--threads``, default 1
then 2) takes mini_vllm's first run and the sweep's run at the best batch
size as its first pair, then alternates (HF, mini, mini, HF, ...) up to
``--repeats`` runs each; at the other thread counts, ``--other-repeats``
pairs (on a shared machine a thread count that ignores a busy core can cost
10x). Medians are reported with the 1-minute load average. Also in the same
run, at the first thread count:

- the per-part breakdown of one mini_vllm run (``step_breakdown``);
- the machine's matmul rate (in the run's dtype) for SmolLM2's linear layers
  at the batch sizes the engine runs (decode rows and prefill chunks), and the time the
  run's decoder-layer linear FLOPs would take at the best of those rates.

Writes ``OUT/continuous_batching_cpu.json`` (``_bf16.json`` in bfloat16) after each
thread count, with ``--note`` in it when given; prints
markdown tables. This is mini_vllm's own benchmark (upstream's is
vllm/benchmarks/throughput.py).
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
import torch  # noqa: E402

from mini_vllm.benchmarks.step_breakdown import step_breakdown  # noqa: E402
from mini_vllm.benchmarks.throughput import (  # noqa: E402
    DEFAULT_OUT,
    StepTimer,
    make_workload,
    run_hf,
    run_mini,
)

# nano-vllm: 256 requests, prompts and outputs uniform in 100-1024 (see above).
NUM_REQUESTS, PROMPT_LENS, OUTPUT_LENS = 128, (4, 40), (4, 40)
QUICK = 32, (4, 40), (4, 40)
SHAPE = (
    "nano-vllm's shape (256 req, prompts and outputs each uniform in 100-1024) scaled to "
    "this CPU: half the requests, lengths / 25.6 (max/min 10x, as nano-vllm's)"
)
HF_BATCHES = {"float32": (8, 16, 32, 64), "bfloat16": (8, 16, 32, 64, 128)}
DTYPE_TAG = {"float32": "fp32", "bfloat16": "bf16"}
med = statistics.median


def linear_shapes(cfg) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linears: fused QKV, output, fused gate/up, down."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]


def matmul_rate(m: int, shapes, dtype: torch.dtype, iters: int = 5) -> float:
    """Median FLOP/s of ``[m, in] @ [in, out]`` in ``dtype`` over one layer's linear shapes."""
    xs = [(torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)) for k, n in shapes]
    flops = sum(2 * m * k * n for k, n in shapes)
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        for x, w in xs:
            torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - t0)
    return flops / med(times[1:])


def hf_sweep(hf, workload, pad_id, mini_tokens, batches):
    """(results by batch size, greedy tokens by batch size)."""
    sweep, tokens = {}, {}
    for bs in batches:
        r = run_hf(hf, workload, bs, pad_id)
        tokens[bs] = r.pop("tokens")
        same = sum(a == b for a, b in zip(tokens[bs], mini_tokens, strict=True))
        r["identical_to_mini"] = f"{same}/{len(workload)}"
        r["cpu_tok_s"] = sum(n for _, n in workload) / r["cpu_s"]
        r["run"] = {k: v for k, v in r.items() if k != "identical_to_mini"}  # for the timed pairs
        sweep[bs] = r
        print(
            f"  HF batch {bs}: {r['tok_s']:.1f} useful tok/s ({r['cpu_tok_s']:.1f} per CPU s), "
            f"{r['wall_s']:.1f}s, "
            f"{r['identical_to_mini']} identical (load {r['loadavg_1m']:.1f})",
            file=sys.stderr,
        )
    return sweep, tokens


@torch.inference_mode()
def first_differences(ref, hf, workload, mini_tokens, hf_tokens) -> dict:
    """Where the two sides' greedy tokens part, and how close the call was there.

    For every request whose tokens differ: the first differing position, the
    two tokens chosen there, and ``ref``'s (transformers in float32) gap in
    log-probability between them, computed on the prompt and the tokens both
    sides agree on; whether ``ref``'s own choice there is one of the two; and
    the run dtype's own error there, the largest |``hf`` - ``ref``| over the
    vocabulary's logits (``hf``: transformers in the run's dtype). A gap below
    that error is a tie at the run dtype's precision.
    """
    diffs = []
    for req, ((prompt, _), a, b) in enumerate(zip(workload, mini_tokens, hf_tokens, strict=True)):
        if a == b:
            continue
        i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        context = torch.tensor([prompt + a[:i]])
        logits = ref(context).logits[0, -1].float()  # float32 [V]
        error = (hf(context).logits[0, -1].float() - logits).abs().max().item()
        logprobs = logits.log_softmax(-1)  # float32 [V]
        gap = abs(logprobs[a[i]] - logprobs[b[i]]).item()
        diffs.append(
            dict(
                request=req,
                position=i,
                mini_token=a[i],
                hf_token=b[i],
                fp32_gap_nats=gap,
                fp32_choice_is_one_of_them=int(logprobs.argmax()) in (a[i], b[i]),
                dtype_error_nats=error,
            )
        )
    gaps = [d["fp32_gap_nats"] for d in diffs]
    return dict(
        differing=len(diffs),
        max_fp32_gap_nats=max(gaps, default=None),
        median_fp32_gap_nats=med(gaps) if gaps else None,
        gap_below_dtype_error=sum(d["fp32_gap_nats"] < d["dtype_error_nats"] for d in diffs),
        requests=diffs,
    )


def alternate(llm, timer, hf, workload, hf_batch, pad_id, repeats, first_pair=None):
    """``repeats`` runs of each, alternating; ``first_pair`` (mini's run, HF's run), when
    given, counts as the first pair."""
    runs = {"mini": [], "hf": []}
    if first_pair is not None:
        runs["mini"].append(first_pair[0])
        runs["hf"].append(first_pair[1])
    for r in range(len(runs["mini"]), repeats):
        for name in ["mini", "hf"] if r % 2 == 0 else ["hf", "mini"]:
            if name == "mini":
                res = run_mini(llm, timer, workload)
                res.pop("decode")
            else:
                res = run_hf(hf, workload, hf_batch, pad_id)
            res.pop("tokens")
            runs[name].append(res)
            print(
                f"  {torch.get_num_threads()} threads, run {r + 1} {name}: "
                f"{res['tok_s']:.1f} tok/s in {res['wall_s']:.1f}s (load {res['loadavg_1m']:.1f})",
                file=sys.stderr,
            )
    tokens = sum(n for _, n in workload)
    mini_cpu, hf_cpu = (med(tokens / r["cpu_s"] for r in runs[k]) for k in ("mini", "hf"))
    return dict(
        mini_tok_s=med(r["tok_s"] for r in runs["mini"]),
        hf_tok_s=med(r["tok_s"] for r in runs["hf"]),
        ratio=med(r["tok_s"] for r in runs["mini"]) / med(r["tok_s"] for r in runs["hf"]),
        mini_cpu_tok_s=mini_cpu,
        hf_cpu_tok_s=hf_cpu,
        cpu_ratio=mini_cpu / hf_cpu,
        loadavg_1m=med(r["loadavg_1m"] for r in runs["mini"] + runs["hf"]),
        mini_steps=runs["mini"][0]["steps"],
        mini_step_ms=med(1e3 * r["step_s"] / r["steps"] for r in runs["mini"]),
        runs=runs,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mini_vllm.benchmarks.continuous_batching")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a small workload, for development")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--other-repeats", type=int, default=1, help="repeats at the thread counts after the first"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--dtype", choices=sorted(HF_BATCHES), default="float32")
    parser.add_argument("--note", help="a remark stored in the results file (e.g. the load)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    import transformers
    from transformers import AutoModelForCausalLM

    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.model_executor.model_loader import smollm2_gguf_path
    from mini_vllm.sampling_params import SamplingParams

    transformers.utils.logging.set_verbosity_error()
    n, prompt_lens, output_lens = QUICK if args.quick else (NUM_REQUESTS, PROMPT_LENS, OUTPUT_LENS)
    path = smollm2_gguf_path()
    llm = LLM(
        str(path),
        max_model_len=512,
        max_num_seqs=n,
        max_num_batched_tokens=2048,
        device="cpu",
        dtype=args.dtype,
    )
    engine = llm.llm_engine
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    ).eval()
    pad_id = hf.generation_config.pad_token_id or 0
    cfg = engine.hf_config
    workload = make_workload(n, prompt_lens, output_lens, cfg.vocab_size)
    timer = StepTimer(llm)
    threads0 = torch.get_num_threads()
    result = dict(
        model=f"SmolLM2-135M (GGUF Q4_1 -> {DTYPE_TAG[args.dtype]})",
        dtype=args.dtype,
        workload=f"{n} req, prompt {prompt_lens[0]}-{prompt_lens[1]}, "
        f"output {output_lens[0]}-{output_lens[1]}, seed 0",
        shape=SHAPE,
        useful_output_tokens=sum(m for _, m in workload),
        prompt_tokens=sum(len(p) for p, _ in workload),
        attention_backend=engine.attention_backend,
        cpu_count=os.cpu_count(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        repeats=args.repeats,
    )
    if args.note:
        result["note"] = args.note

    # Warm-up, then mini_vllm once for its tokens, then the static-batch sweep.
    torch.set_num_threads(args.threads[0])
    run_mini(llm, timer, [(p, 2) for p, _ in workload[:2]])
    run_hf(hf, [(p, 2) for p, _ in workload[:2]], 2, pad_id)
    first = run_mini(llm, timer, workload)
    print(f"mini_vllm: {first['tok_s']:.1f} tok/s in {first['wall_s']:.1f}s", file=sys.stderr)
    sweep, hf_tokens = hf_sweep(hf, workload, pad_id, first["tokens"], HF_BATCHES[args.dtype])
    # At 1 thread, the best batch by CPU time: what the run costs, whatever else shares the
    # machine (on a quiet one, CPU time is wall time); at more, by wall time.
    best_by = "cpu_tok_s" if args.threads[0] == 1 else "tok_s"
    best = max(sweep, key=lambda bs: sweep[bs][best_by])
    result.update(
        hf_sweep={bs: {k: v for k, v in r.items() if k != "run"} for bs, r in sweep.items()},
        hf_best_batch=best,
        hf_best_by=best_by,
        mini_steps=first["steps"],
    )

    # The timed comparison at the first thread count: the first pair is the runs above.
    suffix = "" if args.dtype == "float32" else f"_{DTYPE_TAG[args.dtype]}"
    out = args.out / f"continuous_batching_cpu{suffix}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    mini_tokens = first.pop("tokens")
    first.pop("decode")
    pair = first, sweep[best]["run"]
    result["by_threads"] = {
        args.threads[0]: alternate(llm, timer, hf, workload, best, pad_id, args.repeats, pair)
    }

    # Breakdown and matmul rates at the first thread count.
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0) for _, m in workload]
    llm.llm_engine.engine_core.scheduler.reset_prefix_cache()
    result["breakdown_s"] = step_breakdown(llm, prompts, params)
    result["breakdown_loadavg_1m"] = os.getloadavg()[0]
    shapes, layers, rates = linear_shapes(cfg), cfg.num_hidden_layers, {}
    for m in sorted({8, 32, n, 512, 2048}):
        rate = matmul_rate(m, shapes, dtype)
        rates[m] = dict(
            gflop_s=rate / 1e9,
            # the decoder layers' linears for m tokens at that rate (logits excluded)
            linear_floor_ms=1e3 * layers * sum(2 * m * k * o for k, o in shapes) / rate,
        )
    # The run's decoder-layer linear FLOPs (every prompt and output token once)
    # at the best measured rate: a floor under the breakdown's "linear" part.
    tokens = sum(len(p) + m for p, m in workload)
    flops = tokens * layers * sum(2 * k * o for k, o in shapes)
    best_rate = max(s["gflop_s"] for s in rates.values()) * 1e9
    result["matmul"] = dict(
        threads=args.threads[0],
        dtype=args.dtype,
        loadavg_1m=os.getloadavg()[0],
        by_rows=rates,
        run_linear_floor_s=flops / best_rate,
    )

    # Where the tokens differ, how close the call was (float32 transformers as the judge).
    ref = hf
    if dtype != torch.float32:
        ref = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    result["first_differences"] = {
        bs: first_differences(ref, hf, workload, mini_tokens, tokens)
        for bs, tokens in hf_tokens.items()
    }
    # How far each side's greedy tokens are from float32's (transformers', batch ``best``).
    fp32 = hf_tokens[best] if ref is hf else run_hf(ref, workload, best, pad_id)["tokens"]
    result["identical_to_fp32"] = {
        name: f"{sum(a == b for a, b in zip(toks, fp32, strict=True))}/{len(workload)}"
        for name, toks in (("mini", mini_tokens), (f"hf_batch_{best}", hf_tokens[best]))
    }
    del ref
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result), flush=True)

    # The other thread counts (the result is written after each).
    for t in args.threads[1:]:
        torch.set_num_threads(t)
        result["by_threads"][t] = alternate(
            llm, timer, hf, workload, best, pad_id, args.other_repeats
        )
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(table(result), flush=True)
    torch.set_num_threads(threads0)
    return 0


def table(r) -> str:
    lines = [
        f"{r['workload']}; {r['model']}; attention backend {r['attention_backend']}",
        f"Shape: {r['shape']}.",
        "",
        "| transformers static batch | useful tok/s | per CPU s | identical tokens "
        "| largest fp32 gap at a first difference (gaps below the dtype's error) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for bs, s in r["hf_sweep"].items():
        d = r.get("first_differences", {}).get(bs, {})
        gap = "-"
        if d.get("max_fp32_gap_nats") is not None:
            below = f"{d.get('gap_below_dtype_error', '?')}/{d['differing']}"
            gap = f"{d['max_fp32_gap_nats']:.3f} nats ({below})"
        cpu = f"{s['cpu_tok_s']:.1f}" if "cpu_tok_s" in s else "-"
        lines.append(f"| {bs} | {s['tok_s']:.1f} | {cpu} | {s['identical_to_mini']} | {gap} |")
    lines += [
        "",
        f"| threads | mini_vllm tok/s | HF (batch {r['hf_best_batch']}) tok/s | mini/HF "
        "| per CPU s: mini | HF | mini/HF | mini ms/step | load avg |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t, s in r["by_threads"].items():
        cpu = (
            f"{s['mini_cpu_tok_s']:.1f} | {s['hf_cpu_tok_s']:.1f} | {s['cpu_ratio']:.2f}x"
            if "cpu_ratio" in s
            else "- | - | -"
        )
        lines.append(
            f"| {t} | {s['mini_tok_s']:.1f} | {s['hf_tok_s']:.1f} | {s['ratio']:.2f}x "
            f"| {cpu} | {s['mini_step_ms']:.0f} | {s['loadavg_1m']:.1f} |"
        )
    total = sum(r["breakdown_s"].values())
    lines += [
        "",
        f"| part (one mini_vllm run, load avg {r['breakdown_loadavg_1m']:.1f}) | s | share |",
        "|---|---:|---:|",
    ]
    for part, s in r["breakdown_s"].items():
        lines.append(f"| {part} | {s:.2f} | {100 * s / total:.0f}% |")
    if "identical_to_fp32" in r:
        same = ", ".join(f"{k} {v}" for k, v in r["identical_to_fp32"].items())
        lines.append(f"\nGreedy tokens identical to float32 transformers': {same}.")
    lines.append(
        f"\nThe run's decoder linears at the best measured matmul rate: "
        f"{r['matmul']['run_linear_floor_s']:.2f} s (logits excluded)."
    )
    lines += [
        "",
        f"| matmul rows ({r['matmul']['threads']} thread(s), load avg "
        f"{r['matmul']['loadavg_1m']:.1f}) | {DTYPE_TAG[r.get('dtype', 'float32')]} GFLOP/s "
        "| the decoder's linears at that rate |",
        "|---:|---:|---:|",
    ]
    for m, s in r["matmul"]["by_rows"].items():
        lines.append(f"| {m} | {s['gflop_s']:.1f} | {s['linear_floor_ms']:.1f} ms |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
