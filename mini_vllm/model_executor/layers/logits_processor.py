"""Logits from the last hidden states: the LM head's matmul, gathered over the ranks.

Mirrors upstream ``vllm/model_executor/layers/logits_processor.py`` at
v0.22.1 (``LogitsProcessor`` :19, ``_gather_logits`` :75, ``_get_logits``
:89). Each rank multiplies by its rows of the (padded) vocabulary; an
all-gather puts the slices side by side on every rank (upstream's default,
``Platform.use_all_gather``: every rank then samples the same token), and
the padding columns are cut off. Left out: ``scale``, ``soft_cap``, the
embedding bias, gather-to-one-rank, vocab-parallel argmax.
"""

from __future__ import annotations

import torch
from torch import nn

from mini_vllm.distributed.communication_op import tensor_model_parallel_all_gather


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int, org_vocab_size: int | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.org_vocab_size = org_vocab_size or vocab_size

    def forward(self, lm_head: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] -> logits [N, org_vocab_size], on every rank."""
        logits = lm_head.quant_method.apply(lm_head, hidden_states)
        if getattr(lm_head, "tp_size", 1) > 1:
            logits = tensor_model_parallel_all_gather(logits)
        return logits[..., : self.org_vocab_size]
