"""The KV-memory calculator (mini_vllm/kv_cache_interface.py), the calculator
table (mini_vllm/benchmarks/kv_memory.py) and the KV-cache speed-up helpers
(mini_vllm/benchmarks/kv_cache_speedup.py), without the pinned upstream.

Oracles: upstream's numbers recorded at the pin
(tests/snapshots/kv_sizing/upstream.json), the SmolLM2 GGUF itself, the
engine's own allocation, and transformers' greedy tokens.
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_reference import hf_greedy

from mini_vllm import kv_cache_interface as kv
from mini_vllm.benchmarks import kv_cache_speedup, kv_memory
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader import gguf_loader, load_model, smollm2_gguf_path
from mini_vllm.oracle import kv_sizing


def test_model_config_facts_of_smollm2_equal_the_gguf():
    path = smollm2_gguf_path()
    config = gguf_loader.gguf_to_hf_config(gguf_loader.open_gguf(path), path)
    (facts,) = [m for m in kv_memory.load_model_configs() if m["name"] == "SmolLM2-135M"]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert (facts["num_hidden_layers"], facts["num_key_value_heads"], facts["head_dim"]) == (
        config.num_hidden_layers,
        config.num_key_value_heads,
        head_dim,
    )


def test_recording_covers_every_case_and_the_reference_reproduces_it():
    records = json.loads(kv_sizing.RECORDING.read_text())
    assert [r["case"] for r in records] == kv_sizing.cases()
    for r in records:
        case, up = r["case"], r["upstream"]
        spec = kv.FullAttentionSpec(
            block_size=case["block_size"],
            num_kv_heads=case["num_kv_heads"],
            head_size=case["head_size"],
            dtype=getattr(torch, case["dtype"]),
        )
        n = kv.get_num_blocks(
            case["num_layers"],
            case["available_memory"],
            spec.page_size_bytes,
            case["num_gpu_blocks_override"],
        )
        assert spec.page_size_bytes == up["page_size_bytes"]
        assert spec.max_memory_usage_bytes(case["max_model_len"]) == up["max_memory_usage_bytes"]
        assert n == up["num_blocks"]
        assert (
            kv.get_max_concurrency_for_kv_cache_config(
                n, spec, case["num_layers"], case["max_model_len"]
            )
            == up["max_concurrency"]
        )


def test_calculator_table_agrees_with_upstreams_recorded_numbers():
    """The guide's table (80 GiB at 0.9, 4096 tokens, block 16) is upstream's arithmetic."""
    by_model = {
        r["case"]["model"]: r["upstream"]
        for r in json.loads(kv_sizing.RECORDING.read_text())
        if r["case"]["available_memory"] == int(0.9 * 80 * kv_memory.GIB)
        and r["case"]["block_size"] == 16
        and r["case"]["max_model_len"] == 4096
        and r["case"]["dtype"] != "float32"
    }
    rows = kv_memory.table()
    assert {r["model"] for r in rows} == set(by_model)
    for row in rows:
        up = by_model[row["model"]]
        assert row["num_blocks"] == up["num_blocks"]
        assert row["upstream_max_concurrency"] == up["max_concurrency"]
        assert row["bytes_per_token"] * 16 == up["page_size_bytes"] * row["layers"]


def test_engine_allocates_what_the_spec_says(tiny_qwen3):
    folder, _ = tiny_qwen3
    llm = LLM(
        str(folder), max_model_len=64, kv_cache_memory_bytes=777_777, device="cpu", dtype="float32"
    )
    core = llm.llm_engine.engine_core
    allocated = sum(t.numel() * t.element_size() for t in core.kv_caches)
    assert (
        allocated
        == core.kv_cache_spec.page_size_bytes
        * core.num_layers
        * llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        <= 777_777
    )


def test_layers_with_different_kv_shapes_are_refused():
    from types import SimpleNamespace

    from mini_vllm.worker.gpu_worker import kv_cache_spec_of

    layers = [
        SimpleNamespace(num_kv_heads=2, head_size=32),
        SimpleNamespace(num_kv_heads=4, head_size=32),
    ]
    model = SimpleNamespace(attention_layers=lambda: layers)
    with pytest.raises(ValueError, match="same KV shape"):
        kv_cache_spec_of(model, 16, torch.float32)
    spec, n = kv_cache_spec_of(
        SimpleNamespace(attention_layers=lambda: layers[:1] * 3), 16, torch.bfloat16
    )
    assert (spec, n) == (
        kv.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16),
        3,
    )


def test_kv_cache_too_small_is_a_clear_error(tiny_qwen3):
    folder, _ = tiny_qwen3
    with pytest.raises(ValueError, match="KV cache too small"):
        LLM(
            str(folder), max_model_len=64, kv_cache_memory_bytes=1000, device="cpu", dtype="float32"
        )


def test_paged_model_refuses_a_gap_in_the_cache(tiny_qwen3):
    folder, _ = tiny_qwen3
    model = load_model(folder, load_tokenizer=False).model
    pm = kv_cache_speedup.PagedModel(model, max_model_len=32)
    pm.forward([5, 6, 7], start=0)
    with pytest.raises(ValueError, match="never computed"):
        pm.forward([8], start=4)
    pm.reset()
    with pytest.raises(ValueError, match="never computed"):
        pm.forward([8], start=1)


@pytest.mark.slow
def test_reference_greedy_loops_equal_transformers_on_smollm2(smollm2_hf):
    path, hf = smollm2_hf
    model, _, tokenizer = load_model(path, dtype=torch.float32)
    pm = kv_cache_speedup.PagedModel(model, max_model_len=64)
    prompt = tokenizer.encode("The capital of France is")
    expected = hf_greedy(hf, prompt, 8)
    assert kv_cache_speedup.greedy_with_cache(pm, prompt, 8) == expected
    assert kv_cache_speedup.greedy_without_cache(pm, prompt, 8) == expected
