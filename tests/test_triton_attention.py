"""The Triton attention backend and its kernels against the torch reference.

On a machine without CUDA the kernels run under Triton's interpreter (set up
by conftest.py) on CPU tensors, so shapes are kept small; the ``gpu`` class
repeats the comparisons compiled, with larger shapes.

Every batch is built the way the model runner would see it: the cached
context of each request is already in the paged cache, its new tokens are
stored by the step itself, block tables are random (non-contiguous) block
ids, and every cache slot that holds no token is NaN, so a kernel that reads
a slot it should not shows up as NaN in its output.

Tolerances, |triton - torch| <= atol + rtol * |torch|:
- float32: both sides compute in float32 and differ only in summation
  order, about 1e-6 on outputs of size ~1;
- float16: outputs are rounded to float16 on both sides (a rounding flip is
  one ulp, 2**-10 relative), and the prefill kernel rounds the softmax
  weights P to float16 before its P @ V dot (2**-11 relative each);
- bfloat16: as float16 with 8 mantissa bits instead of 11 (ulp 2**-7
  relative), so about 8x looser.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_vllm.attention.backend import AttentionMetadata, get_attn_backend, get_kv_cache_shape
from mini_vllm.attention.backends import triton_attn
from mini_vllm.attention.backends.torch_attn import TorchAttentionImpl
from mini_vllm.attention.backends.triton_attn import TritonAttentionImpl
from mini_vllm.attention.ops.triton_decode_attention import decode_attention
from mini_vllm.attention.ops.triton_prefill_attention import prefill_attention
from mini_vllm.attention.ops.triton_reshape_and_cache import reshape_and_cache

TOL = {  # dtype -> (atol, rtol); see the module docstring
    torch.float32: (1e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 2e-2),
}
DTYPES = list(TOL)
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]
HEAD_CONFIGS = st.tuples(
    st.sampled_from([1, 3, 4]),  # GQA ratio num_heads / num_kv_heads
    st.sampled_from([1, 2]),  # num_kv_heads
    st.sampled_from([16, 32, 64]),  # head_size
    st.sampled_from([4, 8, 16]),
)  # block_size
# Example counts keep the file near 30 s under the interpreter on 2 cores.
SETTINGS = settings(max_examples=20, deadline=None)


def make_batch(
    layout,
    num_heads,
    num_kv_heads,
    head_size,
    block_size,
    dtype,
    device="cpu",
    seed=0,
    num_padding_tokens=0,
):
    """A step over requests ``layout = [(context_len, q_len), ...]``.

    Returns query, key, value (new tokens only), the KV cache holding each
    request's context (every other slot NaN) and the metadata.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-(ctx + q) // block_size) for ctx, q in layout]
    num_blocks = 1 + sum(blocks_per_req) + 2  # null block 0, two spares
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    shape = get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    cache = torch.full(shape, float("nan"), dtype=dtype)
    table = torch.zeros(len(layout), max(blocks_per_req), dtype=torch.int32)
    slots, qsl, seq_lens = [], [0], []
    for i, (ctx, q_len) in enumerate(layout):
        ids = torch.tensor([free.pop() for _ in range(blocks_per_req[i])], dtype=torch.int32)
        table[i, : len(ids)] = ids
        pos = torch.arange(ctx + q_len)
        block, off = ids[pos // block_size].long(), pos % block_size
        # Positions before ctx were cached by earlier steps; the rest are this step's.
        cache[block[:ctx], :, off[:ctx]] = torch.randn(
            ctx, 2, num_kv_heads, head_size, generator=gen
        ).to(dtype)
        slots += (block[ctx:] * block_size + off[ctx:]).tolist()
        qsl.append(qsl[-1] + q_len)
        seq_lens.append(ctx + q_len)
    n = qsl[-1]
    slots += [-1] * num_padding_tokens  # padded tokens own no slot
    t = n + num_padding_tokens
    q, k, v = (
        torch.randn(t, h, head_size, generator=gen).to(dtype)
        for h in (num_heads, num_kv_heads, num_kv_heads)
    )
    md = AttentionMetadata(
        num_actual_tokens=n,
        max_query_len=max(q for _, q in layout),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        max_seq_len=max(seq_lens),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
    )
    return q.to(device), k.to(device), v.to(device), cache.to(device), md


def check_close(out, ref, dtype, counts=None):
    atol, rtol = TOL[dtype]
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    if counts is not None:
        key = f"triton attention max abs err {str(dtype).removeprefix('torch.')}"
        counts[key] = max(counts.get(key, 0.0), (out.float() - ref.float()).abs().max().item())


def reference(q, k, v, cache, md, num_heads, num_kv_heads, head_size):
    """Torch output, and the cache after the torch backend stored the step."""
    cache = cache.clone()
    impl = TorchAttentionImpl(num_heads, head_size, head_size**-0.5, num_kv_heads)
    return impl.forward(q, k, v, cache, md), cache


# -- the store kernel ----------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    kv_heads=st.sampled_from([1, 3]),
    head_size=st.sampled_from([16, 24]),
    block_size=st.sampled_from([4, 16]),
    cache_dtype=st.sampled_from(DTYPES),
)
def test_store_writes_exactly_its_slots(data, kv_heads, head_size, block_size, cache_dtype):
    num_blocks = 5
    num_slots = num_blocks * block_size
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), min_size=1, max_size=12, unique=True))
    skip = data.draw(st.lists(st.booleans(), min_size=len(slots), max_size=len(slots)))
    slot_mapping = torch.tensor(
        [-1 if s else x for x, s in zip(slots, skip, strict=True)], dtype=torch.int64
    )
    t = len(slots)
    # key and value are views into one fused float32 tensor (strided rows),
    # stored into a cache of another dtype.
    kv = torch.randn(t, 2, kv_heads, head_size)
    key, value = kv[:, 0], kv[:, 1]
    cache = torch.full(
        get_kv_cache_shape(num_blocks, block_size, kv_heads, head_size),
        float("nan"),
        dtype=cache_dtype,
    )
    expected = cache.clone()
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected[slot // block_size, 0, slot % block_size] = key[i].to(cache_dtype)
            expected[slot // block_size, 1, slot % block_size] = value[i].to(cache_dtype)
    reshape_and_cache(key, value, cache, slot_mapping)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0, equal_nan=True)


# -- the attention kernels, each on its own -----------------------------------

LAYOUT = st.lists(st.tuples(st.integers(0, 48), st.integers(1, 16)), min_size=1, max_size=5)
DECODE_LAYOUT = st.lists(st.tuples(st.integers(0, 90), st.just(1)), min_size=1, max_size=5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@SETTINGS
@given(
    layout=LAYOUT,
    heads=HEAD_CONFIGS,
    seed=st.integers(0, 2**16),
    block_m=st.sampled_from([16, 32]),
    tile_n=st.sampled_from([16, 32]),
)
def test_prefill_kernel_matches_reference(dtype, layout, heads, seed, block_m, tile_n, counts):
    ratio, kv_heads, head_size, block_size = heads
    h = ratio * kv_heads
    q, k, v, cache, md = make_batch(layout, h, kv_heads, head_size, block_size, dtype, seed=seed)
    ref, cache = reference(q, k, v, cache, md, h, kv_heads, head_size)
    out = torch.zeros_like(q)
    prefill_attention(
        out,
        q,
        cache,
        md.block_table,
        md.seq_lens,
        md.query_start_loc,
        md.max_query_len,
        head_size**-0.5,
        block_m=block_m,
        tile_n=tile_n,
    )
    check_close(out, ref, dtype, counts)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@SETTINGS
@given(
    layout=DECODE_LAYOUT,
    heads=HEAD_CONFIGS,
    seed=st.integers(0, 2**16),
    num_splits=st.integers(1, 6),
    tile_n=st.sampled_from([16, 32]),
)
def test_decode_kernel_matches_reference(dtype, layout, heads, seed, num_splits, tile_n, counts):
    # Up to 91 keys in tiles of 16 or 32 over up to 6 splits: some splits
    # get nothing, and the merge must weigh them as zero.
    ratio, kv_heads, head_size, block_size = heads
    h = ratio * kv_heads
    q, k, v, cache, md = make_batch(layout, h, kv_heads, head_size, block_size, dtype, seed=seed)
    ref, cache = reference(q, k, v, cache, md, h, kv_heads, head_size)
    out = torch.zeros_like(q)
    decode_attention(
        out,
        q,
        cache,
        md.block_table,
        md.seq_lens,
        md.query_start_loc,
        md.max_seq_len,
        head_size**-0.5,
        num_splits=num_splits,
        tile_n=tile_n,
    )
    check_close(out, ref, dtype, counts)


# -- the whole backend ---------------------------------------------------------

MIXED = [(5, 3), (0, 1), (17, 1), (0, 9), (33, 2)]  # prefills with and without context, decodes
DECODE = [(5, 1), (0, 1), (40, 1), (70, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "ratio,head_size,block_size", [(1, 16, 4), (3, 32, 8), (4, 64, 16), (2, 24, 8)]
)
@pytest.mark.parametrize("layout", [MIXED, DECODE], ids=["mixed", "decode"])
def test_backend_matches_reference(dtype, ratio, head_size, block_size, layout, counts):
    kv_heads = 2
    h = ratio * kv_heads
    q, k, v, cache, md = make_batch(
        layout, h, kv_heads, head_size, block_size, dtype, seed=ratio, num_padding_tokens=2
    )
    ref, ref_cache = reference(q, k, v, cache, md, h, kv_heads, head_size)
    out = TritonAttentionImpl(h, head_size, head_size**-0.5, kv_heads).forward(q, k, v, cache, md)
    # Same cache contents (padding tokens wrote nothing), rows past n are zero.
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0, equal_nan=True)
    assert out.shape == q.shape and not out[md.num_actual_tokens :].any()
    check_close(out, ref, dtype, counts)


def test_backend_routes_by_max_query_len(monkeypatch):
    calls = []
    monkeypatch.setattr(triton_attn, "decode_attention", lambda *a, **kw: calls.append("decode"))
    monkeypatch.setattr(triton_attn, "prefill_attention", lambda *a, **kw: calls.append("prefill"))
    for layout in (DECODE, MIXED, [(0, 4)]):
        q, k, v, cache, md = make_batch(layout, 2, 1, 16, 4, torch.float32)
        TritonAttentionImpl(2, 16, 0.25, 1).forward(q, k, v, cache, md)
    assert calls == ["decode", "prefill", "prefill"]


def test_backend_accepts_strided_query():
    # Models slice q, k and v out of one fused projection: rows are strided.
    h, kv_heads, d = 4, 2, 32
    q, k, v, cache, md = make_batch(MIXED, h, kv_heads, d, 8, torch.float32, seed=3)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q2 = qkv[:, : h * d].view(-1, h, d)
    k2 = qkv[:, h * d : (h + kv_heads) * d].view(-1, kv_heads, d)
    v2 = qkv[:, (h + kv_heads) * d :].view(-1, kv_heads, d)
    assert not q2.is_contiguous()
    ref, _ = reference(q, k, v, cache, md, h, kv_heads, d)
    out = TritonAttentionImpl(h, d, d**-0.5, kv_heads).forward(q2, k2, v2, cache, md)
    check_close(out, ref, torch.float32)


def test_get_attn_backend_finds_triton():
    assert get_attn_backend("triton") is TritonAttentionImpl


# -- compiled, on a GPU --------------------------------------------------------


@pytest.mark.gpu
class TestOnCuda:
    """The same comparisons compiled on CUDA, at sizes the interpreter cannot afford."""

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize(
        "ratio,kv_heads,head_size,block_size",
        [(1, 8, 64, 16), (4, 2, 128, 16), (8, 1, 128, 32), (3, 2, 80, 16)],
    )
    def test_backend(self, dtype, ratio, kv_heads, head_size, block_size, counts):
        gen = torch.Generator().manual_seed(ratio * 1000 + head_size)
        for trial in range(3):
            mixed = [
                (
                    int(torch.randint(0, 600, (1,), generator=gen)),
                    int(torch.randint(1, 300, (1,), generator=gen)),
                )
                for _ in range(6)
            ]
            decode = [(int(torch.randint(0, 3000, (1,), generator=gen)), 1) for _ in range(16)]
            for layout in (mixed + decode, decode):
                h = ratio * kv_heads
                q, k, v, cache, md = make_batch(
                    layout, h, kv_heads, head_size, block_size, dtype, device="cuda", seed=trial
                )
                ref, ref_cache = reference(q, k, v, cache, md, h, kv_heads, head_size)
                impl = TritonAttentionImpl(h, head_size, head_size**-0.5, kv_heads)
                out = impl.forward(q, k, v, cache, md)
                torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0, equal_nan=True)
                check_close(out, ref, dtype, counts)

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    def test_decode_splits(self, dtype, counts):
        layout = [(int(n), 1) for n in torch.randint(0, 4000, (32,))]
        q, k, v, cache, md = make_batch(layout, 32, 8, 128, 16, dtype, device="cuda")
        ref, cache = reference(q, k, v, cache, md, 32, 8, 128)
        for num_splits in (1, 4, 16):
            out = torch.zeros_like(q)
            decode_attention(
                out,
                q,
                cache,
                md.block_table,
                md.seq_lens,
                md.query_start_loc,
                md.max_seq_len,
                128**-0.5,
                num_splits=num_splits,
            )
            check_close(out, ref, dtype, counts)
