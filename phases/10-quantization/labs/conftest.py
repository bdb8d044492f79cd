"""Fixtures shared by Phase 10's graded suites (helpers: phase10_helpers.py).

- ``upstream_quant_fp8``: the pinned upstream's own ``QuantFP8`` objects
  (vllm/model_executor/layers/quantization/input_quant_fp8.py:30), built on a
  CPU as DESIGN.md says (inside ``set_current_vllm_config`` with a CPU
  ``DeviceConfig``), per token, per tensor and static;
- ``smollm2_float32``: SmolLM2-135M-Instruct loaded once in float32 (its
  GGUF dequantized at load, the model every quantized run of Lab 10.4 is
  measured against), with a fixed text's tokens and its logits there.
"""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def upstream_quant_fp8():
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        return {
            "per_token": QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN),
            "per_tensor": QuantFP8(static=False, group_shape=GroupShape.PER_TENSOR),
            "static": QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR),
        }


@pytest.fixture(scope="session")
def smollm2_float32():
    """(float32 model, the text's token ids, its logits [T, vocab])."""
    from phase10_helpers import TEXT, forward_logits

    from mini_vllm.model_executor.model_loader import load_model, smollm2_gguf_path

    model, _, tokenizer = load_model(smollm2_gguf_path())
    # The quantized layers' matmuls are F.linear's; the loader packs float weights for
    # oneDNN on a CPU (mini_vllm/model_executor/layers/utils.py), which rounds
    # differently: the reference runs F.linear too, so that only the weights differ.
    for module in model.modules():
        if "cpu_linear" in module.__dict__:
            module.cpu_linear = torch.nn.functional.linear
    ids = tokenizer(TEXT)["input_ids"]
    return model, ids, forward_logits(model, ids)
