"""The CPU GEMM dispatch: a linear layer's weight packed once for oneDNN.

Mirrors upstream ``vllm/model_executor/layers/utils.py`` at v0.22.1
(``dispatch_cpu_unquantized_gemm`` at :228, ``cpu_unquantized_gemm`` at :312,
``dispatch_unquantized_gemm`` at :321). On a CPU, upstream's unquantized
linear and embedding methods call ``dispatch_cpu_unquantized_gemm`` once the
weights are loaded (``process_weights_after_loading``, linear.py:214 and
vocab_parallel_embedding.py:61): it reorders the weight into oneDNN's
blocked layout for matmuls (``create_onednn_mm``, a C++ op of ``vllm._C``) and
gives the layer a ``cpu_linear`` that runs that matmul; every step then skips
the repacking a plain ``F.linear`` does inside its GEMM call. On this
project's CPUs that is worth 10-40% of a matmul's time at decode batch
sizes (see mini_vllm/benchmarks/README.md, the roofline).

mini_vllm does the same with torch's own oneDNN ops
(``torch.ops.mkldnn._reorder_linear_weight`` and ``_linear_pointwise``, what
inductor's weight freezing uses on a CPU), since ``vllm._C`` is not built
here. The matmul is one registered custom op, ``mini_vllm::onednn_mm``, as
upstream's is one op of ``vllm._C`` (``torch.ops._C.onednn_mm``, called by
``onednn_mm`` in vllm/_custom_ops.py:3438): under ``torch.compile`` Dynamo
does not trace into it, so the compiled graph calls the packed matmul and
inductor fuses only the elementwise work around it. The op's fake
implementation gives the trace its output's shape and dtype. Eagerly, the
layer calls the op's body (``onednn_linear``) directly, as the attention
layer does its forward: a Python custom op's dispatch (an autograd wrapper,
a Dynamo-disabled frame) costs tens of microseconds a call, half a one-row
matmul (UPSTREAM_PIN.md has the measurement), where upstream's Python
``onednn_mm`` reaches its C++ op through one plain dispatch.

Left out: the zentorch and SGL kernel paths, the causal-conv weight pack.
Differs from upstream: upstream's op reaches the packed weight through a
handle (an int64 tensor holding a C++ pointer); here the packed tensor
itself is the op's argument, which Dynamo passes through as it is. The
layer keeps its ``weight`` (upstream's linear layers drop it,
``remove_weight=True``): LoRA, tensor-parallel loading and the tests read
it, and the op takes it too: a weight replaced, changed in place or cast
after packing (or an input of another dtype) runs ``F.linear`` inside the op,
compiled or not, until the layer is dispatched again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# The batch size oneDNN's weight layout is chosen for (upstream passes 32 too).
ONEDNN_BATCH_HINT = 32


def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module) -> None:
    """Give ``layer`` a ``cpu_linear(x, weight, bias)``: oneDNN over a packed copy of
    ``layer.weight`` where torch's oneDNN supports it, else ``F.linear``."""
    weight = layer.weight
    layer.cpu_linear = F.linear
    if (
        weight.device.type != "cpu"
        or weight.dim() != 2
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or not torch.backends.mkldnn.is_available()
    ):
        return
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_BATCH_HINT)
    except RuntimeError:  # this torch build cannot: the plain matmul stays
        return

    packed.packed_from = (weight.data_ptr(), weight._version, weight.dtype)

    def cpu_linear(x, weight_now, bias):
        if torch.compiler.is_compiling():  # traced: one opaque op (the docstring)
            return onednn_mm(x, weight_now, bias, packed)
        return onednn_linear(x, weight_now, bias, packed)

    layer.cpu_linear = cpu_linear


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed by oneDNN over ``packed``, the copy of
    ``weight`` that ``dispatch_cpu_unquantized_gemm`` reordered."""
    # A weight replaced, changed in place or cast since it was packed, or an
    # input of another dtype: the packed copy is stale, so the plain matmul runs.
    if (weight.data_ptr(), weight._version, x.dtype) != packed.packed_from:
        return F.linear(x, weight, bias)
    out = torch.ops.mkldnn._linear_pointwise(
        x.reshape(-1, x.shape[-1]), packed, bias, "none", [], ""
    )  # [tokens, out_features]
    return out.reshape(*x.shape[:-1], out.shape[-1])


@torch.library.custom_op("mini_vllm::onednn_mm", mutates_args=())
def onednn_mm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor
) -> torch.Tensor:
    """``onednn_linear`` as one registered op, what a compiled graph calls."""
    return onednn_linear(x, weight, bias, packed)


@onednn_mm.register_fake
def onednn_mm_fake(x, weight, bias, packed) -> torch.Tensor:
    """What the trace sees: a new tensor of ``x``'s rows by the weight's out_features."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def cpu_unquantized_gemm(layer, x, weight, bias=None) -> torch.Tensor:
    """The layer's dispatched matmul; a layer never dispatched runs ``F.linear``."""
    return getattr(layer, "cpu_linear", F.linear)(x, weight, bias)


def default_unquantized_gemm(layer, x, weight, bias=None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def dispatch_unquantized_gemm(device: torch.device) -> Callable[..., torch.Tensor]:
    """The GEMM for weights on ``device`` (upstream asks the platform)."""
    return cpu_unquantized_gemm if device.type == "cpu" else default_unquantized_gemm
