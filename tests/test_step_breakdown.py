"""step_breakdown: every part present, the parts add up to the run's wall time,
nothing counted twice, and the timers leave the engine as they found it."""

from __future__ import annotations

import time

from mini_vllm.benchmarks.step_breakdown import PARTS, step_breakdown
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.sampling_params import SamplingParams

PROMPTS = [
    {"prompt_token_ids": [(7 * i + 3 * j) % 500 + 3 for j in range(5 + 6 * i)]} for i in range(4)
]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_parts_cover_the_run_once_each(tiny_qwen3):
    path, _ = tiny_qwen3
    llm = LLM(
        path,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    t0 = time.perf_counter()
    parts = step_breakdown(llm, PROMPTS, greedy(8))
    outer = time.perf_counter() - t0
    assert tuple(parts) == PARTS
    named = {k: v for k, v in parts.items() if k != "other"}
    # Every timer fired: each named part took some time.
    assert all(v > 0 for v in named.values()), parts
    # Disjoint: a part timed twice (or one timer inside another) would make
    # the named parts exceed the wall time and "other" negative.
    assert parts["other"] >= 0, parts
    total = sum(parts.values())
    # The parts add up to generate's wall time, which is inside the outer timer.
    # (No lower bound: on a loaded machine the setup around generate can take
    # longer than generate itself, so a ratio would be a timing assertion.)
    assert total <= outer


def test_timers_are_removed_and_tokens_unchanged(tiny_qwen3):
    path, _ = tiny_qwen3
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=8 << 20)
    core = llm.llm_engine.engine_core
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(6), use_tqdm=False)]
    step_breakdown(llm, PROMPTS, greedy(6))
    assert not any(
        m._forward_hooks or m._forward_pre_hooks for m in core.model_runner.model.modules()
    )
    for obj, names in [
        (core.model_runner, ["_sample", "_update_states", "_prepare_inputs"]),
        (core.scheduler, ["schedule", "update_from_output"]),
        (core.model_runner.model, ["compute_logits"]),
    ]:
        assert not set(names) & set(vars(obj)), names
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(6), use_tqdm=False)]
    assert again == plain
