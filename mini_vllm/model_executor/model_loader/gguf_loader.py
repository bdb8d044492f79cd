"""Loading a GGUF file (llama.cpp's format): metadata -> HF config, tensors -> HF names.

Mirrors upstream ``vllm/model_executor/model_loader/gguf_loader.py`` at
v0.22.1 (``GGUFModelLoader`` at :38, its name table built in
``GGUFModelLoader._get_gguf_weights_map`` at :108) and the iterator
``gguf_quant_weights_iterator`` (weight_utils.py:1281). Left out: hub
downloads, sharded and multimodal GGUFs, every architecture but Llama and
Qwen3.

Two ways to read the tensors:

- ``gguf_weights_iterator`` (mini_vllm's default): every tensor
  dequantized to float32 with the ``gguf`` package, so the model is an
  ordinary float model (any GGUF type, k-quants included);
- ``gguf_quant_weights_iterator`` (``quantization="gguf"``, upstream's only
  way, engine/arg_utils.py:1549 forces it for a GGUF model): quantized
  tensors stay bytes, named ``...qweight`` with their type as
  ``...qweight_type``, for layers/quantization/gguf.py to dequantize at
  run time; float tensors (norms) come as ``...weight``.

Two more differences from upstream:

- the Hugging Face config is built here from the GGUF metadata (upstream
  asks transformers to parse it); the tokenizer is still transformers' GGUF
  tokenizer, ``AutoTokenizer.from_pretrained(folder, gguf_file=name)``;
- llama.cpp's converter permutes the rows of every Llama ``q_proj`` and
  ``k_proj`` head so that GPT-J (interleaved) RoPE reproduces the model;
  upstream keeps those rows and switches RoPE style, mini_vllm undoes the
  permutation (``unpermute_qk``) and keeps neox RoPE. Qwen3 GGUFs are not
  permuted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from transformers import LlamaConfig, PretrainedConfig, Qwen3Config

# GGUF ``general.architecture`` -> (HF architecture, config class, q/k permuted?)
GGUF_ARCHITECTURES: dict[str, tuple[str, type[PretrainedConfig], bool]] = {
    "llama": ("LlamaForCausalLM", LlamaConfig, True),
    "qwen3": ("Qwen3ForCausalLM", Qwen3Config, False),
}

# Tensor names: ``token_embd.weight`` and ``blk.N.attn_q.weight``, ``.bias`` alike.
GGUF_TO_HF_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
GGUF_TO_HF_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_REQUIRED = object()


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Memory-map the file and parse its header; ValueError if it is not a GGUF."""
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises assorted errors on a bad file
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def gguf_field(
    reader: gguf.GGUFReader, key: str, default: Any = _REQUIRED, *, path: Path | None = None
) -> Any:
    """A metadata value (int, float, str or list); a missing required key raises ValueError."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"{path}: GGUF metadata has no {key!r}")
        return default
    return field.contents()


def gguf_architecture(reader: gguf.GGUFReader, path: Path) -> str:
    arch = gguf_field(reader, "general.architecture", None, path=path)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported by mini_vllm; "
            f"supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    return arch


def gguf_to_hf_config(reader: gguf.GGUFReader, path: Path) -> PretrainedConfig:
    """The Hugging Face config (LlamaConfig / Qwen3Config) the GGUF metadata describes."""
    arch = gguf_architecture(reader, path)
    hf_arch, config_cls, _ = GGUF_ARCHITECTURES[arch]

    def meta(key: str, default: Any = _REQUIRED) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default, path=path)

    tensor_shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    scaling = meta("rope.scaling.type", None)
    if scaling not in (None, "none") or "rope_freqs.weight" in tensor_shapes:
        raise ValueError(f"{path}: scaled RoPE ({scaling or 'rope_freqs'}) is not supported")
    num_heads = meta("attention.head_count")
    num_kv_heads = meta("attention.head_count_kv", num_heads)
    if isinstance(num_heads, list) or isinstance(num_kv_heads, list):
        raise ValueError(f"{path}: per-layer head counts are not supported")
    hidden_size = meta("embedding_length")
    head_dim = meta("attention.key_length", None) or hidden_size // num_heads
    rope_dim = meta("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(
            f"{path}: partial RoPE (rope.dimension_count {rope_dim} != head_dim "
            f"{head_dim}) is not supported"
        )
    if "token_embd.weight" not in tensor_shapes:
        raise ValueError(f"{path}: GGUF has no token_embd.weight tensor")
    vocab_size = meta("vocab_size", None) or tensor_shapes["token_embd.weight"][0]
    default_theta = 1e6 if arch == "qwen3" else 1e4

    token_ids = {}
    for name in ("bos", "eos", "padding", "unknown"):
        value = gguf_field(reader, f"tokenizer.ggml.{name}_token_id", None)
        if value is not None:
            token_ids[{"padding": "pad", "unknown": "unk"}.get(name, name) + "_token_id"] = value
    return config_cls(
        architectures=[hf_arch],
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=meta("context_length"),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(meta("rope.freq_base", default_theta)),
        },
        tie_word_embeddings="output.weight" not in tensor_shapes,
        **token_ids,
    )


def has_tokenizer(reader: gguf.GGUFReader) -> bool:
    """Whether the file embeds a tokenizer (llama.cpp writes one into every converted model)."""
    return "tokenizer.ggml.model" in reader.fields


def gguf_to_hf_name(name: str, path: Path | None = None) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.

    Raises ValueError for a name it does not know."""
    base, _, kind = name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 1 and base in GGUF_TO_HF_GLOBAL:
        return f"{GGUF_TO_HF_GLOBAL[base]}.{kind}"
    if (
        len(parts) == 3
        and parts[0] == "blk"
        and parts[1].isdigit()
        and parts[2] in GGUF_TO_HF_BLOCK
    ):
        return f"model.layers.{parts[1]}.{GGUF_TO_HF_BLOCK[parts[2]]}.{kind}"
    raise ValueError(f"{path}: GGUF tensor {name!r} has no counterpart in mini_vllm's models")


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (weights [rows, cols] or biases [rows]).

    Within each head, llama.cpp stores the rows of the first and second half
    interleaved (row 2i from half one, row 2i+1 from half two); this puts the
    halves back, the layout neox RoPE expects.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """A GGUF tensor (any quantization) as a float32 torch tensor in torch's [rows, cols] order."""
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    array = np.asarray(array, dtype=np.float32).reshape([int(n) for n in reversed(tensor.shape)])
    if not array.flags.writeable:  # unquantized tensors come back as views of the mapped file
        array = array.copy()
    return torch.from_numpy(array)


def gguf_unquantized_modules(reader: gguf.GGUFReader, path: Path) -> list[str]:
    """The HF module names whose GGUF tensors are plain floats (upstream's
    ``unquant_names`` in ``GGUFModelLoader.load_weights``)."""
    return [
        gguf_to_hf_name(t.name, path).rsplit(".", 1)[0]
        for t in reader.tensors
        if t.tensor_type.name in ("F32", "F16", "BF16")
    ]


def gguf_quant_weights_iterator(
    reader: gguf.GGUFReader, hf_config: PretrainedConfig, path: Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor): first every quantized tensor's ``...qweight_type`` (a
    scalar), then ``...qweight`` (uint8 [rows, bytes a row]) for quantized
    tensors and float32 ``...weight`` for the rest, q/k rows un-permuted."""
    quantized = [t for t in reader.tensors if t.tensor_type.name not in ("F32", "F16", "BF16")]
    for tensor in quantized:
        name = gguf_to_hf_name(tensor.name, path).replace("weight", "qweight_type")
        yield name, torch.tensor(int(tensor.tensor_type), dtype=torch.uint8)
    permuted = GGUF_ARCHITECTURES[gguf_architecture(reader, path)][2]
    for tensor in reader.tensors:
        name = gguf_to_hf_name(tensor.name, path)
        if tensor in quantized:
            name = name.replace("weight", "qweight")
            weight = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
        else:
            weight = dequantize(tensor)
        if permuted and ".self_attn.q_proj." in name:
            weight = unpermute_qk(weight, hf_config.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in name:
            weight = unpermute_qk(weight, hf_config.num_key_value_heads)
        yield name, weight


def gguf_weights_iterator(
    reader: gguf.GGUFReader, hf_config: PretrainedConfig, path: Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor in the file, q/k un-permuted where needed."""
    arch = gguf_architecture(reader, path)
    permuted = GGUF_ARCHITECTURES[arch][2]
    for tensor in reader.tensors:
        name = gguf_to_hf_name(tensor.name, path)
        weight = dequantize(tensor)
        if permuted and ".self_attn.q_proj." in name:
            weight = unpermute_qk(weight, hf_config.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in name:
            weight = unpermute_qk(weight, hf_config.num_key_value_heads)
        yield name, weight


def verify_gguf_quant_types(reader: gguf.GGUFReader, path: Path) -> None:
    """Before building the model: every quantized tensor must be of a type that
    ``quantization="gguf"`` dequantizes at run time; ValueError naming the first other."""
    from mini_vllm.model_executor.layers.quantization.gguf import DEQUANT_TYPES

    for tensor in reader.tensors:
        kind = tensor.tensor_type
        if kind.name not in ("F32", "F16", "BF16") and kind not in DEQUANT_TYPES:
            supported = ", ".join(sorted(t.name for t in DEQUANT_TYPES))
            raise ValueError(
                f"{path}: tensor {tensor.name} is {kind.name}, which quantization='gguf' "
                f"cannot keep in memory (mini_vllm dequantizes {supported} at run time); "
                "load without quantization to dequantize it at load"
            )
