"""The contract between the model runner, the attention layers and a backend.

Mirrors upstream ``vllm/v1/attention/backend.py`` (``AttentionBackend`` :55,
``AttentionMetadata`` :345, ``AttentionImpl`` :763) at v0.22.1, shaped
after its Triton backend's metadata (``TritonAttentionMetadata``
(backends/triton_attn.py:59)). Left out: cascade attention,
CUDA-graph padding, multimodal prefix ranges, FP8 KV cache.

The batch is *flat*: the new tokens of every scheduled request are
concatenated, request after request, in scheduling order::

    query_start_loc = [0, q0, q0+q1, ...]   # request i owns tokens [qsl[i], qsl[i+1])
    seq_lens[i]     = tokens of request i in the KV cache after this step
                    = num_computed_tokens + its new tokens
    block_table[i]  = its block ids (row padded with 0, the null block)
    slot_mapping[t] = block_id * block_size + offset of token t's KV slot
                      (always a real slot: mini_vllm never pads the batch,
                      so upstream's -1 "skip this token" never occurs)

A query token of request i at position p attends to KV positions 0..p of
that request: the cached context plus the new tokens up to itself (causal).
A layer with a ``sliding_window`` of w attends to positions p-w+1..p only
(its last w tokens, itself included), as upstream's backends do (flash
attention's ``window_size=(w - 1, 0)``); the blocks before that may hold
anything (the scheduler gave them back: the null block in their place).
A model with several KV-cache groups gets one metadata per group, handed to
each layer by name (``dict[layer_name, AttentionMetadata]``, as upstream's
forward context).

KV cache of one layer: ``(num_blocks, 2, block_size, num_kv_heads,
head_size)``, index 0 = keys, 1 = values (the Triton backend's layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    max_seq_len: int
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens]

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


def get_kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, ...]:
    return (num_blocks, 2, block_size, num_kv_heads, head_size)


class AttentionImpl:
    """One backend's attention computation; subclasses implement ``forward``."""

    # Rows with at most this many new tokens count as decodes, and the model
    # runner puts them first in the batch (upstream: the metadata builder's
    # ``reorder_batch_threshold``, read by gpu_model_runner.py:1072); None: any order.
    reorder_batch_threshold: int | None = None

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        # None: full attention; w: each query sees its last w key positions.
        self.sliding_window = sliding_window

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # get_kv_cache_shape(...)
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        """Write key/value into kv_cache at slot_mapping, then attend."""
        raise NotImplementedError


def get_attn_backend(name: str) -> type[AttentionImpl]:
    """'cpu' (batched torch, the default on CPU), 'torch' (the reference) or 'triton'."""
    if name == "cpu":
        from mini_vllm.attention.backends.cpu_attn import CPUAttentionBackendImpl

        return CPUAttentionBackendImpl
    if name == "torch":
        from mini_vllm.attention.backends.torch_attn import TorchAttentionImpl

        return TorchAttentionImpl
    if name == "triton":
        from mini_vllm.attention.backends.triton_attn import TritonAttentionImpl

        return TritonAttentionImpl
    raise ValueError(f"Unknown attention backend {name!r}: use 'cpu', 'torch' or 'triton'.")
