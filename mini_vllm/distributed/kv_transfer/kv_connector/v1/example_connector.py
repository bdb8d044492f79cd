"""A storage connector: KV blocks saved to and loaded from a directory.

Mirrors upstream
``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py`` at
v0.22.1 (``ReqMeta`` :33, ``ExampleConnectorMetadata`` :69,
``ExampleConnector`` :85, ``align_to_block_size`` :455), upstream's example
of the whole connector API. A new request whose prompt has no folder yet is
stored: as its first forward writes each layer's KV into the paged cache,
``save_kv_layer`` copies the prompt's slots (all but the last token, cut to
whole blocks) into ``<shared_storage_path>/<hash of those tokens>/<layer>.safetensors``.
A later request with the same prompt, in this engine or another one
reading the same folder, finds it: ``get_num_new_matched_tokens`` reports
those tokens (loaded synchronously), and ``start_load_kv`` writes them into
its freshly allocated blocks before the forward pass, which then computes
only the rest.

Left out: multimodal hashes in the key and the MLA and Triton layouts (mini
has one layout, ``[num_blocks, 2, block_size, num_kv_heads, head_size]``);
the worker half reads the tensors ``register_kv_caches`` gave it instead of
the forward context's layers (mini's context has no layer table).

Invariants kept: a stored folder holds one file per attention layer; only
whole blocks are saved and loaded; a request loads only when its whole key
prefix is stored (a missing folder is a miss, not an error).

One departure: upstream's ``start_load_kv`` raises on a missing, corrupt or
misshapen stored file, which takes the engine down. Here the request's
loading blocks are reported instead, through ``get_block_ids_with_load_errors``
(base.py:375), upstream's API for it, and the scheduler's invalid-block path
recomputes or fails that request alone, by ``kv_load_failure_policy``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch

from mini_vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from mini_vllm.config import VllmConfig
    from mini_vllm.core.kv_cache_manager import KVCacheBlocks
    from mini_vllm.core.sched.output import SchedulerOutput
    from mini_vllm.kv_cache_interface import KVCacheConfig
    from mini_vllm.request import Request

logger = logging.getLogger(__name__)


def align_to_block_size(num_tokens: int, block_size: int) -> int:
    """The whole blocks below ``num_tokens`` tokens, in tokens (upstream's rule:
    ``(num_tokens - 1) // block_size * block_size``)."""
    return (num_tokens - 1) // block_size * block_size


@dataclass
class ReqMeta:
    # The tokens whose KV is stored or loaded (whole blocks of the prompt).
    token_ids: torch.Tensor
    # Their slots in the paged cache (block id * block_size + offset).
    slot_mapping: torch.Tensor
    is_store: bool

    @staticmethod
    def make_meta(
        token_ids: list[int], block_ids: list[int], block_size: int, is_store: bool
    ) -> ReqMeta:
        num_tokens = align_to_block_size(len(token_ids), block_size)
        blocks = torch.tensor(block_ids, dtype=torch.long)
        slots = (blocks.reshape(-1, 1) * block_size + torch.arange(block_size)).flatten()
        return ReqMeta(
            token_ids=torch.tensor(token_ids)[:num_tokens],
            slot_mapping=slots[:num_tokens],
            is_store=is_store,
        )


@dataclass
class ExampleConnectorMetadata(KVConnectorMetadata):
    requests: list[ReqMeta] = field(default_factory=list)

    def add_request(
        self, token_ids: list[int], block_ids: list[int], block_size: int, is_store: bool
    ) -> None:
        self.requests.append(ReqMeta.make_meta(token_ids, block_ids, block_size, is_store))


class ExampleConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        # Scheduler half: requests given blocks to load into this step.
        self._requests_need_load: dict[str, Request] = {}
        self._storage_path = self._kv_transfer_config.get_from_extra_config(
            "shared_storage_path", "/tmp"
        )
        # Worker half: layer name -> its paged KV tensor.
        self._kv_caches: dict[str, torch.Tensor] = {}
        # Worker half: blocks whose load failed since the last report.
        self._invalid_block_ids: set[int] = set()

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)

    # BEGIN LAB 15.3: write each loading request's stored KV into its slots, before the forward
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Write every loading request's stored KV into its slots, layer by
        layer. A request whose stored files cannot be read (missing, corrupt,
        the wrong shape) has all its loading blocks reported as failed, for
        the scheduler to recompute or fail by ``kv_load_failure_policy``;
        upstream's example raises instead."""
        # HINT: receives forward_context (its attn_metadata None: a step with no forward, load
        # HINT: nothing); leaves the paged caches filled. Storing requests are not loads. A
        # HINT: request whose files cannot be read (any exception from _load_request) loads
        # HINT: nothing: add its blocks (slot // block_size, each once) to
        # HINT: self._invalid_block_ids and go on with the next request.
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ExampleConnectorMetadata)
        if forward_context.attn_metadata is None:
            return
        for request in metadata.requests:
            if request.is_store:
                continue
            logger.info("Loading the KV of %d tokens", len(request.slot_mapping))
            try:
                self._load_request(request)
            except Exception as e:  # any unreadable file: its blocks are invalid
                blocks = (request.slot_mapping // self._block_size).unique().tolist()
                logger.error("KV load failed, %d block(s) invalid: %s", len(blocks), e)
                self._invalid_block_ids.update(blocks)

    # END LAB 15.3

    # BEGIN LAB 15.3: one request's stored KV into every layer, slot by slot
    def _load_request(self, request: ReqMeta) -> None:
        # HINT: receives request (a ReqMeta: token_ids, slot_mapping); leaves every layer's
        # HINT: self._kv_caches tensor holding the stored KV at those slots. A slot is
        # HINT: block * block_size + offset; the cache is [blocks, 2, block_size, heads, dim]
        # HINT: and the file holds [tokens, 2, heads, dim] under the key 'kv_cache'. A file
        # HINT: of any other shape is an error (raise): broadcasting would hide it.
        blocks = request.slot_mapping // self._block_size
        offsets = request.slot_mapping % self._block_size
        for layer_name, kv_cache in self._kv_caches.items():
            filename = self._generate_filename_debug(layer_name, request.token_ids)
            stored = safetensors.torch.load_file(filename, device=str(kv_cache.device))
            # [num_tokens, 2, num_kv_heads, head_size] into [blocks, 2, offsets].
            expected = kv_cache[blocks, :, offsets].shape
            if stored["kv_cache"].shape != expected:
                raise ValueError(
                    f"{filename}: kv_cache has shape {tuple(stored['kv_cache'].shape)}, "
                    f"expected {tuple(expected)}"
                )
            kv_cache[blocks, :, offsets] = stored["kv_cache"].to(kv_cache.dtype)

    # END LAB 15.3

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer already

    # BEGIN LAB 15.3: copy each storing request's slots of this layer into its file
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Copy each storing request's slots of this layer into its file."""
        # HINT: receives layer_name, kv_layer ([blocks, 2, block_size, heads, dim]); leaves one
        # HINT: file per storing request: _generate_filename_debug(layer_name, its token_ids),
        # HINT: {'kv_cache': [tokens, 2, heads, dim]} on the CPU (safetensors.torch.save_file).
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ExampleConnectorMetadata)
        for request in metadata.requests:
            if not request.is_store:
                continue
            blocks = request.slot_mapping // self._block_size
            offsets = request.slot_mapping % self._block_size
            kv = kv_layer[blocks, :, offsets]
            filename = self._generate_filename_debug(layer_name, request.token_ids)
            safetensors.torch.save_file({"kv_cache": kv.detach().cpu().contiguous()}, filename)

    # END LAB 15.3

    def wait_for_save(self) -> None:
        return  # save_kv_layer wrote its files already

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks whose load failed since the last call (then forgets
        them), as upstream's NIXL worker reports a failed transfer."""
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    # --------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The stored whole blocks of the prompt beyond the local hit (all
        or nothing: the key is the prompt's whole-block prefix), loaded
        synchronously."""
        if not self._found_match_for_request(request):
            return 0, False
        logger.info("External cache hit for request %s", request.request_id)
        num_tokens = align_to_block_size(len(request.prompt_token_ids) - 1, self._block_size)
        return num_tokens - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            self._requests_need_load[request.request_id] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Loads for the requests just given blocks; stores for new requests
        whose prompt is not stored yet."""
        meta = ExampleConnectorMetadata()
        num_loads = 0
        for new_req in scheduler_output.scheduled_new_reqs:
            token_ids = new_req.prompt_token_ids
            if new_req.req_id in self._requests_need_load:
                meta.add_request(token_ids, new_req.block_ids[0], self._block_size, False)
                num_loads += 1
            elif not self._found_match_for_prompt(token_ids):
                meta.add_request(token_ids, new_req.block_ids[0], self._block_size, True)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            # A resumed request sends its whole block table again.
            if req_id not in cached.resumed_req_ids or req_id not in self._requests_need_load:
                continue
            num_new_tokens = scheduler_output.num_scheduled_tokens[req_id]
            num_tokens = cached.num_computed_tokens[i] + num_new_tokens
            request = self._requests_need_load[req_id]
            block_ids = cached.new_block_ids[i]
            assert block_ids is not None
            meta.add_request(
                request.all_token_ids[:num_tokens], block_ids[0], self._block_size, False
            )
            num_loads += 1
        assert num_loads == len(self._requests_need_load)
        self._requests_need_load.clear()
        return meta

    # ---------------------------------------------------------------- helpers

    def _found_match_for_request(self, request: Request) -> bool:
        return self._found_match_for_prompt(list(request.prompt_token_ids))

    def _found_match_for_prompt(self, prompt_token_ids: list[int]) -> bool:
        num_tokens = align_to_block_size(len(prompt_token_ids) - 1, self._block_size)
        folder = self._generate_foldername_debug(torch.tensor(prompt_token_ids)[:num_tokens])
        return os.path.exists(folder)

    # BEGIN LAB 15.3: the stored prefix's folder: a hash of its token ids' bytes
    def _generate_foldername_debug(
        self, token_ids: torch.Tensor, create_folder: bool = False
    ) -> str:
        """``<shared_storage_path>/<md5 of the token ids' bytes>`` (upstream's
        ``safe_hash``, md5 where the platform allows it)."""
        # HINT: receives token_ids (an int64 tensor); returns <storage path>/<md5 hex digest of
        # HINT: the tensor's bytes> (numpy().tobytes()), made when create_folder is set.
        token_bytes = token_ids.numpy().tobytes()
        digest = hashlib.md5(token_bytes, usedforsecurity=False).hexdigest()
        folder = os.path.join(self._storage_path, digest)
        if create_folder:
            os.makedirs(folder, exist_ok=True)
        return folder

    # END LAB 15.3

    def _generate_filename_debug(self, layer_name: str, token_ids: torch.Tensor) -> str:
        folder = self._generate_foldername_debug(token_ids, create_folder=True)
        return os.path.join(folder, f"{layer_name}.safetensors")
