"""Lab 00.2: the KV-memory calculator, against upstream and against the engine.

Your ``FullAttentionSpec.page_size_bytes``, ``max_memory_usage_bytes``,
``get_num_blocks``, ``get_max_concurrency_for_kv_cache_config`` and
``num_requests_that_fit`` (labs/phase_00/kv_cache_interface.py) are checked:

(a) against the pinned upstream, on six real model configs
    (mini_vllm/benchmarks/data/model_configs.json) x block sizes x dtypes x
    budgets: upstream's own numbers were recorded at the pin into
    tests/snapshots/kv_sizing/upstream.json (re-recording is checked by
    tests/upstream/test_kv_sizing_recording.py), so grading needs no vllm;
(b) against mini_vllm's engine: built with ``kv_cache_memory_bytes=X``, it
    must allocate exactly the blocks and bytes you predict, and run exactly
    as many requests at once as you predict fit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader import smollm2_gguf_path
from mini_vllm.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

RECORDING = (
    Path(__file__).resolve().parents[4] / "tests" / "snapshots" / "kv_sizing" / "upstream.json"
)


def recorded():
    return json.loads(RECORDING.read_text())


def spec_of(impl, case):
    return impl.kv_cache_interface.FullAttentionSpec(
        block_size=case["block_size"],
        num_kv_heads=case["num_kv_heads"],
        head_size=case["head_size"],
        dtype=getattr(torch, case["dtype"]),
    )


def describe(case) -> str:
    return (
        f"{case['model']} ({case['num_layers']} layers, {case['num_kv_heads']} KV heads of "
        f"{case['head_size']} dims, {case['dtype']}), block_size {case['block_size']}"
    )


@pytest.mark.points(2)
def test_page_size_and_max_memory_usage_match_upstream(impl):
    for rec in recorded():
        case, up = rec["case"], rec["upstream"]
        spec = spec_of(impl, case)
        assert spec.page_size_bytes == up["page_size_bytes"], (
            f"{describe(case)}: page_size_bytes {spec.page_size_bytes}, upstream "
            f"{up['page_size_bytes']}. One page is one layer's block: a key AND a value "
            "(2) x block_size tokens x num_kv_heads x head_size x bytes per element "
            "(vllm/v1/kv_cache_interface.py:167)."
        )
        got = spec.max_memory_usage_bytes(case["max_model_len"])
        assert got == up["max_memory_usage_bytes"], (
            f"{describe(case)}: max_memory_usage_bytes({case['max_model_len']}) = {got}, "
            f"upstream {up['max_memory_usage_bytes']}. Memory comes in whole blocks: "
            "cdiv(max_model_len, block_size) pages (vllm/v1/kv_cache_interface.py:210)."
        )


@pytest.mark.points(2)
def test_get_num_blocks_matches_upstream(impl):
    for rec in recorded():
        case, up = rec["case"], rec["upstream"]
        got = impl.kv_cache_interface.get_num_blocks(
            case["num_layers"],
            case["available_memory"],
            up["page_size_bytes"],
            case["num_gpu_blocks_override"],
        )
        assert got == up["num_blocks"], (
            f"{describe(case)}, {case['available_memory']:,} bytes available, "
            f"num_gpu_blocks_override={case['num_gpu_blocks_override']}: you give {got} blocks, "
            f"upstream {up['num_blocks']}. A block spans every layer: "
            "available // page_size // num_layers, never negative, and an override replaces "
            "the computed count (vllm/v1/core/kv_cache_utils.py:935)."
        )


@pytest.mark.points(2)
def test_max_concurrency_matches_upstream(impl):
    for rec in recorded():
        case, up = rec["case"], rec["upstream"]
        got = impl.kv_cache_interface.get_max_concurrency_for_kv_cache_config(
            up["num_blocks"], spec_of(impl, case), case["num_layers"], case["max_model_len"]
        )
        assert got == up["max_concurrency"], (
            f"{describe(case)}, {up['num_blocks']} blocks, requests of {case['max_model_len']} "
            f"tokens: you give {got}, upstream {up['max_concurrency']}. Upstream divides "
            "num_blocks (null block included) by the blocks one request needs, rounded up, "
            "and does not round the quotient (vllm/v1/core/kv_cache_utils.py:877)."
        )


class RecordingScheduler(Scheduler):
    """The reference scheduler, noting the most requests it ever had running."""

    peak_running = 0

    def schedule(self):
        out = super().schedule()
        type(self).peak_running = max(type(self).peak_running, len(self.running))
        return out


def engine_spec(impl, llm):
    core = llm.llm_engine.engine_core
    layers = llm.llm_engine.model.attention_layers()
    spec = impl.kv_cache_interface.FullAttentionSpec(
        block_size=llm.llm_engine.vllm_config.cache_config.block_size,
        num_kv_heads=layers[0].num_kv_heads,
        head_size=layers[0].head_size,
        dtype=core.kv_caches[0].dtype,
    )
    return spec, len(layers)


def check_engine_sizing(impl, llm, budget: int, what: str) -> int:
    spec, num_layers = engine_spec(impl, llm)
    core = llm.llm_engine.engine_core
    predicted = impl.kv_cache_interface.get_num_blocks(num_layers, budget, spec.page_size_bytes)
    actual = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    assert predicted == actual, (
        f"{what} with kv_cache_memory_bytes={budget:,}: you predict {predicted} blocks, the "
        f"engine allocated {actual} (worker/gpu_worker.py, determine_num_blocks)."
    )
    allocated = sum(t.numel() * t.element_size() for t in core.kv_caches)
    want = predicted * spec.page_size_bytes * num_layers
    assert allocated == want, (
        f"{what}: the engine's KV tensors hold {allocated:,} bytes; your blocks x "
        f"page_size_bytes x layers = {predicted} x {spec.page_size_bytes} x {num_layers} = "
        f"{want:,}."
    )
    return actual


@pytest.mark.points(3)
def test_prediction_equals_the_engines_allocation(impl, tiny_qwen3):
    folder, _, _ = tiny_qwen3
    for budget in (200_000, 1_000_003, 5 * (1 << 20)):
        llm = LLM(
            str(folder),
            max_model_len=64,
            block_size=16,
            kv_cache_memory_bytes=budget,
            device="cpu",
            dtype="float32",
        )
        check_engine_sizing(impl, llm, budget, "tiny Qwen3")


@pytest.mark.points(2)
def test_prediction_equals_the_engines_allocation_on_smollm2(impl):
    budget = 3_000_000 * 7 + 11
    llm = LLM(
        str(smollm2_gguf_path()),
        max_model_len=256,
        block_size=16,
        kv_cache_memory_bytes=budget,
        device="cpu",
        dtype="float32",
    )
    check_engine_sizing(impl, llm, budget, "SmolLM2-135M (float32)")


@pytest.mark.points(3)
@pytest.mark.parametrize("blocks,length", [(32, 256), (33, 256), (20, 100), (9, 48)])
def test_requests_that_fit_equal_what_the_engine_runs(impl, tiny_qwen3, blocks, length):
    folder, _, _ = tiny_qwen3
    # max_model_len is one more than the prompts: a prompt must leave room for a token.
    probe = LLM(
        str(folder),
        max_model_len=length + 1,
        block_size=16,
        num_gpu_blocks_override=blocks,
        device="cpu",
        dtype="float32",
    )
    spec, num_layers = engine_spec(impl, probe)
    # A budget a little above `blocks` blocks, so memory decides the count.
    budget = blocks * spec.page_size_bytes * num_layers + spec.page_size_bytes * num_layers - 1
    RecordingScheduler.peak_running = 0
    llm = LLM(
        str(folder),
        max_model_len=length + 1,
        block_size=16,
        kv_cache_memory_bytes=budget,
        max_num_seqs=64,
        max_num_batched_tokens=64 * length,
        enable_prefix_caching=False,
        scheduler_cls=RecordingScheduler,
        device="cpu",
        dtype="float32",
    )
    num_blocks = check_engine_sizing(impl, llm, budget, "tiny Qwen3")
    predicted = impl.kv_cache_interface.num_requests_that_fit(num_blocks, spec, length)
    upstream_says = impl.kv_cache_interface.get_max_concurrency_for_kv_cache_config(
        num_blocks, spec, num_layers, length
    )
    prompts = [
        {"prompt_token_ids": [(7 * i + 3 * j) % 500 + 3 for j in range(length)]} for i in range(16)
    ]
    llm.generate(
        prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    ran = RecordingScheduler.peak_running
    assert predicted == ran, (
        f"{num_blocks} blocks of 16 tokens (block 0 is the null block), 16 requests of "
        f"{length} tokens, budget and max_num_seqs ample: the engine ran at most {ran} at "
        f"once, you predicted {predicted}. Each request needs cdiv({length}, 16) = "
        f"{-(-length // 16)} blocks and the pool never hands out the null block "
        f"(upstream's 'maximum concurrency' figure here is {upstream_says:.2f})."
    )
