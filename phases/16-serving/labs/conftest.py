"""Fixtures shared by Phase 16's graded suites (helpers: phase16_helpers.py).

The runs use a tiny seeded Llama that carries SmolLM2's tokenizer
(``make_tiny_model(..., tokenizer=True)``): real BPE text, milliseconds a
step. Writing it (copying the tokenizer out of the GGUF) is the slow part,
once per session. The notebook serves SmolLM2 itself.
"""

from __future__ import annotations

import asyncio

import pytest

from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model

from phase16_helpers import ENGINE_ARGS


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny_llama_phase16")
    return str(make_tiny_model(folder, arch="llama", seed=0, tokenizer=True))


@pytest.fixture(scope="session")
def loop():
    """One event loop for the session: an AsyncLLM serves the loop it started on."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def ref_engine(tiny_model, loop):
    """The reference AsyncLLM on the tiny model (it records Lab 16.1's outputs)."""
    engine = AsyncLLM.from_model(tiny_model, model_name="tiny-llama", **ENGINE_ARGS)
    yield engine
    engine.shutdown()
    loop.run_until_complete(asyncio.sleep(0))  # let the cancelled output handler end


@pytest.fixture(scope="session")
def offline_llm(tiny_model) -> LLM:
    """The same model offline: LLM.generate gives every expected text."""
    return LLM(tiny_model, **ENGINE_ARGS)
