"""Fixtures shared by Phase 17's graded suites.

- ``tiny_llama``: the tiny seeded Llama checkpoint (4 query heads, 2 KV
  heads), written once per session, and transformers' greedy tokens for
  the labs' prompts on it (phase17_helpers.py; the same weights, in float32).

Each lab folder may add fixtures of its own in its own ``conftest.py``.
"""

from __future__ import annotations

import pytest
import torch
from phase17_helpers import NUM_TOKENS, prompts


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(the checkpoint's folder, transformers' greedy tokens for ``prompts()``)."""
    from transformers import AutoModelForCausalLM

    from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
    from mini_vllm.testing import hf_greedy

    path = make_tiny_model(tmp_path_factory.mktemp("tp"), "llama", seed=0)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, [hf_greedy(hf, p, NUM_TOKENS) for p in prompts()]
