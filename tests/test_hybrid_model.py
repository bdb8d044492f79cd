"""A hybrid model through the engine: full and sliding-window layers, equal to transformers.

The model is a tiny seeded checkpoint of transformers' Ministral
(``MinistralForCausalLM``, model_loader/tiny.py): Llama's architecture with
``layer_types`` naming each layer full or sliding-window attention. Chosen
because transformers runs it offline on a CPU from a config alone, and
because it is the per-layer rule upstream's own Llama implements
(vllm/model_executor/models/llama.py:184-203), which mini_vllm's Llama
mirrors; Gemma 2/3 would add soft-capping and extra norms that teach nothing
about the KV cache. Its window is 8 tokens, and every prompt plus its output
is longer, so the window decides tokens (checked: the same weights with every
layer full attention give other tokens).

Through the engine, with each attention backend, the KV cache has three
groups (two sliding-window layers, one full; the grouping is upstream's), one
pool of blocks, one block table per group in the runner; prefix caching hits,
chunked prefill and preemption all happen (checked from the engine's stats),
and every request's greedy tokens equal transformers'. The Triton run is
slow under the interpreter (about 45 s) and runs in the deep tier; the fast
tier checks each backend's window against the torch backend's on one batch
(decodes, prefills with and without cached context, several windows).
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_triton_attention import DECODE, MIXED, make_batch
from transformers import AutoModelForCausalLM

from mini_vllm.attention.backend import get_attn_backend
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from mini_vllm.model_executor.model_loader.tiny import TINY_SLIDING_WINDOW, make_tiny_model
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.testing import hf_greedy

SHARED = [(5 * j + 3) % 509 + 3 for j in range(21)]  # a shared prefix: 5 blocks of 4, then 1
PROMPTS = [
    SHARED + [11, 12],
    SHARED + [13],
    [(7 * j) % 500 + 3 for j in range(5)],
    [(3 * j) % 500 + 3 for j in range(30)],
]
N = 16  # every prompt + output passes the window (8)


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny_ministral"), arch="ministral", seed=0)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, N) for p in PROMPTS]
    return str(folder), hf, expected


def test_the_window_decides_tokens(tiny_hybrid):
    """Without its windows (every layer full attention) the same weights say
    other tokens on these prompts: the comparison below tests the window."""
    _, hf, expected = tiny_hybrid
    assert hf.config.layer_types.count("sliding_attention") == 2
    assert all(len(p) + N > TINY_SLIDING_WINDOW for p in PROMPTS)
    config = copy.deepcopy(hf.config)
    config.layer_types = ["full_attention"] * len(config.layer_types)
    full = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    full.load_state_dict(hf.state_dict())
    differ = [hf_greedy(full, p, N) != e for p, e in zip(PROMPTS, expected, strict=True)]
    assert sum(differ) >= 3, differ


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("layout", [MIXED, DECODE], ids=["mixed", "decode"])
def test_backend_window_matches_torch(backend, layout):
    """Each backend with a sliding window equals the torch backend's window
    (which the engine test below checks against transformers), for windows
    shorter than a block, across blocks and past every sequence; and the
    window changes the output (the comparison would catch one ignored)."""
    heads, kv_heads, head_size, block_size = 4, 2, 16, 4
    q, k, v, cache, md = make_batch(layout, heads, kv_heads, head_size, block_size, torch.float32)
    # Finite stale slots: the cpu backend's padded decode gather multiplies
    # masked values by zero weights, as the engine's zeroed cache allows.
    cache = cache.nan_to_num(0.5)
    scale = head_size**-0.5
    torch_impl = get_attn_backend("torch")
    full = torch_impl(heads, head_size, scale, kv_heads).forward(q, k, v, cache.clone(), md)
    for window in (1, 3, 8, 13, 200):
        args = (heads, head_size, scale, kv_heads)
        ref = torch_impl(*args, sliding_window=window).forward(q, k, v, cache.clone(), md)
        out = get_attn_backend(backend)(*args, sliding_window=window).forward(
            q, k, v, cache.clone(), md
        )
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        if window < 8:
            assert not torch.allclose(ref, full), f"window {window} changed nothing"


@pytest.mark.parametrize(
    "backend", ["torch", "cpu", pytest.param("triton", marks=pytest.mark.deep)]
)
def test_hybrid_engine_matches_transformers(tiny_hybrid, backend, counts):
    """Prefix caching, chunked prefill (8 tokens a step) and a pool too small
    for all four requests at once (so the scheduler preempts); the repeated
    first prompt hits the cache in every group."""
    path, _, expected = tiny_hybrid
    llm = LLM(
        path,
        max_model_len=64,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        num_gpu_blocks_override=30,
        attention_backend=backend,
    )
    core = llm.llm_engine.engine_core
    groups = core.kv_cache_config.kv_cache_groups
    assert [type(g.kv_cache_spec) for g in groups] == [
        SlidingWindowSpec,
        SlidingWindowSpec,
        FullAttentionSpec,
    ]
    assert len(core.model_runner.input_batch.block_table.block_tables) == 3
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    outs += llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == expected + [expected[0]]
    stats = llm.llm_engine.get_stats()
    counts[f"hybrid engine {backend} preemptions"] = stats["num_preemptions"]
    counts[f"hybrid engine {backend} prefix-cache hits"] = stats["prefix_cache_hits"]
    assert stats["num_preemptions"] > 0, stats
    assert stats["prefix_cache_hits"] >= 20, stats
