"""The machine's limit for the continuous-batching workload, and how close the engine gets.

``python -m mini_vllm.benchmarks.roofline [--requests N] [--repeats N]``
``[--hf-batches B ...] [--model PATH] [--out DIR] [--note TEXT]``
``[--compare-plain-gemm] [--compile [--compile-backend inductor|eager]]``

One run, in four parts:

1. The machine: the matmul peak (a square ``--matrix`` x ``--matrix`` matmul,
   float32 and bfloat16, 1 and 2 threads; best of a few; the faster of
   ``torch.mm`` and oneDNN over a packed weight) and the memory
   bandwidth (a ``--mib`` MiB tensor copied, bytes read + written per second,
   and summed, bytes read per second; 1 and 2 threads; best of a few).
2. The engine: continuous_batching.py's workload (its ``NUM_REQUESTS``,
   lengths, seed and engine settings; SmolLM2-135M in float32), on 1 thread:
   a warm-up, then ``--repeats`` timed ``LLM.generate`` runs (median wall
   time; with ``--compare-plain-gemm`` as many runs of the same engine with
   its linear layers on ``F.linear``, alternating, the greedy tokens of every
   run checked equal); the engine's first run records, for every step the engine ran, its scheduled
   tokens and context lengths (``ExecutionContext.from_scheduler_output``,
   mini_vllm/metrics/perf.py). With ``--compile``, a second engine on the
   same weights compiled (``compilation_config`` mode VLLM_COMPILE, which a
   CPU runs as one Dynamo trace with inductor; ``--compile-backend eager``
   traces without inductor): its first run, which compiles, is timed apart
   and left out; then ``--repeats`` timed runs, their greedy tokens compared
   with eager's. Then one more eager run under ``step_breakdown``
   (linear / attention / sampling / input preparation / scheduling / other).
   Right after the eager runs, the linear layers alone (``linears_alone``):
   the model's own linear layers and logits, in model order, on inputs of
   every recorded step's rows, nothing else between them, both ways (oneDNN
   over the packed weights, ``F.linear``), ``--linear-passes`` passes
   alternating, each step's fastest kept: what these GEMM kernels need at
   the workload's shapes whatever the rest of the engine does.
3. transformers' static batches: continuous_batching.py's sweep
   (``hf_sweep``) over ``--hf-batches``; the best by tokens per CPU second is
   the baseline.
4. The roofline: for every recorded step, each of its operations (``OPS``:
   the QKV, output, gate/up and down projections, attention, SiLU-and-mul,
   the logits) takes its FLOPs at the peak rate or its bytes (read + written)
   at the bandwidth, whichever is slower (``roofline_seconds``); the steps'
   sum is the roofline time, at the 1-thread float32 peak and the better
   1-thread bandwidth (both by CPU time: on a machine other jobs share, the
   wall time of a 1-thread measurement includes its waits for a core).
   Reported: the engine's median time against it (% of roofline = roofline /
   engine; also by CPU time, ``time.process_time``, the time a 1-thread run
   held a core, the steadier one where other jobs share the machine), the
   engine against transformers' best batch
   (useful tokens per second), and the padding cap: the tokens the static
   batches feed through the model over those the engine feeds (its steps'
   scheduled tokens), what removing padding alone can give.

FLOPs and bytes follow upstream's MFU model (vllm/v1/metrics/perf.py; see
mini_vllm/metrics/perf.py), which counts matmuls and attention and leaves
out norms, rotary embedding and residual adds: those, sampling and all host
work are time the roofline does not allow. The roofline is an upper bound
on speed for these kernels' work, not for any algorithm: attention is counted
over the full query x context rectangle, as upstream counts it.

Writes ``OUT/roofline_cpu.json`` with the conditions (threads, load,
dtype); prints markdown tables. mini_vllm's own benchmark; no upstream twin.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")  # before torch imports tqdm: no GGUF load bars
import torch  # noqa: E402

from mini_vllm.benchmarks import continuous_batching as cb  # noqa: E402
from mini_vllm.benchmarks.step_breakdown import step_breakdown  # noqa: E402
from mini_vllm.benchmarks.throughput import DEFAULT_OUT, make_workload  # noqa: E402
from mini_vllm.metrics.perf import ExecutionContext, ModelMetrics  # noqa: E402
from mini_vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # noqa: E402

med = statistics.median

# A step's operations: (FLOP keys, share of them, read-byte keys, write-byte keys),
# keys from ModelMetrics' breakdowns. The FFN's FLOPs are one upstream key for three
# matmuls of equal size: gate and up (2/3 of them), down (1/3).
OPS = {
    "qkv_proj": (["attn.qkv_proj"], 1, ["attn.qkv_input", "attn.qkv_weight"], ["attn.qkv_output"]),
    "attention": (
        ["attn.attn_qk", "attn.attn_av"],
        1,
        ["attn.attn_input"],
        ["attn.kv_cache"],
    ),
    "out_proj": (["attn.out_proj"], 1, ["attn.out_input", "attn.out_weight"], ["attn.out_output"]),
    "gate_up_proj": (
        ["ffn.dense_ffn"],
        2 / 3,
        ["ffn.dense_up_gate_input", "ffn.dense_up_gate_weights"],
        ["ffn.dense_up_gate_output"],
    ),
    "silu_and_mul": ([], 0, ["ffn.dense_silu_input"], ["ffn.dense_silu_output"]),
    "down_proj": (
        ["ffn.dense_ffn"],
        1 / 3,
        ["ffn.dense_down_input", "ffn.dense_down_weights"],
        ["ffn.dense_down_output"],
    ),
    "logits": (["unembed.unembed"], 1, ["unembed.input", "unembed.weight"], ["unembed.output"]),
}


def op_costs(metrics: ModelMetrics, ctx: ExecutionContext) -> dict[str, tuple[float, int]]:
    """(FLOPs, bytes read + written) of each of ``OPS`` in one step."""
    flops = metrics.get_num_flops_breakdown(ctx)
    read = metrics.get_read_bytes_breakdown(ctx)
    write = metrics.get_write_bytes_breakdown(ctx)
    return {
        op: (
            share * sum(flops.get(k, 0) for k in f_keys),
            sum(read.get(k, 0) for k in r_keys) + sum(write.get(k, 0) for k in w_keys),
        )
        for op, (f_keys, share, r_keys, w_keys) in OPS.items()
    }


def roofline_seconds(costs: dict[str, tuple[float, int]], peak: float, bandwidth: float):
    """Each operation's time at the roofline: its FLOPs at ``peak`` (FLOP/s) or its
    bytes at ``bandwidth`` (bytes/s), whichever takes longer."""
    return {op: max(f / peak, b / bandwidth) for op, (f, b) in costs.items()}


def _best_of(fn, iters: int) -> tuple[float, float]:
    """The shortest (wall, CPU) seconds of ``iters`` calls of ``fn``, after a warm-up."""
    fn()
    wall, cpu = [], []
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return min(wall), max(min(cpu), 1e-9)


def matmul_peak(dtype: torch.dtype, n: int, iters: int = 5) -> dict[str, tuple[float, float]]:
    """FLOP/s of an ``n x n @ n x n`` matmul in ``dtype``, by wall time and by CPU time,
    two ways: ``torch.mm``, and oneDNN over a packed weight (the engine's CPU linear,
    mini_vllm/model_executor/layers/utils.py), which is often the faster."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    flops = 2 * n**3
    out = {"mm": _best_of(lambda: torch.mm(a, b), iters)}
    layer = torch.nn.Linear(n, n, bias=False, dtype=dtype)
    dispatch_cpu_unquantized_gemm(layer)
    if layer.cpu_linear is not torch.nn.functional.linear:
        out["onednn"] = _best_of(lambda: layer.cpu_linear(a, layer.weight, None), iters)
    return {k: (flops / wall, flops / cpu) for k, (wall, cpu) in out.items()}


def bandwidth(mib: int, iters: int = 5) -> dict[str, tuple[float, float]]:
    """Bytes/s of a float32 copy (read + written) and of a sum (read) over ``mib`` MiB:
    by wall time, by CPU time."""
    x = torch.ones(mib * 2**20 // 4)
    y = torch.empty_like(x)
    copy = _best_of(lambda: y.copy_(x), iters)
    read = _best_of(lambda: x.sum(), iters)
    return dict(
        copy=(2 * x.nbytes / copy[0], 2 * x.nbytes / copy[1]),
        read=(x.nbytes / read[0], x.nbytes / read[1]),
    )


def measure_machine(matrix: int, mib: int, threads=(1, 2)) -> dict:
    """Per thread count: the matmul peaks (the better of the two ways) and bandwidths by
    wall time; at 1 thread by CPU time too (the rate while the thread held a core, which
    a busy machine's wall time understates)."""
    before = torch.get_num_threads()
    out = {}
    for t in threads:
        torch.set_num_threads(t)
        mm = {name: matmul_peak(getattr(torch, name), matrix) for name in ("float32", "bfloat16")}
        bw = bandwidth(mib)
        out[t] = dict(
            matmul_gflop_s={k: max(w for w, _ in v.values()) / 1e9 for k, v in mm.items()},
            matmul_gflop_s_by_way={
                k: {way: w / 1e9 for way, (w, _) in v.items()} for k, v in mm.items()
            },
            bandwidth_gb_s={k: v[0] / 1e9 for k, v in bw.items()},
            loadavg_1m=os.getloadavg()[0],
        )
        if t == 1:
            out[t]["matmul_gflop_s_by_cpu"] = {
                k: max(c for _, c in v.values()) / 1e9 for k, v in mm.items()
            }
            out[t]["bandwidth_gb_s_by_cpu"] = {k: v[1] / 1e9 for k, v in bw.items()}
    torch.set_num_threads(before)
    return out


def linears_alone(dispatched: dict, steps: list[ExecutionContext], passes: int) -> dict:
    """CPU seconds of the model's linear layers alone over every step in ``steps``:
    ``dispatched`` maps each layer to its dispatched ``cpu_linear`` (the logits'
    embedding table among them, fed the step's logits rows, the others its tokens),
    called in model order on preallocated random inputs, one step at a time. Each
    way (``onednn``: the dispatched matmul; ``plain``: ``F.linear``) runs ``passes``
    times, the two alternating, and keeps each step's fastest; ``better_per_step``
    sums the faster of the two at each step."""
    from mini_vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    rows = max(max(ctx.total_num_tokens(), ctx.num_logits_tokens()) for ctx in steps)
    inputs = {k: torch.randn(rows, k) for k in {m.weight.shape[1] for m in dispatched}}
    best = {way: [float("inf")] * len(steps) for way in ("onednn", "plain")}
    with torch.inference_mode():
        for p in range(passes):
            for way in ("onednn", "plain") if p % 2 == 0 else ("plain", "onednn"):
                for i, ctx in enumerate(steps):
                    c0 = time.process_time()
                    for module, linear in dispatched.items():
                        if way == "plain":
                            linear = torch.nn.functional.linear
                        logits = isinstance(module, VocabParallelEmbedding)
                        n = ctx.num_logits_tokens() if logits else ctx.total_num_tokens()
                        x = inputs[module.weight.shape[1]][:n]  # [n, in_features]
                        linear(x, module.weight, getattr(module, "bias", None))
                    best[way][i] = min(best[way][i], time.process_time() - c0)
    return dict(
        passes=passes,
        onednn_cpu_s=sum(best["onednn"]),
        plain_cpu_s=sum(best["plain"]),
        better_per_step_cpu_s=sum(map(min, best["onednn"], best["plain"])),
        loadavg_1m=os.getloadavg()[0],
    )


class StepRecorder:
    """Keeps each step's ``ExecutionContext`` while ``recording``: the runner's
    ``execute_model`` is shadowed on the instance (mini_vllm's code is unchanged)."""

    def __init__(self, llm) -> None:
        runner = llm.llm_engine.engine_core.model_runner
        self.steps: list[ExecutionContext] = []
        self.recording = False
        execute = runner.execute_model

        def recorded(scheduler_output, *args):
            if self.recording and scheduler_output.total_num_scheduled_tokens:
                self.steps.append(ExecutionContext.from_scheduler_output(scheduler_output))
            return execute(scheduler_output, *args)

        runner.execute_model = recorded


def static_tokens(workload, batch: int) -> int:
    """Tokens transformers feeds through the model in left-padded static batches: every
    row gets the batch's longest prompt, then one token per step to its longest output
    (the last output token is never fed back)."""
    total = 0
    for b in range(0, len(workload), batch):
        rows = workload[b : b + batch]
        total += len(rows) * (max(len(p) for p, _ in rows) + max(n for _, n in rows) - 1)
    return total


def run_engine(llm, workload) -> dict:
    from mini_vllm.sampling_params import SamplingParams

    llm.llm_engine.engine_core.scheduler.reset_prefix_cache()
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for _, n in workload]
    load, t0, cpu0 = os.getloadavg()[0], time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return dict(wall_s=wall, cpu_s=cpu, loadavg_1m=load, tokens=tokens)


def make_llm(path: Path, n: int, dtype: torch.dtype, compilation_config=None):
    """mini_vllm's LLM with continuous_batching.py's engine settings."""
    from mini_vllm.entrypoints.llm import LLM

    return LLM(
        str(path),
        max_model_len=512,
        max_num_seqs=n,
        max_num_batched_tokens=2048,
        device="cpu",
        dtype=str(dtype).removeprefix("torch."),
        compilation_config=compilation_config,
    )


def compiled_runs(path: Path, n: int, dtype, workload, tokens, repeats: int, backend: str):
    """The engine compiled: its first run (the trace and compile, on a tiny batch) timed
    apart, then ``repeats`` timed runs of ``workload``; each run's greedy tokens are
    compared with ``tokens`` (eager's), row by row."""
    from mini_vllm.config import CompilationMode

    mode = CompilationMode.VLLM_COMPILE
    if backend == "eager":  # a Dynamo trace without inductor
        mode = CompilationMode.DYNAMO_TRACE_ONCE
    llm = make_llm(path, n, dtype, {"mode": mode, "backend": backend})
    first = run_engine(llm, [(p, 2) for p, _ in workload[:2]])  # compiles
    runs = []
    for r in range(repeats):
        runs.append(run_engine(llm, workload))
        same = sum(a == b for a, b in zip(runs[-1].pop("tokens"), tokens, strict=True))
        runs[-1]["identical_to_eager"] = f"{same}/{len(tokens)}"
        print(f"  compiled run {r + 1}: {runs[-1]['wall_s']:.2f} s", file=sys.stderr)
    return dict(
        mode=llm.llm_engine.vllm_config.compilation_config.mode.name,
        backend=backend,
        compile_run_wall_s=first["wall_s"],
        compile_run_cpu_s=first["cpu_s"],
        runs=runs,
        cpu_s=med(r["cpu_s"] for r in runs),
        wall_s=med(r["wall_s"] for r in runs),
    )


def load_models(model: str | None, n: int, dtype: torch.dtype):
    """(mini_vllm's LLM, transformers' model) on the same weights; SmolLM2's GGUF by default."""
    from transformers import AutoModelForCausalLM

    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    path = Path(model) if model else smollm2_gguf_path()
    llm = make_llm(path, n, dtype)
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return llm, hf.eval()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm.benchmarks.roofline")
    parser.add_argument("--requests", type=int, default=cb.NUM_REQUESTS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-batches", type=int, nargs="+", default=list(cb.HF_BATCHES["float32"]))
    parser.add_argument("--model", help="a checkpoint folder or GGUF file (default: SmolLM2)")
    parser.add_argument("--matrix", type=int, default=2048, help="the peak's square matmul size")
    parser.add_argument("--mib", type=int, default=512, help="the bandwidth's tensor size")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--compare-plain-gemm",
        action="store_true",
        help="also time the engine with its linears on F.linear (before the oneDNN dispatch)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time the engine compiled (torch.compile; its compile run left out)",
    )
    parser.add_argument("--compile-backend", choices=("inductor", "eager"), default="inductor")
    parser.add_argument(
        "--linear-passes", type=int, default=3, help="passes of the linear layers alone, per way"
    )
    parser.add_argument("--note", help="a remark stored in the results file")
    args = parser.parse_args(argv)
    if args.linear_passes < 1:
        parser.error(f"--linear-passes must be at least 1, got {args.linear_passes}")
    import transformers

    from mini_vllm.sampling_params import SamplingParams

    transformers.utils.logging.set_verbosity_error()
    dtype, threads0 = torch.float32, torch.get_num_threads()

    machine = measure_machine(args.matrix, args.mib)
    # 1 thread, by CPU time: the machine's rate whenever the thread runs.
    peak = machine[1]["matmul_gflop_s_by_cpu"]["float32"] * 1e9
    bw = max(machine[1]["bandwidth_gb_s_by_cpu"].values()) * 1e9
    print(f"machine: {json.dumps(machine)}", file=sys.stderr)

    llm, hf = load_models(args.model, args.requests, dtype)
    cfg = llm.llm_engine.hf_config
    workload = make_workload(args.requests, cb.PROMPT_LENS, cb.OUTPUT_LENS, cfg.vocab_size)
    recorder = StepRecorder(llm)
    torch.set_num_threads(1)
    run_engine(llm, [(p, 2) for p, _ in workload[:2]])  # warm-up
    # The engine as it is, and with --compare-plain-gemm the same engine with every linear
    # layer back on F.linear (the oneDNN dispatch undone), alternating run by run.
    model = llm.llm_engine.engine_core.model_runner.model
    dispatched = {m: m.cpu_linear for m in model.modules() if "cpu_linear" in m.__dict__}
    names = ["engine", "plain_gemm"] if args.compare_plain_gemm else ["engine"]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            for module, linear in dispatched.items():
                module.cpu_linear = torch.nn.functional.linear if name != "engine" else linear
            recorder.recording = name == "engine" and not runs["engine"]
            runs[name].append(run_engine(llm, workload))
            recorder.recording = False
            print(f"  {name} run {r + 1}: {runs[name][-1]['wall_s']:.2f} s", file=sys.stderr)
    for module, linear in dispatched.items():
        module.cpu_linear = linear
    alone = linears_alone(dispatched, recorder.steps, args.linear_passes)
    # The same 1-thread rates again: a machine whose speed moved while the engine ran
    # (a shared host) shows it here, and its percentages then compare unlike times.
    machine_after = measure_machine(args.matrix, args.mib, threads=(1,))[1]
    mini_tokens = runs["engine"][0]["tokens"]
    for run in (run for rs in runs.values() for run in rs):
        assert run.pop("tokens") == mini_tokens, "the engine's greedy tokens changed between runs"
    if args.compile:
        from mini_vllm.model_executor.model_loader import smollm2_gguf_path

        path = Path(args.model) if args.model else smollm2_gguf_path()
        compiled = compiled_runs(
            path, args.requests, dtype, workload, mini_tokens, args.repeats, args.compile_backend
        )
    llm.llm_engine.engine_core.scheduler.reset_prefix_cache()
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for _, n in workload]
    breakdown = step_breakdown(llm, prompts, params)
    breakdown_load = os.getloadavg()[0]

    pad_id = hf.generation_config.pad_token_id or 0
    sweep, _ = cb.hf_sweep(hf, workload, pad_id, mini_tokens, args.hf_batches)
    best = max(sweep, key=lambda bs: sweep[bs]["cpu_tok_s"])
    torch.set_num_threads(threads0)

    # The roofline of every step the engine ran.
    metrics = ModelMetrics(cfg, dtype)
    by_op = dict.fromkeys(OPS, 0.0)
    flops = bytes_ = 0.0
    for ctx in recorder.steps:
        costs = op_costs(metrics, ctx)
        for op, s in roofline_seconds(costs, peak, bw).items():
            by_op[op] += s
        flops += sum(f for f, _ in costs.values())
        bytes_ += sum(b for _, b in costs.values())
    roofline_s = sum(by_op.values())
    engine_s = med(r["wall_s"] for r in runs["engine"])
    useful = sum(n for _, n in workload)
    engine_tokens = sum(ctx.total_num_tokens() for ctx in recorder.steps)
    result = dict(
        model=f"{args.model or 'SmolLM2-135M (GGUF Q4_1 -> fp32)'}",
        dtype="float32",
        threads=1,
        workload=f"{args.requests} req, prompt {cb.PROMPT_LENS[0]}-{cb.PROMPT_LENS[1]}, "
        f"output {cb.OUTPUT_LENS[0]}-{cb.OUTPUT_LENS[1]}, seed 0 (continuous_batching.py)",
        useful_output_tokens=useful,
        cpu_count=os.cpu_count(),
        torch=torch.__version__,
        machine=machine,
        machine_after_engine_runs=machine_after,
        # After over before, 1 thread by CPU time: 1.0 when the machine held its speed.
        drift=dict(
            matmul=machine_after["matmul_gflop_s_by_cpu"]["float32"] * 1e9 / peak,
            bandwidth=max(machine_after["bandwidth_gb_s_by_cpu"].values()) * 1e9 / bw,
        ),
        peak_gflop_s=peak / 1e9,
        bandwidth_gb_s=bw / 1e9,
        steps=len(recorder.steps),
        step_tokens=[ctx.total_num_tokens() for ctx in recorder.steps],
        model_flops=flops,
        model_bytes=bytes_,
        roofline_s=roofline_s,
        roofline_by_op_s=by_op,
        step_contexts=[asdict(ctx) for ctx in recorder.steps],
        engine_runs=runs["engine"],
        engine_s=engine_s,
        percent_of_roofline=100 * roofline_s / engine_s,
        # At 1 thread, the time the run held a core: the steadier figure on a shared machine.
        engine_cpu_s=med(r["cpu_s"] for r in runs["engine"]),
        percent_of_roofline_cpu=100 * roofline_s / med(r["cpu_s"] for r in runs["engine"]),
        breakdown_s=breakdown,
        breakdown_loadavg_1m=breakdown_load,
        linears_alone=alone,
        hf_sweep={bs: {k: v for k, v in r.items() if k != "run"} for bs, r in sweep.items()},
        hf_best_batch=best,
        mini_tok_s=useful / engine_s,
        hf_tok_s=sweep[best]["tok_s"],
        ratio_to_hf=useful / engine_s / sweep[best]["tok_s"],
        # Per CPU second (1 thread: the time each run held a core), as continuous_batching.py.
        mini_cpu_tok_s=useful / med(r["cpu_s"] for r in runs["engine"]),
        hf_cpu_tok_s=sweep[best]["cpu_tok_s"],
        ratio_to_hf_cpu=useful / med(r["cpu_s"] for r in runs["engine"]) / sweep[best]["cpu_tok_s"],
        engine_tokens=engine_tokens,
        static_tokens=static_tokens(workload, best),
        padding_cap=static_tokens(workload, best) / engine_tokens,
    )
    if args.compare_plain_gemm:
        plain = runs["plain_gemm"]
        result.update(
            plain_gemm_runs=plain,
            plain_gemm_s=med(r["wall_s"] for r in plain),
            plain_gemm_cpu_s=med(r["cpu_s"] for r in plain),
            plain_gemm_percent_of_roofline_cpu=100 * roofline_s / med(r["cpu_s"] for r in plain),
        )
    if args.compile:
        compiled["percent_of_roofline_cpu"] = 100 * roofline_s / compiled["cpu_s"]
        result["compiled"] = compiled
    if args.note:
        result["note"] = args.note
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "roofline_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(result), flush=True)
    return result


def table(r: dict) -> str:
    m1, m2 = r["machine"][1], r["machine"][2]
    lines = [
        f"{r['workload']}; {r['model']}; 1 thread",
        "",
        "| threads | fp32 GFLOP/s | bf16 GFLOP/s | copy GB/s | read GB/s | load avg |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    by_cpu = dict(
        matmul_gflop_s=m1["matmul_gflop_s_by_cpu"],
        bandwidth_gb_s=m1["bandwidth_gb_s_by_cpu"],
        loadavg_1m=m1["loadavg_1m"],
    )
    for t, m in ((1, m1), ("1, by CPU time", by_cpu), (2, m2)):
        mm, bw = m["matmul_gflop_s"], m["bandwidth_gb_s"]
        lines.append(
            f"| {t} | {mm['float32']:.1f} | {mm['bfloat16']:.1f} | {bw['copy']:.1f} "
            f"| {bw['read']:.1f} | {m['loadavg_1m']:.1f} |"
        )
    lines += [
        "",
        f"Roofline ({r['steps']} steps, {r['model_flops'] / 1e12:.3f} TFLOP, "
        f"{r['model_bytes'] / 1e9:.2f} GB at {r['peak_gflop_s']:.1f} GFLOP/s and "
        f"{r['bandwidth_gb_s']:.1f} GB/s): {r['roofline_s']:.2f} s; the engine "
        f"(median of {len(r['engine_runs'])}): {r['engine_s']:.2f} s, "
        f"**{r['percent_of_roofline']:.0f}% of the roofline** "
        f"({r['percent_of_roofline_cpu']:.0f}% by CPU time, {r['engine_cpu_s']:.2f} s).",
        f"Measured again after the engine's runs, the 1-thread fp32 peak was "
        f"{r['drift']['matmul']:.2f}x and the bandwidth {r['drift']['bandwidth']:.2f}x "
        f"the rates the roofline uses"
        + (
            " (1.00x is a steady machine)."
            if all(0.9 <= d <= 1.1 for d in r["drift"].values())
            else ": the machine's speed moved during the run, so these percentages "
            "compare times taken at different speeds."
        ),
        f"Engine against transformers' best static batch ({r['hf_best_batch']}): "
        f"{r['mini_tok_s']:.1f} against {r['hf_tok_s']:.1f} useful tok/s, "
        f"{r['ratio_to_hf']:.2f}x (per CPU second {r['mini_cpu_tok_s']:.1f} against "
        f"{r['hf_cpu_tok_s']:.1f}, {r['ratio_to_hf_cpu']:.2f}x); "
        f"padding cap {r['static_tokens']} / {r['engine_tokens']} tokens "
        f"= {r['padding_cap']:.2f}x.",
    ]
    if "plain_gemm_cpu_s" in r:
        lines.append(
            f"Before the oneDNN dispatch (linears on F.linear, same run, alternating): "
            f"{r['plain_gemm_s']:.2f} s, {r['plain_gemm_cpu_s']:.2f} CPU s, "
            f"{r['plain_gemm_percent_of_roofline_cpu']:.0f}% of the roofline by CPU time."
        )
    if "compiled" in r:
        c = r["compiled"]
        lines.append(
            f"Compiled ({c['mode']}, {c['backend']}; its compile run, "
            f"{c['compile_run_wall_s']:.0f} s wall, left out): {c['wall_s']:.2f} s, "
            f"{c['cpu_s']:.2f} CPU s, {c['percent_of_roofline_cpu']:.0f}% of the roofline by CPU "
            "time; greedy tokens identical to eager's: "
            f"{', '.join(run['identical_to_eager'] for run in c['runs'])}."
        )
    a = r["linears_alone"]
    ops = r["roofline_by_op_s"]
    linear = sum(s for op, s in ops.items() if op not in ("attention", "silu_and_mul"))
    lines.append(
        f"The linear layers alone (the model's weights at every step's rows, fastest of "
        f"{a['passes']} passes, CPU s): oneDNN {a['onednn_cpu_s']:.2f}, F.linear "
        f"{a['plain_cpu_s']:.2f}, the faster per step {a['better_per_step_cpu_s']:.2f}; "
        f"their roofline {linear:.2f}; at 75% of the roofline the whole run has "
        f"{r['roofline_s'] / 0.75:.2f} s."
    )
    lines += [
        "",
        f"| part | breakdown s (wall, load {r['breakdown_loadavg_1m']:.1f}) | share "
        "| share x engine CPU s | roofline s |",
        "|---|---:|---:|---:|---:|",
    ]
    roof = {"linear": linear, "attention": ops["attention"], "other": ops["silu_and_mul"]}
    total = sum(r["breakdown_s"].values())
    for part, s in r["breakdown_s"].items():
        share = s / total
        lines.append(
            f"| {part} | {s:.2f} | {100 * share:.0f}% | {share * r['engine_cpu_s']:.2f} "
            f"| {roof.get(part, 0.0):.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
    sys.exit(0)
