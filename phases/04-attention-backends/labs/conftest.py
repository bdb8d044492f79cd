"""Fixtures shared by Phase 04's graded suites (helpers: phase04_helpers.py)."""

from __future__ import annotations

import pytest
import torch

from phase04_helpers import make_batch


@pytest.fixture
def paged():
    """``paged(layout, num_heads, num_kv_heads, head_size, block_size, ...)``."""
    return make_batch


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama (4 query heads, 2 KV heads: GQA) and its HF twin."""
    from transformers import AutoModelForCausalLM

    from mini_vllm.model_executor.model_loader.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny_llama_phase04")
    make_tiny_model(folder, arch="llama", seed=0)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.eval()
    return str(folder), hf
