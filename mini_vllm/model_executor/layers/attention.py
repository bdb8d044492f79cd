"""The attention layer a model calls: paged KV cache plus a backend.

Mirrors upstream ``vllm/model_executor/layers/attention/attention.py``
(``Attention`` :177, its ``forward`` :437) at v0.22.1. Left out: quantized KV, sliding windows,
KV-sharing, custom-op registration for torch.compile.

The model runner binds ``kv_cache`` (one tensor per layer, see
``mini_vllm.attention.backend``) and a backend implementation before the
first forward; each forward takes its metadata from the forward context.
"""

from __future__ import annotations

import torch
from torch import nn

from mini_vllm.attention.backend import AttentionImpl
from mini_vllm.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, prefix: str = ""
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_name = prefix
        self.kv_cache: torch.Tensor | None = None
        self.impl: AttentionImpl | None = None

    def bind(self, impl_cls: type[AttentionImpl], kv_cache: torch.Tensor) -> None:
        self.impl = impl_cls(self.num_heads, self.head_size, self.scale, self.num_kv_heads)
        self.kv_cache = kv_cache

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [T, num_heads*head_size], key/value [T, num_kv_heads*head_size]
        -> [T, num_heads*head_size]."""
        if self.impl is None or self.kv_cache is None:
            raise RuntimeError(f"attention layer {self.layer_name!r} has no KV cache bound")
        metadata = get_forward_context().attn_metadata
        t = query.shape[0]
        out = self.impl.forward(
            query.view(t, self.num_heads, self.head_size),
            key.view(t, self.num_kv_heads, self.head_size),
            value.view(t, self.num_kv_heads, self.head_size),
            self.kv_cache,
            metadata,
        )
        return out.reshape(t, self.num_heads * self.head_size)
