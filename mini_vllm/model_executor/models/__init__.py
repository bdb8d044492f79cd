"""Model classes by Hugging Face architecture name.

Mirrors upstream ``vllm/model_executor/models/registry.py`` at v0.22.1
(the ``_TEXT_GENERATION_MODELS`` table and
``_ModelRegistry.resolve_model_cls`` at :1202), cut down to a dict of the
architectures mini_vllm implements. Left out: lazy imports, out-of-tree
registration, the Transformers-backend fallback, pooling models, every
multimodal model but LLaVA (upstream's multimodal table, registry.py:345: one
table here) and model inspection.

Every class here has the same interface: ``Model(hf_config)``,
``forward(input_ids [T], positions [T]) -> hidden_states [T, hidden]``,
``compute_logits(hidden_states) -> [N, vocab]``, ``attention_layers()`` and
``load_weights(iterable of (hf_name, tensor))``.
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from mini_vllm.model_executor.models.llama import LlamaForCausalLM
from mini_vllm.model_executor.models.llava import LlavaForConditionalGeneration
from mini_vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

_TEXT_GENERATION_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    # transformers' Ministral: Llama with per-layer sliding windows
    # (``layer_types``), which upstream's llama.py honours (:184-203).
    # Upstream's table has no entry for it (its Transformers backend runs it).
    "MinistralForCausalLM": LlamaForCausalLM,
    # A vision-language model (Phase 13): CLIP tower + projector + Llama.
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
}

# For configs that name no architecture (transformers' GGUF parsing, say).
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "ministral": "MinistralForCausalLM",
    "llava": "LlavaForConditionalGeneration",
}


def get_supported_archs() -> list[str]:
    return sorted(_TEXT_GENERATION_MODELS)


def resolve_model_cls(hf_config: PretrainedConfig) -> type[nn.Module]:
    """The class for ``hf_config.architectures[0]`` (or, if absent, its ``model_type``)."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in _MODEL_TYPE_TO_ARCH:
            raise ValueError(
                f"config names no architecture and its model_type {model_type!r} is "
                f"not supported; supported architectures: {get_supported_archs()}"
            )
        archs = [_MODEL_TYPE_TO_ARCH[model_type]]
    arch = archs[0]
    if arch not in _TEXT_GENERATION_MODELS:
        raise ValueError(
            f"Model architecture {arch!r} is not supported by mini_vllm; "
            f"supported architectures: {get_supported_archs()}"
        )
    return _TEXT_GENERATION_MODELS[arch]


__all__ = [
    "LlamaForCausalLM",
    "LlavaForConditionalGeneration",
    "Qwen3ForCausalLM",
    "get_supported_archs",
    "resolve_model_cls",
]
