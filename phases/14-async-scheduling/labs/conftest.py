"""Fixtures shared by Phase 14's graded suites (helpers: phase14_helpers.py).

- ``up``: the pinned upstream's scheduler backend (mini_vllm/oracle/upstream.py),
  whose ``AsyncScheduler`` Lab 14.1's lockstep runs beside yours;
- ``tiny_qwen3_folder``: a tiny seeded Qwen3 checkpoint (3 layers, vocabulary
  512; mini_vllm/model_executor/model_loader/tiny.py): Lab 14.2 runs it with
  async scheduling on and off, in milliseconds a step.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def up():
    from mini_vllm.oracle import upstream

    return upstream


@pytest.fixture(scope="session")
def tiny_qwen3_folder(tmp_path_factory) -> str:
    from mini_vllm.model_executor.model_loader.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny_qwen3")
    make_tiny_model(folder, arch="qwen3", seed=0)
    return str(folder)
