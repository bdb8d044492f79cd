"""The roofline's FLOP model counts what torch counts, and the benchmark runs.

- ``ModelMetrics.get_num_flops`` (mini_vllm/metrics/perf.py), given a step's
  ``ExecutionContext`` built from the scheduler's output, equals the FLOPs
  ``torch.utils.flop_counter.FlopCounterMode`` counts in the real model's
  forward and logits for that step, step by step, over steps with whole
  prefills, chunked prefills and decodes together (the ``torch`` attention
  backend: one SDPA call a request over its whole context, run by SDPA's
  math kernel so that torch counts its two matmuls; the linear layers on
  ``F.linear``, whose matmuls torch counts, instead of oneDNN's);
- its weight bytes are the model's own weights: every linear layer's and
  the logits' weight tensors, counted once a step;
- ``python -m mini_vllm.benchmarks.roofline`` runs at a tiny setting and
  records every step the engine ran (their tokens add up to every prompt
  token and every output token but the last); its linear layers alone are
  timed both ways.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mini_vllm.benchmarks import roofline
from mini_vllm.benchmarks.throughput import make_workload
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.metrics.perf import ExecutionContext, ModelMetrics
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
from mini_vllm.sampling_params import SamplingParams


def _model_path(name, tmp_path_factory):
    if name == "smollm2":
        from mini_vllm.model_executor.model_loader import smollm2_gguf_path

        try:
            return smollm2_gguf_path()
        except FileNotFoundError as e:
            pytest.skip(str(e))
    arch = name.removeprefix("tiny-")
    return make_tiny_model(tmp_path_factory.mktemp(name), arch=arch, seed=0)


@pytest.mark.parametrize(
    "name", ["tiny-llama", "tiny-qwen3", pytest.param("smollm2", marks=pytest.mark.slow)]
)
def test_the_flop_model_counts_what_torch_counts(name, tmp_path_factory):
    path = _model_path(name, tmp_path_factory)
    # A 24-token budget: the 40-token prompt is prefilled in chunks beside decodes.
    llm = LLM(
        str(path),
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        device="cpu",
        dtype="float32",
        attention_backend="torch",
    )
    runner = llm.llm_engine.engine_core.model_runner
    # torch counts F.linear's matmuls, not oneDNN's packed ones (the same products).
    for module in runner.model.modules():
        if "cpu_linear" in module.__dict__:
            module.cpu_linear = F.linear
    metrics = ModelMetrics(llm.llm_engine.hf_config, torch.float32)
    counted: list[tuple[ExecutionContext, int]] = []
    execute = runner.execute_model

    def counting(scheduler_output, *args):
        if not scheduler_output.total_num_scheduled_tokens:
            return execute(scheduler_output, *args)
        ctx = ExecutionContext.from_scheduler_output(scheduler_output)
        with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
            out = execute(scheduler_output, *args)
        counted.append((ctx, counter.get_total_flops()))
        return out

    runner.execute_model = counting
    prompts = [[5, 6, 7], list(range(10, 50)), list(range(60, 75))]
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0),
        use_tqdm=False,
    )
    assert any(c.prefill_num_tokens and c.decode_num_tokens for c, _ in counted), (
        "the workload should mix prefills and decodes in one step"
    )
    assert any(c.prefill_context_len > c.prefill_num_tokens for c, _ in counted), (
        "the workload should prefill a prompt in chunks"
    )
    for step, (ctx, torch_flops) in enumerate(counted):
        assert metrics.get_num_flops(ctx) == torch_flops, (
            f"step {step} ({ctx}): the model says {metrics.get_num_flops(ctx)} FLOPs, "
            f"torch counted {torch_flops}"
        )


def test_the_weight_bytes_are_the_models_weights(tmp_path_factory):
    path = _model_path("tiny-llama", tmp_path_factory)
    llm = LLM(str(path), max_model_len=128, device="cpu", dtype="float32")
    model = llm.llm_engine.engine_core.model_runner.model
    # Every linear layer's weights, and the (tied) embedding table that makes the logits.
    matrices = sum(p.nbytes for p in model.parameters() if p.dim() == 2)
    ctx = ExecutionContext()
    ctx.add(num_tokens=1, context_len=10, is_prefill=False)
    read = ModelMetrics(llm.llm_engine.hf_config, torch.float32).get_read_bytes_breakdown(ctx)
    weights = sum(v for k, v in read.items() if k.endswith(("weight", "weights")))
    assert weights == matrices


def test_the_benchmark_runs_at_a_tiny_setting(tmp_path):
    path = make_tiny_model(tmp_path / "tiny-llama", arch="llama", seed=0)
    argv = ["--model", str(path), "--requests", "6", "--repeats", "2", "--hf-batches", "2", "4"]
    argv += [
        "--matrix",
        "128",
        "--mib",
        "8",
        "--out",
        str(tmp_path / "out"),
        "--compare-plain-gemm",
        "--compile",
        "--compile-backend",
        "eager",
    ]
    report = roofline.main(argv)
    saved = json.loads((tmp_path / "out" / "roofline_cpu.json").read_text())
    assert saved == json.loads(json.dumps(report))
    workload = make_workload(6, roofline.cb.PROMPT_LENS, roofline.cb.OUTPUT_LENS, 512)
    # Every prompt token, then every output token but the last, fed through the model once.
    assert report["engine_tokens"] == sum(len(p) + n - 1 for p, n in workload)
    assert sum(report["step_tokens"]) == report["engine_tokens"]
    assert report["hf_best_batch"] in (2, 4) and set(report["hf_sweep"]) == {2, 4}
    assert report["static_tokens"] == roofline.static_tokens(workload, report["hf_best_batch"])
    assert report["roofline_s"] == pytest.approx(sum(report["roofline_by_op_s"].values()))
    assert 0 < report["percent_of_roofline"]
    # Before and after the oneDNN dispatch, alternating, the same tokens (checked inside).
    assert len(report["plain_gemm_runs"]) == len(report["engine_runs"]) == 2
    assert report["machine"][1]["matmul_gflop_s_by_way"]["float32"].keys() >= {"mm"}
    # The 1-thread rates measured again after the engine's runs, as ratios to the first.
    after = report["machine_after_engine_runs"]
    assert report["drift"]["matmul"] == pytest.approx(
        after["matmul_gflop_s_by_cpu"]["float32"] / report["peak_gflop_s"]
    )
    assert report["drift"]["bandwidth"] == pytest.approx(
        max(after["bandwidth_gb_s_by_cpu"].values()) / report["bandwidth_gb_s"]
    )
    # The linear layers alone, both ways (what they sum is checked below).
    assert report["linears_alone"]["passes"] == 3
    # The compiled engine (a Dynamo trace, eager backend here: no inductor in the fast
    # tier): its own timed runs, after a compile run left out, with eager's tokens.
    compiled = report["compiled"]
    assert compiled["mode"] == "DYNAMO_TRACE_ONCE" and compiled["backend"] == "eager"
    assert [run["identical_to_eager"] for run in compiled["runs"]] == ["6/6", "6/6"]
    assert compiled["percent_of_roofline_cpu"] > 0 and compiled["compile_run_cpu_s"] > 0


def test_the_linears_alone_run_every_layer_at_its_steps_rows(tmp_path, monkeypatch):
    path = make_tiny_model(tmp_path / "m", arch="llama", seed=0)
    model = LLM(str(path), max_model_len=64, device="cpu").llm_engine.engine_core.model_runner.model
    layers = [m for m in model.modules() if "cpu_linear" in m.__dict__]
    vocab = max(m.weight.shape[0] for m in layers)
    # A clock that only the calls move: a call costs what its way pays at its step
    # (known by its rows), and 10 more in the first and last of three passes, which
    # keeping each step's fastest pass drops.
    linear, calls, clock = F.linear, [], [0]
    cost = {"onednn": {5: 1, 1: 1, 7: 3, 3: 3}, "plain": {5: 2, 1: 2, 7: 2, 3: 2}}

    def recorder(way):
        def call(x, weight, bias=None):
            middle_pass = sum(c[0] == way for c in calls) // (2 * len(layers)) == 1
            clock[0] += cost[way][x.shape[0]] + (0 if middle_pass else 10)
            calls.append((way, weight.shape[0], x.shape[0]))
            return linear(x, weight, bias)

        return call

    monkeypatch.setattr(F, "linear", recorder("plain"))
    monkeypatch.setattr(roofline.time, "process_time", lambda: clock[0])
    first, second = ExecutionContext(), ExecutionContext()
    first.add(num_tokens=5, context_len=5, is_prefill=True)
    for _ in range(2):  # a prefill of 5 tokens beside 2 decodes: 7 token rows, 3 logits rows
        second.add(num_tokens=1, context_len=9, is_prefill=False)
    second.add(num_tokens=5, context_len=5, is_prefill=True)
    alone = roofline.linears_alone(
        {m: recorder("onednn") for m in layers}, [first, second], passes=3
    )
    # Per way, three passes over both steps, every layer once a step, in model order.
    expected = [
        (m.weight.shape[0], ctx_rows[m.weight.shape[0] == vocab])
        for ctx_rows in ((5, 1), (7, 3))
        for m in layers
    ]
    for way in ("onednn", "plain"):
        assert [c[1:] for c in calls if c[0] == way] == expected * 3
    # Each step's fastest pass: oneDNN 1 + 3 a layer, F.linear 2 + 2; the faster way
    # at each step 1 + 2 (less than either sum).
    n = len(layers)
    assert (alone["onednn_cpu_s"], alone["plain_cpu_s"]) == (4 * n, 4 * n)
    assert alone["better_per_step_cpu_s"] == 3 * n and alone["passes"] == 3


def test_the_benchmark_refuses_zero_linear_passes(capsys):
    with pytest.raises(SystemExit):
        roofline.main(["--linear-passes", "0"])
    assert "--linear-passes must be at least 1, got 0" in capsys.readouterr().err
