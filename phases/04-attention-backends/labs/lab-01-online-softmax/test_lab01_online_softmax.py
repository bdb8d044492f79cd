"""Lab 04.1 — merging partial attention results (the online softmax).

Graded: the ``LAB 04.1`` region of ``labs/phase_04/merge_attn_states.py``,
``merge_attn_states``. ``tiled_attention`` (reference code) folds one KV
tile at a time into a running result with your merge, so it is graded too.

The oracle everywhere is softmax attention computed from its definition in
float64 over all the keys at once; the last test runs upstream's own Triton
kernel (``vllm/v1/attention/ops/triton_merge_attn_states.py``) on the same
inputs, under Triton's interpreter on CPU.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mini_vllm.attention.ops import merge_attn_states as reference_module
from mini_vllm.grading.checks import lab_settings

pytestmark = pytest.mark.timeout(60)
PROPERTY = lab_settings(40, shrink=True)
INF = float("inf")


def partial(q, k, v, scale):
    """(out [T, H, D], lse [H, T]) of attention over exactly these keys, float64."""
    s = torch.einsum("thd,nhd->htn", q.double(), k.double()) * scale
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("htn,nhd->thd", torch.softmax(s, dim=-1), v.double()), lse


def qkv(T, H, D, N, seed, magnitude=1.0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(T, H, D, generator=g) * magnitude,
        torch.randn(N, H, D, generator=g),
        torch.randn(N, H, D, generator=g),
    )


def merge(impl, p_out, p_lse, s_out, s_lse, dtype=torch.float32):
    out = torch.full(p_out.shape, float("nan"), dtype=dtype)
    lse = torch.full(p_lse.shape, float("nan"))
    impl.merge_attn_states.merge_attn_states(
        out, p_out.to(dtype), p_lse.float(), s_out.to(dtype), s_lse.float(), lse
    )
    return out, lse


@pytest.mark.points(4)
@PROPERTY
@given(
    T=st.integers(1, 4),
    H=st.integers(1, 3),
    D=st.sampled_from([1, 8, 16]),
    N=st.integers(2, 40),
    cut=st.floats(0.01, 0.99),
    seed=st.integers(0, 1000),
)
def test_merge_equals_attention_over_all_keys(impl, T, H, D, N, cut, seed):
    q, k, v = qkv(T, H, D, N, seed)
    c = min(N - 1, max(1, int(N * cut)))
    scale = D**-0.5
    (p_out, p_lse), (s_out, s_lse) = (
        partial(q, k[:c], v[:c], scale),
        partial(q, k[c:], v[c:], scale),
    )
    want_out, want_lse = partial(q, k, v, scale)
    out, lse = merge(impl, p_out, p_lse, s_out, s_lse)
    torch.testing.assert_close(
        out.double(),
        want_out,
        atol=1e-5,
        rtol=1e-5,
        msg=lambda m: (
            f"Merging attention over keys [0, {c}) and [{c}, {N}) must equal attention "
            f"over all {N} keys: out = w_P * out_P + w_S * out_S with w_X = exp(lse_X - lse), "
            f"lse = log(exp(lse_P) + exp(lse_S)). "
            f"Shapes: out [T={T}, H={H}, D={D}], lse [H, T].\n{m}"
        ),
    )
    torch.testing.assert_close(
        lse.double(),
        want_lse,
        atol=1e-5,
        rtol=1e-5,
        msg=lambda m: (
            "output_lse must be the log-sum-exp over both sides' keys, "
            f"log(exp(prefix_lse) + exp(suffix_lse)), shape [H, T].\n{m}"
        ),
    )


@pytest.mark.points(3)
@PROPERTY
@given(
    T=st.integers(1, 5),
    N=st.integers(1, 70),
    tile=st.integers(1, 80),
    causal=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_tiled_attention_equals_full_softmax(impl, T, N, tile, causal, seed):
    # tiled_attention starts from an empty result (lse = -inf) and merges one
    # tile at a time; with causality, late tiles are empty for early queries.
    # It is the reference's code, calling the merge_attn_states of its module:
    # point that name at yours while it runs.
    T = min(T, N)
    q, k, v = qkv(T, 2, 8, N, seed)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference_module, "merge_attn_states", impl.merge_attn_states.merge_attn_states)
        out, lse = reference_module.tiled_attention(q, k, v, 8**-0.5, tile, causal)
    s = torch.einsum("thd,nhd->htn", q.double(), k.double()) * 8**-0.5
    if causal:
        visible = torch.arange(N)[None, :] <= torch.arange(N - T, N)[:, None]
        s = s.masked_fill(~visible, -INF)
    want = torch.einsum("htn,nhd->thd", torch.softmax(s, -1), v.double())
    torch.testing.assert_close(
        out.double(),
        want,
        atol=1e-5,
        rtol=1e-5,
        msg=lambda m: (
            f"One pass over {N} keys in tiles of {tile} (causal={causal}, {T} queries) "
            "must give full softmax attention: each merge rescales the running result by "
            f"exp(lse_old - lse_new).\n{m}"
        ),
    )
    torch.testing.assert_close(
        lse.double(),
        torch.logsumexp(s, -1),
        atol=1e-5,
        rtol=1e-5,
        msg=lambda m: (
            f"After the last of the tiles of {tile} keys, output_lse must be the "
            f"log-sum-exp over all the visible keys (causal={causal}).\n{m}"
        ),
    )


@pytest.mark.points(3)
@pytest.mark.parametrize("empty", ["prefix", "suffix"])
@pytest.mark.parametrize("as_value", [-INF, INF], ids=["minus_inf", "plus_inf"])
def test_an_empty_side_weighs_nothing(impl, empty, as_value):
    # An empty partial result (no key seen: lse -inf; FlashAttention-2 reports
    # +inf) must leave the other side unchanged, output and LSE.
    q, k, v = qkv(3, 2, 8, 6, seed=1)
    full_out, full_lse = partial(q, k, v, 8**-0.5)
    junk = torch.randn(full_out.shape)  # an empty side's output is meaningless
    empty_lse = torch.full(full_lse.shape, as_value)
    sides = (
        (junk, empty_lse, full_out, full_lse)
        if empty == "prefix"
        else (full_out, full_lse, junk, empty_lse)
    )
    out, lse = merge(impl, *sides)
    torch.testing.assert_close(
        out.double(),
        full_out,
        atol=1e-6,
        rtol=1e-6,
        msg=lambda m: (
            f"The {empty} side is empty (lse = {as_value}): it must weigh exactly zero "
            f"({'+inf is read as -inf, ' if as_value > 0 else ''}exp(-inf - max) = 0), so the "
            f"output is the other side's.\n{m}"
        ),
    )
    torch.testing.assert_close(
        lse.double(),
        full_lse,
        atol=1e-6,
        rtol=1e-6,
        msg=lambda m: f"output_lse with an empty {empty} side must be the other side's lse.\n{m}",
    )


@pytest.mark.points(2)
@pytest.mark.parametrize("magnitude", [60.0, 120.0])
def test_large_logits_do_not_overflow(impl, magnitude):
    # Scores of hundreds: exp(lse) overflows float32 (max ~ exp(88)).
    q, k, v = qkv(2, 2, 16, 12, seed=2, magnitude=magnitude)
    scale = 16**-0.5
    want_out, want_lse = partial(q, k, v, scale)
    (p_out, p_lse), (s_out, s_lse) = (
        partial(q, k[:5], v[:5], scale),
        partial(q, k[5:], v[5:], scale),
    )
    assert want_lse.abs().max() > 88, "the test needs LSEs past float32's exp range"
    out, lse = merge(impl, p_out, p_lse, s_out, s_lse)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), (
        f"LSEs up to {want_lse.abs().max():.0f}: exp(lse) is inf in float32. Subtract the "
        f"larger lse before exp, as the online softmax subtracts its running max. Got "
        f"out {out.flatten()[:4].tolist()}..., lse {lse.flatten().tolist()}"
    )
    # float32 LSEs of a few hundred carry ~3e-5 of rounding (their ulp), and
    # the weights exp(lse_X - lse) inherit it: 1e-4 leaves a margin of 3.
    torch.testing.assert_close(
        out.double(),
        want_out,
        atol=1e-4,
        rtol=1e-4,
        msg=lambda m: (
            f"LSEs up to {want_lse.abs().max():.0f}: the output is finite but wrong. "
            f"Weigh each side by exp(lse_X - max_lse) / (p_se + s_se).\n{m}"
        ),
    )
    torch.testing.assert_close(
        lse.double(),
        want_lse,
        atol=1e-4,
        rtol=1e-5,
        msg=lambda m: (
            f"output_lse must be log(p_se + s_se) + max_lse (LSEs up to "
            f"{want_lse.abs().max():.0f}).\n{m}"
        ),
    )


@pytest.mark.points(1)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_half_precision_outputs_are_merged_in_float32(impl, dtype):
    # Upstream's kernel multiplies the half-precision outputs by float32
    # weights, so the sum is float32 and rounded once, on the store. The oracle:
    # the same formula in float64 on the same rounded inputs. One rounding is
    # at most half an ulp of the result (ulps counted from 1/16 up, so values
    # near 0 are not judged by their tiny ulp); the test allows one ulp.
    # Rounding the weights or the products to the dtype costs several.
    g = torch.Generator().manual_seed(3)
    T, H, D = 8, 4, 32
    p_out, s_out = (torch.randn(T, H, D, generator=g).to(dtype) for _ in range(2))
    p_lse, s_lse = torch.randn(H, T, generator=g) * 3, torch.randn(H, T, generator=g) * 3
    m = torch.maximum(p_lse, s_lse).double()
    a, b = torch.exp(p_lse.double() - m), torch.exp(s_lse.double() - m)
    want = p_out.double() * (a / (a + b)).T[..., None] + s_out.double() * (b / (a + b)).T[..., None]
    out, _ = merge(impl, p_out, p_lse, s_out, s_lse, dtype=dtype)
    assert out.dtype == dtype, f"output must stay {dtype} (written in place), got {out.dtype}"
    ulp = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2**-4))))
    worst = ((out.double() - want).abs() / ulp).max().item()
    assert worst <= 1.0, (
        f"{dtype} partial outputs: the merged output is off by {worst:.1f} ulp of {dtype} from the "
        "exact merge of the same inputs. Compute the weights and the weighted sum in float32 "
        "(prefix_output.float() * weight + ...) and round once, when writing into output; "
        "rounding the weights or the products to the dtype costs several ulps."
    )


def upstream_triton_merge():
    """Upstream's Triton merge_attn_states, with real triton even where vLLM's
    import check saw no GPU driver (under TRITON_INTERPRET it runs on CPU)."""
    import triton
    import triton.language as tl
    import vllm.triton_utils as tu

    name = "vllm.v1.attention.ops.triton_merge_attn_states"
    saved = tu.triton, tu.tl
    tu.triton, tu.tl = triton, tl
    try:
        return importlib.reload(importlib.import_module(name)).merge_attn_states
    finally:
        tu.triton, tu.tl = saved


@pytest.mark.upstream
@pytest.mark.points(3)
# Upstream's kernel computes -inf - -inf on the all-empty row (NaN by design);
# under the interpreter that is numpy, which warns.
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
def test_matches_upstream_triton_kernel(impl):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    upstream = upstream_triton_merge()
    g = torch.Generator().manual_seed(4)
    T, H, D = 6, 3, 24  # D not a power of 2: upstream pads and masks
    p_out, s_out = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)
    p_lse, s_lse = torch.randn(H, T, generator=g) * 5, torch.randn(H, T, generator=g) * 5
    p_lse[0, 0], s_lse[0, 1] = -INF, -INF  # one side empty
    p_lse[1, 2], s_lse[1, 3] = INF, INF  # FlashAttention-2's "empty"
    p_lse[2, 4] = s_lse[2, 4] = -INF  # both empty: NaN in upstream's kernel
    p_lse[2, 5], s_lse[2, 5] = 200.0, 150.0  # exp overflows float32
    want = torch.empty(T, H, D, device=device)
    want_lse = torch.empty(H, T, device=device)
    upstream(want, p_out.to(device), p_lse.to(device), s_out.to(device), s_lse.to(device), want_lse)
    out, lse = merge(impl, p_out, p_lse, s_out, s_lse)
    torch.testing.assert_close(
        out,
        want.cpu(),
        atol=1e-6,
        rtol=1e-6,
        equal_nan=True,
        msg=lambda m: (
            "Your merge differs from upstream's Triton merge_attn_states "
            "(vllm/v1/attention/ops/triton_merge_attn_states.py) on inputs with -inf, +inf, both "
            f"empty (upstream gives NaN there) and huge LSEs.\n{m}"
        ),
    )
    torch.testing.assert_close(
        lse,
        want_lse.cpu(),
        atol=1e-6,
        rtol=1e-6,
        equal_nan=True,
        msg=lambda m: (
            "Your output_lse differs from upstream's Triton merge_attn_states "
            f"(log(p_se + s_se) + max_lse; NaN where both sides are empty).\n{m}"
        ),
    )
