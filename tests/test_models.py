"""mini_vllm's Llama and Qwen3 against transformers, through a paged KV cache.

For a tiny seeded Llama (tied embeddings), a tiny seeded Qwen3 (untied,
explicit head_dim) and the real SmolLM2-135M (GGUF, Q4_1 dequantized):

- prefill one prompt through the flat-batch model with a freshly allocated
  paged KV cache (block size 16, blocks handed out in shuffled order, the
  ``AttentionMetadata`` built by hand, ``TorchAttentionImpl``) and compare
  the logits at every position with transformers' float32 forward;
- decode 5 more tokens one at a time through the same cache and check the
  greedy tokens equal transformers' greedy ``generate`` (and each decode
  step's logits equal transformers' logits at that position);
- one flat batch mixing a decode, a prefill chunk after cached context, and
  a fresh prefill gives the same logits as running each alone.

The largest logit error of each comparison is printed in the closing
"mini_vllm counters" section. Then: GGUF round trips of the tiny models
(q/k permuted the way llama.cpp does it), RoPE styles, and the loader's
errors.
"""

from __future__ import annotations

import copy
import random
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from mini_vllm.attention.backend import AttentionMetadata, get_kv_cache_shape
from mini_vllm.attention.backends.cpu_attn import CPUAttentionBackendImpl
from mini_vllm.attention.backends.torch_attn import TorchAttentionImpl
from mini_vllm.forward_context import set_forward_context
from mini_vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope
from mini_vllm.model_executor.model_loader import find_checkpoint, load_model, smollm2_gguf_path
from mini_vllm.model_executor.model_loader.gguf_loader import (
    GGUF_TO_HF_BLOCK,
    GGUF_TO_HF_GLOBAL,
    unpermute_qk,
)
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
from mini_vllm.model_executor.models import resolve_model_cls

BLOCK_SIZE = 16
NUM_DECODE = 5
# Largest |ours - transformers| over all logits, relative to the largest |logit|.
REL_TOL = 1e-4


# --------------------------------------------------------------------------
# A hand-rolled paged KV cache for a few requests.
# --------------------------------------------------------------------------


class PagedKV:
    """One KV cache tensor per attention layer, and a shuffled free list of block ids."""

    def __init__(self, model, num_blocks: int = 32, seed: int = 0, impl=TorchAttentionImpl) -> None:
        for layer in model.attention_layers():
            shape = get_kv_cache_shape(num_blocks, BLOCK_SIZE, layer.num_kv_heads, layer.head_size)
            layer.bind(impl, torch.zeros(shape))
        self.free = list(range(1, num_blocks))  # block 0 is the null block
        random.Random(seed).shuffle(self.free)


class Seq:
    """One request: its block table and how many of its tokens are in the cache."""

    def __init__(self, kv: PagedKV) -> None:
        self.kv = kv
        self.blocks: list[int] = []
        self.num_computed = 0

    def schedule(self, num_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and KV slots of the next ``num_new`` tokens (allocating blocks as needed)."""
        end = self.num_computed + num_new
        while len(self.blocks) * BLOCK_SIZE < end:
            self.blocks.append(self.kv.free.pop())
        positions = torch.arange(self.num_computed, end)
        slots = torch.tensor(
            [
                self.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                for p in positions.tolist()
            ],
            dtype=torch.int64,
        )
        self.num_computed = end
        return positions, slots


def run_step(model, batch: list[tuple[Seq, list[int]]]) -> list[torch.Tensor]:
    """One flat forward over the new tokens of each (request, tokens); logits per request."""
    ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
    for seq, tokens in batch:
        pos, slot = seq.schedule(len(tokens))
        ids += tokens
        positions.append(pos)
        slots.append(slot)
        qsl.append(qsl[-1] + len(tokens))
        seq_lens.append(seq.num_computed)
    width = max(len(seq.blocks) for seq, _ in batch)
    table = torch.zeros(len(batch), width, dtype=torch.int32)
    for i, (seq, _) in enumerate(batch):
        table[i, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=len(ids),
        max_query_len=max(len(t) for _, t in batch),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_seq_len=max(seq_lens),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.cat(slots),
    )
    with torch.no_grad(), set_forward_context(metadata):
        hidden = model(torch.tensor(ids, dtype=torch.int64), torch.cat(positions))
        logits = model.compute_logits(hidden)
    return list(logits.split([len(t) for _, t in batch]))


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0]


def hf_greedy(hf_model, prompt: list[int], num_tokens: int) -> list[int]:
    config = copy.deepcopy(hf_model.generation_config)
    config.do_sample, config.max_new_tokens, config.eos_token_id = False, num_tokens, None
    config.temperature = config.top_p = config.top_k = None
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            generation_config=config,
        )
    generated = out[0, len(prompt) :].tolist()
    assert len(generated) == num_tokens, "transformers stopped early"
    return generated


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    err = (ours.float() - ref.float()).abs().max().item()
    scale = ref.abs().max().item()
    return err / scale, err


# --------------------------------------------------------------------------
# The three models under test.
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        arch: make_tiny_model(root / f"tiny-{arch}", arch, seed=0) for arch in ("llama", "qwen3")
    }


def _tiny_case(tiny_dirs, arch):
    model, hf_config, tokenizer = load_model(tiny_dirs[arch])
    assert tokenizer is None
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dirs[arch]), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    # 28 tokens: the prefill spans two blocks, the decode steps reach a third.
    prompts = [torch.randint(3, hf_config.vocab_size, (28,), generator=g).tolist()]
    return model, hf, prompts


@pytest.fixture(scope="module")
def smollm2(counts, request):
    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    start = time.perf_counter()
    model, hf_config, tokenizer = load_model(path)
    counts["models: SmolLM2 load_model seconds (weights + tokenizer)"] = (
        f"{time.perf_counter() - start:.1f}"
    )
    _, hf = request.getfixturevalue("smollm2_hf")
    return model, hf_config, tokenizer, hf


def _smollm2_case(smollm2):
    model, _, tokenizer, hf = smollm2
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompts = [tokenizer("The capital of France is")["input_ids"], tokenizer(chat)["input_ids"]]
    return model, hf, prompts


CASES = ["tiny-llama", "tiny-qwen3", pytest.param("smollm2", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=CASES)
def case(request):
    name = request.param
    if name == "smollm2":
        return name, *_smollm2_case(request.getfixturevalue("smollm2"))
    return name, *_tiny_case(request.getfixturevalue("tiny_dirs"), name.removeprefix("tiny-"))


# --------------------------------------------------------------------------
# Parity with transformers.
# --------------------------------------------------------------------------


def test_prefill_then_decode_match_transformers(case, counts):
    name, model, hf, prompts = case
    worst_prefill = worst_decode = (0.0, 0.0)
    for prompt in prompts:
        kv = PagedKV(model)
        seq = Seq(kv)
        (prefill,) = run_step(model, [(seq, prompt)])
        ref = hf_logits(hf, prompt)
        assert prefill.shape == ref.shape == (len(prompt), model.config.vocab_size)
        worst_prefill = max(worst_prefill, rel_err(prefill, ref))

        tokens = [int(prefill[-1].argmax())]
        decode_logits = []
        for _ in range(NUM_DECODE):
            (step,) = run_step(model, [(seq, tokens[-1:])])
            decode_logits.append(step[0])
            tokens.append(int(step[0].argmax()))
        assert seq.num_computed == len(prompt) + NUM_DECODE
        assert tokens == hf_greedy(hf, prompt, NUM_DECODE + 1), name

        ref_all = hf_logits(hf, prompt + tokens[:-1])[len(prompt) :]
        worst_decode = max(worst_decode, rel_err(torch.stack(decode_logits), ref_all))

    for what, (rel, err) in (("prefill", worst_prefill), ("decode", worst_decode)):
        counts[f"models: {name} {what} max |logit err| (relative)"] = f"{err:.2e} ({rel:.1e})"
        assert rel < REL_TOL, (
            f"{name} {what}: max |logit err| {err:.3g} is {rel:.2g} of the logit scale"
        )


@pytest.mark.slow
def test_smollm2_says_paris(smollm2):
    model, hf_config, tokenizer, hf = smollm2
    assert hf_config.architectures == ["LlamaForCausalLM"]
    prompt = tokenizer("The capital of France is")["input_ids"]
    (logits,) = run_step(model, [(Seq(PagedKV(model)), prompt)])
    assert tokenizer.decode([int(logits[-1].argmax())]) == " Paris"


@pytest.mark.slow
def test_smollm2_gguf_config_matches_transformers(smollm2):
    _, ours, _, hf = smollm2
    theirs = hf.config
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"] == 1e5


@pytest.mark.parametrize(
    "impl", [TorchAttentionImpl, CPUAttentionBackendImpl], ids=["torch", "cpu"]
)
def test_mixed_flat_batch_equals_requests_alone(tiny_dirs, impl):
    """A decode, a prefill chunk on top of cached context and a fresh prefill, in one batch
    (each backend against the torch backend's requests alone)."""
    model, _, _ = load_model(tiny_dirs["qwen3"])
    g = torch.Generator().manual_seed(2)
    a, b, c = (torch.randint(3, 512, (n,), generator=g).tolist() for n in (20, 30, 9))

    def alone(prompt):
        return run_step(model, [(Seq(PagedKV(model)), prompt)])[0]

    kv = PagedKV(model, num_blocks=16, seed=3, impl=impl)
    seq_a, seq_b, seq_c = Seq(kv), Seq(kv), Seq(kv)
    run_step(model, [(seq_a, a[:-1]), (seq_b, b[:12])])  # a: all but its last token; b: a chunk
    out_a, out_b, out_c = run_step(model, [(seq_a, a[-1:]), (seq_b, b[12:]), (seq_c, c)])
    torch.testing.assert_close(out_a, alone(a)[-1:], rtol=0, atol=1e-4)
    torch.testing.assert_close(out_b, alone(b)[12:], rtol=0, atol=1e-4)
    torch.testing.assert_close(out_c, alone(c), rtol=0, atol=1e-4)


def test_load_in_bfloat16(tiny_dirs):
    model, _, _ = load_model(tiny_dirs["llama"], dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    (logits,) = run_step(model, [(Seq(PagedKV(model)), list(range(3, 23)))])
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_attention_layers_in_order(tiny_dirs):
    model, hf_config, _ = load_model(tiny_dirs["qwen3"])
    layers = model.attention_layers()
    assert [a.layer_name for a in layers] == [
        f"model.layers.{i}.self_attn.attn" for i in range(hf_config.num_hidden_layers)
    ]
    assert {(a.num_heads, a.num_kv_heads, a.head_size) for a in layers} == {(4, 2, 32)}


# --------------------------------------------------------------------------
# GGUF: round trips of the tiny models, written the way llama.cpp writes them.
# --------------------------------------------------------------------------

HF_TO_GGUF_GLOBAL = {v: k for k, v in GGUF_TO_HF_GLOBAL.items()}
HF_TO_GGUF_BLOCK = {v: k for k, v in GGUF_TO_HF_BLOCK.items()}


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's converter does to Llama q/k rows (the inverse of unpermute_qk)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def hf_to_gguf_name(name: str) -> str:
    base, _, kind = name.rpartition(".")
    if base in HF_TO_GGUF_GLOBAL:
        return f"{HF_TO_GGUF_GLOBAL[base]}.{kind}"
    _, _, index, module = base.split(".", 3)
    return f"blk.{index}.{HF_TO_GGUF_BLOCK[module]}.{kind}"


def write_gguf(
    path: Path, arch: str, config, tensors: dict[str, torch.Tensor], types: dict | None = None
) -> Path:
    """A GGUF of ``tensors``: float32, or quantized to ``types[name]`` by ``gguf.quants``,
    or given as (uint8 bytes, GGML type)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
            continue
        array = tensor.detach().float().numpy()
        qtype = (types or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_gguf_tensors(folder: Path, arch: str) -> tuple[object, dict[str, torch.Tensor]]:
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    config = hf.config
    tensors = {}
    for name, w in hf.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, config.num_attention_heads)
        if arch == "llama" and name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, config.num_key_value_heads)
        tensors[hf_to_gguf_name(name)] = w
    return config, tensors


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_round_trip_equals_safetensors(tiny_dirs, tmp_path, arch):
    config, tensors = tiny_gguf_tensors(tiny_dirs[arch], arch)
    folder = tmp_path / "gguf"
    folder.mkdir()
    write_gguf(folder / f"tiny-{arch}.gguf", arch, config, tensors)

    from_gguf, gguf_config, tokenizer = load_model(folder)  # a folder with exactly one .gguf
    assert tokenizer is None  # this GGUF embeds none
    from_st, _, _ = load_model(tiny_dirs[arch])
    for key in (
        "architectures",
        "vocab_size",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "tie_word_embeddings",
        "rope_parameters",
    ):
        assert getattr(gguf_config, key) == getattr(config, key), key
    prompt = list(range(3, 40))
    (a,) = run_step(from_gguf, [(Seq(PagedKV(from_gguf)), prompt)])
    (b,) = run_step(from_st, [(Seq(PagedKV(from_st)), prompt)])
    assert torch.equal(a, b)


def test_unpermute_inverts_llama_cpp():
    w = torch.arange(6 * 8 * 5, dtype=torch.float32).reshape(6 * 8, 5)
    assert torch.equal(unpermute_qk(llama_cpp_permute(w, 6), 6), w)
    assert not torch.equal(llama_cpp_permute(w, 6), w)


def test_gptj_rope_on_permuted_heads_is_neox_rope():
    """Why upstream can run permuted GGUF weights with GPT-J RoPE: it is the same rotation."""
    heads, head_size = 3, 16
    neox = RotaryEmbedding(head_size, 64, 1e4, is_neox_style=True)
    gptj = RotaryEmbedding(head_size, 64, 1e4, is_neox_style=False)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, heads * head_size, generator=g)
    k = torch.randn(5, head_size, generator=g)
    positions = torch.tensor([0, 3, 7, 1, 63])
    # The rotation is in place (as upstream's kernel): each call gets its own copies.
    q_neox, k_neox = neox(positions, q.clone(), k.clone())
    q_gptj, k_gptj = gptj(
        positions, llama_cpp_permute(q.T, heads).T.clone(), llama_cpp_permute(k.T, 1).T.clone()
    )
    torch.testing.assert_close(unpermute_qk(q_gptj.T, heads).T, q_neox)
    torch.testing.assert_close(unpermute_qk(k_gptj.T, 1).T, k_neox)


def test_rope_rejects_scaling():
    with pytest.raises(ValueError, match="'llama3' is not supported"):
        get_rope(64, 128, {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0})


# --------------------------------------------------------------------------
# Loader errors.
# --------------------------------------------------------------------------


def test_error_unknown_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or folder") as e:
        load_model(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(e.value)


def test_error_folder_without_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        load_model(tmp_path)


def test_error_not_a_model_file(tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("x")
    with pytest.raises(ValueError, match="must be a .gguf"):
        load_model(path)


def test_error_config_without_weights(tiny_dirs, tmp_path):
    (tmp_path / "config.json").write_text((tiny_dirs["llama"] / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        load_model(tmp_path)


def test_error_unsupported_architecture(tmp_path):
    GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=16, architectures=["GPT2LMHeadModel"]
    ).save_pretrained(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(
        ValueError, match="'GPT2LMHeadModel' is not supported.*LlamaForCausalLM"
    ) as e:
        load_model(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_tiny_cli_writes_loadable_checkpoints(tmp_path, capsys):
    from mini_vllm.model_executor.model_loader.tiny import main

    main([str(tmp_path), "--seed", "7"])
    assert "tiny-llama" in capsys.readouterr().out
    for arch, cls in (("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")):
        model, hf_config, _ = load_model(tmp_path / f"tiny-{arch}")
        assert type(model).__name__ == cls == hf_config.architectures[0]


def test_registry_falls_back_to_model_type(tiny_dirs):
    config = copy.deepcopy(load_model(tiny_dirs["qwen3"]).hf_config)
    config.architectures = None
    assert resolve_model_cls(config).__name__ == "Qwen3ForCausalLM"


def _rewrite(src: Path, dst: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_error_missing_tensor(tiny_dirs, tmp_path):
    folder = _rewrite(
        tiny_dirs["qwen3"],
        tmp_path / "m",
        lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
    )
    with pytest.raises(
        ValueError,
        match=r"missing tensors.*: model\.layers\.1\.self_attn\.k_proj"
        r"\.weight$",
    ) as e:
        load_model(folder)
    assert str(folder) in str(e.value)


def test_error_unexpected_tensor(tiny_dirs, tmp_path):
    folder = _rewrite(
        tiny_dirs["llama"],
        tmp_path / "m",
        lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
    )
    with pytest.raises(ValueError, match="'model.layers.0.mlp.extra.weight' matches no parameter"):
        load_model(folder)


def test_error_wrong_shape(tiny_dirs, tmp_path):
    def shrink(t):
        t["model.norm.weight"] = t["model.norm.weight"][:10]

    folder = _rewrite(tiny_dirs["llama"], tmp_path / "m", shrink)
    with pytest.raises(
        ValueError, match=r"'model.norm.weight' has shape \(10,\), expected \(64,\)"
    ):
        load_model(folder)


def test_error_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported") as e:
        load_model(path)
    assert str(path) in str(e.value)


def test_error_gguf_missing_tensor(tiny_dirs, tmp_path):
    config, tensors = tiny_gguf_tensors(tiny_dirs["llama"], "llama")
    del tensors["blk.2.ffn_up.weight"]
    path = write_gguf(tmp_path / "broken.gguf", "llama", config, tensors)
    with pytest.raises(
        ValueError,
        match=r"missing tensors.*: model\.layers\.2\.mlp\.up_proj"
        r"\.weight$",
    ) as e:
        load_model(path)
    assert str(path) in str(e.value)


def test_error_not_a_gguf(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(path)


def test_error_several_ggufs(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf files"):
        find_checkpoint(tmp_path)


def test_smollm2_path_missing_says_make_setup(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="make setup"):
        smollm2_gguf_path()
