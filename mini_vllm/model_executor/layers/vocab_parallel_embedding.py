"""The token embedding and the output head, split over the ranks by vocabulary.

Mirrors upstream ``vllm/model_executor/layers/vocab_parallel_embedding.py``
at v0.22.1 (``UnquantizedEmbeddingMethod`` at :35, ``pad_vocab_size`` :81,
``vocab_range_from_global_vocab_size`` :94, ``get_masked_input_and_mask``
:163, ``VocabParallelEmbedding`` at :192, ``ParallelLMHead`` at :503).

Split over ``tp`` ranks, the vocabulary is padded up to a multiple of 64
(``padding_size``) and rank ``r`` keeps rows ``[r * V/tp, (r+1) * V/tp)``
of the padded table (the padding rows are zeros). ``forward(ids)`` looks
up the ids this rank holds, writes zeros for the others, and one
all-reduce adds the ranks' rows up: each token's row comes from the one
rank that has it. For logits, ``quant_method.apply(layer, hidden)``
multiplies by this rank's rows: its slice of the vocabulary, which the
``LogitsProcessor`` all-gathers (logits_processor.py); a tied head is the
embedding itself.

Left out: LoRA's added tokens (``org_num_embeddings``), the output bias,
quantized tables split over ranks. One difference: upstream pads the
vocabulary even with one rank; here a table whole on one rank keeps the
checkpoint's shape (the quantized GGUF method and LoRA read it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mini_vllm.distributed.communication_op import tensor_model_parallel_all_reduce
from mini_vllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from mini_vllm.model_executor.layers.linear import divide
from mini_vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from mini_vllm.model_executor.layers.utils import (
    dispatch_cpu_unquantized_gemm,
    dispatch_unquantized_gemm,
)

DEFAULT_VOCAB_PADDING_SIZE = 64


class UnquantizedEmbeddingMethod(QuantizeMethodBase):
    """The table as it is, [vocab, hidden] in the model's dtype."""

    def create_weights(self, layer, input_size, output_partition_sizes, params_dtype):
        weight = torch.empty(sum(output_partition_sizes), input_size, dtype=params_dtype)
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))

    def process_weights_after_loading(self, layer):
        """On a CPU, pack the table for the logits' matmul (upstream's CPU GEMM dispatch)."""
        if layer.weight.device.type == "cpu":
            dispatch_cpu_unquantized_gemm(layer)

    def apply(self, layer, x, bias=None):
        return dispatch_unquantized_gemm(layer.weight.device)(layer, x, layer.weight, bias)

    def embedding(self, layer, input_):
        return F.embedding(input_, layer.weight)


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    """``vocab_size`` rounded up to a multiple of ``pad_to``."""
    return (vocab_size + pad_to - 1) // pad_to * pad_to


def vocab_range_from_global_vocab_size(
    global_vocab_size: int, rank: int, world_size: int
) -> tuple[int, int]:
    """[start, end) of rank ``rank``'s equal part of ``global_vocab_size`` ids."""
    per_partition = divide(global_vocab_size, world_size)
    return rank * per_partition, (rank + 1) * per_partition


# BEGIN LAB 17.2: token ids as rows of this rank's table, and which ids it lacks
def get_masked_input_and_mask(
    input_: torch.Tensor, org_vocab_start_index: int, org_vocab_end_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids as rows of this rank's table, 0 where the rank lacks the id;
    True where it lacks it)."""
    # HINT: an id in [org_vocab_start_index, org_vocab_end_index) is row id - start here.
    mask = (input_ >= org_vocab_start_index) & (input_ < org_vocab_end_index)
    return (input_ - org_vocab_start_index) * mask, ~mask


# END LAB 17.2


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
    ) -> None:
        # The base class by name, not super(): the lab starter's class
        # subclasses this one, and super() there would run this method again.
        nn.Module.__init__(self)
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = self.org_vocab_size = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        if self.tp_size > 1 and quant_config is not None:
            raise ValueError(f"{prefix}: a quantized table cannot be split over ranks in mini_vllm")
        # BEGIN LAB 17.2: the padded vocabulary and this rank's ids in it
        # HINT: set self.num_embeddings_padded (padded to padding_size only when split over
        # HINT: ranks), self.num_embeddings_per_partition (this rank's table rows) and
        # HINT: [self.org_vocab_start_index, self.org_vocab_end_index): the real ids this rank
        # HINT: holds, padding left out (pad_vocab_size and vocab_range_from_global_vocab_size).
        padded = num_embeddings
        if self.tp_size > 1:
            padded = pad_vocab_size(num_embeddings, padding_size)
        self.num_embeddings_padded = padded
        self.num_embeddings_per_partition = divide(padded, self.tp_size)
        start, end = vocab_range_from_global_vocab_size(padded, self.tp_rank, self.tp_size)
        # This rank's ids, padding left out: [org_vocab_start_index, org_vocab_end_index).
        self.org_vocab_start_index = min(start, num_embeddings)
        self.org_vocab_end_index = min(end, num_embeddings)
        # END LAB 17.2
        # The table seen as a linear layer's weight [out, in], one shard.
        self.input_size, self.output_sizes, self.shard_ids = embedding_dim, [num_embeddings], [None]
        method = quant_config.get_quant_method(self, prefix) if quant_config else None
        self.quant_method: QuantizeMethodBase = method or UnquantizedEmbeddingMethod()
        self.quant_method.create_weights(
            self, embedding_dim, [self.num_embeddings_per_partition], torch.get_default_dtype()
        )

    # BEGIN LAB 17.2: the embedding split by vocabulary: look up what this rank has, sum
    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """Each token id's row of the whole table, on every rank (upstream:
        ``forward`` :470)."""
        # HINT: self.quant_method.embedding(self, ids) looks rows up in this rank's table;
        # HINT: a row for an id this rank lacks must add nothing to the all-reduced sum.
        if self.tp_size == 1:
            return self.quant_method.embedding(self, input_)
        masked_input, input_mask = get_masked_input_and_mask(
            input_, self.org_vocab_start_index, self.org_vocab_end_index
        )
        output = self.quant_method.embedding(self, masked_input)
        output.masked_fill_(input_mask.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(output)

    # END LAB 17.2

    def weight_loader(
        self, param_name: str, loaded: torch.Tensor, shard_id=None, ckpt_name: str = ""
    ) -> None:
        """Copy this rank's rows of the checkpoint's table (zeros for the
        padding), with a shape check, unless the method loads."""
        custom = getattr(self.quant_method, "weight_loader", None)
        if custom is not None:
            custom(self, param_name, loaded, shard_id, ckpt_name)
            return
        target = getattr(self, param_name).data
        whole = (self.org_vocab_size, *target.shape[1:])
        if tuple(loaded.shape) != whole:
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} has shape {tuple(loaded.shape)}, expected {whole}"
            )
        start, end = self.org_vocab_start_index, self.org_vocab_end_index
        with torch.no_grad():
            target[: end - start].copy_(loaded[start:end])
            target[end - start :].fill_(0)


class ParallelLMHead(VocabParallelEmbedding):
    """An untied output head: used through ``quant_method.apply``, never called."""

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the LM head's weights are used by compute_logits, not forward")
