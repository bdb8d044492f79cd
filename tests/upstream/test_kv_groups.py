"""KV-cache specs and groups against the pinned upstream: the same layers
give the same groups (layer names and specs, in order), the same block
count and the same tensors, with a float16 cache and an fp8 one (a byte a
value, as ``kv_cache_dtype="fp8"`` makes them); sliding-window sizing
equals upstream's.

Upstream's ``get_kv_cache_groups`` and ``get_kv_cache_config_from_groups``
read only ``scheduler_config.disable_hybrid_kv_cache_manager`` and
``cache_config.num_gpu_blocks_override`` from the ``VllmConfig``, so a
namespace with those two stands in for it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mini_vllm import kv_cache_interface as mini_kv
from mini_vllm.core import kv_cache_utils as mini_utils

pytestmark = pytest.mark.upstream

# (name, [(kind, window) per layer]); kind "full" or "swa".
PATTERNS = [
    ("all full", [("full", None)] * 6),
    ("all one window", [("swa", 8)] * 4),
    ("gemma-3 5:1", ([("swa", 8)] * 5 + [("full", None)]) * 2),
    ("gpt-oss 1:1", [("swa", 16), ("full", None)] * 3),
    ("two windows and full", [("swa", 8), ("swa", 32), ("full", None)] * 2),
    ("12 swa + 13 full", [("swa", 8)] * 12 + [("full", None)] * 13),
    ("uneven 3 full + 7 swa", [("full", None)] * 3 + [("swa", 4)] * 7),
]


def _specs(kv, pattern, block_size=4, dtype=torch.float16):
    specs = {}
    for i, (kind, window) in enumerate(pattern):
        common = dict(block_size=block_size, num_kv_heads=2, head_size=8, dtype=dtype)
        if kind == "full":
            specs[f"layers.{i}.attn"] = kv.FullAttentionSpec(**common)
        else:
            specs[f"layers.{i}.attn"] = kv.SlidingWindowSpec(sliding_window=window, **common)
    return specs


def _described(groups):
    out = []
    for g in groups:
        spec = g.kv_cache_spec
        out.append(
            (
                list(g.layer_names),
                type(spec).__name__,
                spec.block_size,
                spec.page_size_bytes,
                getattr(spec, "sliding_window", None),
            )
        )
    return out


def _vllm_config(disable_hybrid: bool, override=None):
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=disable_hybrid),
        cache_config=SimpleNamespace(num_gpu_blocks_override=override),
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=["fp16", "fp8"])
@pytest.mark.parametrize("disable_hybrid", [False, True])
@pytest.mark.parametrize("name,pattern", PATTERNS, ids=[p[0] for p in PATTERNS])
def test_groups_and_config_equal_upstream(name, pattern, disable_hybrid, dtype):
    from vllm.v1 import kv_cache_interface as up_kv
    from vllm.v1.core import kv_cache_utils as up_utils

    try:
        up_groups = up_utils.get_kv_cache_groups(
            _vllm_config(disable_hybrid), _specs(up_kv, pattern, dtype=dtype)
        )
    except ValueError:
        with pytest.raises(ValueError):
            mini_utils.get_kv_cache_groups(
                _specs(mini_kv, pattern, dtype=dtype),
                disable_hybrid_kv_cache_manager=disable_hybrid,
            )
        return
    mini_groups = mini_utils.get_kv_cache_groups(
        _specs(mini_kv, pattern, dtype=dtype), disable_hybrid_kv_cache_manager=disable_hybrid
    )
    assert _described(mini_groups) == _described(up_groups), name
    for memory, override in [(1 << 20, None), (123_457, None), (1 << 20, 77)]:
        up = up_utils.get_kv_cache_config_from_groups(
            _vllm_config(disable_hybrid, override), up_groups, memory
        )
        got = mini_utils.get_kv_cache_config_from_groups(mini_groups, memory, override)
        assert got.num_blocks == up.num_blocks, (name, memory, override)
        assert [(t.size, t.shared_by) for t in got.kv_cache_tensors] == [
            (t.size, t.shared_by) for t in up.kv_cache_tensors
        ], (name, memory, override)


@pytest.mark.parametrize("window", [1, 2, 5, 8, 17, 64])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("max_num_batched_tokens,max_model_len", [(8, 64), (64, 64), (512, 100)])
def test_sliding_window_sizing_equals_upstream(
    window, block_size, max_num_batched_tokens, max_model_len
):
    from vllm.v1 import kv_cache_interface as up_kv

    common = dict(block_size=block_size, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    up = up_kv.SlidingWindowSpec(sliding_window=window, **common)
    got = mini_kv.SlidingWindowSpec(sliding_window=window, **common)
    up_config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_num_batched_tokens),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )
    assert got.page_size_bytes == up.page_size_bytes
    assert got.max_admission_blocks_per_request(
        max_num_batched_tokens, max_model_len
    ) == up.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
    assert got.max_memory_usage_bytes(max_model_len, max_num_batched_tokens) == (
        up.max_memory_usage_bytes(up_config)
    )
