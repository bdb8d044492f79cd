"""The KV-connector API: one class, two halves, two processes.

Mirrors upstream ``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` at
v0.22.1 (``KVConnectorRole`` :124, ``KVConnectorMetadata`` :141,
``KVConnectorBase_V1`` :171; worker side from :211, scheduler side from
:454). A connector is built twice: with role SCHEDULER inside the
scheduler, with role WORKER inside the model runner. The scheduler half
decides (how many tokens an external store holds, which blocks to load
into or save from) and packs its decisions into a ``KVConnectorMetadata``
each step; the worker half receives that object before the forward pass
and moves the bytes, layer by layer.

Scheduler side, in the order a request meets them:
``get_num_new_matched_tokens`` (tokens the store has beyond the local
prefix hit, and whether they load asynchronously), ``update_state_after_alloc``
(the blocks the scheduler gave them), ``build_connector_meta`` (once per
step), ``update_connector_output`` (what the workers reported), and
``request_finished`` (True: the connector still reads the blocks, free them
only when the workers report the save done).

Worker side, in the order a forward pass calls them: ``bind_connector_metadata``,
``start_load_kv``, per layer ``wait_for_layer_load`` then ``save_kv_layer``,
``wait_for_save``, ``get_finished`` and ``get_block_ids_with_load_errors``,
``clear_connector_metadata``.

Left out: hybrid-model support (``SupportsHMA``), handshake and worker
metadata, cross-layer blocks, stats, events, metrics and cache reset;
mini_vllm's connectors run with one full-attention KV-cache group.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mini_vllm.config import VllmConfig
    from mini_vllm.core.kv_cache_manager import KVCacheBlocks
    from mini_vllm.core.sched.output import SchedulerOutput
    from mini_vllm.kv_cache_interface import KVCacheConfig
    from mini_vllm.outputs import KVConnectorOutput
    from mini_vllm.request import Request


class KVConnectorRole(enum.Enum):
    # The half that lives in the scheduler's process.
    SCHEDULER = 0
    # The half that lives in each worker's process, beside the KV cache.
    WORKER = 1


class KVConnectorMetadata(ABC):  # noqa: B024
    """What the scheduler half tells the worker half for one step (each
    connector subclasses it with its own fields)."""


class KVConnectorBase_V1(ABC):  # noqa: N801 (upstream's name)
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set to build a KV connector.")
        self._connector_metadata: KVConnectorMetadata | None = None
        self._vllm_config = vllm_config
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # ------------------------------------------------------------ worker side

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The runner hands over this step's metadata before the forward pass."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """The runner drops the step's metadata after the forward pass."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None, "no connector metadata bound this step"
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The paged KV tensors, one per layer name, once at start-up."""
        return

    @abstractmethod
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Begin loading the KV this step's metadata asks for into the paged
        cache, before the forward pass."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV is loaded (attention calls it)."""

    @abstractmethod
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Begin saving ``layer_name``'s KV out of the paged cache, after
        attention wrote this step's keys and values into it."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until every save of this step is done, as the forward pass
        ends, so no block is overwritten while it is read."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous transfers ended since the last call:
        (finished sending / saving, finished receiving / loading).
        ``finished_req_ids``: the requests the scheduler finished this step."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks that failed to load (reported in the step that found them,
        at the latest with the request's id in ``get_finished``)."""
        return set()

    def shutdown(self) -> None:
        return

    # --------------------------------------------------------- scheduler side

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens the external store holds beyond the ``num_computed_tokens``
        the local prefix cache hit, and whether they load asynchronously
        (between steps; then the request waits in WAITING_FOR_REMOTE_KVS).
        ``None``: not known yet, ask again next step. Must be (0, False)
        when there is nothing to load."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """The request's blocks after allocation; ``num_external_tokens`` of
        them are to be filled from the store. Called again for an
        asynchronously loaded request when it is scheduled after the load."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads and saves for the workers; resets the
        connector's per-step state. Must not change ``scheduler_output``."""

    def on_new_request(self, request: Request) -> None:
        """A request was added to the scheduler."""
        return

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """What the workers reported this step."""
        return

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request finishes, before its blocks are freed.
        True: the connector still reads them (an asynchronous save); the
        scheduler frees them when the workers report the request in
        ``finished_sending``. The dict: transfer parameters for the output."""
        return False, None
