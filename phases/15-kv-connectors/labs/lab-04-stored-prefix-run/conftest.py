"""Lab 15.4's fixtures.

- ``smollm2``: SmolLM2-135M loaded once (float32), the greedy tokens of an
  engine without any connector on the lab's prompts (phase15_run_helpers.py)
  and its stats, and the prompts' token ids;
- ``stored_runs``: two engines built from your whole Phase 15 (your
  Scheduler through ``scheduler_cls``, your ExampleConnector through
  ``kv_connector_module_path``; every region yours, as the ``phase`` marker
  gives it), sharing the weights and one storage folder: the first saves the
  prompts' KV, the second (fresh) loads it.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from phase15_run_helpers import BLOCK_SIZE, MAX_TOKENS, MODULE, PROMPTS

from mini_vllm.grading.checks import engine_greedy_tokens


@pytest.fixture(scope="module")
def llm():
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    return LLM(
        str(smollm2_gguf_path()),
        max_model_len=256,
        max_num_seqs=4,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=64,
        device="cuda" if torch.cuda.is_available() else "cpu",
        dtype="float32",
    )


@pytest.fixture(scope="module")
def smollm2(llm):
    """(the LLM, (the connector-less engine's greedy tokens, its stats), the
    prompts' token ids)."""
    plain = engine_greedy_tokens(llm.llm_engine, PROMPTS, MAX_TOKENS)
    prompt_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    return llm, (plain, llm.llm_engine.get_stats()), prompt_ids


def connector_engine(llm, impl, storage):
    """A fresh engine on ``llm``'s weights, with your Scheduler and your
    ExampleConnector over ``storage``."""
    from mini_vllm.config import KVTransferConfig
    from mini_vllm.engine.llm_engine import LLMEngine

    base = llm.llm_engine
    config = dataclasses.replace(
        base.vllm_config,
        scheduler_config=dataclasses.replace(
            base.vllm_config.scheduler_config, scheduler_cls=impl.scheduler.Scheduler
        ),
        cache_config=dataclasses.replace(base.vllm_config.cache_config),
        kv_transfer_config=KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_module_path=MODULE,
            kv_connector_extra_config={"shared_storage_path": str(storage)},
        ),
    )
    return LLMEngine(config, (base.model, base.hf_config, base.tokenizer))


@pytest.fixture(scope="module")
def impl15(tmp_path_factory):
    """Your Phase 15 modules (every region yours), registered as MODULE for
    ``kv_connector_module_path``. Before SmolLM2 is loaded, each of your
    pieces is called once on a tiny case, so a region still unwritten fails
    here at once rather than a minute later, inside the engine."""
    from mini_vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from mini_vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from mini_vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
        ExampleConnectorMetadata,
    )
    from mini_vllm.grading import impl as impl_mod
    from mini_vllm.grading.checks import written
    from mini_vllm.testing import create_requests, create_scheduler

    impl = impl_mod.load("15")
    storage = str(tmp_path_factory.mktemp("lab154_smoke"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setitem(sys.modules, MODULE, impl.example_connector)
        transfer = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": MODULE,
            "kv_connector_extra_config": {"shared_storage_path": storage},
        }
        sched = create_scheduler(
            scheduler_cls=impl.scheduler.Scheduler, block_size=4, num_blocks=16,
            max_num_batched_tokens=64, kv_transfer_config=transfer,
        )  # fmt: skip
        (req,) = create_requests(1, num_tokens=9, block_size=4)
        sched.add_request(req)
        written(sched.schedule)
        config = VllmConfig(
            model_config=ModelConfig(max_model_len=64),
            cache_config=CacheConfig(block_size=4, num_gpu_blocks=16),
            kv_transfer_config=KVTransferConfig(**transfer),
        )
        worker = impl.example_connector.ExampleConnector(config, KVConnectorRole.WORKER)
        worker.bind_connector_metadata(ExampleConnectorMetadata())
        written(worker.start_load_kv, type("Context", (), {"attn_metadata": None})())
        written(worker.save_kv_layer, "layer", torch.zeros(16, 2, 4, 1, 1), None)
        written(worker._generate_foldername_debug, torch.tensor([1, 2]))
    return impl


@pytest.fixture(scope="module")
def stored_runs(impl15, llm, tmp_path_factory):
    """{"first": (tokens, stats), "second": (tokens, stats), "storage": folder}."""
    impl = impl15
    storage = tmp_path_factory.mktemp("lab154_kv")
    runs = {"storage": storage}
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setitem(sys.modules, MODULE, impl.example_connector)
        for name in ("first", "second"):
            engine = connector_engine(llm, impl, storage)
            assert type(engine.engine_core.scheduler) is impl.scheduler.Scheduler, (
                "the engine must run your Scheduler"
            )
            tokens = engine_greedy_tokens(engine, PROMPTS, MAX_TOKENS)
            runs[name] = (tokens, engine.get_stats())
    return runs


@pytest.fixture(scope="module")
def transformers_tokens(smollm2):
    """transformers' greedy tokens on the prompts' token ids, float32, from the
    folder mini_vllm's GGUF cache keeps (or from the GGUF when the cache is off)."""
    from transformers import AutoModelForCausalLM

    from mini_vllm.model_executor.model_loader import gguf_cache, smollm2_gguf_path
    from mini_vllm.testing import hf_greedy

    _, _, prompt_ids = smollm2
    path = smollm2_gguf_path()
    root = gguf_cache.cache_dir()
    entry = None if root is None else gguf_cache.entry_dir(root, path)
    if entry is not None and gguf_cache.entry_problem(entry, gguf_cache.source_of(path)) is None:
        model = AutoModelForCausalLM.from_pretrained(str(entry), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    model.eval()
    return [hf_greedy(model, ids, MAX_TOKENS) for ids in prompt_ids]
