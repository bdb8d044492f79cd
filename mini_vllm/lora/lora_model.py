"""One LoRA adapter read from a PEFT folder: its matrices per module, checked.

Mirrors upstream ``vllm/lora/lora_model.py`` at v0.22.1 (``LoRAModel`` :60,
``from_local_checkpoint`` :167) with the checks of upstream's
``PEFTHelper.validate_legal`` (vllm/lora/peft_helper.py:114). Left out: ``.bin`` and tensorizer
checkpoints, DoRA, extra vocabularies and embedding/``lm_head`` adapters,
MoE experts, bias adapters (refused, as upstream refuses them).

A PEFT folder holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``) and ``adapter_model.safetensors``, whose
keys read ``base_model.model.<module>.lora_A.weight`` ([r, in]) and
``...lora_B.weight`` ([out, r]). The scaling, ``lora_alpha / r`` (or
``lora_alpha / sqrt(r)`` with rsLoRA), is multiplied into ``lora_b`` once at
load, as upstream's ``LoRALayerWeights.optimize`` does, so a forward adds
``x A^T B^T`` with no scale.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

PEFT_PREFIX = "base_model.model."


@dataclass
class LoRALayerWeights:
    """One module's adapter: ``lora_a`` [rank, in], ``lora_b`` [out, rank] (scaled)."""

    module_name: str
    rank: int
    lora_a: torch.Tensor
    lora_b: torch.Tensor


class LoRAModel:
    def __init__(self, lora_model_id: int, rank: int, loras: dict[str, LoRALayerWeights]):
        self.id = lora_model_id
        self.rank = rank
        # PEFT module name (model.layers.0.self_attn.q_proj) -> its weights.
        self.loras = loras

    def get_lora(self, module_name: str) -> LoRALayerWeights | None:
        return self.loras.get(module_name)

    @classmethod
    def from_local_checkpoint(
        cls,
        lora_dir: str,
        expected_lora_modules: set[str],
        lora_model_id: int,
        max_lora_rank: int,
        dtype: torch.dtype = torch.float32,
    ) -> LoRAModel:
        """Read and check a PEFT folder. ``expected_lora_modules``: the module
        suffixes the model can adapt (q_proj, ..., down_proj). One ValueError,
        one line, for a missing file, a rank above ``max_lora_rank``, a bias
        adapter, or a module the model lacks."""
        from safetensors.torch import load_file

        config_path = os.path.join(lora_dir, "adapter_config.json")
        tensors_path = os.path.join(lora_dir, "adapter_model.safetensors")
        for path in (config_path, tensors_path):
            if not os.path.isfile(path):
                raise ValueError(f"LoRA adapter {lora_dir!r}: no file {os.path.basename(path)}.")
        with open(config_path) as f:
            config = json.load(f)
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
        if rank > max_lora_rank:
            raise ValueError(
                f"LoRA adapter {lora_dir!r}: rank r={rank} is greater than "
                f"max_lora_rank={max_lora_rank}."
            )
        if config.get("bias", "none") != "none":
            raise ValueError(
                f"LoRA adapter {lora_dir!r}: bias={config['bias']!r} is not supported."
            )
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in load_file(tensors_path).items():
            name = key.removeprefix(PEFT_PREFIX)
            module, _, part = name.rpartition(".lora_")
            if part not in ("A.weight", "B.weight"):
                raise ValueError(f"LoRA adapter {lora_dir!r}: unexpected tensor {key!r}.")
            pairs.setdefault(module, {})[part[0]] = tensor
        unexpected = sorted({m.rsplit(".", 1)[-1] for m in pairs} - set(expected_lora_modules))
        if unexpected:
            raise ValueError(
                f"LoRA adapter {lora_dir!r}: target modules {unexpected} are not in the "
                f"model's LoRA modules {sorted(expected_lora_modules)}."
            )
        loras = {}
        for module, ab in pairs.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"LoRA adapter {lora_dir!r}: {module} lacks lora_A or lora_B.")
            loras[module] = LoRALayerWeights(
                module, rank, ab["A"].to(dtype), (ab["B"] * scaling).to(dtype)
            )
        return cls(lora_model_id, rank, loras)
