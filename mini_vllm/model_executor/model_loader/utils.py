"""Building an empty model of the right class, dtype and device.

Mirrors upstream ``vllm/model_executor/model_loader/utils.py`` at v0.22.1
(``initialize_model`` at :40, ``process_weights_after_loading`` at :99; the
dtype context is ``set_default_torch_dtype`` (vllm/utils/torch_utils.py:146)).
Left out: the ``vllm_config`` plumbing, CPU offloading, attention layers'
own post-load step.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers import PretrainedConfig

from mini_vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from mini_vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from mini_vllm.model_executor.models import resolve_model_cls


@contextlib.contextmanager
def set_default_torch_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def resolve_dtype(dtype: torch.dtype | str, hf_config: PretrainedConfig) -> torch.dtype:
    """A torch dtype, a name ("float32", "bfloat16", ...) or "auto" (the config's, else float32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        found = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        return resolve_dtype(found, hf_config) if found and found != "auto" else torch.float32
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(
            f"unknown model dtype {dtype!r}: use a floating torch dtype, its name, or 'auto'"
        )
    return resolved


def initialize_model(
    hf_config: PretrainedConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    quant_config: QuantizationConfig | None = None,
) -> nn.Module:
    """The architecture's model class on ``device``, parameters in ``dtype``, left *unset*.

    Like upstream's layers, which allocate with ``torch.empty``, nothing is
    randomly initialized: the model is built on the meta device (shapes
    only), then given uninitialized storage on ``device``. ``load_weights``
    must then fill every parameter, and checks that it does. Buffers are
    computed, not loaded, so they are rebuilt on the real device here.
    """
    model_cls = resolve_model_cls(hf_config)
    with set_default_torch_dtype(dtype), torch.device("meta"):
        model = model_cls(hf_config, quant_config=quant_config)
    model = model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.cos_sin_cache = module._compute_cos_sin_cache().to(device)
    return model.eval()


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer's quantization method finish its weights once all are loaded."""
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)
        if isinstance(quant_method, QuantizeMethodBase):
            quant_method.process_weights_after_loading(module)
