"""Quantizing activations to fp8 (e4m3): one scale per tensor or per token.

Mirrors upstream ``vllm/model_executor/layers/quantization/input_quant_fp8.py``
at v0.22.1: ``QuantFP8`` (:30) and its ``forward_native`` (:188), with
``GroupShape`` from utils/quant_utils.py. Left out: the CUDA / ROCm paths
(``forward_cuda``, ``forward_hip``), group (block) quantization, token
padding, scale layouts for DeepGEMM, the CustomOp registration.

e4m3 keeps 3 mantissa bits and an exponent from -6 to 8 (largest finite
value 448), so rounding a value in its normal range costs at most 2^-4 of
it; below 2^-6 (subnormals) the steps are a fixed 2^-9. A scale maps the
largest magnitude onto 448: ``x ≈ q * scale`` with ``scale = amax / 448``
(never below ``1 / (448 * 512)``, so an all-zero row does not divide by
zero). Dynamic quantization computes the scale from ``x`` itself, per
token (one scale a row) or per tensor; static quantization is given it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
_FP8_MIN = torch.finfo(FP8_DTYPE).min
_FP8_MAX = torch.finfo(FP8_DTYPE).max
_FP8_MIN_SCALING_FACTOR = 1.0 / (_FP8_MAX * 512.0)


class GroupShape(NamedTuple):
    """How many rows and columns share one scale; -1 means all of them."""

    row: int
    col: int


GroupShape.PER_TENSOR = GroupShape(-1, -1)
GroupShape.PER_TOKEN = GroupShape(1, -1)


class QuantFP8:
    """``x [T, H]`` -> ``(q fp8 [T, H], scale float32)``, ``x ≈ q * scale``."""

    def __init__(self, static: bool, group_shape: GroupShape) -> None:
        if group_shape not in (GroupShape.PER_TENSOR, GroupShape.PER_TOKEN):
            raise ValueError(
                f"group_shape must be GroupShape.PER_TENSOR or PER_TOKEN, got {group_shape}"
            )
        if static and group_shape != GroupShape.PER_TENSOR:
            raise ValueError("static fp8 quantization takes one per-tensor scale")
        self.static = static
        self.group_shape = group_shape
        self.use_per_token_if_dynamic = group_shape == GroupShape.PER_TOKEN

    def __call__(self, x, scale=None, scale_ub=None):
        return self.forward_native(x, scale, scale_ub)

    def forward_native(
        self,
        x: torch.Tensor,
        scale: torch.Tensor | None = None,
        scale_ub: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize ``x``; ``scale`` is given if and only if static. ``scale_ub`` caps
        each token's amax (dynamic per-token only)."""
        if (scale is not None) != self.static:
            raise ValueError("QuantFP8: give a scale exactly when static=True")
        if scale_ub is not None and (self.static or not self.use_per_token_if_dynamic):
            raise ValueError("QuantFP8: scale_ub caps dynamic per-token scales only")
        if scale is None:
            # BEGIN LAB 10.2: the dynamic scale: per token or per tensor
            # HINT: receives x, scale_ub, self.use_per_token_if_dynamic; leaves scale, float32:
            # HINT: [T, 1] per token (one a row), [1] per tensor.
            # HINT: scale = amax(|x|) / _FP8_MAX (a token's amax capped at scale_ub when one is
            # HINT: given), never below _FP8_MIN_SCALING_FACTOR; take the amax in x's dtype,
            # HINT: then widen it to float32.
            if self.use_per_token_if_dynamic:
                x_max = x.abs().max(dim=-1).values.unsqueeze(-1).to(torch.float32)
                if scale_ub is not None:
                    x_max = x_max.clamp(max=scale_ub)
            else:
                x_max = x.abs().max().unsqueeze(-1).to(torch.float32)
            scale = (x_max / _FP8_MAX).clamp(min=_FP8_MIN_SCALING_FACTOR)
            # END LAB 10.2
        # BEGIN LAB 10.2: x / scale, clamped to e4m3's range, cast
        # HINT: receives x, scale; returns (q, scale), q in FP8_DTYPE with x's shape.
        # HINT: as upstream: multiply by the reciprocal of the scale (in float32), do not
        # HINT: divide: near a rounding tie the two give different fp8 values. Clamp to
        # HINT: [_FP8_MIN, _FP8_MAX] before the cast (a cast does not saturate).
        out = x.to(torch.float32) * scale.to(torch.float32).reciprocal()
        return out.clamp(_FP8_MIN, _FP8_MAX).to(FP8_DTYPE), scale
        # END LAB 10.2
