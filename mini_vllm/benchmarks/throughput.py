"""Output throughput of mini_vllm against transformers' ``generate``, and the demo's memory.

``python -m mini_vllm.benchmarks.throughput [--repeats N] [--out DIR]``
``[--attention-backend auto|cpu|torch] [--skip-rss]``

1. CPU: SmolLM2-135M, the shipped Q4_1 GGUF dequantized to float32 (same weights
   on both sides). 32 requests, prompts of seeded random token ids (not text),
   lengths uniform in 32-256; outputs uniform in 32-128, greedy, EOS ignored.
   mini_vllm: one ``LLM.generate`` over all 32 (max_num_seqs=32, 8192-token
   budget, the default attention backend (``cpu``; ``--attention-backend
   torch`` for the per-request reference), prefix cache reset before each run). transformers:
   one left-padded batch of all 32 (default sdpa attention, DynamicCache),
   greedy, EOS disabled, ``max_new_tokens`` = the longest requested output.
   "Useful" tok/s counts the tokens each request asked for; HF's "raw" counts
   every token it computed (every row runs to the longest output).
2. Peak RSS of ``python -m mini_vllm --no-progress`` as a child (``wait4``).
3. CUDA only: nano-vllm's shape, 256 requests, prompts and outputs uniform in
   100-1024, on a Qwen3-0.6B-shaped model (hidden 1024, 28 layers, 16/8 heads,
   head_dim 128, MLP 3072, vocab 151936, tied) with seeded random weights,
   bfloat16. mini_vllm: max_num_seqs=256, 8192-token budget, Triton attention,
   KV cache = the whole workload's need, capped at 40% of GPU memory.
   transformers: static left-padded batches of ``--gpu-hf-batch`` (64).
   Decode-only steps vs a floor: (weight bytes + KV bytes read) / bandwidth of
   a 1 GiB device-to-device copy in the same run ((read + written) bytes / s).

Only the ``generate`` calls are timed (after loading and a short warm-up).
Runs alternate (mini, HF, HF, mini, ...); medians over ``--repeats`` are
reported, and mini/HF of useful tok/s. "Outside forward" = 1 - runner
``forward_time`` (forward + logits + sampling) / summed ``engine.step`` wall
time, timed by shadowing ``engine.step`` on the instance (mini_vllm unchanged).
``cpu_s``: the process's CPU time over the same span (all its threads); with
one thread and other jobs on the machine, the time the run held a core.
Writes ``OUT/throughput_{cpu,cuda}.{json,png}``; prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")  # before torch imports tqdm: no GGUF load bars
import torch  # noqa: E402

DEFAULT_OUT = Path(__file__).parent / "results"
QWEN3_06B = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
med = statistics.median


def make_workload(n, prompt_lens, output_lens, vocab, seed=0):
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(vocab) for _ in range(rng.randint(*prompt_lens))],
            rng.randint(*output_lens),
        )
        for _ in range(n)
    ]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Records (step s, forward s, requests, KV tokens read if decode-only) per engine step."""

    def __init__(self, llm):
        engine = llm.llm_engine
        self.runner = runner = engine.engine_core.model_runner
        self.records, self._info = [], (0, None)
        step, execute = engine.step, runner.execute_model

        def timed_execute(so, *args):
            out = execute(so, *args)
            reqs = list(so.num_scheduled_tokens)
            decode = bool(reqs) and so.total_num_scheduled_tokens == len(reqs)
            kv = sum(runner.requests[r].num_computed_tokens for r in reqs) if decode else None
            self._info = (len(reqs), kv)
            return out

        def timed_step():
            fwd0, t0 = runner.forward_time, time.perf_counter()
            out = step()
            sync(runner.device)
            self.records.append((time.perf_counter() - t0, runner.forward_time - fwd0, *self._info))
            return out

        runner.execute_model, engine.step = timed_execute, timed_step


def run_mini(llm, timer, workload):
    from mini_vllm.sampling_params import SamplingParams

    llm.llm_engine.engine_core.scheduler.reset_prefix_cache()
    timer.records.clear()
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for _, n in workload]
    load, t0, cpu0 = os.getloadavg()[0], time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(timer.runner.device)
    wall, rec = time.perf_counter() - t0, timer.records
    cpu = time.process_time() - cpu0
    step_s, fwd_s = sum(r[0] for r in rec), sum(r[1] for r in rec)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return dict(
        wall_s=wall,
        tok_s=sum(map(len, tokens)) / wall,
        cpu_s=cpu,
        steps=len(rec),
        step_s=step_s,
        forward_s=fwd_s,
        outside_share=1 - fwd_s / step_s,
        loadavg_1m=load,
        tokens=tokens,
        decode=[(r[0], r[1], r[3]) for r in rec if r[3] is not None],
    )


@torch.inference_mode()
def run_hf(model, workload, batch_size, pad_id):
    dev, tokens, raw, passes = model.device, [], 0, 0
    load, t0, cpu0 = os.getloadavg()[0], time.perf_counter(), time.process_time()
    for b in range(0, len(workload), batch_size):
        batch = workload[b : b + batch_size]
        width, new = max(len(p) for p, _ in batch), max(n for _, n in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
        out = model.generate(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            do_sample=False,
            max_new_tokens=new,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
        gen = out[:, width:]
        assert gen.shape[1] == new, "transformers stopped early"
        raw, passes = raw + gen.numel(), passes + new
        tokens += [gen[i, :n].tolist() for i, (_, n) in enumerate(batch)]
    sync(dev)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return dict(
        wall_s=wall,
        tok_s=sum(n for _, n in workload) / wall,
        cpu_s=cpu,
        raw_tok_s=raw / wall,
        raw_tokens=raw,
        forward_passes=passes,
        loadavg_1m=load,
        tokens=tokens,
    )


def compare(llm, hf, workload, repeats, hf_batch, pad_id):
    """Alternating timed runs; returns (summary of medians, per-run numbers)."""
    timer = StepTimer(llm)
    warm = [(p, 4) for p, _ in workload[:2]]
    run_mini(llm, timer, warm)
    run_hf(hf, warm, hf_batch, pad_id)
    runs = {"mini": [], "hf": []}
    for r in range(repeats):
        for name in ["mini", "hf"] if r % 2 == 0 else ["hf", "mini"]:
            res = (
                run_mini(llm, timer, workload)
                if name == "mini"
                else run_hf(hf, workload, hf_batch, pad_id)
            )
            runs[name].append(res)
            print(
                f"  run {r + 1} {name}: {res['tok_s']:.1f} useful tok/s in {res['wall_s']:.1f}s"
                f" (load avg {res['loadavg_1m']:.1f})",
                file=sys.stderr,
            )
    m, h = runs["mini"], runs["hf"]
    same = sum(a == b for a, b in zip(m[-1]["tokens"], h[-1]["tokens"], strict=False))
    s = dict(
        num_requests=len(workload),
        prompt_tokens=sum(len(p) for p, _ in workload),
        useful_output_tokens=sum(n for _, n in workload),
        hf_batch_size=hf_batch,
        mini_tok_s=med(r["tok_s"] for r in m),
        hf_tok_s=med(r["tok_s"] for r in h),
        hf_raw_tok_s=med(r["raw_tok_s"] for r in h),
        hf_raw_tokens=h[0]["raw_tokens"],
        mini_steps=m[0]["steps"],
        hf_forward_passes=h[0]["forward_passes"],
        outside_share=med(r["outside_share"] for r in m),
        mini_step_ms=med(1e3 * r["step_s"] / r["steps"] for r in m),
        mini_forward_ms=med(1e3 * r["forward_s"] / r["steps"] for r in m),
        hf_pass_ms=med(1e3 * r["wall_s"] / r["forward_passes"] for r in h),
        outputs_identical_to_hf=f"{same}/{len(workload)}",
    )
    s["ratio"] = s["mini_tok_s"] / s["hf_tok_s"]
    for r in m + h:
        r.pop("tokens")
    return s, runs


def cpu_section(repeats, attention_backend="auto"):
    from transformers import AutoModelForCausalLM

    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    path = smollm2_gguf_path()
    llm = LLM(
        str(path),
        max_model_len=512,
        max_num_seqs=32,
        device="cpu",
        dtype="float32",
        attention_backend=attention_backend,
    )
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    workload = make_workload(32, (32, 256), (32, 128), llm.llm_engine.hf_config.vocab_size)
    s, runs = compare(llm, hf, workload, repeats, 32, hf.generation_config.pad_token_id or 0)
    s.update(
        model="SmolLM2-135M (GGUF Q4_1 -> fp32)",
        dtype="float32",
        device=f"CPU, {torch.get_num_threads()} threads",
        attention_backend=llm.llm_engine.attention_backend,
        workload="32 req, prompt 32-256, output 32-128",
    )
    return s, runs


def demo_peak_rss_mib():
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mini_vllm", "--no-progress"],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            err.seek(0)
            raise RuntimeError(f"demo failed ({proc.returncode}): {err.read().decode()[-2000:]}")
    return usage.ru_maxrss / 1024  # ru_maxrss is in KiB on Linux


def copy_bandwidth(device, nbytes=1 << 30, iters=20):
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * iters / (time.perf_counter() - t0)


def gpu_section(
    repeats,
    hf_batch,
    device="cuda",
    shape=QWEN3_06B,
    num_requests=256,
    lens=(100, 1024),
    dtype=torch.bfloat16,
):
    """The arguments after the first two exist to smoke-test this section on a CPU."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from mini_vllm.entrypoints.llm import LLM

    dev = torch.device(device)
    cfg = Qwen3Config(architectures=["Qwen3ForCausalLM"], **shape)
    torch.manual_seed(0)
    with dev:
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    workload = make_workload(num_requests, lens, lens, cfg.vocab_size)
    kv_per_token = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    )
    need = sum(-(-(len(p) + n) // 16) + 1 for p, n in workload) * 16 * kv_per_token
    kv_budget = min(need, int(0.4 * torch.cuda.get_device_properties(dev).total_memory))
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        llm = LLM(
            tmp,
            max_model_len=2 * lens[1],
            max_num_seqs=num_requests,
            max_num_batched_tokens=8192,
            kv_cache_memory_bytes=kv_budget,
            device=device,
            dtype=str(dtype).removeprefix("torch."),
        )
    s, runs = compare(llm, hf, workload, repeats, hf_batch, 0)
    engine = llm.llm_engine
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv_bytes = engine.engine_core.bytes_per_block / engine.vllm_config.cache_config.block_size
    bw = copy_bandwidth(dev)
    decode = [d for r in runs["mini"] for d in r["decode"]]
    floor = [(weight_bytes + kv * kv_bytes) / bw for _, _, kv in decode]
    s.update(
        model="Qwen3-0.6B-shaped, random weights",
        dtype=str(dtype).removeprefix("torch."),
        device=torch.cuda.get_device_name(dev),
        kv_cache_bytes=kv_budget,
        workload=f"{num_requests} req, prompt/output {lens[0]}-{lens[1]}",
        copy_bandwidth_gb_s=bw / 1e9,
        weight_bytes=weight_bytes,
        decode_steps=len(decode),
        decode_step_ms=med(1e3 * d[0] for d in decode),
        decode_forward_ms=med(1e3 * d[1] for d in decode),
        decode_floor_ms=med(1e3 * f for f in floor),
        decode_step_over_floor=med(d[0] / f for d, f in zip(decode, floor, strict=True)),
    )
    return s, runs


def plot(s, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    bars = a.bar(
        ["mini_vllm", "HF generate\n(useful)", "HF generate\n(raw)"],
        [s["mini_tok_s"], s["hf_tok_s"], s["hf_raw_tok_s"]],
        color=["tab:blue", "tab:orange", "navajowhite"],
    )
    a.bar_label(bars, fmt="%.0f")
    a.set_ylabel("output tokens/s (median)")
    a.set_title(f"{s['workload']}\nmini/HF (useful) = {s['ratio']:.2f}x", fontsize=9)
    fwd, step, x = s["mini_forward_ms"], s["mini_step_ms"], "mini_vllm\nengine step"
    b.bar([x], [fwd], color="tab:blue", label="model forward + sampling")
    b.bar(
        [x],
        [step - fwd],
        bottom=[fwd],
        color="lightsteelblue",
        label=f"outside forward ({100 * s['outside_share']:.1f}%)",
    )
    b.bar(
        ["HF generate\nper forward pass"],
        [s["hf_pass_ms"]],
        color="tab:orange",
        label="HF generate (all)",
    )
    b.set_ylabel("ms per step (mean over the run)")
    b.set_ylim(top=1.35 * max(step, s["hf_pass_ms"]))  # room for the legend
    b.legend(fontsize=8)
    b.set_title(f"{s['model']}, {s['dtype']}, {s['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(results):
    lines = [
        "| device | model | workload | mini_vllm tok/s | HF tok/s (useful) | HF tok/s (raw) "
        "| mini/HF | mini steps | outside forward |",
        "|" + "---|" * 9,
    ]
    notes = []
    for kind, s in results.items():
        lines.append(
            f"| {s['device']} | {s['model']} | {s['workload']} | {s['mini_tok_s']:.1f} "
            f"| {s['hf_tok_s']:.1f} | {s['hf_raw_tok_s']:.1f} | {s['ratio']:.2f}x "
            f"| {s['mini_steps']} | {100 * s['outside_share']:.1f}% |"
        )
        if "demo_peak_rss_mib" in s:
            notes.append(
                f"Peak RSS of `python -m mini_vllm --no-progress`: {s['demo_peak_rss_mib']:.0f} MiB"
            )
        if "decode_floor_ms" in s:
            notes.append(
                f"{kind} decode step: median {s['decode_step_ms']:.2f} ms (forward "
                f"{s['decode_forward_ms']:.2f} ms), bandwidth floor "
                f"{s['decode_floor_ms']:.2f} ms at {s['copy_bandwidth_gb_s']:.0f} GB/s: "
                f"{s['decode_step_over_floor']:.2f}x the floor"
            )
    return "\n".join(lines + [""] + notes)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mini_vllm.benchmarks.throughput")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--gpu-hf-batch",
        type=int,
        default=64,
        help="static batch size of the transformers baseline on CUDA",
    )
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch"])
    parser.add_argument("--skip-rss", action="store_true", help="skip the demo's peak RSS")
    args = parser.parse_args(argv)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    args.out.mkdir(parents=True, exist_ok=True)
    rss = None
    if not args.skip_rss:
        print("demo peak RSS ...", file=sys.stderr)
        rss = demo_peak_rss_mib()
    sections = [("cpu", lambda: cpu_section(args.repeats, args.attention_backend))]
    if torch.cuda.is_available():
        sections.append(("cuda", lambda: gpu_section(args.repeats, args.gpu_hf_batch)))
    else:
        print("cuda: skipped (torch.cuda.is_available() is False)")
    results = {}
    for kind, section in sections:
        print(f"{kind} ...", file=sys.stderr)
        s, runs = section()
        if kind == "cpu" and rss is not None:
            s["demo_peak_rss_mib"] = rss
        s.update(
            torch=torch.__version__, transformers=transformers.__version__, repeats=args.repeats
        )
        results[kind] = s
        for r in runs["mini"]:
            r.pop("decode")
        (args.out / f"throughput_{kind}.json").write_text(
            json.dumps({"summary": s, "runs": runs}, indent=1) + "\n"
        )
        plot(s, args.out / f"throughput_{kind}.png")
    print(table(results))
    print(f"\nwrote throughput_{{{','.join(results)}}}.{{json,png}} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
