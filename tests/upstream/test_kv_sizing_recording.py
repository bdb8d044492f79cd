"""Re-recording upstream's KV-cache sizing at the pin reproduces the committed file.

tests/snapshots/kv_sizing/upstream.json is what Lab 00.2 grades against
(mini_vllm/oracle/kv_sizing.py records it); this proves it is upstream's.
"""

from __future__ import annotations

import json

import pytest

from mini_vllm.oracle import kv_sizing

pytestmark = pytest.mark.upstream


def test_recording_equals_the_pinned_upstream_live():
    committed = json.loads(kv_sizing.RECORDING.read_text())
    live = kv_sizing.record()
    assert len(live) == len(committed) == len(kv_sizing.cases())
    for got, want in zip(live, committed, strict=True):
        assert got == want, f"upstream now computes {got}, the recording says {want}"


def test_mini_vllm_sizing_equals_upstream_live():
    """The reference calculator (what the engine sizes with) on every recorded case."""
    import torch

    from mini_vllm import kv_cache_interface as kv

    for case in kv_sizing.cases():
        up = kv_sizing.upstream_sizing(case)
        spec = kv.FullAttentionSpec(
            block_size=case["block_size"],
            num_kv_heads=case["num_kv_heads"],
            head_size=case["head_size"],
            dtype=getattr(torch, case["dtype"]),
        )
        num_blocks = kv.get_num_blocks(
            case["num_layers"],
            case["available_memory"],
            spec.page_size_bytes,
            case["num_gpu_blocks_override"],
        )
        assert (
            spec.page_size_bytes,
            spec.max_memory_usage_bytes(case["max_model_len"]),
            num_blocks,
            num_blocks * spec.page_size_bytes * case["num_layers"],
            kv.get_max_concurrency_for_kv_cache_config(
                num_blocks, spec, case["num_layers"], case["max_model_len"]
            ),
        ) == (
            up["page_size_bytes"],
            up["max_memory_usage_bytes"],
            up["num_blocks"],
            up["kv_cache_tensor_bytes"],
            up["max_concurrency"],
        ), case


def test_make_snapshots_rewrites_the_file_byte_for_byte(tmp_path):
    """`make snapshots` (python -m mini_vllm.oracle record) re-records this file too."""
    from mini_vllm.oracle.__main__ import main

    assert main(["record", "--only", "kv_sizing", "--out", str(tmp_path)]) == 0
    assert (tmp_path / kv_sizing.RECORDING.name).read_bytes() == kv_sizing.RECORDING.read_bytes()
