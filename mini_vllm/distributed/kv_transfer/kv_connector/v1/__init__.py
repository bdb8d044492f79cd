"""The v1 connector API (upstream ``kv_connector/v1/__init__.py``)."""

from mini_vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole"]
