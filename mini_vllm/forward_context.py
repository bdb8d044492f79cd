"""Per-step state the attention layers read without it being threaded through
every model's ``forward``.

Mirrors upstream ``vllm/forward_context.py`` (``ForwardContext`` :129,
``set_forward_context`` :250, ``get_forward_context`` :191) at v0.22.1, and its
``BatchDescriptor`` (:30), the key of a CUDA graph: the context carries the
step's graph mode and key for the graph wrapper (mini_vllm/compilation/cuda_graph.py).
Left out: data parallel metadata, per-layer metadata dicts (mini_vllm's layers all
share one ``AttentionMetadata``).

Differs from upstream: the context carries the worker half of the KV
connector (``kv_connector``), which upstream's attention layers find through
a process-wide group (``get_kv_transfer_group``,
vllm/distributed/kv_transfer/kv_transfer_state.py:19): mini_vllm may run
two engines in one process, each with its own connector. A connector call
that raises in a layer is recorded in ``kv_connector_errors`` (upstream's
engine dies) and the forward goes on.

Differs from upstream: the context is per thread, not per process. Upstream
runs one engine core per process; mini_vllm's ``AsyncLLM`` steps its engine
in a thread, so a server and an offline ``LLM`` in one process (tests,
notebooks) may run forwards at the same time, each under its own context.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from mini_vllm.attention.backend import AttentionMetadata
from mini_vllm.config import CUDAGraphMode


@dataclass(frozen=True)
class BatchDescriptor:
    """A padded batch's shape, the key of one CUDA graph (upstream's
    BatchDescriptor, without LoRA's two fields)."""

    num_tokens: int
    # None: a graph that runs any number of requests (PIECEWISE).
    num_reqs: int | None = None
    # Every request has the same query length (a decode batch).
    uniform: bool = False


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    # The worker half of the engine's KV connector (Phase 15), or None.
    kv_connector: Any = None
    # mini only: the first error each connector call in the layers raised
    # this step, by call name; the runner handles them after the forward.
    kv_connector_errors: dict[str, Exception] = field(default_factory=dict)
    # How this step's forward runs (Phase 18): NONE eagerly, FULL from the
    # CUDA graph of ``batch_descriptor`` (captured on its first such call).
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: BatchDescriptor | None = None
    # The attention layers by name, for the opaque attention op of a compiled
    # model (upstream's field; the compiled model fills it, Phase 18).
    no_compile_layers: dict[str, Any] = field(default_factory=dict)


# One slot per thread: ``_local.context`` is the running forward's context.
_local = threading.local()


def get_forward_context() -> ForwardContext:
    context = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError("No forward context: run the model inside set_forward_context().")
    return context


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | None,
    kv_connector: Any = None,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    batch_descriptor: BatchDescriptor | None = None,
):
    previous = getattr(_local, "context", None)
    _local.context = ForwardContext(
        attn_metadata,
        kv_connector,
        cudagraph_runtime_mode=cudagraph_runtime_mode,
        batch_descriptor=batch_descriptor,
    )
    try:
        yield
    finally:
        _local.context = previous
