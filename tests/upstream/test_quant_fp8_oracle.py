"""``QuantFP8.forward_native`` against the pinned upstream's own, on CPU.

Upstream's ``QuantFP8`` is a CustomOp: it is built inside
``set_current_vllm_config`` with a CPU ``DeviceConfig`` (DESIGN.md), then
both quantize the same inputs. The fp8 bytes and the scales must be
bit-identical, for dynamic per-token and per-tensor scales, a static scale,
and a per-token cap (``scale_ub``), on values spread over 16 decades (the
normal and subnormal ranges of e4m3, an all-zero row, values that clamp).
"""

from __future__ import annotations

import os

import pytest
import torch

from mini_vllm.model_executor.layers.quantization.input_quant_fp8 import GroupShape, QuantFP8

pytestmark = pytest.mark.upstream


@pytest.fixture(scope="module")
def upstream_quant_fp8():
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8 as UpQuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape as UpShape

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        return {
            "per_token": UpQuantFP8(static=False, group_shape=UpShape.PER_TOKEN),
            "per_tensor": UpQuantFP8(static=False, group_shape=UpShape.PER_TENSOR),
            "static": UpQuantFP8(static=True, group_shape=UpShape.PER_TENSOR),
        }


MINI = {
    "per_token": QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN),
    "per_tensor": QuantFP8(static=False, group_shape=GroupShape.PER_TENSOR),
    "static": QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR),
}


def inputs(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 96, generator=g) * torch.logspace(-10, 5, 16).unsqueeze(1)
    x[3] = 0.0  # an all-zero token: the minimum scale
    x[5, :4] = torch.tensor([1e30, -1e30, 0.5, -0.0])
    return x


@pytest.mark.parametrize("kind", ["per_token", "per_tensor", "static"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quant_fp8_matches_upstream(upstream_quant_fp8, kind, dtype, seed):
    x = inputs(seed).to(dtype)
    scale = torch.tensor([0.37]) if kind == "static" else None
    q_up, s_up = upstream_quant_fp8[kind].forward_native(x, scale)
    q_mini, s_mini = MINI[kind].forward_native(x, scale)
    assert q_mini.dtype == q_up.dtype == torch.float8_e4m3fn
    assert torch.equal(q_mini.view(torch.uint8), q_up.view(torch.uint8))
    assert torch.equal(s_mini, s_up) and s_mini.shape == s_up.shape


def near_ties(scale: torch.Tensor) -> torch.Tensor:
    """Values that land next to a midpoint between two e4m3 numbers once divided by
    ``scale``: there ``x / scale`` and ``x * (1 / scale)`` can round to different fp8
    values, so these tell upstream's reciprocal-multiply from a division."""
    fp8 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    fp8 = fp8[torch.isfinite(fp8) & (fp8 > 0)].unique().sort().values
    x = ((fp8[:-1] + fp8[1:]) / 2 * scale).float()
    up, down = torch.full_like(x, 1e9), torch.zeros_like(x)
    return torch.cat([x, torch.nextafter(x, up), torch.nextafter(x, down)])


def test_quant_fp8_static_near_ties_matches_upstream(upstream_quant_fp8):
    scale = torch.tensor([0.37])
    x = near_ties(scale).reshape(-1, 15)
    divided = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    q_up, _ = upstream_quant_fp8["static"].forward_native(x, scale)
    assert (divided != q_up.view(torch.uint8)).any(), "the inputs no longer tell the two apart"
    q_mini, _ = MINI["static"].forward_native(x, scale)
    assert torch.equal(q_mini.view(torch.uint8), q_up.view(torch.uint8))


def test_quant_fp8_scale_ub_matches_upstream(upstream_quant_fp8):
    x, ub = inputs(3), torch.tensor(2.0)
    q_up, s_up = upstream_quant_fp8["per_token"].forward_native(x, None, ub)
    q_mini, s_mini = MINI["per_token"].forward_native(x, None, ub)
    assert torch.equal(q_mini.view(torch.uint8), q_up.view(torch.uint8))
    assert torch.equal(s_mini, s_up)


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_linear_quantizes_like_upstream(upstream_quant_fp8, per_channel):
    """The fp8 linear layer: weight and activations quantized by upstream's QuantFP8
    (weight per tensor, or per row = per output channel; activations per token),
    then the fp8 product scaled back."""
    from mini_vllm.model_executor.layers.linear import LinearBase
    from mini_vllm.model_executor.layers.quantization.fp8 import (
        Fp8Config,
        Fp8OnlineLinearMethod,
    )

    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 96, generator=g)
    layer = LinearBase(96, [40], quant_config=Fp8Config(weight_per_channel=per_channel))
    assert isinstance(layer.quant_method, Fp8OnlineLinearMethod)
    layer.weight.data.copy_(w)
    layer.quant_method.process_weights_after_loading(layer)
    wkind = "per_token" if per_channel else "per_tensor"
    qw, sw = upstream_quant_fp8[wkind].forward_native(w)
    assert torch.equal(layer.weight.view(torch.uint8), qw.view(torch.uint8))
    x = inputs(5)  # tokens 16 decades apart: per-token and per-tensor scales differ
    qx, sx = upstream_quant_fp8["per_token"].forward_native(x)
    expected = (qx.float() @ qw.float().t()) * sx * sw.view(1, -1)
    assert torch.equal(layer(x), expected)
