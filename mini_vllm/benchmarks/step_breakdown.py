"""Where one ``LLM.generate`` run spends its time, part by part.

``step_breakdown(llm, prompts, sampling_params)`` runs ``llm.generate`` once
and returns the seconds spent in each part of the engine's steps:

- ``linear``: every linear layer (``LinearBase``) of the model (QKV, output, gate/up and down
  projections; forward hooks) and the logits projection (``compute_logits``);
- ``attention``: every paged attention layer (``Attention.forward``: the KV
  write and the attention of the backend in use; forward hooks);
- ``sampling``: the runner's ``_sample``;
- ``input preparation``: the runner's ``_update_states`` (the persistent
  batch's deltas) and ``_prepare_inputs`` (the flat batch, block table and
  slot mapping);
- ``scheduling``: the scheduler's ``schedule`` and ``update_from_output``;
- ``other``: the rest of the measured wall time of ``generate``: embedding,
  norms, rotary embedding, activation and residual adds inside the model,
  the runner's bookkeeping, output processing and detokenization.

The parts are disjoint (no timed call runs inside another), so they add up
to the wall time; ``other`` is that wall time minus the named parts. The
timers are installed on the instances (attributes shadowing the methods,
hooks on the modules) and removed afterwards: mini_vllm's code is unchanged.
On CUDA every timer synchronizes the device, which slows the run but puts
each kernel's time in its own part.

This is mini_vllm's measuring tool, not a mirror of an upstream file; vLLM
profiles with the torch profiler (``vllm/profiler``), see UPSTREAM_PIN.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack

import torch
from torch import nn

from mini_vllm.model_executor.layers.attention import Attention
from mini_vllm.model_executor.layers.linear import LinearBase

PARTS = ("linear", "attention", "sampling", "input preparation", "scheduling", "other")


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = dict.fromkeys(PARTS, 0.0)

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def timed(self, part: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            t0 = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += self.now() - t0

        return wrapper

    def hook(self, stack: ExitStack, part: str, module: nn.Module) -> None:
        started: list[float] = []

        def pre(_module, _args):
            started.append(self.now())

        def post(_module, _args, _output):
            self.seconds[part] += self.now() - started.pop()

        stack.callback(module.register_forward_pre_hook(pre).remove)
        stack.callback(module.register_forward_hook(post).remove)


def _shadow(stack: ExitStack, clock: _Clock, obj: object, name: str, part: str) -> None:
    """Time ``obj.name`` under ``part`` until the stack closes."""
    setattr(obj, name, clock.timed(part, getattr(obj, name)))
    stack.callback(delattr, obj, name)  # the class's method shows through again


def step_breakdown(llm, prompts, sampling_params) -> dict[str, float]:
    """Seconds per part (``PARTS``) over one ``llm.generate(prompts, sampling_params)``."""
    core = llm.llm_engine.engine_core
    runner, scheduler, model = core.model_runner, core.scheduler, core.model_runner.model
    clock = _Clock(runner.device)
    with ExitStack() as stack:
        for module in model.modules():
            if isinstance(module, (nn.Linear, LinearBase)):
                clock.hook(stack, "linear", module)
            elif isinstance(module, Attention):
                clock.hook(stack, "attention", module)
        _shadow(stack, clock, model, "compute_logits", "linear")
        _shadow(stack, clock, runner, "_sample", "sampling")
        _shadow(stack, clock, runner, "_update_states", "input preparation")
        _shadow(stack, clock, runner, "_prepare_inputs", "input preparation")
        _shadow(stack, clock, scheduler, "schedule", "scheduling")
        _shadow(stack, clock, scheduler, "update_from_output", "scheduling")
        t0 = clock.now()
        llm.generate(prompts, sampling_params, use_tqdm=False)
        total = clock.now() - t0
    seconds = clock.seconds
    seconds["other"] = total - sum(seconds.values())
    return seconds
