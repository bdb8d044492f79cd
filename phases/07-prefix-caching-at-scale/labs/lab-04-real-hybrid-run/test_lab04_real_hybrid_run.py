"""Lab 07.4 — a hybrid model's KV-cache groups, and the real run.

Graded: the ``LAB 07.4`` region of ``labs/phase_07/kv_cache_utils.py``,
``_get_kv_cache_groups_uniform_page_size``: a model whose layers are not all
alike (full attention and sliding windows) gets one KV-cache group per kind
of layer and per ``group_size`` layers of that kind, every group the same
number of layers (so one block id costs the same memory in every group),
layer ``i`` of a kind in group ``i % num_groups`` of that kind.

First, marked ``upstream``, your grouping against the pinned upstream's
``_get_kv_cache_groups_uniform_page_size``
(vllm/v1/core/kv_cache_utils.py:1057) on generated mixes of layers. Then,
marked ``phase`` (every Phase 07 region is yours): a tiny seeded checkpoint
of transformers' Ministral (``MinistralForCausalLM``: Llama with
``layer_types``, two sliding-window layers of window 8 and one full layer)
through an engine built from your grouping, your coordinator and managers and
your group keys, with prefix caching, chunked prefill and a pool small
enough to preempt: its greedy tokens must equal transformers' on prompts
whose prompt plus output is longer than the window (so the window decides
tokens: tests/test_hybrid_model.py shows the same weights without windows
give other tokens).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from phase07_helpers import MAX_TOKENS, PROMPTS, Backend, plug_into_engine, written, your_keys

from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.kv_workload import KVWorkload, run_kv_workload

PROPERTY = lab_settings(200)

KINDS = [("full", None), ("window 8", 8), ("window 32", 32)]


def specs(kv, layers: list[int], block_size: int = 4) -> dict:
    """Layer name -> spec of ``kv`` (upstream's kv_cache_interface or mini_vllm's)."""
    out = {}
    for i, kind in enumerate(layers):
        common = dict(block_size=block_size, num_kv_heads=2, head_size=8, dtype=torch.float16)
        window = KINDS[kind][1]
        if window is None:
            out[f"model.layers.{i}.self_attn.attn"] = kv.FullAttentionSpec(**common)
        else:
            out[f"model.layers.{i}.self_attn.attn"] = kv.SlidingWindowSpec(
                sliding_window=window, **common
            )
    return out


def described(groups) -> list:
    return [
        (
            list(g.layer_names),
            type(g.kv_cache_spec).__name__,
            getattr(g.kv_cache_spec, "sliding_window", None),
        )
        for g in groups
    ]


@st.composite
def layer_mixes(draw):
    """Layers of two or three kinds, in an order a model could have."""
    kinds = draw(st.sampled_from([[0, 1], [1, 0], [1, 2], [0, 1, 2], [2, 0, 1]]))
    counts = [draw(st.integers(1, 14)) for _ in kinds]
    layers = [k for k, n in zip(kinds, counts, strict=True) for _ in range(n)]
    if draw(st.booleans(), label="interleave"):
        layers = draw(st.permutations(layers))
    return layers


@pytest.mark.upstream
@pytest.mark.points(6)
@pytest.mark.timeout(300)
@PROPERTY
@given(layers=layer_mixes())
def test_groups_equal_upstreams(impl, layers):
    from vllm.v1 import kv_cache_interface as up_kv
    from vllm.v1.core import kv_cache_utils as up_utils

    from mini_vllm import kv_cache_interface as mini_kv

    want = described(up_utils._get_kv_cache_groups_uniform_page_size(specs(up_kv, layers)))
    got = described(
        written(impl.kv_cache_utils._get_kv_cache_groups_uniform_page_size, specs(mini_kv, layers))
    )
    names = [KINDS[k][0] for k in layers]
    assert got == want, (
        f"layers (in order) {names}: your groups (layer names, spec, window) differ from "
        f"upstream's.\n  upstream: {want}\n  yours:    {got}\n"
        "Gather the layers by spec (first-seen order). group_size is the smallest kind's "
        "layer count, or the largest's when no kind has 1.5 times the layers of another; a "
        "kind of n layers makes cdiv(n, group_size) groups, group i holding layers[i::num_groups]."
    )


# A KV-cache workload that reaches every Phase 07 region (full attention and a
# window of 4, two requests sharing a prefix, blocks sliding out of the window).
EVERY_REGION = KVWorkload(
    name="every region",
    config={
        "block_size": 2,
        "num_blocks": 20,
        "max_model_len": 32,
        "enable_caching": True,
        "groups": [None, 4],
    },
    requests=[["a", list(range(1, 11))], ["b", list(range(1, 9)) + [50, 51]]],
    ops=[
        ["lookup", "a"],
        ["allocate", "a", 10],
        ["lookup", "b"],
        ["allocate", "b", 2],
        ["free", "a"],
    ],
)


def every_region_written(impl) -> None:
    """Fail at once if a Phase 07 region still raises NotImplementedError,
    before the model loads: a few cheap calls that reach every region."""
    from mini_vllm import kv_cache_interface as mini_kv

    utils = impl.kv_cache_utils
    key = written(utils.make_block_hash_with_group_id, b"\x01" * 32, 1)
    written(utils.get_block_hash, key)
    written(utils.get_group_id, key)
    written(utils._get_kv_cache_groups_uniform_page_size, specs(mini_kv, [0, 1, 1]))
    with your_keys(impl):
        written(run_kv_workload, Backend(impl), EVERY_REGION)


@pytest.mark.phase
@pytest.mark.points(10)
@pytest.mark.timeout(600)
def test_tiny_hybrid_model_through_your_kv_cache_equals_transformers(impl, request, monkeypatch):
    every_region_written(impl)  # before the model is built
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from mini_vllm.sampling_params import SamplingParams

    path, expected = request.getfixturevalue("tiny_hybrid")
    plug_into_engine(impl, monkeypatch)
    llm = LLM(
        path,
        max_model_len=64,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        num_gpu_blocks_override=30,
        attention_backend="torch",
    )
    core = llm.llm_engine.engine_core
    groups = core.kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec) for g in groups]
    assert kinds == [SlidingWindowSpec, SlidingWindowSpec, FullAttentionSpec], (
        f"the tiny Ministral (layers: sliding, sliding, full; all one page size) grouped by "
        f"your _get_kv_cache_groups_uniform_page_size gives groups {kinds} of layers "
        f"{[g.layer_names for g in groups]}; upstream's rule gives three groups of one layer: "
        "the two window layers (the first kind seen), then the full layer."
    )
    coordinator = core.scheduler.kv_cache_manager.coordinator
    assert type(coordinator) is impl.kv_cache_coordinator.HybridKVCacheCoordinator, (
        f"the engine runs {type(coordinator).__name__}, not your HybridKVCacheCoordinator"
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    # The first prompt again: a prefix-cache hit in every group.
    outs += llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    prompts = [*PROMPTS, PROMPTS[0]]
    for i, (g, w) in enumerate(zip(got, [*expected, expected[0]], strict=True)):
        k = next((j for j, (x, y) in enumerate(zip(g, w, strict=False)) if x != y), len(w))
        assert g == w, (
            f"request {i} (a prompt of {len(prompts[i])} tokens): "
            f"greedy token {k} is {g[k : k + 1]}, transformers says {w[k : k + 1]} (tokens "
            f"before it agree). The attention read KV from the wrong blocks: a window block "
            "freed too early or reused while still in the window, a hit the groups cannot all "
            "serve, or a hit on another group's block. make check-lab-07.1 ... 07.3 name the "
            "broken rule."
        )
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, (
        f"the run was meant to preempt and to hit the prefix cache, and did not: {stats}"
    )
