"""Which of the model's modules an adapter may adapt.

Mirrors upstream ``vllm/lora/utils.py`` at v0.22.1: ``is_supported_lora_module``
(:232), which ``LoRAModelManager._match_target_modules``
(vllm/lora/model_manager.py:671) asks for every module of the model. Left out:
the rest of that file (``is_in_target_modules``, for ``LoRAConfig``'s
``target_modules``; ``parse_fine_tuned_lora_name``, whose PEFT-name parsing
``LoRAModel.from_local_checkpoint`` does inline; adapter paths on the Hugging
Face hub; the MoE and embedding helpers).
"""

from __future__ import annotations


def is_supported_lora_module(module_name: str, supported_lora_modules: list[str]) -> bool:
    """Whether ``module_name`` (a full dotted name, such as
    ``model.layers.0.self_attn.o_proj``) is one of ``supported_lora_modules``
    or ends with one of them after a dot. Whole names only: ``proj`` does not
    match ``o_proj``."""
    return any(
        module_name == suffix or module_name.endswith("." + suffix)
        for suffix in supported_lora_modules
    )
