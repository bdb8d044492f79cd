"""SiluAndMul: the gated activation of a SwiGLU MLP.

Mirrors upstream ``vllm/model_executor/layers/activation.py`` at v0.22.1
(``SiluAndMul`` at :118; ``QuickGELU`` at :505 and ``get_act_fn`` at :736
for the vision tower, Phase 13). Left out: the fused CUDA/XPU kernels behind
CustomOp, and every other activation in that file.

The MLP's gate and up projections are computed by one matmul whose output
is ``[gate | up]`` along the last dimension; this layer returns
``silu(gate) * up``, halving the last dimension. Upstream's ``forward_native``
(:138) multiplies into a new tensor; here the product is written into SiLU's
own output (``mul_``), the same numbers with one [T, d] allocation and pass
fewer (its fused kernel, ``silu_and_mul``, writes once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2 * d] -> [..., d]."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]).mul_(x[..., d:])


class QuickGELU(nn.Module):
    """``x * sigmoid(1.702 x)``: CLIP's activation (upstream ``QuickGELU``, activation.py:505)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


# The activations the vision tower and projector name (upstream's
# ``_ACTIVATION_REGISTRY``, activation.py:706, cut down).
_ACTIVATION_REGISTRY = {"gelu": nn.GELU, "quick_gelu": QuickGELU, "silu": nn.SiLU}


def get_act_fn(act_fn_name: str) -> nn.Module:
    """The activation a config names (upstream's ``get_act_fn``, activation.py:736)."""
    name = act_fn_name.lower()
    if name not in _ACTIVATION_REGISTRY:
        raise ValueError(
            f"Activation function {act_fn_name!r} is not supported; "
            f"use one of {sorted(_ACTIVATION_REGISTRY)}"
        )
    return _ACTIVATION_REGISTRY[name]()
