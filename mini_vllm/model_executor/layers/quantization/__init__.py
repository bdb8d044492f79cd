"""Quantization methods by name: ``quantization=...`` on ``LLM``, the CLI and the server.

Mirrors upstream ``vllm/model_executor/layers/quantization/__init__.py`` at
v0.22.1 (the ``QuantizationMethods`` literal, and ``get_quantization_config``
at :109) with the methods mini_vllm has. The check of a name against the model
is upstream's ``ModelConfig._verify_quantization`` (vllm/config/model.py);
here ``verify_quantization``, run before the model loads.
"""

from __future__ import annotations

from mini_vllm.model_executor.layers.quantization.base_config import QuantizationConfig

# "gguf" and "fp8" are upstream's; "fp8_per_channel" and "int8_per_channel" are
# mini_vllm's own (see fp8.py and int8.py for what upstream has instead).
QUANTIZATION_METHODS: list[str] = ["gguf", "fp8", "fp8_per_channel", "int8_per_channel"]


def verify_quantization(quantization: str | None, checkpoint_kind: str | None = None) -> None:
    """ValueError in one line for an unknown method or one the checkpoint cannot take.

    ``checkpoint_kind``: "gguf" or "hf" (see model_loader.find_checkpoint), None if unknown."""
    if quantization is None:
        return
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"Unknown quantization method: {quantization}. Must be one of {QUANTIZATION_METHODS}."
        )
    if quantization == "gguf" and checkpoint_kind not in (None, "gguf"):
        raise ValueError(
            "quantization='gguf' keeps a GGUF file's weights quantized: the model must be "
            "a .gguf file (or a folder holding one)."
        )


def get_quantization_config(quantization: str) -> type[QuantizationConfig]:
    """The config class for a method name."""
    verify_quantization(quantization)
    from mini_vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from mini_vllm.model_executor.layers.quantization.gguf import GGUFConfig
    from mini_vllm.model_executor.layers.quantization.int8 import Int8Config

    return {
        "gguf": GGUFConfig,
        "fp8": Fp8Config,
        "fp8_per_channel": Fp8Config,
        "int8_per_channel": Int8Config,
    }[quantization]


def make_quant_config(quantization: str) -> QuantizationConfig:
    """A config for an online method (one that quantizes float weights at load)."""
    config_cls = get_quantization_config(quantization)
    if quantization == "fp8_per_channel":
        return config_cls(weight_per_channel=True)
    return config_cls()


__all__ = [
    "QUANTIZATION_METHODS",
    "get_quantization_config",
    "make_quant_config",
    "verify_quantization",
]
