"""What the pinned upstream does with an adapter made for another base model.

mini_vllm's ``LRUCacheLoRAModelManager.load_adapter`` refuses, with one line,
an adapter whose matrices do not fit the projections they adapt
(tests/test_lora.py, tests/test_lora_engine.py). These tests run upstream's own
code to show what it does instead, as UPSTREAM_PIN.md (Phase 11) states:

- its ``BaseLinearLayerWithLoRA.set_lora`` (vllm/lora/layers/base_linear.py:157)
  copies the matrices into the top-left corner of the slot: a matrix larger
  than the slot raises (at activation, in the worker), a smaller one is taken
  silently, padded with zeros;
- ``PEFTHelper`` (vllm/lora/peft_helper.py) never reads adapter_config's
  ``base_model_name_or_path``: an adapter naming another base passes
  ``validate_legal``. mini_vllm does not read it either.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.upstream

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

RANK, D_IN, D_OUT = 8, 16, 12


def _upstream_layer():
    """Upstream's own LoRA layer stacks on a bare ReplicatedLinear (no model, no TP)."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA as Upstream
    from vllm.model_executor.layers.linear import ReplicatedLinear

    layer = Upstream.__new__(Upstream)
    nn.Module.__init__(layer)
    layer.base_layer = ReplicatedLinear.__new__(ReplicatedLinear)
    layer.input_size, layer.output_size, layer.device = D_IN, D_OUT, "cpu"
    layer.n_slices, layer.tp_size = 1, 1
    config = LoRAConfig(max_lora_rank=RANK, max_loras=1, lora_dtype=torch.float32)
    layer.create_lora_weights(1, config)
    return layer


def test_upstream_refuses_a_wider_adapter_only_when_it_copies_it_into_a_slot():
    layer = _upstream_layer()
    with pytest.raises(RuntimeError):
        layer.set_lora(0, torch.ones(RANK, D_IN + 8), torch.ones(D_OUT, RANK))


def test_upstream_takes_a_narrower_adapter_padded_with_zeros():
    layer = _upstream_layer()
    a, b = torch.ones(RANK, D_IN - 8), torch.ones(D_OUT - 4, RANK)
    layer.set_lora(0, a, b)  # no error
    stacked_a, stacked_b = layer.lora_a_stacked[0][0, 0], layer.lora_b_stacked[0][0, 0]
    assert stacked_a[:, : D_IN - 8].equal(a) and not stacked_a[:, D_IN - 8 :].any()
    assert stacked_b[: D_OUT - 4].equal(b) and not stacked_b[D_OUT - 4 :].any()


def test_upstream_does_not_read_the_adapters_base_model_name(tmp_path):
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    config = {
        "r": RANK,
        "lora_alpha": RANK,
        "target_modules": ["q_proj"],
        "base_model_name_or_path": "some-org/another-model",
    }
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    helper = PEFTHelper.from_local_dir(str(tmp_path), max_position_embeddings=None)
    helper.validate_legal(LoRAConfig(max_lora_rank=16))  # no error
    assert not hasattr(helper, "base_model_name_or_path")
