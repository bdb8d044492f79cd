"""RMSNorm: scale each vector by the inverse of its root mean square.

Mirrors upstream ``vllm/model_executor/layers/layernorm.py`` at v0.22.1
(``RMSNorm`` at :38). Left out: the CustomOp dispatch to fused CUDA/XPU
kernels, ``var_hidden_size``, weightless norms, the batch-invariant path and
the Gemma / gated variants.

Like upstream, ``forward(x, residual)`` optionally fuses the residual add
that precedes every norm in a pre-norm decoder: it returns the normalized
sum *and* the sum itself, which becomes the next residual. The sum is
written in place, into ``x`` (upstream's fused kernel writes it into the
residual; ``forward_native`` :82 calls ``fused_add_rms_norm.maybe_inplace``,
which allows that): callers pass an ``x`` they no longer need. The arithmetic
follows Hugging Face's ``LlamaRMSNorm``: normalize in float32, cast back to
the input dtype, then multiply by the weight.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., hidden] -> normed x; with ``residual``: (norm(x + residual), x + residual)."""
        if residual is not None:
            # The sum is written over x, which the caller hands over (the layer's
            # attention or MLP output), not over the residual it may still hold.
            x = x.add_(residual)
            residual = x
        x32 = x.float()
        variance = x32.pow(2).mean(dim=-1, keepdim=True)
        normed = (x32 * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)
        if normed.dtype == self.weight.dtype:
            out = normed.mul_(self.weight)  # the same product, without a new tensor
        else:
            out = self.weight * normed
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.variance_epsilon}"
