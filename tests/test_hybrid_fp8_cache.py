"""A hybrid model with an fp8 KV cache (``kv_cache_dtype="fp8"``), issue 31.

The tiny seeded Ministral of tests/test_hybrid_model.py (two sliding-window
layers, one full; window 8) runs with its KV cache in float8 e4m3:

- sizing, per group: every group's page is one byte a value, half a
  bfloat16 page, so the same memory holds twice the blocks, and the cache
  tensors shared across groups are fp8 (tests/upstream/test_kv_groups.py
  compares the fp8 groups and block counts with upstream's);
- tokens: what the format allows is exactly "attention over keys and values
  rounded to e4m3" (scale 1.0, upstream's default without checkpoint
  scales). So the oracle is transformers' own greedy loop with its KV cache
  rounded to e4m3 as it is written (``DynamicCache.update``), and the
  engine's tokens must equal it under prefix caching, chunked prefill and
  preemption, on the torch and cpu backends (the Triton backend refuses an
  fp8 cache: tests/test_kv_cache_fp8.py). The fp32-cache tokens differ on
  these prompts (the tiny model's margins are small), which shows the
  comparison sees the rounding; the agreement is counted, not asserted.
"""

from __future__ import annotations

import pytest
import torch
from test_hybrid_model import PROMPTS, N, tiny_hybrid  # noqa: F401 (a fixture)
from transformers import DynamicCache

from mini_vllm.entrypoints.llm import LLM
from mini_vllm.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from mini_vllm.sampling_params import SamplingParams

GROUPS = [SlidingWindowSpec, SlidingWindowSpec, FullAttentionSpec]


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` as an fp8 cache holds it with scale 1.0: torch's float8 cast."""
    return x.to(torch.float8_e4m3fn).to(x.dtype)


def hf_greedy_e4m3_cache(model, prompt_ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens with every key and value rounded to e4m3
    when it is written to the cache (what attention then reads back)."""
    cache = DynamicCache(config=model.config)
    update = cache.update
    cache.update = lambda k, v, *args, **kwargs: update(e4m3(k), e4m3(v), *args, **kwargs)
    tokens = []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), past_key_values=cache, use_cache=True)
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
    return tokens


def test_fp8_pages_are_half_bf16_pages_in_every_group(tiny_hybrid):  # noqa: F811
    path, _, _ = tiny_hybrid
    budget = 3 * 2**16
    cores = {
        kd: LLM(
            path,
            dtype="bfloat16",
            kv_cache_dtype=kd,
            kv_cache_memory_bytes=budget,
            max_model_len=64,
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=8,
        ).llm_engine.engine_core
        for kd in ("auto", "fp8")
    }
    auto, fp8 = cores["auto"].kv_cache_config, cores["fp8"].kv_cache_config
    for config in (auto, fp8):
        assert [type(g.kv_cache_spec) for g in config.kv_cache_groups] == GROUPS
    for a, f in zip(auto.kv_cache_groups, fp8.kv_cache_groups, strict=True):
        assert f.kv_cache_spec.dtype == torch.float8_e4m3fn, f"group {f.layer_names}: not fp8"
        assert 2 * f.kv_cache_spec.page_size_bytes == a.kv_cache_spec.page_size_bytes, (
            f"group {f.layer_names}: an fp8 page must be half a bfloat16 page"
        )
    assert fp8.num_blocks == 2 * auto.num_blocks, "the same memory must hold twice the blocks"
    assert all(c.dtype == torch.float8_e4m3fn for c in cores["fp8"].kv_caches)
    assert [t.shared_by for t in fp8.kv_cache_tensors] == [
        t.shared_by for t in auto.kv_cache_tensors
    ]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_hybrid_fp8_cache_equals_transformers_on_an_e4m3_cache(tiny_hybrid, backend, counts):  # noqa: F811
    """Prefix caching, chunked prefill (8 tokens a step) and a pool too small
    for all four requests (so the scheduler preempts), as the fp32 test."""
    path, hf, fp32_expected = tiny_hybrid
    expected = [hf_greedy_e4m3_cache(hf, p, N) for p in PROMPTS]
    assert expected != fp32_expected, "e4m3 rounding changes no token: the test would see nothing"
    llm = LLM(
        path,
        max_model_len=64,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        num_gpu_blocks_override=30,
        attention_backend=backend,
        kv_cache_dtype="fp8",
    )
    core = llm.llm_engine.engine_core
    assert [type(g.kv_cache_spec) for g in core.kv_cache_config.kv_cache_groups] == GROUPS
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    outs += llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    for i, (g, e) in enumerate(zip(got, expected + [expected[0]], strict=True)):
        first = next((j for j, (a, b) in enumerate(zip(g, e, strict=True)) if a != b), None)
        assert first is None, (
            f"request {i}: the fp8-cache tokens differ from transformers' on an e4m3-rounded "
            f"cache from output {first}: {g} vs {e}"
        )
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions"] > 0, stats
    assert stats["prefix_cache_hits"] >= 20, stats
    pairs = zip(got[: len(PROMPTS)], fp32_expected, strict=True)
    agree = sum(a == b for g, e in pairs for a, b in zip(g, e, strict=True))
    counts[f"hybrid fp8 cache {backend}: tokens equal to the fp32 cache's"] = (
        f"{agree}/{N * len(PROMPTS)}"
    )
