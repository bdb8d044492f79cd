"""Fixtures for Lab 12.2's graded suite, built once per session.

- ``tokenizer``: SmolLM2's Hugging Face tokenizer (read from its GGUF file):
  the vocabulary every grammar here is compiled against (49152 tokens);
- ``up_manager``: upstream's ``StructuredOutputManager`` over that tokenizer
  (room for 8 requests with 2 drafts each), for the ``upstream`` tests.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from mini_vllm.oracle.structured_workload import smollm2_tokenizer

    return smollm2_tokenizer()


@pytest.fixture(scope="session")
def up_manager(up, tokenizer):
    from mini_vllm.oracle.structured_workload import NUM_SPEC

    return up.create_structured_output_manager(
        tokenizer, max_num_seqs=8, num_speculative_tokens=NUM_SPEC
    )
