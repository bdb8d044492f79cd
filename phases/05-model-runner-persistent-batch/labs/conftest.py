"""Fixtures shared by Phase 05's graded suites (helpers: phase05_helpers.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama (4 query heads, 2 KV heads) and its HF twin."""
    from transformers import AutoModelForCausalLM

    from mini_vllm.model_executor.model_loader.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny_llama_phase05")
    make_tiny_model(folder, arch="llama", seed=0)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.eval()
    return str(folder), hf
