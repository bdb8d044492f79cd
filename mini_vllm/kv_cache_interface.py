"""What one layer's KV cache costs, and how many blocks and requests fit in a budget.

Mirrors upstream ``vllm/v1/kv_cache_interface.py`` (``AttentionSpec`` :144
with ``page_size_bytes`` :152 and ``real_page_size_bytes`` :167,
``FullAttentionSpec`` :188 with ``max_memory_usage_bytes`` :210) and the
sizing functions ``get_num_blocks`` (core/kv_cache_utils.py:935) and
``get_max_concurrency_for_kv_cache_config`` (core/kv_cache_utils.py:877) at v0.22.1.
mini_vllm's engine sizes its cache with these (worker/gpu_worker.py), so
they are its one source of truth.

Left out, and why:

- the spec hierarchy (``KVCacheSpec`` -> ``AttentionSpec`` ->
  ``FullAttentionSpec``) is one class here: mini_vllm has full attention
  only. Sliding windows, MLA, Mamba, quantized KV (``kv_quant_mode``),
  page padding and ``head_size_v`` are left out;
- upstream's functions take a ``VllmConfig`` and a ``KVCacheConfig``; these
  take the numbers they read from them (``max_model_len``, ``num_blocks``,
  the number of layers). Decode/prefill context parallelism, which divides
  ``max_model_len`` upstream, does not exist here;
- the cache is one KV-cache group of ``num_layers`` identical layers, the
  case upstream's ``get_kv_cache_config_from_groups`` handles in its general
  branch (kv_cache_utils.py:1236).

``num_requests_that_fit`` has no upstream twin: it is the exact number of
requests of a given length the scheduler can hold at once, which differs
from upstream's ``get_max_concurrency_for_kv_cache_config`` because that
one counts block 0, the null block, as usable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division (upstream vllm/utils/math_utils.py:10)."""
    return -(a // -b)


def get_dtype_size(dtype: torch.dtype) -> int:
    """Bytes of one element (upstream vllm/utils/torch_utils.py:213)."""
    return torch.tensor([], dtype=dtype).element_size()


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec:
    """The KV-cache format of one full-attention layer."""

    block_size: int  # tokens per block
    num_kv_heads: int  # key/value heads (fewer than query heads under GQA)
    head_size: int  # dimension of one head
    dtype: torch.dtype  # dtype of the cached keys and values

    # BEGIN LAB 00.2: the KV-memory calculator
    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of ONE layer: keys and values of ``block_size`` tokens."""
        # HINT: a block holds a key AND a value vector per token, per KV head.
        return 2 * self.block_size * self.num_kv_heads * self.head_size * get_dtype_size(self.dtype)

    # END LAB 00.2

    # BEGIN LAB 00.2: max_memory_usage_bytes: one max_model_len request's bytes
    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        """Bytes of ONE layer's cache that a request of ``max_model_len`` tokens can use."""
        # HINT: memory is handed out in whole blocks.
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    # END LAB 00.2


def kv_cache_bytes_per_token(spec: FullAttentionSpec, num_layers: int) -> float:
    """Bytes of KV cache one token costs across all layers (a block's bytes / its tokens)."""
    return num_layers * spec.page_size_bytes / spec.block_size


# BEGIN LAB 00.2: get_num_blocks: how many blocks the memory budget holds
def get_num_blocks(
    num_layers: int,
    available_memory: int,
    page_size: int,
    num_gpu_blocks_override: int | None = None,
) -> int:
    """How many blocks ``available_memory`` bytes hold when every block spans
    ``num_layers`` layers of ``page_size`` bytes each (block 0, the null
    block, included); an override, when given, wins."""
    # HINT: upstream divides by the page size, then by the number of layers, rounding down.
    if num_gpu_blocks_override is not None:
        return num_gpu_blocks_override
    return max(int(available_memory // page_size // num_layers), 0)


# END LAB 00.2


# BEGIN LAB 00.2: get_max_concurrency_for_kv_cache_config: max_model_len requests at once
def get_max_concurrency_for_kv_cache_config(
    num_blocks: int, kv_cache_spec: FullAttentionSpec, num_layers: int, max_model_len: int
) -> float:
    """Upstream's "Maximum concurrency for N tokens per request": ``num_blocks``
    divided by the blocks one ``max_model_len`` request needs (a float)."""
    # HINT: per request: num_layers layers, each max_memory_usage_bytes; per block:
    # HINT: num_layers pages. Round the blocks per request up; do not round the result.
    bytes_per_request = num_layers * kv_cache_spec.max_memory_usage_bytes(max_model_len)
    bytes_per_block = num_layers * kv_cache_spec.page_size_bytes
    blocks_per_request = cdiv(bytes_per_request, bytes_per_block)
    return num_blocks / blocks_per_request


# END LAB 00.2


# BEGIN LAB 00.2: num_requests_that_fit: requests of a given length at once
def num_requests_that_fit(
    num_blocks: int, kv_cache_spec: FullAttentionSpec, num_tokens: int
) -> int:
    """How many requests of ``num_tokens`` tokens each the KV cache holds at
    once: what the scheduler actually runs side by side when memory binds."""
    # HINT: block 0 is the null block: the block pool never hands it out.
    return (num_blocks - 1) // cdiv(num_tokens, kv_cache_spec.block_size)


# END LAB 00.2
