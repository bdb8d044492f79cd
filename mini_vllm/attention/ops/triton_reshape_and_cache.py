"""Store the new tokens' keys and values in the paged KV cache (a Triton kernel).

Mirrors upstream ``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py``
(``reshape_and_cache_kernel_flash`` :18 and its launcher
``triton_reshape_and_cache_flash`` :319) at v0.22.1. Left out: FP8 and per-head
quantized caches (scales), the head-major layout some platforms use, the
"diffkv" variant with different key and value head sizes, and upstream's
tiling of one token's row over several programs.

Layout (see ``mini_vllm.attention.backend``): one layer's cache is
``(num_blocks, 2, block_size, num_kv_heads, head_size)``; index 0 of the
second axis holds keys, 1 holds values. A token whose slot is ``s`` lands in
block ``s // block_size`` at offset ``s % block_size``.

Invariants:
- exactly the slots named in ``slot_mapping`` are written, each with its
  token's key (axis 1 = 0) and value (axis 1 = 1), converted to the cache
  dtype as ``Tensor.to`` does (the launcher converts; the kernel copies);
- a slot of -1 marks a padding token: nothing is written for it;
- the launcher works on CPU tensors under ``TRITON_INTERPRET=1`` and on
  CUDA tensors when compiled; it never synchronises with the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    kv_cache_ptr,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens], int64
    key_stride_tok,
    key_stride_head,
    value_stride_tok,
    value_stride_head,
    cache_stride_block,
    cache_stride_kv,
    cache_stride_slot,
    cache_stride_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of 2
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_SIZE rounded up to a power of 2
    BLOCK_SIZE: tl.constexpr,
):
    # One program per token: it copies that token's whole [heads, head_size]
    # row of keys and the same row of values. tl.arange needs power-of-2
    # lengths, so the tile is padded and the padding masked off.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # a padding token: it owns no slot

    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_SIZE)

    # Source: row `token` of key and value (the last axis is contiguous).
    tok = token.to(tl.int64)
    k = tl.load(
        key_ptr + tok * key_stride_tok + heads[:, None] * key_stride_head + dims[None, :], mask=mask
    )
    v = tl.load(
        value_ptr + tok * value_stride_tok + heads[:, None] * value_stride_head + dims[None, :],
        mask=mask,
    )

    # Destination: cache[block, 0 or 1, offset, head, dim].
    dst = (
        kv_cache_ptr
        + block * cache_stride_block
        + offset * cache_stride_slot
        + heads[:, None] * cache_stride_head
        + dims[None, :]
    )
    tl.store(dst, k, mask=mask)
    tl.store(dst + cache_stride_kv, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] (int64; -1 = skip)
) -> None:
    """Write ``key[t]``/``value[t]`` into ``kv_cache`` at ``slot_mapping[t]``, in place."""
    num_tokens, num_kv_heads, head_size = key.shape
    assert value.shape == key.shape, (value.shape, key.shape)
    assert slot_mapping.shape[0] >= num_tokens
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2
    assert kv_cache.shape[3:] == (num_kv_heads, head_size), (kv_cache.shape, key.shape)
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.stride(4) == 1, (
        "the head_size axis must be contiguous"
    )
    if num_tokens == 0:
        return
    if key.dtype != kv_cache.dtype:
        # Convert with torch (round to nearest even) so the kernel is a plain
        # copy: Triton's interpreter truncates float32 -> bfloat16 instead.
        key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE=head_size,
        HEAD_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=kv_cache.shape[2],
    )
