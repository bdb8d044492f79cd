"""Linear layers whose weights a quantization method owns.

Mirrors upstream ``vllm/model_executor/layers/linear.py`` at v0.22.1
(``LinearMethodBase`` at :141, ``UnquantizedLinearMethod`` at :182,
``LinearBase`` at :231, ``MergedColumnParallelLinear`` at :607,
``QKVParallelLinear`` at :975, ``RowParallelLinear`` at :1392). Left out:
tensor parallelism (every layer here holds the whole weight, so "parallel"
is only the name, kept so that a reader finds upstream's layers), LoRA,
the CPU GEMM dispatch, ``ReplicatedLinear`` and ``ColumnParallelLinear``
(the models use the three above), and upstream's per-parameter
``weight_loader`` attributes: here the layer's own ``weight_loader`` puts a
checkpoint tensor into place.

A fused layer (q/k/v, gate/up) holds its shards' rows one after another;
``shard_rows(shard_id)`` says where a shard's rows are. Without a
quantization config the method is ``UnquantizedLinearMethod``: ``weight``
[out, in] and ``F.linear``, exactly what ``nn.Linear`` computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mini_vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)


class LinearMethodBase(QuantizeMethodBase):
    """A way to store and apply a linear layer's weight."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        raise NotImplementedError

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethodBase):
    """The weight as it is, [out, in] in the model's dtype."""

    def create_weights(self, layer, input_size, output_partition_sizes, params_dtype):
        weight = torch.empty(sum(output_partition_sizes), input_size, dtype=params_dtype)
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)


class LinearBase(nn.Module):
    """``y = x W^T + b``, with ``W`` kept as ``quant_method`` chooses.

    ``output_sizes`` lists the shards of a fused layer (one entry for a
    plain layer) and ``shard_ids`` their names in checkpoint order.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        shard_ids: list | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(self.output_sizes)
        self.shard_ids = list(shard_ids) if shard_ids is not None else [None]
        self.prefix = prefix
        method = quant_config.get_quant_method(self, prefix) if quant_config else None
        self.quant_method: LinearMethodBase = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(
            self, input_size, self.output_sizes, torch.get_default_dtype()
        )
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def shard_rows(self, shard_id) -> slice:
        """The output rows that hold shard ``shard_id`` (all rows for None)."""
        if shard_id is None:
            return slice(0, self.output_size)
        i = self.shard_ids.index(shard_id)
        start = sum(self.output_sizes[:i])
        return slice(start, start + self.output_sizes[i])

    def weight_loader(
        self, param_name: str, loaded: torch.Tensor, shard_id=None, ckpt_name: str = ""
    ) -> None:
        """Copy a checkpoint tensor into its rows of ``param_name``; ValueError on a shape
        mismatch. A quantization method with its own ``weight_loader`` takes over."""
        custom = getattr(self.quant_method, "weight_loader", None)
        if custom is not None and param_name != "bias":
            custom(self, param_name, loaded, shard_id, ckpt_name)
            return
        target = getattr(self, param_name).data[self.shard_rows(shard_id)]
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} has shape {tuple(loaded.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(loaded)


class MergedColumnParallelLinear(LinearBase):
    """Several projections of the same input in one layer (gate and up: shards 0, 1)."""

    def __init__(self, input_size, output_sizes, bias=False, quant_config=None, prefix=""):
        super().__init__(
            input_size, output_sizes, bias, quant_config, prefix, list(range(len(output_sizes)))
        )


class QKVParallelLinear(LinearBase):
    """Query, key and value projections in one layer (shards "q", "k", "v")."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        sizes = [total_num_heads * head_size] + [total_num_kv_heads * head_size] * 2
        super().__init__(hidden_size, sizes, bias, quant_config, prefix, ["q", "k", "v"])


class RowParallelLinear(LinearBase):
    """A plain projection (o_proj, down_proj); upstream splits its input across ranks."""

    def __init__(self, input_size, output_size, bias=False, quant_config=None, prefix=""):
        super().__init__(input_size, [output_size], bias, quant_config, prefix)
