"""Helpers to build and drive a mini_vllm Scheduler without a model, and the
transformers greedy loop that model runs are compared against (``hf_greedy``),
and the tiny seeded LLaVA checkpoint of Phase 13 (``make_tiny_llava``).

The keyword names follow upstream's test helpers (tests/v1/core/utils.py:
``create_scheduler``, ``create_requests``), and ``mini_vllm.oracle.upstream``
offers the same three functions for the pinned upstream, so one workload
script drives either. Labs and notebooks use this module too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mini_vllm.config import (
    CacheConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from mini_vllm.core.kv_cache_manager import KVCacheManager
from mini_vllm.core.kv_cache_utils import (
    get_request_block_hasher,
    make_block_hash_with_group_id,
    sha256,
)
from mini_vllm.core.sched.async_scheduler import AsyncScheduler
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from mini_vllm.lora.request import LoRARequest
from mini_vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from mini_vllm.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from mini_vllm.request import Request, RequestStatus
from mini_vllm.sampling_params import SamplingParams, StructuredOutputsParams
from mini_vllm.structured_output import StructuredOutputManager

EOS_TOKEN_ID = 50256  # the id upstream's scheduler tests use

__all__ = [
    "EOS_TOKEN_ID",
    "RequestStatus",
    "create_scheduler",
    "create_requests",
    "create_kv_cache_manager",
    "create_structured_output_manager",
    "manager_state",
    "make_model_runner_output",
    "ModelRunnerOutput",
    "KVConnectorOutput",
    "DraftTokenIds",
    "RecordingGrammar",
    "make_tiny_llava",
]


def create_scheduler(
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    enable_prefix_caching: bool = True,
    long_prefill_token_threshold: int = 0,
    num_blocks: int = 10000,
    block_size: int = 16,
    max_model_len: int | None = None,
    enable_chunked_prefill: bool = True,
    policy: str = "fcfs",
    scheduler_reserve_full_isl: bool = True,
    scheduler_cls: type | None = None,
    async_scheduling: bool = False,
    num_speculative_tokens: int | None = None,
    kv_groups: list | None = None,
    max_loras: int | None = None,
    kv_transfer_config: dict | None = None,
    mm_max_tokens_per_item: int | None = None,
    max_num_encoder_input_tokens: int | None = None,
    encoder_cache_size: int | None = None,
    disable_chunked_mm_input: bool = False,
) -> Scheduler:
    """A scheduler over ``num_blocks`` KV blocks (block 0 is the null block);
    an ``AsyncScheduler`` with ``async_scheduling``, as upstream's engine picks;
    with ``num_speculative_tokens``, an n-gram speculative config (as
    upstream's helper builds one). With both, the scheduler is the one
    upstream runs for a drafter in the worker (EAGLE, MTP, ``ngram_gpu``):
    mini_vllm has no such drafter, and its config refuses async scheduling
    with the n-gram one, as upstream's does, so the switch is set after the
    config is checked. ``kv_groups``: one KV-cache group per entry (``None``
    full attention, an int a sliding window; ``kv_cache_config_of``); default
    one full-attention group. ``max_loras``: LoRA on, with that many adapters a step.
    ``kv_transfer_config``: KVTransferConfig's fields, for a scheduler with a
    KV connector. ``mm_max_tokens_per_item``: a multimodal (image) model whose
    items have at most that many embeddings, with the encoder budgets
    ``max_num_encoder_input_tokens`` and ``encoder_cache_size`` (None:
    max_num_batched_tokens, upstream's value)."""
    if max_model_len is None:
        max_model_len = max_num_batched_tokens
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            max_model_len=max_model_len,
            mm_max_tokens_per_item=None
            if mm_max_tokens_per_item is None
            else {"image": mm_max_tokens_per_item},
        ),
        cache_config=CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            num_gpu_blocks=num_blocks,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            policy=policy,
            scheduler_reserve_full_isl=scheduler_reserve_full_isl,
            async_scheduling=async_scheduling if num_speculative_tokens is None else False,
            max_num_encoder_input_tokens=max_num_encoder_input_tokens,
            encoder_cache_size=encoder_cache_size,
            disable_chunked_mm_input=disable_chunked_mm_input,
        ),
        speculative_config=None
        if num_speculative_tokens is None
        else SpeculativeConfig(num_speculative_tokens=num_speculative_tokens),
        lora_config=None if max_loras is None else LoRAConfig(max_loras=max_loras),
        kv_transfer_config=None
        if kv_transfer_config is None
        else KVTransferConfig(**kv_transfer_config),
    )
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    if scheduler_cls is None:
        scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
    if kv_groups is None:
        return scheduler_cls(vllm_config, log_stats=True)
    kv_cache_config = kv_cache_config_of(num_blocks, block_size, kv_groups)
    return scheduler_cls(vllm_config, log_stats=True, kv_cache_config=kv_cache_config)


def first_hit(pool, block_hash, group_id: int = 0):
    """The block ``pool`` would hand out for ``block_hash`` in KV-cache group
    ``group_id`` (the oldest cached under that key), or None."""
    hit = pool.get_cached_block(block_hash, [group_id])
    return None if hit is None else hit[0]


def cache_key(block_hash, group_id: int = 0) -> bytes:
    """A block's ``block_hash`` once cached: its hash with the group id appended."""
    return make_block_hash_with_group_id(block_hash, group_id)


def create_requests(
    num_requests: int,
    num_tokens: int = 10,
    max_tokens: int = 16,
    stop_token_ids: list[int] | None = None,
    same_prompt: bool = False,
    block_size: int = 16,
    req_ids: Sequence[str] | None = None,
    prompt_token_ids: Sequence[list[int]] | None = None,
    priorities: Sequence[int] | None = None,
    arrival_times: Sequence[float] | None = None,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    structured_outputs: dict | None = None,
    lora_ids: Sequence[int | None] | None = None,
    mm_items: Sequence[list | None] | None = None,
) -> list[Request]:
    """Requests whose prompts are ``[i] * num_tokens`` (or ``[0] * ...`` with
    ``same_prompt``) unless ``prompt_token_ids`` gives them; EOS is
    ``EOS_TOKEN_ID`` unless ``ignore_eos``. ``block_size`` must equal the
    scheduler's: it sets how the requests hash their blocks.
    ``structured_outputs``: keyword arguments of a StructuredOutputsParams
    every request gets, validated as the input processor does (the requests
    then wait for their grammar). ``lora_ids``: per request, None or the id
    of a LoRA adapter (``lora_request_for``). ``mm_items``: per request, its
    images as ``(offset, length, identifier, is_embed)`` (``mm_features_for``)."""
    block_hasher = get_request_block_hasher(block_size, sha256)
    requests = []
    for i in range(num_requests):
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            structured_outputs=None
            if structured_outputs is None
            else StructuredOutputsParams(**structured_outputs),
        )
        params._validate_structured_outputs()
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        if prompt_token_ids is not None:
            prompt = list(prompt_token_ids[i])
        else:
            prompt = [0 if same_prompt else i] * num_tokens
        requests.append(
            Request(
                request_id=req_ids[i] if req_ids is not None else str(i),
                prompt_token_ids=prompt,
                sampling_params=params,
                arrival_time=arrival_times[i] if arrival_times is not None else float(i),
                priority=priorities[i] if priorities is not None else 0,
                block_hasher=block_hasher,
                lora_request=lora_request_for(lora_ids[i] if lora_ids is not None else None),
                mm_features=mm_features_for(mm_items[i] if mm_items is not None else None),
            )
        )
    return requests


def mm_features_for(items: Sequence | None) -> list[MultiModalFeatureSpec]:
    """Fake image features, no data: ``(offset, length, identifier, is_embed)``
    each (``is_embed``: None, or a list of bools over the placeholders)."""
    features = []
    for offset, length, identifier, is_embed in items or ():
        mask = None if is_embed is None else torch.tensor(is_embed, dtype=torch.bool)
        features.append(
            MultiModalFeatureSpec(None, "image", identifier, PlaceholderRange(offset, length, mask))
        )
    return features


def lora_request_for(lora_id: int | None) -> LoRARequest | None:
    """The stand-in adapter ``lora-<id>`` (its path is never read), or None."""
    if lora_id is None:
        return None
    return LoRARequest(f"lora-{lora_id}", lora_id, f"/nonexistent/lora-{lora_id}")


def make_model_runner_output(
    scheduler, scheduler_output, next_token: Callable[[object], int], output_cls=ModelRunnerOutput
):
    """What a model runner would return, with ``next_token(request)`` as the model.

    A request samples only if, after ``schedule()``, every one of its tokens
    is computed; one still mid-prefill gets ``[]``. Works for upstream's
    scheduler too (pass upstream's ``ModelRunnerOutput`` as ``output_cls``).
    """
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([next_token(request)] if done else [])
    return output_cls(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def create_structured_output_manager(
    tokenizer,
    max_num_seqs: int = 16,
    num_speculative_tokens: int | None = None,
    manager_cls: type | None = None,
) -> StructuredOutputManager:
    """A StructuredOutputManager (or ``manager_cls``) over ``tokenizer``'s
    vocabulary, for a batch of up to ``max_num_seqs`` requests (each with
    that many drafts)."""
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs),
        speculative_config=None
        if num_speculative_tokens is None
        else SpeculativeConfig(num_speculative_tokens=num_speculative_tokens),
    )
    return (manager_cls or StructuredOutputManager)(
        vllm_config, tokenizer=tokenizer, vocab_size=len(tokenizer)
    )


class RecordingGrammar:
    """A compiled grammar's stand-in for the scheduler tests: ``fed`` holds
    the tokens of every ``accept_tokens`` call, ``accepted`` those of the
    calls it accepted; a call holding a token in ``refuse`` is refused, and
    ``validate_tokens`` keeps drafts up to the first refused one (as
    ``update_draft_token_ids`` cuts them). It never terminates."""

    def __init__(self, refuse=()) -> None:
        self.fed: list[list[int]] = []
        self.accepted: list[int] = []
        self.refuse = set(refuse)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        self.fed.append(list(tokens))
        if self.refuse & set(tokens):
            return False
        self.accepted.extend(tokens)
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        valid = []
        for token in tokens:
            if token in self.refuse:
                break
            valid.append(token)
        return valid

    def is_terminated(self) -> bool:
        return False


def create_kv_cache_manager(
    block_size: int = 16,
    num_blocks: int = 10000,
    max_model_len: int = 8192,
    enable_caching: bool = True,
    manager_cls: type | None = None,
    groups: list | None = None,
) -> KVCacheManager:
    """A KV cache manager over ``num_blocks`` blocks (block 0 is the null
    block), as the scheduler builds it (``mini_vllm.oracle.kv_workload``).
    ``groups``: one entry per KV-cache group, ``None`` for full attention or
    a sliding window's size (default: one full-attention group)."""
    kv_cache_config = None
    if groups is not None:
        kv_cache_config = kv_cache_config_of(num_blocks, block_size, groups)
    return (manager_cls or KVCacheManager)(
        num_blocks,
        block_size,
        max_model_len,
        enable_caching=enable_caching,
        kv_cache_config=kv_cache_config,
    )


def kv_cache_config_of(num_blocks: int, block_size: int, groups: list) -> KVCacheConfig:
    """A ``KVCacheConfig`` of one one-layer group per entry of ``groups``
    (``None``: full attention; an int: that sliding window); no tensors."""
    import torch

    specs = []
    for window in groups:
        common = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        if window is None:
            specs.append(FullAttentionSpec(**common))
        else:
            specs.append(SlidingWindowSpec(sliding_window=window, **common))
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)],
    )


def manager_state(manager) -> dict:
    """What a KV-cache trace records after each operation."""
    from mini_vllm.oracle.kv_workload import groups_state, pool_state

    coordinator = manager.coordinator
    managers = [manager] if coordinator is None else coordinator.single_type_managers
    if len(managers) == 1:
        tables, num_cached_block = managers[0].req_to_blocks, managers[0].num_cached_block
    else:
        tables, num_cached_block = groups_state(managers)
    return pool_state(manager.block_pool, tables, num_cached_block, manager.prefix_cache_stats)


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """The n tokens a transformers model picks greedily after ``prompt_ids``:
    a plain loop over its own KV cache, no EOS handling, no padding (so
    nothing can differ from mini_vllm's ``ignore_eos`` runs)."""
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids], device=device), use_cache=True)
        tokens = []
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(
                torch.tensor([[tokens[-1]]], device=device),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    return tokens


def make_tiny_llava(*args, **kwargs):
    """``model_loader.tiny_llava.make_tiny_llava``, imported on first use: it
    pulls in transformers, which every other helper here does without (the
    docs' examples import this module in a fresh process each)."""
    from mini_vllm.model_executor.model_loader.tiny_llava import make_tiny_llava as make

    return make(*args, **kwargs)
