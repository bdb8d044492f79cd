"""The fake KV connector (mini_vllm/oracle/fake_connector.py) on upstream's
``KVConnectorBase_V1`` (vllm/distributed/kv_transfer/kv_connector/v1/base.py:171),
for upstream's Scheduler to load through ``kv_connector_module_path``.
Importing this module imports vllm."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

from mini_vllm.oracle.fake_connector import FakeConnectorLogic, FakeConnectorMetadataFields


class FakeConnectorMetadata(FakeConnectorMetadataFields, KVConnectorMetadata):
    pass


class FakeKVConnector(FakeConnectorLogic, KVConnectorBase_V1):
    metadata_cls = FakeConnectorMetadata

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        self._init_fake(vllm_config.kv_transfer_config.kv_connector_extra_config)
