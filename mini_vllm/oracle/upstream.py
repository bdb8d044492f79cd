"""The pinned upstream Scheduler, built on a CPU, with mini_vllm.testing's keywords.

Needs ``make upstream`` (vllm 0.22.1 installed with --no-deps beside the CPU
torch). Importing this module imports vllm (about 5 s). How it works,
following the facts in the project's design notes:
- a ``ModelConfig`` needs a model folder: we write a ``config.json`` naming a
  stand-in architecture registered with ``ModelRegistry``, so vllm never
  imports a real model class or reaches a hub;
- ``DeviceConfig(device="cpu")`` avoids GPU platform detection without
  turning on vLLM's CPU platform (which would change block size, prefix
  caching and chunked prefill);
- the KV cache is one full-attention group of ``num_blocks`` blocks;
- the resolved configuration is checked against what was asked, so a
  silent rewrite by vllm fails loudly instead of skewing a comparison.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

import torch  # noqa: E402
import vllm  # noqa: E402
from torch import nn  # noqa: E402
from vllm import ModelRegistry  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.core.encoder_cache_manager import (  # noqa: E402
    EncoderCacheManager,
    compute_mm_encoder_budget,
)
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar  # noqa: E402

EOS_TOKEN_ID = 50256
VERSION = vllm.__version__
COMMIT = "0decac0d96c42b49572498019f0a0e3600f50398"
_ARCH = "MiniVllmSchedulerStandIn"

__all__ = [
    "EOS_TOKEN_ID",
    "RequestStatus",
    "ModelRunnerOutput",
    "KVConnectorOutput",
    "DraftTokenIds",
    "create_scheduler",
    "create_requests",
    "create_kv_cache_manager",
    "create_structured_output_manager",
    "manager_state",
    "VERSION",
    "COMMIT",
]


class _StandInModel(nn.Module):
    """Satisfies vllm's 'is a text-generation model' check; never runs."""

    def __init__(self, *, vllm_config=None, prefix: str = "") -> None:
        super().__init__()

    def embed_input_ids(self, input_ids):
        return input_ids

    def forward(self, input_ids, positions, **kwargs):
        return input_ids

    def compute_logits(self, hidden_states):
        return hidden_states


ModelRegistry.register_model(_ARCH, _StandInModel)
_model_dir = tempfile.mkdtemp(prefix="mini_vllm_upstream_model_")
with open(os.path.join(_model_dir, "config.json"), "w") as f:
    json.dump(
        {
            "architectures": [_ARCH],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
            "num_hidden_layers": 1,
            "vocab_size": 65536,
            "max_position_embeddings": 1 << 20,
        },
        f,
    )

# Chain block hashes from sha256("0"), as mini_vllm does (upstream reads the
# seed from PYTHONHASHSEED and is random without it).
_old_seed = os.environ.get("PYTHONHASHSEED")
os.environ["PYTHONHASHSEED"] = "0"
kv_cache_utils.init_none_hash(sha256)
if _old_seed is None:
    del os.environ["PYTHONHASHSEED"]
else:
    os.environ["PYTHONHASHSEED"] = _old_seed


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
    """Upstream's Scheduler, or its AsyncScheduler with ``async_scheduling``
    (the class upstream's engine picks for that setting). ``kv_groups``: one
    KV-cache group per entry (``None`` full attention, an int a sliding
    window), driven by upstream's hybrid coordinator as on a GPU; default one
    full-attention group. ``max_loras``: LoRA on, with that many adapters a step.
    ``kv_transfer_config``: KVTransferConfig's fields (the connector's buffer
    on the CPU), for a scheduler with a KV connector. ``mm_max_tokens_per_item``:
    the scheduler of a multimodal (image) model whose items have at most that
    many embeddings, with the encoder budgets given (None: upstream's,
    max_num_batched_tokens). The stand-in model is text-only, so the budgets
    are set after the scheduler is built, from upstream's own
    compute_mm_encoder_budget, as its MultiModalBudget would
    (vllm/multimodal/encoder_budget.py:117) and as upstream's scheduler tests
    do (tests/v1/core/test_scheduler.py:3638)."""
    if max_model_len is None:
        max_model_len = max_num_batched_tokens
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        long_prefill_token_threshold=long_prefill_token_threshold,
        enable_chunked_prefill=enable_chunked_prefill,
        policy=policy,
        scheduler_reserve_full_isl=scheduler_reserve_full_isl,
        async_scheduling=async_scheduling,
        disable_chunked_mm_input=disable_chunked_mm_input,
    )
    if max_num_encoder_input_tokens is not None:
        scheduler_config.max_num_encoder_input_tokens = max_num_encoder_input_tokens
    if encoder_cache_size is not None:
        scheduler_config.encoder_cache_size = encoder_cache_size
    model_config = ModelConfig(
        model=_model_dir,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="float32",
        seed=0,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    # As upstream's test helper (tests/v1/core/utils.py) builds it: n-gram
    # drafts. Upstream refuses the n-gram drafter with async scheduling; it
    # accepts a drafter run in the worker (EAGLE, MTP, draft models,
    # "ngram_gpu"): the scheduler then holds placeholder drafts. ngram_gpu
    # reserves no lookahead slots (EAGLE would), which mini_vllm has none of.
    speculative_method = "ngram_gpu" if async_scheduling else "ngram"
    speculative_config = None
    if num_speculative_tokens is not None:
        speculative_config = SpeculativeConfig(
            method=speculative_method, num_speculative_tokens=num_speculative_tokens
        )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        device_config=DeviceConfig(device="cpu"),
        speculative_config=speculative_config,
        lora_config=None if max_loras is None else LoRAConfig(max_loras=max_loras),
        kv_transfer_config=None
        if kv_transfer_config is None
        else KVTransferConfig(kv_buffer_device="cpu", **kv_transfer_config),
    )
    asked = {
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "long_prefill_token_threshold": long_prefill_token_threshold,
        "enable_chunked_prefill": enable_chunked_prefill,
        "policy": policy,
        "scheduler_reserve_full_isl": scheduler_reserve_full_isl,
        "async_scheduling": async_scheduling,
    }
    got = {k: getattr(vllm_config.scheduler_config, k) for k in asked}
    got_cache = (
        vllm_config.cache_config.block_size,
        vllm_config.cache_config.enable_prefix_caching,
    )
    if (
        got != asked
        or got_cache != (block_size, enable_prefix_caching)
        or vllm_config.model_config.max_model_len != max_model_len
        or (
            speculative_config is not None
            and vllm_config.speculative_config.method != speculative_method
        )
    ):
        raise RuntimeError(f"vllm rewrote the configuration: asked {asked}, got {got}, {got_cache}")
    kv_cache_config = _kv_cache_config(num_blocks, block_size, kv_groups)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    if kv_groups is not None:
        # On a CPU, VllmConfig disables the hybrid manager (the platform says
        # it has no support, vllm/config/vllm.py:1415); a GPU keeps it on.
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    scheduler = (AsyncScheduler if async_scheduling else Scheduler)(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=True,
    )
    if mm_max_tokens_per_item is not None:
        budget, cache_size = compute_mm_encoder_budget(
            vllm_config.scheduler_config, {"image": mm_max_tokens_per_item}
        )
        scheduler.max_num_encoder_input_tokens = budget
        scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=cache_size)
    return scheduler


def _kv_cache_config(num_blocks: int, block_size: int, groups: list | None = None) -> KVCacheConfig:
    """KV-cache groups of ``num_blocks`` blocks; no tensors. Default: one
    full-attention group; else one one-layer group per entry of ``groups``
    (``None``: full attention; an int: that sliding window)."""
    if groups is None:
        return KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer"],
                    FullAttentionSpec(
                        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
                    ),
                )
            ],
        )
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


def create_kv_cache_manager(
    block_size: int = 16,
    num_blocks: int = 10000,
    max_model_len: int = 8192,
    enable_caching: bool = True,
    groups: list | None = None,
) -> KVCacheManager:
    """Upstream's KVCacheManager with the arguments its Scheduler passes (no
    eagle, events or context parallelism), and prefix-cache stats on;
    ``groups`` as ``_kv_cache_config`` takes them."""
    return KVCacheManager(
        kv_cache_config=_kv_cache_config(num_blocks, block_size, groups),
        max_model_len=max_model_len,
        hash_block_size=block_size,
        enable_caching=enable_caching,
        log_stats=True,
    )


def manager_state(manager: KVCacheManager) -> dict:
    """What a KV-cache trace records after each operation. The block tables
    live in the coordinator's single-type managers, one per group."""
    from mini_vllm.oracle.kv_workload import groups_state, pool_state

    managers = manager.coordinator.single_type_managers
    if len(managers) == 1:
        tables, num_cached_block = managers[0].req_to_blocks, managers[0].num_cached_block
    else:
        tables, num_cached_block = groups_state(managers)
    return pool_state(manager.block_pool, tables, num_cached_block, manager.prefix_cache_stats)


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
    """``lora_ids``: per request, None or an adapter id (``lora_request_for``).
    ``structured_outputs``: keyword arguments of a StructuredOutputsParams
    every request gets, validated as upstream's input processor does with the
    xgrammar backend (the request then waits for its grammar). ``mm_items``:
    per request, its images as ``(offset, length, identifier, is_embed)``
    (``mm_features_for``)."""
    block_hasher = kv_cache_utils.get_request_block_hasher(block_size, sha256)
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
        if structured_outputs is not None:
            validate_xgrammar_grammar(params)
            params.structured_outputs._backend = "xgrammar"
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
                pooling_params=None,
                arrival_time=arrival_times[i] if arrival_times is not None else float(i),
                priority=priorities[i] if priorities is not None else 0,
                block_hasher=block_hasher,
                lora_request=lora_request_for(lora_ids[i] if lora_ids is not None else None),
                mm_features=mm_features_for(mm_items[i] if mm_items is not None else None),
            )
        )
    return requests


def mm_features_for(items: Sequence | None) -> list[MultiModalFeatureSpec] | None:
    """Upstream's fake image features, no data: ``(offset, length,
    identifier, is_embed)`` each; None for none, as upstream's helper passes."""
    features = []
    for offset, length, identifier, is_embed in items or ():
        mask = None if is_embed is None else torch.tensor(is_embed, dtype=torch.bool)
        features.append(
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=identifier,
                mm_position=PlaceholderRange(offset=offset, length=length, is_embed=mask),
            )
        )
    return features or None


def lora_request_for(lora_id: int | None) -> LoRARequest | None:
    """Upstream's LoRARequest for the stand-in adapter ``lora-<id>``, or None."""
    if lora_id is None:
        return None
    return LoRARequest(f"lora-{lora_id}", lora_id, f"/nonexistent/lora-{lora_id}")


def create_structured_output_manager(
    tokenizer, max_num_seqs: int = 16, num_speculative_tokens: int | None = None
) -> StructuredOutputManager:
    """Upstream's StructuredOutputManager over ``tokenizer`` (a Hugging Face
    tokenizer, saved to a folder that upstream loads it back from, with a
    config.json giving the tokenizer's vocabulary size as the model's)."""
    folder = tempfile.mkdtemp(prefix="mini_vllm_upstream_tokenizer_")
    tokenizer.save_pretrained(folder)
    with open(os.path.join(_model_dir, "config.json")) as f:
        config = json.load(f)
    config["vocab_size"] = len(tokenizer)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    max_model_len = 1024
    speculative_config = None
    if num_speculative_tokens is not None:
        speculative_config = SpeculativeConfig(
            method="ngram", num_speculative_tokens=num_speculative_tokens
        )
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=folder, tokenizer=folder, max_model_len=max_model_len, dtype="float32", seed=0
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_model_len,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig(device="cpu"),
        speculative_config=speculative_config,
    )
    return StructuredOutputManager(vllm_config)
