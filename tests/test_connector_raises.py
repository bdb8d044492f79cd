"""A KV connector that raises in a worker-side call fails or recomputes its request alone.

Upstream's engine dies when a connector's ``start_load_kv`` raises. mini_vllm's
runner reports the blocks the step's new requests start from as failed loads
(``invalid_block_ids``), and the scheduler's invalid-block path
(vllm/v1/core/sched/scheduler.py:2268) does the rest, by
``kv_load_failure_policy``: "recompute" gives the tokens of an engine without
a connector, "fail" ends that request with finish_reason "error" while a
request in the same batch finishes; either way the engine serves the next
request and no block stays allocated. The connector is ExampleConnector
(storage) loaded through ``kv_connector_module_path``, raising whenever it
has a stored prefix to load.
"""

from __future__ import annotations

import pytest

from mini_vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
from mini_vllm.sampling_params import SamplingParams

# The module fixtures (tiny model, reference tokens): keep the module on one xdist worker.
pytestmark = pytest.mark.xdist_group("connector-raises")

BLOCK_SIZE = 8
PROMPT = [(5 * j + 3) % 509 + 3 for j in range(37)]
OTHER = [(7 * j + 1) % 499 + 3 for j in range(21)]
N = 6


class RaisingConnector(ExampleConnector):
    """ExampleConnector whose start_load_kv raises when it has something to load."""

    def start_load_kv(self, forward_context, **kwargs) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ExampleConnectorMetadata)
        if any(not r.is_store for r in metadata.requests):
            raise OSError("the storage went away")
        super().start_load_kv(forward_context, **kwargs)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_llama_raises"), arch="llama"))


def make_llm(path: str, storage: str | None, name: str = "ExampleConnector", policy="fail"):
    kv_transfer_config = None
    if storage is not None:
        kv_transfer_config = {
            "kv_connector": name,
            "kv_role": "kv_both",
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"shared_storage_path": storage},
        }
        if name == "RaisingConnector":
            kv_transfer_config["kv_connector_module_path"] = __name__
    return LLM(
        path,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        block_size=BLOCK_SIZE,
        max_num_seqs=4,
        attention_backend="torch",
        kv_transfer_config=kv_transfer_config,
    )


PARAMS = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


def tokens(out) -> list[int]:
    return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def fresh(tiny_llama):
    llm = make_llm(tiny_llama, None)
    outs = llm.generate([{"prompt_token_ids": p} for p in (PROMPT, OTHER)], PARAMS)
    return [tokens(o) for o in outs]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_raising_start_load_kv_fails_or_recomputes_its_request_alone(
    tiny_llama, fresh, tmp_path, policy
):
    storage = str(tmp_path / "kv")
    make_llm(tiny_llama, storage).generate([{"prompt_token_ids": PROMPT}], PARAMS)  # stores it

    llm = make_llm(tiny_llama, storage, "RaisingConnector", policy)
    pool = llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool
    total = pool.get_num_free_blocks()
    loaded, other = llm.generate([{"prompt_token_ids": p} for p in (PROMPT, OTHER)], PARAMS)
    assert tokens(other) == fresh[1] and other.outputs[0].finish_reason == "length"
    if policy == "recompute":
        assert tokens(loaded) == fresh[0]
    else:
        assert loaded.outputs[0].finish_reason == "error" and not tokens(loaded)
    assert pool.get_num_free_blocks() == total
    # The engine goes on serving.
    (again,) = llm.generate([{"prompt_token_ids": OTHER}], PARAMS)
    assert tokens(again) == fresh[1]
