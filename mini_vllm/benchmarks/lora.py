"""What multi-LoRA batching buys: a mixed batch's step time against the base
model alone and against one batch per adapter, in one run.

    python -m mini_vllm.benchmarks.lora [--ranks 8 16 64] [--counts 1 2 4]
                                        [--rows 10] [--prompt-len 32] [--tokens 16]
                                        [--repeats 3] [--threads N] [--model PATH]
                                        [--out DIR]

A course module (Phase 11); no upstream counterpart. On SmolLM2 (float32, the
shipped GGUF; ``--model`` for another Llama) it builds one engine without
LoRA (the base) and, for each rank R of ``--ranks``, one engine with
``enable_lora=True, max_loras=4, max_lora_rank=R``. Its adapters are seeded
PEFT folders of rank R (``lora_alpha`` 2R) on all seven projections
(q/k/v/o, gate/up/down), written from the engine's own LoRA layers' shapes
(``write_seeded_adapter``): the values do not change the time, the rank and
the layers they touch do. For each adapter count n of ``--counts``, the
``--rows`` requests (seeded random prompts of ``--prompt-len`` tokens,
``--tokens`` greedy tokens each, EOS ignored) cycle over n adapters and the
base model (A, B, none, A, B, none, ... for n = 2), and three ways to serve
them are timed:

- ``base``: the same rows on the engine without LoRA (the floor);
- ``mixed``: all rows in one batch, each row with its adapter (what vLLM
  does: one forward, shrink/expand picks each row's slot);
- ``separate``: one batch per adapter (and one for the base rows), one after
  another, on the same engine: what serving without multi-LoRA batching
  costs. Its step time is the sum of the batches' decode-step medians (the
  time to give every row one token).

The runner's ``execute_model`` is timed per step, by the wall clock and by
the process's CPU time (with one thread, less sensitive to other jobs on
the machine); decode steps are those that compute one token per request of
the batch. Reported: decode-step medians over ``--repeats`` rounds (each
round runs every case once, in the same order), the prefill step (all
prompts in one step) of every one-batch case, and CPU-time ratios against
the base. Also ``no adapter``: the
LoRA engine with every row on the base model (the ops are skipped then).
Each row's greedy tokens are kept: in ``mixed`` and ``separate`` a row must
get the same tokens (the same work, batched differently). The conditions go
with the numbers: thread count, 1-minute load average per round, torch's
version. Writes ``OUT/lora_cpu.json`` (``cuda`` on a GPU; ``OUT`` defaults
to this folder's ``results/``) and prints a table. Run it quiet.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")  # before torch imports tqdm: no GGUF load bars

import torch

from mini_vllm.entrypoints.llm import LLM
from mini_vllm.lora.model_manager import PACKED_MODULES_MAPPING
from mini_vllm.lora.request import LoRARequest
from mini_vllm.model_executor.model_loader import smollm2_gguf_path
from mini_vllm.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results"
MAX_LORAS = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_seeded_adapter(folder: Path, llm: LLM, rank: int, seed: int) -> str:
    """A PEFT folder (adapter_config.json + adapter_model.safetensors, keys
    ``base_model.model.<module>.lora_A/B.weight`` as peft writes them) of rank
    ``rank`` on every projection of ``llm``'s model, seeded; shapes read from
    the engine's LoRA layers (a fused qkv_proj gives q_proj, k_proj, v_proj)."""
    from safetensors.torch import save_file

    manager = llm.llm_engine.engine_core.model_runner.lora_manager
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, layer in manager.modules.items():
        parent, _, child = name.rpartition(".")
        parts = PACKED_MODULES_MAPPING.get(child, [child])
        for part, size in zip(parts, layer.output_slices, strict=True):
            key = f"base_model.model.{parent}.{part}.lora_"
            d_in = layer.base_layer.input_size
            tensors[key + "A.weight"] = torch.randn(rank, d_in, generator=g) * 0.05
            tensors[key + "B.weight"] = torch.randn(size, rank, generator=g) * 0.05
    folder.mkdir(parents=True)
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS, "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


def timed_run(llm: LLM, prompts: list[list[int]], loras: list, tokens: int) -> dict:
    """One generate of ``prompts`` (row i with ``loras[i]``): each runner
    step's scheduled tokens and seconds, and each row's greedy tokens."""
    runner = llm.llm_engine.engine_core.model_runner
    steps: list[tuple[int, float, float]] = []
    execute = runner.execute_model

    def timed(scheduler_output, *args):
        cpu, start = time.process_time(), time.perf_counter()
        out = execute(scheduler_output, *args)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        steps.append((scheduler_output.total_num_scheduled_tokens, wall, cpu))
        return out

    runner.execute_model = timed  # an instance attribute: removed below
    try:
        llm.llm_engine.engine_core.scheduler.reset_prefix_cache()
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
        )
    finally:
        del runner.execute_model
    rows, first = len(prompts), steps[0]
    return {
        "decode_s": [s for n, s, _ in steps if n == rows],
        "decode_cpu_s": [c for n, _, c in steps if n == rows],
        "prefill_s": first[1:] if first[0] == sum(map(len, prompts)) else None,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }


def cycle_rows(adapters: list, rows: int) -> list:
    """Row i's adapter: adapters first, then the base model (None), repeated."""
    kinds = [*adapters, None]
    return [kinds[i % len(kinds)] for i in range(rows)]


def groups_of(loras: list) -> list[list[int]]:
    """The row indices of each adapter (base rows last), in first-seen order."""
    order = sorted({id(x): x for x in loras}.values(), key=lambda x: x is None)
    return [[i for i, x in enumerate(loras) if x is y] for y in order]


def median_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    model = args.model or str(smollm2_gguf_path())
    common = dict(max_model_len=256, kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    base_llm = LLM(model, **common)
    vocab = base_llm.get_tokenizer().vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, vocab - 100, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.rows)
    ]
    folder = Path(tempfile.mkdtemp(prefix="mini_vllm_lora_bench_"))
    engines, adapters = {}, {}
    for rank in args.ranks:
        llm = LLM(model, enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=rank, **common)
        engines[rank] = llm
        adapters[rank] = [
            LoRARequest(
                f"r{rank}-{k}", k + 1, write_seeded_adapter(folder / f"r{rank}-{k}", llm, rank, k)
            )
            for k in range(max(args.counts))
        ]
    # cases: (name, engine, rows' adapters); "separate" is expanded per group
    cases = [("base", None, base_llm, [None] * args.rows)]
    for rank in args.ranks:
        cases.append(("no adapter", rank, engines[rank], [None] * args.rows))
        for n in args.counts:
            loras = cycle_rows(adapters[rank][:n], args.rows)
            cases.append((f"mixed {n}", rank, engines[rank], loras))
            cases.append((f"separate {n}", rank, engines[rank], loras))
    # Untimed warm-up, once per engine with the most adapters it serves: the
    # adapters are loaded and one-off costs paid before anything is timed.
    warm = {id(llm): (llm, loras) for _, _, llm, loras in cases if loras.count(None) < len(loras)}
    warm.setdefault(id(base_llm), (base_llm, [None] * args.rows))
    for llm, loras in warm.values():
        timed_run(llm, prompts, loras, 2)
    # per case, per clock ("wall", "cpu"): decode-step seconds and prefill-step seconds
    raw: dict[tuple, dict] = {}
    loads = []
    for _ in range(args.repeats):
        for name, rank, llm, loras in cases:
            rec = raw.setdefault((name, rank), {"wall": [], "cpu": [], "prefill": [], "groups": []})
            if name.startswith("separate"):
                tokens, per_group = [None] * args.rows, []
                for rows in groups_of(loras):
                    r = timed_run(
                        llm, [prompts[i] for i in rows], [loras[i] for i in rows], args.tokens
                    )
                    per_group.append((median_ms(r["decode_s"]), median_ms(r["decode_cpu_s"])))
                    for i, t in zip(rows, r["tokens"], strict=True):
                        tokens[i] = t
                rec["groups"].append(per_group)
                # one token for every row: one step of each batch, one after another
                rec["wall"].append(sum(w for w, _ in per_group) / 1000)
                rec["cpu"].append(sum(c for _, c in per_group) / 1000)
            else:
                r = timed_run(llm, prompts, loras, args.tokens)
                rec["wall"] += r["decode_s"]
                rec["cpu"] += r["decode_cpu_s"]
                if r["prefill_s"] is not None:
                    rec["prefill"].append(r["prefill_s"])
                tokens = r["tokens"]
            rec["tokens"] = tokens
            rec["rows"] = [None if x is None else x.lora_name for x in loras]
        loads.append(os.getloadavg()[0])
    base = raw[("base", None)]
    base_wall, base_cpu = median_ms(base["wall"]), median_ms(base["cpu"])
    base_prefill = [median_ms([p[k] for p in base["prefill"]]) for k in (0, 1)]
    out = []
    for (name, rank), rec in raw.items():
        row = {
            "case": name,
            "rank": rank,
            "adapters": int(name.split()[-1]) if name.split()[-1].isdigit() else 0,
            "decode_step_ms": median_ms(rec["wall"]),
            "decode_step_cpu_ms": median_ms(rec["cpu"]),
            "rows": rec["rows"],
            "tokens": rec["tokens"],
        }
        row["vs_base"] = row["decode_step_ms"] / base_wall
        row["cpu_vs_base"] = row["decode_step_cpu_ms"] / base_cpu
        if rec["prefill"]:
            row["prefill_step_ms"] = median_ms([p[0] for p in rec["prefill"]])
            row["prefill_step_cpu_ms"] = median_ms([p[1] for p in rec["prefill"]])
            row["prefill_cpu_vs_base"] = row["prefill_step_cpu_ms"] / base_prefill[1]
        if rec["groups"]:
            row["group_decode_ms"] = [
                [statistics.median(g[k] for g in col) for k in (0, 1)]
                for col in zip(*rec["groups"], strict=True)
            ]
        out.append(row)
    device = torch.device(base_llm.llm_engine.engine_core.model_runner.device).type
    return {
        "model": Path(model).name,
        "device": device,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "rows": args.rows,
        "prompt_len": args.prompt_len,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "max_loras": MAX_LORAS,
        "ranks": args.ranks,
        "counts": args.counts,
        "targets": TARGETS,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "loadavg_1m": loads,
        "cases": out,
    }


def table(result: dict) -> str:
    lines = [
        f"model {result['model']}; {result['rows']} rows x {result['prompt_len']}-token prompts, "
        f"{result['tokens']} greedy tokens; max_loras {result['max_loras']}; "
        f"{result['threads']} threads; load {min(result['loadavg_1m']):.1f}-"
        f"{max(result['loadavg_1m']):.1f}; medians of {result['repeats']} rounds",
        "",
        "| case | rank | adapters | decode step | cpu | cpu vs base | prefill step | cpu "
        "| cpu vs base |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["cases"]:
        prefill = "- | - | -"
        if "prefill_step_ms" in r:
            prefill = (
                f"{r['prefill_step_ms']:.0f} ms | {r['prefill_step_cpu_ms']:.0f} ms "
                f"| {r['prefill_cpu_vs_base']:.2f}x"
            )
        lines.append(
            f"| {r['case'].rstrip(' 0123456789')} | {r['rank'] or '-'} | {r['adapters']} "
            f"| {r['decode_step_ms']:.1f} ms | {r['decode_step_cpu_ms']:.1f} ms "
            f"| {r['cpu_vs_base']:.2f}x | {prefill} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2's GGUF")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rows", type=int, default=10)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=64 << 20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if max(args.counts) > MAX_LORAS:
        parser.error(f"--counts: at most max_loras={MAX_LORAS} adapters in one batch")
    result = run(args)
    print(table(result))
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"lora_{result['device']}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
