"""Fixtures shared by Phase 19's graded suites.

- ``tiny_qwen3_folder``: a tiny seeded Qwen3 checkpoint (3 layers, vocabulary
  512; mini_vllm/model_executor/model_loader/tiny.py);
- ``pressure_prompts``: four prompts that outgrow its KV cache in
  ``variant_checks.greedy``;
- ``default_greedy``: their greedy tokens with v1's own Scheduler, the tokens
  Labs 19.1 and 19.2 must reproduce (a test asks for it after running the
  student's scheduler, so a starter fails without paying for this run).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_qwen3_folder(tmp_path_factory) -> str:
    from mini_vllm.model_executor.model_loader.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny_qwen3")
    make_tiny_model(folder, arch="qwen3", seed=0)
    return str(folder)


@pytest.fixture(scope="session")
def pressure_prompts(tiny_qwen3_folder) -> list[list[int]]:
    from mini_vllm.grading import variant_checks as V

    vocab = json.loads((Path(tiny_qwen3_folder) / "config.json").read_text())["vocab_size"]
    return V.pressure_prompts(vocab)


@pytest.fixture(scope="session")
def default_greedy(tiny_qwen3_folder, pressure_prompts) -> list[list[int]]:
    from mini_vllm.grading import variant_checks as V

    tokens, _ = V.greedy(tiny_qwen3_folder, None, pressure_prompts)
    return tokens
