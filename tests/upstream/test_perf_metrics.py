"""mini_vllm/metrics/perf.py gives upstream's FLOPs and bytes, key for key.

Upstream's ``AttentionMetrics``, ``FfnMetrics`` and ``UnembedMetrics``
(vllm/v1/metrics/perf.py) are built directly from their fields (no
VllmConfig: the config parsers are what mini_vllm leaves out), with one
tensor-parallel rank and SmolLM2's and the tiny models' sizes, and fed the
same ``ExecutionContext`` as mini_vllm's: seeded random steps of prefills
(some chunked, with a cached prefix) and decodes. Every breakdown (FLOPs,
bytes read, bytes written) must be equal, keys and values.
"""

from __future__ import annotations

import random

import pytest
import torch

from mini_vllm.metrics import perf

pytestmark = pytest.mark.upstream
up = pytest.importorskip("vllm.v1.metrics.perf")

# (layers, hidden, heads, kv heads, head dim, intermediate, vocab)
SIZES = {
    "smollm2": (30, 576, 9, 3, 64, 1536, 49152),
    "tiny-qwen3": (2, 64, 4, 2, 32, 128, 512),
}


def _pairs(sizes, dtype_bytes):
    L, D, H, KV, d, DI, V = sizes
    b = dtype_bytes
    ours = perf.ModelMetrics.__new__(perf.ModelMetrics)
    ours.components = {
        "attn": perf.AttentionMetrics(L, D, H, KV, d, b, b, b),
        "ffn": perf.FfnMetrics(L, D, DI, b, b),
        "unembed": perf.UnembedMetrics(D, V, b, b),
    }
    theirs = {
        "attn": up.AttentionMetrics(
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
        "ffn": up.FfnMetrics(
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
        "unembed": up.UnembedMetrics(
            hidden_size=D, vocab_size=V, weight_byte_size=b, activation_byte_size=b, tp_size=1
        ),
    }
    return ours, theirs


def _random_step(rng):
    mine, theirs = perf.ExecutionContext(), up.ExecutionContext()
    for _ in range(rng.randint(1, 12)):
        prefill = rng.random() < 0.4
        n = rng.randint(2, 300) if prefill else 1
        context = n + rng.choice([0, rng.randint(1, 500)])
        mine.add(n, context, prefill)
        theirs.add(n, context, prefill)
    return mine, theirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SIZES))
def test_the_breakdowns_are_upstreams(name, dtype):
    ours, theirs = _pairs(SIZES[name], torch.empty((), dtype=dtype).element_size())
    rng = random.Random(0)
    for step in range(50):
        ctx, up_ctx = _random_step(rng)
        for method in (
            "get_num_flops_breakdown",
            "get_read_bytes_breakdown",
            "get_write_bytes_breakdown",
        ):
            got = getattr(ours, method)(ctx)
            want = {
                f"{part}.{key}": value
                for part, component in theirs.items()
                for key, value in getattr(component, method)(up_ctx, per_gpu=True).items()
            }
            assert got == want, f"step {step} ({ctx}): {method} differs from upstream's"
