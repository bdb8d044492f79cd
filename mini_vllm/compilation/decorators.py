"""``@support_torch_compile``: a model class whose forward can be compiled once.

Mirrors upstream ``vllm/compilation/decorators.py`` (``support_torch_compile``
:118, ``_support_torch_compile`` :331, its ``_mark_dynamic_inputs`` :414 and
``__call__`` :502) at v0.22.1.

The decorator adds ``TorchCompileWithNoGuardsWrapper`` (wrapper.py) to the
class's bases and replaces its ``__call__``. An instance runs its plain
``forward`` until ``enable_torch_compile`` hands it a compilation config
whose mode compiles; then its first call marks dimension 0 of the
arguments named in ``dynamic_arg_dims`` dynamic (the number of tokens), so
Dynamo's one trace is symbolic in it, and every call runs that trace.

Attention stays out of the graph: each layer's attention is one opaque
custom op (``mini_vllm::unified_attention_with_output``, see
mini_vllm/model_executor/layers/attention.py), as upstream's CPU platform
does (``opaque_attention_op``, vllm/platforms/cpu.py:399). Inside it the
backend runs eagerly, reads the step's metadata and writes the KV cache;
the op finds its layer by name in the forward context's
``no_compile_layers``, which the compiled model fills before each call.

Differs from upstream: upstream's decorator reads the current VllmConfig
when the model is built; mini_vllm's ``LLM`` loads the model before its
config exists, so the model runner calls ``enable_torch_compile`` when it
takes the model. Upstream copies the layers into the forward context from
``compilation_config.static_forward_context``; here the compiled model
hands over its own. An argument that was None at the trace must stay None
(upstream's rule too): a call where one changes (a step with prompt
embeddings after steps without) runs ``forward`` eagerly instead, and so
does a first call of fewer than 2 tokens (Dynamo would fix a size of 1
into the graph). Left out: inferring the dynamic arguments from type
annotations, ``enable_if``, ``mark_unbacked_dims``, shape ids, the
traced-file list and ahead-of-time artifacts, ``ignore_torch_compile``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from mini_vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
from mini_vllm.config import CompilationConfig, CompilationMode
from mini_vllm.forward_context import get_forward_context


def support_torch_compile(*, dynamic_arg_dims: dict[str, int]):
    """Class decorator: ``dynamic_arg_dims`` maps forward's argument names to
    the dimension of each that varies from step to step."""

    def decorate(cls: type[nn.Module]) -> type[nn.Module]:
        params = inspect.signature(cls.forward).parameters
        for name in dynamic_arg_dims:
            if name not in params:
                raise ValueError(f"Argument {name} not found in the forward method of {cls}")
        return _support_torch_compile(cls, dynamic_arg_dims)

    return decorate


def _mark_dynamic_inputs(module: nn.Module, arguments: dict[str, Any]) -> None:
    """Before the one trace: mark the varying dimension of each named tensor."""
    for name, dim in module._dynamic_arg_dims.items():
        arg = arguments.get(name)
        # BEGIN LAB 18.4: mark the batch dimension dynamic
        # HINT: receives arg (a tensor or None) and dim (its varying dimension); leaves
        # HINT: that dimension of a tensor symbolic in Dynamo's trace (None stays as it is).
        # HINT: torch._dynamo has the function; without it the trace fixes today's size and,
        # HINT: with every guard dropped, runs tomorrow's batch through it.
        if isinstance(arg, torch.Tensor):
            torch._dynamo.mark_dynamic(arg, dim)
        # END LAB 18.4


def _none_args(module: nn.Module, arguments: dict[str, Any]) -> frozenset[str]:
    return frozenset(name for name in module._dynamic_arg_dims if arguments.get(name) is None)


def _support_torch_compile(cls: type[nn.Module], dynamic_arg_dims: dict[str, int]):
    if TorchCompileWithNoGuardsWrapper in cls.__bases__:
        return cls  # decorated twice
    cls.__bases__ = cls.__bases__ + (TorchCompileWithNoGuardsWrapper,)
    old_init = cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        old_init(self, *args, **kwargs)
        self._dynamic_arg_dims = dynamic_arg_dims
        self.do_not_compile = True  # until enable_torch_compile says otherwise

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.do_not_compile or torch.compiler.is_compiling():
            return self.forward(*args, **kwargs)
        arguments = inspect.signature(self.forward).bind(*args, **kwargs).arguments
        if not self.compiled:
            name, dim = next(iter(self._dynamic_arg_dims.items()))
            if arguments[name].shape[dim] < 2:
                return self.forward(*args, **kwargs)  # see the module docstring
            self._traced_none_args = _none_args(self, arguments)
            _mark_dynamic_inputs(self, arguments)
        elif _none_args(self, arguments) != self._traced_none_args:
            return self.forward(*args, **kwargs)
        get_forward_context().no_compile_layers = self.no_compile_layers
        return TorchCompileWithNoGuardsWrapper.__call__(self, *args, **kwargs)

    cls.__init__ = __init__
    cls.__call__ = __call__
    return cls


def enable_torch_compile(model: nn.Module, compilation_config: CompilationConfig) -> int:
    """Switch compilation on in every decorated module of ``model`` when the
    config's mode compiles; returns how many modules will compile."""
    from mini_vllm.model_executor.layers.attention import Attention

    if compilation_config.mode == CompilationMode.NONE:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, TorchCompileWithNoGuardsWrapper):
            module.no_compile_layers = {
                m.layer_name: m for m in module.modules() if isinstance(m, Attention)
            }
            TorchCompileWithNoGuardsWrapper.__init__(module, compilation_config)
            module.do_not_compile = False
            count += 1
    return count
