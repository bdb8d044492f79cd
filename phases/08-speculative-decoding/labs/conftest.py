"""Fixtures shared by Phase 08's graded suites (helpers: phase08_helpers.py).

- ``up``: the pinned upstream's scheduler backend (mini_vllm/oracle/upstream.py),
  whose ``Scheduler`` Lab 08.1's lockstep runs beside yours;
- ``smollm2_reference``: SmolLM2-135M-Instruct loaded once into a reference
  engine without speculation, with its greedy tokens on Lab 08.4's prompts
  (the model Lab 08.4's engines share).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def up():
    from mini_vllm.oracle import upstream

    return upstream


@pytest.fixture(scope="session")
def smollm2_reference():
    """(reference LLMEngine without speculation, its greedy tokens on
    phase08_helpers.PROMPTS). The reference engine's greedy SmolLM2 tokens
    equal transformers' (tests/test_spec_decode_engine.py, tests/test_engine.py);
    loading SmolLM2 a second time, into transformers, would more than double
    this phase's grading time."""
    from phase08_helpers import greedy_tokens, smollm2_engine

    engine = smollm2_engine(speculative_config=None)
    return engine, greedy_tokens(engine)
