"""Build a KV connector by registered name or by module path.

Mirrors upstream ``vllm/distributed/kv_transfer/kv_connector/factory.py`` at
v0.22.1 (``register_connector`` :31, ``create_connector`` :43,
``get_connector_class`` :96): a module path, when given, wins over the
registry; registered connectors are imported only when asked for. Left
out: the hybrid-model (HMA) check and the old two-argument constructor
check; mini_vllm's registry holds its own connectors only (ExampleConnector,
the storage connector; ZmqConnector, the network one).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from mini_vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from mini_vllm.config import KVTransferConfig, VllmConfig
    from mini_vllm.kv_cache_interface import KVCacheConfig


class KVConnectorFactory:
    _registry: dict[str, Callable[[], type[KVConnectorBase_V1]]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``class_name`` of ``module_path`` under ``name``, imported lazily."""
        if name in cls._registry:
            raise ValueError(f"Connector {name!r} is already registered.")

        def loader() -> type[KVConnectorBase_V1]:
            return getattr(importlib.import_module(module_path), class_name)

        cls._registry[name] = loader

    @classmethod
    def create_connector(
        cls,
        config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> KVConnectorBase_V1:
        if config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set to create a connector.")
        connector_cls = cls.get_connector_class(config.kv_transfer_config)
        return connector_cls(config, role, kv_cache_config)

    @classmethod
    def get_connector_class(cls, kv_transfer_config: KVTransferConfig) -> type[KVConnectorBase_V1]:
        name = kv_transfer_config.kv_connector
        if name is None:
            raise ValueError("kv_transfer_config.kv_connector is not set.")
        module_path = kv_transfer_config.kv_connector_module_path
        if module_path is not None and not module_path:
            raise ValueError("kv_connector_module_path cannot be an empty string.")
        if module_path:
            module = importlib.import_module(module_path)
            try:
                return getattr(module, name)
            except AttributeError as e:
                raise AttributeError(f"Class {name} not found in {module_path}") from e
        if name in cls._registry:
            return cls._registry[name]()
        raise ValueError(f"Unsupported connector type: {name!r}")


# mini_vllm's connectors, imported only when asked for (factory.py:135 on).
KVConnectorFactory.register_connector(
    "ExampleConnector",
    "mini_vllm.distributed.kv_transfer.kv_connector.v1.example_connector",
    "ExampleConnector",
)
KVConnectorFactory.register_connector(
    "ZmqConnector",
    "mini_vllm.distributed.kv_transfer.kv_connector.v1.zmq_connector",
    "ZmqConnector",
)
