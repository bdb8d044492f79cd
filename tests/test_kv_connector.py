"""The KV-connector API, its config and its factory (Phase 15).

The scheduler's use of a connector is proven against upstream in
tests/upstream/test_connector_lockstep.py; here: KVTransferConfig refuses
bad input in one line naming the field, as upstream's checks do
(vllm/config/kv_transfer.py:93-108); the factory finds a connector by
registered name or by module path, a module path winning
(vllm/distributed/kv_transfer/kv_connector/factory.py:96-132); the base
class leaves the scheduler and worker halves abstract; a scheduler builds
its connector with the SCHEDULER role and refuses one over a hybrid
KV-cache config.
"""

from __future__ import annotations

import pytest

import mini_vllm.testing as mini
from mini_vllm.config import KVTransferConfig, VllmConfig
from mini_vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from mini_vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from mini_vllm.oracle.fake_connector import FakeKVConnector

FAKE = {
    "kv_connector": "FakeKVConnector",
    "kv_role": "kv_both",
    "kv_connector_module_path": "mini_vllm.oracle.fake_connector",
    "kv_connector_extra_config": {"block_size": 16},
}


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"kv_connector": "X"}, "kv_role must be set"),
        ({"kv_connector": "X", "kv_role": "both"}, "kv_role must be one of"),
        (
            {"kv_connector": "X", "kv_role": "kv_both", "kv_load_failure_policy": "retry"},
            "kv_load_failure_policy",
        ),
    ],
)
def test_kv_transfer_config_refuses_bad_fields(fields, words):
    with pytest.raises(ValueError, match=words):
        KVTransferConfig(**fields)


def test_kv_transfer_config_from_dict_names_unknown_keys():
    with pytest.raises(ValueError, match=r"unsupported keys \['kv_port'\]"):
        KVTransferConfig.from_dict({"kv_connector": "X", "kv_role": "kv_both", "kv_port": 1})
    with pytest.raises(ValueError, match="must be a dict"):
        KVTransferConfig.from_dict(["kv_both"])
    config = KVTransferConfig.from_dict({"kv_connector": "X", "kv_role": "kv_consumer"})
    assert config.is_kv_consumer and not config.is_kv_producer
    assert config.kv_load_failure_policy == "fail"  # upstream's default


def test_factory_loads_by_module_path_and_by_registered_name():
    config = VllmConfig(kv_transfer_config=KVTransferConfig(**FAKE))
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER)
    assert type(connector) is FakeKVConnector
    assert connector.role is KVConnectorRole.WORKER

    name = "MiniVllmTestFakeConnector"
    KVConnectorFactory.register_connector(
        name, "mini_vllm.oracle.fake_connector", "FakeKVConnector"
    )
    try:
        with pytest.raises(ValueError, match="already registered"):
            KVConnectorFactory.register_connector(name, "x", "y")
        by_name = KVTransferConfig(
            kv_connector=name, kv_role="kv_both", kv_connector_extra_config={"block_size": 16}
        )
        assert KVConnectorFactory.get_connector_class(by_name) is FakeKVConnector
    finally:
        del KVConnectorFactory._registry[name]


def test_factory_errors_name_the_problem():
    with pytest.raises(ValueError, match="Unsupported connector type: 'NoSuchConnector'"):
        KVConnectorFactory.get_connector_class(
            KVTransferConfig(kv_connector="NoSuchConnector", kv_role="kv_both")
        )
    with pytest.raises(AttributeError, match="Class Nope not found in mini_vllm.oracle"):
        KVConnectorFactory.get_connector_class(
            KVTransferConfig(
                kv_connector="Nope", kv_role="kv_both", kv_connector_module_path="mini_vllm.oracle"
            )
        )
    with pytest.raises(ValueError, match="cannot be an empty string"):
        KVConnectorFactory.get_connector_class(
            KVTransferConfig(kv_connector="X", kv_role="kv_both", kv_connector_module_path="")
        )


def test_base_class_leaves_both_halves_abstract():
    assert KVConnectorBase_V1.__abstractmethods__ == {
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "start_load_kv",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_save",
    }


def test_scheduler_builds_its_connector_with_the_scheduler_role():
    sched = mini.create_scheduler(kv_transfer_config=FAKE)
    assert type(sched.get_kv_connector()) is FakeKVConnector
    assert sched.connector.role is KVConnectorRole.SCHEDULER
    assert mini.create_scheduler().get_kv_connector() is None
    with pytest.raises(ValueError, match="one full-attention KV-cache group"):
        mini.create_scheduler(kv_transfer_config=FAKE, kv_groups=[None, 8])


def test_scheduler_with_a_transfer_config_but_no_connector_names_the_field():
    # Upstream builds a connector whenever kv_transfer_config is set, and its
    # factory refuses a config without kv_connector (factory.py:100-101).
    with pytest.raises(ValueError, match="kv_connector is not set"):
        mini.create_scheduler(kv_transfer_config={"kv_role": "kv_both"})
