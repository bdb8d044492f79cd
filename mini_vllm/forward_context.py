"""Per-step state the attention layers read without it being threaded through
every model's ``forward``.

Mirrors upstream ``vllm/forward_context.py`` (``ForwardContext`` :129,
``set_forward_context`` :250, ``get_forward_context`` :191) at v0.22.1. Left out: data
parallel metadata, CUDA-graph batch descriptors, per-layer metadata dicts
(mini_vllm's layers all share one ``AttentionMetadata``).

Differs from upstream: the context is per thread, not per process. Upstream
runs one engine core per process; mini_vllm's ``AsyncLLM`` steps its engine
in a thread, so a server and an offline ``LLM`` in one process (tests,
notebooks) may run forwards at the same time, each under its own context.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

from mini_vllm.attention.backend import AttentionMetadata


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None


# One slot per thread: ``_local.context`` is the running forward's context.
_local = threading.local()


def get_forward_context() -> ForwardContext:
    context = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError("No forward context: run the model inside set_forward_context().")
    return context


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None):
    previous = getattr(_local, "context", None)
    _local.context = ForwardContext(attn_metadata)
    try:
        yield
    finally:
        _local.context = previous
