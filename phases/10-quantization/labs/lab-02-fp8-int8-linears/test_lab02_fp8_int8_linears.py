"""Lab 10.2 — fp8 and int8 linear layers, with their scales.

Graded: the ``LAB 10.2`` regions of ``labs/phase_10/input_quant_fp8.py``
(``QuantFP8.forward_native``: the dynamic scale, per token or per tensor,
and the quantization itself), ``labs/phase_10/fp8.py``
(``Fp8OnlineLinearMethod.apply``: the fp8 product scaled back) and
``labs/phase_10/int8.py`` (``quantize_int8_per_channel`` and
``Int8WeightOnlyLinearMethod.apply``).

Marked ``upstream``, against the pinned upstream's own code run on a CPU,
bit for bit: your ``QuantFP8`` against upstream's ``QuantFP8.forward_native``
(vllm/model_executor/layers/quantization/input_quant_fp8.py:188) on values
spread over 16 decades (e4m3's normal and subnormal ranges, an all-zero
token, values that clamp) in float32 and bfloat16, on values next to a
rounding tie (where multiplying by the reciprocal and dividing differ) and
with a per-token cap; your fp8 linear against the product of the operands
upstream's ``QuantFP8`` quantizes; your int8 rows against upstream's online
int8 quantizer (``Int8OnlineMoEMethod._quantize_weights``,
vllm/model_executor/layers/quantization/online/int8.py:56, called on a
stand-in layer). Without a marker: what upstream leaves undefined (an
all-zero int8 row) and the int8 product against float32 within the
format's bound.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from phase10_helpers import F32, written

from mini_vllm.model_executor.layers.linear import LinearBase
from mini_vllm.model_executor.layers.quantization.fp8 import Fp8Config
from mini_vllm.model_executor.layers.quantization.input_quant_fp8 import GroupShape

pytestmark = pytest.mark.timeout(60)

KINDS = {
    "per_token": dict(static=False, group_shape=GroupShape.PER_TOKEN),
    "per_tensor": dict(static=False, group_shape=GroupShape.PER_TENSOR),
    "static": dict(static=True, group_shape=GroupShape.PER_TENSOR),
}


def inputs(seed: int) -> torch.Tensor:
    """16 tokens whose magnitudes run from 1e-10 to 1e5, an all-zero token and
    values that clamp."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 96, generator=g) * torch.logspace(-10, 5, 16).unsqueeze(1)
    x[3] = 0.0
    x[5, :4] = torch.tensor([1e30, -1e30, 0.5, -0.0])
    return x


def compare(kind, x, up, mine, what: str) -> None:
    q_up, s_up = up
    q_mine, s_mine = mine
    assert q_mine.dtype == torch.float8_e4m3fn, (
        f"{what}: q must be torch.float8_e4m3fn, got {q_mine.dtype}"
    )
    assert s_mine.dtype == s_up.dtype and s_mine.shape == s_up.shape, (
        f"{what}: the scale must be {s_up.dtype} {list(s_up.shape)} (one a token per token, "
        f"one in all per tensor), got {s_mine.dtype} {list(s_mine.shape)}"
    )
    if not torch.equal(s_mine, s_up):
        i = int((s_mine != s_up).flatten().nonzero()[0])
        raise AssertionError(
            f"{what}: scale {i} differs: upstream {s_up.flatten()[i].item()!r}, yours "
            f"{s_mine.flatten()[i].item()!r}. scale = amax(|x|) / 448 (per token: each row's "
            "amax, capped at scale_ub if given), never below 1 / (448 * 512)."
        )
    wrong = (q_mine.view(torch.uint8) != q_up.view(torch.uint8)).nonzero()
    if len(wrong):
        r, c = wrong[0].tolist()
        raise AssertionError(
            f"{what}: x[{r}, {c}] = {x[r, c].item()!r} quantizes to {q_up[r, c].item()!r} "
            f"upstream, {q_mine[r, c].item()!r} yours ({len(wrong)} values differ). "
            "q = clamp(x * (1 / scale), -448, 448) in float32, then the cast to e4m3."
        )


@pytest.mark.upstream
@pytest.mark.points(2)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_quant_fp8_equals_upstreams(impl, upstream_quant_fp8, kind, dtype):
    mine = impl.input_quant_fp8.QuantFP8(**KINDS[kind])
    for seed in (0, 1):
        x = inputs(seed).to(dtype)
        scale = torch.tensor([0.37]) if kind == "static" else None
        up = upstream_quant_fp8[kind].forward_native(x, scale)
        compare(kind, x, up, written(mine.forward_native, x, scale), f"{kind}, {dtype}")


def near_ties(scale: torch.Tensor) -> torch.Tensor:
    """Values next to a midpoint between two e4m3 numbers once divided by ``scale``."""
    fp8 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    fp8 = fp8[torch.isfinite(fp8) & (fp8 > 0)].unique().sort().values
    x = ((fp8[:-1] + fp8[1:]) / 2 * scale).float()
    up, down = torch.full_like(x, 1e9), torch.zeros_like(x)
    return torch.cat([x, torch.nextafter(x, up), torch.nextafter(x, down)])


@pytest.mark.upstream
@pytest.mark.points(3)
def test_near_rounding_ties_equal_upstreams(impl, upstream_quant_fp8):
    scale = torch.tensor([0.37])
    x = near_ties(scale).reshape(-1, 15)
    divided = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    up = upstream_quant_fp8["static"].forward_native(x, scale)
    assert (divided != up[0].view(torch.uint8)).any(), "the inputs no longer tell the two apart"
    mine = written(impl.input_quant_fp8.QuantFP8(**KINDS["static"]).forward_native, x, scale)
    compare("static", x, up, mine, "values next to a rounding tie (static scale 0.37)")


@pytest.mark.upstream
@pytest.mark.points(2)
def test_scale_ub_equals_upstreams(impl, upstream_quant_fp8):
    x, ub = inputs(3), torch.tensor(2.0)
    up = upstream_quant_fp8["per_token"].forward_native(x, None, ub)
    mine = written(impl.input_quant_fp8.QuantFP8(**KINDS["per_token"]).forward_native, x, None, ub)
    compare("per_token", x, up, mine, "per token with scale_ub=2.0")


def fp8_layer(impl, w: torch.Tensor, per_channel: bool, bias=None) -> LinearBase:
    """A linear layer with your fp8 method, its weight quantized as the loader does."""
    layer = LinearBase(w.shape[1], [w.shape[0]], quant_config=Fp8Config(per_channel))
    layer.quant_method = impl.fp8.Fp8OnlineLinearMethod(Fp8Config(per_channel))
    layer.weight.data.copy_(w)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.upstream
@pytest.mark.points(3)
@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
def test_fp8_linear_is_the_product_of_upstreams_operands(impl, upstream_quant_fp8, per_channel):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 96, generator=g) * torch.logspace(-3, 1, 40).unsqueeze(1)
    layer = fp8_layer(impl, w, per_channel)
    qw, sw = upstream_quant_fp8["per_token" if per_channel else "per_tensor"].forward_native(w)
    x = inputs(5)  # tokens 16 decades apart: per-token scales matter
    qx, sx = upstream_quant_fp8["per_token"].forward_native(x)
    want = (qx.float() @ qw.float().t()) * sx * sw.view(1, -1)
    got = written(layer.quant_method.apply, layer, x)
    assert got.shape == want.shape and got.dtype == torch.float32, (
        f"apply must return float32 {list(want.shape)} for float32 input, got "
        f"{got.dtype} {list(got.shape)}"
    )
    assert torch.equal(got, want), (
        f"fp8 linear ({'per channel' if per_channel else 'per tensor'} weight scale): largest "
        f"difference {(got - want).abs().max().item():.3g} from (qx qW^T) * sx * sW, with qx, sx "
        "and qW, sW quantized by upstream's QuantFP8. Quantize x per token with "
        "self.input_quant, multiply the fp8 values widened to float32, then scale by the "
        "tokens' scales (a column) and layer.weight_scale (a row), in that order."
    )


@pytest.mark.points(2)
def test_fp8_linear_bias_and_dtype(impl):
    g = torch.Generator().manual_seed(6)
    w, bias = torch.randn(24, 64, generator=g), torch.randn(24, generator=g)
    x = torch.randn(5, 64, generator=g)
    plain = fp8_layer(impl, w, per_channel=True)
    biased = fp8_layer(impl, w, per_channel=True, bias=bias)
    without = written(plain.quant_method.apply, plain, x)
    got = written(biased.quant_method.apply, biased, x, bias)
    assert torch.equal(got, without + bias), "the bias is added to the scaled product, last"
    half = written(plain.quant_method.apply, plain, x.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16, f"bfloat16 in must give bfloat16 out, got {half.dtype}"


def upstream_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's online int8 quantizer on w's rows: (int8 [out, in], float32 scale [out])."""
    from vllm.model_executor.layers.quantization.online.int8 import Int8OnlineMoEMethod

    layer = torch.nn.Module()
    layer.num_experts = layer.local_num_experts = 1
    layer.w13_weight = torch.nn.Parameter(w[None].clone(), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(w[None].clone(), requires_grad=False)
    Int8OnlineMoEMethod._quantize_weights(None, layer)  # reads nothing of self
    return layer.w13_weight[0], layer.w13_scale[0]


@pytest.mark.upstream
@pytest.mark.points(4)
def test_int8_rows_equal_upstreams(impl):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-4, 1, 48).unsqueeze(1)
    w[9, 5] = -w[9].abs().max() * 2  # a negative amax: q = -127
    q_up, s_up = upstream_int8_rows(w)
    q, scale = written(impl.int8.quantize_int8_per_channel, w)
    assert q.dtype == torch.int8 and tuple(q.shape) == (48, 64), f"q: {q.dtype} {list(q.shape)}"
    assert scale.dtype == torch.float32 and tuple(scale.shape) == (48, 1), (
        f"scale must be float32 [48, 1] (one per output row), got {scale.dtype} {list(scale.shape)}"
    )
    if not torch.equal(scale[:, 0], s_up):
        r = int((scale[:, 0] != s_up).nonzero()[0])
        raise AssertionError(
            f"row {r}: scale {scale[r, 0].item()!r}, upstream's {s_up[r].item()!r}: "
            "a row's scale is amax(|row|) / 127"
        )
    wrong = (q != q_up).nonzero()
    assert not len(wrong), (
        f"w[{wrong[0, 0]}, {wrong[0, 1]}] = {w[tuple(wrong[0])].item()!r}: q {q[tuple(wrong[0])]}, "
        f"upstream's {q_up[tuple(wrong[0])]} ({len(wrong)} differ). q = round(w / scale) "
        "(divide, round half to even), clamped to [-127, 127]."
    )


@pytest.mark.points(2)
def test_int8_all_zero_row(impl):
    """Upstream divides 0 by 0 there (its scale is 0); mini_vllm's rule: scale 1, q 0."""
    w = torch.randn(4, 32)
    w[2] = 0.0
    q, scale = written(impl.int8.quantize_int8_per_channel, w)
    assert scale[2, 0].item() == 1.0 and (q[2] == 0).all(), (
        f"an all-zero row must get scale 1.0 and q 0 (not 0 / 0), got scale "
        f"{scale[2, 0].item()!r}, q {q[2, :4].tolist()}..."
    )


@pytest.mark.points(3)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_int8_linear_is_the_dequantized_weight_times_x(impl, dtype):
    """W8A16: only the weight is quantized; ``x (q * s)^T`` in x's dtype, and in
    float32 within the format's bound of ``x W^T``: ``Σ |x| s / 2`` a row, plus
    float32 accumulation."""
    from mini_vllm.model_executor.layers.quantization.int8 import Int8Config

    g = torch.Generator().manual_seed(2)
    w, bias = torch.randn(32, 80, generator=g), torch.randn(32, generator=g)
    layer = LinearBase(80, [32], quant_config=Int8Config())
    layer.quant_method = impl.int8.Int8WeightOnlyLinearMethod()
    layer.weight.data.copy_(w)
    layer.quant_method.process_weights_after_loading(layer)  # the reference's (Lab 10.4's)
    x = torch.randn(6, 80, generator=g).to(dtype)
    got = written(layer.quant_method.apply, layer, x, bias.to(dtype))
    w_hat = layer.weight.to(dtype) * layer.weight_scale.to(dtype)
    want = F.linear(x, w_hat, bias.to(dtype))
    assert got.dtype == dtype and torch.equal(got, want), (
        f"{dtype}: apply must be F.linear(x, q * scale, bias), the weight widened to x's "
        f"dtype; largest difference {(got.float() - want.float()).abs().max().item():.3g}"
    )
    if dtype == torch.float32:
        exact = F.linear(x, w, bias)
        s = layer.weight_scale.view(1, -1)
        k = x.shape[1]
        bound = x.abs().sum(1, keepdim=True) * s / 2 + 2 * k * F32 * (x.abs() @ w.abs().t() + 1)
        assert ((got - exact).abs() <= bound).all(), "beyond int8's rounding bound (s / 2 a weight)"
