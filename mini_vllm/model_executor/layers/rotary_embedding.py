"""Rotary position embedding (RoPE), applied token by token from position ids.

Mirrors upstream ``vllm/model_executor/layers/rotary_embedding/base.py`` at
v0.22.1 (``RotaryEmbedding`` at :118, its cache built by
``RotaryEmbeddingBase._compute_cos_sin_cache`` at :83) and the factory
``get_rope`` (__init__.py:33), with the two rotations of ``rotate_neox``
(common.py:18) and ``rotate_gptj`` (common.py:24). Left out: every scaled
variant (linear, dynamic NTK, YaRN, Llama 3, M-RoPE, ...), partial rotary
dimensions, the fused CUDA kernel, FlashInfer and AITER paths.

The batch is flat, so there is no "sequence" axis to index by: each token
carries its own position, and row ``p`` of a precomputed ``[cos | sin]``
table rotates it. Pair ``i`` of a head (i < head_size / 2) turns by angle
``p * base ** (-2i / head_size)``. Which two numbers form pair ``i`` is the
style:

- neox (Hugging Face Llama/Qwen3, ``is_neox_style=True``): ``x[i]`` and
  ``x[i + head_size/2]``, the two halves of the head;
- GPT-J (``is_neox_style=False``): ``x[2i]`` and ``x[2i + 1]``, neighbours.

The two are the same rotation up to a fixed permutation of each head's
rows, which is exactly the permutation llama.cpp applies to q/k weights when
it writes a Llama GGUF. Upstream therefore runs GGUF Llamas in GPT-J style;
mini_vllm un-permutes the weights at load time and always uses neox.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_size: int, max_position_embeddings: int, base: float, is_neox_style: bool = True
    ) -> None:
        super().__init__()
        if head_size % 2:
            raise ValueError(f"RoPE needs an even head size, got {head_size}")
        self.head_size = head_size
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        # Float32 [max_position, head_size]: cos of every angle, then sin.
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache(), persistent=False)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        # Same float32 arithmetic as Hugging Face's default rope init, so the
        # tables agree bit for bit.
        exponents = torch.arange(0, self.head_size, 2, dtype=torch.int64).float() / self.head_size
        inv_freq = 1.0 / (self.base**exponents)  # [head_size / 2]
        t = torch.arange(self.max_position_embeddings, dtype=torch.float32)
        angles = torch.outer(t, inv_freq)  # [max_position, head_size / 2]
        return torch.cat((angles.cos(), angles.sin()), dim=-1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (each below max_position_embeddings); query [T, num_heads*head_size];
        key [T, num_kv_heads*head_size]. Rotates query and key in place and returns them."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).to(query.dtype).chunk(2, dim=-1)
        # [T, head_size/2] -> [T, 1, head_size/2]: the same angles for every head.
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return self._rotate_(query, cos, sin), self._rotate_(key, cos, sin)

    def _rotate_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates ``x`` in place and returns it, as upstream's kernel does
        (``forward_cpu``, rotary_embedding/base.py:277, calls the in-place
        ``ops.rotary_embedding``); the numbers are those of ``forward_native``."""
        heads = x.view(x.shape[0], -1, self.head_size)  # a view: writes reach x
        if self.is_neox_style:
            x1, x2 = heads.chunk(2, dim=-1)
        else:
            x1, x2 = heads[..., 0::2], heads[..., 1::2]
        r1 = x1 * cos - x2 * sin  # from the old x1 and x2, before either is written
        x2.mul_(cos).add_(x1 * sin)  # x2 * cos + x1 * sin
        x1.copy_(r1)
        return x

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, max_position_embeddings={self.max_position_embeddings}, "
            f"base={self.base}, is_neox_style={self.is_neox_style}"
        )


def get_rope(
    head_size: int,
    max_position: int,
    rope_parameters: dict[str, Any] | None,
    is_neox_style: bool = True,
) -> RotaryEmbedding:
    """Build the RoPE a Hugging Face config asks for; only the unscaled kind exists here.

    ``rope_parameters`` is transformers' dict (``{"rope_type": "default",
    "rope_theta": ...}``); ``None`` means default RoPE with theta 10000.
    """
    params = dict(rope_parameters or {})
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type != "default":
        raise ValueError(
            f"RoPE scaling type {rope_type!r} is not supported by mini_vllm "
            "(only unscaled 'default' RoPE)"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    base = float(params.get("rope_theta", 10000.0))
    return RotaryEmbedding(head_size, max_position, base, is_neox_style)
