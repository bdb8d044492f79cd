"""SiluAndMul: the gated activation of a SwiGLU MLP.

Mirrors upstream ``vllm/model_executor/layers/activation.py`` at v0.22.1
(``SiluAndMul`` at :118). Left out: the fused CUDA/XPU kernel behind
CustomOp, and every other activation in that file.

The MLP's gate and up projections are computed by one matmul whose output
is ``[gate | up]`` along the last dimension; this layer returns
``silu(gate) * up``, halving the last dimension.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2 * d] -> [..., d]."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
