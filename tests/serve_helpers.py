"""Helpers of the serve tests: the tiny text model, and waiting for an idle engine.

The server itself runs in a thread (``ServerThread``, in
mini_vllm/entrypoints/openai/api_server.py).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
import time

from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model


@functools.cache
def tiny_text_model() -> str:
    """The tiny seeded Llama with SmolLM2's tokenizer, written once per test process
    (copying the tokenizer out of the GGUF is the slow part)."""
    folder = tempfile.mkdtemp(prefix="mini_vllm_serve_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return str(make_tiny_model(folder, arch="llama", tokenizer=True))


def wait_until_idle(engine: AsyncLLM, timeout: float = 60.0) -> None:
    """Until the engine core holds no request (read from the test thread)."""
    scheduler = engine.llm_engine.engine_core.scheduler
    deadline = time.monotonic() + timeout
    while scheduler.requests or scheduler.finished_req_ids:
        if time.monotonic() > deadline:
            raise AssertionError(f"requests still in the engine: {list(scheduler.requests)}")
        time.sleep(0.02)
