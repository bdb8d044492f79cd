"""Per-step state the attention layers read without it being threaded through
every model's ``forward``.

Mirrors upstream ``vllm/forward_context.py`` (``ForwardContext`` :129,
``set_forward_context`` :250, ``get_forward_context`` :191) at v0.22.1. Left out: data
parallel metadata, CUDA-graph batch descriptors, per-layer metadata dicts
(mini_vllm's layers all share one ``AttentionMetadata``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from mini_vllm.attention.backend import AttentionMetadata


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("No forward context: run the model inside set_forward_context().")
    return _forward_context


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None):
    global _forward_context
    previous, _forward_context = _forward_context, ForwardContext(attn_metadata)
    try:
        yield
    finally:
        _forward_context = previous
