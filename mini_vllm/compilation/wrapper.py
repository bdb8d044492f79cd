"""Compile a module's forward once, then run that one trace for every batch size.

Mirrors upstream ``vllm/compilation/wrapper.py`` (``TorchCompileWithNoGuardsWrapper``
:47, its ``__init__`` :72 and ``__call__`` :169) at v0.22.1, on its
``VLLM_USE_BYTECODE_HOOK=0`` path.

``torch.compile`` normally guards every compiled graph: before each call,
Dynamo checks that the inputs still look as they did when it traced (shapes,
dtypes, module attributes ...) and traces again when one does not. In
DYNAMO_TRACE_ONCE mode the wrapper drops every guard
(``torch.compiler.skip_all_guards_unsafe`` as Dynamo's ``guard_filter_fn``):
the first call traces and compiles, every later call runs that code as it
is. That is safe only because the decorator (decorators.py) marks the
batch dimension dynamic before the first trace, so the one graph is
symbolic in the number of tokens, and because the model's forward has no
Python branch on anything else that changes from step to step.

``fullgraph=True``: a graph break is an error, not a silent split.

Left out: the bytecode hook (upstream swaps the compiled bytecode into
``forward`` and skips Dynamo's frame evaluation entirely), ahead-of-time
compiled artifacts saved to disk, guard evaluation
(``dynamic_shapes_config.evaluate_guards``), NVTX ranges, and upstream's
own inductor backend (VLLM_COMPILE's piecewise graphs, compilation/backends.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from mini_vllm.config import CompilationConfig, CompilationMode


class TorchCompileWithNoGuardsWrapper:
    """A base class added to a compiled module's class by ``support_torch_compile``."""

    def __init__(self, compilation_config: CompilationConfig) -> None:
        mode = compilation_config.mode
        if mode != CompilationMode.DYNAMO_TRACE_ONCE:
            raise ValueError(
                f"compilation mode {mode.name} has no compiled wrapper in mini_vllm "
                "(only DYNAMO_TRACE_ONCE)."
            )
        backend = compilation_config.backend or "inductor"
        options: dict[str, Any] = {}
        if backend == "inductor":
            options.update(compilation_config.inductor_compile_config)
            if compilation_config.cache_dir:
                # Inductor reads this at each lookup: compiled kernels go there and
                # a later start with the same graph finds them (process-wide).
                os.makedirs(compilation_config.cache_dir, exist_ok=True)
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(
                    compilation_config.cache_dir
                )
        # BEGIN LAB 18.4: trace once, never check guards again
        # HINT: receives options (the backend's options, a dict); leaves in it what makes
        # HINT: Dynamo keep no guard at all, so that a later call never traces again.
        # HINT: torch.compile takes a ``guard_filter_fn`` option: called with the guards of a
        # HINT: trace, it returns one bool a guard (keep it or not). torch.compiler has one
        # HINT: that drops them all.
        options["guard_filter_fn"] = torch.compiler.skip_all_guards_unsafe
        # END LAB 18.4
        self.compiled = False
        self._compiled_callable = torch.compile(
            self.forward, fullgraph=True, dynamic=False, backend=backend, options=options
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.compiled = True
        return self._compiled_callable(*args, **kwargs)
