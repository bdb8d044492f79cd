"""Upstream's KV-cache sizing, recorded on real model configs.

    # re-record tests/snapshots/kv_sizing/upstream.json:
    python -m mini_vllm.oracle record --only kv_sizing

For each case (a model from mini_vllm/benchmarks/data/model_configs.json,
a block size, a dtype, a byte budget, a request length, optionally
``num_gpu_blocks_override``) the pinned upstream computes:
``FullAttentionSpec(...).page_size_bytes`` (vllm/v1/kv_cache_interface.py:152),
``max_memory_usage_bytes`` (:210), the number of blocks its
``get_kv_cache_config_from_groups`` (vllm/v1/core/kv_cache_utils.py:1236)
gives the budget, and ``get_max_concurrency_for_kv_cache_config`` (:877).
Lab 00.2's graded tests compare a student's calculator with the recording,
so grading needs no vllm; tests/upstream/test_kv_sizing_recording.py checks
that re-recording at the pin reproduces the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

from mini_vllm.benchmarks.kv_memory import GIB, load_model_configs

RECORDING = (
    Path(__file__).resolve().parents[2] / "tests" / "snapshots" / "kv_sizing" / "upstream.json"
)

# (available_memory bytes, max_model_len, num_gpu_blocks_override)
BUDGETS = [
    (int(0.9 * 80 * GIB), 4096, None),
    (GIB, 4096, None),
    (3 * GIB + 12345, 1000, None),
    (10 * (1 << 20) + 7, 17, None),
    (GIB, 2048, 123),
]


def cases() -> list[dict]:
    out = []
    for cfg in load_model_configs():
        for block_size in (16, 32):
            for dtype in sorted({cfg["torch_dtype"], "float32"}):
                for available, max_model_len, override in BUDGETS:
                    out.append(
                        {
                            "model": cfg["name"],
                            "num_layers": cfg["num_hidden_layers"],
                            "num_kv_heads": cfg["num_key_value_heads"],
                            "head_size": cfg["head_dim"],
                            "dtype": dtype,
                            "block_size": block_size,
                            "available_memory": available,
                            "max_model_len": max_model_len,
                            "num_gpu_blocks_override": override,
                        }
                    )
    return out


def upstream_sizing(case: dict) -> dict:
    """What the pinned upstream computes for one case."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import torch
    import vllm
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_max_concurrency_for_kv_cache_config,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=case["block_size"],
        num_kv_heads=case["num_kv_heads"],
        head_size=case["head_size"],
        dtype=getattr(torch, case["dtype"]),
    )
    # The three VllmConfig fields these functions read, and nothing else.
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=case["max_model_len"]),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=1, prefill_context_parallel_size=1
        ),
        cache_config=SimpleNamespace(num_gpu_blocks_override=case["num_gpu_blocks_override"]),
    )
    groups = [
        KVCacheGroupSpec(
            [f"model.layers.{i}.self_attn.attn" for i in range(case["num_layers"])], spec
        )
    ]
    config = get_kv_cache_config_from_groups(vllm_config, groups, case["available_memory"])
    return {
        "vllm_version": vllm.__version__,
        "page_size_bytes": spec.page_size_bytes,
        "max_memory_usage_bytes": spec.max_memory_usage_bytes(vllm_config),
        "num_blocks": config.num_blocks,
        "kv_cache_tensor_bytes": sum(t.size for t in config.kv_cache_tensors),
        "max_concurrency": get_max_concurrency_for_kv_cache_config(vllm_config, config),
    }


def record() -> list[dict]:
    return [{"case": case, "upstream": upstream_sizing(case)} for case in cases()]


def dumps(records: list[dict]) -> str:
    return json.dumps(records, indent=1) + "\n"
