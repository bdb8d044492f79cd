"""The storage connector (ExampleConnector, Phase 15) through the engine.

Upstream's example connector (vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py:85)
saves a new prompt's KV, layer by layer, into a folder keyed by the hash of
its tokens, and a later request with that prompt loads it instead of
computing it. Here, on a tiny seeded Llama: an engine with the connector
stores the prompt; a second engine (a restart: a fresh process's state, the
same folder) schedules only the tokens past the stored blocks and still
produces the greedy tokens of an engine without any connector; and when
the stored KV is replaced by zeros, the second engine's tokens change, so
the loaded KV is what its forward pass attended to.
"""

from __future__ import annotations

import os

import pytest
import safetensors.torch
import torch

from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
from mini_vllm.sampling_params import SamplingParams

BLOCK_SIZE = 8
# 37 tokens: the connector stores and loads the first 32 (4 whole blocks).
PROMPT = [(5 * j + 3) % 509 + 3 for j in range(37)]
STORED_TOKENS = 32
N = 6


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_llama_connector"), arch="llama"))


def run(path: str, storage: str | None) -> tuple[list[int], dict]:
    kv_transfer_config = None
    if storage is not None:
        kv_transfer_config = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": storage},
        }
    llm = LLM(
        path,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        block_size=BLOCK_SIZE,
        max_num_seqs=4,
        attention_backend="torch",
        kv_transfer_config=kv_transfer_config,
    )
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    return list(out.outputs[0].token_ids), llm.llm_engine.get_stats()


def test_a_second_engine_loads_the_stored_prefill(tiny_llama, tmp_path):
    storage = str(tmp_path / "kv")
    fresh, fresh_stats = run(tiny_llama, None)

    first, first_stats = run(tiny_llama, storage)
    assert first == fresh
    assert first_stats["num_scheduled_tokens"] == fresh_stats["num_scheduled_tokens"]
    (folder,) = os.listdir(storage)  # one prompt, one key
    files = sorted(os.listdir(os.path.join(storage, folder)))
    assert files == [f"model.layers.{i}.self_attn.attn.safetensors" for i in range(3)], files

    second, second_stats = run(tiny_llama, storage)
    assert second == fresh
    assert (
        second_stats["num_scheduled_tokens"] == fresh_stats["num_scheduled_tokens"] - STORED_TOKENS
    ), (fresh_stats, second_stats)

    # Zeros in place of the stored KV: the second engine still skips those
    # tokens, and its tokens now differ, so it really attended to what it loaded.
    for name in files:
        path = os.path.join(storage, folder, name)
        kv = safetensors.torch.load_file(path)["kv_cache"]
        safetensors.torch.save_file({"kv_cache": torch.zeros_like(kv)}, path)
    zeroed, zeroed_stats = run(tiny_llama, storage)
    assert zeroed_stats["num_scheduled_tokens"] == second_stats["num_scheduled_tokens"]
    assert zeroed != fresh


def test_example_connector_is_registered_by_name():
    from mini_vllm.config import KVTransferConfig
    from mini_vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from mini_vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
        ExampleConnector,
    )

    config = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(config) is ExampleConnector


# ---------------------------------------------------------------- load failures
#
# Upstream's example connector raises on a stored file it cannot read, which
# takes the engine down. mini's reports the request's loading blocks through
# get_block_ids_with_load_errors (vllm/distributed/kv_transfer/kv_connector/v1/base.py:375),
# and the scheduler's invalid-block path (vllm/v1/core/sched/scheduler.py:2268)
# recomputes the request or fails it alone, by kv_load_failure_policy.

OTHER = [(7 * j + 11) % 509 + 3 for j in range(21)]  # a second prompt, never damaged


def damage(storage: str, how: str) -> None:
    """Spoil the one stored prompt's layer-1 file (its folder stays, so the
    connector still reports a hit and tries the load)."""
    (folder,) = os.listdir(storage)
    path = os.path.join(storage, folder, "model.layers.1.self_attn.attn.safetensors")
    if how == "deleted":
        os.remove(path)
    elif how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    else:  # one token's KV where 32 are stored: it would broadcast silently
        kv = safetensors.torch.load_file(path)["kv_cache"]
        safetensors.torch.save_file({"kv_cache": kv[:1].contiguous()}, path)


def make_llm(path: str, storage: str, policy: str) -> LLM:
    return LLM(
        path,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        block_size=BLOCK_SIZE,
        max_num_seqs=4,
        attention_backend="torch",
        kv_transfer_config={
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": storage},
            "kv_load_failure_policy": policy,
        },
    )


def num_free_blocks(llm: LLM) -> int:
    return llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


@pytest.fixture(scope="module")
def fresh_tokens(tiny_llama):
    """Each prompt's greedy tokens from an engine without a connector."""
    llm = LLM(
        tiny_llama,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        block_size=BLOCK_SIZE,
        max_num_seqs=4,
        attention_backend="torch",
    )
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": OTHER}], params, use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("how", ["deleted", "truncated", "wrong_shape"])
def test_a_failed_load_is_recomputed(tiny_llama, tmp_path, fresh_tokens, how):
    storage = str(tmp_path / "kv")
    first, _ = run(tiny_llama, storage)
    assert first == fresh_tokens[0]
    damage(storage, how)

    llm = make_llm(tiny_llama, storage, "recompute")
    free_at_start = num_free_blocks(llm)
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"
    assert list(out.outputs[0].token_ids) == fresh_tokens[0], f"{how}: recomputed tokens differ"
    # The load was tried and thrown away: the stored 32 tokens were scheduled
    # on top of the load's 5 + 5 decode steps, not skipped.
    stats = llm.llm_engine.get_stats()
    assert stats["num_scheduled_tokens"] > len(PROMPT) - STORED_TOKENS + N - 1, stats
    assert num_free_blocks(llm) == free_at_start, f"{how}: blocks leaked"


@pytest.mark.parametrize("how", ["deleted", "truncated", "wrong_shape"])
def test_a_failed_load_fails_its_request_alone(tiny_llama, tmp_path, fresh_tokens, how):
    storage = str(tmp_path / "kv")
    run(tiny_llama, storage)
    damage(storage, how)

    llm = make_llm(tiny_llama, storage, "fail")
    free_at_start = num_free_blocks(llm)
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    bad, other = llm.generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": OTHER}], params, use_tqdm=False
    )
    assert bad.outputs[0].finish_reason == "error", f"{how}: {bad.outputs[0]}"
    assert list(bad.outputs[0].token_ids) == []
    assert other.outputs[0].finish_reason == "length"
    assert list(other.outputs[0].token_ids) == fresh_tokens[1]
    assert num_free_blocks(llm) == free_at_start, f"{how}: blocks leaked"

    # The engine keeps serving: the same prompt fails again, alone.
    again, other_again = llm.generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": OTHER}], params, use_tqdm=False
    )
    assert again.outputs[0].finish_reason == "error"
    assert list(other_again.outputs[0].token_ids) == fresh_tokens[1]
    assert num_free_blocks(llm) == free_at_start, f"{how}: blocks leaked"
