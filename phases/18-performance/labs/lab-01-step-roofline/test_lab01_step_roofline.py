"""Lab 18.1 — the roofline of a step by hand: its FLOPs and bytes.

Graded: the ``LAB 18.1`` regions of ``labs/phase_18/perf.py``.

Against upstream's MFU model (vllm/v1/metrics/perf.py at the pin), live:
upstream's ``AttentionMetrics``, ``FfnMetrics`` and ``UnembedMetrics`` are
built from their fields (SmolLM2's sizes and a tiny model's, fp32 and
bf16, one rank) and fed the same seeded random steps as yours (prefills,
some chunked with a cached prefix, and decodes); every breakdown must be
upstream's, key for key. Then real steps: generated workloads run through
the reference scheduler, and each step's ``SchedulerOutput`` goes to your
``ExecutionContext.from_scheduler_output`` and to upstream's
``ModelMetrics.get_step_perf_stats_per_gpu``: the contexts and the step's
totals must agree.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given

import mini_vllm.testing as mini
from mini_vllm.grading.checks import lab_settings, written
from mini_vllm.oracle import strategies
from mini_vllm.oracle.workload import run_workload

pytestmark = [pytest.mark.upstream, pytest.mark.timeout(60)]

# (layers, hidden, heads, kv heads, head dim, intermediate, vocab)
SIZES = {
    "smollm2": (30, 576, 9, 3, 64, 1536, 49152),
    "tiny": (2, 64, 4, 2, 32, 128, 512),
}
BYTES = {"fp32": 4, "bf16": 2}
METHODS = ("get_num_flops_breakdown", "get_read_bytes_breakdown", "get_write_bytes_breakdown")


@pytest.fixture(scope="module")
def up():
    return pytest.importorskip("vllm.v1.metrics.perf")


def components(perf, up, sizes, b):
    """{part: (yours, upstream's)} for one model size and dtype size."""
    L, D, H, KV, d, DI, V = sizes
    return {
        "attn": (
            perf.AttentionMetrics(L, D, H, KV, d, b, b, b),
            up.AttentionMetrics(
                num_hidden_layers=L,
                hidden_size=D,
                num_attention_heads=H,
                activation_byte_size=b,
                tp_size=1,
                pp_size=1,
                num_key_value_heads=KV,
                head_dim=d,
                cache_byte_size=b,
                weight_byte_size=b,
            ),
        ),
        "ffn": (
            perf.FfnMetrics(L, D, DI, b, b),
            up.FfnMetrics(
                num_hidden_layers=L,
                hidden_size=D,
                activation_byte_size=b,
                pp_size=1,
                ffn_tp_size=1,
                ffn_ep_size=1,
                intermediate_size=DI,
                num_moe_layers=0,
                weight_byte_size=b,
            ),
        ),
        "unembed": (
            perf.UnembedMetrics(D, V, b, b),
            up.UnembedMetrics(
                hidden_size=D, vocab_size=V, weight_byte_size=b, activation_byte_size=b, tp_size=1
            ),
        ),
    }


def random_steps(perf, up, seed: int, count: int):
    """(yours, upstream's) ExecutionContext pairs of seeded random steps."""
    rng = random.Random(seed)
    for _ in range(count):
        mine, theirs = perf.ExecutionContext(), up.ExecutionContext()
        kind = rng.choice(["mixed", "decode only", "prefill only"])
        for _ in range(rng.randint(1, 12)):
            prefill = kind == "prefill only" or (kind == "mixed" and rng.random() < 0.4)
            n = rng.randint(2, 300) if prefill else 1
            context = n + rng.choice([0, rng.randint(1, 500)])  # a cached prefix or not
            mine.add(n, context, prefill)
            theirs.add(n, context, prefill)
        yield mine, theirs


def check_part(impl, up, part: str, methods=METHODS) -> None:
    for name, sizes in SIZES.items():
        for dtype, b in BYTES.items():
            yours, theirs = components(impl.perf, up, sizes, b)[part]
            for step, (ctx, up_ctx) in enumerate(random_steps(impl.perf, up, 0, 40)):
                for method in methods:
                    got = written(getattr(yours, method), ctx)
                    want = getattr(theirs, method)(up_ctx, per_gpu=True)
                    assert got == want, (
                        f"{part}.{method} on {name} ({dtype}), random step {step} "
                        f"({dataclasses.asdict(ctx)}):\n  yours:    {got}\n  upstream: {want}"
                    )


@pytest.mark.points(3)
def test_attention_flops_are_upstreams(impl, up):
    check_part(impl, up, "attn", ("get_num_flops_breakdown",))


@pytest.mark.points(3)
def test_attention_bytes_are_upstreams(impl, up):
    check_part(impl, up, "attn", ("get_read_bytes_breakdown", "get_write_bytes_breakdown"))


@pytest.mark.points(2)
def test_mlp_flops_are_upstreams(impl, up):
    check_part(impl, up, "ffn", ("get_num_flops_breakdown",))


@pytest.mark.points(2)
def test_mlp_bytes_are_upstreams(impl, up):
    check_part(impl, up, "ffn", ("get_read_bytes_breakdown", "get_write_bytes_breakdown"))


@pytest.mark.points(2)
def test_logits_are_upstreams(impl, up):
    check_part(impl, up, "unembed")


# ------------------------------------------------------------------ real steps


def upstream_step(up, parts, scheduler_output):
    """Upstream's ExecutionContext and PerfStats of one step
    (``ModelMetrics.get_step_perf_stats_per_gpu``, perf.py:1056), which reads
    only the fields mini_vllm's SchedulerOutput shares with upstream's."""
    seen = []

    class Recording(up.ModelMetrics):
        def get_num_flops_breakdown(self, ctx, per_gpu=True):
            seen.append(ctx)
            return super().get_num_flops_breakdown(ctx, per_gpu)

    model = Recording.__new__(Recording)
    model.metrics = [theirs for _, theirs in parts.values()]
    stats = model.get_step_perf_stats_per_gpu(scheduler_output)
    return seen[0], stats


@pytest.mark.points(4)
@lab_settings(40)
@given(workload=strategies.workloads())
def test_real_steps_are_counted_as_upstream_counts_them(impl, up, workload):
    parts = components(impl.perf, up, SIZES["smollm2"], 4)
    sched = mini.create_scheduler(**workload.config)
    schedule = sched.schedule
    checked = []

    def checking_schedule():
        out = schedule()
        step = len(checked)
        ctx = written(impl.perf.ExecutionContext.from_scheduler_output, out)
        up_ctx, up_stats = upstream_step(up, parts, out)
        assert dataclasses.asdict(ctx) == dataclasses.asdict(up_ctx), (
            f"step {step} of a generated workload: the context of its SchedulerOutput "
            f"(new {[r.req_id for r in out.scheduled_new_reqs]}, running "
            f"{out.scheduled_cached_reqs.req_ids}, scheduled {out.num_scheduled_tokens}):\n"
            f"  yours:    {dataclasses.asdict(ctx)}\n  upstream: {dataclasses.asdict(up_ctx)}"
        )
        totals = tuple(
            sum(sum(written(getattr(mine, m), ctx).values()) for mine, _ in parts.values())
            for m in METHODS
        )
        want = (up_stats.num_flops_per_gpu, up_stats.num_read_bytes_per_gpu)
        want += (up_stats.num_write_bytes_per_gpu,)
        assert totals == want, (
            f"step {step}: (FLOPs, bytes read, bytes written) yours {totals}, upstream {want}"
        )
        checked.append(step)
        return out

    sched.schedule = checking_schedule
    run_workload(mini, workload, scheduler=sched)
    assert checked, "the workload scheduled no step"


# ------------------------------------------------------------------ what torch counts


@pytest.mark.points(3)
@pytest.mark.timeout(120)
def test_your_flops_are_what_torch_counts_in_the_real_forward(impl, tmp_path):
    """A tiny Llama through the engine (the ``torch`` attention backend, SDPA's
    math kernel, linear layers on ``F.linear``: every matmul one torch counts),
    a 24-token budget so that a 40-token prompt is prefilled in chunks beside
    decodes: each step's FLOPs by your parts equal what
    ``torch.utils.flop_counter.FlopCounterMode`` counts in its forward and
    logits (the harness of tests/test_roofline.py)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.metrics.perf import ModelMetrics
    from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
    from mini_vllm.sampling_params import SamplingParams

    written(
        impl.perf.UnembedMetrics(8, 8, 4, 4).get_num_flops_breakdown, impl.perf.ExecutionContext()
    )
    path = make_tiny_model(tmp_path / "tiny-llama", arch="llama", seed=0)
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
    for module in runner.model.modules():
        if "cpu_linear" in module.__dict__:
            module.cpu_linear = F.linear  # torch counts F.linear's matmuls, not oneDNN's
    # Your parts, with the sizes the reference reads off the model's config.
    reference = ModelMetrics(llm.llm_engine.hf_config, torch.float32).components
    parts = {
        name: getattr(impl.perf, type(part).__name__)(**dataclasses.asdict(part))
        for name, part in reference.items()
    }
    counted = []
    execute = runner.execute_model

    def counting(scheduler_output, *args):
        if not scheduler_output.total_num_scheduled_tokens:
            return execute(scheduler_output, *args)
        ctx = written(impl.perf.ExecutionContext.from_scheduler_output, scheduler_output)
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
    assert any(c.prefill_num_tokens and c.decode_num_tokens for c, _ in counted)
    for step, (ctx, torch_flops) in enumerate(counted):
        yours = {
            f"{name}.{key}": value
            for name, part in parts.items()
            for key, value in written(part.get_num_flops_breakdown, ctx).items()
        }
        assert sum(yours.values()) == torch_flops, (
            f"step {step} ({dataclasses.asdict(ctx)}): your parts count "
            f"{sum(yours.values())} FLOPs ({yours}), torch counted {torch_flops} in the forward"
        )
