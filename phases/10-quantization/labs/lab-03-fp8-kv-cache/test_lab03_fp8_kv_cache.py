"""Lab 10.3 — the fp8 KV cache: what is stored, and what is read back.

Graded: the two ``LAB 10.3`` regions of ``Attention.forward`` in
``labs/phase_10/attention.py``: with ``kv_cache_dtype="fp8"`` the cache
keeps ``key / k_scale`` and ``value / v_scale`` in e4m3 (the backend's store
is a cast to the cache's dtype), and what attention reads back is
``k̂ * k_scale`` and ``v̂ * v_scale``, as upstream's kernels read it
(``triton_reshape_and_cache_flash``,
vllm/v1/attention/ops/triton_reshape_and_cache_flash.py:319, divides by the
scale before the cast; its attention kernels multiply it back).

Checked on a real ``Attention`` layer bound to an fp8 paged cache, with
upstream's default scales (1.0) and others: the stored bytes are torch's
float8 cast of ``key / k_scale`` (upstream's Triton store, run under the
interpreter, differs from that cast on a few values: the cast, which
rounds to nearest-even as the format says, is the definition here); the
output is attention over the dequantized keys and values, on the torch and
cpu backends; a cache that is not fp8 ignores the scales.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from phase10_helpers import SUB8, U8, written

from mini_vllm.attention.backend import AttentionMetadata, get_attn_backend, get_kv_cache_shape
from mini_vllm.forward_context import set_forward_context

pytestmark = pytest.mark.timeout(60)

HEADS, KV_HEADS, D, BLOCK = 4, 2, 32, 16


def one_request(n: int, num_blocks: int = 8) -> AttentionMetadata:
    """Metadata for one request of ``n`` new tokens in blocks 1, 2, ..."""
    return AttentionMetadata(
        num_actual_tokens=n,
        max_query_len=n,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        max_seq_len=n,
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_table=torch.arange(1, num_blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(BLOCK, BLOCK + n, dtype=torch.int64),
    )


def your_layer(impl, backend: str, kv_cache_dtype: str, k_scale: float, v_scale: float):
    layer = impl.attention.Attention(HEADS, D, D**-0.5, KV_HEADS, prefix="layer")
    dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.float32
    cache = torch.zeros(get_kv_cache_shape(8, BLOCK, KV_HEADS, D), dtype=dtype)
    layer.bind(get_attn_backend(backend), cache, kv_cache_dtype)
    layer.set_kv_scales(k_scale, v_scale)
    return layer


def qkv(n: int, seed: int):
    """Keys spread over five decades (e4m3's subnormals included), values of size 3."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HEADS * D, generator=g)
    k = torch.randn(n, KV_HEADS * D, generator=g) * torch.logspace(-4, 1, D).repeat(KV_HEADS)
    v = torch.randn(n, KV_HEADS * D, generator=g) * 3
    return q, k, v


def run(layer, q, k, v):
    with torch.no_grad(), set_forward_context(one_request(q.shape[0])):
        return written(layer, q, k, v)


def stored(layer, n: int):
    """(keys, values) in the cache's slots 16 .. 16 + n, [n, KV_HEADS * D]."""
    blocks = layer.kv_cache[1:3]  # [2, 2, BLOCK, KV_HEADS, D]: blocks 1 and 2
    k_hat = blocks[:, 0].reshape(-1, KV_HEADS * D)[:n]
    v_hat = blocks[:, 1].reshape(-1, KV_HEADS * D)[:n]
    return k_hat, v_hat


def attention(q, k, v):
    """Causal attention of one request in float32, GQA as the backends do it."""
    n, group = q.shape[0], HEADS // KV_HEADS
    heads = lambda x, h: x.view(n, h, D).transpose(0, 1)  # noqa: E731
    kk = heads(k, KV_HEADS).repeat_interleave(group, dim=0)
    vv = heads(v, KV_HEADS).repeat_interleave(group, dim=0)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(heads(q, HEADS), kk, vv, attn_mask=mask, scale=D**-0.5)
    return out.transpose(0, 1).reshape(n, HEADS * D)


SCALES = [(1.0, 1.0), (0.5, 2.0), (0.37, 1.7)]


@pytest.mark.points(4)
@pytest.mark.parametrize("scales", SCALES, ids=lambda s: f"k{s[0]}-v{s[1]}")
def test_the_store_is_the_float8_cast_of_x_over_its_scale(impl, scales):
    k_scale, v_scale = scales
    layer = your_layer(impl, "torch", "fp8", k_scale, v_scale)
    q, k, v = qkv(20, seed=0)
    run(layer, q, k, v)
    k_hat, v_hat = stored(layer, 20)
    for name, hat, x, s in (("key", k_hat, k, k_scale), ("value", v_hat, v, v_scale)):
        want = (x / s).to(torch.float8_e4m3fn)
        wrong = (hat.view(torch.uint8) != want.view(torch.uint8)).nonzero()
        if len(wrong):
            t, c = wrong[0].tolist()
            raise AssertionError(
                f"k_scale {k_scale}, v_scale {v_scale}: token {t}'s {name} element {c} is "
                f"{x[t, c].item()!r}; the cache must hold ({name} / {name[0]}_scale) cast to "
                f"e4m3 = {want[t, c].item()!r}, it holds {hat[t, c].item()!r} "
                f"({len(wrong)} of {hat.numel()} differ)"
            )
        # and so every stored value is within e4m3's rounding of the original
        err = (hat.float() * s - x).abs()
        bound = torch.maximum(U8 * x.abs(), torch.full_like(x, SUB8 * s)) * (1 + 2**-22)
        assert (err <= bound).all()


@pytest.mark.points(4)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_attention_reads_the_dequantized_values(impl, backend):
    """Power-of-two scales: folding them in and out is exact, so the output is
    attention over k̂ k_scale and v̂ v_scale exactly (torch) or to float32's
    rounding (cpu, whose batched kernels sum in another order)."""
    for k_scale, v_scale in ((0.5, 4.0), (1.0, 1.0)):
        layer = your_layer(impl, backend, "fp8", k_scale, v_scale)
        q, k, v = qkv(24, seed=1)
        out = run(layer, q, k, v)
        k_hat = (k / k_scale).to(torch.float8_e4m3fn).float() * k_scale
        v_hat = (v / v_scale).to(torch.float8_e4m3fn).float() * v_scale
        want = attention(q, k_hat, v_hat)
        if backend == "torch":
            ok = torch.equal(out, want)
        else:
            ok = torch.allclose(out, want, rtol=1e-5, atol=1e-6)
        assert ok, (
            f"{backend} backend, k_scale {k_scale}, v_scale {v_scale}: the output is not "
            f"attention over the dequantized cache (k̂ * k_scale, v̂ * v_scale); largest "
            f"difference {(out - want).abs().max().item():.3g}. Fold k_scale into the query "
            "and multiply the output by v_scale."
        )


@pytest.mark.points(3)
def test_attention_with_any_scale_is_within_float32_of_the_dequantized(impl):
    k_scale, v_scale = 0.37, 1.7
    layer = your_layer(impl, "torch", "fp8", k_scale, v_scale)
    q, k, v = qkv(24, seed=2)
    out = run(layer, q, k, v)
    k_hat = (k / k_scale).to(torch.float8_e4m3fn).float() * k_scale
    v_hat = (v / v_scale).to(torch.float8_e4m3fn).float() * v_scale
    want = attention(q, k_hat, v_hat)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-5), (
        f"k_scale {k_scale}, v_scale {v_scale}: largest difference from attention over the "
        f"dequantized cache {(out - want).abs().max().item():.3g}: the scales must come back "
        "out of what is read (k̂ * k_scale, v̂ * v_scale)"
    )


@pytest.mark.points(3)
def test_a_cache_that_is_not_fp8_ignores_the_scales(impl):
    layer = your_layer(impl, "torch", "auto", 0.5, 4.0)
    q, k, v = qkv(20, seed=3)
    out = run(layer, q, k, v)
    k_hat, v_hat = stored(layer, 20)
    assert torch.equal(k_hat, k) and torch.equal(v_hat, v), (
        "kv_cache_dtype='auto' (a float32 cache) with scales 0.5 / 4.0 set: the cache must "
        "hold the keys and values as they are (the scales are an fp8 cache's)"
    )
    assert torch.equal(out, attention(q, k, v)), "an 'auto' cache: plain attention"
