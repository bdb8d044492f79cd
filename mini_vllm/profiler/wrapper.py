"""The torch profiler around engine steps, writing a Chrome trace.

Mirrors upstream ``vllm/profiler/wrapper.py`` (``WorkerProfiler`` :19,
``TorchProfilerWrapper`` :159) at v0.22.1: ``start`` begins recording every
torch op the engine runs (CPU, and CUDA where there is a GPU), ``stop`` ends
it and ``torch.profiler.tensorboard_trace_handler`` writes the trace,
``<worker_name>.<time>.pt.trace.json`` (``.gz`` unless
``torch_profiler_use_gzip`` is off) under ``torch_profiler_dir``: open it in
Perfetto (ui.perfetto.dev) or chrome://tracing. A second ``start`` while
recording, or a ``stop`` while not, is ignored, as upstream.

Left out: delayed starts, iteration limits and warm-up schedules
(``delay_iterations``, ``max_iterations``, ``warmup_iterations``), the
summary tables upstream prints and writes on stop, FLOP and memory
recording, and the CUDA (nsys) profiler.
"""

from __future__ import annotations

import torch

from mini_vllm.config import ProfilerConfig


class TorchProfilerWrapper:
    def __init__(self, profiler_config: ProfilerConfig, worker_name: str) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities,
            record_shapes=profiler_config.torch_profiler_record_shapes,
            with_stack=profiler_config.torch_profiler_with_stack,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                profiler_config.torch_profiler_dir,
                worker_name=worker_name,
                use_gzip=profiler_config.torch_profiler_use_gzip,
            ),
        )
        self.running = False

    def start(self) -> None:
        if not self.running:
            self.profiler.start()
            self.running = True

    def stop(self) -> None:
        """Stop recording and write the trace."""
        if self.running:
            self.profiler.stop()
            self.running = False
