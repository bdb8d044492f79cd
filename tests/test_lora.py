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
