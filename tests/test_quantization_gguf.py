"""GGUF kept quantized in memory (``quantization="gguf"``), against dequantize-at-load.

- ``ggml_dequantize`` equals ``gguf.quants.dequantize`` bit for bit: on
  blocks ``gguf.quants`` quantized, on arbitrary bytes, and on SmolLM2's own
  Q4_1 and Q8_0 tensors;
- a tiny Llama / Qwen3 GGUF (Q4_1, Q8_0, Q4_0, a fused layer mixing types)
  loaded with ``quantization="gguf"`` keeps uint8 bytes in memory and gives
  exactly the logits of the same file dequantized at load;
- SmolLM2 through ``LLM(quantization="gguf")``: the same greedy tokens and
  log-probs as the default path;
- bad combinations are refused before any model is built.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_models import PagedKV, Seq, run_step, tiny_gguf_tensors, write_gguf

from mini_vllm.entrypoints.cli import build_parser, check_args
from mini_vllm.model_executor.layers.quantization import get_quantization_config
from mini_vllm.model_executor.layers.quantization.gguf import ggml_dequantize
from mini_vllm.model_executor.model_loader import load_model, smollm2_gguf_path
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model

FORMATS = [T.Q4_0, T.Q4_1, T.Q8_0]


def bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def dequant_both(packed: np.ndarray, qtype: T, rows: int, cols: int):
    ours = ggml_dequantize(torch.from_numpy(packed.copy()), qtype, rows, cols)
    ref = gguf.quants.dequantize(packed, qtype).reshape(rows, cols)
    return ours.numpy(), ref


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_dequantize_bit_exact_on_quantized_weights(qtype):
    w = np.random.default_rng(0).normal(0, 0.3, size=(48, 256)).astype(np.float32)
    packed = gguf.quants.quantize(w, qtype)
    ours, ref = dequant_both(packed, qtype, 48, 256)
    assert np.array_equal(bits(ours), bits(ref))
    # and it is a quantization of w, not a copy: the format's rounding shows
    assert 0 < np.abs(ours - w).max() < 0.3


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_dequantize_bit_exact_on_any_bytes(qtype):
    """Every byte pattern (scales and minimums as any finite fp16) decodes as gguf's."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, size=(16, 8 * size), dtype=np.uint8)
    blocks = packed.reshape(-1, size)
    fp16_fields = 2 if qtype == T.Q4_1 else 1  # d (and m)
    for f in range(fp16_fields):
        scales = rng.normal(0, 2, size=len(blocks)).astype(np.float16)
        blocks[:, 2 * f : 2 * f + 2] = scales.view(np.uint8).reshape(-1, 2)
    ours, ref = dequant_both(packed, qtype, 16, 8 * block)
    assert np.array_equal(bits(ours), bits(ref))


def test_dequantize_bit_exact_on_smollm2_tensors():
    reader = gguf.GGUFReader(str(smollm2_gguf_path()))
    tensors = {t.name: t for t in reader.tensors}
    for name in ("blk.7.attn_v.weight", "blk.29.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        rows, cols = int(t.shape[1]), int(t.shape[0])
        ours, ref = dequant_both(np.array(t.data), t.tensor_type, rows, cols)
        assert np.array_equal(bits(ours), bits(ref)), name
    assert {tensors[n].tensor_type for n in tensors} == {T.F32, T.Q4_1, T.Q8_0}


def test_dequantize_refuses_wrong_bytes():
    with pytest.raises(ValueError, match=r"qweight must be uint8 \[4, 40\] .* Q4_1"):
        ggml_dequantize(torch.zeros(4, 41, dtype=torch.uint8), T.Q4_1, 4, 64)
    with pytest.raises(NotImplementedError, match="Q6_K"):
        ggml_dequantize(torch.zeros(4, 210, dtype=torch.uint8), T.Q6_K, 4, 256)


# --------------------------------------------------------------------------
# A tiny quantized GGUF: in memory against dequantized at load.
# --------------------------------------------------------------------------

# Per tensor kind: a mix, with a fused layer (q/k/v) whose shards differ.
TYPES = {
    "token_embd": T.Q8_0,
    "output": T.Q8_0,
    "attn_q": T.Q4_1,
    "attn_k": T.Q8_0,
    "attn_v": T.Q4_0,
    "attn_output": T.Q4_1,
    "ffn_gate": T.Q4_1,
    "ffn_up": T.Q4_1,
    "ffn_down": T.Q8_0,
}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_quant_gguf(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"quant-{arch}")
    folder = make_tiny_model(root / "hf", arch, seed=0)
    config, tensors = tiny_gguf_tensors(folder, arch)
    types = {}
    for name in tensors:
        kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        if kind in TYPES:
            types[name] = TYPES[kind]
    return arch, write_gguf(root / f"tiny-{arch}.gguf", arch, config, tensors, types)


def test_tiny_gguf_in_memory_equals_dequantized_at_load(tiny_quant_gguf):
    arch, path = tiny_quant_gguf
    quant = load_model(path, quantization="gguf").model
    dequant = load_model(path).model
    # The same matmuls: the GGUF layers dequantize and call F.linear, while the loader
    # packs float weights for oneDNN on a CPU (layers/utils.py), which rounds differently.
    for module in dequant.modules():
        if "cpu_linear" in module.__dict__:
            module.cpu_linear = torch.nn.functional.linear
    # In memory: bytes, not floats, for every quantized layer.
    qkv = quant.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.uint8 and not hasattr(qkv, "weight")
    assert [T(int(t)) for t in qkv.qweight_type] == [T.Q4_1, T.Q8_0, T.Q4_0]
    assert quant.model.embed_tokens.qweight.dtype == torch.uint8
    floats = {n for n, p in quant.named_parameters() if p.is_floating_point()}
    assert all("norm" in n for n in floats), floats
    # Same math: the same logits, bit for bit, prefill then decode.
    prompt = list(range(3, 40))
    sq, sd = Seq(PagedKV(quant)), Seq(PagedKV(dequant))
    (a,) = run_step(quant, [(sq, prompt)])
    (b,) = run_step(dequant, [(sd, prompt)])
    assert torch.equal(a, b)
    nxt = [int(a[-1].argmax())]
    (a,) = run_step(quant, [(sq, nxt)])
    (b,) = run_step(dequant, [(sd, nxt)])
    assert torch.equal(a, b)


def test_in_memory_weights_are_smaller(tiny_quant_gguf):
    _, path = tiny_quant_gguf
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    quant, dequant = load_model(path, quantization="gguf").model, load_model(path).model
    # Q4_1 is 20 bytes and Q8_0 34 bytes per 32 weights, float32 128: under 1/3.
    assert size(quant) < size(dequant) / 3


# --------------------------------------------------------------------------
# Refusals, before any model is built.
# --------------------------------------------------------------------------


def test_unknown_quantization_refused(tmp_path, monkeypatch):
    from mini_vllm.entrypoints.llm import LLM

    built = []
    monkeypatch.setattr(
        "mini_vllm.model_executor.model_loader.initialize_model",
        lambda *a, **k: built.append(a),
    )
    with pytest.raises(ValueError, match=r"^Unknown quantization method: awq\. Must be one of"):
        LLM(str(smollm2_gguf_path()), quantization="awq")
    folder = make_tiny_model(tmp_path / "hf", "llama")
    with pytest.raises(ValueError, match="quantization='gguf' .* must be a .gguf file"):
        LLM(str(folder), quantization="gguf")
    with pytest.raises(ValueError, match="quantization='gguf'"):
        load_model(folder, quantization="gguf")
    assert built == []
    with pytest.raises(ValueError, match="Unknown quantization method"):
        get_quantization_config("int4")


def test_k_quant_refused_before_the_model_is_built(tmp_path, monkeypatch):
    import mini_vllm.model_executor.model_loader as loader

    folder = make_tiny_model(tmp_path / "hf", "llama")
    config, tensors = tiny_gguf_tensors(folder, "llama")
    name = "blk.1.ffn_down.weight"
    rows, cols = tensors[name].shape
    block, size = gguf.GGML_QUANT_SIZES[T.Q6_K]
    cols = block  # Q6_K blocks hold 256 weights: a wider zero tensor would not fit the model
    tensors[name] = (np.zeros((rows, cols // block * size), dtype=np.uint8), T.Q6_K)
    path = write_gguf(tmp_path / "k.gguf", "llama", config, tensors)
    built = []
    real_init = loader.initialize_model
    monkeypatch.setattr(
        loader, "initialize_model", lambda *a, **k: built.append(a) or real_init(*a, **k)
    )
    with pytest.raises(ValueError, match=r"tensor blk\.1\.ffn_down\.weight is Q6_K"):
        load_model(path, quantization="gguf")
    assert built == []


def test_cli_refuses_unknown_quantization():
    args = build_parser().parse_args(["--prompt", "hi", "--quantization", "nf4"])
    with pytest.raises(ValueError, match="Unknown quantization method: nf4"):
        check_args(args)
    args = build_parser().parse_args(["--prompt", "hi", "-q", "gguf"])
    assert check_args(args) is not None and args.quantization == "gguf"


# --------------------------------------------------------------------------
# SmolLM2 (210 Q4_1 tensors, one Q8_0): the real file, through the engine.
# --------------------------------------------------------------------------


@pytest.mark.deep  # ~55 s on a busy 2-core machine: two SmolLM2 loads and an LLM
def test_smollm2_in_memory_same_logits_and_greedy_tokens_as_transformers(smollm2_hf, counts):
    from hf_reference import hf_greedy

    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.sampling_params import SamplingParams

    path, hf = smollm2_hf
    quant = load_model(path, quantization="gguf", load_tokenizer=False).model
    dequant = load_model(path, load_tokenizer=False).model
    # "The capital of France is Paris. The capital of Germany is"
    prompt = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4521, 314]
    (a,) = run_step(quant, [(Seq(PagedKV(quant)), prompt)])
    (b,) = run_step(dequant, [(Seq(PagedKV(dequant)), prompt)])
    assert torch.equal(a, b), "quantized in memory and dequantized at load must be the same math"
    del quant, dequant

    llm = LLM(str(path), quantization="gguf", num_gpu_blocks_override=64, max_model_len=256)
    weights = llm.llm_engine.model.model.layers[0].mlp.down_proj
    assert weights.qweight.dtype == torch.uint8
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 6)
