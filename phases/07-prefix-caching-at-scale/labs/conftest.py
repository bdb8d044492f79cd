"""Fixtures shared by Phase 07's graded suites (helpers: phase07_helpers.py).

- ``up``: the pinned upstream's KV-cache manager, its prefix cache's keys
  recorded too (mini_vllm/grading/hybrid_checks.py), which the lockstep
  checks of Labs 07.1-07.3 run beside yours;
- ``tiny_hybrid``: the tiny seeded Ministral checkpoint (full and
  sliding-window layers) written once, and transformers' greedy tokens on
  Lab 07.4's prompts (the model the lab's engine loads).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def up():
    from mini_vllm.grading.hybrid_checks import UpstreamBackend

    return UpstreamBackend()


@pytest.fixture(scope="session")
def tiny_hybrid(tmp_path_factory):
    """(checkpoint folder, transformers' greedy tokens on phase07_helpers.PROMPTS)."""
    import torch
    from phase07_helpers import MAX_TOKENS, PROMPTS
    from transformers import AutoModelForCausalLM

    from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
    from mini_vllm.testing import hf_greedy

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny_ministral"), arch="ministral", seed=0)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return str(folder), [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
