"""LoRA in mini_vllm's engine front end (Phase 11): requests carry their adapter.

The upstream comparisons live in tests/upstream/test_lora_request_oracle.py
and test_lora_lockstep.py; these check mini_vllm's own plumbing.
"""

from __future__ import annotations

import pytest

from mini_vllm.config import LoRAConfig
from mini_vllm.engine.input_processor import InputProcessor
from mini_vllm.lora.request import LoRARequest
from mini_vllm.sampling_params import SamplingParams


def _processor(lora_config):
    return InputProcessor(None, 64, 4, None, vocab_size=1000, lora_config=lora_config)


def test_a_lora_request_needs_lora_enabled():
    adapter = LoRARequest("a", 1, "/p")
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        _processor(None).process_inputs("r", [1, 2, 3], SamplingParams(), lora_request=adapter)


def test_the_request_carries_its_adapter_into_its_block_hashes():
    processor = _processor(LoRAConfig())
    adapter = LoRARequest("a", 1, "/p")
    _, with_lora = processor.process_inputs("r", list(range(8)), None, lora_request=adapter)
    _, without = processor.process_inputs("s", list(range(8)), None)
    assert with_lora.lora_request is adapter and without.lora_request is None
    assert len(with_lora.block_hashes) == len(without.block_hashes) == 2
    assert not set(with_lora.block_hashes) & set(without.block_hashes)


def test_lora_request_must_be_a_lora_request():
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        _processor(LoRAConfig()).process_inputs("r", [1], None, lora_request="a")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_lora_rank": 7}, "max_lora_rank"),
        ({"max_loras": 0}, "max_loras"),
        ({"max_loras": 2, "max_cpu_loras": 1}, "max_cpu_loras"),
    ],
)
def test_lora_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LoRAConfig(**kwargs).verify()


# ------------------------------------------------------------ the adapter LRU


def _tiny_model():
    """model.layers.0.self_attn.qkv_proj (q/k/v shards) and .mlp.down_proj."""
    from torch import nn

    from mini_vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear

    layer = nn.Module()
    layer.self_attn = nn.Module()
    layer.self_attn.qkv_proj = QKVParallelLinear(8, 2, 2, 1)
    layer.mlp = nn.Module()
    layer.mlp.down_proj = RowParallelLinear(8, 8)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([layer])
    for p in model.parameters():
        nn.init.normal_(p)
    return model


def _adapter(lora_id: int):
    import torch

    from mini_vllm.lora.lora_model import LoRALayerWeights, LoRAModel

    g = torch.Generator().manual_seed(lora_id)
    name = "model.layers.0.self_attn.k_proj"
    weights = LoRALayerWeights(
        name, 2, torch.randn(2, 8, generator=g), torch.randn(2, 2, generator=g)
    )
    return LoRAModel(lora_id, 2, {name: weights})


def _manager(max_loras: int, max_cpu_loras: int):
    import torch

    from mini_vllm.lora.model_manager import LRUCacheLoRAModelManager

    config = LoRAConfig(max_lora_rank=8, max_loras=max_loras, max_cpu_loras=max_cpu_loras)
    config.verify()
    return LRUCacheLoRAModelManager(_tiny_model(), config, torch.float32, "cpu")


def test_active_adapters_evict_the_least_recently_used_slot():
    manager = _manager(max_loras=2, max_cpu_loras=4)
    for i in (1, 2, 3):
        manager.add_adapter(_adapter(i))
    assert manager.activate_adapter(1) and manager.activate_adapter(2)
    assert not manager.activate_adapter(1)  # already in a slot: only touched
    assert manager.activate_adapter(3)  # evicts 2, the least recently used
    assert manager.lora_index_to_id == [1, 3]
    layer = manager.modules["model.layers.0.self_attn.qkv_proj"]
    # adapter 3 sits in slot 1, in the k shard only (rows past rank 2 stay zero)
    assert layer.lora_a_stacked[1][1, 0, :2].equal(
        _adapter(3).loras["model.layers.0.self_attn.k_proj"].lora_a
    )
    assert not layer.lora_a_stacked[1][1, 0, 2:].any()
    assert not layer.lora_a_stacked[0][1].any() and not layer.lora_a_stacked[2][1].any()
    # the spare last slot, used by rows without an adapter, is never written
    assert not any(t[-1].any() for t in layer.lora_a_stacked + layer.lora_b_stacked)


def test_host_cache_evicts_the_least_recently_used_adapter_and_its_slot():
    manager = _manager(max_loras=1, max_cpu_loras=2)
    manager.add_adapter(_adapter(1))
    manager.add_adapter(_adapter(2))
    manager.activate_adapter(1)
    assert not manager.add_adapter(_adapter(1))  # touched: 2 is now the oldest
    manager.add_adapter(_adapter(3))
    assert sorted(manager.list_adapters()) == [1, 3]
    manager.add_adapter(_adapter(2))  # evicts 1, which leaves its slot too
    assert sorted(manager.list_adapters()) == [2, 3]
    assert manager.lora_index_to_id == [None]
    layer = manager.modules["model.layers.0.self_attn.qkv_proj"]
    assert not any(t.any() for t in layer.lora_a_stacked + layer.lora_b_stacked)


def test_one_forward_adds_each_rows_adapter_and_nothing_to_base_rows():
    import torch

    manager = _manager(max_loras=2, max_cpu_loras=2)
    model = manager.model
    layer = manager.modules["model.layers.0.self_attn.qkv_proj"]
    x = torch.randn(5, 8)
    base = layer.base_layer(x)
    requests = [_request(1), _request(2)]
    manager.add_adapter(_adapter(1))
    manager.add_adapter(_adapter(2))
    manager.set_active_adapters(requests, [1, 1, 0, 2, 0])
    y = model.model.layers[0].self_attn.qkv_proj(x)
    for row, lora_id in enumerate([1, 1, 0, 2, 0]):
        want = base[row].clone()
        if lora_id:
            w = _adapter(lora_id).loras["model.layers.0.self_attn.k_proj"]
            want[4:6] += w.lora_b @ (w.lora_a @ x[row])
        torch.testing.assert_close(y[row], want)


def _request(lora_id: int):
    return LoRARequest(f"lora-{lora_id}", lora_id, "/unused")


def _write_peft_folder(folder, tensors: dict, **config) -> str:
    import json

    from safetensors.torch import save_file

    folder.mkdir()
    config = {"r": 2, "lora_alpha": 2, **config}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    prefix = "base_model.model.model.layers"
    save_file(
        {f"{prefix}.{k}.weight": v for k, v in tensors.items()},
        str(folder / "adapter_model.safetensors"),
    )
    return str(folder)


@pytest.mark.parametrize(
    ("module", "a_shape", "b_shape", "message"),
    [
        # q_proj of a wider base: hidden 16, not 8 (upstream's copy into the slot would raise)
        ("0.self_attn.q_proj", (2, 16), (4, 2), r"q_proj.lora_A .* \[2, 16\].*needs \[2, 8\]"),
        # down_proj of a narrower base: out 4, not 8 (upstream would pad it with zeros)
        ("0.mlp.down_proj", (2, 8), (4, 2), r"down_proj.lora_B .* \[4, 2\].*needs \[8, 2\]"),
    ],
)
def test_an_adapter_for_another_base_model_fails_its_load_with_one_line(
    tmp_path, module, a_shape, b_shape, message
):
    import torch

    manager = _manager(max_loras=1, max_cpu_loras=1)
    tensors = {f"{module}.lora_A": torch.ones(a_shape), f"{module}.lora_B": torch.ones(b_shape)}
    folder = _write_peft_folder(tmp_path / "wrong", tensors)
    with pytest.raises(ValueError, match=message) as info:
        manager.load_adapter(LoRARequest("wrong", 1, folder))
    assert "\n" not in str(info.value)


def test_base_model_name_and_layers_past_the_models_are_not_checked(tmp_path):
    """As upstream: adapter_config's base_model_name_or_path is never read, and
    a module in a layer the model lacks is skipped (activate_adapter walks the
    model's modules)."""
    import torch

    manager = _manager(max_loras=1, max_cpu_loras=1)
    tensors = {
        "0.self_attn.k_proj.lora_A": torch.ones(2, 8),
        "0.self_attn.k_proj.lora_B": torch.ones(2, 2),
        "7.self_attn.k_proj.lora_A": torch.ones(2, 99),
        "7.self_attn.k_proj.lora_B": torch.ones(99, 2),
    }
    folder = _write_peft_folder(tmp_path / "ok", tensors, base_model_name_or_path="other/model")
    manager.add_adapter(manager.load_adapter(LoRARequest("ok", 1, folder)))
    assert manager.activate_adapter(1)
    layer = manager.modules["model.layers.0.self_attn.qkv_proj"]
    assert layer.lora_a_stacked[1][0, 0, :2].equal(torch.ones(2, 8))
