"""The GGUF load cache: a miss builds an entry, a hit reads it without opening
the GGUF, and a stale or corrupt entry is rebuilt, never used."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_models import tiny_gguf_tensors, write_gguf

from mini_vllm.model_executor.model_loader import gguf_cache, gguf_loader, load_model
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model


@pytest.fixture
def gguf_file(tmp_path):
    folder = make_tiny_model(tmp_path / "tiny-llama", "llama", seed=0)
    config, tensors = tiny_gguf_tensors(folder, "llama")
    return write_gguf(tmp_path / "tiny.gguf", "llama", config, tensors), config, tensors


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("MINI_VLLM_CACHE_DIR", str(root))
    return root


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def uncached(path, monkeypatch) -> dict[str, torch.Tensor]:
    with monkeypatch.context() as m:
        m.setenv("MINI_VLLM_CACHE_DIR", "off")
        return params(load_model(path).model)


def builds(monkeypatch) -> list:
    calls = []
    build = gguf_cache.build_entry
    monkeypatch.setattr(gguf_cache, "build_entry", lambda *a: calls.append(a[0].name) or build(*a))
    return calls


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0, msg=k)


def test_miss_builds_then_hit_reads_without_the_gguf(gguf_file, cache, monkeypatch):
    path, _, _ = gguf_file
    expected = uncached(path, monkeypatch)
    calls = builds(monkeypatch)
    assert_same(params(load_model(path).model), expected)
    assert len(calls) == 1
    entry = gguf_cache.entry_dir(cache, path)
    assert (entry / "manifest.json").is_file() and (entry / "model.safetensors").is_file()
    # A hit: the GGUF is not even opened.
    monkeypatch.setattr(gguf_loader, "open_gguf", lambda p: pytest.fail("opened the GGUF"))
    assert_same(params(load_model(path).model), expected)
    assert len(calls) == 1


def test_stale_entry_is_rebuilt(gguf_file, cache, monkeypatch, tmp_path):
    path, config, tensors = gguf_file
    load_model(path)
    # Same path, same size, new contents and modification time.
    write_gguf(path, "llama", config, {k: 2 * v for k, v in tensors.items()})
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    entry = gguf_cache.entry_dir(cache, path)
    assert gguf_cache.entry_problem(entry, gguf_cache.source_of(path)) == "stale"
    calls = builds(monkeypatch)
    assert_same(params(load_model(path).model), uncached(path, monkeypatch))
    assert len(calls) == 1


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "no manifest", "bad manifest"])
def test_corrupt_entry_is_rebuilt(gguf_file, cache, monkeypatch, damage):
    path, _, _ = gguf_file
    expected = params(load_model(path).model)
    entry = gguf_cache.entry_dir(cache, path)
    weights = entry / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "flip a byte":
        data[-5] ^= 0x40  # inside the last tensor: still a valid safetensors file
        weights.write_bytes(data)
    elif damage == "truncate":
        weights.write_bytes(data[:-100])
    elif damage == "no manifest":
        (entry / "manifest.json").unlink()
    else:
        (entry / "manifest.json").write_text("{")
    problem = gguf_cache.entry_problem(entry, gguf_cache.source_of(path))
    assert problem is not None
    calls = builds(monkeypatch)
    assert_same(params(load_model(path).model), expected)
    assert len(calls) == 1, problem
    assert gguf_cache.entry_problem(entry, gguf_cache.source_of(path)) is None


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("MINI_VLLM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert gguf_cache.cache_dir() == tmp_path / "mini_vllm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert gguf_cache.cache_dir() == gguf_cache.Path.home() / ".cache" / "mini_vllm"
    monkeypatch.setenv("MINI_VLLM_CACHE_DIR", "off")
    assert gguf_cache.cache_dir() is None


def test_smollm2_tokenizer_from_the_cache_equals_the_gguf_one(cache, monkeypatch):
    from hf_reference import PROMPTS

    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    path = smollm2_gguf_path()
    load_model(path, load_tokenizer=False)  # builds the entry, tokenizer included
    manifest = json.loads((gguf_cache.entry_dir(cache, path) / "manifest.json").read_text())
    assert any(name.startswith("tokenizer/") for name in manifest["files"])
    _, _, cached = load_model(path)
    with monkeypatch.context() as m:
        m.setenv("MINI_VLLM_CACHE_DIR", "off")
        _, _, direct = load_model(path)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    for tok in (cached, direct):
        tok.encoded = [tok.encode(p) for p in PROMPTS] + [
            tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ]
    assert cached.encoded == direct.encoded
    assert (cached.eos_token_id, cached.bos_token_id) == (direct.eos_token_id, direct.bos_token_id)
    assert cached.decode(cached.encoded[2]) == direct.decode(direct.encoded[2])
