"""The CPU backend (batched) against the torch backend (the definition), on CPU.

Same batches as the Triton tests (``make_batch``: random block placement,
cached context plus new tokens, GQA ratios 1-4), except that slots no
request owns hold large finite values instead of NaN: the CPU backend reads
padding slots by design (each decode row is padded to the longest one) and
masks them, and in the engine those slots always hold finite numbers (the
cache is zeroed at allocation and only ever written with keys and values).
A mask that let padding through would move the output by ~1e3.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_triton_attention import TOL, make_batch, reference

from mini_vllm.attention.backend import get_attn_backend
from mini_vllm.attention.backends.cpu_attn import (
    DECODE_GROUP_ROWS,
    PREFILL_GROUP_CELLS,
    CPUAttentionBackendImpl,
    plan_for,
)

LAYOUT = st.lists(
    st.tuples(st.integers(0, 70), st.sampled_from([1, 1, 1, 2, 5, 17])),  # (context, new tokens)
    min_size=1,
    max_size=9,
)


def run_both(layout, ratio, kv_heads, head_size, block_size, dtype, seed, padding=0):
    h = ratio * kv_heads
    q, k, v, cache, md = make_batch(
        layout, h, kv_heads, head_size, block_size, dtype, seed=seed, num_padding_tokens=padding
    )
    gen = torch.Generator().manual_seed(seed)
    garbage = 1e3 * torch.randn(cache.shape, generator=gen).to(dtype)
    cache = torch.where(cache.isnan(), garbage, cache)
    ref, ref_cache = reference(q, k, v, cache, md, h, kv_heads, head_size)
    impl = CPUAttentionBackendImpl(h, head_size, head_size**-0.5, kv_heads)
    out = impl.forward(q, k, v, cache, md)
    return out, ref, cache, ref_cache, md


@settings(max_examples=60, deadline=None)
@given(
    layout=LAYOUT,
    ratio=st.sampled_from([1, 3, 4]),
    kv_heads=st.sampled_from([1, 2]),
    head_size=st.sampled_from([16, 64]),
    block_size=st.sampled_from([4, 16]),
    seed=st.integers(0, 2**16),
)
def test_matches_torch_backend_float32(layout, ratio, kv_heads, head_size, block_size, seed):
    # Decode rows anywhere in the batch (not only first) and prefill rows with context.
    out, ref, cache, ref_cache, md = run_both(
        layout, ratio, kv_heads, head_size, block_size, torch.float32, seed, padding=2
    )
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
    assert out.shape == ref.shape and not out[md.num_actual_tokens :].any()
    atol, rtol = TOL[torch.float32]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


def test_decode_rows_in_several_length_groups():
    # More decode rows than one group holds, lengths shuffled across the batch, with
    # prefill rows among them: each group pads to its own longest row, and every row's
    # output must land on its own token.
    assert DECODE_GROUP_ROWS < 40
    gen = torch.Generator().manual_seed(0)
    contexts = torch.randint(0, 150, (2 * DECODE_GROUP_ROWS + 7,), generator=gen).tolist()
    layout = [(c, 1) for c in contexts]
    layout[5], layout[40] = (30, 9), (0, 17)
    out, ref, cache, ref_cache, md = run_both(layout, 3, 1, 64, 16, torch.float32, seed=3)
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_prefill_rows_in_several_padded_groups():
    # More prefill rows than one group holds, of shuffled query lengths and cached
    # contexts, decode rows among them: each group pads queries and keys to its own
    # longest row, and only the real query slots' outputs land, each on its own token.
    gen = torch.Generator().manual_seed(1)
    contexts = torch.randint(0, 150, (24,), generator=gen).tolist()
    q_lens = torch.randint(2, 41, (24,), generator=gen).tolist()
    layout = list(zip(contexts, q_lens, strict=True))
    layout[3], layout[11], layout[17] = (60, 1), (0, 1), (149, 1)
    out, ref, cache, ref_cache, md = run_both(layout, 3, 1, 64, 16, torch.float32, seed=4)
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    groups = plan_for(md, 16).prefill_groups
    assert len(groups) > 1 and max(g.mask.shape[0] for g in groups) > 1
    assert all(g.mask[:, 0].numel() <= PREFILL_GROUP_CELLS or g.mask.shape[0] == 1 for g in groups)
    assert sorted(torch.cat([g.tokens for g in groups]).tolist()) == [
        t
        for i, (_, q) in enumerate(layout)
        if q > 1
        for t in range(md.query_start_loc[i], md.query_start_loc[i] + q)
    ]


def test_the_plan_is_built_once_per_metadata():
    # Every layer of a step reads the same plan; a new step's metadata gets a new one.
    q, k, v, cache, md = make_batch([(20, 1), (3, 4)], 3, 1, 16, 4, torch.float32, seed=0)
    first = plan_for(md, 4)
    assert plan_for(md, 4) is first
    _, _, _, _, md2 = make_batch([(20, 1), (3, 4)], 3, 1, 16, 4, torch.float32, seed=0)
    assert plan_for(md2, 4) is not first


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_matches_torch_backend_half(dtype):
    layout = [(40, 1), (3, 1), (67, 1), (0, 9), (20, 6)]
    out, ref, *_ = run_both(layout, 3, 2, 64, 16, dtype, seed=1)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


def test_the_workspace_is_reused_across_sizes_and_inference_mode():
    # Under inference_mode as in the runner, then smaller outside it (a buffer made
    # under inference_mode cannot be written there), then back in, then larger.
    steps = [([(90, 1)] * 6, True), ([(5, 1), (30, 1)], False), ([(40, 1)] * 3, True)]
    steps.append(([(150, 1)] * 7, False))
    for seed, (layout, inference) in enumerate(steps):
        with torch.inference_mode(inference):
            out, ref, *_ = run_both(layout, 3, 1, 64, 16, torch.float32, seed=seed)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_get_attn_backend_finds_cpu():
    assert get_attn_backend("cpu") is CPUAttentionBackendImpl
    assert CPUAttentionBackendImpl.reorder_batch_threshold == 1
