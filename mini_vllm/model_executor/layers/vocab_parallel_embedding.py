"""The token embedding and the output head, with weights a quantization method owns.

Mirrors upstream ``vllm/model_executor/layers/vocab_parallel_embedding.py``
at v0.22.1 (``UnquantizedEmbeddingMethod`` at :35, ``VocabParallelEmbedding``
at :192, ``ParallelLMHead`` at :503). Left out: splitting the vocabulary
across ranks and padding it, LoRA's extra tokens, the output bias.

``forward(ids)`` gathers rows (``quant_method.embedding``);
``quant_method.apply(layer, hidden)`` multiplies by the whole table, which
is how the model computes logits, for a tied head (the embedding itself)
as for an untied one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mini_vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)


class UnquantizedEmbeddingMethod(QuantizeMethodBase):
    """The table as it is, [vocab, hidden] in the model's dtype."""

    def create_weights(self, layer, input_size, output_partition_sizes, params_dtype):
        weight = torch.empty(sum(output_partition_sizes), input_size, dtype=params_dtype)
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)

    def embedding(self, layer, input_):
        return F.embedding(input_, layer.weight)


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        # The table seen as a linear layer's weight [out, in], one shard.
        self.input_size, self.output_sizes, self.shard_ids = embedding_dim, [num_embeddings], [None]
        method = quant_config.get_quant_method(self, prefix) if quant_config else None
        self.quant_method: QuantizeMethodBase = method or UnquantizedEmbeddingMethod()
        self.quant_method.create_weights(
            self, embedding_dim, [num_embeddings], torch.get_default_dtype()
        )

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        return self.quant_method.embedding(self, input_)

    def weight_loader(
        self, param_name: str, loaded: torch.Tensor, shard_id=None, ckpt_name: str = ""
    ) -> None:
        """As ``LinearBase.weight_loader``: copy with a shape check, unless the method loads."""
        custom = getattr(self.quant_method, "weight_loader", None)
        if custom is not None:
            custom(self, param_name, loaded, shard_id, ckpt_name)
            return
        target = getattr(self, param_name).data
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} has shape {tuple(loaded.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(loaded)


class ParallelLMHead(VocabParallelEmbedding):
    """An untied output head: used through ``quant_method.apply``, never called."""

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the LM head's weights are used by compute_logits, not forward")
