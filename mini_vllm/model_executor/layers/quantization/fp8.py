"""fp8 (e4m3) weights quantized at load, activations quantized per token at run time.

Mirrors upstream ``vllm/model_executor/layers/quantization/fp8.py`` at
v0.22.1: ``Fp8Config`` (:100) and ``Fp8OnlineLinearMethod`` (:488), the
method upstream picks for ``quantization="fp8"`` on a checkpoint that is not
already fp8: load the float weights, then quantize them in
``process_weights_after_loading`` with one scale for the whole weight.
``quantization="fp8_per_channel"`` is mini_vllm's own name for one scale
per output channel (upstream reads per-channel fp8 weights only from
checkpoints, e.g. compressed-tensors). Left out: fp8 checkpoints
(``Fp8LinearMethod``), block scales, static activation scales, MoE, the
fp8 KV cache (see the attention backends), and the fp8 GEMM kernels.

The product: with ``x ≈ qx * sx`` (``QuantFP8``, one scale a token) and
``W ≈ qW * sW``, ``x W^T ≈ (qx qW^T) * sx * sW``. Upstream's
``torch._scaled_mm`` multiplies fp8 by fp8 on the GPU; here the fp8 values
are widened to float32 (exactly) and multiplied there, then scaled: the
same quantities, with float32 accumulation. The weight stays [out, in]
(upstream stores it transposed for the kernel).
"""

from __future__ import annotations

import torch
from torch import nn

from mini_vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
)
from mini_vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from mini_vllm.model_executor.layers.quantization.input_quant_fp8 import GroupShape, QuantFP8


class Fp8Config(QuantizationConfig):
    """fp8 weights on every linear layer (the embedding and LM head stay unquantized)."""

    def __init__(self, weight_per_channel: bool = False) -> None:
        self.weight_per_channel = weight_per_channel

    def get_name(self) -> str:
        return "fp8_per_channel" if self.weight_per_channel else "fp8"

    def get_quant_method(self, layer: nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            return Fp8OnlineLinearMethod(self)
        return None


class Fp8OnlineLinearMethod(LinearMethodBase):
    """Loads the float weight as is; quantizes it once loading ends."""

    def __init__(self, quant_config: Fp8Config) -> None:
        self.quant_config = quant_config
        # Activations: dynamic, one scale per token.
        self.input_quant = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN)
        # The weight: a tensor scale, or (per channel) one per row, i.e. per output.
        shape = GroupShape.PER_TOKEN if quant_config.weight_per_channel else GroupShape.PER_TENSOR
        self.weight_quant = QuantFP8(static=False, group_shape=shape)

    def create_weights(self, layer, input_size, output_partition_sizes, params_dtype):
        UnquantizedLinearMethod().create_weights(
            layer, input_size, output_partition_sizes, params_dtype
        )

    # BEGIN LAB 10.4: quantize the loaded float weight to fp8, once
    def process_weights_after_loading(self, layer):
        """``layer.weight`` (float [out, in]) -> fp8 ``layer.weight`` and float32
        ``layer.weight_scale`` ([1, 1] per tensor, [1, out] per channel)."""
        # HINT: self.weight_quant is a QuantFP8 built for the weight (per tensor, or per
        # HINT: row = per output channel); replace the parameters (nn.Parameter,
        # HINT: requires_grad=False); apply() multiplies by weight_scale as a row vector.
        qweight, weight_scale = self.weight_quant(layer.weight.data)
        layer.weight = nn.Parameter(qweight, requires_grad=False)  # fp8 [out, in]
        # [1] per tensor, [out, 1] per channel: as a row vector over the outputs.
        layer.weight_scale = nn.Parameter(weight_scale.view(1, -1), requires_grad=False)

    # END LAB 10.4

    # BEGIN LAB 10.2: the fp8 product, scaled back
    def apply(self, layer, x, bias=None):
        """``x [T, in]`` -> ``[T, out]`` in ``x``'s dtype, through fp8 activations and weights."""
        # HINT: quantize x per token with self.input_quant (q, one scale a token), widen both
        # HINT: fp8 operands to float32 (exact), multiply (x W^T), then scale the product:
        # HINT: by each token's scale (a column) and by layer.weight_scale (a row), in that
        # HINT: order; add the bias last; cast back to x's dtype.
        qx, x_scale = self.input_quant(x)  # [T, in] fp8, [T, 1]
        out = torch.mm(qx.to(torch.float32), layer.weight.to(torch.float32).t())
        out = out * x_scale * layer.weight_scale
        if bias is not None:
            out = out + bias
        return out.to(x.dtype)

    # END LAB 10.2
