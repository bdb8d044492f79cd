"""Which adapters sit in the layers' slots, and which stay loaded on the host.

Mirrors upstream ``vllm/lora/model_manager.py`` at v0.22.1 (``LoRAModelManager``
:64: ``activate_adapter`` :285, ``_deactivate_adapter`` :326,
``_create_lora_modules`` :375; ``LRUCacheLoRAModelManager`` :1163:
``add_adapter`` :1196, ``activate_adapter`` :1208) and, in
``set_active_adapters``, the worker's side of it
(``LRUCacheWorkerLoRAManager._apply_adapters``, vllm/lora/worker_manager.py).
Left out: pinning, dummy adapters for warm-up, multimodal and MoE modules,
tensor parallelism.

Two LRU caches: ``max_cpu_loras`` adapters kept loaded (``_registered_adapters``)
and ``max_loras`` of them in the layers' slots (``_active_adapters``,
``lora_index_to_id`` says which slot holds which adapter id). Activating an
adapter that is not in a slot takes the first free slot, after evicting the
least recently used active adapter when all are taken; the scheduler's
``max_loras`` limit guarantees that a step's adapters all fit.

``load_adapter`` also checks each matrix's shape against the projection it
adapts (an adapter made for another base model fails with one line), where
upstream copies the matrix into its slot at activation and fails there only if
it is too large (UPSTREAM_PIN.md, Phase 11).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from mini_vllm.lora.layers import BaseLinearLayerWithLoRA
from mini_vllm.lora.lora_model import LoRAModel
from mini_vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
from mini_vllm.lora.request import LoRARequest
from mini_vllm.lora.utils import is_supported_lora_module

# The model's fused layers and the PEFT modules (Hugging Face names) each
# holds, in shard order (upstream's ``packed_modules_mapping`` of Llama).
PACKED_MODULES_MAPPING = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}
# The modules an adapter may target, by their Hugging Face names.
SUPPORTED_LORA_MODULES = {
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
}


class LRUCacheLoRAModelManager:
    def __init__(self, model: nn.Module, lora_config, dtype: torch.dtype, device) -> None:
        self.model = model
        self.lora_config = lora_config
        self.lora_slots = lora_config.max_loras
        self.capacity = lora_config.max_cpu_loras
        self.dtype = dtype
        self.lora_index_to_id: list[int | None] = [None] * self.lora_slots
        self.punica_wrapper = PunicaWrapperCPU()
        self._registered_adapters: OrderedDict[int, LoRAModel] = OrderedDict()
        self._active_adapters: OrderedDict[int, None] = OrderedDict()
        self.modules: dict[str, BaseLinearLayerWithLoRA] = {}
        # PEFT module name -> (in, out) of the projection (the shard of a fused layer).
        self.module_shapes: dict[str, tuple[int, int]] = {}
        self._create_lora_modules(device)

    def _create_lora_modules(self, device) -> None:
        """Wrap every adaptable linear layer of the model in place."""
        names = [
            name
            for name, module in self.model.named_modules()
            if is_supported_lora_module(name, [*PACKED_MODULES_MAPPING, *SUPPORTED_LORA_MODULES])
            and hasattr(module, "output_sizes")
        ]
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = self.model.get_submodule(parent_name)
            layer = BaseLinearLayerWithLoRA(getattr(parent, child))
            layer.create_lora_weights(
                self.lora_slots, self.lora_config.max_lora_rank, self.dtype, device
            )
            layer.punica_wrapper = self.punica_wrapper
            setattr(parent, child, layer)
            self.modules[name] = layer
            parts = PACKED_MODULES_MAPPING.get(child, [child])
            for part, size in zip(parts, layer.output_slices, strict=True):
                self.module_shapes[f"{parent_name}.{part}"] = (layer.base_layer.input_size, size)

    def load_adapter(self, lora_request: LoRARequest) -> LoRAModel:
        """Read and check the adapter's PEFT folder (ValueError, one line, if bad)."""
        lora = LoRAModel.from_local_checkpoint(
            lora_request.lora_path,
            SUPPORTED_LORA_MODULES,
            lora_request.lora_int_id,
            self.lora_config.max_lora_rank,
            self.dtype,
        )
        self._check_shapes(lora, lora_request.lora_path)
        return lora

    def _check_shapes(self, lora: LoRAModel, lora_dir: str) -> None:
        """Each lora_A must be [r, in] and each lora_B [out, r] for the
        projection it adapts: other shapes mean an adapter for another base
        model. A module this model lacks (a layer past its last) is skipped,
        as upstream's ``activate_adapter`` skips it."""
        for name, weights in lora.loras.items():
            if name not in self.module_shapes:
                continue
            d_in, d_out = self.module_shapes[name]
            wants = {"A": (weights.rank, d_in), "B": (d_out, weights.rank)}
            for part, tensor in (("A", weights.lora_a), ("B", weights.lora_b)):
                if tuple(tensor.shape) != wants[part]:
                    raise ValueError(
                        f"LoRA adapter {lora_dir!r}: {name}.lora_{part} has shape "
                        f"{list(tensor.shape)}, but this base model needs {list(wants[part])} "
                        "(an adapter for another base model?)."
                    )

    # BEGIN LAB 11.3: keep an adapter loaded on the host, least recently used out
    def add_adapter(self, lora: LoRAModel) -> bool:
        """Keep ``lora`` loaded on the host (evicting the least recently used
        when ``max_cpu_loras`` are); False if it already was (it is touched)."""
        # HINT: _registered_adapters is an OrderedDict, least recently used first. An id
        # HINT: already there is touched (moved to the end) and returns False; a new one,
        # HINT: when capacity (max_cpu_loras) adapters are loaded, first removes the oldest
        # HINT: (remove_adapter: out of its slot too), then joins at the end: True.
        if lora.id in self._registered_adapters:
            self._registered_adapters.move_to_end(lora.id)
            return False
        if len(self._registered_adapters) >= self.capacity:
            oldest = next(iter(self._registered_adapters))
            self.remove_adapter(oldest)
        self._registered_adapters[lora.id] = lora
        return True

    # END LAB 11.3

    def remove_adapter(self, adapter_id: int) -> bool:
        self.deactivate_adapter(adapter_id)
        return self._registered_adapters.pop(adapter_id, None) is not None

    # BEGIN LAB 11.3: put a loaded adapter in a slot, least recently used out
    def activate_adapter(self, lora_id: int) -> bool:
        """Put a registered adapter in a slot; False if it already had one (it is touched)."""
        # HINT: _active_adapters (OrderedDict, oldest first) holds the ids in slots. Already
        # HINT: active: touch it, return False. Otherwise, when all lora_slots are taken,
        # HINT: deactivate the oldest; take the first free slot (None in lora_index_to_id),
        # HINT: record the id there and at the end of _active_adapters, and set_lora that slot
        # HINT: on every module with _get_lora_layer_weights(lora, name). Reading the adapter
        # HINT: from _registered_adapters is a use: it moves to that cache's end too. True.
        if lora_id in self._active_adapters:
            self._active_adapters.move_to_end(lora_id)
            return False
        if len(self._active_adapters) >= self.lora_slots:
            self.deactivate_adapter(next(iter(self._active_adapters)))
        index = self.lora_index_to_id.index(None)
        lora = self._registered_adapters[lora_id]
        # Upstream reads it from its host LRU cache (vllm/lora/model_manager.py:304),
        # a lookup that counts as a use: it becomes the most recently used there too.
        self._registered_adapters.move_to_end(lora_id)
        self.lora_index_to_id[index] = lora_id
        self._active_adapters[lora_id] = None
        for name, module in self.modules.items():
            module.set_lora(index, *self._get_lora_layer_weights(lora, name))
        return True

    # END LAB 11.3

    # BEGIN LAB 11.3: free an adapter's slot
    def deactivate_adapter(self, adapter_id: int) -> bool:
        # HINT: not active: False. Else drop it from _active_adapters, put None in its slot
        # HINT: of lora_index_to_id, reset_lora that slot on every module, return True.
        if adapter_id not in self._active_adapters:
            return False
        del self._active_adapters[adapter_id]
        index = self.lora_index_to_id.index(adapter_id)
        self.lora_index_to_id[index] = None
        for module in self.modules.values():
            module.reset_lora(index)
        return True

    # END LAB 11.3

    def _get_lora_layer_weights(self, lora: LoRAModel, module_name: str):
        """Per shard of the module, the adapter's (lora_a, lora_b) or None."""
        parent, _, child = module_name.rpartition(".")
        parts = PACKED_MODULES_MAPPING.get(child, [child])
        found = [lora.get_lora(f"{parent}.{part}") for part in parts]
        return [w and w.lora_a for w in found], [w and w.lora_b for w in found]

    def set_active_adapters(
        self, lora_requests: Iterable[LoRARequest], token_lora_mapping: Sequence[int]
    ) -> None:
        """Make the step's adapters active (loading any the host lacks) and
        give the layers each token's slot."""
        requests = list(lora_requests)
        if len(requests) > self.lora_slots:
            raise RuntimeError(
                f"{len(requests)} adapters in one step, but max_loras={self.lora_slots}."
            )
        for request in requests:
            if request.lora_int_id not in self._registered_adapters:
                self.add_adapter(self.load_adapter(request))
            else:
                self._registered_adapters.move_to_end(request.lora_int_id)
            self.activate_adapter(request.lora_int_id)
        self.punica_wrapper.update_metadata(token_lora_mapping, self.lora_index_to_id)

    def list_adapters(self) -> dict[int, LoRAModel]:
        return dict(self._registered_adapters)
