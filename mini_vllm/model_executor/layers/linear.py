"""Linear layers split over the tensor-parallel group, with weights a quantization method owns.

Mirrors upstream ``vllm/model_executor/layers/linear.py`` at v0.22.1
(``LinearMethodBase`` at :141, ``UnquantizedLinearMethod`` at :182,
``LinearBase`` at :231, ``ColumnParallelLinear`` at :410,
``MergedColumnParallelLinear`` at :607, ``QKVParallelLinear`` at :975,
``RowParallelLinear`` at :1392).

Tensor parallelism (``y = x W^T + b`` with ``W`` [out, in]):

- a column-parallel layer keeps rows ``[r * out/tp, (r+1) * out/tp)`` of
  ``W`` (and of ``b``) on rank ``r``: each rank computes its slice of ``y``;
  ``gather_output`` all-gathers the slices into the whole ``y``;
- a row-parallel layer keeps columns ``[r * in/tp, (r+1) * in/tp)`` of ``W``
  and takes its slice of ``x`` (the slice a column-parallel layer left it):
  each rank computes a partial ``y``, and one all-reduce sums them; ``b``
  is whole and added on rank 0 only, so that it is added once;
- a fused layer (gate/up, q/k/v) splits each of its shards so, and keeps its
  slices one after another: ``shard_rows(shard_id)`` says where;
- ``QKVParallelLinear`` splits the query heads over the ranks and the KV
  heads too while there are at least as many as ranks; with fewer, each
  rank keeps one KV head, shared by ``tp / total_num_kv_heads`` ranks.

``weight_loader`` takes the whole checkpoint tensor (GGUF or safetensors
alike) and keeps this rank's slice. Outside any run the group has one rank
and every layer holds its whole weight.

Left out: LoRA, ``ReplicatedLinear``,
``skip_bias_add`` / ``return_bias`` (``forward`` returns the output alone),
already-fused checkpoint tensors, upstream's per-parameter
``weight_loader`` attributes (here the layer's own ``weight_loader`` puts
a checkpoint tensor into place), and quantized weights split over ranks
(VllmConfig refuses quantization with tensor_parallel_size > 1). Without a
quantization config the method is ``UnquantizedLinearMethod``: ``weight``
[out, in] and what ``nn.Linear`` computes, through ``F.linear`` or, on a
CPU once the weights are loaded, through oneDNN over a packed copy of the
weight (utils.py, upstream's CPU GEMM dispatch).
"""

from __future__ import annotations

import torch
from torch import nn

from mini_vllm.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from mini_vllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from mini_vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from mini_vllm.model_executor.layers.utils import (
    dispatch_cpu_unquantized_gemm,
    dispatch_unquantized_gemm,
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

    def process_weights_after_loading(self, layer):
        """On a CPU, pack the weight for oneDNN (upstream's CPU GEMM dispatch)."""
        if layer.weight.device.type == "cpu":
            dispatch_cpu_unquantized_gemm(layer)

    def apply(self, layer, x, bias=None):
        return dispatch_unquantized_gemm(layer.weight.device)(layer, x, layer.weight, bias)


def divide(numerator: int, denominator: int) -> int:
    """``numerator / denominator``, which must be whole (upstream: distributed/utils.py)."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    """``y = x W^T + b``, with ``W`` kept as ``quant_method`` chooses.

    ``output_sizes`` lists the shards of a fused layer (one entry for a
    plain layer) and ``shard_ids`` their names in checkpoint order. A
    subclass sets ``input_size_per_partition`` and
    ``output_partition_sizes`` (this rank's part) before calling
    ``__init__``; left unset, the layer is whole on every rank.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        shard_ids: list | None = None,
        *,
        disable_tp: bool = False,
    ) -> None:
        super().__init__()
        self.tp_rank = 0 if disable_tp else get_tensor_model_parallel_rank()
        self.tp_size = 1 if disable_tp else get_tensor_model_parallel_world_size()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(self.output_sizes)
        self.shard_ids = list(shard_ids) if shard_ids is not None else [None]
        self.prefix = prefix
        if not hasattr(self, "output_partition_sizes"):
            self.input_size_per_partition = input_size
            self.output_partition_sizes = list(self.output_sizes)
        if quant_config is not None and self.tp_size > 1:
            raise ValueError(f"{prefix}: quantized layers cannot be split over ranks in mini_vllm")
        method = quant_config.get_quant_method(self, prefix) if quant_config else None
        self.quant_method: LinearMethodBase = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(
            self,
            self.input_size_per_partition,
            self.output_partition_sizes,
            torch.get_default_dtype(),
        )
        if bias:
            rows = sum(self.output_partition_sizes)
            self.bias = nn.Parameter(torch.empty(rows), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def shard_rows(self, shard_id) -> slice:
        """This rank's output rows that hold shard ``shard_id`` (all rows for None)."""
        if shard_id is None:
            return slice(0, sum(self.output_partition_sizes))
        i = self.shard_ids.index(shard_id)
        start = sum(self.output_partition_sizes[:i])
        return slice(start, start + self.output_partition_sizes[i])

    def checkpoint_layout(
        self, param_name: str, shard_id, target_shape: torch.Size
    ) -> tuple[tuple[int, ...], int | None, int]:
        """(the checkpoint tensor's whole shape, the dim this rank slices or
        None, where its slice starts). Here: whole on every rank."""
        return tuple(target_shape), None, 0

    def weight_loader(
        self, param_name: str, loaded: torch.Tensor, shard_id=None, ckpt_name: str = ""
    ) -> None:
        """Copy this rank's slice of a checkpoint tensor into its rows of
        ``param_name``; ValueError on a shape mismatch. A quantization method
        with its own ``weight_loader`` takes over."""
        custom = getattr(self.quant_method, "weight_loader", None)
        if custom is not None and param_name != "bias":
            custom(self, param_name, loaded, shard_id, ckpt_name)
            return
        target = getattr(self, param_name).data[self.shard_rows(shard_id)]
        whole, dim, start = self.checkpoint_layout(param_name, shard_id, target.shape)
        if tuple(loaded.shape) != whole:
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} has shape {tuple(loaded.shape)}, expected {whole}"
            )
        if dim is not None:
            loaded = loaded.narrow(dim, start, target.shape[dim])
        with torch.no_grad():
            target.copy_(loaded)


class ColumnParallelLinear(LinearBase):
    """Output rows split over the ranks; ``gather_output`` all-gathers ``y``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        *,
        gather_output: bool = False,
        disable_tp: bool = False,
        output_sizes: list[int] | None = None,
        shard_ids: list | None = None,
    ) -> None:
        tp_size = 1 if disable_tp else get_tensor_model_parallel_world_size()
        output_sizes = output_sizes or [output_size]
        self.input_size_per_partition = input_size
        self.output_partition_sizes = [divide(size, tp_size) for size in output_sizes]
        super().__init__(
            input_size, output_sizes, bias, quant_config, prefix, shard_ids, disable_tp=disable_tp
        )
        self.gather_output = gather_output

    def shard_rank(self, shard_id) -> int:
        """Which slice of the checkpoint's shard this rank holds."""
        return self.tp_rank

    def checkpoint_rows(self, shard_id) -> int:
        """The checkpoint tensor's rows for shard ``shard_id``."""
        if shard_id is None:
            return self.output_size
        return self.output_sizes[self.shard_ids.index(shard_id)]

    # BEGIN LAB 17.1: a column-parallel weight's slice: which checkpoint rows this rank keeps
    def checkpoint_layout(self, param_name, shard_id, target_shape):
        """(the checkpoint tensor's whole shape, the dim this rank slices, where
        its slice starts) for ``param_name``'s rows of shard ``shard_id``;
        ``target_shape`` is this rank's part (upstream: ``weight_loader`` :533)."""
        # HINT: checkpoint_rows(shard_id) is the shard's rows in the checkpoint; the weight
        # HINT: and the bias both keep target_shape[0] of them, the shard_rank(shard_id)-th part.
        whole = (self.checkpoint_rows(shard_id), *target_shape[1:])
        return whole, 0, self.shard_rank(shard_id) * target_shape[0]

    # END LAB 17.1

    # BEGIN LAB 17.1: a column-parallel layer's output: this rank's slice, or all of it
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's columns of ``y``; all of ``y`` on every rank with
        ``gather_output`` (upstream: ``forward`` :578)."""
        # HINT: self.quant_method.apply(self, x, self.bias) computes this rank's columns;
        # HINT: the whole y is a collective of communication_op away (only when there are ranks).
        output = self.quant_method.apply(self, x, self.bias)
        if self.gather_output and self.tp_size > 1:
            output = tensor_model_parallel_all_gather(output)
        return output

    # END LAB 17.1


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input in one layer (gate and up:
    shards 0, 1), each split over the ranks on its own."""

    def __init__(
        self,
        input_size,
        output_sizes,
        bias=False,
        quant_config=None,
        prefix="",
        *,
        gather_output: bool = False,
        disable_tp: bool = False,
    ):
        super().__init__(
            input_size,
            sum(output_sizes),
            bias,
            quant_config,
            prefix,
            gather_output=gather_output,
            disable_tp=disable_tp,
            output_sizes=list(output_sizes),
            shard_ids=list(range(len(output_sizes))),
        )


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one layer (shards "q", "k", "v"),
    split by heads: ``num_heads`` query and ``num_kv_heads`` KV heads a rank."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        *,
        disable_tp: bool = False,
    ) -> None:
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp_size = 1 if disable_tp else get_tensor_model_parallel_world_size()
        # BEGIN LAB 17.2: the heads a rank holds: query heads split, KV heads split or shared
        # HINT: set self.num_heads, self.num_kv_heads and self.num_kv_head_replicas (how many
        # HINT: ranks hold each KV head) from total_num_heads, self.total_num_kv_heads and tp_size;
        # HINT: divide() refuses a split that is not whole, with one clear line.
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= self.total_num_kv_heads:
            # Fewer KV heads than ranks: one a rank, each on tp / total ranks.
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, self.total_num_kv_heads)
        else:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        # END LAB 17.2
        # The sizes as if every rank's part were distinct (upstream's output_sizes).
        sizes = [self.num_heads * head_size * tp_size] + [
            self.num_kv_heads * head_size * tp_size
        ] * 2
        # The base class by name, not super(): the lab starter's class
        # subclasses this one, and super() there would run this method again.
        ColumnParallelLinear.__init__(
            self,
            hidden_size,
            sum(sizes),
            bias,
            quant_config,
            prefix,
            disable_tp=disable_tp,
            output_sizes=sizes,
            shard_ids=["q", "k", "v"],
        )

    # BEGIN LAB 17.2: which part of a q, k or v checkpoint tensor this rank keeps
    def shard_rank(self, shard_id) -> int:
        """The part of shard ``shard_id`` ("q", "k" or "v") this rank holds,
        counted in this rank's head count (upstream: linear.py:1364-1366)."""
        # HINT: query heads: the rank's own part; a KV head held by num_kv_head_replicas ranks
        # HINT: is the same part on each of them.
        if shard_id == "q":
            return self.tp_rank
        return self.tp_rank // self.num_kv_head_replicas

    # END LAB 17.2

    # BEGIN LAB 17.2: how many rows a q, k or v checkpoint tensor has
    def checkpoint_rows(self, shard_id) -> int:
        """The rows of shard ``shard_id``'s tensor in the checkpoint: all its heads."""
        # HINT: a head is head_size rows; "k" and "v" have the same total head count.
        heads = {"q": self.total_num_heads, "k": self.total_num_kv_heads}
        return heads.get(shard_id, self.total_num_kv_heads) * self.head_size

    # END LAB 17.2


class RowParallelLinear(LinearBase):
    """Input columns split over the ranks; one all-reduce sums the partial
    outputs (o_proj, down_proj)."""

    def __init__(
        self,
        input_size,
        output_size,
        bias=False,
        quant_config=None,
        prefix="",
        *,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        disable_tp: bool = False,
    ):
        tp_size = 1 if disable_tp else get_tensor_model_parallel_world_size()
        self.input_size_per_partition = divide(input_size, tp_size)
        self.output_partition_sizes = [output_size]
        super().__init__(
            input_size, [output_size], bias, quant_config, prefix, disable_tp=disable_tp
        )
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results

    # BEGIN LAB 17.1: a row-parallel weight's slice: which checkpoint columns this rank keeps
    def checkpoint_layout(self, param_name, shard_id, target_shape):
        """(the checkpoint tensor's whole shape, the dim this rank slices or
        None, where its slice starts) for ``param_name`` (upstream:
        ``weight_loader`` :1496)."""
        # HINT: the bias is whole on every rank (nothing sliced); the weight [out, in] keeps
        # HINT: input_size_per_partition of the input_size columns, rank after rank.
        if param_name == "bias":  # whole on every rank
            return tuple(target_shape), None, 0
        whole = (target_shape[0], self.input_size)
        return whole, 1, self.tp_rank * self.input_size_per_partition

    # END LAB 17.1

    # BEGIN LAB 17.1: a row-parallel layer's output: partial sums, added up once
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``y`` from this rank's slice of ``x`` (its whole ``x`` unless
        ``input_is_parallel``): a partial sum, all-reduced when
        ``reduce_results`` (upstream: ``forward`` :1540)."""
        # HINT: with input_is_parallel=False, x is whole: take this rank's part of its last dim.
        # HINT: the bias goes in once over the group (rank 0 only), before the partial sums add up.
        if not self.input_is_parallel:
            x = x.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()
        bias = self.bias if self.tp_rank == 0 else None
        output = self.quant_method.apply(self, x, bias)
        if self.reduce_results and self.tp_size > 1:
            output = tensor_model_parallel_all_reduce(output)
        return output

    # END LAB 17.1
