"""What every quantization method is made of: a config that picks a method per layer,
and methods that make, load, post-process and apply a layer's weights.

Mirrors upstream ``vllm/model_executor/layers/quantization/base_config.py``
at v0.22.1 (``QuantizeMethodBase`` at :19, ``QuantizationConfig`` further
down). Left out: checkpoint config files (``from_config``,
``get_config_filenames``), minimum GPU capability, activation dtypes,
weight-name mappers, MoE.

A layer built with a config asks it for a method (``get_quant_method``);
``None`` means "leave this layer unquantized". The method then registers
the layer's parameters (``create_weights``), may turn the loaded tensors
into what it computes with (``process_weights_after_loading``, called once
for every layer after the whole checkpoint is in), and computes the layer's
output (``apply``; for embeddings also ``embedding``).
"""

from __future__ import annotations

import torch
from torch import nn


class QuantizeMethodBase:
    """How one layer stores and applies its (maybe quantized) weights."""

    def create_weights(self, layer: nn.Module, *args, **kwargs) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def embedding(self, layer: nn.Module, *args, **kwargs) -> torch.Tensor:
        """Gather rows of an embedding table (embedding layers only)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded tensors into the ones ``apply`` uses (quantize, repack, check)."""
        return None


class QuantizationConfig:
    """One quantization scheme for a whole model."""

    def get_name(self) -> str:
        raise NotImplementedError

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for ``layer`` (named ``prefix`` in the model), or None: unquantized."""
        raise NotImplementedError
