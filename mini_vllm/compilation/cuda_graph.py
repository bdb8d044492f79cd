"""Capture a model's forward as a CUDA graph once per batch shape; replay it after.

Mirrors upstream ``vllm/compilation/cuda_graph.py`` (``CUDAGraphEntry`` :128,
``CUDAGraphWrapper`` :145, its ``__call__`` :233) at v0.22.1.

The wrapper stands where the model was. Each call reads the forward context:
when the step's runtime mode is the wrapper's (FULL here) and its batch
descriptor names a shape, the first call for that shape captures the
forward into a graph (the kernels are recorded, not run), and every later
call replays it: the recorded kernels run again on whatever the input
buffers hold now, with no Python in between. Any other mode (NONE: a prefill,
a mixed batch, a warm-up run) calls the model as it is.

A graph reads and writes fixed addresses, so its inputs must live in
buffers that never move (the runner's persistent ``input_ids``,
``positions``, block table, slot mapping ...) and the runner must write each
step's values into them before a replay; the output is the tensor captured,
overwritten by the next replay.

Left out: weak references to the outputs (mini_vllm keeps each graph's
output alive), the capture-time checks of input addresses, garbage-collection
and offloader options, and the piecewise graphs (one per compiled piece)
that upstream's compiled models run. mini only: ``num_replays`` counts
replays, so a test can see that graphs ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mini_vllm.config import CUDAGraphMode
from mini_vllm.forward_context import BatchDescriptor, get_forward_context


@dataclass
class CUDAGraphEntry:
    batch_descriptor: BatchDescriptor
    cudagraph: torch.cuda.CUDAGraph | None = None
    output: Any | None = None


class CUDAGraphWrapper:
    def __init__(self, runnable: torch.nn.Module, runtime_mode: CUDAGraphMode, graph_pool=None):
        assert runtime_mode in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE), runtime_mode
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        # One memory pool for every graph (made at the first capture): captured
        # largest first, the smaller ones reuse the largest one's memory.
        self.graph_pool = graph_pool
        self.concrete_cudagraph_entries: dict[BatchDescriptor, CUDAGraphEntry] = {}
        self.num_replays = 0

    def __getattr__(self, key: str) -> Any:
        # Everything else (compute_logits, attention_layers, config ...) is the model's.
        return getattr(self.runnable, key)

    def unwrap(self) -> torch.nn.Module:
        return self.runnable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context = get_forward_context()
        batch_descriptor = context.batch_descriptor
        if context.cudagraph_runtime_mode != self.runtime_mode:
            return self.runnable(*args, **kwargs)
        assert batch_descriptor is not None, "a graph's mode needs its batch descriptor"
        entry = self.concrete_cudagraph_entries.get(batch_descriptor)
        if entry is None:
            entry = self.concrete_cudagraph_entries[batch_descriptor] = CUDAGraphEntry(
                batch_descriptor
            )
        if entry.cudagraph is None:
            # Capture: the kernels are recorded into the graph, not run.
            if self.graph_pool is None:
                self.graph_pool = torch.cuda.graph_pool_handle()
            cudagraph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cudagraph, pool=self.graph_pool):
                entry.output = self.runnable(*args, **kwargs)
            entry.cudagraph = cudagraph
            return entry.output
        entry.cudagraph.replay()
        self.num_replays += 1
        return entry.output
