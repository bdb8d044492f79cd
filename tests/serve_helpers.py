"""A real mini_vllm OpenAI server on the loopback interface, for the serve tests.

uvicorn runs in a thread on a socket bound to port 0 (the kernel picks a free
port, so parallel test workers never collide); ``stop`` shuts it and the
AsyncLLM's engine-core thread down.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import shutil
import socket
import tempfile
import threading
import time

import uvicorn

from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.entrypoints.openai.api_server import build_app, init_app_state
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model


@functools.cache
def tiny_text_model() -> str:
    """The tiny seeded Llama with SmolLM2's tokenizer, written once per test process
    (copying the tokenizer out of the GGUF is the slow part)."""
    folder = tempfile.mkdtemp(prefix="mini_vllm_serve_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return str(make_tiny_model(folder, arch="llama", tokenizer=True))


class ServerThread:
    def __init__(self, engine: AsyncLLM, model_path: str, served_model_name: str) -> None:
        self.engine = engine
        args = argparse.Namespace(model=model_path, served_model_name=[served_model_name])
        app = build_app(args)
        init_app_state(engine, app.state, args)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.shutdown()
        self.sock.close()


def wait_until_idle(engine: AsyncLLM, timeout: float = 60.0) -> None:
    """Until the engine core holds no request (read from the test thread)."""
    scheduler = engine.llm_engine.engine_core.scheduler
    deadline = time.monotonic() + timeout
    while scheduler.requests or scheduler.finished_req_ids:
        if time.monotonic() > deadline:
            raise AssertionError(f"requests still in the engine: {list(scheduler.requests)}")
        time.sleep(0.02)
