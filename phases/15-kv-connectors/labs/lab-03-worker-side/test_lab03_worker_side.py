"""Lab 15.3 — the worker side of the storage connector, layer by layer.

Graded: the ``LAB 15.3`` regions of ``labs/phase_15/example_connector.py``:
``_generate_foldername_debug`` (a stored prefix's folder, keyed by a hash of
its token ids), ``save_kv_layer`` (each storing request's slots of one layer
into ``<folder>/<layer>.safetensors``), ``start_load_kv`` and
``_load_request`` (each loading request's stored KV back into its slots of
every layer, before the forward pass; a file it cannot read reports the
request's blocks through ``get_block_ids_with_load_errors``).

Against the pinned upstream's ExampleConnector
(vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py:85),
driven on CPU tensors: mini_vllm's paged layout ``[blocks, 2, block_size,
heads, dim]`` is upstream's Triton layout, so upstream's connector runs its
Triton branch (:150, :244) on the same caches, given a
``TritonAttentionMetadata``. Your folders must be upstream's, your files
must hold upstream's tensors, and your loads must fill the caches exactly
as upstream's loads of the same files do. Then a round trip through the
engine on a tiny seeded Llama: a second engine (fresh) loads what a first
one saved, computes only the rest, and samples the greedy tokens of an
engine without any connector.
"""

from __future__ import annotations

import os
import sys

import pytest
import safetensors.torch
import torch
from hypothesis import given
from hypothesis import strategies as st

from mini_vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
from mini_vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from mini_vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnectorMetadata,
)
from mini_vllm.grading.checks import lab_settings, written

BLOCK = 4
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
CACHE_SHAPE = (16, 2, BLOCK, 3, 8)  # [blocks, 2 (K, V), block_size, kv heads, head dim]
# (prompt, block ids, is_store): two prompts to save, one to load (not stored).
REQUESTS = [
    ([(7 * j + 3) % 97 for j in range(14)], [3, 9, 1, 12], True),
    ([(5 * j + 1) % 89 for j in range(9)], [5, 6, 2], True),
    ([(3 * j + 2) % 83 for j in range(11)], [4, 8, 11], False),
]


class Context:
    """A forward context: mini's worker reads only ``attn_metadata``."""

    def __init__(self, attn_metadata=True) -> None:
        self.attn_metadata = attn_metadata


def yours(impl, storage) -> object:
    config = VllmConfig(
        model_config=ModelConfig(max_model_len=64),
        cache_config=CacheConfig(block_size=BLOCK, num_gpu_blocks=CACHE_SHAPE[0]),
        kv_transfer_config=KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": str(storage)},
        ),
    )
    return impl.example_connector.ExampleConnector(config, KVConnectorRole.WORKER)


def upstreams(storage):
    """Upstream's ExampleConnector, its worker half, without a VllmConfig: the
    fields its worker methods read."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_connector as up

    connector = object.__new__(up.ExampleConnector)
    connector._block_size = BLOCK
    connector._storage_path = str(storage)
    connector._connector_metadata = None
    return connector, up


def triton_metadata():
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata

    return object.__new__(TritonAttentionMetadata)


def metadata_pair(up, requests):
    mine, theirs = ExampleConnectorMetadata(), up.ExampleConnectorMetadata()
    for tokens, blocks, is_store in requests:
        mine.add_request(tokens, blocks, BLOCK, is_store)
        theirs.add_request(tokens, blocks, BLOCK, is_store, [])
    return mine, theirs


def stored_files(root) -> dict[str, torch.Tensor]:
    out = {}
    for folder in sorted(os.listdir(root)):
        for name in sorted(os.listdir(os.path.join(root, folder))):
            path = os.path.join(root, folder, name)
            out[f"{folder}/{name}"] = safetensors.torch.load_file(path)["kv_cache"]
    return out


def caches(seed: int | None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed or 0)
    return {
        name: torch.randn(CACHE_SHAPE, generator=gen) if seed else torch.zeros(CACHE_SHAPE)
        for name in LAYERS
    }


# ------------------------------------------------------------------ the key


@pytest.mark.points(3)
def test_the_folder_is_upstreams_hash_of_the_tokens(impl, tmp_path):
    mine = yours(impl, tmp_path)
    theirs, _ = upstreams(tmp_path)

    @lab_settings(40)
    @given(tokens=st.lists(st.integers(0, 49151), min_size=1, max_size=64))
    def run(tokens):
        ids = torch.tensor(tokens)
        got = written(mine._generate_foldername_debug, ids)
        want = theirs._generate_foldername_debug(ids, [])
        assert got == want, (
            f"the folder of tokens {tokens[:8]}... ({len(tokens)} tokens): yours {got!r}, "
            f"upstream's {want!r}. The key is <shared_storage_path>/<md5 hex digest of the int64 "
            "tensor's bytes> (numpy().tobytes()): another hash, another dtype or the token list's "
            "repr gives another folder, and a stored prefix is never found again."
        )

    run()
    folder = written(mine._generate_foldername_debug, torch.tensor([1, 2, 3]))
    assert not os.path.exists(folder), "without create_folder the folder must not be made"
    written(mine._generate_foldername_debug, torch.tensor([1, 2, 3]), create_folder=True)
    assert os.path.isdir(folder), "with create_folder=True the folder is made"


# ------------------------------------------------------------------ save


@pytest.mark.points(6)
def test_save_kv_layer_writes_upstreams_files(impl, tmp_path):
    theirs, up = upstreams(tmp_path / "upstream")
    mine = yours(impl, tmp_path / "yours")
    meta_mine, meta_theirs = metadata_pair(up, REQUESTS)
    mine.bind_connector_metadata(meta_mine)
    theirs._connector_metadata = meta_theirs
    kv = caches(seed=1)
    for name in LAYERS:
        written(mine.save_kv_layer, name, kv[name], object())
        theirs.save_kv_layer(name, kv[name], triton_metadata())
    want = stored_files(tmp_path / "upstream")
    got = stored_files(tmp_path / "yours") if (tmp_path / "yours").exists() else {}
    assert sorted(got) == sorted(want), (
        f"the files saved: yours {sorted(got)}, upstream's {sorted(want)}. One folder per "
        "STORING request (the load request saves nothing), one <layer name>.safetensors per "
        "layer, the folder named by _generate_foldername_debug of the request's token_ids (the "
        "whole blocks of the prompt but the last token: ReqMeta cut them already)."
    )
    for key, tensor in want.items():
        mine_tensor = got[key]
        assert mine_tensor.shape == tensor.shape and mine_tensor.dtype == tensor.dtype, (
            f"{key}: yours holds {tuple(mine_tensor.shape)} {mine_tensor.dtype}, upstream's "
            f"{tuple(tensor.shape)} {tensor.dtype}: one row per token, [tokens, 2, heads, dim] "
            "(kv_layer[slot // block_size, :, slot % block_size])."
        )
        assert torch.equal(mine_tensor, tensor), (
            f"{key}: same shape, other values than upstream's: each token's K and V come from "
            "its slot (block id * block_size + offset) of THIS layer's cache, in token order."
        )


# ------------------------------------------------------------------ load


def saved_by_upstream(tmp_path, up, source):
    """The three prompts saved by upstream's connector from ``source``."""
    theirs, _ = upstreams(tmp_path)
    _, meta = metadata_pair(up, [(t, b, True) for t, b, _ in REQUESTS])
    theirs._connector_metadata = meta
    for name in LAYERS:
        theirs.save_kv_layer(name, source[name], triton_metadata())


class Layer:
    def __init__(self, kv_cache) -> None:
        self.kv_cache = kv_cache


@pytest.mark.points(6)
def test_start_load_kv_fills_the_slots_upstream_fills(impl, tmp_path):
    theirs, up = upstreams(tmp_path)
    saved_by_upstream(tmp_path, up, caches(seed=2))
    # Load the first and third prompts into other blocks; the second is a store.
    loads = [
        (REQUESTS[0][0], [7, 13, 2, 10], False),
        (REQUESTS[1][0], [1, 4, 6], True),
        (REQUESTS[2][0], [15, 3, 5], False),
    ]
    meta_mine, meta_theirs = metadata_pair(up, loads)
    mine = yours(impl, tmp_path)
    my_caches, their_caches = caches(None), caches(None)
    mine.register_kv_caches(my_caches)
    mine.bind_connector_metadata(meta_mine)
    written(mine.start_load_kv, Context())
    theirs._connector_metadata = meta_theirs
    context = Context({name: triton_metadata() for name in LAYERS})
    context.no_compile_layers = {name: Layer(their_caches[name]) for name in LAYERS}
    theirs.start_load_kv(context)
    assert any(bool(c.any()) for c in their_caches.values())
    for name in LAYERS:
        if not torch.equal(my_caches[name], their_caches[name]):
            differ = (my_caches[name] != their_caches[name]).any(dim=(1, 3, 4)).nonzero().tolist()
            pytest.fail(
                f"{name}: after start_load_kv your cache differs from upstream's at (block, "
                f"offset) {differ[:6]}. Each LOADING request's file goes back into its slots "
                "(cache[slot // block_size, :, slot % block_size] = the stored rows) in every "
                "layer; a storing request loads nothing.",
                pytrace=False,
            )
    assert not written(mine.get_block_ids_with_load_errors), "no load failed"
    empty = caches(None)
    mine = yours(impl, tmp_path)
    mine.register_kv_caches(empty)
    mine.bind_connector_metadata(meta_mine)
    written(mine.start_load_kv, Context(attn_metadata=None))
    assert not any(bool(c.any()) for c in empty.values()), (
        "a step with no attention metadata (nothing to run) loads nothing, as upstream's "
        "start_load_kv returns at once"
    )


@pytest.mark.points(4)
@pytest.mark.parametrize("damage", ["deleted", "wrong shape"])
def test_a_file_it_cannot_read_reports_the_requests_blocks(impl, tmp_path, damage):
    _, up = upstreams(tmp_path)
    saved_by_upstream(tmp_path, up, caches(seed=3))
    mine = yours(impl, tmp_path)
    folder = written(mine._generate_foldername_debug, torch.tensor(REQUESTS[0][0][:12]))
    path = os.path.join(folder, f"{LAYERS[1]}.safetensors")
    if damage == "deleted":
        os.remove(path)
    else:  # one token's KV where 12 are stored: it would broadcast silently
        kv = safetensors.torch.load_file(path)["kv_cache"]
        safetensors.torch.save_file({"kv_cache": kv[:1].contiguous()}, path)
    loads = [(REQUESTS[0][0], [7, 13, 2, 10], False), (REQUESTS[2][0], [15, 3, 5], False)]
    meta, _ = metadata_pair(up, loads)
    my_caches = caches(None)
    mine.register_kv_caches(my_caches)
    mine.bind_connector_metadata(meta)
    try:
        written(mine.start_load_kv, Context())
    except Exception as e:
        pytest.fail(
            f"start_load_kv raised {type(e).__name__}: {e}. mini_vllm's connector does not take "
            "the engine down on a file it cannot read (upstream's does): the request's blocks "
            "go to self._invalid_block_ids, for the scheduler to recompute or fail it alone.",
            pytrace=False,
        )
    invalid = written(mine.get_block_ids_with_load_errors)
    assert invalid == {7, 13, 2}, (
        f"the first request's layer-1 file is {damage}: all the blocks it was loading (the "
        f"12 stored tokens: blocks 7, 13, 2) are reported, each once; got {invalid}."
    )
    assert bool(my_caches[LAYERS[0]][15].any()), (
        "the second request's files are fine: it must still load (one bad request does not "
        "stop the others)"
    )


# ------------------------------------------------------------------ a round trip


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from mini_vllm.model_executor.model_loader.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_llama_lab153"), arch="llama"))


PROMPT = [(5 * j + 3) % 509 + 3 for j in range(37)]  # 37 tokens: 32 stored (4 blocks of 8)


def engine_run(path, module: str | None, storage) -> tuple[list[int], int]:
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.sampling_params import SamplingParams

    config = None
    if module is not None:
        config = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": module,
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        }
    llm = LLM(
        path,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        block_size=8,
        max_num_seqs=4,
        attention_backend="torch",
        kv_transfer_config=config,
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (out,) = written(llm.generate, [{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    return list(out.outputs[0].token_ids), llm.llm_engine.get_stats()["num_scheduled_tokens"]


@pytest.mark.points(5)
def test_a_fresh_engine_loads_what_another_saved(impl, tiny_llama, tmp_path, monkeypatch):
    module = "lab_15_3_your_example_connector"
    monkeypatch.setitem(sys.modules, module, impl.example_connector)
    plain, plain_tokens = engine_run(tiny_llama, None, None)
    first, first_tokens = engine_run(tiny_llama, module, tmp_path)
    assert first == plain, (
        f"the first engine (it saves) sampled {first}, an engine without a connector {plain}: "
        "saving must not change what the forward pass computes"
    )
    assert len(os.listdir(tmp_path)) == 1, f"one prompt, one stored folder: {os.listdir(tmp_path)}"
    second, second_tokens = engine_run(tiny_llama, module, tmp_path)
    assert second_tokens == plain_tokens - 32, (
        f"a fresh engine finds the 32 stored tokens (4 whole blocks) and schedules only the "
        f"rest: {second_tokens} tokens scheduled, want {plain_tokens - 32}."
    )
    assert second == plain, (
        f"the second engine loaded the stored KV and sampled {second}; without a connector "
        f"{plain}. The loaded KV must be exactly what the first engine computed, in the same "
        "slots its forward pass reads (start_load_kv / _load_request)."
    )
