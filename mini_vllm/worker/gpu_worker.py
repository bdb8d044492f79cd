"""Owns the device: loads the model, sizes and allocates the paged KV cache.

Mirrors upstream ``vllm/v1/worker/gpu_worker.py`` (``Worker`` :109:
``determine_available_memory`` :358, ``initialize_from_config`` :543) and
the sizing in ``get_num_blocks`` (../core/kv_cache_utils.py:935) at v0.22.1.
Left out: profiling runs, sleep mode, CUDA graphs. The distributed
set-up of a tensor-parallel rank is in ``executor/multiproc_executor.py``
(``WorkerProc``), which calls ``initialize_kv_cache`` here in each rank.

The arithmetic (bytes per block, blocks per budget) is not done here: it
comes from ``mini_vllm.kv_cache_interface`` (``FullAttentionSpec``,
``get_num_blocks``), the one place mini_vllm computes KV-cache sizes.

The KV cache is one tensor per attention layer, shaped
``(num_blocks, 2, block_size, num_kv_heads, head_size)``. Its size comes
from, in order of precedence: an explicit block count, a byte budget, or a
fraction of the device's memory (on CUDA: of total memory, minus what is
already in use; on CPU: of physical memory). A budget that cannot hold one
``max_model_len`` request fails here, at engine start-up, with the numbers
(``check_enough_kv_cache_memory``); the scheduler itself, as upstream's,
accepts any cache of at least two blocks.

A model whose layers are not all full attention (sliding-window layers
beside full ones) goes the way upstream's engine takes every model:
``get_kv_cache_spec`` (one spec per layer), then ``get_kv_cache_groups``
and ``get_kv_cache_config_from_groups`` (../core/kv_cache_utils.py) size
one pool of blocks shared by the groups, and ``allocate_kv_caches_from_config``
allocates its tensors, each shared by one layer of every group (the groups
hold disjoint block ids, so they never write the same page).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from mini_vllm.attention.backend import get_attn_backend, get_kv_cache_shape
from mini_vllm.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from mini_vllm.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
    cdiv,
    get_num_blocks,
)
from mini_vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype


def get_kv_cache_spec(
    model: torch.nn.Module, block_size: int, dtype: torch.dtype
) -> dict[str, AttentionSpec]:
    """Layer name -> its KV-cache spec: a ``SlidingWindowSpec`` for a layer
    with a window, else a ``FullAttentionSpec`` (upstream: the worker's
    ``get_kv_cache_spec``, gpu_worker.py, asking each ``Attention`` layer)."""
    specs: dict[str, AttentionSpec] = {}
    for layer in model.attention_layers():
        shape = dict(
            block_size=block_size,
            num_kv_heads=layer.num_kv_heads,
            head_size=layer.head_size,
            dtype=dtype,
        )
        if layer.sliding_window is None:
            specs[layer.layer_name] = FullAttentionSpec(**shape)
        else:
            specs[layer.layer_name] = SlidingWindowSpec(
                sliding_window=layer.sliding_window, **shape
            )
    return specs


def kv_cache_spec_of(
    model: torch.nn.Module, block_size: int, dtype: torch.dtype
) -> tuple[FullAttentionSpec, int]:
    """(the spec every attention layer shares, the number of layers), as
    upstream's ``get_kv_cache_spec`` collects one spec per layer."""
    layers = model.attention_layers()
    specs = {
        FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=layer.num_kv_heads,
            head_size=layer.head_size,
            dtype=dtype,
        )
        for layer in layers
    }
    if len(specs) != 1:
        raise ValueError(
            f"mini_vllm needs every attention layer to have the same KV shape, "
            f"got {sorted(map(str, specs))}"
        )
    return specs.pop(), len(layers)


def device_memory_bytes(device: torch.device) -> tuple[int, int]:
    """(total, already used) bytes on the device."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, total - free
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, 0


def determine_num_blocks(
    *,
    kv_cache_spec: FullAttentionSpec,
    num_layers: int,
    max_model_len: int,
    num_gpu_blocks_override: int | None,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float,
    device: torch.device,
) -> int:
    """How many KV blocks to allocate (block 0, the null block, included)."""
    block_size = kv_cache_spec.block_size
    bytes_per_block = kv_cache_spec.page_size_bytes * num_layers
    budget, source = kv_cache_budget(
        num_gpu_blocks_override, kv_cache_memory_bytes, gpu_memory_utilization, device
    )
    num_blocks = get_num_blocks(
        num_layers, budget, kv_cache_spec.page_size_bytes, num_gpu_blocks_override
    )
    check_enough_kv_cache_memory(num_blocks, block_size, bytes_per_block, max_model_len, source)
    return num_blocks


def kv_cache_budget(
    num_gpu_blocks_override: int | None,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float,
    device: torch.device,
) -> tuple[int, str]:
    """(bytes the KV cache may take, where that number came from); 0 bytes
    with an explicit block count, which then decides alone."""
    budget = 0
    if num_gpu_blocks_override is not None:
        source = f"num_gpu_blocks_override={num_gpu_blocks_override}"
    else:
        if kv_cache_memory_bytes is not None:
            budget = kv_cache_memory_bytes
            source = f"kv_cache_memory_bytes={budget}"
        else:
            if not 0 < gpu_memory_utilization <= 1:
                raise ValueError(
                    f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}."
                )
            total, used = device_memory_bytes(device)
            budget = int(total * gpu_memory_utilization) - used
            source = (
                f"gpu_memory_utilization={gpu_memory_utilization} of "
                f"{total / 2**30:.1f} GiB with {used / 2**30:.1f} GiB in use"
            )
    return max(budget, 0), source


def determine_kv_cache_config(
    *,
    kv_cache_spec: dict[str, AttentionSpec],
    max_model_len: int,
    max_num_batched_tokens: int,
    num_gpu_blocks_override: int | None,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float,
    device: torch.device,
) -> KVCacheConfig:
    """The KV cache of a model with several kinds of layers: its groups, one
    pool of blocks for all of them, and the tensors (upstream:
    ``get_kv_cache_configs``, kv_cache_utils.py). Refused at start-up if the
    pool cannot hold one ``max_model_len`` request in every group."""
    budget, source = kv_cache_budget(
        num_gpu_blocks_override, kv_cache_memory_bytes, gpu_memory_utilization, device
    )
    groups = get_kv_cache_groups(kv_cache_spec)
    config = get_kv_cache_config_from_groups(groups, budget, num_gpu_blocks_override)
    # Blocks one max_model_len request can hold at once, every group together.
    needed = 1
    for group in groups:
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            needed += spec.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
        else:
            needed += cdiv(max_model_len, spec.block_size)
    if config.num_blocks < needed:
        raise ValueError(
            f"KV cache too small ({source}): {config.num_blocks} blocks shared by "
            f"{len(groups)} KV-cache groups, but one request of max_model_len={max_model_len} "
            f"can hold {needed} blocks (null block included). "
            "Raise the budget or lower max_model_len."
        )
    return config


def check_enough_kv_cache_memory(
    num_blocks: int, block_size: int, bytes_per_block: int, max_model_len: int, source: str
) -> None:
    """Refuse, at start-up, a cache that cannot hold one ``max_model_len`` request.

    Upstream's check is ``_check_enough_kv_cache_memory``
    (vllm/v1/core/kv_cache_utils.py:691), run once at engine start-up by
    ``get_kv_cache_configs``; its error gives the memory needed, the memory
    available, and the longest ``max_model_len`` that would fit. It compares
    bytes and does not count the null block; this one counts it, so a cache
    that passes can really hold the request (UPSTREAM_PIN.md).
    """
    needed = cdiv(max_model_len, block_size) + 1
    if num_blocks < needed:
        longest = (num_blocks - 1) * block_size
        fits = (
            f"This cache fits a max_model_len of at most {longest}. "
            if longest > 0
            else "This cache cannot hold even one block besides the null block. "
        )
        raise ValueError(
            f"KV cache too small ({source}): {num_blocks} blocks of {block_size} tokens "
            f"at {bytes_per_block} bytes each, but one request of max_model_len="
            f"{max_model_len} needs {needed} blocks (null block included), i.e. "
            f"{needed * bytes_per_block} bytes. {fits}"
            "Raise the budget or lower max_model_len."
        )


def allocate_kv_caches(
    model: torch.nn.Module,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str,
    kv_cache_dtype: str = "auto",
) -> list[torch.Tensor]:
    """One zeroed cache tensor per attention layer, bound to that layer. ``dtype``:
    the cache tensor's; ``kv_cache_dtype``: its name in the config ("auto", "fp8")."""
    impl_cls = get_attn_backend(attention_backend)
    caches = []
    for layer in model.attention_layers():
        shape = get_kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_size)
        cache = torch.zeros(shape, dtype=dtype, device=device)
        layer.bind(impl_cls, cache, kv_cache_dtype)
        caches.append(cache)
    return caches


def allocate_kv_caches_from_config(
    model: torch.nn.Module,
    kv_cache_config: KVCacheConfig,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str,
    kv_cache_dtype: str = "auto",
) -> list[torch.Tensor]:
    """One zeroed tensor per ``KVCacheTensor`` of the config, bound to every
    layer that shares it (upstream: ``initialize_kv_cache_tensors`` in the
    model runner); ``dtype`` and ``kv_cache_dtype`` as ``allocate_kv_caches``."""
    impl_cls = get_attn_backend(attention_backend)
    layers = {layer.layer_name: layer for layer in model.attention_layers()}
    block_size = {
        name: group.kv_cache_spec.block_size
        for group in kv_cache_config.kv_cache_groups
        for name in group.layer_names
    }
    caches = []
    for tensor in kv_cache_config.kv_cache_tensors:
        first = layers[tensor.shared_by[0]]
        shape = get_kv_cache_shape(
            kv_cache_config.num_blocks,
            block_size[first.layer_name],
            first.num_kv_heads,
            first.head_size,
        )
        cache = torch.zeros(shape, dtype=dtype, device=device)
        for name in tensor.shared_by:
            layers[name].bind(impl_cls, cache, kv_cache_dtype)
        caches.append(cache)
    return caches


class KVCacheSetup(NamedTuple):
    """What ``initialize_kv_cache`` built: the spec every layer shares (the
    first group's, with groups), the layer count, the bytes one block id
    spans, the tensors, the groups (None for a full-attention model) and the
    block count (null block included)."""

    kv_cache_spec: AttentionSpec
    num_layers: int
    bytes_per_block: int
    kv_caches: list[torch.Tensor]
    kv_cache_config: KVCacheConfig | None
    num_blocks: int


def initialize_kv_cache(
    vllm_config,
    model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    attention_backend: str,
    num_gpu_blocks_override: int | None = None,
) -> KVCacheSetup:
    """Size this process's KV cache and allocate it, bound to the model's
    attention layers. With tensor parallelism each rank's layers hold their
    KV heads only, so a block takes ``1/tp`` of the bytes (fewer when KV
    heads are replicated) and a byte budget holds that many more blocks.
    ``num_gpu_blocks_override``: a count that wins over the config's budget
    (the executor passes the smallest count of all ranks)."""
    cache = vllm_config.cache_config
    override = num_gpu_blocks_override or cache.num_gpu_blocks_override
    kv_dtype = kv_cache_dtype_str_to_dtype(cache.cache_dtype, dtype)  # fp8: a byte a value
    # A model with sliding-window layers gets KV-cache groups (one block
    # table each); a full-attention model keeps one group, sized here.
    layer_specs = get_kv_cache_spec(model, cache.block_size, kv_dtype)
    if all(isinstance(s, FullAttentionSpec) for s in layer_specs.values()):
        kv_cache_spec, num_layers = kv_cache_spec_of(model, cache.block_size, kv_dtype)
        num_blocks = determine_num_blocks(
            kv_cache_spec=kv_cache_spec,
            num_layers=num_layers,
            max_model_len=vllm_config.model_config.max_model_len,
            num_gpu_blocks_override=override,
            kv_cache_memory_bytes=cache.kv_cache_memory_bytes,
            gpu_memory_utilization=cache.gpu_memory_utilization,
            device=device,
        )
        kv_caches = allocate_kv_caches(
            model,
            num_blocks,
            cache.block_size,
            kv_dtype,
            device,
            attention_backend,
            cache.cache_dtype,
        )
        return KVCacheSetup(
            kv_cache_spec,
            num_layers,
            kv_cache_spec.page_size_bytes * num_layers,
            kv_caches,
            None,
            num_blocks,
        )
    kv_cache_config = determine_kv_cache_config(
        kv_cache_spec=layer_specs,
        max_model_len=vllm_config.model_config.max_model_len,
        max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        num_gpu_blocks_override=override,
        kv_cache_memory_bytes=cache.kv_cache_memory_bytes,
        gpu_memory_utilization=cache.gpu_memory_utilization,
        device=device,
    )
    kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    kv_caches = allocate_kv_caches_from_config(
        model, kv_cache_config, kv_dtype, device, attention_backend, cache.cache_dtype
    )
    # A block id spans one page of each shared tensor.
    bytes_per_block = kv_cache_spec.page_size_bytes * len(kv_cache_config.kv_cache_tensors)
    return KVCacheSetup(
        kv_cache_spec,
        len(layer_specs),
        bytes_per_block,
        kv_caches,
        kv_cache_config,
        kv_cache_config.num_blocks,
    )
