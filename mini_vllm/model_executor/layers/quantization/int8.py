"""int8 weight-only (W8A16) linear layers: one scale per output channel.

mini_vllm's own method, ``quantization="int8_per_channel"``. Upstream's
nearest is the ``int8_per_channel_weight_only`` shorthand
(vllm/config/quantization.py), which at v0.22.1 quantizes MoE experts only
(``Int8OnlineMoEMethod`` (vllm/model_executor/layers/quantization/online/int8.py:30))
and leaves linear layers unquantized; checkpoints reach int8 linears through
compressed-tensors. Left out: int8 activations (W8A8), group-wise scales,
int8 GEMM kernels.

At load, each output row ``w`` of the weight gets ``scale = amax(|w|) / 127``
and ``q = round(w / scale)`` in [-127, 127] (int8): every weight moves by at
most ``scale / 2``. At run time the row is widened back, ``q * scale``, in
the activations' dtype, and the matmul is an ordinary float one: only the
weights lose precision (weight-only), and memory holds a byte a weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mini_vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
)
from mini_vllm.model_executor.layers.quantization.base_config import QuantizationConfig

INT8_MAX = 127


class Int8Config(QuantizationConfig):
    """int8 weights, per output channel, on every linear layer."""

    def get_name(self) -> str:
        return "int8_per_channel"

    def get_quant_method(self, layer: nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            return Int8WeightOnlyLinearMethod()
        return None


# BEGIN LAB 10.2: int8 per output channel
def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 [out, in], float32 scale [out, 1]), ``weight ≈ q * scale``."""
    # HINT: in float32: a row's scale is amax(|row|) / INT8_MAX (an all-zero row gets 1.0,
    # HINT: not 0); q = round(w / scale) (divide, as upstream), clamped to +-INT8_MAX.
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=1, keepdim=True) / INT8_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero row
    q = torch.round(w / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


# END LAB 10.2


class Int8WeightOnlyLinearMethod(LinearMethodBase):
    def create_weights(self, layer, input_size, output_partition_sizes, params_dtype):
        UnquantizedLinearMethod().create_weights(
            layer, input_size, output_partition_sizes, params_dtype
        )

    # BEGIN LAB 10.4: quantize the loaded float weight to int8, once
    def process_weights_after_loading(self, layer):
        """``layer.weight`` (float [out, in]) -> int8 ``layer.weight`` and float32
        ``layer.weight_scale`` [out, 1]."""
        # HINT: quantize_int8_per_channel does the numbers; replace both parameters
        # HINT: (nn.Parameter, requires_grad=False).
        qweight, scale = quantize_int8_per_channel(layer.weight.data)
        layer.weight = nn.Parameter(qweight, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    # END LAB 10.4

    # BEGIN LAB 10.2: the int8 weight widened back, then an ordinary matmul
    def apply(self, layer, x, bias=None):
        """``x [T, in]`` -> ``[T, out]``: only the weight was quantized (W8A16)."""
        # HINT: widen q and its per-row scale to x's dtype, multiply them (the weight
        # HINT: dequantized, [out, in]), then F.linear with the bias.
        weight = layer.weight.to(x.dtype) * layer.weight_scale.to(x.dtype)
        return F.linear(x, weight, bias)

    # END LAB 10.2
