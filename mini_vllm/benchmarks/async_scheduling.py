"""Async scheduling on and off, in one run: time per output token and the overlap.

``python -m mini_vllm.benchmarks.async_scheduling [--repeats N] [--out DIR]``
``[--tiny-only]``

Two engines on the same model, one with ``async_scheduling=True``, run the
same workload in alternating order (off, on, on, off, ...); medians over
``--repeats`` are reported, and on/off ratios.

1. The throughput workload of ``benchmarks/throughput.py``: SmolLM2-135M
   (GGUF dequantized to float32), 32 requests, prompts of seeded random
   token ids of 32-256 tokens, outputs of 32-128, greedy, EOS ignored, one
   ``LLM.generate`` (max_num_seqs=32, max_model_len=512).
2. The same workload shape on the tiny seeded Qwen3 (2 layers, hidden 64):
   a model whose forward is about as cheap as the engine's own CPU work, so
   the overlap has something to hide.

Measured per run (the timers shadow methods on the instances; mini_vllm's
code is unchanged), each as [start, end] intervals of ``perf_counter``:

- *engine-thread CPU work*: ``schedule``, ``update_from_output`` and the
  front end's ``process_outputs`` (detokenization, stop strings): the work
  async scheduling moves off the critical path;
- *worker busy*: the runner's ``execute_model`` (its input preparation,
  forward, sampling and bookkeeping; on the worker thread with async on);
- *input preparation*: the runner's ``_update_states`` and
  ``_prepare_inputs``, inside the worker's time: mini_vllm's runner does it
  on the worker thread, before the forward (upstream overlaps it with the
  previous step's forward too; UPSTREAM_PIN.md), so it is not hidden here.

*Hidden* is the engine-thread CPU time that ran while the worker was busy
(interval intersection), as a share of the engine-thread CPU time (how much
of the overlappable work the overlap hid) and per engine step with async
off (how much of a step it could save). ms per output token = ``generate``
wall time / output tokens (the whole batch's, not per request). Threads
(``torch.get_num_threads()``), the CPU count and the 1-minute load average
are stated with each run. Writes ``OUT/async_scheduling_cpu.json`` and prints
a markdown table.

What a 2-core CPU can show: whether the engine-thread work overlaps the
forward (hidden share) and whether tokens stay the same. What it cannot:
a speed-up of the size a GPU gives. On a CPU torch's forward already uses
every core (intra-op threads), so the engine thread's work, when it
overlaps, takes a core from the forward; and the runner's Python (input
preparation, bookkeeping) holds the GIL, so it serializes with the engine
thread's Python. On a GPU the forward runs on the device and the host is
idle during it, which is what async scheduling recovers.
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

from mini_vllm.benchmarks.throughput import make_workload  # noqa: E402

DEFAULT_OUT = Path(__file__).parent / "results"
med = statistics.median


class Intervals:
    """[start, end] of every call of the shadowed methods, by part."""

    def __init__(self, llm) -> None:
        engine = llm.llm_engine
        core = engine.engine_core
        self.parts: dict[str, list[tuple[float, float]]] = {"engine": [], "worker": [], "prep": []}
        self._shadow(core.scheduler, "schedule", "engine")
        self._shadow(core.scheduler, "update_from_output", "engine")
        self._shadow(engine.output_processor, "process_outputs", "engine")
        self._shadow(core.model_runner, "execute_model", "worker")
        self._shadow(core.model_runner, "_update_states", "prep")
        self._shadow(core.model_runner, "_prepare_inputs", "prep")

    def _shadow(self, obj, name: str, part: str) -> None:
        fn = getattr(obj, name)
        record = self.parts[part].append

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                record((t0, time.perf_counter()))

        setattr(obj, name, timed)

    def clear(self) -> None:
        for v in self.parts.values():
            v.clear()

    def summary(self) -> dict:
        engine = sorted(self.parts["engine"])
        worker = sorted(self.parts["worker"])
        engine_s = sum(b - a for a, b in engine)
        hidden = 0.0
        j = 0
        for a, b in engine:
            while j < len(worker) and worker[j][1] <= a:
                j += 1
            k = j
            while k < len(worker) and worker[k][0] < b:
                hidden += max(0.0, min(b, worker[k][1]) - max(a, worker[k][0]))
                k += 1
        return dict(
            engine_cpu_s=engine_s,
            worker_busy_s=sum(b - a for a, b in worker),
            input_prep_s=sum(b - a for a, b in self.parts["prep"]),
            hidden_s=hidden,
            hidden_share_of_engine_cpu=hidden / engine_s if engine_s else 0.0,
            worker_calls=len(worker),
        )


def run_once(llm, timer: Intervals, workload) -> dict:
    from mini_vllm.sampling_params import SamplingParams

    llm.llm_engine.engine_core.scheduler.reset_prefix_cache()
    timer.clear()
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for _, n in workload]
    load, t0 = os.getloadavg()[0], time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n = sum(map(len, tokens))
    return dict(
        wall_s=wall, ms_per_token=1000 * wall / n, loadavg_1m=load, tokens=tokens, **timer.summary()
    )


def compare(make_llm, repeats: int) -> tuple[dict, dict]:
    llms = {"off": make_llm(False), "on": make_llm(True)}
    vocab = llms["off"].llm_engine.hf_config.vocab_size
    workload = make_workload(32, (32, 256), (32, 128), vocab)
    timers = {k: Intervals(v) for k, v in llms.items()}
    warm = [(p, 4) for p, _ in workload[:2]]
    for k in llms:
        run_once(llms[k], timers[k], warm)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for r in range(repeats):
        for k in ("off", "on") if r % 2 == 0 else ("on", "off"):
            res = run_once(llms[k], timers[k], workload)
            runs[k].append(res)
            print(
                f"  run {r + 1} async {k}: {res['ms_per_token']:.2f} ms/token in "
                f"{res['wall_s']:.1f}s, hidden {100 * res['hidden_share_of_engine_cpu']:.0f}% "
                f"of {res['engine_cpu_s']:.2f}s engine CPU (load avg {res['loadavg_1m']:.1f})",
                file=sys.stderr,
            )
    off, on = runs["off"], runs["on"]
    same = sum(a == b for a, b in zip(off[-1]["tokens"], on[-1]["tokens"], strict=True))
    steps_off = med(r["worker_calls"] for r in off)
    steps_on = med(r["worker_calls"] for r in on)
    step_ms_off = 1000 * med(r["wall_s"] for r in off) / steps_off
    s = dict(
        ms_per_token_off=med(r["ms_per_token"] for r in off),
        ms_per_token_on=med(r["ms_per_token"] for r in on),
        step_ms_off=step_ms_off,
        engine_cpu_ms_per_step_off=1000 * med(r["engine_cpu_s"] for r in off) / steps_off,
        worker_ms_per_step_off=1000 * med(r["worker_busy_s"] for r in off) / steps_off,
        input_prep_ms_per_step_off=1000 * med(r["input_prep_s"] for r in off) / steps_off,
        hidden_share_of_engine_cpu_on=med(r["hidden_share_of_engine_cpu"] for r in on),
        # Engine-thread CPU time hidden per step (async on), over a step's
        # time with async off.
        hidden_share_of_step=1000 * med(r["hidden_s"] for r in on) / steps_on / step_ms_off,
        steps_off=steps_off,
        steps_on=steps_on,
        outputs_identical=f"{same}/{len(workload)}",
        loadavg_1m=med(r["loadavg_1m"] for r in off + on),
    )
    s["ratio_on_over_off"] = s["ms_per_token_on"] / s["ms_per_token_off"]
    for r in off + on:
        del r["tokens"]
    return s, runs


def smollm2(async_scheduling: bool):
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    return LLM(
        str(smollm2_gguf_path()),
        max_model_len=512,
        max_num_seqs=32,
        device="cpu",
        dtype="float32",
        async_scheduling=async_scheduling,
    )


def tiny(folder: str):
    from mini_vllm.entrypoints.llm import LLM

    def make(async_scheduling: bool):
        return LLM(
            folder,
            max_model_len=512,
            max_num_seqs=32,
            device="cpu",
            dtype="float32",
            async_scheduling=async_scheduling,
        )

    return make


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from mini_vllm.model_executor.model_loader.tiny import make_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--tiny-only", action="store_true", help="skip SmolLM2 (a quick run)")
    args = parser.parse_args(argv)

    sections = {}
    with tempfile.TemporaryDirectory() as folder:
        make_tiny_model(folder, arch="qwen3", seed=0)
        print("tiny Qwen3:", file=sys.stderr)
        sections["tiny_qwen3"] = compare(tiny(folder), args.repeats)
    if not args.tiny_only:
        print("SmolLM2-135M:", file=sys.stderr)
        sections["smollm2"] = compare(smollm2, args.repeats)

    meta = dict(
        device=f"CPU, {os.cpu_count()} cores, torch {torch.get_num_threads()} threads",
        torch=torch.__version__,
        workload="32 req, prompt 32-256, output 32-128, greedy, EOS ignored",
        repeats=args.repeats,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "async_scheduling_cpu.json").write_text(
        json.dumps(
            {"meta": meta, **{k: {"summary": s, "runs": r} for k, (s, r) in sections.items()}},
            indent=1,
        )
    )
    print(f"\n{meta['device']}; {meta['workload']}; medians of {args.repeats}\n")
    print(
        "| model | ms/token off | ms/token on | on/off | step ms (off) | engine CPU ms/step "
        "| worker ms/step (input prep) | hidden (of engine CPU) | hidden (of a step) "
        "| same tokens | load avg |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (s, _) in sections.items():
        print(
            f"| {name} | {s['ms_per_token_off']:.2f} | {s['ms_per_token_on']:.2f} "
            f"| {s['ratio_on_over_off']:.3f} | {s['step_ms_off']:.1f} "
            f"| {s['engine_cpu_ms_per_step_off']:.2f} "
            f"| {s['worker_ms_per_step_off']:.1f} ({s['input_prep_ms_per_step_off']:.2f}) "
            f"| {100 * s['hidden_share_of_engine_cpu_on']:.0f}% "
            f"| {100 * s['hidden_share_of_step']:.2f}% | {s['outputs_identical']} "
            f"| {s['loadavg_1m']:.1f} |"
        )
    print(
        "\nThe most the overlap can save is the engine-thread CPU it hides: the 'hidden (of a "
        "step)' column. A gap between 'ms/token off' and 'on' larger than that is noise "
        "(other load on the machine; see the load average), not the overlap."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
