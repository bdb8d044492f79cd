"""What one layer's KV cache costs, the KV-cache groups, and how many blocks
and requests fit in a budget.

Mirrors upstream ``vllm/v1/kv_cache_interface.py`` at v0.22.1:
``AttentionSpec`` :144 (``page_size_bytes`` :152), ``FullAttentionSpec`` :188
(``max_memory_usage_bytes`` :210, ``merge`` :233), ``SlidingWindowSpec`` :435
(``max_admission_blocks_per_request`` :463, ``max_memory_usage_bytes`` :485),
``KVCacheTensor`` :813, ``KVCacheGroupSpec`` :823, ``KVCacheConfig`` :838; and
the sizing functions ``get_num_blocks`` (core/kv_cache_utils.py:935) and
``get_max_concurrency_for_kv_cache_config`` (core/kv_cache_utils.py:877).
mini_vllm's engine sizes its cache with these (worker/gpu_worker.py), so
they are its one source of truth. Grouping layers into KV-cache groups is
in ``core/kv_cache_utils.py``, as upstream.

Left out, and why:

- ``KVCacheSpec``, the root of upstream's hierarchy, is folded into
  ``AttentionSpec``: mini_vllm has attention layers only. MLA, Mamba,
  chunked-local, cross-attention and sink specs, quantized KV
  (``kv_quant_mode``), page padding and ``head_size_v`` are left out;
- upstream's ``max_memory_usage_bytes`` take a ``VllmConfig``; these take
  the numbers they read from it (``max_model_len``, and for a sliding
  window ``max_num_batched_tokens``). Decode/prefill context parallelism,
  which divides ``max_model_len`` upstream, does not exist here;
- ``get_max_concurrency_for_kv_cache_config`` takes a block count, one spec
  and a layer count instead of a ``KVCacheConfig``: one group of identical
  layers, the case upstream's ``get_kv_cache_config_from_groups`` handles in
  its general branch (kv_cache_utils.py:1236).

``num_requests_that_fit`` has no upstream twin: it is the exact number of
requests of a given length the scheduler can hold at once, which differs
from upstream's ``get_max_concurrency_for_kv_cache_config`` because that
one counts block 0, the null block, as usable.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division (upstream vllm/utils/math_utils.py:10)."""
    return -(a // -b)


def get_dtype_size(dtype: torch.dtype) -> int:
    """Bytes of one element (upstream vllm/utils/torch_utils.py:213)."""
    return torch.tensor([], dtype=dtype).element_size()


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """The KV-cache format of one attention layer (frozen: specs are dict keys
    when layers are grouped)."""

    block_size: int  # tokens per block
    num_kv_heads: int  # key/value heads (fewer than query heads under GQA)
    head_size: int  # dimension of one head
    dtype: torch.dtype  # dtype of the cached keys and values

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of ONE layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * get_dtype_size(self.dtype)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """The KV-cache format of one full-attention layer: every token it has
    seen stays in its cache until the request ends."""

    # Set only when the hybrid manager is off and a sliding-window layer is
    # managed as full attention (upstream :198): the window still applies
    # when attention is computed, but no block is freed for it.
    sliding_window: int | None = None

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

    @classmethod
    def merge(cls, specs: list[AttentionSpec]) -> FullAttentionSpec:
        """One spec for a group of full-attention layers (upstream :233): all
        must share the attention fields and at most one window size."""
        if not all(isinstance(spec, FullAttentionSpec) for spec in specs):
            raise AssertionError("every layer of a full-attention group must be full attention")
        windows = {spec.sliding_window for spec in specs if spec.sliding_window is not None}
        if len(windows) > 1:
            raise ValueError("all layers of one KV-cache group must have the same window size")
        merged = replace(specs[0], sliding_window=windows.pop() if windows else None)
        if any(replace(spec, sliding_window=merged.sliding_window) != merged for spec in specs):
            raise AssertionError("all layers of one KV-cache group must have the same spec")
        return merged


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """The KV-cache format of a layer that attends to its last
    ``sliding_window`` tokens only: blocks that slide out are freed."""

    sliding_window: int

    def max_admission_blocks_per_request(
        self, max_num_batched_tokens: int, max_model_len: int
    ) -> int:
        """Most blocks one request holds at once (upstream :463): the window's
        last ``sliding_window - 1`` computed tokens plus one step's new ones,
        and one more block because the window need not start on a block
        boundary."""
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Bytes of ONE layer's cache one request can hold at once (upstream :485)."""
        blocks = self.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
        return blocks * self.page_size_bytes

    @classmethod
    def merge(cls, specs: list[AttentionSpec]) -> SlidingWindowSpec:
        """Layers of one group must have equal specs (upstream's base ``merge``, :133)."""
        if any(spec != specs[0] for spec in specs[1:]):
            raise AssertionError("all layers of one KV-cache group must have the same spec")
        return specs[0]


@dataclass
class KVCacheTensor:
    """One cache tensor the runner allocates, and the layers that share it."""

    size: int  # bytes
    shared_by: list[str]  # layer names


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table: the manager sees them as one layer."""

    layer_names: list[str]
    kv_cache_spec: AttentionSpec


@dataclass
class KVCacheConfig:
    """The KV cache of a model: how many blocks, the tensors, the groups
    (one group per block table; a model with one kind of layer has one)."""

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]


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
